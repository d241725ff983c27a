"""What `verify` reports and compares, for either pipeline kind: a `Check` (one line of
`colo-data verify`), the one-device mesh its loaders run on, and the rows in which two
columns differ."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh

Status = Literal["PASS", "FAIL", "SKIP"]
Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class Check:
    """One verification: its name, PASS, FAIL or SKIP, and what was seen (on a failure:
    the host count, the first offending batch and row, and the record there)."""

    name: str
    status: Status
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def __str__(self) -> str:
        return f"{self.status}  {self.name}: {self.detail}"


def one_device() -> Mesh:
    """A mesh of one device, on which simulated hosts run with a batch size that need only
    divide by the host count: the checks are about hosts, not devices."""
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def differing_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows whose bytes differ (bytes, so that NaN equals NaN)."""
    width = int(np.prod(a.shape[1:])) * a.dtype.itemsize
    first, second = (np.ascontiguousarray(x).view(np.uint8).reshape(len(x), width) for x in (a, b))
    return np.flatnonzero((first != second).any(axis=1))
