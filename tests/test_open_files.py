"""Open files stay bounded: a source of 1,500 files reads whole, globally shuffled, under a
`ulimit -n` of 1024 (a source holds no file open between reads); running out of file
descriptors is a `ResourceError` that names the limit, never a corrupt file; and a mixture
of 256 components costs the threads, file descriptors and memory of one of 4 (beyond its
metadata), with a small state. Each runs in a process of its own, whose limits it sets."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MANY_FILES = """
import json, resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import colo_data as cd
from colo_data.testing import read_all

pipeline = cd.Pipeline(source=cd.ArrowSource(sys.argv[1] + "/*.parquet"), order=cd.Order(shuffle="global", seed=1),
                       global_batch_size=60)
ids = np.concatenate([b["id"] for b in read_all(cd.Loader(pipeline))])
# then no descriptor left at all: a read that must open a file (of a source not read yet) says so
import os
fresh = cd.ArrowSource(sys.argv[1] + "/*.parquet")
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    fresh.take(np.arange(0, 15000, 10))
    error = None
except Exception as e:
    error = [type(e).__name__, str(e)]
print(json.dumps({"ids": sorted(ids.tolist()), "error": error}))
"""

MIXTURE = """
import json, sys
import psutil
import colo_data as cd

root, count = sys.argv[1], int(sys.argv[2])
components = {f"c{c}": cd.ArrowSource(f"{root}/c{c}") for c in range(count)}
pipeline = cd.Pipeline(source=cd.Mix(components, {name: 1 for name in components}), order=cd.Order(shuffle="global", seed=1),
                       transforms=[cd.pad_or_truncate("tokens", 8)], global_batch_size=64, epochs=None)
me = psutil.Process()
# no workers: a pool the policy counts for the costlier mixture (its fork server's and workers' sockets)
# comes with the workers, not with the components, and would be counted as theirs
with cd.Loader(pipeline, backend=cd.InProcess(workers=0)) as loader:
    for _ in range(60):
        next(loader)
    state = loader.get_state()
    print(json.dumps({"threads": me.num_threads(), "fds": me.num_fds(), "rss": me.memory_info().rss,
                      "state_bytes": len(json.dumps(state))}))
"""


def child(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_source_of_1500_files_reads_whole_under_ulimit_1024_and_running_out_is_named(tmp_path: Path) -> None:
    for i in range(1500):
        pq.write_table(pa.table({"id": np.arange(i * 10, i * 10 + 10)}), tmp_path / f"part-{i:05d}.parquet")
    got = child(MANY_FILES, str(tmp_path))
    assert got["ids"] == list(range(15000)), "every record of the 1,500 files once"
    kind, message = got["error"]
    assert kind == "ResourceError" and "too many open files" in message and "RLIMIT_NOFILE" in message, got["error"]
    assert "Rewrite or remove" not in message, "a good file is not called damaged"


def test_256_components_cost_what_4_do(tmp_path: Path) -> None:
    """The same 5,120 records as 256 components or as 4: threads, file descriptors and
    resident memory within 10% (file descriptors: or 2, as a read-ahead thread may hold a
    file open at the moment they are counted), and a state of at most 16 KiB."""
    measured = {}
    for count in (4, 256):
        root = tmp_path / str(count)
        per = 5120 // count
        for c in range(count):
            (root / f"c{c}").mkdir(parents=True)
            tokens = [list(range(i % 7 + 1)) for i in range(per)]
            pq.write_table(pa.table({"id": np.arange(per), "tokens": tokens}), root / f"c{c}" / "part.parquet", row_group_size=16)
        measured[count] = child(MIXTURE, str(root), str(count))
    few, many = measured[4], measured[256]
    for what in ("threads", "fds", "rss"):
        allowed = max(1.1 * few[what], few[what] + 2) if what == "fds" else 1.1 * few[what]
        assert many[what] <= allowed, f"{what}: 256 components {many[what]}, 4 components {few[what]}"
    assert many["state_bytes"] <= 16 * 1024, many
