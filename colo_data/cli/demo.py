"""`colo-data demo`: run the built-in demo pipeline end to end and print records/s."""

from __future__ import annotations

import time
from typing import Literal

import click


@click.command()
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Global batches to read (default: one epoch).")
@click.option("--hosts", type=click.IntRange(min=1), default=1, show_default=True, help="Simulated host pipelines.")
@click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True, help="Worker processes per host.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--shuffle", type=click.Choice(["none", "global", "block"]), default="block", show_default=True)
def demo(
    steps: int | None, hosts: int, workers: int, batch_size: int, seq_len: int, shuffle: Literal["none", "global", "block"]
) -> None:
    """Read the demo corpus (written on first use) through cd.Loader and report throughput."""
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    from colo_data import InProcess, Loader
    from colo_data import demo as demo_data

    t0 = time.perf_counter()
    directory = demo_data.corpus()
    click.echo(f"demo corpus: {directory} (ready in {time.perf_counter() - t0:.1f} s)")
    pipeline = demo_data.pipeline(directory, seq_len=seq_len, global_batch_size=batch_size, shuffle=shuffle)
    records = 0
    with Loader(pipeline, backend=InProcess(workers=workers), hosts=hosts) as loader:
        start = time.perf_counter()
        first = None
        for step, batch in enumerate(loader):
            batch["tokens"].block_until_ready()
            first = first or time.perf_counter() - start
            records += batch["tokens"].shape[0]
            if steps is not None and step + 1 >= steps:
                break
        elapsed = time.perf_counter() - start
    assert first is not None  # the demo corpus gives at least one batch
    click.echo(
        f"{records} records in {elapsed:.2f} s: {records / elapsed:,.0f} records/s "
        f"(first batch {first * 1000:.0f} ms; shuffle={shuffle}, hosts={hosts}, workers={workers}, "
        f"batch={batch_size}, seq_len={seq_len})"
    )
