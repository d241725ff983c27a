"""`colo-data verify CONFIG`: the acceptance run before a large job. It runs CONFIG's
pipeline briefly with several host counts and prints one PASS/FAIL/SKIP line per check
(`colo_data.verification.verify`). Exit status: 0 when no check fails, 1 when one does (or the pipeline
itself fails while running), 2 when the pipeline cannot be verified as given (a config or
option error, no index column), as for click's usage errors."""

from __future__ import annotations

import click

from colo_data.config import CONFIG_IS_CODE


class CannotVerify(click.ClickException):
    """The pipeline cannot be verified as given: exit status 2, apart from failed checks (1)."""

    exit_code = 2


def _host_counts(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(v) for v in value.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{value!r}: give positive host counts separated by commas, e.g. 1,2,4")
    return counts


@click.command(epilog=CONFIG_IS_CODE)
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--hosts", default="1,2,4", show_default=True, callback=_host_counts,
    help="Host counts to run, comma-separated; the first is the reference. One that does not divide the batch "
    "is skipped.",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=None,
    help="Global batches to read (default: one epoch, also for pipelines that repeat forever; "
    "for a cd.Mix, until every weighted component has finished one of its epochs).",
)
@click.option(
    "--resume-at", type=click.IntRange(min=0), default=None,
    help="Save the state after this many batches of the first host count's run (default: half the run).",
)
@click.option(
    "--resume-hosts", type=click.IntRange(min=1), default=None,
    help="Host count to restore the state with (default: the last of --hosts that runs).",
)
def verify(
    config: str, hosts: tuple[int, ...], steps: int | None, resume_at: int | None, resume_hosts: int | None
) -> None:
    """Check CONFIG's pipeline on a short run: every host count yields identical global
    batches, each record appears exactly once (through the pipeline's index column), in
    the order the seed defines, and a state saved at one step and restored with another
    host count continues identically. A cd.GrainPipeline is checked against Grain itself:
    with each host count, the loader's batches (in process and through sidecars) are those
    Grain gives host by host, and a saved state continues identically (--steps, default 8
    batches). Exits 1 if a check fails, 2 if the pipeline cannot be verified as given."""
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    from colo_data.config import load_config
    from colo_data.errors import ColoDataError, ConfigError
    from colo_data.verification.verify import run_length
    from colo_data.verification.verify import verify as run_checks

    try:
        settings = load_config(config)
        pipeline = settings.build()
        click.echo(
            f"verify {config} ({settings.pipeline}, global batch {pipeline.global_batch_size}): "
            f"{run_length(pipeline, steps)}, hosts {', '.join(map(str, hosts))}"
        )
        checks = run_checks(pipeline, hosts, steps, resume_at, resume_hosts)
    except ConfigError as e:
        raise CannotVerify(str(e)) from e
    except ColoDataError as e:
        raise click.ClickException(f"the pipeline failed while being verified: {e}") from e
    for check in checks:
        click.echo(str(check))
    failed = sum(check.failed for check in checks)
    if failed:
        click.echo(f"verify: {failed} of {len(checks)} checks failed")
        raise SystemExit(1)
    click.echo(f"verify: no check failed ({sum(check.status == 'PASS' for check in checks)} passed)")
