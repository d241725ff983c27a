"""The loader state's format tag, and the one place a state's format is checked. The tag
changes whenever a state would point at other records: colo-data/2 changed the `global`
shuffle (`colo_data.pipeline.permute`)."""

from __future__ import annotations

FORMAT = "colo-data/2"
# The furthest position (or partition position) a state may hold: an int64 with room
# above it for the arithmetic of the batches that follow (a made-up state past it is refused).
MAX_POSITION = 2**62


def format_of(state: object) -> str | None:
    """The problem with `state` as a loader state of this colo-data's format, or None when
    it is one."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a dict of format {FORMAT!r}"
    found = state.get("format")
    if found == FORMAT:
        return None
    if isinstance(found, str) and found.startswith("colo-data/"):
        return (
            f"format {found!r}, from another colo-data version, which orders records otherwise (this one reads "
            f"{FORMAT!r}): continue it with the version that saved it, or start without a state"
        )
    return f"format {found!r}; this colo-data reads {FORMAT!r}"
