"""Spreading one-device schedules over several devices (XEngine's multi-device start)."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.checkmate import solve_checkmate
from tests.helpers import RESIDUAL, copy_models, random_graph
from xengine.graph.synthetic import training_graph
from xengine.problem import Instance
from xengine.schedule import keep_all_schedule
from xengine.simulate import keep_all_peak_bytes, simulate
from xengine.solvers import SolverOptions
from xengine.strategies.distribute import place, spread, start_candidates, units
from xengine.strategies.solve import agree, solve_xengine

OPTS = SolverOptions(time_limit_s=60, rel_gap=1e-9)


def _residual(costs_b: float = 1.0):
    return training_graph(
        "residual",
        RESIDUAL,
        4,
        [1000, 3000, 1000, 3000],
        {"a": [1.0] * 4, "b": [costs_b] * 4},
        saves_input=False,
        copy_models=copy_models(("a", "b")),
    )


def test_units_pair_each_forward_node_with_its_backward_node():
    g = random_graph(2)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    u = units(inst)
    for i, v in enumerate(g.nodes):
        if v.kind == "bwd":
            assert u[i] == u[v.fwd_index], v.name
    fwd = [i for i, v in enumerate(g.nodes) if v.kind == "fwd"]
    assert sorted(u[fwd]) == list(range(len(fwd)))  # one unit per forward node, in order
    loss = next(i for i, v in enumerate(g.nodes) if v.kind == "loss")
    assert u[loss] == u[max(fwd)]


@pytest.mark.parametrize("seed", range(6))
def test_any_placement_of_a_valid_schedule_is_valid_and_computes_the_same_nodes(seed):
    g = random_graph(seed)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    single = keep_all_schedule(inst.only_device(0, 10**9))
    rng = np.random.default_rng(seed)
    placement = rng.integers(0, 2, g.size)[units(inst)]
    sched = place(single, inst.devices, placement)
    sim = simulate(inst, sched)  # raises on an invalid schedule
    assert (sched.R.sum(axis=0) == single.R[0]).all()
    for i in range(g.size):
        assert not sched.R[1 - placement[i], :, i].any()
    # compute time = each node at its device's cost; the rest is copies
    expect = sum(inst.compute_s[placement[i], i] for i in range(g.size))
    assert sim.compute_time_s == pytest.approx(expect)
    assert sim.time_s == pytest.approx(sim.compute_time_s + sim.copy_time_s)


def test_place_rejects_bad_input():
    g = random_graph(0)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    single = keep_all_schedule(inst.only_device(0, 10**9))
    with pytest.raises(ValueError, match="entries"):
        place(single, inst.devices, [0, 1])
    with pytest.raises(ValueError, match="outside"):
        place(single, inst.devices, [2] * g.size)
    with pytest.raises(ValueError, match="one-device"):
        place(keep_all_schedule(inst), inst.devices, [0] * g.size)


def test_spread_fits_where_neither_device_alone_does():
    """Case (c) of the XEngine issue: 9000 bytes per device, one device needs 10000. Keep-all
    spread over both devices fits, and the placed model finds a schedule at least as fast."""
    g = _residual()
    inst = Instance(g, ("a", "b"), (9000, 9000))
    keep = keep_all_schedule(inst.only_device(0, 18000))
    sp = spread(inst, [("keep-all", keep)])
    assert sp is not None and sp.fits and sp.devices_used == 2
    sim = simulate(inst, sp.schedule)  # within budget, or it raises
    assert sp.time_s == pytest.approx(sim.time_s)
    assert np.array_equal(sp.peak_bytes, sim.peak_bytes)
    cands = start_candidates(inst, [], options=OPTS)
    assert [label.split()[0] for label, _ in cands] == ["keep-all", "XEngine"]
    times = [simulate(inst, s).time_s for _, s in cands]
    assert times[1] <= times[0] + 1e-9
    # the full model from that start is optimal and never slower than the start
    res = solve_xengine(inst, options=OPTS, warm_start=cands[1][1])
    assert res.status == "optimal" and res.objective_s <= times[1] + 1e-9


def test_spread_reports_the_least_excess_when_nothing_fits():
    g = _residual()
    inst = Instance(g, ("a", "b"), (4000, 4000))  # below the largest op's footprint
    sp = spread(inst, [("keep-all", keep_all_schedule(inst.only_device(0, 8000)))])
    assert sp is not None and not sp.fits and sp.excess_bytes > 0
    assert start_candidates(inst, [], options=OPTS) == []


@pytest.mark.parametrize("seed", range(6))
def test_placed_model_is_exact_and_never_beats_the_full_model(seed):
    """The model restricted to a placement: every node only on its device, its objective and
    peaks equal the simulator's, and its optimum is >= the full model's (a restriction) and
    equal to it when the placement is the full optimum's own."""
    g = random_graph(seed)
    peak = keep_all_peak_bytes(g)
    for frac in (0.6, 0.8, 1.0):  # the tightest of these budgets that the graph allows
        inst = Instance(g, ("a", "b"), (int(frac * peak), int(frac * peak)))
        full = solve_xengine(inst, options=OPTS)
        if full.status != "infeasible":
            break
    assert full.status == "optimal"
    placement = np.random.default_rng(seed).integers(0, 2, g.size)[units(inst)]
    res = solve_xengine(inst, options=OPTS, placement=placement)
    if res.status == "infeasible":
        return
    assert res.status == "optimal" and agree(res)
    for i in range(g.size):
        assert not res.schedule.R[1 - placement[i], :, i].any()
        assert not res.schedule.S[1 - placement[i], :, i].any()
    assert res.objective_s >= full.objective_s - 1e-9
    # the full optimum's placement, where each node runs on one device only
    on = full.schedule.R.any(axis=1) | full.schedule.S.any(axis=1)  # (D, n)
    if (on.sum(axis=0) == 1).all():
        again = solve_xengine(inst, options=OPTS, placement=on.argmax(axis=0))
        assert again.objective_s == pytest.approx(full.objective_s)


def test_placed_model_rejects_a_bad_placement():
    g = random_graph(0)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    with pytest.raises(ValueError, match="one device index"):
        solve_xengine(inst, options=OPTS, placement=np.zeros(3, dtype=int))


def test_start_candidates_need_several_devices():
    g = random_graph(0)
    inst = Instance.single(g, "a", 10**9)
    res = solve_checkmate(inst, options=OPTS)
    assert start_candidates(inst, [("checkmate", res.schedule)], options=OPTS) == []


@pytest.mark.parametrize("seed", range(4))
def test_placed_model_leaves_nodes_at_minus_one_free(seed):
    g = random_graph(seed)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    full = solve_xengine(inst, options=OPTS)
    free = solve_xengine(inst, options=OPTS, placement=np.full(g.size, -1))
    assert free.objective_s == pytest.approx(full.objective_s)
    # one unit pinned to device b, the rest free: b computes it, a never does
    placement = np.full(g.size, -1)
    pinned = units(inst) == 0
    placement[pinned] = 1
    res = solve_xengine(inst, options=OPTS, placement=placement)
    assert res.status == "optimal" and agree(res)
    assert not res.schedule.R[0][:, pinned].any() and res.schedule.R[1][:, pinned].any()
    assert res.objective_s >= full.objective_s - 1e-9


def test_spread_tries_every_schedule_even_without_time_left():
    """The cuts of every schedule are tried even at a zero time limit (the first one must not
    use up the others' time), and a schedule given twice is placed once."""
    from baselines.heuristics import solve_chen_sqrtn
    from xengine.graph.synthetic import chain

    g = chain(8, devices=("a", "b")).with_costs({}, copy_models(("a", "b")))
    peak = keep_all_peak_bytes(g)
    inst = Instance(g, ("a", "b"), (int(0.4 * peak), int(0.4 * peak)))
    alone = inst.only_device(0, int(0.8 * peak))
    keep = keep_all_schedule(alone)  # needs the whole peak at once: no placement fits
    sqrtn = solve_chen_sqrtn(alone)
    assert sqrtn.has_schedule
    sp = spread(inst, [("keep-all", keep), ("sqrtn", sqrtn.schedule)], time_limit_s=0.0)
    once = spread(inst, [("keep-all", keep)], time_limit_s=0.0)
    assert sp.source == "sqrtn" and sp.excess_bytes < once.excess_bytes
    twice = spread(inst, [("keep-all", keep), ("again", keep)], time_limit_s=0.0)
    assert twice.evaluations == once.evaluations


def test_placed_model_gets_a_multi_device_placement_when_one_device_fits_best():
    """When the best fitting placement is one device alone, the placed model still starts from
    the best placement over both devices (it can recompute where the spread could not)."""
    g = _residual()
    inst = Instance(g, ("a", "b"), (10**9, 10**9))  # everything fits on one device
    keep = keep_all_schedule(inst.only_device(0, 2 * 10**9))
    best = spread(inst, [("keep-all", keep)])
    assert best.fits and best.devices_used == 1  # copies only cost: one device is best
    multi = spread(inst, [("keep-all", keep)], min_devices_used=2)
    assert multi.devices_used == 2 and multi.time_s >= best.time_s
    labels = [label for label, _ in start_candidates(inst, [], options=OPTS)]
    assert labels[0].endswith("placed on one device")
    assert any(label.startswith("XEngine restricted") for label in labels)


def test_an_unavailable_solver_skips_the_placed_model_with_a_warning(monkeypatch, caplog):
    import xengine.strategies.solve as solve_mod
    from xengine.solvers import SolverUnavailable

    def unavailable(*args, **kwargs):
        raise SolverUnavailable("solver=gurobi: the licence limits models to 2000 variables")

    monkeypatch.setattr(solve_mod, "solve_xengine", unavailable)
    g = _residual()
    inst = Instance(g, ("a", "b"), (9000, 9000))
    with caplog.at_level("WARNING"):
        cands = start_candidates(inst, [], solver="gurobi", options=OPTS)
    assert [label.split()[0] for label, _ in cands] == ["keep-all"]  # the spread is kept
    assert "placed model skipped: solver=gurobi" in caplog.text


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fraction", [0.5, 0.6, 0.8])
def test_offloaded_starts_fit_every_budget(seed, fraction):
    """Every schedule ``offload_starts`` returns is valid and within each device's budget
    (the simulator's replay, the one definition of what fits)."""
    from xengine.strategies.distribute import offload_starts

    g = random_graph(seed)
    b = int(keep_all_peak_bytes(g) * fraction)
    inst = Instance(g, ("a", "b"), (b, b))
    for what, sched in offload_starts(inst, time_limit_s=10):
        sim = simulate(inst, sched, check_budget=False)
        assert sim.within_budget, what
        assert (sim.peak_bytes <= inst.budgets).all(), what


def test_offloading_beats_the_fast_device_alone_where_memory_is_short():
    """On this graph at 60 % the fast device alone must recompute; recomputing less there and
    keeping some pairs on the slow device is faster, and uses both devices."""
    from baselines.heuristics import solve_recompute_greedy
    from xengine.strategies.distribute import offload_starts

    g = random_graph(6)
    b = int(keep_all_peak_bytes(g) * 0.6)
    inst = Instance(g, ("a", "b"), (b, b))
    fast = int(np.argmin(inst.compute_s.sum(axis=1)))
    alone = solve_recompute_greedy(inst.only_device(fast, b), hold=True)
    assert alone.fits
    starts = offload_starts(inst, time_limit_s=10)
    best = min(starts, key=lambda s: simulate(inst, s[1]).time_s)[1]
    assert simulate(inst, best).time_s < 0.9 * alone.sim.time_s
    assert (best.R.sum(axis=(1, 2)) > 0).all()  # both devices compute


def test_the_fastest_device_runs_every_node_once_in_the_least_time():
    """Where the multi-device starts put their recomputations: the device of least total
    compute time, whichever its position."""
    for costs_b, fastest in ((0.5, 1), (2.0, 0)):
        inst = Instance(_residual(costs_b), ("a", "b"), (10**6, 10**6))
        assert inst.fastest_device == fastest
        assert inst.compute_s[fastest].sum() < inst.compute_s[1 - fastest].sum()
