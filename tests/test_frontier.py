"""The frontier relaxation (xengine/strategies/frontier.py): every schedule is a point of it at its
own time, so its optimum bounds Checkmate's; and solve_checkmate's use of it (with the stage-cut
bound off)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from _nets import costed, tiny
from _schedules import checkpoint_schedule

import baselines.checkmate as cm
from baselines.heuristics import run_heuristics
from xengine.checkpoints import min_feasible_budget_bytes
from xengine.graph.synthetic import chain, training_graph
from xengine.problem import Instance
from xengine.simulate import keep_all_peak_bytes, simulate
from xengine.solvers import SolverOptions, solve
from xengine.strategies.frontier import FrontierResult, build_frontier, solve_frontier

DEV = "cpu"
OPTS = SolverOptions(time_limit_s=60, rel_gap=1e-9)


@pytest.fixture(autouse=True)
def _no_stage_cut(monkeypatch):
    """The stage-cut bound, which runs before the relaxation and can settle an instance alone,
    is off here so that each test sees the relaxation's path (tests/test_stage_cut.py has
    the two together)."""
    monkeypatch.setattr(cm, "stage_cut_bound", lambda *args, **kwargs: None)


def _graphs():
    r = np.random.default_rng(3)
    with_states = training_graph(
        "states",
        [(0, 1), (1, 2), (2, 3), (0, 3), (3, 4)],
        5,
        list(r.integers(1, 4, 5) * 1000),
        {DEV: list(np.round(r.uniform(0.5, 2.0, 5), 2))},
        loss_cost_s={DEV: 0.25},
        state_bytes=[500, 0, 700, 300, 0],
    )
    return [chain(6), chain(9), with_states, costed(tiny(2).graph, (DEV,))]


GRAPHS = _graphs()


def _inst(g, budget=None):
    return Instance.single(g, DEV, budget)


def _schedules(g):
    """Checkpointing schedules over every subset of up to 3 kept forward nodes."""
    inst = _inst(g)
    fwd = list(g.forward_indices)
    for k in range(min(3, len(fwd)) + 1):
        for keep in itertools.islice(itertools.combinations(fwd, k), 12):
            yield checkpoint_schedule(inst, set(keep))


@pytest.mark.parametrize("g", GRAPHS, ids=lambda g: g.name)
def test_every_schedule_is_a_point_at_its_own_time(g):
    # at a budget equal to the schedule's own peak, so the memory rows are tested at their edge
    n = 0
    for sched in _schedules(g):
        peak = int(simulate(_inst(g), sched).peak_bytes.max())
        inst = _inst(g, peak)
        sim = simulate(inst, sched)
        fm = build_frontier(inst)
        x = fm.assignment(sched)
        assert fm.model.max_violation(x) <= 1e-9
        assert fm.model.objective(x) * 1e-3 == pytest.approx(sim.time_s, rel=1e-12)
        n += 1
    assert n >= 4


@pytest.mark.parametrize("g", GRAPHS, ids=lambda g: g.name)
def test_heuristic_schedules_are_points_too(g):
    peak = keep_all_peak_bytes(g, DEV)
    for frac in (0.6, 0.8):
        inst = _inst(g, int(frac * peak))
        fm = build_frontier(inst)
        for r in run_heuristics(inst):
            if r.sim.within_budget:
                x = fm.assignment(r.schedule)
                assert fm.model.max_violation(x) <= 1e-9, r.strategy
                assert fm.model.objective(x) * 1e-3 == pytest.approx(r.sim.time_s, rel=1e-12)


def _mid_budgets(g):
    lower, known = min_feasible_budget_bytes(g)
    peak = keep_all_peak_bytes(g, DEV)
    return sorted({known, (known + peak) // 2, (3 * known + peak) // 4})


@pytest.mark.parametrize("g", GRAPHS, ids=lambda g: g.name)
def test_bound_never_exceeds_the_milp_optimum_and_answers_agree(g):
    for b in _mid_budgets(g):
        inst = _inst(g, b)
        milp = cm.solve_checkmate(inst, options=OPTS, frontier=False)
        assert milp.status == "optimal"
        fr = solve_frontier(inst, options=OPTS)
        assert fr.status == "optimal"
        assert fr.bound_s <= milp.sim.time_s * (1 + 1e-7)
        both = cm.solve_checkmate(inst, options=OPTS)
        assert both.status == "optimal", both.message
        assert both.sim.within_budget
        assert both.sim.time_s == pytest.approx(milp.sim.time_s, rel=1e-7)
        assert both.best_bound_s <= both.sim.time_s
        assert both.frontier is not None


def test_frontier_settles_a_chain_without_the_milp():
    g = chain(9)
    inst = _inst(g, _mid_budgets(g)[1])
    res = cm.solve_checkmate(inst, options=OPTS)
    assert res.status == "optimal" and res.gap <= 1e-9
    assert "raw_sim" not in res.extra  # the MILP did not run
    assert "proven optimal by the frontier relaxation" in res.message
    assert res.n_vars == res.frontier.n_vars


def test_a_weak_bound_hands_over_to_the_milp_with_a_floor(monkeypatch):
    # a relaxation that proves only "every op once" and gives no schedule: the MILP must run,
    # start from the heuristic, take the floor as a row, and still reach the optimum
    g = chain(9)
    inst = _inst(g, _mid_budgets(g)[1])
    base_s = float(inst.compute_s.sum())

    def weak(inst, solver, options, start=None, progress=None):
        return FrontierResult("feasible", base_s, base_s, None, 0.0, 0.0, 1, 1)

    monkeypatch.setattr(cm, "solve_frontier", weak)
    res = cm.solve_checkmate(inst, options=OPTS)
    alone = cm.solve_checkmate(inst, options=OPTS, frontier=False)
    assert res.status == "optimal" and "raw_sim" in res.extra
    assert res.n_rows == alone.n_rows + 1  # the floor row
    assert res.sim.time_s == pytest.approx(alone.sim.time_s, rel=1e-9)
    # a floor at the optimum itself cuts nothing off
    form = cm.build(inst, mode="exact")
    floor = alone.objective_s / form.time_scale * (1 - cm.FLOOR_RTOL)
    sr = solve(form.model.with_floor(floor), "highs", OPTS)
    assert sr.status == "optimal"
    assert form.objective_s(sr.x) == pytest.approx(alone.objective_s, rel=1e-9)


def _no_bound(inst, solver, options, start=None, progress=None):
    """A relaxation that proved nothing and gave no schedule within its share (GPT-2 of 48
    layers at 240 s: its presolve outlasted the share)."""
    return FrontierResult("no_solution", None, None, None, 0.0, 0.0, 1, 1)


def test_without_a_frontier_bound_every_op_once_is_the_bound_reported(monkeypatch):
    # before: a schedule kept where the MILP was refused reported no bound and no gap
    g = chain(9)
    inst = _inst(g, _mid_budgets(g)[1])
    monkeypatch.setattr(cm, "solve_frontier", _no_bound)
    monkeypatch.setattr(cm, "milp_memory_problem", lambda *a, **k: "too large for this test")
    res = cm.solve_checkmate(inst, options=OPTS)
    once_s = float(inst.compute_s.sum())
    assert res.status == "feasible" and res.best_bound_s == pytest.approx(once_s, rel=1e-12)
    assert res.gap == pytest.approx((res.sim.time_s - once_s) / res.sim.time_s, rel=1e-9)
    assert res.gap > 0.01 and res.extra["bound_from"] == cm.ONCE
    assert "bound_source" not in res.extra


def test_the_milp_alone_ended_before_its_root_reports_every_op_once(monkeypatch):
    g = chain(9)
    inst = _inst(g, _mid_budgets(g)[1])
    real = cm.solve

    def no_bound(*args, **kwargs):  # as HiGHS ended in its presolve: a start, no bound
        res = real(*args, **kwargs)
        return dataclasses.replace(res, status="feasible", best_bound=None, gap=None)

    monkeypatch.setattr(cm, "solve", no_bound)
    res = cm.solve_checkmate(inst, options=OPTS, frontier=False)
    once_s = float(inst.compute_s.sum())
    assert res.status == "feasible" and res.best_bound_s == pytest.approx(once_s, rel=1e-12)
    assert res.extra["bound_from"] == cm.ONCE and res.gap > 0


def test_a_start_within_the_gap_of_every_op_once_is_optimal_without_the_milp(monkeypatch):
    g = chain(9)
    inst = _inst(g, _mid_budgets(g)[1])
    monkeypatch.setattr(cm, "solve_frontier", _no_bound)
    loose = SolverOptions(time_limit_s=60, rel_gap=0.9)  # every schedule here is within 90 %
    res = cm.solve_checkmate(inst, options=loose)
    assert res.status == "optimal" and "raw_sim" not in res.extra
    assert "meets the bound of every op run once" in res.message
    assert res.best_bound_s == pytest.approx(float(inst.compute_s.sum()), rel=1e-12)


def _record_limits(monkeypatch) -> list[float]:
    """The time limits the frontier relaxation is given from now on (it proves nothing)."""
    given: list[float] = []

    def record(inst, solver, options, start=None, progress=None):
        given.append(options.time_limit_s)
        return _no_bound(inst, solver, options)

    monkeypatch.setattr(cm, "solve_frontier", record)
    return given


@pytest.mark.parametrize("spent_share", [0.0, 0.8])
def test_the_relaxation_gets_its_share_or_what_is_left_of_the_limit(monkeypatch, spent_share):
    # its share counted from its own start let a 240 s row end at 265-276 s at 48 GPT-2
    # layers, where the heuristics took 137 s of their 96
    import time

    g = chain(9)
    inst = _inst(g, _mid_budgets(g)[1])
    given = _record_limits(monkeypatch)
    opts = SolverOptions(time_limit_s=100.0)
    t_start = time.perf_counter() - spent_share * 100.0
    cm._frontier_phase(inst, "highs", opts, None, None, {}, t_start)
    want = 100.0 * cm.FRONTIER_SHARE if spent_share == 0.0 else 100.0 * (1 - spent_share)
    assert given[0] == pytest.approx(want, abs=0.5)


def test_the_relaxation_gets_all_that_is_left_when_the_milp_will_not_be_built(monkeypatch):
    # at 48 GPT-2 layers the MILP is refused (14.7 GiB): after the relaxation's half the
    # strategy answered with half of its limit unused
    g = chain(9)
    inst = _inst(g, _mid_budgets(g)[1])
    given = _record_limits(monkeypatch)
    monkeypatch.setattr(cm, "milp_memory_problem", lambda graph: "too large for this test")
    res = cm.solve_checkmate(inst, options=SolverOptions(time_limit_s=100.0))
    assert given and given[0] > 90.0  # what the heuristics left of 100 s, not 50
    assert "too large for this test" in res.extra["milp_refused"]
