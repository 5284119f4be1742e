"""The scripts that measure profiles on a device mix and run saved schedules side by side,
on two CPU sub-devices (their CUDA use is the same code with another device name)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
try:
    import device_profiles  # noqa: E402
    import execute_schedules  # noqa: E402
finally:
    sys.path.remove(str(REPO / "experiments"))

from xengine.graph.io import load_graph  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.profile.profiler import Profile, apply_profile, profile_model  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.schedule import keep_all_schedule  # noqa: E402
from xengine.simulate import simulate  # noqa: E402

NET = ["--net", "tiny", "--batch-size", "2", "--image-size", "16"]


def test_profiles_and_costed_graph_are_written_and_apply(tmp_path):
    rc = device_profiles.main(
        ["--nets", "tiny:2", "--devices", "cpu2", "cpu1", "--steps", "1"]
        + ["--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]
    )
    assert rc == 0
    prof = Profile.load(tmp_path / "tiny-b2-cpu2+cpu1.profile.json")
    graph = load_graph(tmp_path / "tiny-b2-cpu2+cpu1.graph.json")
    cap = capture_net("tiny", 2)
    assert apply_profile(cap.graph, prof).size == graph.size
    for d in ("cpu2", "cpu1"):
        assert graph.cost_array_s(d).sum() > 0
    rows = list(csv.DictReader((tmp_path / "profiles.csv").open()))
    assert {r["device"] for r in rows if r["plain_step_ms"]} == {"cpu2", "cpu1"}
    assert {(r["device"], r["copy_to"]) for r in rows if r["copy_to"]} == {
        ("cpu2", "cpu1"),
        ("cpu1", "cpu2"),
    }
    assert (tmp_path / "profiles.png").stat().st_size > 0


def test_saved_schedules_run_side_by_side(tmp_path):
    cap = capture_net("tiny", 2, image_size=16)
    prof = profile_model(cap, ("cpu2", "cpu1"), 1, 0, cache_dir=None, progress=False)
    prof_path = prof.save(tmp_path / "tiny.profile.json")
    graph = apply_profile(cap.graph, prof)
    args = []
    for d in ("cpu2", "cpu1"):
        inst = Instance(graph, (d,), (10**9,))
        path = tmp_path / f"{d}.json"
        path.write_text(json.dumps(keep_all_schedule(inst).to_json()))
        args += ["--schedule", f"keep_all.{d}={path}"]
    out = tmp_path / "out"
    rc = execute_schedules.main(
        [*NET, "--profile", str(prof_path), *args, "--rounds", "2", "--out", str(out)]
    )
    assert rc == 0
    rows = {r["label"]: r for r in csv.DictReader((out / "tiny_b2_summary.csv").open())}
    assert set(rows) == {"keep_all.cpu2", "keep_all.cpu1", "pytorch.cpu2"}
    for d in ("cpu2", "cpu1"):
        r = rows[f"keep_all.{d}"]
        assert r["grads_match"] == "True"
        inst = Instance(graph, (d,), (10**9,))
        expect = simulate(inst, keep_all_schedule(inst))
        assert float(r["predicted_ms"]) == pytest.approx(1e3 * expect.time_s, rel=1e-3)
        assert float(r["measured_peak_mib"]) == pytest.approx(
            expect.peak_bytes[0] / 2**20, rel=0.05
        )
    steps = list(csv.DictReader((out / "tiny_b2.csv").open()))
    assert len(steps) == 2 * 3  # rounds x (two schedules + one plain step)
    assert (out / "tiny_b2.png").stat().st_size > 0
