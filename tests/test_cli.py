"""``python run.py``: config, bad input, MLflow records, and the pipeline behind it.

CLI tests run ``run.py`` as a subprocess on small graph JSON files (solve only) with results
and the MLflow store under ``tmp_path``; the run on a real (tiny) network is marked ``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.helpers import Recorder, run_cli, tiny_run
from xengine.checkpoints import min_feasible_budget_bytes
from xengine.config import BudgetError, ConfigError, RunConfig
from xengine.execute.executor import available_devices
from xengine.graph.io import graph_to_dict, save_graph
from xengine.graph.synthetic import chain
from xengine.graph.types import CopyModel
from xengine.pipeline import run_pipeline
from xengine.prepare import prepare
from xengine.problem import Instance
from xengine.protocol import summarize as protocol_summary
from xengine.records.tracking import flatten_config, resolve_tracking_uri
from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import simulate
from xengine.solvers import SolverOptions, SolverUnavailable
from xengine.strategies.registry import STRATEGIES, StrategySpec
from xengine.units import MemorySpecError

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _chain_graph(devices=("cpu",)):
    """13 nodes, 1 MiB per tensor: keep-all peak 8 MiB, smallest feasible budget 4 MiB."""
    g = chain(6, bytes_per_layer=MIB, cost_s=1e-3, devices=devices)
    if len(devices) > 1:
        copy = {(a, b): CopyModel(1e-4, 1e9) for a in devices for b in devices if a != b}
        g = type(g)(g.name, g.nodes, g.edges, copy_models=copy)
    return g


@pytest.fixture
def graph_file(tmp_path):
    path = tmp_path / "chain.json"
    save_graph(_chain_graph(), path)
    return path


def _search_runs(tmp_path: Path):
    import mlflow

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        return mlflow.search_runs(experiment_names=["xengine"])
    finally:
        mlflow.set_tracking_uri(before)


# --------------------------------------------------------------------------- bad input
def _cycle_file(tmp_path: Path) -> Path:
    data = graph_to_dict(_chain_graph())
    data["links"].append({"source": 3, "target": 1})  # f3 -> f1 closes f1 -> f2 -> f3
    path = tmp_path / "cycle.json"
    path.write_text(json.dumps(data))
    return path


def _missing_node_file(tmp_path: Path) -> Path:
    data = graph_to_dict(_chain_graph())
    data["links"][2]["target"] = 99
    path = tmp_path / "missing.json"
    path.write_text(json.dumps(data))
    return path


BAD_INPUT = [
    # (args, words the one line must contain); {graph} is the chain graph file
    (["graph={graph}", "mem=2XB"], ["2XB", "unit"]),
    (["graph={graph}", "mem=-1GB"], ["-1GB", "negative"]),
    (["graph={graph}", "mem=3MiB"], ["smallest feasible budget", "4194304 bytes"]),
    (["graph={graph}", "solver=nosuchsolver"], ["unknown solver", "nosuchsolver", "highs"]),
    (["graph={graph}", "solver.name=nosuchsolver"], ["unknown solver", "nosuchsolver"]),
    (["graph={graph}", "strategy=[checkmate,nosuch]"], ["unknown strategy", "nosuch"]),
    (["graph={graph}", "devices=[cpu,cuda]"], ["cuda", "no cost"]),
    (["net=nosuchnet"], ["unknown net", "nosuchnet", "torchvision classification model"]),
    (["graph={cycle}", "mem=5MiB"], ["cycle.json", "cycle", "'f1'", "'f2'", "'f3'"]),
    (["graph={missing}", "mem=5MiB"], ["missing.json", "links[2].target", "99"]),
    (["graph={tmp}/nowhere.json"], ["nowhere.json", "does not exist"]),
    (["net=tiny", "profile.path={profile}"], ["bad_profile.json", "'key'"]),
]


@pytest.mark.parametrize("args, words", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(tmp_path, graph_file, args, words):
    paths = {
        "graph": graph_file,
        "cycle": _cycle_file(tmp_path),
        "missing": _missing_node_file(tmp_path),
        "tmp": tmp_path,
        "profile": tmp_path / "bad_profile.json",
    }
    paths["profile"].write_text('{"format": "xengine-profile", "version": 1}')
    proc = run_cli(tmp_path, *(a.format(**paths) for a in args))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for w in words:
        assert w in lines[0]
    assert proc.stdout == ""
    assert not (tmp_path / "mlflow.db").exists()  # bad input records nothing


def test_budget_error_names_the_smallest_budget(graph_file):
    # the number in the message is min_feasible_budget_bytes' lower bound, not a guess
    lower, _ = min_feasible_budget_bytes(_chain_graph())
    with pytest.raises(BudgetError, match=f"{lower} bytes"):
        prepare(RunConfig(graph_path=str(graph_file), mem=(f"{lower - 1}B",)))
    assert prepare(RunConfig(graph_path=str(graph_file), mem=(f"{lower}B",))).budget_bytes == (
        lower,
    )


@pytest.mark.parametrize(
    "cfg, error",
    [
        (RunConfig(mem=("2XB",)), MemorySpecError),
        (RunConfig(mode="both"), ConfigError),
        (RunConfig(devices=("cpu", "cpu")), ConfigError),
        (RunConfig(devices=("cpu", "cpu1"), mem=("1GB", "2GB", "3GB")), ConfigError),
        (RunConfig(strategies=()), ConfigError),
        (RunConfig(solver="nosuch"), SolverUnavailable),
        (RunConfig(n_steps=0), ConfigError),
        (RunConfig(formulation="fast"), ConfigError),
        (RunConfig(formulation="intervals", max_computes=0), ConfigError),
        (RunConfig(formulation="intervals", lp_bound="later"), ConfigError),
        (RunConfig(coarsen=0), ConfigError),
        (RunConfig(coarsen=2), ConfigError),  # one device, no xengine row to coarsen
    ],
)
def test_config_validation(cfg, error):
    with pytest.raises(error):
        cfg.validate()


def test_heuristics_only_need_no_solver():
    RunConfig(solver="nosuch", strategies=("chen_sqrtn",)).validate()


# --------------------------------------------------------------------------- a real run
def test_solve_only_run_logs_one_mlflow_run(tmp_path, graph_file, store):
    proc = run_cli(tmp_path, f"graph={graph_file}", "mem=70%", "solver.time_limit_s=60")
    assert proc.returncode == 0, proc.stderr
    # stdout is the table and nothing else
    out = proc.stdout.strip().splitlines()
    assert out[0].startswith(str(graph_file)) and "70%" in out[0]
    assert out[1].split()[:2] == ["strategy", "status"]
    labels = [line.split()[0] for line in out[3:8]]
    assert labels == [
        "checkmate", "checkpoint_all", "chen_sqrtn", "chen_greedy", "recompute_greedy",
    ]  # fmt: skip
    assert "Traceback" not in proc.stderr

    runs = _search_runs(tmp_path)
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["status"] == "FINISHED"
    assert run["tags.xe.status"] == "ok"
    assert run["params.graph"] == str(graph_file)
    assert run["params.mem"] == "70%"
    assert run["params.solver.name"] == "highs"
    assert run["params.solver.time_limit_s"] == "60"
    assert run["params.strategy"] == (
        "checkmate,checkpoint_all,chen_sqrtn,chen_greedy,recompute_greedy"
    )
    assert run["tags.xe.status.checkmate"] == "optimal"
    assert run["metrics.checkmate/budget_mib"] == pytest.approx(0.7 * 8)
    assert run["metrics.checkmate/gap"] == pytest.approx(0, abs=1e-3)
    assert run["metrics.graph/num_nodes"] == 13
    for key in ("predicted_time_ms", "predicted_peak_mib", "solve_time_s"):
        assert f"metrics.checkmate/{key}" in runs.columns
    assert "metrics.checkmate/measured_time_ms" not in runs.columns  # solve only

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    art = Path(client.download_artifacts(run["run_id"], "", str(tmp_path / "art")))
    names = {str(p.relative_to(art)) for p in art.rglob("*") if p.is_file()}
    assert {"config.yaml", "table.csv", "run.log", "hydra/overrides.yaml"} <= names
    assert {f"schedules/{s}.json" for s in labels} <= names
    assert (art / "table.csv").read_text().splitlines()[0].startswith("strategy,devices,status")

    # the logged schedule, replayed by the simulator, gives the logged prediction
    g = _chain_graph()
    budget = int(round(0.7 * 8 * MIB))
    inst = Instance.single(g, "cpu", budget)
    sched = Schedule.from_json(json.loads((art / "schedules/checkmate.json").read_text()))
    sim = simulate(inst, sched)
    assert sim.time_s * 1e3 == pytest.approx(run["metrics.checkmate/predicted_time_ms"])
    assert sim.peak_bytes.max() / MIB == pytest.approx(run["metrics.checkmate/predicted_peak_mib"])
    assert sim.peak_bytes.max() <= budget
    # under a budget below the keep-all peak, the optimum recomputes; checkpoint-all cannot fit
    assert sim.n_recomputes > 0
    assert run["tags.xe.status.checkpoint_all"] == "infeasible"


def test_tracking_uri_from_environment(tmp_path, graph_file, empty_store):
    env_db = tmp_path / "env.db"
    shutil.copy(empty_store, env_db)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{env_db}"}
    cmd = [sys.executable, str(REPO / "run.py"), f"results_dir={tmp_path / 'r'}",
           f"graph={graph_file}", "strategy=[chen_sqrtn]"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(MlflowClient(f"sqlite:///{env_db}").search_runs(["1"])) == 1
    assert not (tmp_path / "r" / "mlflow.db").exists()


def test_tracking_uri_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri(None, tmp_path) == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///x.db", tmp_path) == "sqlite:///x.db"


def test_flatten_config():
    flat = flatten_config(
        {"net": {"name": "tiny", "batch_size": 2}, "strategy": ["a", "b"], "g": None}
    )
    assert flat == {"net.name": "tiny", "net.batch_size": "2", "strategy": "a,b", "g": "null"}


# --------------------------------------------------------------------------- config
def _run_module():
    """``run.py`` imported as a module (its functions, not its Hydra entry point)."""
    sys.path.insert(0, str(REPO))
    try:
        import run
    finally:
        sys.path.remove(str(REPO))
    return run


def test_devices_auto_is_every_device_torch_sees(monkeypatch):
    from hydra import compose, initialize_config_dir

    from xengine.commandline import one_device_note, run_config_from

    _run_module()  # registers the config's resolvers
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config")
        assert cfg.devices.names == "auto"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert run_config_from(cfg).devices == ("cpu", "cuda")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        rc = run_config_from(cfg)
        assert rc.devices == ("cpu",)
        note = one_device_note(cfg, rc)
        assert "XEngine needs two devices" in note and "devices=cpu2+cpu1" in note
        named = compose(config_name="config", overrides=["devices=cpu"])
        assert one_device_note(named, run_config_from(named)) is None  # asked for one


def test_default_config_composes_to_the_documented_defaults():
    from hydra import compose, initialize_config_dir

    from xengine.commandline import run_config_from

    _run_module()  # registers the config's resolvers
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config")
        rc = run_config_from(cfg)
        over = run_config_from(
            compose(
                config_name="config",
                overrides=["net=resnet50", "mem=2GB", "solver=gurobi", "solver.time_limit_s=60",
                           "devices=cpu+cuda", "mode=infer", "execute=false"],
            )
        )  # fmt: skip
        solvers = [compose(config_name="config", overrides=[f"solver={p.stem}"]).solver
                   for p in (REPO / "conf" / "solver").glob("*.yaml")]  # fmt: skip
    assert (rc.net, rc.batch_size, rc.image_size, rc.mode) == ("resnet18", 4, 224, "train")
    assert rc.devices == available_devices() and rc.mem == {"all": "70%"}
    assert rc.solver == "highs"
    assert rc.memory_texts() == ("70%",) and rc.mem_text == "70%"
    assert rc.solver_options.time_limit_s == 10.0  # the default run ends within a minute
    assert len(solvers) == 5 and {s.time_limit_s for s in solvers} == {10}
    assert rc.strategies == (
        "checkmate",
        "checkpoint_all",
        "chen_sqrtn",
        "chen_greedy",
        "recompute_greedy",
    )
    assert rc.execute and rc.n_steps == 5
    assert rc.malloc == "steady"  # the time benchmark's setting (docs/measurements.md)
    assert Path(rc.profile_cache_dir) == REPO / "results" / "cache" / "profiles"
    assert (over.net, over.mem, over.solver, over.mode, over.execute) == (
        "resnet50", ("2GB",), "gurobi", "infer", False,
    )  # fmt: skip
    assert over.solver_options.time_limit_s == 60.0
    assert over.devices == ("cpu", "cuda") and over.memory_texts() == ("2GB", "2GB")
    assert over.run_strategies[-1] == "xengine"  # joins with two devices


def test_every_net_config_names_a_capturable_net():
    from xengine.graph.capture import TORCHVISION_NETS

    names = {p.stem for p in (REPO / "conf" / "net").glob("*.yaml")} - {"torchvision"}
    assert names <= set(TORCHVISION_NETS)
    assert {"resnet18", "resnet50", "tiny"} <= names


# --------------------------------------------------------------------------- the pipeline
def _fake(status, with_schedule=False, raises=None):
    def solve(inst, **kwargs):
        if raises is not None:
            raise raises
        res = StrategyResult(
            "fake", inst.devices, inst.budget_bytes, status, solver="highs", gap=0.25
        )
        if with_schedule:
            from xengine.schedule import keep_all_schedule

            res.schedule = keep_all_schedule(inst)
        return res

    return solve


@pytest.fixture
def fake_strategies(monkeypatch):
    import xengine.strategies.registry as registry

    fakes = {
        "nothing": _fake("no_solution"),
        "crash": _fake("optimal", raises=RuntimeError("solver blew up")),
        "limit": _fake("feasible", with_schedule=True),
    }
    for name in fakes:
        monkeypatch.setitem(STRATEGIES, name, StrategySpec(f"fake:{name}", True, True))
    real_load = registry._load
    monkeypatch.setattr(
        registry, "_load", lambda t: fakes[t[5:]] if t.startswith("fake:") else real_load(t)
    )


def test_failures_and_missing_incumbents_are_recorded_and_the_run_goes_on(
    graph_file, fake_strategies
):
    rec = Recorder()
    cfg = RunConfig(
        graph_path=str(graph_file),
        mem=("100%",),
        strategies=("crash", "nothing", "limit", "chen_sqrtn"),
    )
    rows = run_pipeline(cfg, rec)
    by = {r.label: r for r in rows}
    assert [r.label for r in rows] == ["crash", "nothing", "limit", "chen_sqrtn"]
    assert by["crash"].status == "error" and "solver blew up" in by["crash"].note
    assert rec.tags_["xe.status.crash"] == "error"
    assert "solver blew up" in rec.tags_["xe.note.crash"]
    assert by["nothing"].status == "no_solution" and by["nothing"].predicted_time_s is None
    assert rec.tags_["xe.status.nothing"] == "no_solution"
    # a time-limited incumbent is kept, simulated by the pipeline, and its gap reported
    assert by["limit"].status == "feasible"
    assert by["limit"].predicted_time_s == pytest.approx(6 * 1e-3 + 6 * 2e-3)  # keep-all
    assert rec.metrics_["limit/gap"] == 0.25
    assert "schedules/limit.json" in rec.artifacts
    assert by["chen_sqrtn"].status == "feasible"


def test_several_devices_follow_the_papers_protocol(tmp_path):
    """Single-device strategies run on each device alone with the TOTAL memory; xengine joins
    by itself, gets the per-device budgets, and its gain over the fastest single-device
    schedule is recorded."""
    path = tmp_path / "two.json"
    save_graph(_chain_graph(devices=("cpu", "cuda")), path)
    cfg = RunConfig(
        graph_path=str(path),
        devices=("cpu", "cuda"),
        mem={"all": "5MiB", "cuda": "4MiB"},
        strategies=("checkmate", "chen_sqrtn"),
    )
    rec = Recorder()
    rows = run_pipeline(cfg, rec)
    labels = [r.label for r in rows]
    assert labels == [
        "checkmate.cpu",
        "checkmate.cuda",
        "chen_sqrtn.cpu",
        "chen_sqrtn.cuda",
        "xengine",
    ]
    by = {r.label: r for r in rows}
    assert by["xengine"].budget_bytes == (5 * MIB, 4 * MIB)
    for label in labels[:-1]:
        assert by[label].budget_bytes == (9 * MIB,) and by[label].alone
    assert not by["xengine"].alone
    # 9 MiB on one device is more than the keep-everything peak (8 MiB): no recomputation
    assert by["checkmate.cpu"].n_recomputes == 0
    summary = protocol_summary(rows)
    best = min(by[k].predicted_time_s for k in labels[:-1])
    assert summary.best_single.predicted_time_s == best
    xe = by["xengine"].predicted_time_s
    assert summary.gain == pytest.approx((best - xe) / best)
    assert rec.metrics_["xengine/gain_vs_best_single"] == pytest.approx(summary.gain)
    assert rec.tags_["xe.best_single"] == summary.best_single.label
    assert rec.tags_["xe.infeasible_single"] == "none"
    assert "xengine/predicted_peak_mib.cuda" in rec.metrics_
    assert by["xengine"].predicted_peak_bytes[1] <= 4 * MIB


def test_intervals_formulation_gives_xengine_the_exact_models_optimum(tmp_path):
    """formulation=intervals: XEngine runs on CP-SAT's interval model while Checkmate keeps
    the run's MILP solver; its schedule is never below the exact model's optimum and never
    above the start it was given."""
    path = tmp_path / "two.json"
    save_graph(_chain_graph(devices=("cpu", "cuda")), path)
    base = dict(
        graph_path=str(path),
        devices=("cpu", "cuda"),
        mem={"all": "5MiB", "cuda": "4MiB"},
        strategies=("checkmate",),
        solver_options=SolverOptions(time_limit_s=10),
    )
    by = {}
    for form in ("exact", "intervals"):
        rows = run_pipeline(RunConfig(**base, formulation=form), Recorder())
        by[form] = {r.label: r for r in rows}
    iv, ex = by["intervals"]["xengine"].result, by["exact"]["xengine"].result
    assert iv.solver == "cpsat" and iv.extra["mode"] == "intervals"
    assert by["intervals"]["checkmate.cpu"].result.solver == "highs"
    assert ex.status == "optimal" and iv.status in ("optimal", "feasible")
    assert iv.sim.within_budget
    assert iv.sim.time_s >= ex.sim.time_s - 1e-9
    # lp_bound=alongside: the same LP bound, computed in another process during the search
    rows = run_pipeline(
        RunConfig(**base, formulation="intervals", lp_bound="alongside"), Recorder()
    )
    along = {r.label: r for r in rows}["xengine"].result
    assert along.lp_bound_s == pytest.approx(iv.lp_bound_s, rel=1e-9)
    assert along.sim.time_s >= ex.sim.time_s - 1e-9 and along.sim.within_budget


@pytest.mark.parametrize(
    ("mem", "expect"),
    [({"all": "7MiB", "cuda": "6MiB"}, "feasible"), ({"all": "5MiB", "cuda": "4MiB"}, "none")],
)
def test_coarsen_solves_xengine_on_the_fused_graph_and_reports_the_fine_schedule(
    tmp_path, mem, expect
):
    """coarsen=k: XEngine's row holds the expanded schedule, checked on the run's own graph,
    never below the fine optimum, and says it was coarsened (no bound, so not optimal). Where
    the fused nodes need more memory than the budgets give, the row says so and does not
    call the instance infeasible."""
    path = tmp_path / "two.json"
    save_graph(_chain_graph(devices=("cpu", "cuda")), path)
    base = dict(
        graph_path=str(path),
        devices=("cpu", "cuda"),
        mem=mem,
        strategies=("checkmate",),
        solver_options=SolverOptions(time_limit_s=10),
    )
    fine = {r.label: r for r in run_pipeline(RunConfig(**base), Recorder())}["xengine"]
    assert fine.status == "optimal"
    xe = {r.label: r for r in run_pipeline(RunConfig(**base, coarsen=2), Recorder())}["xengine"]
    assert xe.strategy == "xengine" and xe.result.coarse.nodes == 7  # of 13
    if expect == "feasible":
        assert xe.status == "feasible" and xe.note.startswith("solved on the coarsened graph")
        assert xe.result.schedule.R.shape == fine.result.schedule.R.shape
        assert xe.result.sim.within_budget
        assert xe.predicted_time_s >= fine.predicted_time_s - 1e-9
    else:
        assert xe.status == "no_solution" and "fine problem may still have schedules" in xe.note


def test_protocol_lists_single_device_schedules_that_do_not_fit(tmp_path):
    path = tmp_path / "two.json"
    save_graph(_chain_graph(devices=("cpu", "cuda")), path)
    # 2.5 MiB each: the total (5 MiB) fits Checkmate but not checkpoint-all (8 MiB)
    cfg = RunConfig(
        graph_path=str(path),
        devices=("cpu", "cuda"),
        mem=("2.5MiB",),
        strategies=("checkmate", "checkpoint_all"),
    )
    rec = Recorder()
    summary = protocol_summary(run_pipeline(cfg, rec))
    assert summary.infeasible_single == ["checkpoint_all.cpu", "checkpoint_all.cuda"]
    assert rec.tags_["xe.infeasible_single"] == "checkpoint_all.cpu,checkpoint_all.cuda"
    # no device alone can run a node that needs 4 MiB with 2.5 MiB: xengine is infeasible
    assert summary.xengine.status == "infeasible" and summary.gain is None
    assert "xengine/gain_vs_best_single" not in rec.metrics_


def test_infer_mode_on_a_graph_file_keeps_the_forward_part(graph_file):
    prep = prepare(RunConfig(graph_path=str(graph_file), mode="infer", mem=("100%",)))
    assert [v.kind for v in prep.graph.nodes] == ["fwd"] * 6


# --------------------------------------------------------------------------- tiny network
def test_tiny_net_schedules_execute_and_match_plain_pytorch(tmp_path):
    """capture -> profile -> solve -> execute: every schedule that fits is run, measured, and
    its loss and gradients equal plain PyTorch's (the tiny net has dropout and batch norm, so
    this needs every run to start from the same random state and buffers)."""
    cfg = tiny_run(tmp_path, ("checkpoint_all", "chen_sqrtn"))
    rec = Recorder()
    rows = run_pipeline(cfg, rec)
    by = {r.label: r for r in rows}
    assert [r.label for r in rows] == ["pytorch", "checkpoint_all", "chen_sqrtn"]
    assert by["pytorch"].measured_time_s > 0 and by["pytorch"].measured_peak_bytes[0] > 0
    for label in ("checkpoint_all", "chen_sqrtn"):
        assert by[label].status == "feasible", by[label].note
        assert by[label].measured_time_s > 0
        assert by[label].grads_match is True, label
        assert rec.metrics_[f"{label}/grads_match"] == 1.0
    assert by["chen_sqrtn"].n_recomputes > 0  # a recomputing schedule matches too
    assert json.loads(rec.artifacts["profile.json"])["format"] == "xengine-profile"
    assert rec.tags_["xe.profile_source"].startswith("measured on")
    assert rec.tags_["xe.profile_file"].startswith(str(tmp_path / "profiles"))
    assert Path(rec.tags_["xe.profile_file"]).exists()  # cached for the next run


def test_one_schedule_is_executed_once(tmp_path, monkeypatch):
    """At 100 % Checkmate, recompute_greedy and checkpoint_all all answer keep-everything:
    it runs once, and the other rows take that measurement and say so."""
    from xengine.execute import executor

    calls = []
    real = executor.execute

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(executor, "execute", counting)
    cfg = tiny_run(tmp_path, ("checkpoint_all", "checkmate", "recompute_greedy", "chen_sqrtn"))
    by = {r.label: r for r in run_pipeline(cfg, Recorder())}
    assert len(calls) == 2  # keep-everything and Chen's schedule
    first = by["checkpoint_all"]
    for label in ("checkmate", "recompute_greedy"):
        row = by[label]
        assert "measured once with checkpoint_all: the same schedule" in row.note, row.note
        assert row.measured_time_s == first.measured_time_s and row.grads_match is True
    assert by["chen_sqrtn"].measured_time_s != first.measured_time_s


# --------------------------------------------------------------------------- real network
@pytest.mark.slow
def test_tiny_net_end_to_end(tmp_path, store):
    """capture -> profile -> solve -> execute -> compare gradients, logged to MLflow."""
    proc = run_cli(
        tmp_path,
        "net=tiny",
        "mem=80%",
        "n_steps=2",
        "profile.repeats=2",
        "profile.progress=false",
        "solver.time_limit_s=60",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    runs = _search_runs(tmp_path)
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["tags.xe.status"] == "ok", run.filter(like="tags.xe").to_dict()
    assert run["params.net.name"] == "tiny"
    for s in ("pytorch", "checkmate"):
        assert run[f"metrics.{s}/measured_time_ms"] > 0
        assert run[f"metrics.{s}/measured_peak_mib"] > 0
    executed = [c.split("/")[0][8:] for c in runs.columns if c.endswith("/grads_match")]
    assert "checkmate" in executed
    for s in executed:  # every schedule that ran matches plain PyTorch
        assert run[f"metrics.{s}/grads_match"] == 1.0, s
        assert run[f"tags.xe.status.{s}"] in ("optimal", "feasible")
    assert run["tags.xe.profile_source"]
    assert "grads match" in proc.stdout


def test_the_terminal_shows_no_torch_cpp_lines(tmp_path, store):
    """A run that captures, profiles and measures memory under torch.profiler: stderr has
    our lines only, none of kineto's status lines or c10's allocator warning (issue 31)."""
    proc = run_cli(
        tmp_path,
        "net=tiny",
        "mem=80%",
        "strategy=[chen_sqrtn]",
        "n_steps=1",
        "profile.repeats=1",
        "profile.context_rounds=0",
        "profile.progress=false",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    for cpp in ("Memory block of unknown size", "USDT:", "STAGE:", "profiler_st"):
        assert cpp not in proc.stderr, proc.stderr


# ------------------------------------------------------------ any torchvision model by name
def test_a_torchvision_model_without_a_file_is_taken_by_name():
    from xengine.commandline import prepare_argv, run_config_from

    conf = REPO / "conf"
    out = prepare_argv(["net=mnasnet0_5", "net.batch_size=2"], conf)
    assert out == ["net=torchvision", "net.name=mnasnet0_5", "net.batch_size=2"]
    assert prepare_argv(["-m", "net=mnasnet0_5,squeezenet1_1"], conf)[1:] == [
        "net=torchvision",
        "net.name=mnasnet0_5,squeezenet1_1",
    ]
    assert prepare_argv(["net=resnet50"], conf) == ["net=resnet50"]  # a file: unchanged
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        rc = run_config_from(compose("config", overrides=out))
    assert (rc.net, rc.batch_size, rc.image_size, rc.num_classes) == ("mnasnet0_5", 2, 224, 1000)


@pytest.mark.parametrize(
    "args, words",
    [
        (["net=resnet19"], ["unknown net 'resnet19'", "did you mean", "resnet18"]),
        (["net=mobilenetv3_small"], ["did you mean", "mobilenet_v3_small"]),
        (["-m", "net=tiny,mnasnet0_5"], ["tiny", "mnasnet0_5", "two runs"]),
    ],
)
def test_an_unknown_net_name_is_one_line_with_the_closest(args, words):
    from xengine.commandline import prepare_argv

    with pytest.raises(ConfigError) as exc:
        prepare_argv(args, REPO / "conf")
    line = str(exc.value)
    assert "\n" not in line
    for w in words:
        assert w in line, line


def test_a_listed_model_is_captured_by_name():
    from xengine.graph.capture import known_nets, trace_net

    assert {"shufflenet_v2_x0_5", "mnasnet0_5", "efficientnet_b0", "vit_b_32"} <= set(known_nets())
    cap = trace_net("squeezenet1_1", 1, image_size=32, num_classes=10)
    assert cap.net == "squeezenet1_1" and cap.graph.size > 20
