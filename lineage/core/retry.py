"""Trying a call again while it fails in a way worth another try (a commit that lost to a
concurrent writer): the one retry loop of Tidemark's writers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def retrying(call: Callable[[], T], *, attempts: int, retryable: Callable[[BaseException], bool], backoff_s: float,
             on_retry: Callable[[BaseException, int], None] | None = None) -> T:
    """``call()``, tried up to ``attempts`` times in all while it raises an exception that
    ``retryable`` accepts, sleeping ``backoff_s`` times the number of the failed try in between;
    ``on_retry(exc, next_try)`` is told before each new try. The last exception, or the first one
    ``retryable`` refuses, propagates unchanged."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as exc:
            if attempt >= attempts or not retryable(exc):
                raise
            if on_retry is not None:
                on_retry(exc, attempt + 1)
            time.sleep(backoff_s * attempt)
    raise AssertionError("attempts must be at least 1")
