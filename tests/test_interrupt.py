"""Ctrl-C and SIGTERM stop a real run within seconds (issue 19): a real signal to a real
``run.py`` during a solve (HiGHS, SCIP, CP-SAT, cvxpy) and during an execution gives one line
on stderr, exit 128 + the signal, no traceback and an MLflow run marked KILLED; and the helper
that keeps native solves interruptible stops its work and passes the interrupt on."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.helpers import REPO, cli_command

# a shipped resnet18 graph with CPU costs: Checkmate at 60 % takes its whole limit on it
GRAPH = REPO / "results" / "profiles" / "resnet18-b4-cpu+cuda.graph.json"


def _interrupt(tmp_path: Path, args: list[str], marker: str, sig: int, after_s: float = 2.0):
    """Start ``run.py``, wait until its stderr shows ``marker``, send ``sig`` ``after_s`` later;
    return (exit code, stderr, seconds from the signal to the exit)."""
    cmd, env = cli_command(tmp_path, *args)
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if marker in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        t_wait = time.perf_counter()
        while not seen.wait(timeout=0.2):
            assert proc.poll() is None, "".join(lines)  # it ended before the marker
            assert time.perf_counter() - t_wait < 240, "".join(lines)
        time.sleep(after_s)
        t0 = time.perf_counter()
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        took = time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    return rc, "".join(lines), took


def _run_status(tmp_path: Path) -> list[str]:
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("xengine")
    return [r.info.status for r in client.search_runs([exp.experiment_id])]


SOLVES = [
    ("highs", signal.SIGINT),
    ("highs", signal.SIGTERM),
    ("scip", signal.SIGINT),  # SCIP would catch Ctrl-C itself and call it a limit
    ("scip", signal.SIGTERM),
    ("cpsat", signal.SIGINT),  # so would CP-SAT
    ("cvxpy", signal.SIGTERM),  # no cancel: its solve is left to end with the process
]


@pytest.mark.parametrize(
    "solver, sig", SOLVES, ids=[f"{s}-{signal.Signals(g).name}" for s, g in SOLVES]
)
def test_a_signal_during_a_solve_stops_the_run(tmp_path, solver, sig):
    """Sent 5 s after the status line appears: the model is built, the solver in native code."""
    args = [
        f"graph={GRAPH}",
        "devices=cpu",
        "mem=60%",
        "strategy=[checkmate,chen_sqrtn]",
        f"solver={solver}",
        "solver.time_limit_s=120",
    ]
    rc, err, took = _interrupt(tmp_path, args, f"checkmate ({solver}", sig, after_s=5.0)
    assert rc == 128 + sig, err
    assert took < 10
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted: {signal.Signals(sig).name} during checkmate"), err
    assert _run_status(tmp_path) == ["KILLED"]


def test_ctrl_c_during_an_execution_stops_the_run(tmp_path):
    args = ["net=tiny", "devices=cpu", "mem=95%", "strategy=[chen_sqrtn]", "n_steps=3000"]
    rc, err, took = _interrupt(tmp_path, args, "executing chen_sqrtn", signal.SIGINT)
    assert rc == 130, err
    assert took < 10
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted: SIGINT during executing")
    assert _run_status(tmp_path) == ["KILLED"]


def test_ctrl_c_during_a_sweep_kills_the_point_and_its_parent(tmp_path):
    args = [
        f"graph={GRAPH}",
        "devices=cpu",
        "mem=60%,70%",
        "strategy=[checkmate]",
        "solver.time_limit_s=120",
        "-m",  # after the overrides: cli_command puts its own first
    ]
    rc, err, took = _interrupt(tmp_path, args, "checkmate (highs", signal.SIGINT)
    assert rc == 130, err
    assert took < 10
    assert "Traceback" not in err
    # the first point and the sweep's parent, both KILLED: a resumed sweep runs the point again
    assert sorted(_run_status(tmp_path)) == ["KILLED", "KILLED"]


def test_run_stoppable_stops_the_work_and_passes_the_interrupt_on():
    """A real SIGINT to this process while ``run_stoppable`` waits: ``stop`` is called, the
    worker ends and KeyboardInterrupt reaches the caller; without one it passes at once."""
    import os

    from xengine.interrupt import run_stoppable

    stopped = threading.Event()

    def work() -> str:  # native code stand-in: sends the signal once it runs, waits for stop
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        while not stopped.wait(0.01):
            pass
        return "stopped"

    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_stoppable(work, stopped.set, "test")
    assert stopped.is_set() and time.perf_counter() - t0 < 5
    assert run_stoppable(lambda: 42, None, "test") == 42
    with pytest.raises(ValueError, match="inside"):
        run_stoppable(lambda: (_ for _ in ()).throw(ValueError("inside")), None, "test")
