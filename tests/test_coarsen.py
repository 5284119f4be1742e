"""Coarsening (issue 5): which nodes fuse, and that a coarse schedule expands to a valid fine
one that is never better than the fine optimum and never above the coarse memory."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests._schedules import checkpoint_schedule
from tests.helpers import copy_models
from xengine.graph.synthetic import chain, training_graph
from xengine.graph.types import CopyModel, Graph
from xengine.problem import Instance
from xengine.schedule import Schedule, keep_all_schedule
from xengine.simulate import keep_all_peak_bytes, simulate
from xengine.solvers import SolverOptions
from xengine.strategies.coarsen import coarsen, group_ranges, solve_coarse
from xengine.strategies.solve import solve_xengine

OPTS = SolverOptions(time_limit_s=20, rel_gap=1e-9)
REPO = Path(__file__).resolve().parents[1]

# conv, bn, relu, maxpool, then a residual block: conv bn relu conv bn, add(maxpool, bn), relu
BLOCK = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9), (3, 9), (9, 10)]


def synthetic(kind: str, n_layers: int, seed: int = 0) -> Graph:
    """experiments/solver_benchmark.py's synthetic graphs (devices a, b; 50 ms + 1 MB/s links)."""
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import solver_benchmark
    finally:
        sys.path.remove(str(REPO / "experiments"))
    return solver_benchmark.synthetic(kind, n_layers, seed)


def block_graph() -> Graph:
    r = np.random.default_rng(3)
    return training_graph(
        "block",
        BLOCK,
        11,
        list(r.integers(1, 5, 11) * 1000),
        {d: list(np.round(r.uniform(0.5, 2.0, 11), 3)) for d in "ab"},
        copy_models=copy_models("ab", latency_s=0.05, bandwidth=1e6),
    )


def _names(c, k):
    return [c.fine.nodes[i].name for i in c.groups[k]]


# ----------------------------------------------------------------------------- grouping
def test_chain_groups_and_coarse_edges():
    g = chain(4)  # f0..f3, loss, b3 b2 b1 b0
    c = coarsen(g, max_group=3)
    assert c.groups == ((0, 1, 2), (3,), (4,), (5, 6, 7), (8,))
    assert [v.name for v in c.graph.nodes] == ["f0+f1+f2", "f3", "loss", "b3+b2+b1", "b0"]
    assert [v.kind for v in c.graph.nodes] == ["fwd", "fwd", "loss", "bwd", "bwd"]
    assert c.group_of.tolist() == [0, 0, 0, 1, 2, 3, 3, 3, 4]
    # b3+b2+b1 reads f1 and f2 (autograd state: not copyable) and f0 (b1's input: copyable)
    assert {(e.src, e.dst): e.copyable for e in c.graph.edges} == {
        (0, 1): True,
        (0, 3): False,
        (0, 4): False,
        (1, 2): True,
        (1, 3): False,
        (2, 3): True,
        (3, 4): True,
    }
    assert all(e.src < e.dst for e in c.graph.edges)
    assert list(c.graph.edges) == sorted(c.graph.edges, key=lambda e: (e.src, e.dst))
    # fwd_index: the coarse node holding the first member's forward op (b3 -> f3, b0 -> f0)
    assert [v.fwd_index for v in c.graph.nodes] == [None, None, None, 1, 0]
    assert coarsen(g, max_group=2).groups == ((0, 1), (2, 3), (4,), (5, 6), (7, 8))


def test_chain_costs_and_memory():
    g = chain(4, bytes_per_layer=1000, cost_s=1.0, devices=("a", "b"))
    c = coarsen(g, max_group=3)
    f, b = c.graph.nodes[0], c.graph.nodes[3]
    assert f.cost_s == {"a": 3.0, "b": 3.0}
    assert b.cost_s == {"a": 6.0, "b": 6.0}
    # every forward member is read by a backward op: all three are the group's output
    assert (f.output_bytes, f.workspace_bytes) == (3000, 0)
    # b3 and b2 are read inside the group only: the output is b1, but b2 and b1 (or b3 and
    # b2) are alive together while the group runs
    assert (b.output_bytes, b.workspace_bytes) == (1000, 1000)
    assert c.graph.copy_models == g.copy_models and c.graph.fixed_bytes == g.fixed_bytes
    assert c.graph.meta["coarsened_from"] == g.name


def test_residual_block_groups():
    c = coarsen(block_graph(), max_group=3)
    got = [_names(c, k) for k in range(c.graph.size)]
    assert got == [
        ["f0", "f1", "f2"],  # conv bn relu
        ["f3"],  # maxpool: read by the block and by the add
        ["f4", "f5", "f6"],
        ["f7", "f8"],  # the add has two forward inputs: it starts a group
        ["f9", "f10"],
        ["loss"],
        ["b10", "b9"],
        ["b8", "b7", "b6"],  # b9's gradient goes to b8 and b3: b8 starts a group
        ["b5", "b4"],
        ["b3", "b2", "b1"],  # b3 reads b4 and b9
        ["b0"],
    ]


@pytest.mark.skipif(
    not (REPO / "results/profiles/resnet18-b8-cpu+cuda.graph.json").exists(),
    reason="the shipped resnet18 profile is not in this checkout",
)
def test_torchvision_conv_bn_relu_fuse():
    from xengine.graph.io import load_graph

    g = load_graph(REPO / "results/profiles/resnet18-b8-cpu+cuda.graph.json")
    c = coarsen(g, max_group=3)
    names = [v.name for v in c.graph.nodes]
    assert names[:3] == [
        "conv1+bn1+relu",
        "maxpool",
        "layer1_0_conv1+layer1_0_bn1+layer1_0_relu",
    ]
    assert "grad_layer1_0_bn1+grad_layer1_0_conv1" in names
    assert c.graph.size < 0.5 * g.size
    inst = Instance(g, ("cpu", "cuda"), (10**12, 10**12))
    ci = c.instance(inst)
    coarse = simulate(ci, keep_all_schedule(ci))
    fine = simulate(inst, c.expand(keep_all_schedule(ci)))
    assert fine.compute_time_s == pytest.approx(coarse.compute_time_s)
    assert fine.peak_bytes[0] == keep_all_peak_bytes(g) <= coarse.peak_bytes[0]


def test_max_group_one_is_the_same_graph():
    for g in (chain(5), block_graph(), synthetic("residual", 6)):
        c = coarsen(g, max_group=1)
        assert c.groups == tuple((i,) for i in range(g.size))
        assert c.graph.nodes == g.nodes
        assert c.graph.edges == g.edges
        assert keep_all_peak_bytes(c.graph) == keep_all_peak_bytes(g)
        inst = Instance(g, ("a",) if "a" in g.devices else ("cpu",), (10**9,))
        for sched in (keep_all_schedule(inst), checkpoint_schedule(inst, keep=set())):
            out = c.expand(sched)
            assert np.array_equal(out.R, sched.R) and np.array_equal(out.S, sched.S)
    with pytest.raises(ValueError, match="max_group"):
        group_ranges(chain(2), max_group=0)


# ----------------------------------------------------------------------------- expansion
@pytest.mark.parametrize("max_group", [2, 3, 4])
@pytest.mark.parametrize(
    "make",
    [lambda: chain(6), block_graph, lambda: synthetic("chain", 8), lambda: _stateful_chain(6)],
)
def test_keep_all_expands_to_fine_keep_all(make, max_group):
    g = make()
    c = coarsen(g, max_group)
    inst = Instance(g, g.devices[:1], (10**9,))
    ci = c.instance(inst)
    coarse_sched = keep_all_schedule(ci)
    coarse = simulate(ci, coarse_sched)
    fine_sched = c.expand(coarse_sched)
    fine = simulate(inst, fine_sched)
    assert fine.compute_time_s == pytest.approx(coarse.compute_time_s)
    assert fine.n_recomputes == 0
    assert fine.peak_bytes[0] <= coarse.peak_bytes[0]
    # kept whole and kept until the group's last reader, the fine tensors that matter are
    # exactly those the fine keep-all schedule keeps
    ref = keep_all_schedule(inst)
    assert np.array_equal(fine_sched.R, ref.R) and np.array_equal(fine_sched.S, ref.S)


def test_recomputing_checkpoint_schedule_expands_within_coarse_memory():
    g = synthetic("chain", 10)
    c = coarsen(g, 3)
    inst = Instance(g, ("a", "b"), (10**9, 10**9))
    ci = c.instance(inst)
    sched = checkpoint_schedule(ci, keep={0}, device_of=[1] * c.graph.size)
    coarse = simulate(ci, sched)
    assert coarse.n_recomputes > 0
    fine = simulate(inst, c.expand(sched))
    assert fine.n_recomputes > 0
    assert fine.compute_time_s <= coarse.compute_time_s + 1e-9
    assert np.all(fine.peak_bytes <= coarse.peak_bytes)
    assert fine.peak_bytes[0] == 0  # nothing on device a


def test_group_recomputed_in_vain_is_not_expanded():
    """A coarse schedule may recompute a group nobody reads (a solver may, for a node that
    costs nothing); the fine schedule must not, or the unread output would stay to the end of
    the stage in the simulator, above the coarse memory."""
    g = chain(4)  # coarse: (f0 f1 f2) (f3) (loss) (b3 b2 b1) (b0)
    c = coarsen(g, 3)
    inst = Instance(g, ("cpu",), (10**9,))
    ci = c.instance(inst)
    ka = keep_all_schedule(ci)
    R, S = ka.R.copy(), ka.S
    R[0, 4, 1] = True  # recompute f3 (from the resident f0 f1 f2) beside b0: valid, in vain
    coarse = simulate(ci, Schedule(ci.devices, R, S))
    assert coarse.n_recomputes == 1
    fine = simulate(inst, c.expand(Schedule(ci.devices, R, S)))
    assert fine.n_recomputes == 0
    assert fine.compute_time_s < coarse.compute_time_s
    assert fine.peak_bytes[0] <= coarse.peak_bytes[0]


def test_unread_members_of_a_kept_group_are_dropped():
    """Regression: a coarse optimum (HiGHS, two devices, tightest budget) that keeps group
    (f3 f4 f5) into the last stage only to recompute the (free) loss from f5, and recomputes
    the loss for nobody. Keeping f3 and f4 as well, as the group is kept, put device a 2 kB
    over its budget in the fine simulator: unread residents stay to the end of the stage."""
    g = training_graph(
        "r24",
        [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 3)],
        6,
        [2000, 4000, 3000, 4000, 3000, 1000],
        {
            "a": [1.216, 1.225, 1.773, 0.356, 1.536, 1.677],
            "b": [1.482, 0.938, 1.897, 0.256, 1.645, 1.284],
        },
        saves_input=False,
        copy_models=copy_models("ab", latency_s=0.05, bandwidth=1e6),
    )
    c = coarsen(g, 3)
    assert c.groups == ((0,), (1, 2), (3, 4, 5), (6,), (7, 8, 9), (10, 11), (12,))
    budget = 18000
    inst = Instance(g, ("a", "b"), (budget, budget))
    ci = c.instance(inst)
    # (stage, device): (recomputed, resident) coarse nodes
    table = {
        (0, 0): ([0], []),
        (1, 0): ([], [0]),
        (1, 1): ([1], []),
        (2, 0): ([2], [0]),
        (2, 1): ([], [1]),
        (3, 0): ([3], [0, 2]),
        (3, 1): ([], [1]),
        (4, 0): ([3, 4], [0, 2]),
        (4, 1): ([], [1]),
        (5, 0): ([], [0, 2, 3, 4]),
        (5, 1): ([5], [1]),
        (6, 0): ([3, 6], [0, 2, 4]),
        (6, 1): ([], [5]),
    }
    N = c.graph.size
    R = np.zeros((2, N, N), dtype=bool)
    S = np.zeros((2, N, N), dtype=bool)
    for (t, d), (rs, ss) in table.items():
        R[d, t, rs] = True
        S[d, t, ss] = True
    sched = Schedule(ci.devices, R, S)
    coarse = simulate(ci, sched)  # within budget
    fine_sched = c.expand(sched)
    fine = simulate(inst, fine_sched)  # raises if over budget
    assert np.all(fine.peak_bytes <= coarse.peak_bytes)
    assert not fine_sched.S[0, 12, [3, 4, 5]].any()  # f3 f4 f5 are not kept for nothing
    assert not fine_sched.R[0, 12, 6]  # and the loss is not recomputed for nothing


def test_wrong_shape_and_wrong_instance_are_refused():
    g = chain(4)
    c = coarsen(g, 3)
    fine_inst = Instance(g, ("cpu",), (10**9,))
    with pytest.raises(ValueError, match=r"expected \(1, 5, 5\)"):
        c.expand(keep_all_schedule(fine_inst))
    with pytest.raises(ValueError, match="coarsening is of"):
        c.instance(Instance(chain(5), ("cpu",), (10**9,)))


# ----------------------------------------------------------------------------- solved schedules
def _budgets(c, fracs):
    peak = keep_all_peak_bytes(c.graph)
    low = int(c.graph.node_lower_bound_bytes().max())
    return [int(low + f * (peak - low)) for f in fracs]


def _stateful_chain(n: int):
    """A chain in the captured graphs' form: states on every other op (one larger than any
    value), values kept for backward only where saved."""
    cm = CopyModel(0.05, 1e6)
    return training_graph(
        f"statechain{n}",
        [(i, i + 1) for i in range(n - 1)],
        n,
        [1000 + 500 * (i % 3) for i in range(n)],
        {"a": [1.0 + 0.1 * i for i in range(n)], "b": [1.5 - 0.1 * i for i in range(n)]},
        copy_models={("a", "b"): cm, ("b", "a"): cm},
        state_bytes=[(3000 if i == 2 else 300) * (i % 2 == 0) for i in range(n)],
    )


@pytest.mark.parametrize(
    ("make", "devices", "max_group"),
    [
        (lambda: synthetic("chain", 8), ("a",), 3),
        (lambda: synthetic("chain", 8), ("a", "b"), 2),
        (lambda: synthetic("residual", 8), ("a", "b"), 3),
        (block_graph, ("a", "b"), 3),
        # autograd states become part of their group's value (read by the backward group)
        (lambda: _stateful_chain(8), ("a",), 3),
        (lambda: _stateful_chain(8), ("a", "b"), 2),
    ],
)
def test_coarse_optimum_expands_to_a_valid_fine_schedule_never_below_the_fine_optimum(
    make, devices, max_group
):
    g = make()
    c = coarsen(g, max_group)
    assert c.graph.size < g.size
    for budget in _budgets(c, (0.8, 0.3, 0.0)):
        inst = Instance(g, devices, (budget,) * len(devices))
        cres = solve_xengine(c.instance(inst), "highs", options=OPTS)
        assert cres.status == "optimal", cres.message
        fine = simulate(inst, c.expand(cres.schedule))  # raises if invalid or over budget
        assert np.all(fine.peak_bytes <= cres.sim.peak_bytes)
        assert fine.compute_time_s <= cres.sim.compute_time_s + 1e-9
        if fine.n_recomputes == cres.sim.n_recomputes:
            assert fine.compute_time_s == pytest.approx(cres.sim.compute_time_s)
        fres = solve_xengine(inst, "highs", options=OPTS)
        assert fres.status == "optimal", fres.message
        assert fine.time_s >= fres.objective_s * (1 - 1e-9)


def test_solve_coarse_reports_the_fine_schedule():
    g = synthetic("chain", 8)
    c = coarsen(g, 3)
    (budget,) = _budgets(c, (0.3,))
    inst = Instance(g, ("a", "b"), (budget, budget))
    res = solve_coarse(inst, c, solver="highs", options=OPTS)
    assert res.status == "feasible"  # an optimal coarse schedule is no fine optimum
    assert res.schedule.R.shape == (2, g.size, g.size)
    assert res.sim.time_s == pytest.approx(simulate(inst, res.schedule).time_s)
    assert res.best_bound_s is None and res.objective_s is None
    assert res.coarse.nodes == c.graph.size
    assert res.placement_bound_s is None and res.lp_bound_s is None
    assert res.coarse.objective_s >= res.sim.compute_time_s * (1 - 1e-12)  # summation order
    assert res.strategy == "xengine-coarse"


def test_an_infeasible_coarse_model_is_no_verdict_on_the_fine_problem():
    """Between the fine and the coarse smallest budgets the coarse model has no schedule but
    the fine one has: the result must not call the instance infeasible."""
    from xengine.checkpoints import min_feasible_budget_bytes

    g = synthetic("chain", 8)
    c = coarsen(g, 3)
    fine_min, _ = min_feasible_budget_bytes(g)
    coarse_min, _ = min_feasible_budget_bytes(c.graph)
    assert coarse_min > fine_min  # a fused node needs its whole bundle at once
    inst = Instance.single(g, "a", fine_min)
    res = solve_coarse(inst, c, solver="highs", options=OPTS)
    assert res.status == "no_solution"
    assert "coarse model" in res.message and "may still have schedules" in res.message
    assert solve_xengine(inst, options=OPTS).status in ("optimal", "feasible")
