"""The colocated-Python backend on a CPU-only JAX, where colocated calls run in this
process: each CPU device stands for a host. Host identity comes from the mesh, batches equal
the in-process backend's, resume works through it, errors are colo-data errors naming the
host they came from, a sidecar's warnings reach the trainer naming theirs, and closing
releases the colocated objects. The 8-host check runs in a fresh Python whose JAX starts
with 8 CPU devices (this session's JAX has 4)."""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import psutil
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import colo_data as cd
from colo_data.host.host_pipeline import HostPipeline
from colo_data import defaults
from colo_data.backends import colocated
from colo_data.backends.colocated import ColocatedHosts, colocated_hosts
from colo_data.host import shares
from colo_data.pipeline.state import make_state, restore_position
from colo_data.testing import assert_batches_equal, read_all, to_numpy

from pipelines import BATCH, idle_host, make_pipeline

HOSTS_8_BATCH = 16  # divisible by 8 hosts
SHUFFLES = ("none", "global", "block")


def reference(pipeline: cd.Pipeline, start: int = 0, steps: int | None = None) -> list[dict[str, np.ndarray]]:
    """`steps` global batches (all when None) from `start` on, computed by one in-process host."""
    return [dict(c.columns) for c in itertools.islice(HostPipeline(pipeline, 0, 1).chunks(start, batches=1), steps)]


def mesh_of(devices: list[jax.Device]) -> Mesh:
    return Mesh(np.array(devices), ("data",))


def test_hosts_are_the_mesh_cpu_devices_in_mesh_order() -> None:
    devices = jax.devices()
    assert len(devices) == 4
    assert colocated_hosts(mesh_of(devices)) == devices
    assert colocated_hosts(mesh_of(devices[::-1])) == devices[::-1]
    grid = Mesh(np.array([devices[2], devices[0], devices[3], devices[1]]).reshape(2, 2), ("data", "model"))
    assert colocated_hosts(grid) == [devices[2], devices[0], devices[3], devices[1]]


def test_hosts_of_accelerators_are_their_colocated_cpus_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Pathways every accelerator of a host maps to the host's one CPU device."""
    chips = [SimpleNamespace(platform="tpu", id=i) for i in range(8)]
    cpus = jax.devices()
    host_of_chip = [cpus[1], cpus[1], cpus[0], cpus[0], cpus[3], cpus[3], cpus[2], cpus[2]]
    asked = []

    def fake_colocated_cpu_devices(devices: tuple) -> list:
        asked.append(devices)
        return [host_of_chip[d.id] for d in devices]

    monkeypatch.setattr(colocated, "colocated_cpu_devices", fake_colocated_cpu_devices)
    mesh = SimpleNamespace(devices=np.array(chips, dtype=object).reshape(2, 4))
    assert colocated_hosts(mesh) == [cpus[1], cpus[0], cpus[3], cpus[2]]
    assert asked == [tuple(chips)]


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_batches_equal_in_process_and_each_host_serves_its_rows(token_corpus: Path, shuffle: str) -> None:
    pipeline = make_pipeline(token_corpus, shuffle)
    devices = jax.devices()[::-1]  # host h is the h-th device of the mesh, whatever its id
    with ColocatedHosts(pipeline, mesh_of(devices)) as hosts:
        batches = list(hosts.batches(0))
    got = [to_numpy(b) for b in batches]
    assert_batches_equal(reference(pipeline), got, f"colocated, {shuffle}")
    in_process = read_all(cd.Loader(pipeline, hosts=4))
    assert_batches_equal(in_process, got, "in-process loader")
    assert {n: a.dtype for n, a in got[0].items()} == {n: a.dtype for n, a in in_process[0].items()}
    for step, batch in enumerate(batches):
        for name, array in batch.items():
            assert array.shape[0] == BATCH
            for shard in array.addressable_shards:
                host = devices.index(shard.device)
                want = next(HostPipeline(pipeline, host, 4).chunks(step * BATCH, batches=1)).columns[name]
                np.testing.assert_array_equal(np.asarray(shard.data), want, err_msg=f"batch {step}, {name!r}, host {host}")


def test_device_put_onto_the_target_sharding(token_corpus: Path) -> None:
    """What the loader does with each batch: move it from the hosts' CPU devices onto the
    mesh with the target sharding (here a 2x2 mesh, batch over "data")."""
    pipeline = make_pipeline(token_corpus)
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
    with ColocatedHosts(pipeline, mesh) as hosts:
        batch = next(iter(hosts.batches(0)))
        placed = jax.device_put(batch, {n: NamedSharding(mesh, PartitionSpec("data")) for n in batch})
    for name, array in placed.items():
        assert array.sharding == NamedSharding(mesh, PartitionSpec("data")), name
        assert array.dtype == batch[name].dtype
        np.testing.assert_array_equal(np.asarray(array), reference(pipeline)[0][name])
        shards = {s.device: np.asarray(s.data) for s in array.addressable_shards}
        assert len(shards[devices[0]]) == BATCH // 2
        np.testing.assert_array_equal(shards[devices[0]], shards[devices[1]])  # replicated over "model"


def test_resume_from_every_state(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus)
    full = reference(pipeline)
    with ColocatedHosts(pipeline, mesh_of(jax.devices())) as hosts:
        for k in range(len(full) + 1):
            state = json.loads(json.dumps(make_state(pipeline, k * BATCH)))
            rest = [to_numpy(b) for b in hosts.batches(restore_position(pipeline, state))]
            assert_batches_equal(full[k:], rest, f"resumed after step {k}")


def test_endless_stream_crosses_epochs_and_stops_early(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, epochs=None)
    with ColocatedHosts(pipeline, mesh_of(jax.devices())) as hosts:
        batches = hosts.batches(7 * BATCH)
        got = [to_numpy(next(batches)) for _ in range(6)]  # positions 84..155: epochs 0 and 1
        batches.close()
    assert_batches_equal(reference(pipeline, 7 * BATCH, 6), got, "across epochs")


def test_calls_are_chunks_of_batches(token_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One colocated call per `batches_per_call` batches, sized like the in-process chunks,
    but the first: one batch, whose bytes bound the rest (these are small: 4 batches a call)."""
    pipeline = make_pipeline(token_corpus, epochs=3)
    monkeypatch.setitem(shares._KINDS, cd.Pipeline, _SmallChunks)  # the host side a native pipeline runs as
    with ColocatedHosts(pipeline, mesh_of(jax.devices())) as hosts:
        assert hosts.batches_per_call == 4
        calls = []
        call = hosts._call

        def counted(method: str, request: jax.Array) -> object:
            calls.append((method, request.shape))
            return call(method, request)

        monkeypatch.setattr(hosts, "_call", counted)
        got = [to_numpy(b) for b in hosts.batches(3 * BATCH)]
    assert_batches_equal(reference(pipeline, 3 * BATCH), got, "4 batches a call")
    # 27 batches left: 1, then 4 a call, then the last 2
    assert calls == [("batches", (4, 1, 2))] + [("batches", (4, 4, 2))] * 6 + [("batches", (4, 2, 2)), ("close", (4, 1, 2))]


class _SmallChunks(HostPipeline):
    @property
    def chunk(self) -> int:
        return 4


@pytest.mark.usefixtures("own_cpu_budget")
def test_workers_run_in_the_colocated_object_and_close_stops_them(
    token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One host with two worker processes allowed; chunks of one batch, cut to the calls' size.
    Where the host's own thread is slow the worker policy counts workers (their fork server
    and they start then): the batches are the same."""
    monkeypatch.setattr(defaults, "CHUNK_RECORDS", BATCH)
    pipeline = make_pipeline(token_corpus, epochs=None, transforms=[idle_host, cd.pad_or_truncate("tokens", 8)])
    before = _children()
    hosts = ColocatedHosts(pipeline, mesh_of(jax.devices()[:1]), workers=2)
    batches = hosts.batches(0)
    got, deadline = [], time.monotonic() + 60
    while len(_children() - before) < 2 or len(got) < 12:  # a fork server and a worker at least
        assert time.monotonic() < deadline, "the host's workers never started"
        got.append(to_numpy(next(batches)))
    got += [to_numpy(next(batches)) for _ in range(24)]  # and make some of these
    assert 2 <= len(_children() - before) <= 3  # the fork server and its workers, still running: the stream is endless
    batches.close()
    hosts.close()
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children() - before, "worker processes left behind"
    assert_batches_equal(reference(pipeline, 0, len(got)), got, "1 host, 2 workers")


def _children() -> set[int]:
    return {
        c.pid
        for c in psutil.Process().children(recursive=True)
        if c.is_running() and c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())
    }


def _live_host_objects() -> int:
    gc.collect()
    return sum(isinstance(o, colocated._ColocatedHost) for o in gc.get_objects())


def test_close_releases_the_colocated_objects_and_batches_reopens(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus)
    before = _live_host_objects()
    hosts = ColocatedHosts(pipeline, mesh_of(jax.devices()))
    first = [to_numpy(b) for b in hosts.batches(0)]
    assert _live_host_objects() == before + 1  # on a CPU-only JAX one object serves every host
    hosts.close()
    assert _live_host_objects() == before
    hosts.close()  # closing twice is harmless
    again = [to_numpy(b) for b in hosts.batches(0)]
    assert _live_host_objects() == before + 1
    hosts.close()
    assert_batches_equal(first, again, "after reopening")


def bad_record_0(batch: dict) -> dict:
    if 0 in batch["_index"]:
        raise ValueError("bad record 0")
    return batch


def test_transform_error_passes_through_and_the_hosts_keep_serving(token_corpus: Path) -> None:
    """The failing first batch call must not lose the colocated object: the next request,
    where no batch holds record 0, is served."""
    pipeline = make_pipeline(token_corpus, "none", transforms=[cd.pad_or_truncate("tokens", 8), bad_record_0])
    with ColocatedHosts(pipeline, mesh_of(jax.devices())) as hosts:
        failed = r"bad_record_0.*on host 0 of 4, batch at position 0.*ValueError: bad record 0"
        with pytest.raises(cd.errors.TransformError, match=failed):
            next(hosts.batches(0))
        rest = [to_numpy(b) for b in hosts.batches(BATCH)]
    assert_batches_equal(reference(make_pipeline(token_corpus, "none"), BATCH), rest, "after the failure")


def test_remote_failures_become_colo_data_errors() -> None:
    """Under Pathways the sidecar sends the error's text, not the exception."""
    hosts = jax.devices()
    remote = RuntimeError("INTERNAL: colocated python: Traceback ...\ncolo_data.errors.SchemaError: column 'x' is missing")
    error = colocated._as_colo_data_error(remote, hosts)
    assert type(error) is cd.errors.SchemaError and "column 'x' is missing" in str(error)
    error = colocated._as_colo_data_error(RuntimeError("UNAVAILABLE: connection reset; KeyError: 3"), hosts)
    assert type(error) is cd.errors.SidecarError
    assert "4 hosts" in str(error) and "UNAVAILABLE" in str(error) and "colo-data" in str(error)


def bad_record_7(batch: dict) -> dict:
    if 7 in batch["_index"]:  # with no shuffle, host 2's rows 6 to 8 of the first batch
        raise ValueError("bad record 7")
    return batch


def test_a_hosts_transform_error_names_the_host_and_carries_its_traceback(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, "none", transforms=[cd.pad_or_truncate("tokens", 8), bad_record_7])
    with ColocatedHosts(pipeline, mesh_of(jax.devices())) as hosts:
        with pytest.raises(cd.errors.TransformError) as failed:
            next(hosts.batches(0))
    message = str(failed.value)
    assert "--- raised in the colocated-Python sidecar of host 2 of 4 ---" in message and "ValueError: bad record 7" in message
    printed = "".join(traceback.format_exception(failed.value))
    assert 'raise ValueError("bad record 7")' in printed  # the remote traceback's lines, on its cause
    # Under Pathways the controller gets the sidecar's text of the exception: the same type comes back.
    remote = RuntimeError("INTERNAL: " + printed)
    again = colocated._as_colo_data_error(remote, jax.devices())
    assert type(again) is cd.errors.TransformError and "sidecar of host 2 of 4" in str(again)


class _LostRowGroup(HostPipeline):
    def chunks(self, start_position: int, owner: Any = None, batches: int | None = None) -> Any:
        if self.host == 1:
            raise KeyError("row group 3")
        return super().chunks(start_position, owner, batches)


def test_any_other_failure_of_a_hosts_work_is_a_sidecar_error_naming_the_host(
    token_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(shares._KINDS, cd.Pipeline, _LostRowGroup)
    with ColocatedHosts(make_pipeline(token_corpus), mesh_of(jax.devices())) as hosts:
        with pytest.raises(cd.errors.SidecarError) as failed:
            next(hosts.batches(0))
    message = str(failed.value)
    assert message.startswith("KeyError: 'row group 3'\n--- raised in the colocated-Python sidecar of host 1 of 4 ---")
    assert type(failed.value.__cause__) is KeyError
    assert 'raise KeyError("row group 3")' in "".join(traceback.format_exception(failed.value))


class OddRecordWarning(UserWarning):
    """A category of the pipeline's own."""


def warn_of_record_4(batch: dict) -> dict:
    if 4 in batch["_index"]:  # with no shuffle, host 1's rows 3 to 5 of the first batch
        warnings.warn("record 4 looks odd", OddRecordWarning, stacklevel=1)
    return batch


def test_warnings_of_a_hosts_work_reach_the_trainer_naming_the_host(token_corpus: Path) -> None:
    """In a sidecar's process (here: told it is in one) a host's warnings are kept and
    re-issued in the trainer's, naming the host; in the trainer's own process they need no
    carrying."""
    pipeline = make_pipeline(token_corpus, "none", transforms=[cd.pad_or_truncate("tokens", 8), warn_of_record_4])
    gc.collect()
    before = [o for o in gc.get_objects() if isinstance(o, colocated._ColocatedHost)]
    with ColocatedHosts(pipeline, mesh_of(jax.devices())) as hosts:
        gc.collect()
        (side,) = [o for o in gc.get_objects() if isinstance(o, colocated._ColocatedHost) and not any(o is b for b in before)]
        assert not side.carries_warnings
        side.carries_warnings = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [to_numpy(b) for b in hosts.batches(0)]
    assert_batches_equal(reference(make_pipeline(token_corpus, "none")), got, "with warnings")
    (warning,) = [w for w in caught if issubclass(w.category, UserWarning)]
    assert warning.category is OddRecordWarning
    text = str(warning.message)
    assert text.startswith("host 1 of 4, in its colocated-Python sidecar: record 4 looks odd (")
    assert f"{Path(__file__).name}:" in text  # where the transform warned


def test_carried_warnings_fit_their_note() -> None:
    """Each host's warnings of a call travel in a fixed-size note; what does not fit is
    counted, and the trainer is told to read the sidecar's log for it."""
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        for i in range(500):
            warnings.warn(f"warning {i} " + "x" * 50, RuntimeWarning, stacklevel=1)
    with warnings.catch_warnings(record=True) as logged:  # here: the sidecar's stderr
        note = colocated._note(raised)
    assert note.dtype == np.uint8 and note.shape == (colocated.NOTE_BYTES,)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        colocated._reissue(np.stack([np.zeros_like(note), note]))
    texts = [str(w.message) for w in caught]
    assert all(t.startswith("host 1 of 2, in its colocated-Python sidecar: ") for t in texts)
    assert "warning 0 x" in texts[0] and all(w.category is RuntimeWarning for w in caught[:-1])
    assert 10 < len(texts) < 500 and texts[-1].endswith(
        f"{501 - len(texts)} more warning(s) did not fit the note the sidecar sends; its log has them"
    )
    assert [str(w.message) for w in logged] == [str(w.message) for w in raised[len(texts) - 1 :]]


def test_batch_not_divisible_by_hosts(token_corpus: Path) -> None:
    pipeline = make_pipeline(token_corpus, global_batch_size=10)
    message = r"global_batch_size=10 is not divisible by the 4 hosts.*use a multiple of 4, e.g. 8 or 12"
    with pytest.raises(cd.errors.ConfigError, match=message):
        ColocatedHosts(pipeline, mesh_of(jax.devices()))
    with pytest.raises(cd.errors.ConfigError, match=r"workers=-1"):
        ColocatedHosts(make_pipeline(token_corpus), mesh_of(jax.devices()), workers=-1)


EIGHT_HOSTS = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    import colo_data as cd
    from colo_data.backends.colocated import ColocatedHosts
    from colo_data.pipeline.state import make_state, restore_position
    from pipelines import make_pipeline

    corpus, out, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    devices = jax.devices()
    assert len(devices) == 8, devices
    mesh = Mesh(np.array(devices), ("data",))
    target = NamedSharding(mesh, PartitionSpec("data"))
    results = {}
    for shuffle in ("none", "global", "block"):
        pipeline = make_pipeline(corpus, shuffle, global_batch_size=size)
        with ColocatedHosts(pipeline, mesh) as hosts:
            results[f"{shuffle}/hosts"] = np.array([d.id for d in hosts.hosts])
            for step, batch in enumerate(hosts.batches(0)):
                for name, array in batch.items():
                    shards = array.addressable_shards
                    results[f"{shuffle}/full/{step}/{name}"] = np.asarray(jax.device_put(array, target))
                    results[f"{shuffle}/shard_devices/{step}/{name}"] = np.array([s.device.id for s in shards])
                    results[f"{shuffle}/shard_rows/{step}/{name}"] = np.array([s.index[0].start for s in shards])
            for k in range(step + 2):
                state = json.loads(json.dumps(make_state(pipeline, k * size)))
                for step, batch in enumerate(hosts.batches(restore_position(pipeline, state))):
                    for name, array in batch.items():
                        results[f"{shuffle}/resumed{k}/{step}/{name}"] = np.asarray(array)
        # the product surface: cd.Loader(backend="colocated"), its state and a resume
        with cd.Loader(pipeline, backend="colocated") as loader:
            results[f"{shuffle}/loader_hosts"] = np.array([loader.hosts])
            for step, batch in enumerate(loader):
                for name, array in batch.items():
                    assert array.sharding == target.update(spec=target.spec[: array.ndim]), array.sharding
                    results[f"{shuffle}/loader/{step}/{name}"] = np.asarray(array)
                if step == 2:
                    state = json.loads(json.dumps(loader.get_state()))
        with cd.Loader(pipeline, backend="colocated", state=state) as loader:
            for step, batch in enumerate(loader):
                for name, array in batch.items():
                    results[f"{shuffle}/loader_resumed/{step}/{name}"] = np.asarray(array)
    np.savez(out, **results)
    """
)


@pytest.fixture(scope="module")
def eight_hosts(token_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The colocated backend's batches in a JAX started with 8 CPU devices, one per host."""
    out = tmp_path_factory.mktemp("eight") / "batches.npz"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", EIGHT_HOSTS, str(token_corpus), str(out), str(HOSTS_8_BATCH)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    with np.load(out) as saved:
        return dict(saved)


def _batches(saved: dict[str, np.ndarray], prefix: str) -> list[dict[str, np.ndarray]]:
    batches: dict[int, dict[str, np.ndarray]] = {}
    for key, value in saved.items():
        if key.startswith(prefix + "/"):
            step, name = key[len(prefix) + 1 :].split("/", 1)
            batches.setdefault(int(step), {})[name] = value
    return [batches[i] for i in range(len(batches))]


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_eight_cpu_devices_are_eight_hosts_with_in_process_batches(
    eight_hosts: dict[str, np.ndarray], token_corpus: Path, shuffle: str
) -> None:
    pipeline = make_pipeline(token_corpus, shuffle, global_batch_size=HOSTS_8_BATCH)
    expected = read_all(cd.Loader(pipeline, hosts=8))
    assert len(expected) == 7  # 120 records, batches of 16
    np.testing.assert_array_equal(eight_hosts[f"{shuffle}/hosts"], np.arange(8))
    assert_batches_equal(expected, _batches(eight_hosts, f"{shuffle}/full"), f"8 colocated hosts, {shuffle}")
    for step in range(len(expected)):
        for name in expected[step]:
            devices = eight_hosts[f"{shuffle}/shard_devices/{step}/{name}"]
            rows = eight_hosts[f"{shuffle}/shard_rows/{step}/{name}"]
            np.testing.assert_array_equal(rows[np.argsort(devices)], 2 * np.arange(8), err_msg="host h's rows on device h")


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_eight_hosts_resume_from_every_state(eight_hosts: dict[str, np.ndarray], token_corpus: Path, shuffle: str) -> None:
    expected = _batches(eight_hosts, f"{shuffle}/full")
    assert len(expected) == 7, f"{shuffle}: {len(expected)} batches saved, expected 7 (120 records, batches of 16)"
    for k in range(len(expected) + 1):
        resumed = _batches(eight_hosts, f"{shuffle}/resumed{k}")
        assert_batches_equal(expected[k:], resumed, f"{shuffle}, resumed after step {k}")


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_loader_with_the_colocated_backend(eight_hosts: dict[str, np.ndarray], token_corpus: Path, shuffle: str) -> None:
    pipeline = make_pipeline(token_corpus, shuffle, global_batch_size=HOSTS_8_BATCH)
    expected = read_all(cd.Loader(pipeline))
    assert eight_hosts[f"{shuffle}/loader_hosts"].tolist() == [8]
    assert_batches_equal(expected, _batches(eight_hosts, f"{shuffle}/loader"), f"Loader(backend='colocated'), {shuffle}")
    resumed = _batches(eight_hosts, f"{shuffle}/loader_resumed")
    assert_batches_equal(expected[3:], resumed, f"Loader(backend='colocated', state=...) after 3 steps, {shuffle}")
