"""The start-up gate on a real 64 MB tmpfs (root): `colo-data doctor CONFIG` sizes the
config's shared-memory ring exactly as a sidecar session does and fails, after its report,
when the ring cannot fit; `colo-data sidecar serve CONFIG` fails at start with the same
message, before it listens. On a Pathways client (JAX_PLATFORMS=proxy) the doctor warns of
compiler flags and a JAX cache directory set where they do nothing, and does not fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner
from start_gate import demo_config, tmpfs

from colo_data.backends.sidecar.client import SidecarClient
from colo_data.cli import main

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


def test_doctor_reports_an_shm_dir_that_is_a_file_as_a_fatal_finding(tmp_path: Path) -> None:
    """Issue 26: a regular file as the shm dir was reported healthy (its file system's free
    space); no ring can be made in it, so the doctor fails after its report, naming it."""
    shm = tmp_path / "shm"
    shm.write_text("not a directory")
    expected = f"is {shm}, which is a regular file, not a directory: point it at a memory-backed directory"
    result = doctor("--shm-dir", str(shm), "--json")
    assert result.exit_code == 1, result.output
    assert expected in json.loads(result.stdout)["shm"]["error"]
    assert result.stderr.startswith("Error: the shm dir (") and expected in result.stderr
    text = doctor("--shm-dir", str(shm))
    assert text.exit_code == 1 and "free (UNUSABLE: see below)" in text.stdout and expected in text.stderr


def doctor_process(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`colo-data doctor ARGS` as a process with this environment, less any JAX_*, XLA_FLAGS
    or LIBTPU_INIT_ARGS of the test run's own, plus `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    return subprocess.run([str(COLO), "doctor", *args], env=base | env, capture_output=True, text=True, timeout=300)


def doctor_processes(*calls: tuple[dict[str, str], tuple[str, ...]]) -> list[subprocess.CompletedProcess[str]]:
    """`doctor_process(env, *args)` for each `(env, args)`, the processes side by side: each
    spends its seconds importing JAX on one CPU, so two take about the time of one on 2 CPUs."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: doctor_process(call[0], *call[1]), calls))


CLIENT_ENV = {  # flags XLA's CPU backend takes, so that only where they are set matters
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2  --xla_dump_hlo_as_text",
    "LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true",
    "JAX_COMPILATION_CACHE_DIR": "/tmp/jax-cache",
}


def test_doctor_on_a_pathways_client_warns_of_settings_that_do_not_reach_the_compiler() -> None:
    """JAX_PLATFORMS=proxy without a proxy to reach: the JAX part is reported unavailable,
    the warnings name the flags and the cache directory, and the exit status stays 0."""
    result, text = doctor_processes(
        ({**CLIENT_ENV, "JAX_PLATFORMS": "proxy"}, ("--json",)), ({**CLIENT_ENV, "JAX_PLATFORMS": "proxy"}, ())
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["jax"]["pathways"] and report["jax"]["backend"] is None and report["jax"]["devices"] == []
    assert "Unable to initialize backend 'proxy'" in report["jax"]["error"]
    xla, libtpu, cache, scratch = report["warnings"]
    assert xla.startswith("XLA_FLAGS is set in this JAX client's environment ")
    assert "(--xla_force_host_platform_device_count=2 --xla_dump_hlo_as_text)" in xla
    assert "do not reach the compiler" in xla and "pathways-proxy" in xla
    assert "--set xla_flags='--xla_force_host_platform_device_count=2 --xla_dump_hlo_as_text'" in xla
    assert libtpu.startswith("LIBTPU_INIT_ARGS is set") and "xla_flags='--xla_tpu_enable_latency_hiding_scheduler=true'" in libtpu
    assert cache.startswith("JAX_COMPILATION_CACHE_DIR is set (/tmp/jax-cache)") and "pathwaysutils.initialize()" in cache
    assert scratch.startswith("no Pathways persistent compilation cache location is set") and "--gcs_scratch_location" in scratch
    assert "--set gcs_scratch=gs://BUCKET/pathways" in scratch and "COLO_DATA_PATHWAYS_SCRATCH" in scratch

    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    warned = [line.split()[1] for line in lines if line.startswith("warning ")]
    assert warned == ["XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_COMPILATION_CACHE_DIR", "no"]
    assert any(line.startswith("jax backend") and "unavailable: Unable to initialize backend 'proxy'" in line for line in lines)


def test_doctor_finds_the_pathways_compilation_cache_location_in_the_environment_or_the_config(tmp_path: Path) -> None:
    """The location comes from the variable the JobSet gives the trainer, or from CONFIG's
    [deploy] gcs_scratch; one that is not on GCS is a warning of its own."""
    proxy = {"JAX_PLATFORMS": "proxy"}
    config = tmp_path / "train.toml"
    config.write_text('pipeline = "colo_data.demo:pipeline"\n[args]\nseq_len = 64\n[deploy]\ngcs_scratch = "gs://bucket/p"\n')
    given, local, from_config = doctor_processes(
        ({**proxy, "COLO_DATA_PATHWAYS_SCRATCH": "gs://bucket/pathways"}, ("--json",)),
        ({**proxy, "COLO_DATA_PATHWAYS_SCRATCH": "/tmp/pathways"}, ("--json",)),
        (proxy, (str(config), "--json")),
    )
    assert given.returncode == 0 and json.loads(given.stdout)["warnings"] == [], given.stdout + given.stderr
    (warning,) = json.loads(local.stdout)["warnings"]
    assert warning.startswith("the Pathways persistent compilation cache location is '/tmp/pathways', not a gs:// location")
    assert from_config.returncode == 0 and json.loads(from_config.stdout)["warnings"] == [], from_config.stderr


def test_doctor_off_pathways_gives_no_warnings() -> None:
    result, text = doctor_processes(({**CLIENT_ENV, "JAX_PLATFORMS": "cpu"}, ("--json",)), (CLIENT_ENV, ()))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["warnings"] == [] and report["jax"]["error"] is None
    assert report["jax"]["backend"] == "cpu" and len(report["jax"]["devices"]) == 2  # XLA_FLAGS reached this compiler
    assert text.returncode == 0, text.stderr
    assert "warning" not in text.stdout and "jax backend" in text.stdout
