"""A sweep stopped in the middle and started again runs only the points that did not finish."""

from __future__ import annotations

from mlflow import MlflowClient

from tests.helpers import run_cli
from xengine.graph.io import save_graph
from xengine.graph.synthetic import chain


def _runs(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("xengine")
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

    from xengine.sweep import sweep_size

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
