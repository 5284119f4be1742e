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


def test_a_peak_off_by_more_than_1_mib_keeps_graph_and_schedule(tmp_path):
    import json
    from types import SimpleNamespace

    import numpy as np

    from xengine.graph.io import load_graph
    from xengine.graph.synthetic import linear_graph
    from xengine.problem import Instance
    from xengine.schedule import Schedule, keep_all_schedule

    graph = linear_graph(4, ("cpu2", "cpu1"))
    inst = Instance(graph, ("cpu2", "cpu1"), (1 << 30, 1 << 30))
    sched = keep_all_schedule(inst)
    mib = second_device.MIB
    sim = SimpleNamespace(peak_bytes=np.array([10 * mib, 4 * mib]))
    row = {"net": "tiny", "candidate": "offloaded +20%"}
    # within 1 MiB on both devices: nothing kept
    second_device._keep_if_off(
        row, tmp_path, graph, (1, 2), sched, sim, {"cpu2": 9.5 * mib, "cpu1": 4 * mib}
    )
    assert "peak_off_dir" not in row and not (tmp_path / "peak_off").exists()
    second_device._keep_if_off(
        row, tmp_path, graph, (1, 2), sched, sim, {"cpu2": 8 * mib, "cpu1": 4 * mib}
    )
    where = tmp_path / row["peak_off_dir"]
    assert where.name == "tiny_offloaded_+20pct"
    assert load_graph(where / "graph.json").size == graph.size
    data = json.loads((where / "schedule.json").read_text())
    assert data["budgets_bytes"] == [1, 2]
    again = Schedule.from_json(data["schedule"])
    assert (again.R == sched.R).all() and (again.S == sched.S).all()
