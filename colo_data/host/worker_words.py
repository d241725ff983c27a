"""The worker-count policy's one sentence: why a host pipeline has the workers it has, in
the terms of the policy's model (`worker_policy`), naming the term that binds (the
trainer's demand, the CPUs, the host's thread, the setting, workers that would not pay or
were given up), e.g. "6 workers: a record costs 1.1 ms of a worker's CPU, and the trainer
takes 5,200 records/s: 6 deliver that"."""

from __future__ import annotations

import math
from typing import NamedTuple


class Terms(NamedTuple):
    """The model's terms as measured: seconds a record (a worker's work `t` and CPU `c`,
    the host's thread's hand-off `h`), the CPUs there are for workers, records a second (the
    trainer's demand, inf while it waits for input; the host's thread alone; the best with
    the most workers; what workers given up delivered, inf where none were), the budget and
    the most workers allowed."""

    t: float
    c: float
    h: float
    cpus: float
    demand: float
    alone: float
    best: float
    ceiling: float
    budget: float
    most: int


def sentence(count: int, terms: Terms) -> str:
    """Why `count` workers, in one sentence."""
    costs = _costs(terms.t, terms.c, "the host's" if not count else "a worker's")
    asks = "the trainer waits for input" if terms.demand == math.inf else f"the trainer takes {_rate(terms.demand)}"
    alone = f"the host's thread alone makes up to {_rate(terms.alone)}"
    if not count and terms.demand <= terms.alone:
        return f"no workers: {asks}, and {alone}; {costs}"
    if not count and terms.best == terms.ceiling:
        return f"no workers: given up: {_bound(terms)}, where {alone}; {costs}"
    if not count:
        return f"no workers: they would not pay: with them, {_bound(terms)}, where {alone}; {costs}"
    if terms.best <= terms.demand:
        return f"{_workers(count)}: {costs}, and {asks}; {_bound(terms)}"
    return f"{_workers(count)}: {costs}, and {asks}: {count} deliver that"


def _bound(terms: Terms) -> str:
    """Which bound of the model the best rate meets, and that rate, in words."""
    if terms.best == terms.ceiling:
        return f"workers delivered at most {_rate(terms.best)} while the trainer waited"
    if terms.h and terms.best == 1 / terms.h:
        return f"the host's thread hands on at most {_rate(terms.best)} ({_ms(terms.h)} a record)"
    if terms.best == terms.most / terms.t:
        return f"{_workers(terms.most)}, the most allowed, deliver at most {_rate(terms.best)}"
    left = f"the {_figure(terms.cpus)} CPUs that the trainer and others leave of the budget of {_figure(terms.budget)}"
    return f"{left} deliver at most {_rate(terms.best)}"


def _figure(value: float) -> str:
    """`value` for people: two significant digits, whole numbers from 10 (0.62, 7.4, 12, 1,234; no exponent)."""
    if value >= 10:
        return f"{value:,.0f}"
    return f"{max(value, 0.001) if value else 0:.2g}"


def _rate(records_per_s: float) -> str:
    return f"{records_per_s:,.0f} records/s"


def _workers(count: int) -> str:
    return f"{count} worker" + ("" if count == 1 else "s")


def _ms(seconds: float) -> str:
    return f"{_figure(seconds * 1000)} ms" if seconds >= 9.995e-4 else f"{_figure(seconds * 1e6)} µs"  # (999.6 µs: 1 ms)


def _costs(t: float, c: float, whose: str) -> str:
    """What a record costs (`whose`: a worker's, the host's thread's), in words: its CPU, or
    where it mostly waits (for I/O, a remote call or a busy CPU), both."""
    if c >= 0.8 * t:
        return f"a record costs {_ms(c)} of {whose} CPU"
    thread = "a worker" if whose == "a worker's" else "the host's thread"
    return f"a record takes {thread} {_ms(t)}, {_ms(c)} of it on a CPU (it waits the rest)"


# what to try where the trainer waits, by the bound a sentence names (the first found; a
# sentence that says workers would not pay names the bound that keeps them from paying)
_NEXT = (
    (
        "given up:",
        "workers delivered less than their costs promised, as when another job takes the host's CPUs: "
        "see what else runs on the host (they are tried again after 30 s)",
    ),
    ("the most allowed", "allow more workers (--workers N, or workers=N on cd.InProcess or cd.Sidecar)"),
    (
        "CPUs that the trainer and others leave",
        "give the host more CPUs (the container's CPU quota), Ray workers (--workers ray:...), or cheaper transforms",
    ),
    ("the host's thread hands on at most", "more hosts (or sidecars) share the batch, or bigger batches of fewer columns"),
)


def advice(why: str) -> str | None:
    """What to try for a host whose trainer waits, from its sentence `why` (as `sentence`
    says it): by the bound it names; None where it names none (the trainer's demand)."""
    return next((what for said, what in _NEXT if said in why), None)
