"""The start-up gate on a real 64 MB tmpfs (root): `colo-data doctor CONFIG` sizes the
config's shared-memory ring exactly as a sidecar session does and fails, after its report,
when the ring cannot fit; `colo-data sidecar serve CONFIG` fails at start with the same
message, before it listens."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from colo_data.cli import main
from colo_data.backends.sidecar.client import SidecarClient

from start_gate import demo_config, tmpfs

COLO = Path(sys.executable).parent / "colo-data"
TOO_BIG = dict(seq_len=2**17, global_batch_size=12)  # 12 rows x 512 KiB: 4 slots need 24 MiB


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs: what a container's small /dev/shm looks like."""
    with tmpfs(tmp_path / "shm", "16m") as mount:
        yield mount


def doctor(*args: str):
    return CliRunner().invoke(main, ["doctor", *args])


def test_doctor_sizes_the_ring_as_the_sidecar_does(token_corpus: Path, small_shm: Path, tmp_path: Path) -> None:
    config = demo_config(tmp_path, token_corpus, seq_len=8, global_batch_size=12)
    result = doctor(str(config), "--shm-dir", str(small_shm), "--json")
    assert result.exit_code == 0, result.output
    ring = json.loads(result.stdout)["ring"]
    assert ring["fits"] and ring["error"] is None
    assert ring["free_bytes"] == 16 * 2**20 and ring["needed_bytes"] == ring["slots"] * ring["slot_bytes"]

    socket = tmp_path / "host0.sock"
    server = subprocess.Popen([str(COLO), "sidecar", "serve", str(config), "--socket", str(socket), "--shm-dir", str(small_shm)])
    try:
        client = SidecarClient(f"unix://{socket}", server.pid)
        batches = client.batches(None, 0, 1, 0)  # the config's pipeline, as one host
        next(batches)
        assert (client.info["slots"], client.info["batches_per_slot"], client.info["slot_bytes"]) == (
            ring["slots"],
            ring["batches_per_slot"],
            ring["slot_bytes"],
        )
        assert ring["batches_per_slot"] > 1, "small batches share a slot"
        batches.close()
    finally:
        server.terminate()
        server.wait(10)


def test_doctor_refuses_a_ring_too_big_and_says_how_to_fix_it(token_corpus: Path, small_shm: Path, tmp_path: Path) -> None:
    config = demo_config(tmp_path, token_corpus, **TOO_BIG)
    result = doctor(str(config), "--shm-dir", str(small_shm), "--json")
    assert result.exit_code == 1
    ring = json.loads(result.stdout)["ring"]  # the report comes first
    slot = 128 + 12 * 2**17 * 4 + 12 * 8  # id (96 bytes, to a 64-byte boundary), tokens, _index
    assert (ring["fits"], ring["slots"], ring["slot_bytes"], ring["needed_bytes"]) == (False, 4, slot, 4 * slot)
    message = result.stderr
    assert message.startswith(f"Error: {config}: a ring of 4 slots x {slot} bytes needs {4 * slot} bytes")
    assert f"but {small_shm} has {16 * 2**20} bytes (16.0 MiB) free" in message
    assert "--shm-size" in message and "fewer slots" in message

    text = doctor(str(config), "--shm-dir", str(small_shm), "--slots", "2")  # 12 MiB fits 16
    assert text.exit_code == 0, text.output
    assert "2 slots x" in text.stdout
    assert [line.split()[-1] for line in text.stdout.splitlines() if line.startswith("ring fits")] == ["yes"]


def test_more_hosts_make_a_smaller_ring(token_corpus: Path, small_shm: Path, tmp_path: Path) -> None:
    config = demo_config(tmp_path, token_corpus, **TOO_BIG)
    result = doctor(str(config), "--shm-dir", str(small_shm), "--hosts", "2", "--json")
    assert result.exit_code == 0, result.output
    ring = json.loads(result.stdout)["ring"]
    assert ring["hosts"] == 2 and ring["slot_bytes"] == 64 + 6 * 2**17 * 4 + 6 * 8


def test_serve_fails_at_start_when_the_ring_cannot_fit(token_corpus: Path, small_shm: Path, tmp_path: Path) -> None:
    config = demo_config(tmp_path, token_corpus, **TOO_BIG)
    socket = tmp_path / "host0.sock"
    server = subprocess.run(
        [str(COLO), "sidecar", "serve", str(config), "--socket", str(socket), "--shm-dir", str(small_shm)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert server.returncode == 1
    assert f"Error: {config}: a ring of 4 slots x " in server.stderr and "--shm-size" in server.stderr
    assert "Traceback" not in server.stderr and "COLO_DATA_HOSTS" in server.stderr
    assert not socket.exists(), "it never listened"

