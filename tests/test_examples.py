"""The programs of examples/, run as a user would: `examples/multihost.py` (whose worker
docs/multi-host.md shows) starts two `jax.distributed` processes on the demo corpus, each
computing only its own host. `examples/train_lm.py` has tests/test_train_lm.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def run_example(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "multihost.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def state_in(out: str) -> dict:
    """The state line process 0 prints, parsed; the whole output when it is missing."""
    found = re.search(r"^state: (.*)$", out, re.M)
    assert found is not None, f"no 'state:' line in the output:\n{out}"
    return json.loads(found.group(1))


def test_multihost_example_runs_and_resumes() -> None:
    out = run_example("--processes", "2", "--steps", "3")
    for process in (0, 1):
        assert f"process {process} computes host(s) [{process}] of 2" in out, out
        held = re.findall(rf"process {process} step \d: global \(16, 128\), holds rows starting at (\[.*\])", out)
        assert held == [str([8 * process, 8 * process + 4])] * 3, out  # 2 devices x 4 rows, its own half
    state = state_in(out)
    assert state["position"] == 3 * 16 and state["epoch"] == 0
    again = run_example("--processes", "2", "--steps", "2", "--state", json.dumps(state))
    assert state_in(again)["position"] == 5 * 16
