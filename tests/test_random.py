"""`cd.random_map`: per-record draws seeded from the pipeline's seed, the record's epoch and
its index: they differ from epoch to epoch, and a record draws the same on any host count,
backend and worker count, after a resume, filtered, mixed and in a pack's prepare."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import cloudpickle
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import colo_data as cd
from colo_data.testing import assert_batches_equal, read_all, to_numpy

from pipelines import BATCH, idle_host, until_workers_made

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # sidecars and workers get its functions by value
RECORDS = 120


def with_noise(record: dict, rng: np.random.Generator) -> dict:
    return {**record, "noise": rng.random(3).astype(np.float32)}


def noisy(corpus: Path, **overrides: object) -> cd.Pipeline:
    settings: dict = dict(
        source=cd.ArrowSource(str(corpus), columns=["id"]), order=cd.Order(shuffle="global", seed=3),
        transforms=[cd.random_map(with_noise)], global_batch_size=BATCH, epochs=2, index_column="_index",
    )
    return cd.Pipeline(**{**settings, **overrides})


@pytest.mark.parametrize("backend", ["sidecar", "colocated"])
def test_draws_differ_between_epochs_and_agree_across_hosts_and_backends(token_corpus: Path, backend: str) -> None:
    pipeline = noisy(token_corpus)
    reference = read_all(cd.Loader(pipeline, hosts=1))
    index = np.concatenate([b["_index"] for b in reference])
    noise = np.concatenate([b["noise"] for b in reference])
    epochs = [dict(zip(index[e * RECORDS : (e + 1) * RECORDS].tolist(), noise[e * RECORDS : (e + 1) * RECORDS].tolist(), strict=True))
              for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(RECORDS))
    assert all(epochs[0][i] != epochs[1][i] for i in range(RECORDS)), "a record draws anew each epoch"
    assert_batches_equal(reference, read_all(cd.Loader(pipeline, hosts=2)), "2 hosts in process")
    other = (cd.Loader(pipeline, backend=backend, mesh=Mesh(np.array(jax.devices()[:2]), ("data",))) if backend == "colocated"
             else cd.Loader(pipeline, backend=backend, hosts=2))
    assert_batches_equal(reference, read_all(other), f"2 hosts, {backend}")


def test_draws_survive_a_resume_on_another_host_count(token_corpus: Path) -> None:
    pipeline = noisy(token_corpus)
    reference = read_all(cd.Loader(pipeline, hosts=1))
    with cd.Loader(pipeline, hosts=2) as loader:
        for _ in range(13):  # into the second epoch
            next(loader)
        state = loader.get_state()
    assert_batches_equal(reference[13:], read_all(cd.Loader(pipeline, hosts=4, state=state)), "resumed on 4 hosts")


@pytest.mark.usefixtures("own_cpu_budget")
def test_worker_processes_draw_the_same(token_corpus: Path) -> None:
    pipeline = noisy(token_corpus, epochs=None, transforms=[idle_host, cd.random_map(with_noise)])
    with cd.Loader(pipeline, hosts=1, backend=cd.InProcess(workers=2)) as loader:
        got = until_workers_made(loader)
    assert_batches_equal(read_all(cd.Loader(pipeline, hosts=1), len(got)), got, "worker processes vs none")


def test_filtered_mixed_and_packed_pipelines_draw_by_record(token_corpus: Path, mix_corpora: dict[str, Path]) -> None:
    def odd(columns: dict) -> np.ndarray:
        return np.asarray(columns["id"]) % 2 == 1

    filtered = noisy(token_corpus, keep=odd)
    assert_batches_equal(read_all(cd.Loader(filtered, hosts=1)), read_all(cd.Loader(filtered, hosts=3)), "filtered")

    components = {n: cd.ArrowSource(str(p), columns=["id"]) for n, p in mix_corpora.items()}
    mixed = noisy(token_corpus, source=cd.Mix(components, {"web": 0.5, "code": 0.3, "math": 0.2}), epochs=None)
    with cd.Loader(mixed, hosts=1) as one, cd.Loader(mixed, hosts=2) as two:
        a, b = [to_numpy(next(one)) for _ in range(8)], [to_numpy(next(two)) for _ in range(8)]
    assert_batches_equal(a, b, "mixed")

    def crop(record: dict, rng: np.random.Generator) -> dict:
        tokens = record["tokens"]
        return {**record, "tokens": tokens[: int(rng.integers(1, len(tokens) + 1))]}

    packed = cd.Pipeline(
        source=cd.ArrowSource(str(token_corpus), columns=["id", "tokens"]), order=cd.Order(shuffle="global", seed=3),
        pack=cd.Pack("tokens", 16, prepare=[cd.random_map(crop)]), global_batch_size=4, epochs=2, index_column="_index",
    )
    reference = read_all(cd.Loader(packed, hosts=1))
    assert_batches_equal(reference, read_all(cd.Loader(packed, hosts=2)), "packed, cropped in prepare")
    with pytest.raises(cd.errors.TransformError, match=r"cd.random_map\('crop', seed=0\) needs each record's epoch and index"):
        next(cd.Loader(dataclasses.replace(packed, transforms=[cd.random_map(crop)])))
