"""`LoaderMeters`: a Loader's telemetry bookkeeping. It owns the step clock, asks the transport
for the hosts' and the hand-off's cumulative counters, and snapshots them at the end of
the warm-up so that `telemetry()` reports the steady state."""

from __future__ import annotations

import jax

from colo_data.backends.base import Transport
from colo_data.telemetry.counters import StepClock
from colo_data.telemetry.report import HostCounters, Telemetry, summarize


class LoaderMeters:
    """Telemetry state of one Loader.

    Args:
        clock: the step clock, made first, when the loader is created.
        transport: where the counters come from.
        prefetch: the loader's prefetch depth (0: no queue to measure).
    """

    def __init__(self, clock: StepClock, transport: Transport, prefetch: int) -> None:
        self.clock = clock
        self.transport, self.prefetch = transport, prefetch
        self._at_warmup: tuple[list[float], list[HostCounters]] | None = None

    def replace_transport(self, transport: Transport) -> None:
        """A new transport (a Grain pipeline's `set_state`): its counters start at zero, so
        the steady state is counted from the next run on, not from the old one's warm-up."""
        self.transport = transport
        self._at_warmup = None

    def start(self) -> None:
        """A run starts: with no warm-up, the steady state is counted from here."""
        if self.clock.count == 0 and self.clock.warmup == 0:
            self._at_warmup = self.transport.counters()

    def step(self, start: float, done: float, records: int, depth: int, arrays: dict[str, jax.Array]) -> None:
        """One `next()`: called at `start`, returned `arrays` holding `records` records at `done`."""
        clock = self.clock
        if not clock.batch_bytes:
            clock.batch_bytes = sum(a.nbytes for a in arrays.values())
        clock.record(start, done, records, depth)
        if clock.count == clock.warmup:
            self._at_warmup = self.transport.counters()

    def telemetry(self) -> Telemetry:
        """The telemetry now (see `cd.telemetry.Telemetry`)."""
        handoff, now = self.transport.counters()
        at = self._at_warmup
        return summarize(
            backend=self.transport.name,
            clock=self.clock,
            prefetch=self.prefetch,
            queue_depth_known=self.prefetch > 0,
            handoff=handoff,
            handoff_at_warmup=at[0] if at else None,
            infos=self.transport.infos(),
            now=now,
            at_warmup_hosts=at[1] if at else None,
            shared_thread=self.transport.on_trainer_thread,
        )
