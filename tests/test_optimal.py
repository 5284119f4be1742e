"""What ``optimal`` means with several devices (docs/design.md section 6, "every schedule the
simulator accepts").

The exact model has no row that forbids computing a node on several devices in one stage
(the simulator accepts it, and it can be the fastest way to serve readers on two devices), so
its optimum is over the simulator's whole problem. Two checks hold it to that:

* **completeness**: every schedule the simulator accepts, made at random with recomputations
  and duplicate computations on 1-3 devices, is a feasible point of the model (all rows
  within 1e-6) whose objective is the simulated time and whose memory is the simulated peak,
  so no schedule is outside the model or priced differently (incumbents included);
* **search**: on small two-device instances at a tight budget, random schedules and random
  walks from the optimum that fit (duplicates allowed) are never faster than the model's
  proven optimum; and where computing a cheap node again on the other device beats copying
  its large output, the optimum does so.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import copy_models, random_graph
from xengine.graph.types import Edge, Graph, Node
from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, keep_all_peak_bytes, simulate
from xengine.solvers import SolverOptions, solve
from xengine.strategies.formulation import build

DEVICES = {1: ("a",), 2: ("a", "b"), 3: ("a", "b", "c")}


class _Draw:
    """One random schedule in the making: R, S and state residency A of shape (D, n, n)."""

    def __init__(self, g: Graph, D: int, rng: np.random.Generator) -> None:
        n = g.size
        self.g, self.D, self.rng = g, D, rng
        self.R = np.zeros((D, n, n), dtype=bool)
        self.S = np.zeros((D, n, n), dtype=bool)
        self.A = np.zeros((D, n, n), dtype=bool)

    def keep(self, t: int, p_keep: float) -> None:
        """Keep at random into stage t what was on each device during stage t - 1."""
        R, S, A, rng = self.R, self.S, self.A, self.rng
        for d in range(self.D):
            was = R[d, t - 1, :t] | S[d, t - 1, :t]
            S[d, t, :t] = was & (rng.random(t) < p_keep)
            had = (R[d, t - 1, :t] | A[d, t - 1, :t]) & (self.g.state_reader[:t] >= t)
            A[d, t, :t] = had & (rng.random(t) < p_keep)

    def present(self, t: int, u: int, d: int) -> bool:
        return bool(self.S[d, t, u] or self.R[d, t, u])

    def compute(self, t: int, v: int, d: int) -> None:
        """Compute v on d in stage t, and first every input that is not where it must be."""
        R, S, A, D = self.R, self.S, self.A, self.D
        if R[d, t, v]:
            return
        # computing v on d makes its value and state anew: what was kept of them on d is
        # dropped instead (every reader comes after v in the stage)
        S[d, t, v] = A[d, t, v] = False
        for e in self.g.in_edges[v]:
            u = e.src
            if e.copyable:
                if not any(self.present(t, u, a) for a in range(D)):
                    self.compute(t, u, int(self.rng.integers(D)))
            elif not self.present(t, u, d):
                self.compute(t, u, d)
        u = int(self.g.state_source[v])
        if u >= 0 and not (A[d, t, u] or R[d, t, u]):
            self.compute(t, u, d)
        R[d, t, v] = True

    def repair(self, t: int) -> None:
        """Make stage t valid again after a change: residency only of what was there in
        stage t - 1, then every computation with its inputs where they must be."""
        R, S, A = self.R, self.S, self.A
        if t > 0:
            S[:, t, :t] &= R[:, t - 1, :t] | S[:, t - 1, :t]
            A[:, t, :t] &= R[:, t - 1, :t] | A[:, t - 1, :t]
        for v in range(t + 1):
            for d in range(self.D):
                if R[d, t, v]:
                    R[d, t, v] = False
                    self.compute(t, v, d)


def mutate(g: Graph, sched: Schedule, rng: np.random.Generator) -> Schedule:
    """A neighbour of ``sched``: in a random stage, one more computation of a random node on a
    random device (a recomputation or a duplicate), or a value or state no longer kept; the
    stages from there on repaired."""
    D = len(sched.devices)
    draw = _Draw(g, D, rng)
    draw.R, draw.S = sched.R.copy(), sched.S.copy()
    draw.A = sched.states_for(g).copy()
    t = int(rng.integers(g.size))
    i, d = int(rng.integers(t + 1)), int(rng.integers(D))
    move = rng.integers(3)
    if move == 0 and not draw.present(t, i, d):
        draw.compute(t, i, d)
    elif move == 1:
        draw.S[d, t, i] = False
    else:
        draw.A[d, t, i] = False
    for k in range(t, g.size):
        draw.repair(k)
    states = draw.A if g.has_states else None
    return Schedule(sched.devices, draw.R, draw.S, states)


def random_schedule(g: Graph, D: int, rng: np.random.Generator, p_keep=0.5, p_extra=0.15):
    """A schedule the simulator accepts, drawn at random: residency kept at random, the
    frontier on a random device (one that kept its state, if any did), extra computations
    (recomputations, and duplicates on other devices) at random, every missing input
    computed on demand."""
    draw = _Draw(g, D, rng)
    for t in range(g.size):
        if t > 0:
            draw.keep(t, p_keep)
        u = int(g.state_source[t])
        holders = [d for d in range(D) if u >= 0 and draw.A[d, t, u]]
        draw.compute(t, t, int(rng.choice(holders)) if holders else int(rng.integers(D)))
        for i in range(t + 1):
            for d in range(D):
                if rng.random() < p_extra and not draw.present(t, i, d):
                    draw.compute(t, i, d)
    states = draw.A if g.has_states else None
    return Schedule(tuple(f"d{k}" for k in range(D)), draw.R, draw.S, states)


def _instance(g: Graph, devices, fraction: float | None = None) -> Instance:
    peak = max(keep_all_peak_bytes(g, d) for d in devices)
    floor = max(int(g.node_lower_bound_bytes(d).max()) for d in devices)  # some op must fit
    budget = 10 * peak if fraction is None else max(int(fraction * peak), floor)
    return Instance(g, devices, [budget] * len(devices))


def _simulate(inst: Instance, sched: Schedule):
    sched = Schedule(inst.devices, sched.R, sched.S, sched.S_state)
    try:
        return sched, simulate(inst, sched, check_budget=False)
    except ScheduleError:
        return sched, None


@pytest.mark.parametrize("free_rows", ["tight", "hazard"])
@pytest.mark.parametrize("D", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_every_simulated_schedule_is_a_model_point_at_its_simulated_time(seed, D, free_rows):
    """Item 5 of issue 27: at every integer point, the model's objective is the simulator's
    time and its memory the simulator's peak, for 1-3 devices."""
    g = random_graph(seed, devices=DEVICES[D], states=True, latency_s=0.3)
    inst = _instance(g, DEVICES[D])
    form = build(inst, "exact", free_rows=free_rows)
    rng = np.random.default_rng(100 + seed)
    checked = dup = 0
    for _ in range(300):
        sched, sim = _simulate(inst, random_schedule(g, D, rng))
        if sim is None:
            continue
        x = form.assignment(sched)
        assert form.model.max_violation(x) <= 1e-6, (seed, D, form.model.max_violation(x))
        assert form.objective_s(x) == pytest.approx(sim.time_s, rel=1e-9, abs=1e-12)
        np.testing.assert_allclose(form.peak_bytes(x), sim.peak_bytes, rtol=1e-9, atol=1e-6)
        checked += 1
        dup += int((sched.R.sum(axis=0) > 1).any())
    assert checked >= 100, checked
    if D > 1:
        assert dup >= 20, dup  # duplicate computations in one stage were among them


def _optimum(inst: Instance):
    form = build(inst, "exact", free_rows="tight")
    sol = solve(form.model, "highs", SolverOptions(time_limit_s=120, rel_gap=1e-9))
    assert sol.status == "optimal"
    sched = form.schedule_from(sol.x)
    sim = simulate(inst, sched)
    assert sim.time_s == pytest.approx(form.objective_s(sol.x), rel=1e-7)
    return sched, sim


@pytest.mark.parametrize("seed", range(6))
def test_no_schedule_found_by_search_beats_the_two_device_optimum(seed):
    """Item 4 of issue 27: a search over every kind of schedule the simulator accepts
    (duplicates included) at a tight budget finds nothing faster than the model's optimum:
    random schedules, and random walks from the optimum through neighbours that fit
    (:func:`mutate`), each judged by the simulator."""
    g = random_graph(seed, devices=DEVICES[2], states=bool(seed % 2), latency_s=0.3)
    inst = _instance(g, DEVICES[2], fraction=0.7)
    opt, best = _optimum(inst)
    rng = np.random.default_rng(seed)
    fitting = dup = 0
    here = opt
    for k in range(1500):
        if k % 2:
            cand = random_schedule(g, 2, rng, p_keep=float(rng.uniform(0.2, 0.9)))
        else:
            cand = mutate(g, here, rng)
        cand, sim = _simulate(inst, cand)
        if sim is None or not sim.within_budget:
            continue
        fitting += 1
        dup += int((cand.R.sum(axis=0) > 1).any())
        assert sim.time_s >= best.time_s - 1e-9, (seed, sim.time_s, best.time_s)
        if k % 2 == 0:
            here = cand if rng.random() < 0.8 else opt  # walk on, now and then from the start
    assert fitting >= 200 and dup >= 20, (fitting, dup)


def _fan_out_graph() -> Graph:
    """x -> y (cheap anywhere, 10 MB) -> p (fast on a only) and q (fast on b only). Copying
    y costs 1 s; computing it again on the other device costs 0.01 s plus copying x (1 KB)."""
    cost = {
        "x": {"a": 0.1, "b": 0.1},
        "y": {"a": 0.01, "b": 0.01},
        "p": {"a": 0.1, "b": 5.0},
        "q": {"a": 5.0, "b": 0.1},
    }
    size = {"x": 1000, "y": 10_000_000, "p": 1000, "q": 1000}
    nodes = tuple(Node(k, "fwd", size[k], cost[k]) for k in ("x", "y", "p", "q"))
    edges = (Edge(0, 1), Edge(1, 2), Edge(1, 3))
    return Graph("fan_out", nodes, edges, copy_models=copy_models(("a", "b"), 0.0, bandwidth=1e7))


def test_computing_a_node_on_both_devices_beats_copying_it():
    inst = _instance(_fan_out_graph(), ("a", "b"))
    sched, sim = _optimum(inst)
    assert sched.R[:, :, 1].sum() == 2 and sched.R[:, :, 1].any(axis=1).all()  # y on a and b
    assert sim.n_copies == 1 and sim.copy_time_s == pytest.approx(1e-4)  # only x moves
    assert sim.time_s == pytest.approx(0.1 + 0.02 + 0.1 + 0.1 + 1e-4)
    # without the duplicate the best is a copy of y (1 s) or running p or q on the slow device
    assert sim.time_s < 0.1 + 0.01 + 0.1 + 0.1 + 1.0


@pytest.mark.parametrize("D", [1, 2])
def test_a_captured_graphs_schedules_are_model_points_with_the_losss_release(D):
    """The same on a captured net, whose loss lets go of the logits only where the schedule
    allows (``Graph.released_logits``): the model charges the logits' bytes exactly where the
    simulator does, including schedules that keep the logits past the loss."""
    from tests.helpers import copy_models
    from xengine.profile.workspace import capture_net

    g0 = capture_net("tiny", 2, image_size=32, num_classes=500).graph
    devs = DEVICES[D]
    r = np.random.default_rng(D)
    g = g0.with_costs(
        {d: {v.name: float(r.uniform(0.5, 2.0)) for v in g0.nodes} for d in devs},
        copy_models(devs, 0.3, bandwidth=1e9),
    )
    assert g.released_logits is not None
    inst = _instance(g, devs)
    form = build(inst, "exact", free_rows="tight")
    rng = np.random.default_rng(7)
    kept = 0
    for _ in range(150):
        sched, sim = _simulate(inst, random_schedule(g, D, rng, p_keep=0.6))
        if sim is None:
            continue
        x = form.assignment(sched)
        assert form.model.max_violation(x) <= 1e-6
        assert form.objective_s(x) == pytest.approx(sim.time_s, rel=1e-9)
        np.testing.assert_allclose(form.peak_bytes(x), sim.peak_bytes, rtol=1e-9, atol=1e-6)
        kept += int(not all(sim.loss_releases))
    assert kept >= 10  # schedules that keep the logits past the loss were among them
