"""The one harness of every benchmark here: the options they share, the timing of one run,
the machine's own speed, interleaved rounds, ratios and their goals, and the results files,
headline figures included (`benchmarks/table.py` makes the performance page's table of
them). One copy, so that every benchmark times, compares and reports the same way (SPDL's
`benchmark_utils.py` plays this part for SPDL's benchmarks).
"""

from __future__ import annotations

import argparse
import compileall
import itertools
import json
import operator
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import psutil
from absl import flags

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
HEADLINES = HERE / "headlines"  # committed: the performance page's table is made from them
QUICK_BATCHES = 5  # --quick: the batches a run reads where a benchmark can cut it short
SAMPLE_EVERY = 50  # batches between two samples of a CpuClock that samples
LOOP = 200_000  # iterations of the fixed loop that each CPU times between two runs (10 to 50 ms here)
WHOLE = "records_per_s"  # whole run, start-up included
AFTER_FIRST = "after_first_per_s"  # after the first batch: start-up left out

Measurement = dict[str, Any]  # one run's figures (measure's keys where it is a run of batches)
Runs = dict[str, list[Measurement]]  # contender -> its measurement in each round
Comparison = Literal[">=", ">", "<=", "<"]
_COMPARE: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


# ---------------------------------------------------------------------------------------------
# Options


def parser(doc: str, rounds: int = 3) -> argparse.ArgumentParser:
    """The options every benchmark takes (`--rounds N`, `--quick`, `--out DIR`), described by
    `doc`'s first line; a benchmark adds its own before `parse`."""
    options = argparse.ArgumentParser(description=doc.splitlines()[0])
    options.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    options.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run of the machinery: 1 round, runs cut short (at most {QUICK_BATCHES} batches where a run can be)",
    )
    options.add_argument("--out", type=Path, default=RESULTS, help="the folder for <name>.md and <name>.json")
    options.add_argument(
        "--headlines",
        type=Path,
        default=None,
        help=f"the folder for <name>.json, the headline figures (default {HEADLINES.relative_to(HERE.parent)}; "
        "a --quick run writes none unless given one)",
    )
    return options


def parse(options: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed options, with `--quick` applied (`rounds` 1; `batches`, the most a run reads:
    `QUICK_BATCHES`, else None; no headlines written unless a folder is given: a smoke run's
    figures measure nothing) and the start noted (`started`); absl's flags are marked parsed,
    as Grain's worker processes need."""
    args = options.parse_args()
    if args.quick:
        args.rounds = 1
    elif args.headlines is None:
        args.headlines = HEADLINES
    args.batches = QUICK_BATCHES if args.quick else None
    args.started = time.perf_counter()
    flags.FLAGS.mark_as_parsed()
    compiled(HERE.parent)
    return args


def compiled(tree: Path) -> None:
    """Write the bytecode of `tree`'s colo-data and benchmarks, as an installed copy has it
    (pip and uv compile a wheel's modules). Where nothing may write bytecode caches
    (`PYTHONDONTWRITEBYTECODE`, set on this machine and on CI), each process of a run,
    worker processes and their fork server included, would compile colo-data's modules from
    source again: about 0.05 s at every start (a CPU-bound pipeline's first worker came that
    much later), which a user's install never pays. Modules already compiled are skipped."""
    for folder in (tree / "colo_data", tree / "benchmarks"):
        compileall.compile_dir(folder, quiet=1)


# ---------------------------------------------------------------------------------------------
# Timing one run


class CpuClock(Protocol):
    """CPU seconds used since the clock was made, by the processes it watches; `sample` is
    called every `SAMPLE_EVERY` batches and at the end of a run."""

    def sample(self) -> None: ...

    def used(self) -> float: ...


class ProcessTreeCpu:
    """This process's CPU time, its reaped children's, and that of its live descendants,
    read at the start and at the end of a run (nothing sampled in between)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.start = self._now()

    def _now(self) -> float:
        times = self.me.cpu_times()
        children = 0.0
        for child in self.me.children(recursive=True):
            try:
                t = child.cpu_times()
                children += t.user + t.system
            except psutil.Error:  # ended between the listing and the reading
                pass
        return times.user + times.system + times.children_user + times.children_system + children

    def sample(self) -> None:
        pass

    def used(self) -> float:
        return self._now() - self.start


def measure(run: Callable[[], Iterator[int]], batches: int | None = None, cpu: CpuClock | None = None) -> Measurement:
    """Time one run: `run()` yields the records of each batch. Records/s over the whole run
    and after its first batch (start-up apart), the first batch's time and CPU seconds per
    1k records (`cpu`, by default this process and its children). With `batches`, only the
    first `batches` are read; a run cut short is closed after its timing."""
    clock = cpu if cpu is not None else ProcessTreeCpu()
    t0 = time.perf_counter()
    counts = run()
    records, first, first_s = 0, 0, 0.0
    for count, n in enumerate(itertools.islice(counts, batches), 1):
        if not records:
            first, first_s = n, time.perf_counter() - t0
        records += n
        if count % SAMPLE_EVERY == 0:
            clock.sample()
    wall = time.perf_counter() - t0
    clock.sample()
    used = clock.used()
    if isinstance(counts, Generator):
        counts.close()
    return {
        "records": records,
        "seconds": wall,
        "first_batch_s": first_s,
        WHOLE: records / wall,
        AFTER_FIRST: (records - first) / (wall - first_s),
        "cpu_s_per_1k": 1000 * used / records,
    }


# ---------------------------------------------------------------------------------------------
# The machine's own speed


class MachineSpeed:
    """How long a fixed loop of Python takes on each CPU of this process's affinity mask,
    timed between two runs (nothing of the benchmark runs then). On a shared virtual machine a
    CPU's speed changes from one second to the next, unseen by the guest (no steal time): here
    the same loop took 1.75x as long in some seconds as in others. Interleaved rounds spread
    that over the contenders, but a ratio whose goal's margin is smaller than the spread can
    read either side of it; the results say how wide it was during the run."""

    def __init__(self) -> None:
        self.timings: list[tuple[int, float]] = []  # (CPU, milliseconds of CPU time)

    def sample(self) -> None:
        """Time the loop once on each CPU (the calling thread moved there and back)."""
        mask = os.sched_getaffinity(0)
        try:
            for cpu in sorted(mask):
                os.sched_setaffinity(0, {cpu})
                start, total = time.thread_time(), 0
                for i in range(LOOP):
                    total += i * i
                self.timings.append((cpu, 1000 * (time.thread_time() - start)))
        finally:
            os.sched_setaffinity(0, mask)

    def spread(self) -> float | None:
        """How many times slower the CPUs ran at some times than at others (the 90th over the
        10th percentile of the timings); None before 10 of them."""
        if len(self.timings) < 10:
            return None
        deciles = statistics.quantiles([t for _, t in self.timings], n=10)
        return deciles[-1] / deciles[0]

    def line(self) -> str:
        """The spread of the timings, for the results; empty before any."""
        if len(self.timings) < 10:
            return ""
        ms = [t for _, t in self.timings]
        deciles = statistics.quantiles(ms, n=10)
        low, high = deciles[0], deciles[-1]
        cpus = sorted({cpu for cpu, _ in self.timings})
        return (
            f"The machine's own speed: a fixed loop of Python took {low:.0f} to {high:.0f} ms on one CPU (the 10th "
            f"and 90th percentiles of {len(ms)} timings between runs, CPUs {', '.join(map(str, cpus))}; median "
            f"{statistics.median(ms):.0f} ms): the CPUs ran {high / low:.2f}x slower at some times than at others."
        )


MACHINE = MachineSpeed()  # sampled before every run of `interleave`, reported by `write_results`


# ---------------------------------------------------------------------------------------------
# Interleaved rounds


def rates(m: Measurement) -> str:
    """One line of a run's records/s, for the progress lines."""
    return f"{m[WHOLE]:,.0f} records/s, {m[AFTER_FIRST]:,.0f} after the first batch ({m['first_batch_s']:.2f} s to it)"


def interleave(
    contenders: Mapping[str, Callable[[], Measurement]],
    rounds: int,
    show: Callable[[Measurement], str] = rates,
    retried: list[str] | None = None,
) -> Runs:
    """Run every contender once per round, in the same order each round (A, B, C, A, B, C, ...),
    so that a noisy neighbour hits every contender alike, printing a line per run; the
    machine's own speed is timed before each (`MACHINE`). With `retried`, a run that raises
    RuntimeError is noted there and run once more."""
    runs: Runs = {name: [] for name in contenders}
    for r in range(rounds):
        for name, contender in contenders.items():
            tag = f"round {r + 1}/{rounds}  {name}"
            MACHINE.sample()
            try:
                m = contender()
            except RuntimeError as e:
                if retried is None:
                    raise
                retried.append(f"{tag}: {e}")
                print(f"{tag} failed, retrying once:\n{e}", flush=True)
                m = contender()
            runs[name].append(m)
            print(f"{tag}: {show(m)}", flush=True)
    return runs


def values(runs: Sequence[Measurement], key: str) -> list[float]:
    """`key` of every round."""
    return [float(m[key]) for m in runs]


def median(runs: Sequence[Measurement], key: str) -> float:
    """The median of `key` over the rounds."""
    return statistics.median(values(runs, key))


def span(xs: Sequence[float], fmt: str) -> str:
    """'min..max' of `xs`, each formatted with `fmt`."""
    return f"{min(xs):{fmt}}..{max(xs):{fmt}}"


# ---------------------------------------------------------------------------------------------
# Ratios and goals


@dataclass(frozen=True)
class Goal:
    """What a figure must be: a comparison and a threshold, written `Goal.of(">= 0.9")`."""

    op: Comparison
    threshold: float

    def __post_init__(self) -> None:
        if self.op not in _COMPARE:
            raise ValueError(f"goal comparison {self.op!r}: use one of {', '.join(_COMPARE)}")

    @classmethod
    def of(cls, text: str) -> Goal:
        """The goal written as `"<op> <threshold>"`, e.g. `"> 1"`, `"<= 1.5"`."""
        op, threshold = text.split()
        return cls(op, float(threshold))  # type: ignore[arg-type]  # checked in __post_init__

    def met(self, value: float) -> bool:
        """Whether `value` meets the goal."""
        return _COMPARE[self.op](value, self.threshold)


@dataclass(frozen=True)
class Ratio:
    """A measured ratio (or, with `unit` " s", a time), the goal it must meet if it has one,
    and every round's value where it was taken within each round (`value` is then their
    median)."""

    name: str
    value: float
    goal: Goal | None = None
    rounds: tuple[float, ...] = ()
    unit: str = "x"

    @property
    def met(self) -> bool | None:
        """Whether `value` meets the goal; None without one."""
        return None if self.goal is None else self.goal.met(self.value)

    def verdict(self) -> str:
        """'met (>= 0.9x)' or '**NOT met** (>= 0.9x)', with how many rounds met it where known;
        'no goal' without one. The one format of every benchmark's goals."""
        if self.goal is None:
            return "no goal"
        per_round = f"; {sum(map(self.goal.met, self.rounds))}/{len(self.rounds)} rounds" if self.rounds else ""
        said = "met" if self.met else "**NOT met**"
        return f"{said} ({self.goal.op} {self.goal.threshold:g}{self.unit}{per_round})"


@dataclass(frozen=True)
class Headline:
    """One figure of a benchmark for the performance page's table: what was measured, its
    value and unit ("x" for a ratio), what it was compared with (`peer`; empty for a rate on
    its own) and its goal's verdict (empty without a goal)."""

    what: str
    value: float
    unit: str
    peer: str = ""
    goal: str = ""

    @classmethod
    def of(cls, ratio: Ratio, what: str, peer: str) -> Headline:
        """`ratio` in a reader's words: `what` against `peer`."""
        return cls(what, ratio.value, ratio.unit.strip(), peer, "" if ratio.goal is None else ratio.verdict())


def headlines(ratios: Sequence[Ratio], picked: Sequence[tuple[str, str, str]]) -> list[Headline]:
    """The headlines `picked` as (the start of a ratio's name, what, peer), from the first
    ratio whose name starts so (some names end with what the run found, e.g. a host's number);
    none for a ratio of a part that did not run."""
    found = ((next((r for r in ratios if r.name.startswith(start)), None), what, peer) for start, what, peer in picked)
    return [Headline.of(ratio, what, peer) for ratio, what, peer in found if ratio is not None]


Side = Sequence[Measurement]  # one contender's rounds


def ratio_of_medians(name: str, a: Side, b: Side, key: str, goal: str | None = None) -> Ratio:
    """`a`'s median `key` over `b`'s."""
    return Ratio(name, median(a, key) / median(b, key), Goal.of(goal) if goal else None)


def ratio_within_rounds(name: str, a: Side, b: Side, key: str, goal: str | None = None) -> Ratio:
    """The median of `a`'s `key` over `b`'s taken round by round (both sides measured minutes
    apart at most), with every round's value."""
    xs = [x / y for x, y in zip(values(a, key), values(b, key), strict=True)]
    return Ratio(name, statistics.median(xs), Goal.of(goal) if goal else None, tuple(xs))


def ratio_table(ratios: Sequence[Ratio]) -> list[str]:
    """The Markdown table of `ratios` and their goals (every round's range where known)."""
    spans = any(r.rounds for r in ratios)
    lines = ["| ratio | value | all rounds | goal |" if spans else "| ratio | value | goal |"]
    lines.append("| --- | ---: | ---: | --- |" if spans else "| --- | ---: | --- |")
    for r in ratios:
        each = f" {span(r.rounds, '.2f') if r.rounds else ''} |" if spans else ""
        lines.append(f"| {r.name} | {r.value:.2f}{r.unit} |{each} {r.verdict()} |")
    return lines


# ---------------------------------------------------------------------------------------------
# Results


def elapsed(args: argparse.Namespace) -> float:
    """Seconds since the options were parsed."""
    return time.perf_counter() - args.started


def write_results(
    name: str,
    args: argparse.Namespace,
    lines: Sequence[str],
    runs: Runs,
    ratios: Sequence[Ratio],
    retried: Sequence[str] = (),
    details: Mapping[str, Any] | None = None,
    headlines: Sequence[Headline] = (),
) -> None:
    """Print the tables (`lines`, Markdown) and write them to `<out>/<name>.md`, and the figures
    to `<out>/<name>.json`, whose keys are the same for every benchmark: when and where it ran,
    the rounds, the runs, the ratios with their goals, the runs retried and the benchmark's own
    `details`; the `headlines`, if any, to `<headlines>/<name>.json` (`write_headlines`)."""
    lines = list(lines)
    if args.quick:
        lines += ["", "A --quick run: a smoke run of the machinery; its figures and verdicts measure nothing."]
    if retried:
        lines += ["", f"Failed and retried once: {len(retried)} run(s); see {name}.json `retried`."]
    if machine := MACHINE.line():
        lines += ["", machine]
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    result = {
        "benchmark": name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": psutil.cpu_count(),
        "rounds": args.rounds,
        "quick": args.quick,
        "wall_s": elapsed(args),
        "runs": runs,
        "ratios": [{**asdict(r), "met": r.met} for r in ratios],
        "retried": list(retried),
        "machine_loop_ms": MACHINE.timings,
        "details": dict(details or {}),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(table + "\n")
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / f'{name}.md'} and {args.out / f'{name}.json'}")
    if headlines and args.headlines is not None:
        print(f"wrote {write_headlines(name, args, headlines)}")


def command() -> str:
    """The command line of this run, as `make benchmarks` writes it (from the repository's root)."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(HERE.parent) if script.is_relative_to(HERE.parent) else script
    return shlex.join([".venv/bin/python", str(shown), *sys.argv[1:]])


def commit() -> str:
    """The checkout's commit, `-dirty` where files differ from it (`git describe`); 'unknown' outside git."""
    described = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True, check=False
    )
    return described.stdout.strip() or "unknown"


def write_headlines(name: str, args: argparse.Namespace, headlines: Sequence[Headline]) -> Path:
    """Write `<headlines>/<name>.json` whole: the run's headline figures, with the command that
    measured them, when, at which commit, on how many CPUs, in how many rounds and seconds, and
    how far the CPUs' speed moved meanwhile; `benchmarks/table.py` renders them."""
    record = {
        "benchmark": name,
        "command": command(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "cpus": psutil.cpu_count(),
        "rounds": args.rounds,
        "wall_s": round(elapsed(args)),
        "machine_spread": MACHINE.spread(),
        "headlines": [asdict(h) for h in headlines],
    }
    args.headlines.mkdir(parents=True, exist_ok=True)
    path = args.headlines / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path
