"""experiments/keep_all_overhead.py runs end to end on one net (the mechanism: rows, figure,
replot); the ratios themselves are measured by running it, not asserted here."""

from __future__ import annotations

import csv

from experiments import keep_all_overhead


def test_one_net_writes_its_row_and_figure(tmp_path):
    keep_all_overhead.main(
        ["--nets", "squeezenet1_1", "--pairs", "3", "--seconds", "0", "--most", "3"]
        + ["--out", str(tmp_path)]
    )
    with open(tmp_path / "keep_all.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["net"] == "squeezenet1_1" and int(row["pairs"]) == 3
    assert min(float(row[k]) for k in ("keep_all_ms", "plain_ms", "ratio")) > 0
    assert row["commit"]
    # squeezenet's 26 ReLU(inplace=True): also timed against the module as written, whose
    # peak is measured (an in-place ReLU frees nothing the peak holds there)
    assert int(row["inplace_modules"]) == 26 and float(row["as_written_ratio"]) > 0
    assert abs(float(row["as_written_peak_mib"]) - float(row["keep_all_peak_mib"])) <= 1.0
    png = tmp_path / "keep_all.png"
    assert png.stat().st_size > 0
    png.unlink()
    keep_all_overhead.main(["--replot", "--out", str(tmp_path)])
    assert png.stat().st_size > 0
