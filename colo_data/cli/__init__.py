"""The `colo-data` command line (click)."""

import click

from colo_data.cli.bench import bench
from colo_data.cli.demo import demo
from colo_data.cli.doctor import doctor
from colo_data.cli.index import index
from colo_data.cli.lineage import lineage
from colo_data.cli.manifest import manifest
from colo_data.cli.sidecar import sidecar
from colo_data.cli.verify import verify


@click.group()
def main() -> None:
    """colo-data: colocated input pipelines for JAX."""


main.add_command(bench)
main.add_command(demo)
main.add_command(doctor)
main.add_command(index)
main.add_command(lineage)
main.add_command(manifest)
main.add_command(sidecar)
main.add_command(verify)
