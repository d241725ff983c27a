"""The `colo-data` command line (click)."""

import click

from colo_data.cli.demo import demo
from colo_data.cli.doctor import doctor
from colo_data.cli.sidecar import sidecar


@click.group()
def main() -> None:
    """colo-data: colocated input pipelines for JAX."""


main.add_command(demo)
main.add_command(doctor)
main.add_command(sidecar)
