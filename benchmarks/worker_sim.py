"""The worker policy on simulated hosts of 2 to 224 CPUs.

The simulation of the unit tests (tests/worker_sim.py: a fake clock, seeded noise of 0 to
15% on every worker's speed), run over every budget and noise level and summed up as the
worst case of each figure:

- a CPU-bound pipeline: its rate 3 s after the start over the best fixed count's, its
  worst 5-second window over 10 minutes, and its rate 3 s after its records got 4x
  costlier (goals: at least 0.9 each);
- records that wait 2 ms (20 µs of CPU): the same figures, "auto"'s bound of workers;
- a trainer that takes half of what the host could give: the most workers over the fewest
  that meet it (goal: at most 1) and the most input wait (goal: under 1%).

A simulation measures the policy, not the machine: its figures are the same on every
machine, and no figure here is a rate of this one.

Run: `.venv/bin/python benchmarks/worker_sim.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from worker_sim import DT, Host, Run, meeting, simulate  # noqa: E402 - the tests' simulation, found above

from colo_data.runtime.budget import CpuBudget  # noqa: E402
from colo_data.workers.settings import auto_most  # noqa: E402

BUDGETS = (2, 8, 32, 64, 128, 224)
NOISES = (0.0, 0.05, 0.10, 0.15)
WINDOW_S = 5.0


def most(budget: float) -> int:
    """The bound of "auto" for `budget` CPUs, on a host with memory to spare."""
    return auto_most(CpuBudget(budget, 0, "simulated", int(budget), None), memory=2**40)


def rates(host: Host, run: Run, seconds: float) -> tuple[float, float, float]:
    """The rate 3 s after the start and 3 s after the host's step, and the worst window
    between, each over the best fixed count's rate at the time."""
    step = min(host.steps)
    reached, after = (run.rate(t + 2.5, t + 3.0) / host.at(t).best()[1] for t in (0.0, step))
    starts = [a for t0, t1 in ((3.0, step), (step + 3.0, seconds)) for a in np.arange(t0, t1 - WINDOW_S + 1e-9, WINDOW_S)]
    worst = min(run.rate(a, a + WINDOW_S) / host.at(a).best()[1] for a in starts)
    return reached, worst, after


def main() -> None:
    """Run every budget and noise level, and write the table and the worst cases."""
    args = harness.parse(harness.parser(__doc__, rounds=1))
    lines = [
        "Simulated hosts (tests/worker_sim.py): budgets of " + ", ".join(map(str, BUDGETS)) + " CPUs, noise "
        + ", ".join(f"{n:.0%}" for n in NOISES) + " a worker a step; figures over the best fixed count's rate.",
        "",
        "| pipeline | CPUs | noise | rate at 3 s | worst 5-s window | 3 s after a 4x costlier record | workers at the end |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    worst = {"cpu": [1.0, 1.0, 1.0], "wait": [1.0, 1.0, 1.0]}
    extra, waited = 0, 0.0
    for budget in BUDGETS:
        for noise in NOISES:
            cases = {
                "cpu": (Host(budget, most(budget), noise=noise, steps={300.0: {"cpu": 4e-3}}), 600.0),
                "wait": (Host(budget, most(budget), cpu=2e-5, wait=2e-3, noise=noise, steps={30.0: {"wait": 8e-3}}), 60.0),
            }
            for kind, (host, seconds) in cases.items():
                run = simulate(host, seconds, seed=budget)
                figures = rates(host, run, seconds)
                worst[kind] = [min(a, b) for a, b in zip(worst[kind], figures, strict=True)]
                cells = " | ".join(f"{f:.3f}" for f in figures)
                lines.append(f"| {kind} | {budget} | {noise:.0%} | {cells} | {run.count[-1]} |")
            _, best = Host(budget, most(budget), noise=noise).best()
            half = Host(budget, most(budget), noise=noise, demand=0.5 * best)
            run = simulate(half, 120.0, seed=budget)
            extra = max(extra, max(run.count[int(20.0 / DT) :]) - meeting(half))
            waited = max(waited, run.waited_share())
    names = ("rate at 3 s", "worst 5-s window over 10 min", "3 s after a 4x costlier record")
    least = "the least of every budget and noise / the best fixed count"
    ratios = [
        harness.Ratio(f"{kind}: {name}, {least}", worst[kind][i], harness.Goal.of(">= 0.9"))
        for kind in worst
        for i, name in enumerate(names)
    ]
    name = "half demand: the most workers beyond the fewest that meet it"
    ratios.append(harness.Ratio(name, extra, harness.Goal.of("<= 1"), unit=" workers"))
    ratios.append(harness.Ratio("half demand: the most input wait", 100 * waited, harness.Goal.of("< 1"), unit="%"))
    lines += ["", *harness.ratio_table(ratios)]
    best = "the best fixed count"
    headlines = harness.headlines(
        ratios,
        (
            ("cpu: rate at 3 s", "simulated hosts of 2 to 224 CPUs, CPU-bound: rate 3 s after the start, worst case", best),
            ("cpu: worst 5-s", "simulated hosts, CPU-bound: the worst 5-s window of 10 minutes", best),
            ("cpu: 3 s after", "simulated hosts, CPU-bound: 3 s after records got 4x costlier", best),
            ("wait: rate at 3 s", "simulated hosts, records that wait 2 ms: rate 3 s after the start", best),
            ("half demand: the most workers", "simulated hosts, a trainer that takes half: workers past the fewest it needs", ""),
            ("half demand: the most input wait", "simulated hosts, a trainer that takes half: its input wait", ""),
        ),
    )
    harness.write_results("worker_sim", args, lines, {}, ratios, headlines=headlines)


if __name__ == "__main__":
    main()
