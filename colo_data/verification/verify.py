"""`verify`: the acceptance run before a large job. A short run of a pipeline through the
real `Loader`, once per host count, checks the promises a trainer relies on: every host
count yields the same global batches, each record appears exactly once (through the
pipeline's index column), in the order the seed defines, and a state saved at one step and
restored with another host count continues identically. A record is a (component, index)
pair, as the pipeline's stream names it (one component for a single source): each comes
once per epoch of its component, and for a `cd.Mix` every prefix also keeps each
component within one record of its share. A partitioned packed or filtered pipeline has
no one stream order: each partition's rows are checked against its own stream. Each result
is a `Check` whose detail names the first offending batch, row and record."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colo_data.backends.options import InProcess
from colo_data.errors import ConfigError
from colo_data.host.host_pipeline import HostPipeline
from colo_data.loader.loader import Loader, to_numpy
from colo_data.pipeline.kinds import AnyPipeline
from colo_data.pipeline.native import Pipeline
from colo_data.pipeline.schedule import DENOMINATOR
from colo_data.verification.checks import Batch, Check, differing_rows, one_device
from colo_data.verification.verify_grain import DEFAULT_STEPS, verify_grain

_KEEP_CHUNK = 4096  # records read at once to learn which ones the pack's `keep` rejects
_PLACES_SHOWN = 4


def verify(
    pipeline: AnyPipeline,
    hosts: Sequence[int] = (1, 2, 4),
    steps: int | None = None,
    resume_at: int | None = None,
    resume_hosts: int | None = None,
) -> list[Check]:
    """Read `steps` global batches of `pipeline` (default: one epoch, also when it repeats
    forever; for a `cd.Mix`, until every component with a weight has run through its first
    epoch, at most 2**20 records) with each host count in `hosts`, and check them; the
    first host count is the reference. Its state after `resume_at` batches (default: half
    the run) is restored with `resume_hosts` hosts (default: the last of `hosts` that runs)
    and must continue as the uninterrupted run does. A host count that does not divide the
    global batch size cannot run the pipeline at all: it gives a SKIP check. Raises
    ConfigError when the pipeline cannot be verified (no index column, or a mixture's
    component column dropped) or a setting is impossible. A check fails rather than
    raises; a pipeline that raises while running raises here too.

    A `cd.GrainPipeline` is checked against Grain itself, each host count on its own
    (`verify_grain`): `steps` defaults to `DEFAULT_STEPS`, and its state restores on the
    host count that saved it."""
    if not pipeline.positional:
        return verify_grain(pipeline, hosts, steps, resume_at, resume_hosts)
    _check_settings(pipeline, hosts, steps, resume_at, resume_hosts)
    size = pipeline.global_batch_size
    counts = list(dict.fromkeys(hosts))
    runnable = [h for h in counts if size % h == 0]
    if not runnable:
        raise ConfigError(
            f"hosts={tuple(counts)}: none divides global_batch_size={size}, so the Loader refuses them all; "
            "give host counts that divide the batch size (1 always does)"
        )
    skipped = [Check(_hosts(h), "SKIP", _refused(size, h)) for h in counts if h not in runnable]
    run_steps = _run_steps(pipeline, steps)
    if run_steps is not None:
        _check_resume_at(resume_at, run_steps)  # before the first run, when its length is known
    runs, difference = _read_together(pipeline, runnable, run_steps)
    reference = runs[0]
    if not len(reference):
        raise ConfigError("the pipeline delivers no batch: does the pack's keep reject every record?")
    resume_at = len(reference) // 2 if resume_at is None else resume_at
    _check_resume_at(resume_at, len(reference))
    resume = _resume(pipeline, reference, resume_at, runnable[-1] if resume_hosts is None else resume_hosts)
    if pipeline.partitioned:
        return skipped + _partitioned_checks(pipeline, runs, difference, resume)
    end = max(run.end for run in runs)
    expected = _expected(pipeline, end)
    if pipeline.pack is not None:
        stream = expected.keys(expected.delivered(end))
        for run in runs:
            run.stream = stream
    order = f"every record comes where seed {pipeline.order.seed} (shuffle={pipeline.order.describe()}) puts it"
    covered = _covered(pipeline, reference.end, expected)
    return skipped + [
        _identical(runs, difference),
        *_shares_check(pipeline, runs, expected),
        _per_run("exactly once", runs, lambda run: _exactly_once(pipeline, run, expected), covered),
        _per_run("seed order", runs, lambda run: _in_order(pipeline, run, expected), order),
        resume,
    ]


def _partitioned_checks(pipeline: Pipeline, runs: list[_Run], difference: str | None, resume: Check) -> list[Check]:
    """The checks of a partitioned packed or filtered pipeline, whose partitions each read
    their own stream at their own pace (`Partitioning.global_positions`): each partition's rows of the
    batches hold its own records, each once per its own epoch and in its own stream's order
    (less what the keep rejects), up to where its packing plans or batches reached."""
    order = f"every record comes where seed {pipeline.order.seed} (shuffle={pipeline.order.describe()}) puts it"
    partitions = pipeline.partitioning.partitions
    reference = runs[0]
    checked = _plans_end(pipeline, reference)
    ends = [int(own) for own in _own_position(pipeline, reference.states[checked])[1:]]
    covered = (
        f"each record once per epoch of its partition, over the first {min(ends)} to {max(ends)} positions of each of "
        f"the {partitions} partitions' own streams"
    )
    if checked < len(reference):
        late = len(reference) - checked
        batches = "batch" if late == 1 else f"{late} batches"
        covered += f" (the last {batches}, in packing plans not yet ended, not checked)"

    expected = {run.hosts: _partitions(pipeline, run) for run in runs}
    return [
        _identical(runs, difference),
        *_partitioned_shares(pipeline, runs, expected),
        _per_run("exactly once", runs, lambda run: _each_partition(pipeline, expected[run.hosts], _exactly_once), covered),
        _per_run("seed order", runs, lambda run: _each_partition(pipeline, expected[run.hosts], _in_order), order),
        resume,
    ]


def _own_position(pipeline: Pipeline, state: dict[str, Any]) -> np.ndarray:
    """A partitioned pipeline's position in a loader state: `[phase, own_0, ...]`."""
    position = pipeline.resumed(state, 1)[1]
    assert isinstance(position, np.ndarray)  # a partitioned pipeline's
    return position


def _plans_end(pipeline: Pipeline, run: _Run) -> int:
    """The run's batches up to the end of its partitions' last whole packing plans (all of
    a filtered pipeline's): a state in the middle of a plan says where the plan starts, not
    which of its records the batches before it hold."""
    end = len(run)
    while end and int(_own_position(pipeline, run.states[end])[0]):
        end -= 1
    return end


def _partitions(pipeline: Pipeline, run: _Run) -> list[tuple[_Run, _Expected]]:
    """Each partition's rows of the run's batches as a run of their own, with what its own
    stream holds up to where the run left it (its own position in the run's last state at
    the end of whole packing plans; the batches after it are not checked)."""
    parts, rows = pipeline.partitioning, pipeline.partitioning.rows
    end = _plans_end(pipeline, run)
    own_ends = _own_position(pipeline, run.states[end])[1:]
    out = []
    for k, own_end in enumerate(own_ends.tolist()):
        mine = slice(k * rows, (k + 1) * rows)
        sub = _Run(
            run.hosts,
            records=[records[mine] for records in run.records[:end]],
            components=[components[mine] for components in run.components[:end]],
            partition=k,
            own_end=own_end,
            plan_batches=pipeline.plan_batches if pipeline.pack is not None else 1,
        )
        expected = _expected_at(pipeline, parts.global_positions(k, np.arange(own_end, dtype=np.int64)))
        if pipeline.pack is not None:
            sub.stream = expected.keys(expected.delivered(own_end))
        out.append((sub, expected))
    return out


def _each_partition(
    pipeline: Pipeline, partitions: list[tuple[_Run, _Expected]], check: Callable[[Pipeline, _Run, _Expected], str | None]
) -> str | None:
    """The first partition's problem that `check` finds, naming the partition."""
    for sub, expected in partitions:
        problem = check(pipeline, sub, expected)
        if problem:
            return f"partition {sub.partition}: {problem}"
    return None


def _partitioned_shares(pipeline: Pipeline, runs: list[_Run], expected: dict[int, list[tuple[_Run, _Expected]]]) -> list[Check]:
    """A partitioned mixture's shares (`_shares_check`), each partition's records taken in
    its own stream's order (a packing plan places them by fit), unless a keep rejects some."""
    shares = pipeline.stream.shares
    if shares is None:
        return []
    if not all(e.kept.all() for _, e in expected[runs[0].hosts]):
        return [Check("shares", "SKIP", "the pack's keep rejects records, so the shares delivered are not the weights'")]

    def problem(run: _Run) -> str | None:
        return _each_partition(pipeline, expected[run.hosts], lambda p, sub, _: _shares(p, shares, sub))

    return [_per_run("shares", runs, problem, _shares_passed(pipeline, runs))]


def run_length(pipeline: AnyPipeline, steps: int | None) -> str:
    """What a `verify` run of `pipeline` reads, in words, for `colo-data verify`'s header."""
    if not pipeline.positional:
        return f"{steps or DEFAULT_STEPS} batches against Grain's own"
    return f"{steps} batches" if steps else pipeline.stream.first_epochs()


def _check_settings(
    pipeline: Pipeline, hosts: Sequence[int], steps: int | None, resume_at: int | None, resume_hosts: int | None
) -> None:
    if pipeline.index_column is None:
        raise ConfigError(
            "the pipeline has no index column, so verify cannot tell which record each row holds: add "
            'index_column="_index" to cd.Pipeline(...) (it adds each row\'s global record index as an int64 '
            "column before the transforms run; a model can ignore it) and keep that column through the transforms"
        )
    if not hosts or any(not isinstance(h, int) or h < 1 for h in hosts):
        raise ConfigError(f"hosts={tuple(hosts)!r}: give one or more positive host counts, e.g. (1, 2, 4)")
    for name, value, least in (("steps", steps, 1), ("resume_at", resume_at, 0), ("resume_hosts", resume_hosts, 1)):
        if value is not None and (not isinstance(value, int) or value < least):
            raise ConfigError(f"{name}={value!r}: must be an int >= {least}")


def _check_resume_at(resume_at: int | None, batches: int) -> None:
    if resume_at is not None and resume_at >= batches:
        raise ConfigError(f"resume_at={resume_at}: the run reads {batches} batches; give 0 <= resume_at < {batches}")


def _run_steps(pipeline: Pipeline, steps: int | None) -> int | None:
    """Global batches to read: `steps`, at most what the stream holds; by default the
    batches that reach the stream's `verify_end` (one epoch; a mixture's: one epoch of every
    component). None for packed or filtered pipelines without `steps`: their batches take as
    many records as fit or pass, so the run reads until it passes `verify_end`."""
    available = pipeline.batches_from(0)
    if steps is None:
        if pipeline.variable_batches:
            return None
        steps = -(-pipeline.stream.verify_end(pipeline) // pipeline.global_batch_size)
    return steps if available is None else min(steps, available)


@dataclass
class _Run:
    """What one host count's run delivered, as verify needs it: each batch's index column
    and component column (zeros for one source) and the loader state after each batch
    (`states[0]`: before the first), through JSON as a checkpoint holds it."""

    hosts: int
    records: list[np.ndarray] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    components: list[np.ndarray] = field(default_factory=list)
    # for packed batches: the records the order delivers, in stream order (`_keys`), for
    # `_delivered` to put each batch's records in that order (they lie in rows by fit)
    stream: np.ndarray | None = None
    # one partition's rows of a partitioned pipeline's run (`_partitions`): which, and its own
    # position at the run's end (its records come from its own positions `[0, own_end)`)
    partition: int | None = None
    own_end: int | None = None
    plan_batches: int = 1  # a packed partition's: the batches its packing plans place records across by fit

    def __len__(self) -> int:
        return len(self.records)

    @property
    def ends(self) -> list[int]:
        """The position after each batch."""
        return [_position(state) for state in self.states[1:]]

    @property
    def end(self) -> int:
        """The position after the run: its records come from positions `[0, end)`
        (a partition's run: its own positions)."""
        return self.own_end if self.own_end is not None else _position(self.states[-1])


def _position(state: dict[str, Any]) -> int:
    """The position a loader state (`colo_data.state.make_state`) points at (a
    mixture's holds it as it is)."""
    if "mix" in state:
        return int(state["position"])
    return state["epoch"] * state["records"] + state["position"]


class _Delivery:
    """A Loader with `hosts` simulated hosts (from `state`) on a one-device mesh, so that
    the batch size need only divide by the host count: the check is about hosts, not
    devices. `next` returns each global batch as numpy and records it in `run`."""

    def __init__(self, pipeline: Pipeline, hosts: int, state: dict[str, Any] | None = None) -> None:
        self.pipeline = pipeline
        # on the host's own thread: workers do not change the batches (tests/test_workers.py), and a
        # transform then sees the same calls in every run (it can depend on its call's rows, wrongly)
        self.loader = Loader(pipeline, hosts=hosts, mesh=one_device(), state=state, backend=InProcess(workers=0))
        self.run = _Run(hosts, states=[self._state()])

    def _state(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.loader.get_state()))

    def next(self) -> Batch | None:
        """The next global batch, or None at the end of the stream."""
        arrays = next(self.loader, None)
        if arrays is None:
            return None
        batch = to_numpy(arrays)
        self.run.records.append(_index_column(self.pipeline, batch))
        self.run.components.append(_component_column(self.pipeline, batch, self.run.records[-1].shape))
        self.run.states.append(self._state())
        return batch


def _index_column(pipeline: Pipeline, batch: Batch) -> np.ndarray:
    """The batch's index column as int64, checked: `(rows,)`, packed `(rows, max_segments)`."""
    name = pipeline.index_column
    assert name is not None
    if name not in batch:
        raise ConfigError(
            f"index_column={name!r}: the batches have no such column (they have {sorted(batch)}): a transform drops "
            "it; keep it in the transforms' output so that verify can tell which record each row holds"
        )
    records, rows = batch[name], pipeline.global_batch_size
    shape = (rows,) if pipeline.pack is None else (rows, pipeline.pack.max_segments)
    if records.shape != shape or records.dtype.kind not in "iu":
        raise ConfigError(
            f"index_column={name!r}: the batches hold it as {records.dtype} {records.shape}, expected integers of "
            f"shape {shape}; keep it through the transforms as the pipeline adds it"
        )
    return records.astype(np.int64)


def _component_column(pipeline: Pipeline, batch: Batch, shape: tuple[int, ...]) -> np.ndarray:
    """A mixture's component column as int64, checked: the index column's shape (zeros for
    a stream of one component)."""
    name = pipeline.stream.component_column
    if name is None:
        return np.zeros(shape, np.int64)
    if name not in batch:
        raise ConfigError(
            f"Mix(component_column={name!r}): the batches have no such column (they have {sorted(batch)}): a "
            "transform drops it; keep it in the transforms' output so that verify can tell which component each "
            "row comes from"
        )
    components = batch[name]
    if components.shape != shape or components.dtype.kind not in "iu":
        raise ConfigError(
            f"Mix(component_column={name!r}): the batches hold it as {components.dtype} {components.shape}, expected "
            f"integers of shape {shape}; keep it through the transforms as the pipeline adds it"
        )
    return components.astype(np.int64)


def _read_together(pipeline: Pipeline, hosts: list[int], steps: int | None) -> tuple[list[_Run], str | None]:
    """Read `steps` batches (None: until the first host count's run passes the first
    epoch) with every host count in lockstep, comparing each batch with the first host
    count's as it comes, so that no batch is kept: the runs, and the first difference."""
    with ExitStack() as stack:
        deliveries = []
        for h in hosts:
            deliveries.append(_Delivery(pipeline, h))
            stack.callback(deliveries[-1].loader.close)
        reference, labels = deliveries[0], [f"with {_hosts(h)}" for h in hosts]
        difference = None
        while steps is None or len(reference.run) < steps:
            step = len(reference.run)
            want = reference.next()
            for delivery, label in zip(deliveries[1:], labels[1:], strict=True):
                got = delivery.next() if len(delivery.run) == step else None  # None: it ended before
                difference = difference or _batch_difference(pipeline, step, want, got, (labels[0], label))
            if want is None or (steps is None and _read_through(pipeline, reference.run)):
                break
    return [delivery.run for delivery in deliveries], difference


def _read_through(pipeline: Pipeline, run: _Run) -> bool:
    """Whether a run without a set length has read far enough: past the stream's
    `verify_end`; a partitioned pipeline's run, each partition past its share of it, and
    at the end of its packing plans (its own positions then say which records it consumed)."""
    end = pipeline.stream.verify_end(pipeline)
    if not pipeline.partitioned:
        return run.end >= end
    position = _own_position(pipeline, run.states[-1])
    shares = pipeline.partitioning.epoch_records(end, np.arange(pipeline.partitioning.partitions))
    return int(position[0]) == 0 and bool((position[1:] >= shares).all())


def _batch_difference(
    pipeline: Pipeline, step: int, want: Batch | None, got: Batch | None, labels: tuple[str, str]
) -> str | None:
    """How batch `step` of two runs differs (`labels` name them; None: that run had
    ended), naming the first differing row, its columns and records; None when equal."""
    if want is None or got is None:
        if want is got:
            return None
        return f"the stream ends at batch {step} {labels[want is not None]} but goes on {labels[want is None]}"
    wanted, gotten = ({name: f"{a.dtype} {a.shape}" for name, a in batch.items()} for batch in (want, got))
    if wanted != gotten:
        column = next(c for c in sorted(wanted.keys() | gotten.keys()) if wanted.get(c) != gotten.get(c))
        a, b = wanted.get(column, "absent"), gotten.get(column, "absent")
        return f"batch {step}: column {column!r} is {a} {labels[0]}, {b} {labels[1]}"
    first = {name: rows[0] for name in want if len(rows := differing_rows(want[name], got[name]))}
    if not first:
        return None
    row = int(min(first.values()))
    columns = ", ".join(repr(name) for name, r in first.items() if r == row)
    return (
        f"batch {step} row {row} differs in {columns}: {_row_records(pipeline, want, row)} {labels[0]}, "
        f"{_row_records(pipeline, got, row)} {labels[1]}"
    )


def _identical(runs: list[_Run], difference: str | None) -> Check:
    name = "identical batches"
    if len(runs) == 1:
        return Check(name, "SKIP", f"only {_hosts(runs[0].hosts)} ran; give two or more host counts (e.g. 1, 2, 4)")
    if difference:
        return Check(name, "FAIL", difference)
    counts = ", ".join(str(run.hosts) for run in runs)
    return Check(name, "PASS", f"hosts {counts} give the same {len(runs[0])} batches, row for row in every column")


def _resume(pipeline: Pipeline, reference: _Run, resume_at: int, resume_hosts: int) -> Check:
    """The reference's state after `resume_at` batches, restored with `resume_hosts` hosts,
    gives the batches that an uninterrupted run (read again, in lockstep) gives."""
    name, size = "resume", pipeline.global_batch_size
    if size % resume_hosts:
        return Check(name, "SKIP", _refused(size, resume_hosts))
    what = f"state after {resume_at} batches with {_hosts(reference.hosts)}, restored with {_hosts(resume_hosts)}"
    labels = ("in the uninterrupted run", "after the restore")
    with ExitStack() as stack:
        uninterrupted = _Delivery(pipeline, reference.hosts)
        stack.callback(uninterrupted.loader.close)
        restored = _Delivery(pipeline, resume_hosts, state=reference.states[resume_at])
        stack.callback(restored.loader.close)
        for _ in range(resume_at):
            uninterrupted.next()
        for step in range(resume_at, len(reference)):
            problem = _batch_difference(pipeline, step, uninterrupted.next(), restored.next(), labels)
            if problem:
                return Check(name, "FAIL", f"{what}: {problem}")
    rest = len(reference) - resume_at
    return Check(name, "PASS", f"{what}: the remaining {rest} batches are identical to the uninterrupted run's")


_COMPONENT_KEY = 2**40  # a record as one key: component * this + index within the component


def _keys(records: np.ndarray, components: np.ndarray) -> np.ndarray:
    """Records (index within the component, component) as keys that tell components apart."""
    return components * _COMPONENT_KEY + records


@dataclass(frozen=True)
class _Expected:
    """What the order defines for positions `[0, len(components))`: each position's
    component, the index of its record within the component, the component's own position
    (its epoch is that // the component's size), and whether the keep (the pipeline's and
    the pack's) takes it."""

    components: np.ndarray
    indices: np.ndarray
    own: np.ndarray
    kept: np.ndarray

    def delivered(self, end: int) -> np.ndarray:
        """The positions of the records delivered from `[0, end)`, in stream order."""
        return np.flatnonzero(self.kept[:end])

    def keys(self, positions: np.ndarray) -> np.ndarray:
        """The records (`_keys`) at `positions`."""
        return _keys(self.indices[positions], self.components[positions])


def _expected(pipeline: Pipeline, end: int) -> _Expected:
    """The order's records for positions `[0, end)`, from the pipeline's stream bound
    to its order, and which of them the keep takes (all, without one)."""
    return _expected_at(pipeline, np.arange(end, dtype=np.int64))


def _expected_at(pipeline: Pipeline, positions: np.ndarray) -> _Expected:
    """`_expected` of the global positions `positions`, one after the other (a partition's
    own stream: `Partitioning.global_positions`)."""
    order = pipeline.stream.bind(pipeline.order, pipeline.partitioning)
    components, own = order.components_at(positions)
    components = components.astype(np.int64)
    indices = order.own_indices(components, own)
    end = len(positions)
    if pipeline.keep is None and (pipeline.pack is None or pipeline.pack.keep is None):
        return _Expected(components, indices, own, np.ones(end, bool))
    host, records = HostPipeline(pipeline), order.indices_at(positions)
    verdicts = [np.zeros(0, bool)]  # none: a partition that has consumed no record yet
    for i in range(0, end, _KEEP_CHUNK):
        verdict = host.kept(records[i : i + _KEEP_CHUNK])
        assert verdict is not None  # there is a keep (above)
        verdicts.append(verdict)
    return _Expected(components, indices, own, np.concatenate(verdicts))


@dataclass(frozen=True)
class _Delivered:
    """A run's records in stream order (index within the component, component) with their
    places, (batch, row, segment) each: segment 0 without packing, else 1, 2, ... as in
    `segment_ids`."""

    records: np.ndarray
    components: np.ndarray
    places: np.ndarray

    @property
    def keys(self) -> np.ndarray:
        return _keys(self.records, self.components)


def _delivered(run: _Run) -> _Delivered:
    """The run's records in stream order (a packed batch's as `run.stream` orders them);
    packed batches' -1 padding left out."""
    records, places, components = [], [], []
    for batch, (index, component) in enumerate(zip(run.records, run.components, strict=True)):
        if index.ndim == 1:
            rows, segments = np.arange(len(index)), np.zeros(len(index), np.int64)
        else:
            rows, slots = np.nonzero(index != -1)  # row-major: the order the records were packed in
            index, component, segments = index[rows, slots], component[rows, slots], slots + 1
        first = 0 if run.partition is None else run.partition * len(run.records[0])  # a partition's: its rows
        records.append(index)
        components.append(component)
        places.append(np.stack([np.full(len(index), batch), first + rows, segments], axis=1))
    if not records:  # a host count whose stream ended at once
        return _Delivered(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3), np.int64))
    delivered = _Delivered(np.concatenate(records), np.concatenate(components), np.concatenate(places))
    return delivered if run.stream is None else _stream_ordered(delivered, run.stream, run.plan_batches)


def _stream_ordered(delivered: _Delivered, want: np.ndarray, plan_batches: int = 1) -> _Delivered:
    """A packed batch places its records in its rows by fit, not in stream order (a
    partition's packing plan, across its `plan_batches` batches): each plan's records put
    in the order the stream has them (`want`, as keys), where the plan holds just the
    records of its part of the stream (else as delivered, for the check to name)."""
    got, order = delivered.keys, np.arange(len(delivered.records))
    batches = delivered.places[:, 0] // plan_batches
    starts = np.flatnonzero(np.r_[True, batches[1:] != batches[:-1]]) if len(batches) else np.zeros(0, np.int64)
    for start, stop in zip(starts.tolist(), [*starts[1:].tolist(), len(got)], strict=True):
        mine, theirs = got[start:stop], want[start:stop]
        by_got, by_want = np.argsort(mine, kind="stable"), np.argsort(theirs, kind="stable")
        if len(mine) == len(theirs) and np.array_equal(mine[by_got], theirs[by_want]):
            order[start + by_want] = start + by_got  # the delivered record that the stream has at each place
    return _Delivered(delivered.records[order], delivered.components[order], delivered.places[order])


def _per_run(name: str, runs: list[_Run], problem_of: Callable[[_Run], str | None], passed: str) -> Check:
    """A check made on every run: FAIL naming the first failing host count (and any other
    that fails), else PASS."""
    failing = [(run.hosts, problem) for run in runs if (problem := problem_of(run))]
    if not failing:
        return Check(name, "PASS", f"{passed}, with hosts {', '.join(str(run.hosts) for run in runs)}")
    (hosts, problem), others = failing[0], [h for h, _ in failing[1:]]
    also = f" (fails with hosts {', '.join(map(str, others))} too)" if others else ""
    return Check(name, "FAIL", f"{_hosts(hosts)}: {problem}{also}")


def _label(pipeline: Pipeline, key: int) -> str:
    """A record key (`_keys`) as a message names it."""
    component, index = divmod(int(key), _COMPONENT_KEY)
    return pipeline.stream.record_label(component, index)


def _outside(pipeline: Pipeline, delivered: _Delivered) -> tuple[np.ndarray, str | None]:
    """Which delivered records name no record of the source (an unknown component, an index
    out of its component's range), and what the first one is."""
    stream = pipeline.stream
    sizes = np.asarray(stream.sizes, dtype=np.int64)
    components, records = delivered.components, delivered.records
    unknown = (components < 0) | (components >= len(sizes))
    outside = unknown | (records < 0) | (records >= sizes[np.where(unknown, 0, components)])
    if not outside.any():
        return outside, None
    i = int(np.flatnonzero(outside)[0])
    place, component = _place(delivered.places[i]), int(components[i])
    if unknown[i]:
        named = ", ".join(map(repr, stream.names))
        return outside, f"{place} holds component {component}, not one of 0-{len(sizes) - 1} ({named})"
    label = stream.record_label(component, int(records[i]))
    return outside, f"{place} holds {label}, not in 0..{sizes[component] - 1}"


def _exactly_once(pipeline: Pipeline, run: _Run, expected: _Expected) -> str | None:
    """What is wrong with the records' counts: each delivered record as often as the order
    puts it in the run's positions (once per epoch of its component), and never one
    the keep rejects."""
    delivered, end = _delivered(run), run.end
    outside, problem = _outside(pipeline, delivered)
    problems = [problem] if problem else []
    got, places = delivered.keys[~outside], delivered.places[~outside]
    positions = expected.delivered(end)
    want = expected.keys(positions)
    keys, inverse = np.unique(np.concatenate([want, got]), return_inverse=True)
    want_at, got_at = inverse[: len(want)], inverse[len(want) :]
    want_count, got_count = np.bincount(want_at, minlength=len(keys)), np.bincount(got_at, minlength=len(keys))
    too_often, missing = got_count > want_count, got_count < want_count
    if too_often.any():
        k = int(got_at[np.flatnonzero(too_often[got_at])[0]])
        seen = f"{_label(pipeline, keys[k])} appears {_times(int(got_count[k]))} ({_places(places[got == keys[k]])})"
        if want_count[k]:
            problems.append(seen + ("" if want_count[k] == 1 else f", expected {_times(int(want_count[k]))}"))
        elif keys[k] in expected.keys(np.arange(end)):
            problems.append(f"{seen}, but the pack's keep rejects it")
        else:
            problems.append(f"{seen}, but the order puts it at none of the positions 0-{end - 1}")
    if missing.any():
        j = int(np.flatnonzero(missing[want_at])[0])
        k, where = int(want_at[j]), f"the order puts it at {_expected_place(pipeline, run, int(positions[j]))}"
        if got_count[k]:
            times, wanted = _times(int(got_count[k])), _times(int(want_count[k]))
            problems.append(f"{_label(pipeline, keys[k])} appears {times}, expected {wanted} ({where})")
        else:
            problems.append(f"{_label(pipeline, keys[k])} is missing ({where})")
    if not problems:
        return None
    too_often_count = _count(int(too_often.sum()), "record")
    return "; ".join(problems) + f" (in all: {too_often_count} too often, {int(missing.sum())} missing)"


def _covered(pipeline: Pipeline, end: int, expected: _Expected) -> str:
    """What the exactly-once check covered, positions `[0, end)`: each component's
    whole epochs and part of the next one."""
    stream = pipeline.stream
    spans = []
    for c, (name, size) in enumerate(zip(stream.names, stream.sizes, strict=True)):
        epochs, rest = divmod(int(np.count_nonzero(expected.components[:end] == c)), size)
        whole = ["epoch 0" if epochs == 1 else f"epochs 0-{epochs - 1}"] if epochs else []
        span = " and ".join(whole + ([f"{rest} of epoch {epochs}'s {size}"] if rest else [])) or "none"
        spans.append(f"{name!r} {span}" if name else span)
    rejected = int((~expected.kept[:end]).sum())
    dropped = f", none of the {rejected} that the pack's keep rejects" if rejected else ""
    epoch = "epoch of its component" if any(stream.names) else "epoch"
    return f"each record once per {epoch} over positions 0-{end - 1}: {', '.join(spans)}{dropped}"


def _in_order(pipeline: Pipeline, run: _Run, expected: _Expected) -> str | None:
    """The first record that is not where the seed's order (less what `keep` rejects) puts it."""
    delivered, positions = _delivered(run), expected.delivered(run.end)
    got, want = delivered.keys, expected.keys(positions)
    count = min(len(got), len(want))
    wrong = np.flatnonzero(got[:count] != want[:count])
    if len(wrong):
        i = int(wrong[0])
        place = _place(delivered.places[i])
        return f"{place} holds {_label(pipeline, got[i])} where the seed's order has {_label(pipeline, want[i])}"
    if len(got) != len(want):
        return f"{len(got)} records delivered; the seed's order has {len(want)} in positions 0-{run.end - 1}"
    return None


def _shares_check(pipeline: Pipeline, runs: list[_Run], expected: _Expected) -> list[Check]:
    """A mixture's shares on every run (none for a stream of one source): in every prefix
    each component within one record of its share."""
    stream = pipeline.stream
    if stream.shares is None:
        return []
    if not expected.kept.all():
        return [Check("shares", "SKIP", "the pack's keep rejects records, so the shares delivered are not the weights'")]
    return [_per_run("shares", runs, lambda run: _shares(pipeline, stream.shares or (), run), _shares_passed(pipeline, runs))]


def _shares_passed(pipeline: Pipeline, runs: list[_Run]) -> str:
    """What the shares check checked, as its PASS line says."""
    stream = pipeline.stream
    assert stream.shares is not None  # a mixture's
    weights = ", ".join(f"{n!r} {s}/{DENOMINATOR}" for n, s in zip(stream.names, stream.shares, strict=True) if s)
    partitions = pipeline.partitioning.partitions
    if partitions == 1:
        end = runs[0].end
        return f"in every prefix of positions 0-{end - 1} each component is within one record of its share ({weights})"
    # each partition runs the schedule from its own slot on (a difference of two prefixes); a partitioned
    # packed or filtered pipeline's partitions each read their own stream, as far as their pace took them
    span = "" if pipeline.partitioned else f" in positions 0-{runs[0].end - 1}"
    within = f"each component is within two records of its share ({weights})"
    return f"in every prefix of each of the {partitions} partitions' records{span} {within}"


def _shares(pipeline: Pipeline, shares: tuple[int, ...], run: _Run) -> str | None:
    """The first prefix of the run in which a component's record count is more than one
    record from its exact share, `records * share / DENOMINATOR` (counted in integers); with
    partitions, of a partition's own records, more than two."""
    delivered = _delivered(run)
    unknown = _outside(pipeline, delivered)[1]
    if unknown:
        return unknown
    rows, partitions = pipeline.partitioning.rows, pipeline.partitioning.partitions
    partition_of = delivered.places[:, 1] // rows
    for k in range(partitions):
        mine = np.flatnonzero(partition_of == k)
        prefix = np.arange(1, len(mine) + 1, dtype=np.int64)
        first: tuple[int, int, int] | None = None  # (its record, component, its count there)
        for c, share in enumerate(shares):
            counts = np.cumsum(delivered.components[mine] == c)
            off = np.flatnonzero(np.abs(counts * DENOMINATOR - prefix * share) > min(partitions, 2) * DENOMINATOR)
            if len(off) and (first is None or off[0] < first[0]):
                first = (int(off[0]), c, int(counts[off[0]]))
        if first is not None:
            i, c, count = first
            exact = (i + 1) * shares[c] / DENOMINATOR
            whose = f" of partition {k}'s" if partitions > 1 else ""
            return (
                f"component {pipeline.stream.names[c]!r} has {count} of the first {i + 1} records{whose} (through "
                f"{_place(delivered.places[mine[i]])}), its share ({shares[c]}/{DENOMINATOR}) of them is {exact:.2f}"
            )
    return None


def _expected_place(pipeline: Pipeline, run: _Run, position: int) -> str:
    """Where the order puts `position`: a batch and row, or for packed batches the
    batch whose positions include it."""
    size = pipeline.global_batch_size
    if run.partition is not None:
        return f"its own position {position}"
    if not pipeline.variable_batches:
        return f"batch {position // size} row {position % size}"
    return f"position {position}, in batch {int(np.searchsorted(run.ends, position, side='right'))}"


def _place(place: np.ndarray) -> str:
    batch, row, segment = (int(v) for v in place)
    return f"batch {batch} row {row}" + (f" segment {segment}" if segment else "")


def _places(places: np.ndarray) -> str:
    named = [_place(p) for p in places[:_PLACES_SHOWN]]
    if len(places) > _PLACES_SHOWN:
        return ", ".join(named) + f" and {len(places) - _PLACES_SHOWN} more"
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]


def _row_records(pipeline: Pipeline, batch: Batch, row: int) -> str:
    """The record(s) a batch's row holds, named by the stream (a mixture's with their
    components); a packed row's without the -1 padding."""
    assert pipeline.index_column is not None  # verify refuses a pipeline without one
    index, stream = batch[pipeline.index_column][row], pipeline.stream
    name = stream.component_column
    components = batch[name][row] if name is not None and name in batch else np.zeros_like(index)
    if index.ndim == 0:
        return stream.record_label(int(components), int(index))
    pairs = zip(components.tolist(), index.tolist(), strict=True)
    return "[" + ", ".join(stream.record_label(c, i) for c, i in pairs if i != -1) + "]"


def _refused(size: int, hosts: int) -> str:
    return f"global_batch_size={size} is not divisible by {hosts}: the Loader refuses {_hosts(hosts)}"


def _times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _hosts(count: int) -> str:
    return _count(count, "host")
