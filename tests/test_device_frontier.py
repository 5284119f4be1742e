"""The frontier relaxation over several devices (``xengine/strategies/device_frontier.py``):
every schedule the simulator accepts is a point of it at no more than its simulated time and
within its own peaks, so its optimum bounds XEngine's from below."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import random_graph
from tests.test_optimal import DEVICES, _instance, _optimum, _simulate, random_schedule
from xengine.problem import Instance
from xengine.simulate import simulate
from xengine.solvers import SolverOptions
from xengine.strategies.device_frontier import (
    build_device_frontier,
    device_frontier_lp_bound,
    solve_device_frontier,
    step_row_nonzeros,
)
from xengine.strategies.frontier import build_frontier


def _at_own_peaks(inst: Instance, peaks) -> Instance:
    """The instance with each device's budget at the schedule's own peak there: the tightest
    budgets the schedule fits, where the memory rows bind."""
    return inst.with_budgets(tuple(max(int(p), 1) for p in peaks))


@pytest.mark.parametrize("D", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_every_simulated_schedule_is_a_point_within_its_time(seed, D):
    g = random_graph(seed, devices=DEVICES[D], states=True, latency_s=0.3)
    inst = _instance(g, DEVICES[D])
    rng = np.random.default_rng(200 + seed)
    checked = copied = 0
    for k in range(120):
        sched, sim = _simulate(inst, random_schedule(g, D, rng))
        if sim is None:
            continue
        tight = _at_own_peaks(inst, sim.peak_bytes) if k % 2 else inst
        fm = build_device_frontier(tight, steps=bool(k % 4 == 1))  # every step's memory too
        x = fm.assignment(sched)
        assert fm.model.max_violation(x) <= 1e-6, (seed, D, k, fm.model.max_violation(x))
        obj_s = float(fm.model.c @ x) * 1e-3
        assert obj_s <= sim.time_s * (1 + 1e-9) + 1e-12, (obj_s, sim.time_s)
        if sim.n_copies == 0:
            assert obj_s == pytest.approx(sim.time_s, rel=1e-9)
        checked += 1
        copied += int(sim.n_copies > 0)
    assert checked >= 40, checked
    if D > 1:
        assert copied >= 10, copied


def test_the_step_rows_estimate_covers_them():
    for seed in range(3):
        g = random_graph(seed, devices=DEVICES[2], states=True, latency_s=0.3)
        inst = _instance(g, DEVICES[2], fraction=0.6)
        plain = build_device_frontier(inst).model.A.nnz
        steps = build_device_frontier(inst, steps=True).model.A.nnz
        assert plain < steps <= plain + step_row_nonzeros(inst)


@pytest.mark.parametrize("seed", range(3))
def test_its_bound_is_below_the_proven_two_device_optimum(seed):
    g = random_graph(seed, devices=DEVICES[2], states=bool(seed % 2), latency_s=0.3)
    inst = _instance(g, DEVICES[2], fraction=0.7)
    _, best = _optimum(inst)
    fr = solve_device_frontier(inst, options=SolverOptions(time_limit_s=60, rel_gap=1e-9))
    assert fr.status == "optimal"
    assert fr.bound_s <= best.time_s * (1 + 1e-7)


def test_with_one_device_it_is_the_one_device_relaxation():
    g = random_graph(1, devices=DEVICES[1], states=True, latency_s=0.3)
    inst = _instance(g, DEVICES[1], fraction=0.6)
    opts = SolverOptions(time_limit_s=60, rel_gap=1e-9)
    from xengine.solvers import solve

    one = solve(build_frontier(inst).model, "highs", opts)
    many = solve(build_device_frontier(inst).model, "highs", opts)
    assert one.status == many.status == "optimal"
    assert many.objective == pytest.approx(one.objective, rel=1e-7)  # both every node once + C


@pytest.mark.parametrize("D", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_a_schedules_own_point_reads_back_as_that_schedule(seed, D):
    """Where the relaxation's point is a schedule, :meth:`schedule_from` gives it back: the same
    computations, so the same time, and never more memory (unread residents dropped)."""
    g = random_graph(seed, devices=DEVICES[D], states=True, latency_s=0.3)
    inst = _instance(g, DEVICES[D])
    fm = build_device_frontier(inst)
    rng = np.random.default_rng(300 + seed)
    checked = 0
    for _ in range(60):
        sched, sim = _simulate(inst, random_schedule(g, D, rng))
        if sim is None:
            continue
        back = fm.schedule_from(fm.assignment(sched))
        again = simulate(inst, back)
        np.testing.assert_array_equal(back.R, sched.R)
        assert again.time_s == pytest.approx(sim.time_s, rel=1e-12)
        assert (again.peak_bytes <= sim.peak_bytes).all()
        checked += 1
    assert checked >= 20, checked


def test_a_relaxed_point_reads_back_as_a_valid_schedule():
    """The relaxation's own optimum (order inside a stage dropped) on random two-device
    instances at a tight budget: read back, the simulator accepts it, at no less than the
    bound."""
    for seed in range(4):
        g = random_graph(seed, devices=DEVICES[2], states=bool(seed % 2), latency_s=0.3)
        inst = _instance(g, DEVICES[2], fraction=0.6)
        fr = solve_device_frontier(inst, options=SolverOptions(time_limit_s=60, rel_gap=1e-9))
        assert fr.schedule is not None
        sim = simulate(inst, fr.schedule, check_budget=False)  # raises on an invalid schedule
        assert sim.time_s >= fr.bound_s * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_xengine_with_the_relaxation_first_reaches_the_milps_optimum(seed):
    """``solve_xengine`` runs the relaxation first (several devices): its answer is as fast as
    the MILP's own optimum, proven, and every figure of it is the simulator's."""
    from xengine.strategies.solve import solve_xengine

    g = random_graph(seed, devices=DEVICES[2], states=bool(seed % 2), latency_s=0.3)
    inst = _instance(g, DEVICES[2], fraction=0.7)
    opts = SolverOptions(time_limit_s=120, rel_gap=1e-6)
    alone = solve_xengine(inst, options=opts, frontier=False)
    first = solve_xengine(inst, options=opts)
    assert alone.status == first.status == "optimal"
    assert first.frontier is not None and first.frontier.bound_s is not None
    assert first.sim.time_s == pytest.approx(alone.sim.time_s, rel=1e-6)
    assert first.objective_s == pytest.approx(first.sim.time_s, rel=1e-12)
    assert first.sim.within_budget
    assert first.best_bound_s <= first.sim.time_s


def test_an_optimum_the_relaxation_proves_needs_no_milp():
    from xengine.strategies.solve import solve_xengine

    for seed in range(6):
        g = random_graph(seed, devices=DEVICES[2], states=True, latency_s=0.3)
        inst = _instance(g, DEVICES[2], fraction=0.7)
        res = solve_xengine(inst, options=SolverOptions(time_limit_s=60, rel_gap=1e-6))
        if "frontier relaxation" in res.message:
            break
    else:
        pytest.fail("the relaxation settled none of six instances")
    assert res.status == "optimal" and res.gap <= 1e-6
    assert res.n_vars == res.frontier.n_vars  # the relaxation's size: no MILP was built
    assert res.frontier.schedule_fits


def test_a_relaxation_too_large_for_the_host_is_not_built(monkeypatch):
    """Issue 30 item 5: refused before it is built, with the line saying why; the MILP (small
    here, so built) answers alone."""
    from xengine.strategies import model_size
    from xengine.strategies import solve as solve_module
    from xengine.strategies.solve import solve_xengine

    g = random_graph(0, devices=DEVICES[2], states=True, latency_s=0.3)
    inst = _instance(g, DEVICES[2], fraction=0.7)
    assert model_size.frontier_memory_problem(g, 2, free_bytes=2**40) is None
    why = model_size.frontier_memory_problem(g, 2, free_bytes=1000)
    assert "frontier relaxation" in why and "1000 B free" in why.replace("1000 bytes", "1000 B")
    monkeypatch.setattr(model_size, "available_host_bytes", lambda: 1000)
    monkeypatch.setattr(solve_module, "milp_memory_problem", lambda *a, **k: None)
    res = solve_xengine(inst, options=SolverOptions(time_limit_s=30))
    assert res.frontier is None and "frontier relaxation" in res.extra["frontier_refused"]
    assert res.status == "optimal"  # the MILP alone


def test_above_the_size_where_it_pays_its_lp_gives_the_bound(monkeypatch):
    """Above :data:`DEVICE_FRONTIER_MAX_NONZEROS` the relaxation is not solved as a MILP; its
    LP (PDLP) bounds, and the MILP answers from the start with that bound as its floor."""
    from xengine.strategies import solve as solve_module
    from xengine.strategies.solve import solve_xengine

    g = random_graph(0, devices=DEVICES[2], states=True, latency_s=0.3)
    inst = _instance(g, DEVICES[2], fraction=0.7)
    full = solve_xengine(inst, options=SolverOptions(time_limit_s=30))
    assert full.frontier is not None and full.frontier.status != "lp_bound"
    monkeypatch.setattr(solve_module, "DEVICE_FRONTIER_MAX_NONZEROS", 0)
    res = solve_xengine(inst, options=SolverOptions(time_limit_s=30))
    assert res.frontier.status == "lp_bound"
    assert 0 < res.frontier.bound_s <= full.objective_s * (1 + 1e-7)
    assert res.status == "optimal" and res.objective_s == pytest.approx(full.objective_s)
    # the row's solve time is the whole solve's, the relaxation's phase included
    assert res.solve_time_s >= res.frontier.solve_time_s + res.extra["milp_solve_time_s"]


@pytest.mark.parametrize("seed", range(3))
def test_the_lp_bound_is_the_relaxations_lp_optimum(seed):
    """PDLP run to convergence bounds at the LP optimum (HiGHS's simplex on the same model),
    from below: a bound from multipliers never exceeds it."""
    from xengine.solvers import solve

    g = random_graph(seed, devices=DEVICES[2], states=bool(seed % 2), latency_s=0.3)
    inst = _instance(g, DEVICES[2], fraction=0.6)
    lp = solve(build_device_frontier(inst).model, "highs", SolverOptions(relax=True))
    assert lp.status == "optimal"
    fr = device_frontier_lp_bound(inst, SolverOptions(time_limit_s=60))
    lp_s = lp.objective * 1e-3
    assert lp_s * (1 - 1e-4) <= fr.bound_s <= lp_s * (1 + 1e-7), (fr.bound_s, lp_s)
