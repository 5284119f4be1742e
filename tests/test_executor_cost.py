"""experiments/executor_cost.py: the figures of a row, the CSV read back, the plot drawn (the
measurement itself is the benchmark's, never asserted in a test)."""

from __future__ import annotations

import pytest

from experiments import executor_cost as ec
from experiments.common import write_csv
from xengine.result import MIB, RunRow


def _rows():
    keep = RunRow("checkpoint_all", "checkpoint_all", ("cpu",), "feasible", predicted_time_s=0.1)
    keep.measured_over_plain = 1.01
    ours = RunRow("checkmate", "checkmate", ("cpu",), "optimal", predicted_time_s=0.12)
    ours.measured_over_plain, ours.n_recomputes = 1.26, 4
    ours.predicted_peak_bytes, ours.measured_peak_bytes = (10 * MIB,), (10 * MIB + 2048,)
    pol = RunRow("torch_checkpoint", "torch_checkpoint", ("cpu",), "feasible")
    pol.measured_over_plain, pol.ours_over_plain = 1.10, 1.25
    return [ec._row(r, "net", 2, 64, 70, 0.1) for r in (keep, ours, pol)]


def test_a_row_is_its_error_over_keep_everythings_prediction():
    keep, ours, pol = _rows()
    assert keep["pred_over_keepall"] == 1.0 and keep["err_pct"] == pytest.approx(1.0)
    assert ours["pred_over_keepall"] == pytest.approx(1.2)
    assert ours["err_pct"] == pytest.approx(100 * (1.26 / 1.2 - 1), abs=1e-3)
    assert ours["peak_err_mib"] == pytest.approx(2048 / MIB, abs=1e-4)
    # PyTorch's own plan against ours: its time over our executor's, beside the same plains
    assert pol["pytorch_over_ours"] == pytest.approx(1.10 / 1.25, abs=1e-4)
    assert pol["err_pct"] is None  # no prediction: PyTorch ran it itself


def test_the_csv_reads_back_and_plots(tmp_path):
    write_csv(tmp_path / "executor_cost.csv", _rows())
    back = ec._read(tmp_path / "executor_cost.csv")
    assert [r["strategy"] for r in back] == ["checkpoint_all", "checkmate", "torch_checkpoint"]
    assert back[1]["err_pct"] == pytest.approx(_rows()[1]["err_pct"]) and back[0]["wrong"] is None
    ec.plot(back, tmp_path / "executor_cost.png")
    assert (tmp_path / "executor_cost.png").stat().st_size > 10_000
