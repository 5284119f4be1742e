"""HiGHS in a process of its own (xengine/solvers/highs_process.py): the same answers as the
in-process solve, and a limit that holds when HiGHS does not stop (a child that sleeps stands
in for HiGHS stuck in presolve)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_solvers import KNAPSACK_OPT, hard_knapsack, knapsack, run
from xengine.solvers import SolverOptions, highs_process
from xengine.solvers.highs_process import solve_in_process, uses_own_process


@pytest.fixture
def every_mip_in_a_process(monkeypatch):
    monkeypatch.setattr(highs_process, "OWN_PROCESS_MIN_NNZ", 0)


def test_only_large_mips_with_a_limit_go_to_a_process():
    m = knapsack()
    assert not uses_own_process(m, SolverOptions(time_limit_s=10))  # 12 nonzeros
    big = highs_process.OWN_PROCESS_MIN_NNZ
    assert big >= m.A.nnz
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(highs_process, "OWN_PROCESS_MIN_NNZ", 1)
        assert uses_own_process(m, SolverOptions(time_limit_s=10))
        assert not uses_own_process(m, SolverOptions())  # no limit to enforce
        assert not uses_own_process(m, SolverOptions(time_limit_s=10, relax=True))


def test_a_process_solve_equals_the_in_process_one(every_mip_in_a_process):
    m = hard_knapsack(80, 10)  # under a second, several incumbents
    seen = []
    res = run(m, "highs", time_limit_s=60, progress=lambda *a: seen.append(a))
    assert res.status == "optimal", res.message
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(highs_process, "OWN_PROCESS_MIN_NNZ", 10**12)
        here = run(m, "highs", time_limit_s=60)
    assert res.objective == pytest.approx(here.objective, abs=1e-6)
    assert res.best_bound == pytest.approx(here.best_bound, abs=1e-6)
    assert seen and seen[-1][1] is not None  # the child's incumbents reached progress
    assert res.time_to_first_s is not None and res.time_to_first_s <= res.solve_time_s
    small = run(knapsack(), "highs", time_limit_s=60, warm_start=np.ones(6))  # bad start
    assert small.status == "optimal" and small.objective == pytest.approx(KNAPSACK_OPT)


STUCK = """
import json, sys, time
from pathlib import Path
import numpy as np
folder = Path(sys.argv[1])
if {incumbent!r} is not None:
    np.save(folder / "incumbent.npy", np.array({incumbent!r}, dtype=float))
print(json.dumps({{"objective": 90.0, "bound": 70.0, "incumbent": True}}), flush=True)
time.sleep(600)
"""


def _stuck_child(monkeypatch, incumbent):
    code = STUCK.format(incumbent=incumbent)
    monkeypatch.setattr(
        highs_process, "_command", lambda folder: [sys.executable, "-c", code, str(folder)]
    )
    monkeypatch.setattr(highs_process, "KILL_GRACE_S", 0.5)


def test_a_child_that_does_not_stop_is_ended_and_its_incumbent_kept(monkeypatch):
    m = knapsack()
    x = [1.0, 0, 0, 0, 1, 1]  # items 10 + 9 + 4: value 23, weight 11
    _stuck_child(monkeypatch, x)
    seen = []
    t0 = time.perf_counter()
    res = solve_in_process(
        m, SolverOptions(time_limit_s=1.0), progress=lambda *a: seen.append(a), cancel_grace_s=0.5
    )
    took = time.perf_counter() - t0
    assert 2.0 <= took < 6.0  # limit 1 s + 0.5 + 0.5 graces, plus starting the child
    assert res.status == "feasible"
    assert np.array_equal(res.x, x) and res.objective == pytest.approx(77.0)
    assert res.best_bound == pytest.approx(70.0)  # the last bound the child reported
    assert res.gap == pytest.approx((77.0 - 70.0) / 77.0)
    assert "ended its process" in res.message and "its last incumbent" in res.message
    assert seen and seen[0][1:] == (90.0, 70.0)


def test_without_an_incumbent_the_start_is_kept_or_nothing(monkeypatch):
    m = knapsack()
    _stuck_child(monkeypatch, None)
    start = np.array([0.0, 1, 0, 0, 1, 1])  # 13 + 9 + 4
    res = solve_in_process(m, SolverOptions(time_limit_s=0.5), warm_start=start, cancel_grace_s=0.5)
    assert res.status == "feasible" and res.objective == pytest.approx(KNAPSACK_OPT)
    assert "the MIP start" in res.message
    bad = solve_in_process(
        m, SolverOptions(time_limit_s=0.5), warm_start=np.ones(6), cancel_grace_s=0.5
    )
    assert bad.status == "no_solution" and bad.x is None and bad.objective is None


def test_a_child_that_fails_is_an_error_with_its_exit_code(monkeypatch):
    monkeypatch.setattr(
        highs_process, "_command", lambda folder: [sys.executable, "-c", "raise SystemExit(7)"]
    )
    res = solve_in_process(knapsack(), SolverOptions(time_limit_s=30))
    assert res.status == "error" and "exit code 7" in res.message


def test_an_interrupt_ends_the_child(monkeypatch):
    _stuck_child(monkeypatch, None)
    children = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        children.append(real_popen(*args, **kwargs))
        return children[-1]

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(highs_process.subprocess, "Popen", popen)
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(KeyboardInterrupt):
            solve_in_process(knapsack(), SolverOptions(time_limit_s=60))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert children and children[0].poll() is not None  # ended, not left running


def test_the_child_exits_when_its_parent_is_gone(tmp_path):
    m = hard_knapsack()  # about 18 s of HiGHS on one core
    highs_process._write(tmp_path, m, SolverOptions(time_limit_s=120), None, time.time() + 120)
    child = subprocess.Popen(
        highs_process._command(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    time.sleep(1.0)
    t0 = time.perf_counter()
    child.stdin.close()  # what the parent's death does to the pipe
    assert child.wait(timeout=30) == 3
    assert time.perf_counter() - t0 < 10
    child.stdout.close()
