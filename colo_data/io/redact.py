"""Paths as messages show them. A URI can carry secrets (`s3://KEY:SECRET@bucket/...`, a
query's `secret_key=` or `token=`, a signed URL's signature): every message, log line and
traceback that colo-data writes about a path shows it through `redacted`, which puts `***`
in their place, so that a secret never reaches a log."""

from __future__ import annotations

import re

_USER_INFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s'\"]*@")  # scheme://user:password@host
_SECRET_QUERY = re.compile(
    r"([?&;][^=&#\s'\"]*(?:key|secret|token|pass|sig|credential|auth)[^=&#\s'\"]*=)[^&#\s'\"]*", re.IGNORECASE
)


def redacted(text: str) -> str:
    """`text` (a path, or a message with paths in it) with the user info of every URI in it
    and the values of query parameters that name a key, secret, token, password, signature
    or credential replaced by `***`."""
    return _SECRET_QUERY.sub(r"\1***", _USER_INFO.sub(r"\1***@", text))
