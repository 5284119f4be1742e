"""The retention-interval model (xengine.strategies.intervals) against the MILP and the
simulator."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from _schedules import checkpoint_schedule, forward_devices
from helpers import copy_models, random_graph

from xengine.graph.synthetic import chain
from xengine.graph.types import Edge, Graph, Node
from xengine.problem import Instance
from xengine.schedule import Schedule, keep_all_schedule
from xengine.simulate import keep_all_peak_bytes, simulate
from xengine.solvers import SolverOptions, SolverUnavailable
from xengine.strategies.intervals import (
    _replay,
    event,
    interval_peaks,
    schedule_from,
    solution_of,
    solve_intervals,
)
from xengine.strategies.solve import agree, solve_xengine

REPO = Path(__file__).resolve().parents[1]
OPTS = SolverOptions(time_limit_s=60, rel_gap=1e-9, threads=2)


def _milp(inst: Instance):
    return solve_xengine(inst, "highs", options=OPTS)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("devices", [("a",), ("a", "b")])
@pytest.mark.parametrize("frac", [1.0, 0.7, 0.5])
def test_optimum_equals_the_milp_and_the_simulator(seed, devices, frac):
    g = random_graph(seed)
    budget = int(frac * keep_all_peak_bytes(g))
    inst = Instance(g, devices, (budget,) * len(devices))
    exact = _milp(inst)
    res = solve_intervals(inst, OPTS, max_computes=3)
    if exact.status == "infeasible":
        assert res.status in ("infeasible", "no_solution")
        return
    assert exact.status == "optimal"
    assert res.extra.get("restricted_optimal"), res.message
    assert res.objective_s == pytest.approx(exact.objective_s, rel=1e-7)
    # "optimal" only when a bound valid for the whole problem meets the schedule
    assert res.status == ("optimal" if res.gap <= OPTS.rel_gap else "feasible")
    assert res.best_bound_s <= exact.objective_s + 1e-9
    # objective and the model's memory (tight intervals) are the simulator's
    assert agree(res), (res.objective_s, res.sim.time_s, res.model_peak_bytes, res.sim.peak_bytes)
    assert res.sim.within_budget


def test_three_devices_equal_the_milp():
    g = random_graph(3, devices=("a", "b", "c"))
    budget = max(int(0.6 * keep_all_peak_bytes(g)), int(g.node_lower_bound_bytes().max()))
    inst = Instance(g, ("a", "b", "c"), (budget,) * 3)
    exact = _milp(inst)
    res = solve_intervals(inst, OPTS, max_computes=3)
    assert exact.status == "optimal" and res.extra.get("restricted_optimal")
    assert res.objective_s == pytest.approx(exact.objective_s, rel=1e-7)
    assert agree(res)


def test_chain_needs_enough_computations_per_node():
    """A 6-layer chain at 60 %: the MILP's optimum recomputes a node 5 times. With that many
    computations allowed the interval model finds the same optimum; with fewer it says it
    has no schedule and names the restriction instead of claiming infeasibility."""
    g = chain(6)
    inst = Instance.single(g, g.devices[0], int(0.6 * keep_all_peak_bytes(g)))
    exact = _milp(inst)
    assert exact.status == "optimal"
    most = int(exact.schedule.R.sum(axis=1).max())
    assert most == 5
    res = solve_intervals(inst, OPTS, max_computes=most)
    assert res.extra["restricted_optimal"]
    assert res.objective_s == pytest.approx(exact.objective_s, rel=1e-9)
    few = solve_intervals(inst, OPTS, max_computes=2)
    if few.sim is not None:
        assert few.objective_s >= exact.objective_s - 1e-9
    else:
        assert few.status == "no_solution"  # not "infeasible": the restriction may be why
        assert "at most 2 computations" in few.message
    # with a computation per later stage the model is the whole problem: its optimum and
    # its infeasibility are proofs
    full = solve_intervals(inst, OPTS, max_computes=g.size, lp_bound=False)
    assert full.status == "optimal" and not full.extra["restricted"]
    assert full.objective_s == pytest.approx(exact.objective_s, rel=1e-9)
    tight = Instance.single(g, g.devices[0], int(g.node_lower_bound_bytes().max()) - 1)
    assert solve_intervals(tight, OPTS, max_computes=g.size).status == "infeasible"


def test_a_restricted_optimum_is_not_called_optimal():
    """The solver benchmark's residual16 graph at 50 % on one device: with two computations
    per node the interval model's optimum (70.971 s) is above the MILP's (70.463 s, a node
    needs three). It comes back as feasible with the LP bound as its bound and the
    restriction named; with three computations it is the MILP's optimum."""
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import solver_benchmark
    finally:
        sys.path.remove(str(REPO / "experiments"))
    g = solver_benchmark.synthetic("residual", 16)
    inst = Instance.single(g, "a", dict(solver_benchmark.budgets_for(g))["50%"])
    exact = _milp(inst)
    assert exact.status == "optimal"
    two = solve_intervals(inst, OPTS, max_computes=2)
    assert two.extra["restricted_optimal"]
    assert two.objective_s > exact.objective_s + 0.1
    assert two.status == "feasible"
    assert "optimal within the interval model (at most 2 computations" in two.message
    assert two.best_bound_s <= exact.objective_s + 1e-9
    three = solve_intervals(inst, OPTS, max_computes=3)
    assert three.objective_s == pytest.approx(exact.objective_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_objective_is_the_simulators_at_every_incumbent(seed, monkeypatch):
    """Not only at the optimum: a solve stopped at its first solution returns a schedule whose
    model time and memory are the simulator's (copies are charged exactly when the simulator
    copies)."""
    from ortools.sat.python import cp_model

    orig = cp_model.CpSolver.solve

    def first_only(self, model, cb=None):
        self.parameters.stop_after_first_solution = True
        return orig(self, model, cb)

    monkeypatch.setattr(cp_model.CpSolver, "solve", first_only)
    g = random_graph(seed)
    budget = max(int(0.7 * keep_all_peak_bytes(g)), int(g.node_lower_bound_bytes().max()))
    inst = Instance(g, ("a", "b"), (budget, budget))
    res = solve_intervals(inst, OPTS, max_computes=3, lp_bound=False)
    assert res.sim is not None, res.message
    assert agree(res)


@pytest.mark.parametrize("seed", range(4))
def test_warm_start_is_taken_as_is(seed, monkeypatch):
    """The hint built from a valid schedule is a feasible point of the model with the same
    time: solving with every hinted variable fixed returns that schedule's time."""
    from ortools.sat.python import cp_model

    g = random_graph(seed)
    inst = Instance(g, ("a", "b"), (keep_all_peak_bytes(g),) * 2)
    start = keep_all_schedule(inst, device=1)
    orig = cp_model.CpSolver.solve

    def fixed(self, model, cb=None):
        self.parameters.fix_variables_to_their_hinted_value = True
        return orig(self, model, cb)

    monkeypatch.setattr(cp_model.CpSolver, "solve", fixed)
    res = solve_intervals(inst, OPTS, warm_start=start)
    assert res.extra.get("restricted_optimal"), res.message
    assert res.objective_s == pytest.approx(simulate(inst, start).time_s, rel=1e-9)
    assert (res.schedule.R == start.R).all()


def test_warm_start_may_need_more_computations_than_max_computes():
    """A start that recomputes a node three times raises that node's allowance."""
    g = chain(8)
    peak = keep_all_peak_bytes(g)
    inst = Instance.single(g, g.devices[0], int(0.5 * peak))
    exact = _milp(inst)
    assert exact.status == "optimal"
    counts = exact.schedule.R.sum(axis=1).max()
    res = solve_intervals(inst, OPTS, warm_start=exact.schedule, max_computes=1)
    assert res.sim is not None
    assert res.objective_s <= exact.objective_s + 1e-9
    if counts > 1:
        assert res.extra["max_computes"] == 1  # the option, not the raised allowance


def test_blocked_budget_is_infeasible_with_the_node_named():
    g = random_graph(1)
    inst = Instance(g, ("a", "b"), (10, 10))
    res = solve_intervals(inst, OPTS)
    assert res.status == "infeasible"
    assert "every budget must be at least" in res.message
    assert res.extra["min_budget_lower_bound_bytes"] > 10


def test_bad_arguments_are_one_line_errors():
    g = random_graph(1)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    with pytest.raises(ValueError, match="max_computes"):
        solve_intervals(inst, OPTS, max_computes=0)
    with pytest.raises(ValueError, match="placement"):
        solve_intervals(inst, OPTS, placement=np.zeros(3, dtype=int))
    with pytest.raises(SolverUnavailable, match="solver=cpsat"):
        solve_xengine(inst, "highs", formulation="intervals")
    with pytest.raises(ValueError, match="no option"):
        solve_xengine(inst, "cpsat", formulation="intervals", build_options={"free_rows": "tight"})
    with pytest.raises(ValueError, match="lp_bound"):
        solve_intervals(inst, OPTS, lp_bound="later")


def test_lp_bound_alongside_is_the_same_bound():
    # computed in a process of its own during the search, the bound is the one computed first
    g = random_graph(0)  # 0.7: 7 % between the LP bound and the optimum
    inst = Instance(g, ("a", "b"), (int(0.7 * keep_all_peak_bytes(g)),) * 2)
    first = solve_intervals(inst, OPTS, max_computes=3)
    along = solve_xengine(
        inst, "cpsat", formulation="intervals", options=OPTS,
        build_options={"max_computes": 3, "lp_bound": "alongside"},
    )  # fmt: skip
    assert first.lp_bound_s is not None
    assert along.lp_bound_s == pytest.approx(first.lp_bound_s, rel=1e-9)
    assert along.objective_s == pytest.approx(first.objective_s, rel=1e-7)
    assert along.best_bound_s == pytest.approx(first.best_bound_s, rel=1e-9)
    assert along.best_bound_s <= along.objective_s and agree(along)


def test_pinned_restores_the_cpus():
    from xengine.strategies.bounds import cpu_split, pinned

    before = os.sched_getaffinity(0)
    bound_cpus, search_cpus = cpu_split()
    assert bound_cpus <= before and search_cpus <= before
    if len(before) > 1:
        assert not bound_cpus & search_cpus and bound_cpus | search_cpus == before
    with pinned(search_cpus):
        assert os.sched_getaffinity(0) == search_cpus
    assert os.sched_getaffinity(0) == before


def test_placement_restricts_like_the_milp():
    g = random_graph(5)
    budget = int(0.8 * keep_all_peak_bytes(g))
    inst = Instance(g, ("a", "b"), (budget, budget))
    placement = np.array([i % 2 for i in range(g.size)])
    # a backward node must sit with its forward node (autograd state is not copyable)
    for e in g.edges:
        if not e.copyable:
            placement[e.dst] = placement[e.src]
    exact = solve_xengine(inst, "highs", options=OPTS, placement=placement)
    res = solve_xengine(inst, "cpsat", formulation="intervals", options=OPTS, placement=placement)
    assert exact.status in ("optimal", "infeasible")
    if exact.status == "optimal":
        assert res.extra["restricted_optimal"]
        assert res.objective_s == pytest.approx(exact.objective_s, rel=1e-7)
        R = res.schedule.R
        for v in range(g.size):
            assert not np.delete(R[:, :, v], placement[v], axis=0).any()


def test_interval_peaks_are_the_simulators():
    """The event-axis memory of hand-made intervals equals the simulator's on their schedule."""
    g = chain(3)
    inst = Instance.single(g, g.devices[0], None)
    sched = keep_all_schedule(inst)
    sim = simulate(inst, sched)
    # keep-all: each node computed once at its own stage and read last by some later node
    sol = solution_of(inst, sched)
    assert (schedule_from(inst, sol).R == sched.R).all()
    assert (schedule_from(inst, sol).S == sched.S).all()
    assert interval_peaks(inst, sol).tolist() == sim.peak_bytes.tolist()


# ---------------------------------------------------------------------- autograd states


def state_graph(g: Graph, seed: int) -> Graph:
    """``g`` with autograd states, as captured graphs have them: each version-1 edge
    ``F_v -> B_v`` becomes a state link (0, 500 or 1000 bytes), and ``B_v`` reads ``F_v``'s
    value only on about half the nodes (ReLU reads its output, BatchNorm does not). Some
    nodes get a workspace that is larger on the last device."""
    r = np.random.default_rng(100 + seed)
    nodes = list(g.nodes)
    edges = []
    for e in g.edges:
        if e.copyable:
            edges.append(e)
            continue
        nodes[e.src] = replace(nodes[e.src], state_bytes=500 * int(r.integers(0, 3)))
        edges.append(Edge(e.src, e.dst, False, "state"))
        if r.random() < 0.5:
            edges.append(Edge(e.src, e.dst))
    for i, v in enumerate(nodes):
        if r.random() < 0.3:
            nodes[i] = replace(v, workspace_bytes=500, device_workspace_bytes={g.devices[-1]: 1500})
    return replace(g, name=g.name + "_states", nodes=tuple(nodes), edges=tuple(edges))


def state_chain(seed: int, devices=("a",)) -> Graph:
    """A 5-layer chain with states and random forward costs: its optimum recomputes."""
    g = chain(5, devices=devices)
    r = np.random.default_rng(seed)
    nodes = tuple(
        replace(v, cost_s={d: float(r.uniform(0.5, 2.0)) for d in devices})
        if v.kind == "fwd"
        else v
        for v in g.nodes
    )
    return state_graph(replace(g, nodes=nodes, copy_models=copy_models(devices)), seed)


def _between(g: Graph, devices, frac: float) -> int:
    """A budget ``frac`` of the way from the least any schedule may need to keep-all's peak."""
    least = int(np.stack([g.node_lower_bound_bytes(d) for d in devices]).min(axis=0).max())
    return int(least + frac * (keep_all_peak_bytes(g) - least))


def _unread_states(inst: Instance, sched: Schedule) -> int:
    """How many computations of the schedule make a state that ``B_v`` never reads."""
    rep = _replay(inst, sched)
    src = inst.graph.state_source
    read = {(d, int(src[b]), j) for (d, b, _s), j in rep.state_reads.items()}
    return sum(
        (d, v, j) not in read
        for (d, v), lst in rep.comps.items()
        if inst.graph.state_reader[v] >= 0
        for j in range(len(lst))
    )


def test_state_graphs_are_well_formed():
    g = state_graph(random_graph(3), 3)
    assert (
        g.has_states and g.state_bytes.any() and (g.state_bytes[list(g.forward_indices)] == 0).any()
    )
    assert not any(not e.copyable for e in g.value_edges)


@pytest.mark.parametrize("seed", [1, 3, 6, 7])
@pytest.mark.parametrize("devices", [("a",), ("a", "b")])
@pytest.mark.parametrize("frac", [0.5, 0.0])
def test_states_optimum_equals_the_milp_and_the_simulator(seed, devices, frac):
    """With autograd states (states of 0 bytes included, per-device workspace) the model's
    optimum is the MILP's, and its time and memory are the simulator's."""
    g = state_graph(random_graph(seed), seed)
    inst = Instance(g, devices, (_between(g, devices, frac),) * len(devices))
    exact = _milp(inst)
    res = solve_intervals(inst, OPTS, max_computes=3)
    if exact.status == "infeasible":
        assert res.status in ("infeasible", "no_solution")
        return
    assert exact.status == "optimal"
    assert res.extra.get("restricted_optimal"), res.message
    assert res.objective_s == pytest.approx(exact.objective_s, rel=1e-7)
    assert res.best_bound_s <= exact.objective_s + 1e-9
    assert agree(res), (res.objective_s, res.sim.time_s, res.model_peak_bytes, res.sim.peak_bytes)
    assert res.sim.within_budget
    assert res.schedule.S_state is not None


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("frac", [0.25, 0.0])
def test_states_unrestricted_model_is_the_whole_problem(seed, frac):
    """One device and a computation per stage: the model's optimum (which recomputes forward
    ops and drops some of their states unread) is the MILP's and is proven, and so is its
    infeasibility where the MILP has none."""
    g = state_chain(seed)
    inst = Instance.single(g, "a", _between(g, ("a",), frac))
    exact = _milp(inst)
    res = solve_intervals(inst, OPTS, max_computes=g.size, lp_bound=False)
    assert not res.extra["restricted"]
    if exact.status == "infeasible":
        assert res.status == "infeasible"
        return
    assert exact.status == "optimal" and res.status == "optimal"
    assert res.objective_s == pytest.approx(exact.objective_s, rel=1e-9)
    assert agree(res) and res.sim.n_recomputes > 0
    if frac:
        assert _unread_states(inst, res.schedule) > 0


@pytest.mark.parametrize("seed", range(4))
def test_states_interval_peaks_are_the_simulators(seed):
    """Hand-made schedules with states (keep-all; checkpointing with recomputation, on one
    device and spread over two with copies) as intervals: the schedule comes back (R, S and
    the state residency) and the event-axis memory is the simulator's."""
    g = state_graph(random_graph(seed), seed)
    one = Instance.single(g, "a", None)
    two = Instance(g, ("a", "b"), (10**12, 10**12))
    spread = forward_devices(two, [i % 2 for i in range(g.size)], loss_device=1)
    cases = [
        (one, keep_all_schedule(one)),
        (one, checkpoint_schedule(one, keep=set())),
        (two, checkpoint_schedule(two, keep={0}, device_of=spread)),
    ]
    for inst, sched in cases:
        sol = solution_of(inst, sched)
        back = schedule_from(inst, sol)
        assert (back.R == sched.R).all() and (back.S == sched.S).all()
        assert (back.S_state == sched.states_for(g)).all()
        assert interval_peaks(inst, sol).tolist() == simulate(inst, sched).peak_bytes.tolist()


def _cut_instance() -> tuple[Instance, Schedule]:
    """Two devices; in the last stage f1 is recomputed on b (its state unread) while b1 is
    recomputed on a from the state kept there. The simulator frees f1's state on b after
    b1's step, before b0 runs on b with its large output: b's peak needs that early end."""
    devs = ("a", "b")
    c = {d: 1.0 for d in devs}
    nodes = (
        Node("f0", "fwd", 1000, c, state_bytes=500),
        Node("f1", "fwd", 1000, c, state_bytes=2000),
        Node("loss", "loss", 1000, c),
        Node("b1", "bwd", 1000, c, fwd_index=1),
        Node("b0", "bwd", 3000, c, fwd_index=0),
    )
    value = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 3)]
    edges = tuple(Edge(u, v) for u, v in value)
    edges += (Edge(1, 3, False, "state"), Edge(0, 4, False, "state"))
    g = Graph("cut", nodes, edges, copy_models=copy_models(devs))
    R = np.zeros((2, 5, 5), dtype=bool)
    S = np.zeros((2, 5, 5), dtype=bool)
    for d, t, v in [(1, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 4, 4), (1, 4, 1), (0, 4, 3)]:
        R[d, t, v] = True
    S[1, 1:5, 0] = S[0, 2, 1] = S[0, 3:5, 2] = True
    sched = Schedule(devs, R, S)
    peaks = simulate(Instance(g, devs, (10**9,) * 2), sched).peak_bytes
    return Instance(g, devs, tuple(int(p) for p in peaks)), sched


def test_an_unread_state_ends_after_its_backward_op_on_another_device(monkeypatch):
    """The simulator's early free of an unread state is the model's: the intervals of the
    hand-made schedule have b's peak, the state ending at b1's step; held until the end of
    the stage it would not fit. The model takes the schedule as a hint at exactly those
    budgets and returns its time."""
    from ortools.sat.python import cp_model

    inst, sched = _cut_instance()
    sim = simulate(inst, sched)
    sol = solution_of(inst, sched)
    assert (1, 1, event(4, 1, 5), event(4, 3, 5)) in sol.states
    assert interval_peaks(inst, sol).tolist() == sim.peak_bytes.tolist()
    late = [(d, v, s, event(4, 4, 5) if (d, v) == (1, 1) else e) for d, v, s, e in sol.states]
    assert interval_peaks(inst, replace(sol, states=late))[1] > inst.budgets[1]

    orig = cp_model.CpSolver.solve

    def fixed(self, model, cb=None):
        self.parameters.fix_variables_to_their_hinted_value = True
        return orig(self, model, cb)

    monkeypatch.setattr(cp_model.CpSolver, "solve", fixed)
    res = solve_intervals(inst, OPTS, warm_start=sched, lp_bound=False)
    assert res.sim is not None, res.message
    assert res.objective_s == pytest.approx(sim.time_s, rel=1e-9)
    assert (res.schedule.R == sched.R).all() and agree(res)


@pytest.mark.parametrize("seed", range(3))
def test_states_warm_start_is_taken_as_is(seed, monkeypatch):
    """A schedule that recomputes and drops states unread, hinted at a budget equal to its
    own peak: the model takes it with every hinted variable fixed."""
    from ortools.sat.python import cp_model

    g = state_chain(seed, devices=("a", "b"))
    inst = Instance(g, ("a", "b"), (10**12, 10**12))
    spread = forward_devices(inst, [0, 0, 1, 1, 1] + [0] * (g.size - 5))
    start = checkpoint_schedule(inst, keep={0}, device_of=spread)
    peaks = simulate(inst, start).peak_bytes
    inst = inst.with_budgets(tuple(int(p) for p in peaks))
    assert _unread_states(inst, start) > 0
    orig = cp_model.CpSolver.solve

    def fixed(self, model, cb=None):
        self.parameters.fix_variables_to_their_hinted_value = True
        return orig(self, model, cb)

    monkeypatch.setattr(cp_model.CpSolver, "solve", fixed)
    res = solve_intervals(inst, OPTS, warm_start=start, max_computes=1, lp_bound=False)
    assert res.sim is not None, res.message
    assert res.objective_s == pytest.approx(simulate(inst, start).time_s, rel=1e-9)
    assert (res.schedule.R == start.R).all() and agree(res)


@pytest.mark.parametrize("seed", range(2))
def test_states_objective_is_the_simulators_at_the_first_incumbent(seed, monkeypatch):
    from ortools.sat.python import cp_model

    orig = cp_model.CpSolver.solve

    def first_only(self, model, cb=None):
        self.parameters.stop_after_first_solution = True
        return orig(self, model, cb)

    monkeypatch.setattr(cp_model.CpSolver, "solve", first_only)
    g = state_graph(random_graph(seed), seed)
    inst = Instance(g, ("a", "b"), (_between(g, ("a", "b"), 0.3),) * 2)
    res = solve_intervals(inst, OPTS, max_computes=3, lp_bound=False)
    assert res.sim is not None, res.message
    assert agree(res)
