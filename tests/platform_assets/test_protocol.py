"""Pure parts of the commit protocol."""

from __future__ import annotations

import time

from platform_assets.core.protocol import Phases


def test_nested_phases_count_only_their_own_time():
    phases = Phases()
    with phases.timed("transform"):
        time.sleep(0.05)
        with phases.timed("spark"):
            time.sleep(0.1)
    with phases.timed("transform"):  # a phase entered twice adds up
        time.sleep(0.05)
    got = phases.seconds
    assert 0.1 <= got["spark"] < 0.2
    assert 0.1 <= got["transform"] < 0.2  # not the 0.2 s it spanned with the session start inside
    assert phases.rounded() == {k: round(v, 3) for k, v in got.items()}


def test_a_phase_that_raises_is_still_counted():
    phases = Phases()
    try:
        with phases.timed("write"):
            time.sleep(0.02)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert phases.seconds["write"] >= 0.02
