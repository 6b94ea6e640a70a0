import datetime as dt

import pytest
from pydantic import ValidationError

from lineage.core.checks import ChecksSpec, Severity, evaluate_block

STATS = {"rows": 100, "base_rows": 120, "max_id": 7, "min_ts": None, "max_ts": None, "max_lag": 90.0,
         "nulls": {"country": 12}}


def _by_name(outcomes):
    return {o.name: o for o in outcomes}


def test_defaults_pass_a_healthy_block_and_carry_the_figures():
    out = _by_name(evaluate_block(ChecksSpec(), STATS))
    assert [o.passed for o in out.values()] == [True, True, True, True]
    assert out["rows"].metadata["nulls"] == {"country": 12} and out["rows"].metadata["max_id"] == 7
    assert out["rows"].severity is Severity.WARN


def test_empty_output_from_a_nonempty_block_fails_rows():
    out = _by_name(evaluate_block(ChecksSpec(severity="error"), {**STATS, "rows": 0}))
    assert not out["rows"].passed and out["rows"].severity is Severity.ERROR
    assert "wrote nothing" in out["rows"].description
    assert _by_name(evaluate_block(ChecksSpec(), {**STATS, "rows": 0, "base_rows": 0}))["rows"].passed
    assert _by_name(evaluate_block(ChecksSpec(require_rows=False), {**STATS, "rows": 0}))["rows"].passed


def test_lag_threshold():
    spec = ChecksSpec.model_validate({"max_lag": "1m"})
    assert spec.max_lag == dt.timedelta(minutes=1)
    lag = _by_name(evaluate_block(spec, STATS))["lag"]
    assert not lag.passed and lag.description == "max_lag 90 s > 1m"
    assert _by_name(evaluate_block(spec, {**STATS, "max_lag": 60.0}))["lag"].passed


def test_null_share_threshold_per_column():
    spec = ChecksSpec(max_null_share={"country": 0.1, "segment": 0.5})
    nulls = _by_name(evaluate_block(spec, {**STATS, "nulls": {"country": 12, "segment": 0}}))["nulls"]
    assert not nulls.passed and nulls.description == "too many nulls: country 12.0% > 10.0%"
    assert _by_name(evaluate_block(ChecksSpec(max_null_share={"country": 0.12}), STATS))["nulls"].passed


def test_incomplete_late_row_detection_fails_late_rows_as_a_warning():
    gap = "late-row detection incomplete: stage.x versions 3..5 no longer in its Delta log (log retention)"
    late = _by_name(evaluate_block(ChecksSpec(severity="error"), {**STATS, "warnings": [gap], "bad_rows": 2}))["late_rows"]
    assert not late.passed and late.severity is Severity.WARN and late.description == gap
    ok = _by_name(evaluate_block(ChecksSpec(), {**STATS, "bad_rows": 2}))["late_rows"]
    assert ok.passed and "2 bad rows quarantined" in ok.description


def test_null_share_of_a_column_nobody_counted_fails():
    """Null counts list every output column (zeros too): a threshold on a column missing from
    them (a typo, or a figure the block could not count) must not pass silently."""
    spec = ChecksSpec(max_null_share={"country": 0.5, "c38": 0.1})
    nulls = _by_name(evaluate_block(spec, STATS))["nulls"]
    assert not nulls.passed and nulls.description.startswith("no null count for c38")
    both = _by_name(evaluate_block(ChecksSpec(max_null_share={"country": 0.1, "c38": 0.1}), STATS))["nulls"]
    assert both.description == "too many nulls: country 12.0% > 10.0%; no null count for c38 (not a column of the block's output; fix max_null_share)"
    assert _by_name(evaluate_block(spec, {**STATS, "rows": 0}))["nulls"].passed  # no rows: no nulls to count


@pytest.mark.parametrize("bad", [{"max_null_share": {"x": 1.5}}, {"severity": "fatal"}, {"max_lag": "soon"}, {"nope": 1}])
def test_bad_check_specs_are_rejected(bad):
    with pytest.raises(ValidationError):
        ChecksSpec.model_validate(bad)


def test_the_exact_check_comes_with_verify_sample_and_fails_as_an_error() -> None:
    from lineage.core.checks import evaluate_unit, merge_check_names

    off = ChecksSpec()
    assert "exact" not in merge_check_names(off)
    assert [o.name for o in evaluate_unit(off, {})] == ["offset_age", "late_rows", "refresh"]
    on = ChecksSpec(verify_sample=5)
    assert merge_check_names(on)[-1] == "exact"

    def exact(stats: dict) -> tuple[bool, str]:
        [o] = [o for o in evaluate_unit(on, stats) if o.name == "exact"]
        assert o.severity is Severity.ERROR
        return o.passed, o.description

    assert exact({"verify": {"keys": 5, "differing": 0, "duplicates": 0}}) == (True, "5 sampled keys equal a recompute")
    assert exact({"verify": {"keys": 5, "differing": 1, "duplicates": 0, "example": "country='?'"}}) == (
        False, "1 of 5 sampled keys differ from a recompute (e.g. country='?'); run: tidemark verify TOPIC")
    assert exact({"verify": {"error": "boom"}}) == (False, "could not verify the view: boom")
    assert not exact({})[0]  # asked for and not reported: never a silent pass
