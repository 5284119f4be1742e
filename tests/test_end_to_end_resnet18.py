"""resnet18, batch 4, 224 px, on the CPU: every strategy at 100 %, 70 % and the smallest
feasible budget is executed for real and must give plain PyTorch's loss and gradients, with a
measured activation peak within 1 % of the simulator's and within the budget's tolerance.

Slow (several minutes on 2 cores): ``python -m pytest -m slow tests/test_end_to_end_resnet18.py``.
"""

from __future__ import annotations

import pytest
import torch

from baselines.checkmate import solve_checkmate
from baselines.heuristics import solve_checkpoint_all, solve_chen_greedy, solve_chen_sqrtn
from baselines.lp_rounding import solve_lp_rounding
from xengine.checkpoints import min_feasible_budget_bytes
from xengine.execute.executor import execute, reference_step
from xengine.problem import Instance
from xengine.profile.profiler import apply_profile, profile_model
from xengine.profile.workspace import capture_net
from xengine.simulate import keep_all_peak_bytes
from xengine.solvers import SolverOptions

pytestmark = pytest.mark.slow
OPTS = SolverOptions(time_limit_s=60)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cap = capture_net("resnet18", 4)
    prof = profile_model(cap, ["cpu"], cache_dir=tmp_path_factory.mktemp("prof"), progress=False)
    graph = apply_profile(cap.graph, prof)
    ref = reference_step(cap, n_steps=1, warmup=0, measure_memory=False)
    return cap, graph, ref


def _budget(graph, level: str) -> int:
    peak = keep_all_peak_bytes(graph)
    if level == "100%":
        return peak
    if level == "70%":
        return int(0.7 * peak)
    return min_feasible_budget_bytes(graph)[1]


@pytest.mark.parametrize("level", ["100%", "70%", "min"])
def test_every_strategy_executes_like_pytorch(setup, level):
    cap, graph, ref = setup
    inst = Instance(graph, ("cpu",), (_budget(graph, level),))
    results = [
        solve_checkmate(inst, options=OPTS),
        solve_lp_rounding(inst, options=OPTS),
        solve_checkpoint_all(inst),
        solve_chen_sqrtn(inst),
        solve_chen_greedy(inst),
    ]
    executed = []
    for res in results:
        fits = res.has_schedule and res.sim.within_budget
        if res.strategy == "checkmate":
            assert fits, f"checkmate found no schedule at {level}: {res.status} {res.message}"
        if not fits:
            continue
        ex = execute(cap, inst, res.schedule, n_steps=1, warmup=0)
        assert ex.loss == pytest.approx(ref.loss, rel=1e-6), res.strategy
        for name, g_ref in ref.param_grads.items():
            torch.testing.assert_close(ex.param_grads[name], g_ref, rtol=1e-5, atol=1e-7)
        pred, meas = ex.predicted_peak_bytes["cpu"], ex.peak_bytes["cpu"]
        assert abs(meas - pred) <= 0.01 * pred + 8 * 1024, (res.strategy, pred, meas)
        assert meas <= inst.budget_bytes[0] + ex.tolerance_bytes["cpu"], (res.strategy, meas)
        assert ex.within_budget
        executed.append(res.strategy)
    if level == "100%":
        assert "checkpoint_all" in executed
    assert "checkmate" in executed
