"""The XEngine model against the simulator, Checkmate and hand-computed optima."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.formulation_variants import build_published, build_symmetry_broken
from tests.helpers import RESIDUAL, copy_models, random_graph
from xengine.graph.synthetic import chain, training_graph
from xengine.problem import Instance
from xengine.schedule import keep_all_schedule
from xengine.simulate import keep_all_peak_bytes, simulate
from xengine.solvers import SolverOptions
from xengine.strategies.formulation import build, default_free_rows
from xengine.strategies.solve import agree
from xengine.strategies.solve import solve_xengine as _solve_xengine

OPTS = SolverOptions(time_limit_s=60, rel_gap=1e-9)


def solve_xengine(*args, **kwargs):
    """The MILP alone (no frontier relaxation first): these tests are about the formulation,
    whose objective and memory must equal the simulator's (``agree``)."""
    return _solve_xengine(*args, frontier=False, **kwargs)


def _single(g, dev, budget):
    return Instance(g, (dev,), (int(budget),))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("states", [False, True], ids=["values", "states"])
def test_one_device_exact_and_paper_equal(seed, states):
    """One device: the exact and the published model have one optimum, the simulator's, on
    graphs with and without autograd states."""
    g = random_graph(seed, devices=("a",), states=states)
    assert g.has_states == states and (g.state_bytes.sum() > 0) == states
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes("a").max())
    for frac in (1.0, 0.5, 0.0):
        inst = _single(g, "a", low + frac * (peak - low))
        ex = solve_xengine(inst, formulation="exact", options=OPTS)
        pa = solve_xengine(inst, formulation="paper", options=OPTS)
        assert ex.status == pa.status
        if ex.status == "optimal":
            assert ex.objective_s == pytest.approx(pa.objective_s, rel=1e-7)
            assert agree(ex), (ex.objective_s, ex.sim.time_s, ex.model_peak_bytes)
            assert (ex.schedule.S_state is not None) == states


def test_states_can_be_dropped_and_made_again():
    """A large state is worth dropping: under this budget f1's state cannot stay through the
    rest of the forward pass, so f1 runs again before its backward op to make it anew."""
    g = training_graph(
        "bigstate",
        [(0, 1), (1, 2)],
        3,
        [1000, 1000, 4000],
        {"a": [1.0, 1.0, 1.0]},
        state_bytes=[0, 5000, 0],
        saves_output=[False, False, False],
    )
    inst0 = _single(g, "a", 10**9)
    keep_all = simulate(inst0, keep_all_schedule(inst0))
    assert keep_all.peak_bytes[0] == 15000
    inst = _single(g, "a", 12000)
    res = solve_xengine(inst, options=OPTS)
    assert res.status == "optimal" and agree(res)
    assert res.sim.peak_bytes[0] <= 12000
    assert res.schedule.R[0, :, 1].sum() == 2  # f1 runs again to make its state anew
    assert not res.schedule.S_state[0, 3:5, 1].any()  # not kept over the loss and b2


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("states", [False, True], ids=["values", "states"])
def test_exact_objective_and_memory_equal_simulator(seed, states):
    devices = ("a", "b", "c") if seed % 4 == 3 else ("a", "b")
    g = random_graph(seed, devices=devices, states=states)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    n_solved = 0
    for frac in (1.0, 0.6, 0.3, 0.0):
        budget = int(low + frac * (peak - low))
        inst = Instance(g, devices, tuple([budget] * len(devices)))
        res = solve_xengine(inst, options=OPTS)
        if res.status == "infeasible":
            continue
        assert res.status == "optimal", res.message
        n_solved += 1
        assert res.sim.within_budget
        assert agree(res), (
            res.objective_s,
            res.sim.time_s,
            res.model_peak_bytes,
            res.sim.peak_bytes,
        )
        # never worse than the best single-device optimum at the same per-device budget
        for d, _name in enumerate(devices):
            single = solve_xengine(inst.only_device(d, inst.budget_bytes[d]), options=OPTS)
            if single.status == "optimal":
                assert res.objective_s <= single.objective_s * (1 + 1e-9) + 1e-12
    assert n_solved >= 1


def test_keep_all_budget_recomputes_nothing():
    # every node has a positive cost (a free node could be recomputed at no loss)
    g = training_graph(
        "chain6",
        [(i, i + 1) for i in range(5)],
        6,
        [1000] * 6,
        {"cpu": [1.0] * 6},
        loss_cost_s={"cpu": 0.5},
    )
    inst = _single(g, "cpu", keep_all_peak_bytes(g))
    res = solve_xengine(inst, options=OPTS)
    assert res.status == "optimal"
    assert res.sim.n_recomputes == 0
    assert res.objective_s == pytest.approx(float(inst.compute_s.sum()))


def test_tighter_budget_costs_more_and_stays_within_it():
    g = chain(8)
    peak = keep_all_peak_bytes(g)
    costs = []
    for frac in (1.0, 0.75, 0.5):
        inst = _single(g, "cpu", peak * frac)
        res = solve_xengine(inst, options=OPTS)
        assert res.status == "optimal"
        assert res.sim.peak_bytes[0] <= inst.budget_bytes[0]
        costs.append(res.objective_s)
    assert costs[0] == pytest.approx(24.0)  # 8 fwd (1 s) + free loss + 8 bwd (2 s), no recompute
    assert costs[0] < costs[1] <= costs[2]


def test_warm_start_from_single_device_schedule_is_feasible_point():
    g = random_graph(1)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    ka = keep_all_schedule(inst, device=1)
    form = build(inst)
    x0 = form.assignment(ka)
    assert form.model.max_violation(x0) < 1e-9
    assert form.objective_s(x0) == pytest.approx(simulate(inst, ka).time_s)
    assert np.allclose(form.peak_bytes(x0), simulate(inst, ka).peak_bytes)


# ----------------------------------------------------------------------------- hand-made cases
def _split_graph(latency_s: float):
    """Device a is 10x faster on layers 0-1, device b on layers 2-3; the loss costs 0.5."""
    fwd = {"a": [1.0, 1.0, 10.0, 10.0], "b": [10.0, 10.0, 1.0, 1.0]}
    bwd = {d: [2 * c for c in cs] for d, cs in fwd.items()}
    return training_graph(
        "split",
        [(0, 1), (1, 2), (2, 3)],
        4,
        [1000] * 4,
        fwd,
        bwd_cost_s=bwd,
        loss_cost_s={"a": 0.5, "b": 0.5},
        saves_input=True,
        copy_models=copy_models(("a", "b"), latency_s=latency_s),
    )


def test_case_a_split_across_devices_matches_hand_computation():
    g = _split_graph(latency_s=0.01)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    res = solve_xengine(inst, options=OPTS)
    assert res.status == "optimal"
    # f0,f1,b1,b0 on a; f2,f3,loss,b3,b2 on b: compute 1+1+1+1+0.5+2+2+2+2 = 12.5.
    # Copies: f1 -> b for f2, f1 -> b again for b2 (b2 reads its input f1), grad b2 -> a for b1.
    assert res.objective_s == pytest.approx(12.5 + 3 * 0.01)
    best_single = min(
        solve_xengine(inst.only_device(d, 10**9), options=OPTS).objective_s for d in range(2)
    )
    assert best_single == pytest.approx(1 + 1 + 10 + 10 + 0.5 + 2 + 2 + 20 + 20)
    gain = (best_single - res.objective_s) / best_single
    assert gain == pytest.approx((66.5 - 12.53) / 66.5)
    on_a = res.schedule.R[0].any(axis=0)
    assert [g.nodes[i].name for i in np.flatnonzero(on_a)] == ["f0", "f1", "b1", "b0"]


def test_case_b_expensive_copies_stay_on_one_device():
    g = _split_graph(latency_s=1000.0)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    res = solve_xengine(inst, options=OPTS)
    assert res.status == "optimal"
    assert res.sim.n_copies == 0
    used = [bool(res.schedule.R[d].any()) for d in range(2)]
    assert used.count(True) == 1
    assert res.objective_s == pytest.approx(66.5)


def test_case_c_two_devices_fit_where_neither_alone_does():
    g = training_graph(
        "residual",
        RESIDUAL,
        4,
        [1000, 3000, 1000, 3000],
        {"a": [1.0] * 4, "b": [1.0] * 4},
        saves_input=False,
        copy_models=copy_models(("a", "b")),
    )
    budget = 9000
    inst = Instance(g, ("a", "b"), (budget, budget))
    for d in range(2):
        assert solve_xengine(inst.only_device(d, budget), options=OPTS).status == "infeasible"
    res = solve_xengine(inst, options=OPTS)
    assert res.status == "optimal"
    assert res.sim.within_budget
    assert all(res.sim.peak_bytes <= budget)
    assert res.schedule.R[0].any() and (res.schedule.R[1].any() or res.schedule.S[1].any())


def test_warm_started_solve_returns_the_optimum_not_the_start():
    # HiGHS 1.16 once returned the MIP start's values with the optimum's objective here
    from baselines.heuristics import solve_chen_greedy

    inst = _single(chain(3), "cpu", 4000)
    start = solve_chen_greedy(inst)
    assert start.sim.time_s == pytest.approx(12.0)
    res = solve_xengine(inst, warm_start=start.schedule, options=OPTS)
    assert res.status == "optimal"
    assert res.objective_s == pytest.approx(10.0)
    assert res.sim.time_s == pytest.approx(10.0)


# ----------------------------------------------------------------------------- reference form
@pytest.mark.parametrize("seed", range(8))
def test_reference_and_hazard_forms_have_the_default_optimum(seed):
    """The published form (full matrices, stage fixings as rows, no reductions) and the
    hazard-count FREE rows are rewritings of the default model (tight FREE rows on HiGHS):
    same optimum, and each one's schedule replays in the simulator to its own objective and
    peak."""
    devices = ("a", "b", "c") if seed % 4 == 3 else (("a",) if seed % 3 == 0 else ("a", "b"))
    g = random_graph(seed, devices=devices)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    for frac in (1.0, 0.4, 0.0):
        inst = Instance(g, devices, tuple([int(low + frac * (peak - low))] * len(devices)))
        default = solve_xengine(inst, options=OPTS)
        assert default.extra["build_options"] == {"free_rows": "tight"}
        for builder, opts in (
            (build_published, {"free_rows": "hazard"}),
            (build, {"free_rows": "hazard"}),
        ):
            label = (builder.__name__, opts)
            other = solve_xengine(inst, options=OPTS, build_options=opts, builder=builder)
            assert other.status == default.status, label
            if default.status != "optimal":
                continue
            assert other.objective_s == pytest.approx(default.objective_s, rel=1e-7), label
            assert agree(other), label
            assert other.sim.within_budget
        if frac == 1.0:
            # a valid schedule is a feasible point of every form, at its simulated cost
            ka = keep_all_schedule(inst)
            for builder, opts in (
                (build, {"free_rows": "hazard"}),
                (build_published, {}),
                (build, {"free_rows": "tight"}),
            ):
                form = builder(inst, **opts)
                x0 = form.assignment(ka)
                assert form.model.max_violation(x0) < 1e-9, (builder.__name__, opts)
                assert form.objective_s(x0) == pytest.approx(simulate(inst, ka).time_s)


def test_free_rows_follow_the_solver():
    """Tight FREE rows for the MILP solvers; CP-SAT, which refuses their continuous F, gets the
    hazard rows; the reference keeps its published ones; a caller's choice stands."""
    assert default_free_rows("highs") == "tight" and default_free_rows("scip") == "tight"
    assert default_free_rows("cpsat") == "hazard" and default_free_rows("CPSAT") == "hazard"
    g = random_graph(2)
    inst = Instance(g, ("a", "b"), (keep_all_peak_bytes(g),) * 2)
    opts = SolverOptions(time_limit_s=30)
    assert solve_xengine(inst, "cpsat", options=opts).extra["build_options"] == {
        "free_rows": "hazard"
    }
    ref = solve_xengine(
        inst, options=opts, build_options={"free_rows": "hazard"}, builder=build_published
    )
    assert ref.extra["build_options"] == {"free_rows": "hazard"}
    mine = solve_xengine(inst, options=opts, build_options={"free_rows": "hazard"})
    assert mine.extra["build_options"] == {"free_rows": "hazard"}


def test_reference_model_is_larger_and_has_stage_rows():
    g = random_graph(1)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    d, r = build(inst), build_published(inst)
    n, E = g.size, len(g.edges)
    assert r.model.n_vars > d.model.n_vars
    assert (r.Rix >= 0).all() and (r.Six >= 0).all() and (r.Uix >= 0).all()
    assert (r.Fix >= 0).sum() == 2 * n * E
    assert (d.Six[:, np.triu_indices(n)[0], np.triu_indices(n)[1]] == -1).all()
    with pytest.raises(ValueError):
        build_published(inst, free_rows="tight")
    with pytest.raises(ValueError):
        build(inst, free_rows="nope")


@pytest.mark.parametrize("seed", range(6))
def test_paper_mode_reference_and_default_agree(seed):
    """Paper mode with several devices: the triangular model and the published full-matrix
    one have the same optimum (a device may only free what it holds)."""
    devices = ("a", "b")
    g = random_graph(seed, devices=devices)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    for frac in (1.0, 0.5, 0.0):
        inst = Instance(g, devices, tuple([int(low + frac * (peak - low))] * 2))
        a = solve_xengine(inst, formulation="paper", options=OPTS)
        b = solve_xengine(inst, formulation="paper", options=OPTS, builder=build_published)
        assert a.status == b.status
        if a.status == "optimal":
            assert a.objective_s == pytest.approx(b.objective_s, rel=1e-7)


# ----------------------------------------------------------------------------- symmetry
def _twins(seed: int):
    """Two interchangeable devices: ``a2`` is a copy of ``a``, the same link both ways."""
    from xengine.graph.types import CopyModel

    g = random_graph(seed, devices=("a",))
    cm = CopyModel(0.05, 1e6)
    return g.with_costs(
        {"a2": {v.name: v.cost_s["a"] for v in g.nodes}}, {("a", "a2"): cm, ("a2", "a"): cm}
    )


def test_twins_are_recognised():
    from experiments.formulation_variants import twin_of_first

    g = _twins(0)
    assert twin_of_first(Instance(g, ("a", "a2"), (10**6, 10**6)))
    assert not twin_of_first(Instance(g, ("a", "a2"), (10**6, 10**6 - 1)))  # other budget
    assert not twin_of_first(Instance(random_graph(0), ("a", "b"), (10**6, 10**6)))
    inst = Instance(g, ("a", "a2"), (10**6, 10**6))
    fixed = build_symmetry_broken(inst)
    r000 = fixed.Rix[0, 0, 0]
    assert fixed.model.lb[r000] == 1.0  # the first twin computes node 0 in stage 0
    assert build(inst).model.lb[r000] == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_breaking_the_symmetry_of_twins_keeps_the_optimum(seed):
    g = _twins(seed)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    for frac in (1.0, 0.4, 0.0):
        inst = Instance(g, ("a", "a2"), (int(low + frac * (peak - low)),) * 2)
        plain = solve_xengine(inst, options=OPTS)
        broken = solve_xengine(inst, options=OPTS, builder=build_symmetry_broken)
        assert plain.status == broken.status
        if plain.status == "optimal":
            assert broken.objective_s == pytest.approx(plain.objective_s, rel=1e-7)
            assert broken.schedule.R[0, 0, 0]  # the first device starts
            assert agree(broken)


def test_a_start_that_meets_the_placement_bound_ends_the_solve_at_once():
    """Memory to spare and one device faster at every op: keep-everything there is optimal,
    the placement bound proves it without a solve, and the full model agrees."""
    cm = copy_models(("a", "b"), latency_s=0.05, bandwidth=1e6)
    base = random_graph(2, devices=("a",), states=True)
    g = base.with_costs({"b": {v.name: 2.0 * v.cost_s["a"] + 0.1 for v in base.nodes}}, cm)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    start = keep_all_schedule(inst, device=0)
    res = solve_xengine(inst, warm_start=start, options=OPTS)
    assert res.status == "optimal" and res.nothing_to_solve and res.gap == 0.0
    assert res.n_vars is None  # no model was built
    cold = solve_xengine(inst, options=OPTS)
    assert cold.status == "optimal"
    assert cold.objective_s == pytest.approx(res.sim.time_s, rel=1e-9)
    # a start that is not optimal is solved as before
    slow = keep_all_schedule(inst, device=1)
    res2 = solve_xengine(inst, warm_start=slow, options=OPTS)
    assert not res2.nothing_to_solve and res2.objective_s == pytest.approx(
        cold.objective_s, rel=1e-9
    )


@pytest.mark.parametrize("formulation", ["exact", "paper"])
def test_a_node_larger_than_every_budget_is_infeasible_before_any_solve(formulation):
    """solve_xengine's blocked answer: the node named, the least budget that could fit it,
    and no solver run (no solve time, no trace)."""
    g = random_graph(1)
    inst = Instance(g, ("a", "b"), (10, 10))
    res = solve_xengine(inst, formulation=formulation, options=OPTS)
    assert res.status == "infeasible"
    assert "every budget must be at least" in res.message
    need = res.extra["min_budget_lower_bound_bytes"]
    assert need > 10 and f"at least {need} bytes" in res.message
    assert not res.trace and not res.solve_time_s
