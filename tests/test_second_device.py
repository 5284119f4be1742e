"""experiments/second_device.py runs end to end on one small net over two CPU sub-devices (the
mechanism: candidates, rows, figure); the speed-ups themselves are measured by running it, not
asserted here. What is asserted is exact: each executed candidate's measured peak on each
device equals the simulator's within 1 MiB, and only the reference row exceeds a budget."""

from __future__ import annotations

import csv

from experiments import second_device


def test_one_net_writes_its_rows_and_figure(tmp_path):
    second_device.main(
        ["--nets", "squeezenet1_1", "--rounds", "2", "--batch-size", "2", "--image-size", "64"]
        + ["--budget", "70"]
        + ["--out", str(tmp_path)]
    )
    with open(tmp_path / "second_device.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    labels = [r["candidate"] for r in rows]
    assert labels[:2] == ["one device", "one device, both budgets"]
    assert any(lab.startswith("offloaded +") for lab in labels)
    for r in rows:
        assert int(r["rounds"]) == 2 and float(r["meas_over_plain"]) > 0
        for dev in ("cpu2", "cpu1"):
            pred, meas = float(r[f"pred_peak_{dev}_mib"]), float(r[f"meas_peak_{dev}_mib"])
            assert abs(pred - meas) <= 1.0, (r["candidate"], dev, pred, meas)
            if r["candidate"] != "one device, both budgets":
                assert pred <= float(r[f"budget_{dev}_mib"])
        if r["candidate"].startswith("one device"):
            assert int(r["computes_off_fastest"]) == 0
    assert float(rows[0]["speedup_over_one_device"]) == 1.0
    assert float(rows[1]["pred_over_keep_all"]) < float(rows[0]["pred_over_keep_all"])
    png = tmp_path / "second_device.png"
    assert png.stat().st_size > 0
    png.unlink()
    second_device.main(["--replot", "--out", str(tmp_path)])
    assert png.stat().st_size > 0
