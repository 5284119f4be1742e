"""The optimum never loses to a heuristic in its own table (issue 57): Checkmate and XEngine
start from the best schedule the run has for their device and budget, and never answer with
a slower one."""

from __future__ import annotations

import numpy as np
import pytest
from _nets import resnet18_small, tiny

from baselines import checkmate
from baselines.checkmate import solve_checkmate
from baselines.heuristics import HEURISTICS, computed_once, solve_chen_sqrtn
from xengine.checkpoints import min_feasible_budget_bytes
from xengine.graph.synthetic import training_graph
from xengine.graph.types import CopyModel
from xengine.problem import Instance
from xengine.protocol import compare, plan, run_schedules
from xengine.result import StrategyResult
from xengine.simulate import keep_all_peak_bytes
from xengine.solvers import SolverOptions

DEV = "cpu"
SPENT = SolverOptions(time_limit_s=1e-3)  # the limit is gone before the MILP: the start answers


def _random_graph(seed: int):
    """A random training DAG of 6-9 forward ops: each op reads its predecessor and, now and
    then, one earlier op (skips), with random bytes and costs."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(6, 10))
    edges = [(i, i + 1) for i in range(n - 1)]
    edges += [(int(rng.integers(0, i - 1)), i) for i in range(2, n) if rng.random() < 0.3]
    return training_graph(
        f"random{seed}",
        sorted(set(edges)),
        n,
        list(rng.integers(1, 6, n) * 1000),
        {DEV: list(np.round(rng.uniform(0.2, 3.0, n), 2))},
        loss_cost_s={DEV: 0.1},
    )


def _mid_budget(g) -> int:
    _, known = min_feasible_budget_bytes(g)
    return (known + keep_all_peak_bytes(g)) // 2


def _best_heuristic_s(inst) -> float:
    fits = [r.sim.time_s for r in (fn(inst) for fn in HEURISTICS.values()) if r.fits]
    return min(fits, default=np.inf)


def test_checkmate_answers_no_slower_than_a_start_it_is_given():
    # the optimum, handed over as another row's schedule, is the answer even when the limit
    # leaves the MILP no time; on some graphs it beats every heuristic, so only the start can
    # have given it
    beaten = 0
    for seed in range(12):
        g = _random_graph(seed)
        inst = Instance.single(g, DEV, _mid_budget(g))
        best = solve_checkmate(inst)
        assert best.status == "optimal", best.message
        res = solve_checkmate(inst, options=SPENT, frontier=False, starts={"row": best.schedule})
        assert res.fits and res.sim.time_s <= best.sim.time_s * (1 + 1e-9), g.name
        beaten += _best_heuristic_s(inst) > best.sim.time_s * (1 + 1e-6)
        alone = solve_checkmate(inst, options=SPENT, frontier=False)
        assert alone.sim.time_s >= best.sim.time_s * (1 - 1e-9)
    assert beaten >= 2


@pytest.mark.parametrize("net", [tiny, resnet18_small], ids=["tiny", "resnet18_64px"])
@pytest.mark.parametrize("share", [0.2, 0.6])  # of the way from the smallest budget
def test_checkmate_beats_every_heuristic_on_captured_nets(net, share):
    graph = net().graph
    rng = np.random.default_rng(0)
    g = graph.with_costs({DEV: {v.name: float(rng.uniform(0.5, 2.0)) for v in graph.nodes}})
    _, known = min_feasible_budget_bytes(g)
    inst = Instance.single(g, DEV, int(known + share * (keep_all_peak_bytes(g, DEV) - known)))
    rows = {name: fn(inst) for name, fn in HEURISTICS.items()}  # the run's rows come first
    for options in (SPENT, SolverOptions(time_limit_s=2)):
        res = solve_checkmate(inst, options=options)
        assert res.fits, res.message
        for name, h in rows.items():
            if h.fits:
                assert res.sim.time_s <= h.sim.time_s * (1 + 1e-9), name
                # ... and handed over as a row's schedule, it changes nothing
                given = solve_checkmate(inst, options=SPENT, starts={name: h.schedule})
                assert given.sim.time_s <= h.sim.time_s * (1 + 1e-9), name


def test_a_start_stopped_by_the_limit_is_said_in_the_row():
    inst = Instance.single(resnet18_small().graph, DEV, 0)
    g = inst.graph.with_costs({DEV: {v.name: 1.0 for v in inst.graph.nodes}})
    _, known = min_feasible_budget_bytes(g)
    inst = Instance.single(g, DEV, int(known + 0.2 * (keep_all_peak_bytes(g, DEV) - known)))
    res = solve_checkmate(inst, options=SPENT)  # nothing computed before it
    assert "the time limit stopped" in res.message and "recompute_greedy" in res.message


def test_a_slower_solver_answer_gives_way_to_the_start(monkeypatch):
    g = _random_graph(3)
    inst = Instance.single(g, DEV, _mid_budget(g))
    slow = solve_chen_sqrtn(Instance.single(g, DEV, keep_all_peak_bytes(g)))

    def slower(inst, solver, options, best, extra, *args, **kwargs):
        return StrategyResult(
            "checkmate", inst.devices, inst.budget_bytes, "feasible", schedule=slow.schedule,
            sim=slow.sim, best_bound_s=1e-6, message="the MILP's",
        )  # fmt: skip

    monkeypatch.setattr(checkmate, "_solve_from", slower)
    res = solve_checkmate(inst)
    assert res.status == "feasible" and res.sim.time_s < slow.sim.time_s
    assert res.message.startswith("kept its start") and res.extra["start_kept"]
    assert res.gap == pytest.approx(1 - 1e-6 / res.sim.time_s)

    def broken(inst, solver, options, best, extra, *args, **kwargs):
        return StrategyResult("checkmate", inst.devices, inst.budget_bytes, "error", message="x")

    monkeypatch.setattr(checkmate, "_solve_from", broken)
    assert solve_checkmate(inst).status == "error"  # a defect stays visible


def test_checkmate_is_solved_after_the_rows_it_starts_from():
    g = _random_graph(1)
    inst = Instance.single(g, DEV, _mid_budget(g))
    names = ("checkmate", "chen_sqrtn", "torch_checkpoint", "recompute_greedy")
    order = [job.name for job in plan(inst, names)]
    assert order[-1] == "checkmate" and set(order) == set(names)
    out = compare(inst, ("checkmate", "chen_sqrtn", "recompute_greedy"))
    assert [r.strategy for r in out.rows] == ["checkmate", "chen_sqrtn", "recompute_greedy"]
    chen = next(r for r in out.rows if r.strategy == "chen_sqrtn")
    assert set(run_schedules(inst, [chen.result])) == {"chen_sqrtn"}


def test_xengine_is_no_slower_than_any_heuristic_on_each_device():
    g = _random_graph(5)
    costs = {d: {v.name: v.cost_s[DEV] * k for v in g.nodes} for d, k in (("a", 1.0), ("b", 1.5))}
    g = g.with_costs(costs, {(x, y): CopyModel(1e-3, 1e4) for x in "ab" for y in "ab" if x != y})
    b = _mid_budget(g)
    inst = Instance(g, ("a", "b"), (b, b))
    out = compare(inst, ("xengine", "checkmate"), options=SPENT)
    xe = out.xengine
    assert xe is not None and xe.fits, xe.message if xe else None
    for d in range(2):
        sub = inst.only_device(d, b)
        for fn in HEURISTICS.values():
            h = fn(sub)
            if h.fits:
                embedded = h.schedule.on_devices(inst.devices)
                from xengine.simulate import simulate

                assert xe.sim.time_s <= simulate(inst, embedded).time_s * (1 + 1e-9)


def test_a_heuristic_is_computed_once_per_instance_and_costs():
    calls = []

    @computed_once
    def counted(inst, time_limit_s=None):
        calls.append(time_limit_s)
        return solve_chen_sqrtn(inst)

    g = _random_graph(2)
    inst = Instance.single(g, DEV, _mid_budget(g))
    first = counted(inst)
    again = counted(Instance.single(g, DEV, _mid_budget(g)), time_limit_s=5.0)
    assert len(calls) == 1 and again.extra["computed_once"] and again.sim is first.sim
    dearer = g.with_costs({DEV: {v.name: 2 * v.cost_s[DEV] for v in g.nodes}})
    counted(Instance.single(dearer, DEV, _mid_budget(g)))
    counted(Instance.single(g, DEV, _mid_budget(g) + 1))
    assert len(calls) == 3  # new costs, a new budget: computed again
    counted(inst, time_limit_s=0.0)  # kept: the finished result answers a tighter limit
    assert len(calls) == 3


def test_xengines_start_stopped_by_the_limit_is_logged(caplog):
    from xengine.protocol import _own_heuristics

    g = _random_graph(4)
    _, known = min_feasible_budget_bytes(g)
    sub = Instance.single(g, DEV, known)
    with caplog.at_level("WARNING", logger="xengine.protocol"):
        out = _own_heuristics(sub, 0.0)
    assert out[0].strategy.startswith("recompute_greedy")
    assert "XEngine's start may be weaker" in caplog.text
    assert "no time left" in caplog.text
