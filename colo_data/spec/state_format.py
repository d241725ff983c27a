"""The loader state's format tag, and the one place a state's format is checked."""

from __future__ import annotations

FORMAT = "colo-data/1"


def format_of(state: object) -> str | None:
    """The problem with `state` as a loader state of this colo-data's format, or None when
    it is one."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a dict of format {FORMAT!r}"
    if state.get("format") != FORMAT:
        return f"format {state.get('format')!r}; this colo-data reads {FORMAT!r}"
    return None
