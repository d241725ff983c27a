"""`FadingMeans`: running means of amounts per unit whose old measurements fade, and that start
afresh at a new level, so that `WorkerPolicy` follows a cost that changes within two decisions
and averages noise over seconds."""

from __future__ import annotations

import math

MEMORY_S = 10.0  # the weight of a measurement fades to 1/e over this long
CHANGE = 0.3  # an amount this far (30%) from its mean in two decisions in a row is a new mean


class FadingMeans:
    """Amounts per unit (`per(i)`: a cost a record, records a second), running means whose
    weight fades over `MEMORY_S`, started afresh at a new mean (`CHANGE`, the first amount
    deciding)."""

    def __init__(self, amounts: int) -> None:
        self.units, self.sums = 0.0, [0.0] * amounts
        self.restarts = 0  # new means found
        self._off = 0  # decisions in a row whose amount was beyond `CHANGE`: +n above, -n below

    def per(self, i: int = 0) -> float | None:
        """The mean of amount `i` a unit; None before any unit."""
        return self.sums[i] / self.units if self.units > 0 else None

    def add(self, units: float, amounts: list[float], elapsed: float) -> None:
        """`units` more (records, seconds) with these `amounts`, `elapsed` seconds after the last."""
        if units <= 0:
            return
        mean = self.per()
        if mean:
            ratio = amounts[0] / units / mean
            off = 1 if ratio > 1 + CHANGE else -1 if ratio < 1 / (1 + CHANGE) else 0
            self._off = self._off + off if off and off * self._off >= 0 else off
            if abs(self._off) >= 2:  # a new mean: the measurements before it no longer count
                self.units, self.sums, self._off = 0.0, [0.0] * len(amounts), 0
                self.restarts += 1
        fade = math.exp(-elapsed / MEMORY_S)
        self.units = self.units * fade + units
        self.sums = [s * fade + x for s, x in zip(self.sums, amounts, strict=True)]
