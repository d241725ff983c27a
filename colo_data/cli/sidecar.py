"""`colo-data sidecar serve`: run a host's sidecar on a Unix socket. Every option can also
come from a `COLO_DATA_*` environment variable (the sidecar image sets them once, for
`colo-data doctor` and for this command alike)."""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import click

from colo_data import defaults
from colo_data.config import CONFIG_IS_CODE

F = TypeVar("F", bound=Callable[..., Any])

if TYPE_CHECKING:
    from colo_data.backends.sidecar.ring_plan import RingPlan
    from colo_data.backends.sidecar.server import SidecarServer
    from colo_data.config import Config


def _stop(server: SidecarServer | None, signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM (a trainer's stop called again) would interrupt the unwinding
    # mid-way, leaving a session's thread in its generator; the trainer kills what hangs.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if server is not None:
        server.stop()  # ends its loop even if the SystemExit below is swallowed mid-session
    sys.exit(0)  # unwinds the server: the open session's ring is removed


def _octal(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        mode = int(value, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise click.BadParameter(f"{value!r}: permissions in octal, e.g. 600 or 660")
    return mode


def slots_option(text: str) -> Callable[[F], F]:
    """`--slots`: the ring's slots, as `sidecar serve` and `doctor` take it."""
    return click.option("--slots", type=click.IntRange(min=2), default=None, envvar="COLO_DATA_SLOTS", help=text)


def hosts_option(text: str) -> Callable[[F], F]:
    """`--hosts`: the trainer's host count, which sizes the ring, as `sidecar serve` and `doctor` take it."""
    return click.option("--hosts", type=click.IntRange(min=1), default=1, envvar="COLO_DATA_HOSTS", help=text)


@click.group()
def sidecar() -> None:
    """The per-host sidecar process."""


@sidecar.command(epilog=CONFIG_IS_CODE)
@click.argument("config", required=False, envvar="COLO_DATA_CONFIG", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--socket", "socket_path", required=True, envvar="COLO_DATA_SOCKET", help="Unix socket path to listen on (unix:// optional)."
)
@click.option(
    "--shm-dir",
    default=None,
    envvar="COLO_DATA_SHM_DIR",
    help="Memory-backed directory for the batch ring [config, else /dev/shm].",
)
@click.option(
    "--workers",
    default=None,
    envvar="COLO_DATA_WORKERS",
    help="Worker processes: a number, 'auto' (from the CPU budget), or Ray actors: 'ray' or 'ray:{\"actors\": 4}' (docs/ray.md).",
)
@slots_option("Batches in the shared-memory ring [4].")
@hosts_option("The trainer's host count, for the start-up check that CONFIG's ring fits [1: the largest ring].")
@click.option(
    "--socket-mode",
    default="600",
    show_default=True,
    envvar="COLO_DATA_SOCKET_MODE",
    callback=_octal,
    help="The socket's permissions, octal; its key file gets the owner's and group's read bits of them.",
)
@click.option("--exit-with", type=int, default=None, hidden=True, help="Exit when this pid (the trainer) exits.")
def serve(
    config: str | None,
    socket_path: str,
    shm_dir: str | None,
    workers: str | None,
    slots: int | None,
    hosts: int,
    socket_mode: int,
    exit_with: int | None,
) -> None:
    """Serve host batches of CONFIG's pipeline (or of the pipeline the trainer sends).
    With CONFIG, a ring that cannot fit the shm dir fails here, at start (ShmError)."""
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    from colo_data.backends.sidecar.protocol import socket_path as path_of
    from colo_data.backends.sidecar.server import SidecarServer
    from colo_data.config import load_config
    from colo_data.errors import ColoDataError
    from colo_data.runtime.input_wait import input_wait_target
    from colo_data.workers.settings import workers_from

    signal.signal(signal.SIGTERM, functools.partial(_stop, None))
    if exit_with is not None:  # a trainer's own sidecar: the trainer stops it (SIGTERM) after a Ctrl-C, not the terminal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        settings = load_config(config) if config else None
        options = settings.sidecar if settings else {}
        chosen = workers_from(workers, "--workers") if workers is not None else options.get("workers", "auto")
        input_wait_target()  # (a bad COLO_DATA_INPUT_WAIT is refused at start, not at the first feed)
        server = SidecarServer(
            path_of(socket_path),
            pipeline=settings.build() if settings else None,
            shm_dir=shm_dir or options.get("shm_dir", defaults.SHM_DIR),
            workers=chosen,
            slots=slots or int(options.get("slots", defaults.SLOTS)),
            exit_with=exit_with,
            socket_mode=socket_mode,
        )
        signal.signal(signal.SIGTERM, functools.partial(_stop, server))
        if settings is not None:
            check_config_ring(settings, server.shm_dir, server.slots, hosts)
        server.listen()
    except ColoDataError as e:
        raise click.ClickException(str(e)) from e
    budget = server.budget
    click.echo(
        f"colo-data sidecar on {socket_path}: CPU budget {budget.cpus:g} ({budget.source}); workers: {server.choice.reason}",
        err=True,
    )
    try:
        server.serve_forever()
    except SystemExit as e:  # a SIGTERM: the session has ended; what a thread still closes is not waited for
        server.leave(e.code if isinstance(e.code, int) else 0)


def check_config_ring(settings: Config, shm_dir: str, slots: int, hosts: int, plan: RingPlan | None = None) -> RingPlan:
    """The ring CONFIG's pipeline needs for host 0 of `hosts` (`plan`, if already made),
    checked against `shm_dir`; ShmError (naming the config, the bytes and the fix) when it
    cannot fit. Planned on a pipeline built for this check only, so that the served one
    starts untouched."""
    from colo_data.backends.sidecar.ring_plan import plan_ring
    from colo_data.errors import ShmError

    plan = plan or plan_ring(settings.build(), shm_dir, slots, hosts)
    try:
        plan.check()
    except ShmError as error:
        raise ShmError(
            f"{settings.path}: {error} (checked for host 0 of {hosts}, {plan.per_slot} batch(es) a slot; "
            "a host's ring shrinks with the host count: set --hosts / COLO_DATA_HOSTS to the trainer's)"
        ) from error
    return plan
