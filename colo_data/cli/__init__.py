"""The `colo-data` command line (click)."""

import click

from colo_data.cli.demo import demo


@click.group()
def main() -> None:
    """colo-data: colocated input pipelines for JAX."""


main.add_command(demo)
