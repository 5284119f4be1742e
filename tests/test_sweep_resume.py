"""A sweep stopped in the middle and started again runs only the points that did not finish."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from mlflow import MlflowClient

from tests.helpers import REPO, cli_command, run_cli
from xengine.graph.io import save_graph
from xengine.graph.synthetic import chain

sys.path.insert(0, str(REPO / "experiments"))
try:
    import figures  # noqa: E402
finally:
    sys.path.remove(str(REPO / "experiments"))


def _runs(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("xengine")
    if exp is None:  # the sweep has not created it yet
        return client, []
    return client, [
        r for r in client.search_runs([exp.experiment_id]) if "xe.fingerprint" in r.data.tags
    ]


def test_restarted_sweep_finishes_only_the_missing_point(tmp_path, store):
    graph = tmp_path / "chain6.json"
    save_graph(chain(6), graph)
    args = (f"graph={graph}", "mem=70%,85%,100%", "strategy=[checkmate]", "-m")
    first = run_cli(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    client, runs = _runs(tmp_path)
    assert sorted(r.data.params["mem"] for r in runs) == ["100%", "70%", "85%"]
    log = first.stdout + first.stderr
    assert "sweep of 3 point(s)" in log
    lines = [ln for ln in log.splitlines() if "sweep point" in ln]
    assert len(lines) == 3
    for line, k, mem in zip(lines, (1, 2, 3), ("70%", "85%", "100%"), strict=True):
        assert f"sweep point {k} of 3 ({3 - k} after this one): " in line and f"mem={mem}" in line
    assert all(r.info.status == "FINISHED" for r in runs)

    # the 85 % point is "killed": it never finished
    killed = next(r for r in runs if r.data.params["mem"] == "85%")
    client.set_terminated(killed.info.run_id, status="KILLED")

    second = run_cli(tmp_path, *args)
    assert second.returncode == 0, second.stderr[-2000:]
    _, runs2 = _runs(tmp_path)
    new = [r for r in runs2 if r.info.run_id not in {r0.info.run_id for r0 in runs}]
    assert [r.data.params["mem"] for r in new] == ["85%"]
    assert new[0].info.status == "FINISHED"
    assert second.stderr.count("has this config and finished") == 2
    # the finished points are untouched and keep their results
    for r0 in runs:
        if r0.info.run_id != killed.info.run_id:
            r1 = client.get_run(r0.info.run_id)
            assert r1.info.status == "FINISHED"
            assert r1.data.metrics == r0.data.metrics


def test_sweep_size_counts_points_as_the_basic_sweeper_expands_them():
    from omegaconf import OmegaConf

    from xengine.records.sweep import sweep_size

    hc = OmegaConf.create(
        {
            "sweeper": {"params": {"net": "resnet18,vgg16", "mem.all": "50%,70%,90%"}},
            "overrides": {"task": ["mem.all=50%,60%", "solver=highs"]},  # the command line wins
        }
    )
    assert sweep_size(hc) == 4
    hc = OmegaConf.create({"sweeper": {"params": None}, "overrides": {"task": ["x=1"]}})
    assert sweep_size(hc) == 1
    assert sweep_size(OmegaConf.create({})) is None


def _overhead_csv(tmp_path: Path) -> pd.DataFrame:
    out = tmp_path / "figures"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert figures.main(["--tracking-uri", uri, "--out", str(out), "--only", "overhead"]) == 0
    data = pd.read_csv(out / "overhead_vs_budget.csv")
    return (
        data.drop(columns=["run_id"]).sort_values(["strategy", "budget_mib"]).reset_index(drop=True)
    )


def test_sweep_killed_mid_run_and_restarted_equals_an_uninterrupted_sweep(tmp_path, store):
    """The sweep process is killed (SIGKILL, whole process group) once two points have
    finished; the restart runs only the points without a finished run, and the figure data
    equal those of the same sweep run without interruption."""
    graph = tmp_path / "chain10.json"
    save_graph(chain(10), graph)
    args = (
        f"graph={graph}",
        "mem=50%,60%,70%,80%,90%,100%",
        "strategy=[checkmate,chen_greedy]",
        "-m",
    )
    killed_dir, whole_dir = tmp_path / "killed", tmp_path / "whole"
    for d in (killed_dir, whole_dir):  # each with a store made in advance (no race on it)
        d.mkdir()
        shutil.copy(store, d / "mlflow.db")
    cmd, env = cli_command(killed_dir, *args)
    proc = subprocess.Popen(
        cmd,
        cwd=killed_dir,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    finished_before: dict[str, dict] = {}
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            _, runs = _runs(killed_dir)
            if sum(r.info.status == "FINISHED" for r in runs) >= 2:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    client, runs = _runs(killed_dir)
    finished_before = {r.info.run_id: r for r in runs if r.info.status == "FINISHED"}
    assert 2 <= len(finished_before) < 6, "the sweep was not interrupted mid-way"

    again = run_cli(killed_dir, *args)
    assert again.returncode == 0, again.stderr[-2000:]
    _, runs = _runs(killed_dir)
    finished = [r for r in runs if r.info.status == "FINISHED"]
    assert sorted(r.data.params["mem"] for r in finished) == sorted(
        ["50%", "60%", "70%", "80%", "90%", "100%"]
    )
    for run_id, r0 in finished_before.items():  # untouched, not redone
        r1 = client.get_run(run_id)
        assert r1.info.status == "FINISHED" and r1.data.metrics == r0.data.metrics
    assert len(finished) == 6

    whole = run_cli(whole_dir, *args)
    assert whole.returncode == 0, whole.stderr[-2000:]
    pd.testing.assert_frame_equal(_overhead_csv(killed_dir), _overhead_csv(whole_dir))
