"""`colo-data index DIR ...`: write a dataset index into each directory of data files, so
that sources of it start from one listing and one read instead of every file's metadata."""

from __future__ import annotations

import time

import click


@click.command()
@click.argument("directories", nargs=-1, required=True)
def index(directories: tuple[str, ...]) -> None:
    """Write a dataset index (_colo_data_index.json) into each of DIRECTORIES: a local
    directory or a URI of one (gs://bucket/dir, s3://bucket/dir). Run it again whenever a
    file under it is added, removed or rewritten: a source refuses an index that the files
    no longer match."""
    from colo_data.errors import ColoDataError
    from colo_data.io.arrow_source import ArrowSource
    from colo_data.io.dataset_index import write_index

    for directory in directories:
        start = time.perf_counter()
        try:
            (written,) = write_index(directory)
            source = ArrowSource(directory)  # reads the index just written, checked against a listing
        except ColoDataError as error:
            raise click.ClickException(str(error)) from error
        click.echo(
            f"{written}: {len(source.files)} files, {len(source):,} records in {len(source.row_group_sizes):,} row groups "
            f"({time.perf_counter() - start:.1f} s)"
        )
