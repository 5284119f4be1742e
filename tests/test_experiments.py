"""Experiment configs, resumable-sweep helpers, the dashboard and the scale-out launcher.

The sweep helpers (:mod:`xengine.records.sweep`) run against a real SQLite MLflow store in
``tmp_path``; the dashboard test starts ``mlflow ui`` on a free loopback port and stops it; the
launcher test runs a 2-point solve-only multirun of ``run.py`` through submitit's local
executor and checks that both points landed in the store.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from omegaconf import OmegaConf

from xengine.records.sweep import (
    FINGERPRINT_TAG,
    PARENT_TAG,
    SweepCallback,
    config_fingerprint,
    ensure_store,
    find_finished_run,
    finish_sweep,
    parent_run_for_sweep,
    sweep_children,
    with_retries,
)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


# --------------------------------------------------------------------------- fingerprint
CFG = {
    "net": {"name": "resnet18", "batch_size": 4},
    "mem": {"all": "70%"},
    "strategy": ["checkmate", "chen_sqrtn"],
    "results_dir": "/a/results",
    "log_level": "WARNING",
    "tracking": {"uri": "sqlite:///a.db", "enabled": True, "experiment": "xengine"},
    "profile": {"repeats": 5, "cache_dir": "/a/results/cache", "progress": True},
}


def _copy(d):
    return yaml.safe_load(yaml.safe_dump(d))


def test_fingerprint_is_stable_and_ignores_volatile_keys():
    fp = config_fingerprint(CFG)
    assert len(fp) == 16 and int(fp, 16) >= 0
    reordered = dict(reversed(list(_copy(CFG).items())))
    assert config_fingerprint(reordered) == fp
    moved = _copy(CFG)
    moved["results_dir"] = "/elsewhere"
    moved["log_level"] = "DEBUG"
    moved["tracking"]["uri"] = "http://127.0.0.1:5000"
    moved["profile"]["cache_dir"] = "/elsewhere/cache"
    moved["profile"]["progress"] = False
    moved["redo"] = True
    moved["hydra"] = {"run": {"dir": "/x"}}
    assert config_fingerprint(moved) == fp
    tupled = _copy(CFG)
    tupled["strategy"] = tuple(tupled["strategy"])
    assert config_fingerprint(tupled) == fp


@pytest.mark.parametrize(
    "path, value",
    [
        (("mem", "all"), "60%"),
        (("net", "batch_size"), 8),
        (("net", "batch_size"), "4"),  # types matter
        (("profile", "repeats"), 3),
        (("strategy",), ["chen_sqrtn", "checkmate"]),  # list order matters
    ],
)
def test_fingerprint_changes_with_what_a_run_computes(path, value):
    changed = _copy(CFG)
    node = changed
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    assert config_fingerprint(changed) != config_fingerprint(CFG)


def test_fingerprint_of_an_omegaconf_container():
    cfg = OmegaConf.create(CFG)
    assert config_fingerprint(OmegaConf.to_container(cfg, resolve=True)) == config_fingerprint(CFG)


# --------------------------------------------------------------------------- finished runs
def _run(client, exp_id, tags, status="FINISHED", name="p"):
    run = client.create_run(exp_id, run_name=name, tags=tags)
    if status is not None:
        client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def test_find_finished_run(uri):
    client = MlflowClient(uri)
    assert find_finished_run(client, "xengine", "abc") is None  # no experiment yet
    exp_id = ensure_store(uri, "xengine")
    assert find_finished_run(client, "xengine", "abc") is None
    _run(client, exp_id, {FINGERPRINT_TAG: "abc"}, status="FAILED")
    _run(client, exp_id, {FINGERPRINT_TAG: "abc", "xe.status": "error"})
    _run(client, exp_id, {FINGERPRINT_TAG: "abc"}, status=None)  # still RUNNING
    _run(client, exp_id, {FINGERPRINT_TAG: "other"})
    assert find_finished_run(client, "xengine", "abc") is None
    first = _run(client, exp_id, {FINGERPRINT_TAG: "abc", "xe.status": "ok"})
    assert find_finished_run(client, "xengine", "abc") == first
    time.sleep(0.01)
    newer = _run(client, exp_id, {FINGERPRINT_TAG: "abc", "xe.status": "partial"})
    assert find_finished_run(client, "xengine", "abc") == newer
    time.sleep(0.01)
    _run(client, exp_id, {FINGERPRINT_TAG: "abc", "xe.status": "wrong"})  # a wrong answer: redo
    assert find_finished_run(client, "xengine", "abc") == newer
    assert find_finished_run(client, exp_id, "abc") == newer  # by id too
    assert find_finished_run(client, "xengine", "it's") is None  # quotes are escaped


# --------------------------------------------------------------------------- parent runs
def test_parent_run_for_sweep_creates_once_and_children_attach(uri):
    client = MlflowClient(uri)
    parent = parent_run_for_sweep(client, "xengine", "/r/multirun/2026-01-01/10-00-00")
    assert client.get_run(parent).info.status == "FINISHED"
    assert client.get_run(parent).info.run_name == "sweep 2026-01-01/10-00-00"
    assert parent_run_for_sweep(client, "xengine", "/r/multirun/2026-01-01/10-00-00") == parent
    other = parent_run_for_sweep(client, "xengine", "/r/multirun/2026-01-01/11-00-00")
    assert other != parent
    exp_id = client.get_run(parent).info.experiment_id
    for status in ("ok", "ok", "error"):
        _run(client, exp_id, {PARENT_TAG: parent, "xe.status": status})
    assert len(sweep_children(client, parent)) == 3
    assert finish_sweep(client, parent) == {"n_runs": 3, "n_ok": 2, "n_error": 1}
    tags = client.get_run(parent).data.tags
    assert tags["xe.n_runs"] == "3" and tags["xe.n_error"] == "1"


def test_parallel_callers_converge_on_one_parent(uri):
    ensure_store(uri, "xengine")
    got, errors = [], []

    def call():
        try:
            got.append(parent_run_for_sweep(MlflowClient(uri), "xengine", "sweep-a"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(set(got)) == 1
    client = MlflowClient(uri)
    alive = client.search_runs(
        [client.get_experiment_by_name("xengine").experiment_id],
        "tags.`xe.sweep_id` = 'sweep-a'",
    )
    assert [r.info.run_id for r in alive] == got[:1]


def _sweep_cfg(tmp_path, db):
    """What :class:`SweepCallback` reads of a multirun's config."""
    return OmegaConf.create(
        {
            "tracking": {"enabled": True, "uri": f"sqlite:///{db}", "experiment": "xengine"},
            "results_dir": str(tmp_path),
            "hydra": {"sweep": {"dir": str(tmp_path / "multirun" / "x")}},
        }
    )


def test_sweep_callback_opens_and_closes_the_parent(tmp_path):
    db = tmp_path / "fresh" / "mlflow.db"  # does not exist yet: the callback creates it
    cfg = _sweep_cfg(tmp_path, db)
    cb = SweepCallback()
    cb.on_multirun_start(cfg)
    client = MlflowClient(f"sqlite:///{db}")
    parent = cb._parent
    assert parent is not None and client.get_run(parent).info.status == "RUNNING"
    exp_id = client.get_run(parent).info.experiment_id
    _run(client, exp_id, {PARENT_TAG: parent, "xe.status": "ok"})
    cb.on_multirun_end(cfg)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and run.data.tags["xe.n_runs"] == "1"
    # a resumed sweep whose points were all done leaves no empty parent behind
    cfg.hydra.sweep.dir = str(tmp_path / "multirun" / "y")
    again = SweepCallback()
    again.on_multirun_start(cfg)
    again.on_multirun_end(cfg)
    assert client.get_run(again._parent).info.lifecycle_stage == "deleted"
    off = SweepCallback()
    off.on_multirun_start(OmegaConf.create({"tracking": {"enabled": False}}))
    assert off._parent is None


_OPEN_AT = """
import sys, time
from xengine.records.tracking import open_client
start = float(sys.argv[2])
time.sleep(max(start - time.time(), 0))
open_client(sys.argv[1]).search_experiments()
print("ok")
"""


def test_processes_that_open_a_fresh_store_at_once_all_get_a_whole_one(tmp_path):
    """MLflow migrates a fresh SQLite file in place: two processes opening it at once broke
    it here in every trial (one failed, or both, leaving tables that fail every later run;
    how the CI run of a8b6904 lost its sweep's parent). Three processes open one fresh
    store at the same instant: all succeed, and the store answers afterwards."""
    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"
    start = time.time() + 8  # after every process has imported mlflow
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AT, uri, str(start)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [o.strip() for o, _ in outs] == ["ok"] * 3, [e[-800:] for _, e in outs]
    assert ensure_store(uri, "xengine") is not None
    assert not list((tmp_path / "fresh").glob(".*.tmp"))  # the schema's own file is gone


def test_a_fresh_store_is_made_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    from xengine.records.tracking import create_store

    def no_links(src, dst):
        raise PermissionError("hard links not permitted")

    monkeypatch.setattr(os, "link", no_links)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    create_store(uri)
    assert ensure_store(uri, "xengine") is not None
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.db"]


def test_finish_sweep_adopts_the_points_of_its_sweep_that_had_no_parent(uri):
    """A job that could not reach the store when it looked for the parent ran without one
    (the failure of the CI run of a8b6904: the parent of a sweep whose point was scancelled
    counted no killed point); it carries the sweep id, and the sweep's end counts it."""
    client = MlflowClient(uri)
    parent = parent_run_for_sweep(client, "xengine", "sweep-a", keep_open=True)
    exp_id = client.get_run(parent).info.experiment_id
    _run(client, exp_id, {PARENT_TAG: parent, "xe.status": "ok", "xe.sweep_id": "sweep-a"})
    orphan = _run(client, exp_id, {"xe.status": "killed", "xe.sweep_id": "sweep-a"}, "KILLED")
    stranger = _run(client, exp_id, {"xe.status": "ok", "xe.sweep_id": "sweep-b"})
    assert finish_sweep(client, parent) == {"n_runs": 2, "n_ok": 1, "n_killed": 1}
    assert client.get_run(orphan).data.tags[PARENT_TAG] == parent
    assert PARENT_TAG not in client.get_run(stranger).data.tags
    tags = client.get_run(parent).data.tags
    assert (tags["xe.n_runs"], tags["xe.n_killed"]) == ("2", "1")


def test_sweep_callback_closes_the_parent_the_jobs_made_when_its_own_failed(tmp_path):
    """The launching process could not make the parent (store trouble at the start); the
    jobs made it: the sweep's end still writes the summary on it."""
    db = tmp_path / "mlflow.db"
    cfg = _sweep_cfg(tmp_path, db)
    cb = SweepCallback()
    cb.on_multirun_start(cfg)
    client = MlflowClient(f"sqlite:///{db}")
    client.delete_run(cb._parent)  # as if it had never been made
    cb._parent = None
    made = parent_run_for_sweep(client, "xengine", str(tmp_path / "multirun" / "x"))
    _run(client, client.get_run(made).info.experiment_id, {PARENT_TAG: made, "xe.status": "ok"})
    cb.on_multirun_end(cfg)
    assert client.get_run(made).data.tags["xe.n_ok"] == "1"


def test_store_writes_are_tried_again_then_the_last_error_is_raised(monkeypatch):
    import xengine.records.sweep as sweep

    monkeypatch.setattr(sweep, "STORE_RETRY_S", 0.0)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < sweep.STORE_ATTEMPTS:
            raise OSError("database is locked")
        return "parent"

    assert with_retries("finding the parent", flaky) == "parent"
    assert len(calls) == sweep.STORE_ATTEMPTS

    def broken():
        calls.append(1)
        raise OSError(f"try {len(calls)}")

    calls.clear()
    with pytest.raises(OSError, match=f"try {sweep.STORE_ATTEMPTS}"):
        with_retries("finding the parent", broken)


# --------------------------------------------------------------------------- experiment configs
def _conf_dir(tmp_path: Path) -> tuple[Path, str]:
    """``conf/`` itself when its defaults list has the ``experiment`` slot, else a copy with
    the slot added (``- experiment: null`` last) - the change the main config needs so that
    ``experiment=<name>`` works (see the report of issue 4)."""
    text = (CONF / "config.yaml").read_text()
    if "- experiment:" in text or "- optional experiment:" in text:
        return CONF, "experiment"
    copy = tmp_path / "conf"
    shutil.copytree(CONF, copy)
    lines = text.splitlines()
    # the slot goes last among the config's own groups, before "- override hydra/..." lines
    idx = next(k for k, line in enumerate(lines) if line.strip().startswith("- override hydra/"))
    lines.insert(idx, "  - experiment: null")
    (copy / "config.yaml").write_text("\n".join(lines) + "\n")
    return copy, "experiment"


def _keys(node, prefix=""):
    """Dotted leaf keys of a plain dict (lists are leaves)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _keys(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix


def _has(cfg, dotted: str) -> bool:
    node = cfg
    for part in dotted.split("."):
        if not OmegaConf.is_dict(node) or part not in node:
            return False
        node = node[part]
    return True


def test_every_experiment_has_the_header():
    assert set(EXPERIMENTS) >= {
        "main_table",
        "memory_teaser",
        "budget_sweep",
        "solver_scaling",
        "predicted_vs_measured",
    }
    for name in EXPERIMENTS:
        lines = (CONF / "experiment" / f"{name}.yaml").read_text().splitlines()
        # Hydra reads the package only from the leading "# @..." lines: it must come first
        assert lines[0] == "# @package _global_", name
        assert lines[1] == f"# python run.py -m experiment={name}", name


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_sets_only_known_keys(tmp_path, name):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    conf, slot = _conf_dir(tmp_path)
    raw = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
    OmegaConf.register_new_resolver("xe_repo", lambda: str(REPO), replace=True)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        base = compose("config", return_hydra_config=True)
        cfg = compose("config", overrides=[f"{slot}={name}"], return_hydra_config=True)
        groups = set(base.hydra.runtime.choices)
        for key in _keys({k: v for k, v in raw.items() if k not in ("defaults", "hydra")}):
            assert _has(base, key), f"{name} sets {key}, which the main config does not have"
            assert OmegaConf.select(cfg, key) == OmegaConf.select(
                OmegaConf.create({k: v for k, v in raw.items() if k != "defaults"}), key
            )
        for entry in raw.get("defaults", []):
            (target, choice), *_ = entry.items()
            group = target.removeprefix("override /")
            if isinstance(choice, list):  # several configs of one group (strategy=[...])
                assert (conf / group).is_dir(), f"{name}: {group} is not a config group"
                assert list(cfg[group]) == choice
                continue
            assert group in groups, f"{name}: {group} is not a config group"
            assert cfg.hydra.runtime.choices[group] == choice
        params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
        for key, values in params.items():
            assert key in groups or _has(base, key), f"{name} sweeps unknown key {key}"
            for value in str(values).split(","):
                if key in groups:
                    assert (conf / key / f"{value}.yaml").is_file(), f"{name}: {key}={value}"
        # the tiny smoke settings are plain overrides of the same keys
        tiny = compose("config", overrides=[f"{slot}={name}", "net=tiny", "execute=false"])
        assert tiny.net.name == "tiny" and tiny.execute is False
    GlobalHydra.instance().clear()


# --------------------------------------------------------------------------- dashboard
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_dashboard_starts_answers_health_and_stops(uri):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "experiments" / "dashboard.py"), "--port", str(port),
         "--tracking-uri", uri],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and not _healthy(port):
            time.sleep(0.5)
        assert _healthy(port), "no answer from /health within 60 s"
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in line
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=30) == 0
        time.sleep(0.5)
        assert not _healthy(port), "the server still answers after Ctrl-C"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


# --------------------------------------------------------------------------- launcher
@pytest.mark.slow
def test_submitit_local_two_point_solve_only_sweep(tmp_path, uri):
    """Two solve-only points of run.py in parallel processes (hydra/launcher=local_parallel,
    submitit's local executor) writing to one SQLite store at the same time: both land, and
    the sweep's parent run is made (and closed) by the sweep callback. (30-80 s on 2 cores.)"""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    db = tmp_path / "mlflow.db"  # the initialised store of ``uri``
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    cmd = [
        sys.executable,
        str(REPO / "run.py"),
        "-m",
        "hydra/launcher=local_parallel",
        # in config.yaml later
        "++hydra.callbacks.sweep._target_=xengine.records.sweep.SweepCallback",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f"results_dir={tmp_path / 'results'}",
        f"tracking.uri=sqlite:///{db}",
        "net=tiny",
        "execute=false",
        "strategy=[checkmate,checkpoint_all]",
        "mem=90%,80%",  # tiny b2 needs 75.4 % of keep-all (its largest op)
        "profile.progress=false",
        "profile.repeats=1",
        "profile.warmup=0",
        "solver.time_limit_s=60",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("xengine")
    runs = client.search_runs([exp.experiment_id])
    points = [r for r in runs if r.data.tags.get("xe.task") == "run"]
    assert len(points) == 2, [r.data.tags for r in runs]
    assert {r.info.status for r in points} == {"FINISHED"}
    assert {r.data.tags.get("xe.status") for r in points} == {"ok"}
    assert sorted(r.data.params["mem"] for r in points) == ["80%", "90%"]
    assert {r.data.tags["xe.job_num"] for r in points} == {"0", "1"}
    from mlflow.entities import ViewType

    parents = client.search_runs(
        [exp.experiment_id], "tags.`xe.role` = 'sweep'", run_view_type=ViewType.ALL
    )
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert {r.data.tags["xe.sweep_id"] for r in points} == {parents[0].data.tags["xe.sweep_id"]}
    if any(PARENT_TAG in r.data.tags for r in points):  # run.py starts points under it
        assert {r.data.tags[PARENT_TAG] for r in points} == {parents[0].info.run_id}
        assert parents[0].data.tags["xe.n_runs"] == "2"
    else:  # no child: the callback deleted the empty parent
        assert parents[0].info.lifecycle_stage == "deleted"
    # each job ran in its own process (submitit's local executor)
    assert len(list((tmp_path / "sweep" / ".submitit").glob("*"))) >= 2


# --------------------------------------------------------------------------- smoke runs
def _smoke_command(name: str) -> list[str]:
    """The arguments of the ``python run.py ...`` smoke-test command in the config's header."""
    import shlex

    lines = (CONF / "experiment" / f"{name}.yaml").read_text().splitlines()
    header = [ln.lstrip("# ").strip() for ln in lines if ln.startswith("#")]
    for i, line in enumerate(header):
        if line.lower().startswith("smoke test"):
            cmd = line.split(":", 1)[1].strip() or header[i + 1]
            args = shlex.split(cmd)
            assert args[:2] == ["python", "run.py"], (name, cmd)
            return args[2:]
    raise AssertionError(f"{name}.yaml has no 'Smoke test:' command in its header")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_smoke_command_runs(tmp_path, store, name):
    """Each config's documented smoke command (with quick profiling and one timed step) runs
    every point of its sweep to a finished MLflow run with status ok."""
    from tests.helpers import cli_command

    args = _smoke_command(name)
    assert f"experiment={name}" in args and "-m" in args
    flags = [a for a in args if a.startswith("-")]  # before every override, as in the header
    overrides = [a for a in args if not a.startswith("-")]
    quick = ["n_steps=1", "warmup=0", "profile.repeats=1", "profile.warmup=0"]
    cmd, env = cli_command(tmp_path, *overrides, *quick)
    cmd[2:2] = flags
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    n_points = int(log.split("sweep of ")[1].split(" point")[0])
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("xengine")
    runs = [r for r in client.search_runs([exp.experiment_id]) if "xe.fingerprint" in r.data.tags]
    assert len(runs) == n_points >= 1
    for r in runs:
        assert r.info.status == "FINISHED", r.data.tags
        assert r.data.tags["xe.status"] == "ok", r.data.tags
        assert r.data.tags.get("xe.experiment") == name
