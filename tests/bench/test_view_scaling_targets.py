"""bench/view_scaling.py's verdicts on issue 56's targets, from results given by hand (no Spark): each
target is judged from the right row, and a size the run left out is "not measured"."""

from __future__ import annotations

import pytest

from bench import view_scaling as vs

KEYED, AGG = vs.KEYED.topic, vs.AGGREGATE.topic


def result(size: int, changed: int, view: str, tm: float, full: float, strategy: str = "incremental") -> vs.Result:
    event = f"{changed:,} changed customers" if changed else "10,000 appended orders"
    return vs.Result(size, event, changed, view, tm, full, strategy, "")


def lines(results: list[vs.Result], capsys: pytest.CaptureFixture[str]) -> list[str]:
    vs.print_targets_56(results)
    return [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_issue_56_verdicts_come_from_the_right_rows(capsys: pytest.CaptureFixture[str]) -> None:
    out = lines([
        result(1_000_000, 10, KEYED, 3.0, 2.0, "full"),         # the full path at 1.5x: a miss of both rules
        result(10_000_000, 10, KEYED, 1.4, 10.0),               # 0.14 <= 0.15
        result(50_000_000, 10, KEYED, 4.0, 50.0),               # 0.08 <= 0.10; growth 4.0 / 3.0
        result(10_000_000, 0, KEYED, 0.4, 10.0),                # 0.04
        result(50_000_000, 0, KEYED, 3.0, 50.0),                # 0.06: a miss
        result(10_000_000, 1_000, AGG, 1.0, 1.0, "full"),
    ], capsys)
    assert f"{KEYED}: 10 changed rows at 1,000,000 orders <= 1.00 x the full rebuild: 1.500 -> MISS" in out
    assert f"{KEYED}: 10 changed rows at 10,000,000 orders <= 0.15 x the full rebuild: 0.140 -> PASS" in out
    assert f"{KEYED}: 10 changed rows at 50,000,000 orders <= 0.10 x the full rebuild: 0.080 -> PASS" in out
    assert f"{KEYED}: 10 changed rows, refresh time 50,000,000 / 1,000,000 orders <= 1.5x: 1.33 -> PASS" in out
    assert (f"{KEYED}: every unit on the full path <= 1.1x the plain rebuild (1 unit(s)): worst 1.500 "
            f"(1,000,000 orders, 10 changed customers) -> MISS") in out
    assert f"{KEYED}: appended orders at 10,000,000 orders <= 5% of the full rebuild: 0.040 -> PASS" in out
    assert f"{KEYED}: appended orders at 50,000,000 orders <= 5% of the full rebuild: 0.060 -> MISS" in out
    assert (f"{AGG}: every unit on the full path <= 1.1x the plain rebuild (1 unit(s)): worst 1.000 "
            f"(10,000,000 orders, 1,000 changed customers) -> PASS") in out
    assert f"{AGG}: 10 changed rows at 10,000,000 orders <= 0.15 x the full rebuild: - -> not measured" in out
    assert f"{AGG}: 10 changed rows, refresh time 50,000,000 / 1,000,000 orders <= 1.5x: - -> not measured" in out


def test_rounds_are_judged_on_their_medians_and_one_outlier_does_not_decide(capsys: pytest.CaptureFixture[str]) -> None:
    rounds = [
        result(1_000_000, 10, KEYED, 0.5, 4.0), result(1_000_000, 10, KEYED, 0.4, 4.2),
        result(1_000_000, 10, KEYED, 2.0, 3.9),   # a unit that ran into the machine's noise
        result(50_000_000, 10, KEYED, 0.6, 50.0), result(50_000_000, 10, KEYED, 0.7, 52.0),
        result(50_000_000, 10, KEYED, 0.65, 49.0),
        result(10_000_000, 1_000, AGG, 6.1, 4.7, "full"),  # a rebuild that ran fast once
        result(10_000_000, 1_000, AGG, 6.0, 6.2, "full"), result(10_000_000, 1_000, AGG, 6.3, 6.0, "full"),
        result(1_000_000, 1_000, AGG, 1.0, 1.0, "incremental"),  # rounds that took different paths stay apart
        result(1_000_000, 1_000, AGG, 1.5, 1.0, "full"), result(1_000_000, 1_000, AGG, 1.2, 1.0, "incremental"),
    ]
    summary = vs.medians(rounds)
    by = {(r.size, r.changed, r.view, r.strategy): r for r in summary}
    assert len(summary) == 5 and by[(1_000_000, 10, KEYED, "incremental")].tm_s == 0.5
    assert by[(10_000_000, 1_000, AGG, "full")].full_s == 6.0 and by[(10_000_000, 1_000, AGG, "full")].rounds == 3
    assert by[(1_000_000, 1_000, AGG, "incremental")].rounds == 2 and by[(1_000_000, 1_000, AGG, "full")].rounds == 1
    assert vs._find(summary, 1_000_000, 1_000, AGG).strategy == "incremental"  # the path most rounds took
    out = lines(summary, capsys)
    assert f"{KEYED}: 10 changed rows, refresh time 50,000,000 / 1,000,000 orders <= 1.5x: 1.30 -> PASS" in out
    # the full path: the worst median is the 1M round alone (1.5x), not the 10M fast rebuild's 1.30
    assert (f"{AGG}: every unit on the full path <= 1.1x the plain rebuild (4 unit(s)): worst 1.500 "
            f"(1,000,000 orders, 1,000 changed customers) -> MISS") in out
    summary = vs.medians(rounds[:9])
    assert (f"{AGG}: every unit on the full path <= 1.1x the plain rebuild (3 unit(s)): worst 1.017 "
            f"(10,000,000 orders, 1,000 changed customers, the median of 3) -> PASS") in lines(summary, capsys)
