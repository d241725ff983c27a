"""Many hosts, one Ray cluster: does any host starve? 64 host pipelines in one process, each
with its own Ray actor (`cd.RayWorkers(actors=1)`), or all sharing one pool of 16 actors
(`--pool 16`: `cd.RayWorkers(actors=16, pool=...)`), against one local Ray cluster.

Each host pipeline runs on a thread of its own, as a sidecar's producer does, so that each
makes its decisions on its own feed, as 64 sidecars would. The per-record work is a sleep
(`PAUSE_S` a record, in workers.py's light pipeline): it stands for work on CPUs of the
cluster's own, which this 2-CPU machine does not have, so that the actors pay; what is
measured is how one cluster serves 64 hosts at once. Once every host's actor has made
records, the run goes on for `--seconds` and reports, per host, from its stage counters:

- its actor's share of its records (`pool_wait` items / the host's records);
- its records per second, and its wait for its actor (`pool_wait` seconds per second);
- the bytes per second it fetched from the object store (`transfer`);

and the actor processes' count and memory (resident, and their own: USS, without the pages
they share).

Goal ("no host starves"): the host whose actor made the least made at least half the median
host's share, and the slowest host's records per second are at least half the median's.
The bytes per second per host size a cluster for 1,000 hosts (docs/ray.md, "Many hosts").

Run: `.venv/bin/python benchmarks/ray_hosts.py [--hosts 64] [--pool ACTORS] [--seconds 60] [--quick] [--out DIR]`.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

import harness
import psutil
import workers_pipeline

HERE = Path(__file__).resolve().parent
ROWS = 8  # rows of each host in a global batch
PAUSE_S = 200e-6  # per record: a host's 512-record chunk takes 0.1 s, wherever it is made
ACTOR_CPUS = 0.25  # logical CPUs an actor reserves: 64 actors on a cluster of 16
READY_S = 900  # the most the actors may take to start and make their first records


def pause(batch: dict) -> dict:
    """Per-record work on CPUs of the cluster's own: a sleep, which costs this machine none."""
    time.sleep(PAUSE_S * len(batch["tokens"]))
    return batch


def actor_memory() -> tuple[int, float, float]:
    """The chunk actors' processes (descendants of this process, which started the cluster),
    and their resident and unique memory in GB."""
    count, rss, uss = 0, 0, 0
    for process in psutil.Process().children(recursive=True):
        try:
            if "ChunkActor" in " ".join(process.cmdline()):
                memory = process.memory_full_info()
                count, rss, uss = count + 1, rss + memory.rss, uss + memory.uss
        except psutil.Error:  # gone meanwhile
            continue
    return count, rss / 1e9, uss / 1e9


def main() -> None:
    """Start the cluster and the hosts; once every actor made records, measure `--seconds`; write the tables."""
    options = harness.parser(__doc__, rounds=1)
    options.add_argument("--hosts", type=int, default=64, help="host pipelines, an actor each (default 64)")
    options.add_argument("--pool", type=int, default=0, help="the hosts share a pool of this many actors (default: one each)")
    options.add_argument("--seconds", type=float, default=60.0, help="seconds measured once every actor made records")
    args = harness.parse(options)
    if args.quick:
        args.hosts, args.seconds, args.pool = 4, 2.0, min(args.pool, 2)
    sys.path.remove(str(HERE))  # this folder's ray.py (a benchmark) must not stand for the ray package
    import ray

    import colo_data as cd
    from colo_data.host.shares import host_pipeline
    from colo_data.runtime.budget import cpu_budget
    from colo_data.runtime.lifecycle import Lifecycle
    from colo_data.runtime.prefetch import close_iterator
    from colo_data.telemetry.counters import POOL_WAIT, TRANSFER
    from colo_data.workers.pools import start_pool
    from colo_data.workers.settings import choose_workers

    corpus = Path(os.environ.get("COLO_DATA_CACHE", Path.home() / ".cache" / "colo-data")) / "workers-bench"
    base = workers_pipeline.pipeline("light", workers_pipeline.corpus(corpus))
    pipeline = cd.Pipeline(
        source=base.source, order=base.order, transforms=[pause, *base.transforms], global_batch_size=args.hosts * ROWS,
        epochs=None,
    )
    cluster_cpus = max(1, int(args.hosts * ACTOR_CPUS))
    ray.init(num_cpus=cluster_cpus, include_dashboard=False, log_to_driver=False)
    owner = Lifecycle("ray_hosts benchmark")
    stop = threading.Event()
    records = [0] * args.hosts
    failed: list[BaseException] = []
    try:
        budget = cpu_budget()
        if args.pool:  # the same logical CPUs in all, in fewer, larger actors
            actors = cd.RayWorkers(actors=args.pool, num_cpus=cluster_cpus / args.pool, pool="ray-hosts-benchmark")
        else:
            actors = cd.RayWorkers(actors=1, num_cpus=ACTOR_CPUS)
        choice = choose_workers(actors, budget, "the host's own thread")
        hosts = [host_pipeline(pipeline, h, args.hosts, start_pool(choice, owner, budget)) for h in range(args.hosts)]

        def produce(h: int) -> None:
            """Host `h`'s chunks, counted, until `stop`."""
            chunks = hosts[h].chunks(0, owner.child(f"host {h}"))
            try:
                for chunk in chunks:
                    records[h] += chunk.rows
                    if stop.is_set():
                        break
            except BaseException as e:
                failed.append(e)
            finally:
                close_iterator(chunks)

        threads = [threading.Thread(target=produce, args=(h,), name=f"host-{h}", daemon=True) for h in range(args.hosts)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        while not all(host.stages.values[3 * POOL_WAIT + 1] for host in hosts):
            if failed:
                raise failed[0]
            if time.monotonic() - started > READY_S:
                raise RuntimeError(f"not every host's actor made records in {READY_S} s")
            time.sleep(0.5)
        all_ready_s = time.monotonic() - started
        before = [(list(host.stages.values), records[h]) for h, host in enumerate(hosts)]
        t0 = time.monotonic()
        time.sleep(args.seconds)
        seconds = time.monotonic() - t0
        after = [(list(host.stages.values), records[h]) for h, host in enumerate(hosts)]
        processes, rss_gb, uss_gb = actor_memory()
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        if failed:
            raise failed[0]
    finally:
        stop.set()
        owner.close()
        ray.shutdown()

    def delta(h: int, stage: int, what: int) -> float:
        return after[h][0][3 * stage + what] - before[h][0][3 * stage + what]

    per_host = []
    for h in range(args.hosts):
        made = after[h][1] - before[h][1]
        per_host.append(
            {
                "host": h,
                "records_per_s": made / seconds,
                "actor_share": delta(h, POOL_WAIT, 1) / made if made else 0.0,
                "wait_s_per_s": delta(h, POOL_WAIT, 0) / seconds,
                "transfer_mb_per_s": delta(h, TRANSFER, 2) / seconds / 1e6,
            }
        )

    def row(label: str, key: str, fmt: str) -> str:
        xs = [h[key] for h in per_host]
        return f"| {label} | {min(xs):{fmt}} | {statistics.median(xs):{fmt}} | {max(xs):{fmt}} |"

    least = min(per_host, key=lambda h: h["actor_share"])
    slowest = min(per_host, key=lambda h: h["records_per_s"])
    share_ratio = least["actor_share"] / (statistics.median(h["actor_share"] for h in per_host) or 1.0)
    rate_ratio = slowest["records_per_s"] / (statistics.median(h["records_per_s"] for h in per_host) or 1.0)
    starves = harness.Goal.of(">= 0.5")
    ratios = [
        harness.Ratio(f"least {'pool' if args.pool else 'actor'} share / median (host {least['host']})", share_ratio, starves),
        harness.Ratio(f"slowest host's records/s / median (host {slowest['host']})", rate_ratio, starves),
    ]
    who = (
        f"sharing one pool of {args.pool} Ray actors ({cluster_cpus / args.pool:g} logical CPU each)"
        if args.pool
        else f"with one Ray actor ({ACTOR_CPUS:g} logical CPU)"
    )
    lines = [
        f"{args.hosts} host pipelines in one process, each on a thread of its own {who} "
        f"on a local cluster of {cluster_cpus} logical CPUs; workers.py's light pipeline "
        f"with a {PAUSE_S * 1e6:.0f} µs sleep a record, {ROWS} rows a host a global batch; {os.cpu_count()} CPUs. "
        f"Every actor had made records {all_ready_s:.0f} s after the start; then {seconds:.0f} s measured. "
        f"{processes} actor processes held {rss_gb:.1f} GB resident ({uss_gb:.1f} GB of their own).",
        "",
        "| per host | min | median | max |",
        "| --- | ---: | ---: | ---: |",
        row("records/s", "records_per_s", ",.0f"),
        row(f"share of its records {'the pool' if args.pool else 'its actor'} made", "actor_share", ".0%"),
        row(f"wait for {'the pool' if args.pool else 'its actor'} (s per s)", "wait_s_per_s", ".3f"),
        row("fetched from the object store (MB/s)", "transfer_mb_per_s", ".3f"),
        "",
        "Goals: no host starves.",
        "",
        *harness.ratio_table(ratios),
    ]
    details = {
        "hosts": per_host, "pool": args.pool, "all_ready_s": all_ready_s, "seconds": seconds,
        "actor_processes": processes, "actor_rss_gb": rss_gb, "actor_uss_gb": uss_gb,
    }
    hosts = f"{args.hosts} hosts, " + (f"a pool of {args.pool} Ray actors shared" if args.pool else "a Ray actor each")
    headlines = harness.headlines(
        ratios,
        [
            ("slowest host's records/s", f"{hosts}: the slowest host's records/s", "the median host's"),
            ("least", f"{hosts}: the least share of a host's records made by Ray", "the median share"),
        ],
    )
    name = "ray_hosts_pool" if args.pool else "ray_hosts"
    harness.write_results(name, args, lines, {}, ratios, details=details, headlines=headlines)


if __name__ == "__main__":
    main()
