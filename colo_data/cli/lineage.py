"""`colo-data lineage CONFIG --steps A:B [--state FILE] [--json]`: which source records made
each row of global steps A to B-1 of CONFIG's pipeline (`cd.lineage`), as a table of one
line a record, or with `--json` one JSON object a step. Exit status 2 when the pipeline,
the state or the steps do not fit together (named), 1 when the pipeline fails."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import stat
import sys
import tomllib
from pathlib import Path
from typing import Any

import click

from colo_data.config import CONFIG_IS_CODE

_TABLE_STEPS = 1024  # steps printed at once (a table is aligned within them)


class CannotTrace(click.ClickException):
    """The steps cannot be traced as asked (a config, state or steps error): exit status 2."""

    exit_code = 2


def _steps(ctx: click.Context, param: click.Parameter, value: str) -> range:
    """`A:B` (B excluded) or one step `A`."""
    first, colon, last = value.partition(":")
    try:
        steps = range(int(first), int(last) if colon else int(first) + 1)
    except ValueError:
        steps = range(-1)
    if steps.start < 0 or not steps:
        raise click.BadParameter(f"{value!r}: give global steps as A:B (A included, B not, A < B), or one step A")
    return steps


def _overrides(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    """`KEY=VALUE` pairs, each VALUE read as TOML (`8`, `"block"`, `{web = 0.5}`), else as text."""
    args: dict[str, Any] = {}
    for item in values:
        key, equals, text = item.partition("=")
        if not equals or not key.strip():
            raise click.BadParameter(f"{item!r}: give KEY=VALUE, e.g. global_batch_size=8")
        try:
            args[key.strip()] = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            args[key.strip()] = text
    return args


def _read_state(path: Path) -> dict[str, Any]:
    """A loader state from its JSON file, or from the one file `cd.checkpoint` saved in a
    checkpoint directory (a step's, or its data item's)."""
    from colo_data.loader.checkpoint import STATE_FILE

    if path.is_dir():
        found = sorted(path.rglob(STATE_FILE))
        if len(found) != 1:
            listed = ", ".join(str(f) for f in found[:4]) + (" ..." if len(found) > 4 else "")
            raise CannotTrace(
                f"--state {path}: a directory holding {len(found)} loader states ({STATE_FILE}){': ' + listed if found else ''}; "
                "give one checkpoint step's directory, or the state's file"
            )
        path = found[0]
    try:
        # opened without waiting (a FIFO's open waits for a writer) and read only if a regular file
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise CannotTrace(
                    f"--state {path}: not a regular file (a FIFO, a device or a socket): give the loader state's JSON "
                    f"file ({STATE_FILE}) or its checkpoint step's directory"
                )
            state = json.loads(file.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CannotTrace(f"--state {path}: not a JSON loader state ({e})") from e
    if not isinstance(state, dict):
        raise CannotTrace(f"--state {path}: holds a {type(state).__name__}, not a loader state (a JSON object)")
    return state


def _table(traced: list[dict[str, Any]]) -> list[str]:
    """A header, then one line a record: its step, row, segment, component (a mixture), file,
    row in the file and index, aligned (within the `_TABLE_STEPS` steps printed at once)."""
    mixed = any("component" in origin for step in traced for row in step["rows"] for origin in row)
    head = ["step", "row", "segment", *(["component"] if mixed else []), "file", "file row", "index"]
    lines = [
        [
            str(step["step"]),
            str(r),
            str(s),
            *([origin.get("component", "")] if mixed else []),
            str(origin["file"] or "-"),
            str(origin["row"]),
            str(origin["index"]),
        ]
        for step in traced
        for r, row in enumerate(step["rows"])
        for s, origin in enumerate(row, 1)
    ]
    widths = [max(len(cells[i]) for cells in [head, *lines]) for i in range(len(head))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip() for cells in [head, *lines]]


@click.command(epilog=CONFIG_IS_CODE)
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--steps",
    required=True,
    callback=_steps,
    help="Global steps A:B (A included, B not), or one step A; step 0 is the stream's first batch.",
)
@click.option(
    "--state",
    "state_path",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="A loader state saved after the steps before A: its JSON file, or a checkpoint directory holding one "
    "(loader_state.json, as cd.checkpoint saves it) [the stream's start].",
)
@click.option(
    "--arg",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    callback=_overrides,
    help="Set one of CONFIG's [args] (VALUE read as TOML), as the run that saved the state had it, e.g. "
    "--arg global_batch_size=8; repeat for more.",
)
@click.option("--json", "as_json", is_flag=True, help='Print one JSON object a step: {"step": N, "rows": [[records], ...]}.')
def lineage(config: str, steps: range, state_path: Path | None, overrides: dict[str, Any], as_json: bool) -> None:
    """Print which source records made each row of global steps --steps of CONFIG's pipeline:
    each record's file, row in the file and index (a packed row's segments in order). A
    padded pipeline's steps are computed without reading records; a packed or filtered
    one's are planned from the state's position on (docs/lineage.md)."""
    from colo_data.config import load_config
    from colo_data.errors import ColoDataError, ConfigError, StateError
    from colo_data.replay.lineage import lineage_steps

    state = _read_state(state_path) if state_path is not None else None
    try:
        settings = load_config(config)
        pipeline = dataclasses.replace(settings, args={**settings.args, **overrides}).build()
        saved = (state or {}).get("global_batch_size", pipeline.global_batch_size)
        if saved != pipeline.global_batch_size:
            click.echo(
                f"note: the state was saved with global_batch_size={saved}; {config}'s pipeline has "
                f"{pipeline.global_batch_size}, whose steps are traced (give --arg global_batch_size={saved} for the run's)",
                err=True,
            )
        traced = lineage_steps(pipeline, state, steps=steps)
        head = True
        while block := list(itertools.islice(traced, _TABLE_STEPS)):  # printed as they come: bounded memory
            if as_json:
                sys.stdout.write("".join(json.dumps(step) + "\n" for step in block))
            else:
                click.echo("\n".join(_table(block)[0 if head else 1 :]))
            head = False
    except (ConfigError, StateError) as e:
        raise CannotTrace(str(e)) from e
    except ColoDataError as e:
        raise click.ClickException(f"the pipeline failed while its steps were traced: {e}") from e
