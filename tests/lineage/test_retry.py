"""The one retry loop (lineage.core.retry): tries again only what it is told to, as often as told."""

from __future__ import annotations

import pytest

from lineage.core import retry
from lineage.core.retry import retrying


class Lost(Exception):
    pass


def test_a_retryable_failure_is_tried_again_until_the_call_succeeds(monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", slept.append)
    told: list[tuple[str, int]] = []
    results = iter([Lost("first"), Lost("second"), "done"])

    def call() -> str:
        r = next(results)
        if isinstance(r, Exception):
            raise r
        return r

    out = retrying(call, attempts=3, retryable=lambda e: isinstance(e, Lost), backoff_s=0.5,
                   on_retry=lambda e, n: told.append((str(e), n)))
    assert out == "done"
    assert told == [("first", 2), ("second", 3)] and slept == [0.5, 1.0]


def test_the_last_failure_and_one_not_retryable_propagate_unchanged(monkeypatch) -> None:
    monkeypatch.setattr(retry.time, "sleep", lambda s: None)
    calls: list[int] = []

    def lost() -> None:
        calls.append(1)
        raise Lost(f"try {len(calls)}")

    with pytest.raises(Lost, match="try 4"):
        retrying(lost, attempts=4, retryable=lambda e: True, backoff_s=0)
    assert len(calls) == 4
    calls.clear()
    with pytest.raises(Lost, match="try 1"):
        retrying(lost, attempts=4, retryable=lambda e: False, backoff_s=0)
    assert len(calls) == 1
