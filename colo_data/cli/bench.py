"""`colo-data bench [CONFIG]`: run a pipeline through cd.Loader with a simulated training
step and print where the time goes (throughput, input wait, stages, CPU, a verdict);
optionally the same pipeline through Grain alone, JSON and a plot."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from pathlib import Path
from typing import Any

import click

from colo_data.backends.options import NAMES
from colo_data.config import CONFIG_IS_CODE

BUILTIN = "configs/demo.toml (built in)"
WIRE_TAIL = "\n--- raised in "  # where `colo_data.errors.from_wire` names the process that raised it


def builtin_config() -> Any:
    """The default CONFIG: what configs/demo.toml holds (a test keeps the two equal)."""
    from colo_data.config import Config

    return Config(BUILTIN, "colo_data.demo:pipeline", {"seq_len": 1024, "global_batch_size": 32}, {"workers": "auto"})


def _backend(name: str, workers: str | None, config_sidecar: dict[str, Any]) -> Any:
    """The backend option object for --backend: a sidecar takes the config's [sidecar]
    settings; --workers (a number, "auto" or Ray workers) overrides the backend's workers."""
    from colo_data.backends.options import resolve, with_sidecar_settings
    from colo_data.errors import ConfigError
    from colo_data.workers.settings import workers_from

    chosen: Any = with_sidecar_settings(resolve(name), config_sidecar)  # a frozen dataclass of options
    if workers is not None:
        try:
            chosen = dataclasses.replace(chosen, workers=workers_from(workers, "--workers"))
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint="--workers") from e
    return chosen


@click.command(epilog=CONFIG_IS_CODE)
@click.argument("config", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--steps", type=click.IntRange(min=1), default=None,
    help="Global batches to read [one pass over the pipeline's epochs; 500 where it repeats forever].",
)
@click.option(
    "--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="First steps kept apart from the steady state."
)
@click.option(
    "--step-time", "step_ms", type=click.FloatRange(min=0), default=0.0, show_default=True,
    help="Simulated training step per batch, in ms.",
)
@click.option(
    "--backend", type=click.Choice(NAMES), default="auto", show_default=True,
    help="Where the host pipelines run (auto: sidecar if COLO_DATA_SIDECAR is set, colocated on Pathways, else inprocess).",
)
@click.option(
    "--hosts", type=click.IntRange(min=1), default=None,
    help="Host pipelines, simulated in one process [the JAX process count; colocated: one per CPU device].",
)
@click.option(
    "--workers", default=None,
    help="The most worker processes per host: a number, 'auto' or Ray actors ('ray', 'ray:{\"actors\": 4}') "
    "[sidecar: the config's [sidecar] workers; inprocess: auto].",
)
@click.option(
    "--compare", type=click.Choice(["grain"]), default=None,
    help="Also run the same pipeline with Grain alone and print the ratio.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the full report as JSON here.")
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
    help="Write a PNG: input wait per step, throughput over time; the fill of packed and padded columns and a "
    "mixture's component shares where the pipeline has them.",
)
def bench(
    config: str | None,
    steps: int | None,
    warmup: int,
    step_ms: float,
    backend: str,
    hosts: int | None,
    workers: str | None,
    compare: str | None,
    json_path: str | None,
    plot_path: str | None,
) -> None:
    """Benchmark CONFIG's pipeline (default: the built-in demo, configs/demo.toml) through
    cd.Loader. Ctrl-C stops early and prints what was measured so far."""
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    from colo_data.config import load_config
    from colo_data.errors import ColoDataError, ConfigError

    try:
        settings = load_config(config) if config else builtin_config()
        try:
            pipeline = settings.build()
        except ConfigError as error:  # a value in [args] the pipeline refused: say which file
            message = str(error)
            raise ConfigError(message if message.startswith(settings.path) else f"{settings.path}: {message}") from error
        # the backend ("auto" asks JAX whether it runs on Pathways) and the loader: once the config is known to be good
        chosen = _backend(backend, workers, settings.sidecar)
        from colo_data.bench.report import as_json, plot, report
        from colo_data.bench.runs import ENDLESS_STEPS, run_grain, run_loader, steps_to_run
        from colo_data.workers.settings import workers_text

        options: dict[str, Any] = {"backend": chosen, "hosts": hosts}
        said = "none (the host's own thread)" if chosen.workers == 0 else workers_text(chosen.workers)
        total = steps_to_run(pipeline, steps)
        endless = " (it repeats forever: --steps N for more)" if steps is None and total == ENDLESS_STEPS else ""
        header = (
            f"colo-data bench: {settings.path} ({settings.pipeline}); backend {chosen.name}, hosts {hosts or 'default'}, "
            f"workers {said}, {total if total is not None else 'all'} steps{endless}, warm-up {warmup} steps, simulated step "
            f"{step_ms:g} ms"
        )
        click.echo(header)
        runs = [run_loader(pipeline, steps=steps, warmup=warmup, step_s=step_ms / 1000, loader_options=options)]
        if compare == "grain" and not runs[0].interrupted:
            runs.append(run_grain(pipeline, steps=steps, warmup=warmup, step_s=step_ms / 1000))
    except ConfigError as error:  # names the key or setting (with the end of the user's code's traceback, if it
        # raised); the process that raised it (a sidecar, a worker) is left out
        raise click.ClickException(str(error).split(WIRE_TAIL, 1)[0]) from error
    except ColoDataError as error:
        raise click.ClickException(str(error)) from error
    except KeyboardInterrupt:  # before the first batch: nothing to report
        click.echo("interrupted before the first batch", err=True)
        sys.exit(128 + signal.SIGINT)
    click.echo("\n" + report(runs, step_ms))
    details = {
        "config": settings.path, "pipeline": settings.pipeline, "args": settings.args, "backend": chosen.name,
        "hosts": hosts, "workers": chosen.workers, "warmup": warmup, "steps": steps, "step_time_ms": step_ms, "compare": compare,
    }
    if json_path:
        Path(json_path).write_text(json.dumps(as_json(runs, details), indent=1) + "\n")
        click.echo(f"wrote {json_path}")
    if plot_path:
        plot(runs, plot_path, f"{settings.pipeline}, backend {chosen.name}, step {step_ms:g} ms")
        click.echo(f"wrote {plot_path}")
    if any(run.interrupted for run in runs):
        sys.exit(128 + signal.SIGINT)
