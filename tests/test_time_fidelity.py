"""experiments/time_fidelity.py's verdicts from rows (the measuring is the benchmark's): what
counts as within 5 % and what as within the noise of the two medians it compares."""

from __future__ import annotations

from experiments.time_fidelity import summarize


def _row(strategy: str, err: float, pred_se: float | None, meas_se: float, **kw) -> dict:
    return {
        "net": "n",
        "devices": "cpu",
        "budget_pct": 50,
        "strategy": strategy,
        "plain_device": "cpu",
        "pred_ms": kw.get("pred", 2.0),
        "meas_ms": 2.0,
        "err_pct": err,
        "profile_err_pct": err,
        "meas_over_plain": kw.get("ratio", 2.0),
        "ratio_se_pct": meas_se,
        "time_se_pct": meas_se,
        "norm_err_pct": err,
        "pred_se_pct": pred_se,
    }


def test_within_five_percent_or_twice_the_standard_error_of_the_two_medians():
    rows = [
        _row("keep_all", 0.0, None, 1.0) | {"norm_err_pct": None},
        _row("a", 4.9, 1.0, 1.0, pred=1.0),
        _row("b", -7.0, 3.0, 2.0),  # 2 * hypot(3, 2) = 7.2: within the noise
        _row("c", 7.0, 1.0, 1.0),  # 2 * hypot(1, 1) = 2.8: a miss
        _row("d", 7.0, None, 4.0),  # no standard error of the prediction: 5 % only
    ]
    (s,) = summarize(rows)
    assert s["within_5pct"] == "1/4"
    assert s["within_5pct_or_noise"] == "2/4"
    assert s["fastest_predicted_is_fastest"] == "50%:ok"


def test_the_fastest_prediction_is_ranked_in_plain_step_units():
    """Two schedules timed in context at different machine speeds: in milliseconds the
    second looks faster (its context met a fast minute), in plain-step units the first is;
    the first is measured fastest, so the verdict is ok, and it would be missed if the
    milliseconds ranked them."""
    rows = [
        _row("keep_all", 0.0, None, 1.0) | {"norm_err_pct": None},
        # predicted 1.9x plain at a slow minute (80 ms), measured 1.9x
        _row("fast", 0.0, 1.0, 1.0, pred=80.0, ratio=1.9),
        # predicted 2.2x plain at a fast minute (66 ms), measured 2.2x
        _row("slow", 0.0, 1.0, 1.0, pred=66.0, ratio=2.2),
    ]
    (s,) = summarize(rows)
    assert s["fastest_predicted_is_fastest"] == "50%:ok"
    rows[1]["norm_err_pct"] = rows[2]["norm_err_pct"] = None  # no context: milliseconds
    (s,) = summarize(rows)
    assert s["fastest_predicted_is_fastest"] == "50%:MISSED"
