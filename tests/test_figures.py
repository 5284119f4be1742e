"""``experiments/figures.py`` on a real SQLite MLflow store filled as ``run.py`` fills it.

The runs are logged by hand (params, ``<label>/<quantity>`` metrics, ``xe.`` tags, schedule
and memory artifacts), so the test is fast and covers the cases that real sweeps produce
rarely: multi-device runs, a memory CSV, a schedule replayed from a logged graph, a run
without metrics, a skipped point and a failed run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from xengine.graph.io import save_graph
from xengine.graph.synthetic import chain
from xengine.problem import Instance
from xengine.schedule import keep_all_schedule
from xengine.simulate import simulate

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _load_figures():
    spec = importlib.util.spec_from_file_location("figures", REPO / "experiments" / "figures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["figures"] = mod
    spec.loader.exec_module(mod)
    return mod


figures = _load_figures()


def _experiment(client, tmp_path):
    """The experiment, its artifacts under ``tmp_path`` (not ``./mlruns``)."""
    return client.create_experiment("xengine", artifact_location=(tmp_path / "art").as_uri())


def _log(client, exp_id, name, params, metrics, tags, texts=None, status="FINISHED"):
    run = client.create_run(exp_id, run_name=name, tags={"xe.task": "run", **tags})
    rid = run.info.run_id
    for k, v in params.items():
        client.log_param(rid, k, v)
    for k, v in metrics.items():
        client.log_metric(rid, k, v)
    for path, text in (texts or {}).items():
        client.log_text(rid, text, path)
    client.set_terminated(rid, status)
    return rid


def _params(net="tiny", devices="cpu", mem="70%", solver="highs", graph="null"):
    return {
        "net.name": net,
        "net.batch_size": "2",
        "net.image_size": "32",
        "net.num_classes": "10",
        "mode": "train",
        "devices": devices,
        "devices.names": devices.replace("+", ","),
        "mem": mem,
        "solver.name": solver,
        "graph": graph,
    }


def _label_metrics(label, pred_ms, budget, peak, meas_ms=None, meas_peak=None, solve=None):
    m = {
        f"{label}/predicted_time_ms": pred_ms,
        f"{label}/budget_mib": budget,
        f"{label}/predicted_peak_mib": peak,
    }
    if meas_ms is not None:
        m[f"{label}/measured_time_ms"] = meas_ms
        m[f"{label}/measured_peak_mib"] = meas_peak
    if solve is not None:
        m[f"{label}/solve_time_s"] = solve
    return m


def _multi_device_run(client, exp_id, experiment_tag="", xengine="optimal"):
    """cpu2+cpu1: each device alone with the total memory, XEngine over both, executed."""
    metrics = {"graph/num_nodes": 23, "protocol/total_budget_mib": 1.0}
    tags = {"xe.status": "ok"}
    for dev, t in (("cpu2", 30.0), ("cpu1", 40.0)):
        metrics |= _label_metrics(f"checkmate.{dev}", t, 1.0, 0.7, t * 1.1, 0.71, solve=0.5)
        metrics |= _label_metrics(f"checkpoint_all.{dev}", t * 0.9, 1.0, 0.9)
        tags |= {
            f"xe.status.checkmate.{dev}": "optimal",
            f"xe.status.checkpoint_all.{dev}": "feasible",
        }
    metrics |= _label_metrics("xengine", 25.0, 0.5, 0.45, 27.0, 0.46, solve=2.0)
    for dev, p, m in (("cpu2", 0.45, 0.46), ("cpu1", 0.3, 0.31)):
        metrics |= {
            f"xengine/budget_mib.{dev}": 0.5,
            f"xengine/predicted_peak_mib.{dev}": p,
            f"xengine/measured_peak_mib.{dev}": m,
        }
    metrics |= {"pytorch/measured_time_ms": 20.0, "pytorch/measured_peak_mib": 0.9}
    tags |= {"xe.status.xengine": xengine, "xe.status.pytorch": "reference"}
    if experiment_tag:
        tags["xe.experiment"] = experiment_tag
    steps = [[0.1 * k, 0.05 * k] for k in range(6)]
    csv = "step,stage,node,cpu2_bytes,cpu1_bytes\n" + "".join(
        f"{k},{k},{k},{int(a * MIB)},{int(b * MIB)}\n" for k, (a, b) in enumerate(steps)
    )
    return _log(
        client,
        exp_id,
        "tiny-40%-cpu2+cpu1-highs",
        _params(devices="cpu2+cpu1", mem="40%"),
        metrics,
        tags,
        texts={"memory/xengine.csv": csv},
    )


def _budget_sweep(client, exp_id, solver="highs"):
    """One device, three budgets; Checkmate's time is not monotone (a time-limited solve at
    0.8 MiB), which the prefix minimum must hide."""
    ids = []
    for budget, t_cm, solve in ((1.0, 100.0, 0.2), (0.8, 130.0, 3.0), (0.6, 120.0, 1.0)):
        metrics = {"graph/num_nodes": 23 if solver == "highs" else 41}
        metrics |= _label_metrics("checkmate", t_cm, budget, budget * 0.95, solve=solve)
        metrics |= _label_metrics("checkpoint_all", 100.0, budget, 0.9)
        metrics |= _label_metrics("chen_sqrtn", 150.0, budget, 0.55)
        tags = {
            "xe.status": "ok",
            "xe.status.checkmate": "optimal" if budget != 0.8 else "feasible",
            "xe.status.checkpoint_all": "feasible" if budget >= 0.9 else "infeasible",
            "xe.status.chen_sqrtn": "feasible",
        }
        ids.append(_log(client, exp_id, f"tiny-{budget}", _params(solver=solver), metrics, tags))
    return ids


def _frontier_sweep(client, exp_id):
    """One device, three budgets, executed: the plain step's time differs per run (a noisy
    machine), Checkmate fits everywhere, torch_checkpoint at the two larger budgets,
    torch_sac nowhere."""
    ids = []
    for budget, plain_ms, ck, pol in (
        (100.0, 100.0, (95.0, 1.0), (90.0, 1.2)),
        (80.0, 110.0, (78.0, 1.1), (75.0, 1.3)),
        (60.0, 90.0, (58.0, 1.2), None),
    ):
        metrics = {"pytorch/measured_time_ms": plain_ms, "pytorch/measured_peak_mib": 100.0}
        peak, x = ck
        metrics |= _label_metrics("checkmate", 1.0, budget, peak, plain_ms * x, peak)
        tags = {
            "xe.status": "ok",
            "xe.experiment": "frontier",
            "xe.status.pytorch": "reference",
            "xe.status.checkmate": "optimal",
            "xe.status.torch_sac": "infeasible",
            "xe.status.torch_checkpoint": "infeasible" if pol is None else "feasible",
        }
        metrics["torch_sac/budget_mib"] = budget
        if pol is not None:
            metrics |= {
                "torch_checkpoint/budget_mib": budget,
                "torch_checkpoint/measured_peak_mib": pol[0],
                "torch_checkpoint/measured_time_ms": plain_ms * pol[1],
            }
        if budget == 80.0:  # a compiled policy whose gradients were wrong
            tags |= {"xe.status.torch_budget": "feasible", "xe.wrong.torch_budget": "grads"}
            metrics |= {
                "torch_budget/budget_mib": budget,
                "torch_budget/measured_peak_mib": 70.0,
                "torch_budget/measured_time_ms": plain_ms * 0.9,
            }
        ids.append(_log(client, exp_id, f"frontier-{budget}", _params(), metrics, tags))
    return ids


def _replay_run(client, exp_id, tmp_path, logged_peak_off=0.0):
    """A solve-only run with a graph.json artifact and a schedule, no memory CSV
    (``logged_peak_off``: the logged peak disagrees with the graph by that many MiB)."""
    g = chain(4, bytes_per_layer=MIB, cost_s=1e-3)
    path = tmp_path / "chain4.json"
    save_graph(g, path)  # logged below as the run's graph.json
    sched = keep_all_schedule(Instance.single(g, "cpu", None))
    metrics = {"graph/num_nodes": g.size}
    peak = simulate(Instance.single(g, "cpu", None), sched).peak_bytes[0] / MIB
    metrics |= _label_metrics("checkmate", 9.0, 8.0, peak + logged_peak_off, solve=0.1)
    rid = _log(
        client,
        exp_id,
        "chain4",
        _params(graph=str(tmp_path / "gone.json")),
        metrics,
        {"xe.status": "ok", "xe.status.checkmate": "optimal"},
        texts={"schedules/checkmate.json": json.dumps(sched.to_json())},
    )
    (tmp_path / rid).mkdir()
    shutil.copy(path, tmp_path / rid / "graph.json")
    client.log_artifact(rid, str(tmp_path / rid / "graph.json"))
    return rid


@pytest.fixture
def filled_store(uri, tmp_path):
    client = MlflowClient(uri)
    exp_id = _experiment(client, tmp_path)
    ids = {
        "multi": _multi_device_run(client, exp_id),
        "no_fit": _multi_device_run(client, exp_id, xengine="infeasible"),
        "sweep": _budget_sweep(client, exp_id),
        "scip": _budget_sweep(client, exp_id, solver="scip"),
        "frontier": _frontier_sweep(client, exp_id),
        "replay_bad": _replay_run(client, exp_id, tmp_path, logged_peak_off=1.0),
        "replay": _replay_run(client, exp_id, tmp_path),
        "bare": _log(client, exp_id, "bare", _params(), {}, {"xe.status": "ok"}),
        "skipped": _log(client, exp_id, "skip", _params(), {}, {"xe.status": "skipped"}),
        "failed": _log(
            client,
            exp_id,
            "fail",
            _params(),
            {"checkmate/predicted_time_ms": 1.0},
            {},
            status="FAILED",
        ),
    }
    return uri, ids


def test_every_figure_is_written_with_its_data(filled_store, tmp_path):
    uri, ids = filled_store
    out = tmp_path / "figures"
    outcomes = figures.make_figures(uri, "xengine", out, recapture=False)
    by_name = {o.name: o for o in outcomes}
    assert set(by_name) == {
        "runtime_bars",
        "memory_per_device",
        "overhead_vs_budget",
        "solver_scaling",
        "predicted_vs_measured",
        "frontier",
        "max_batch",  # drawn from task=max_batch runs: tests/test_max_batch.py
    }
    assert by_name["max_batch"].skipped == "no task=max_batch run in the records"
    for o in outcomes:
        if o.name == "max_batch":
            continue
        assert not o.skipped, (o.name, o.skipped)
        pngs = [p for p in o.paths if p.suffix == ".png"]
        assert pngs and all(p.stat().st_size > 5000 for p in pngs)
        for png in pngs:
            assert png.with_suffix(".csv").is_file()

    bars = pd.read_csv(out / "runtime_bars.csv", keep_default_na=False)
    ok = bars[bars["run_id"] == ids["multi"]].reset_index()
    assert list(ok["bar"]) == ["cpu2 alone", "cpu1 alone", "XEngine"]
    assert list(ok["label"]) == ["checkmate.cpu2", "checkmate.cpu1", "xengine"]
    assert float(ok.loc[2, "measured_time_ms"]) == 27.0
    no_fit = bars[bars["run_id"] == ids["no_fit"]].reset_index()
    assert list(no_fit["status"]) == ["optimal", "optimal", "does not fit"]
    assert no_fit.loc[2, "predicted_time_ms"] == ""

    over = pd.read_csv(out / "overhead_vs_budget.csv")
    cm = over[(over["strategy"] == "checkmate") & (over["run_id"].isin(ids["sweep"]))]
    cm = cm.sort_values("budget_mib")
    assert list(cm["budget_mib"]) == [0.6, 0.8, 1.0]
    assert list(cm["overhead"].round(3)) == [1.2, 1.3, 1.0]
    assert list(cm["overhead_prefix_min"].round(3)) == [1.2, 1.2, 1.0]  # best so far
    ca = over[(over["strategy"] == "checkpoint_all") & over["fits"]]
    assert (ca["overhead"] == 1.0).all()  # the keep-everything time is the denominator
    assert over[~over["fits"]]["overhead_prefix_min"].isna().all()

    scale = pd.read_csv(out / "solver_scaling.csv")
    assert set(scale["solver"]) == {"highs", "scip"}
    assert set(scale["strategy"]) == {"checkmate", "xengine"}
    assert set(scale.loc[scale["solver"] == "scip", "num_nodes"]) == {41}

    pvm = pd.read_csv(out / "predicted_vs_measured.csv")
    time_rows = pvm[pvm["quantity"] == "time_ms"]
    assert set(time_rows["label"]) == {"checkmate.cpu2", "checkmate.cpu1", "xengine", "checkmate"}
    multi = pvm["run_id"] == ids["multi"]
    xe_peak = pvm[multi & (pvm["quantity"] == "peak_mib") & (pvm["label"] == "xengine")]
    assert sorted(xe_peak["device"]) == ["cpu1", "cpu2"]  # one point per device

    front = pd.read_csv(out / "frontier.csv")
    assert set(front["run_id"]) == set(ids["frontier"])  # tagged runs only
    assert sorted(front["strategy"].unique()) == [
        "checkmate", "pytorch", "torch_budget", "torch_checkpoint",
    ]  # fmt: skip
    assert front.loc[front["wrong"], "strategy"].tolist() == ["torch_budget"]
    ck = front[front["strategy"] == "checkmate"].sort_values("measured_peak_mib")
    assert ck["time_over_plain"].round(6).tolist() == [1.2, 1.1, 1.0]  # own run's plain step
    ratios = pd.read_csv(out / "frontier_ratios.csv").sort_values("measured_peak_mib")
    tc = ratios[ratios["strategy"] == "torch_checkpoint"]
    # at 75 MiB only Checkmate's 58 MiB point is at no more memory; at 90 MiB the 78 MiB one
    assert tc["checkmate_peak_mib"].tolist() == [58.0, 78.0]
    assert tc["ratio"].round(6).tolist() == [round(1.3 / 1.2, 6), round(1.2 / 1.1, 6)]
    assert set(ratios.loc[ratios["strategy"] == "pytorch", "ratio"].round(6)) == {1.0}
    assert ratios.loc[ratios["strategy"] == "torch_budget", "wrong_gradients"].tolist() == [True]

    mem = pd.concat(
        pd.read_csv(p) for p in by_name["memory_per_device"].paths if p.suffix == ".csv"
    )
    sources = dict(zip(mem["run_id"], mem["source"], strict=False))
    assert sources[ids["multi"]] == "memory CSV"
    assert sources[ids["replay"]] == "replayed (graph.json artifact)"
    assert ids["replay_bad"] not in set(mem["run_id"])  # its graph is not the run's
    bad = ids["replay_bad"][:8]
    notes = by_name["memory_per_device"].notes
    assert any(n.startswith(f"{bad} checkmate: replayed peak") for n in notes), notes
    xe = mem[(mem["run_id"] == ids["multi"]) & (mem["device"] == "cpu2")]
    assert xe["mem_mib"].round(3).tolist() == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert set(xe["budget_mib"]) == {0.5}


def test_runs_without_what_a_figure_needs_are_skipped_with_a_note(uri, tmp_path, caplog):
    client = MlflowClient(uri)
    exp_id = _experiment(client, tmp_path)
    _budget_sweep(client, exp_id)
    _log(client, exp_id, "bare", _params(), {}, {"xe.status": "ok"})
    with caplog.at_level(logging.INFO, logger="figures"):
        outcomes = figures.make_figures(uri, "xengine", tmp_path / "f", recapture=False)
    by_name = {o.name: o for o in outcomes}
    assert "no multi-device run" in by_name["runtime_bars"].skipped
    assert "no executed schedule" in by_name["predicted_vs_measured"].skipped
    assert by_name["memory_per_device"].skipped  # no CSV, no graph, no recapture
    assert any("no memory" in n or "no schedule" in n for n in by_name["memory_per_device"].notes)
    assert by_name["overhead_vs_budget"].paths and by_name["solver_scaling"].paths
    assert "runtime_bars: skipped" in caplog.text
    assert not (tmp_path / "f" / "runtime_bars.png").exists()


def test_experiment_tag_selects_the_runs_of_a_figure(uri, tmp_path):
    client = MlflowClient(uri)
    exp_id = _experiment(client, tmp_path)
    _multi_device_run(client, exp_id)
    tagged = _multi_device_run(client, exp_id, experiment_tag="main_table")
    figures.make_figures(uri, "xengine", tmp_path, only=["runtime_bars"])
    bars = pd.read_csv(tmp_path / "runtime_bars.csv")
    assert set(bars["run_id"]) == {tagged}


def test_cli(filled_store, tmp_path, capsys):
    uri, _ = filled_store
    out = tmp_path / "cli"
    assert figures.main(["--tracking-uri", uri, "--out", str(out), "--no-recapture"]) == 0
    printed = capsys.readouterr().out
    assert f"overhead_vs_budget: {out / 'overhead_vs_budget.png'}" in printed
    assert figures.main(["--tracking-uri", uri, "--experiment", "nosuch"]) == 2
