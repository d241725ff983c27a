"""Retries of object-storage reads: which errors are transient (HTTP 5xx and 429, resets,
timeouts, as pyarrow's S3 and GCS clients word them) and a bounded loop of attempts with
exponential backoff and full jitter, so that a blip costs a retry and a lasting failure an
error in bounded time, never a hang."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

import pyarrow as pa

T = TypeVar("T")

BACKOFF_S = 0.1  # the first retry waits up to this long; each next one twice as long ...
BACKOFF_CAP_S = 4.0  # ... up to this

# How pyarrow words a failure worth another try: the AWS SDK's error names (SLOW_DOWN for
# 503 SlowDown, SERVICE_UNAVAILABLE, INTERNAL_FAILURE for 5xx, THROTTLING for 429,
# NETWORK_CONNECTION and curl codes for resets and timeouts), google-cloud-cpp's status codes
# (UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, INTERNAL), HTTP codes in messages,
# and the socket errors of any filesystem.
_TRANSIENT = re.compile(
    r"SLOW_DOWN|SlowDown|SERVICE_UNAVAILABLE|ServiceUnavailable|INTERNAL_FAILURE|InternalError|THROTTL|Throttl|"
    r"REQUEST_TIMEOUT|RequestTimeout|NETWORK_CONNECTION|curlCode|UNAVAILABLE|RESOURCE_EXHAUSTED|DEADLINE_EXCEEDED|"
    r"\bINTERNAL\b|\bABORTED\b|[Cc]onnection (reset|refused|aborted|closed)|[Bb]roken pipe|[Tt]imed? ?out|"
    r"[Tt]emporar|\b(HTTP|status|code|response code)[^0-9]{0,3}(429|5\d\d)\b"
)


def transient(error: BaseException) -> bool:
    """Whether `error` (from a pyarrow filesystem, or an fsspec one's as `StoreHandler`
    raises it) may go away on another try."""
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    return isinstance(error, (OSError, pa.ArrowException)) and bool(_TRANSIENT.search(str(error)))


class Exhausted(Exception):
    """A read that failed for good: after `attempts` tries over `seconds`, the last error is
    the cause (`__cause__`); `transient` says whether it was a retryable kind."""

    def __init__(self, attempts: int, seconds: float, transient: bool) -> None:
        super().__init__(f"{attempts} attempt(s) over {seconds:.1f} s")
        self.attempts, self.seconds, self.transient = attempts, seconds, transient


def with_retries(call: Callable[[], T], retries: int) -> T:
    """`call()`, tried again up to `retries` times while it fails with a transient error,
    waiting a random time up to `BACKOFF_S * 2**attempt` (at most `BACKOFF_CAP_S`) before
    each retry.

    Raises:
        Exhausted: a non-transient error, or a transient one that lasted `retries` retries;
            the error itself is its cause.
    """
    start = time.monotonic()
    for attempt in range(retries + 1):
        try:
            return call()
        except (OSError, pa.ArrowException) as e:
            again = transient(e)
            if not again or attempt == retries:
                raise Exhausted(attempt + 1, time.monotonic() - start, again) from e
            time.sleep(random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_S * 2**attempt)))
    raise AssertionError("unreachable")
