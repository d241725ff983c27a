"""The worker-count policy's one sentence: why a host pipeline has the workers it has, in
the terms of the policy's model (`worker_policy`), e.g. "6 workers: a record costs 1.1 ms
of a worker's CPU, and the trainer takes 5,200 records/s: 6 deliver that"."""

from __future__ import annotations

import math
from typing import NamedTuple


class Terms(NamedTuple):
    """The model's terms as measured: seconds a record (a worker's work `t` and CPU `c`,
    the host's thread's hand-off `h`), the CPUs there are for workers, records a second (the
    trainer's demand, inf while it waits for input; the host's thread alone; the best with
    the most workers; what the trainer took at most with workers), the budget and the most
    workers allowed."""

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
    costs = _costs(terms.t, terms.c)
    asks = "the trainer waits for input" if terms.demand == math.inf else f"the trainer takes {_rate(terms.demand)}"
    if not count and terms.alone >= min(terms.demand, terms.best):
        return f"no workers: the host's thread alone makes {_rate(terms.alone)}; {costs}, and {asks}"
    if not count:
        return (
            f"no workers: {costs}; with them the host would deliver at most {_rate(terms.best)} "
            f"({_bound(terms)}), against {_rate(terms.alone)} from its own thread"
        )
    if terms.best <= terms.demand:
        return f"{_workers(count)}: {costs}, and {asks}; {_bound(terms)}"
    return f"{_workers(count)}: {costs}, and {asks}: {count} deliver that"


def _bound(terms: Terms) -> str:
    """Which bound of the model the best rate meets, in words."""
    if terms.best == terms.ceiling:
        return f"with workers the trainer itself took at most {_rate(terms.best)}"
    if terms.h and terms.best == 1 / terms.h:
        return f"the host's thread hands on at most {_rate(terms.best)} ({_ms(terms.h)} a record)"
    if terms.best == terms.most / terms.t:
        return f"{_workers(terms.most)} is the most allowed"
    left = f"the {terms.cpus:.3g} CPUs that the trainer and others leave of the budget of {terms.budget:g}"
    return f"{left} deliver at most {_rate(terms.best)}"


def _rate(records_per_s: float) -> str:
    return f"{records_per_s:,.0f} records/s"


def _workers(count: int) -> str:
    return f"{count} worker" + ("" if count == 1 else "s")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.2g} µs"


def _costs(t: float, c: float) -> str:
    """What a record costs a worker, in words: its CPU, or where it mostly waits, both."""
    if c >= 0.8 * t:
        return f"a record costs {_ms(c)} of a worker's CPU"
    return f"a record takes a worker {_ms(t)}, {_ms(c)} of it on a CPU (it waits the rest)"
