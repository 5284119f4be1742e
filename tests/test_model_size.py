"""The MILP's memory, estimated before it is built (issue 30, item 5): the estimate covers the
nonzeros of the model actually built on captured nets, and a model that would not fit in the
host's free memory is refused with one line, the best schedule at hand answering."""

from __future__ import annotations

import pytest
from _nets import costed, resnet18_small, tiny

import xengine.strategies.model_size as model_size
from baselines.checkmate import solve_checkmate
from xengine.graph.synthetic import training_graph
from xengine.problem import Instance
from xengine.simulate import keep_all_peak_bytes
from xengine.strategies.formulation import build


def _inst(cap, share=0.6):
    g = costed(cap.graph, ["cpu"])
    return Instance.single(g, "cpu", int(share * keep_all_peak_bytes(g, "cpu")))


@pytest.mark.parametrize("cap", [tiny, resnet18_small], ids=["tiny", "resnet18"])
def test_the_estimate_covers_the_model_built(cap):
    inst = _inst(cap())
    nnz = build(inst, mode="exact").model.A.nnz
    est = model_size.milp_nonzeros(inst.graph)
    assert nnz <= est <= 1.1 * nnz, (nnz, est)


def test_a_2500_node_graph_is_refused_on_this_kind_of_machine():
    nf = 1249
    edges = [(i, i + 1) for i in range(nf - 1)] + [(i, i + 3) for i in range(0, nf - 3, 3)]
    g = training_graph("big", edges, nf, [1000] * nf, {"cpu": [1e-3] * nf}, state_bytes=[8] * nf)
    assert g.size == 2499
    why = model_size.milp_memory_problem(g, free_bytes=24 * 2**30)
    assert why is not None and "2499 nodes" in why and "24.0 GiB free" in why
    assert model_size.milp_memory_problem(g, free_bytes=2**40) is None  # fits 1 TiB


def test_checkmate_refuses_the_milp_and_keeps_its_start(monkeypatch):
    inst = _inst(tiny(), share=0.9)  # a heuristic fits at 90 %: it is the answer
    monkeypatch.setattr(model_size, "available_host_bytes", lambda: 2**20)  # 1 MiB free
    res = solve_checkmate(inst, frontier=False)
    assert res.status == "feasible" and res.schedule is not None
    assert "the full MILP was not built" in res.message and "1.0 MiB free" in res.message
    assert res.sim.within_budget and "milp_refused" in res.extra
    # no relaxation ran: the bound is every op once, a bound of any schedule
    assert res.extra["bound_from"] == "every_op_once" and "every op run once" in res.message
    assert res.best_bound_s == pytest.approx(float(inst.compute_s[0].sum()), rel=1e-12)
    assert res.best_bound_s <= res.sim.time_s and res.gap == pytest.approx(
        (res.sim.time_s - res.best_bound_s) / res.sim.time_s, rel=1e-9
    )


@pytest.mark.parametrize("refused", [False, True])
def test_the_seed_has_the_milps_share_when_the_milp_will_not_be_built(monkeypatch, refused):
    import baselines.checkmate as checkmate

    limits = {}
    real_seed, real_heuristics = checkmate._heuristic_seed, checkmate.run_heuristics

    def seed(inst, time_limit_s=None):
        limits["seed"] = time_limit_s
        return real_seed(inst, time_limit_s)

    def heuristics(inst, names=None, time_limit_s=None):
        limits["heuristics"] = time_limit_s
        return real_heuristics(inst, names, time_limit_s)

    monkeypatch.setattr(checkmate, "_heuristic_seed", seed)
    monkeypatch.setattr(checkmate, "run_heuristics", heuristics)
    if refused:
        monkeypatch.setattr(model_size, "available_host_bytes", lambda: 2**20)
    inst = _inst(tiny(), share=0.9)
    options = checkmate.SolverOptions(time_limit_s=100.0)
    res = solve_checkmate(inst, options=options, frontier=False)
    share = 1 - checkmate.FRONTIER_SHARE if refused else checkmate.HEURISTIC_SHARE
    assert limits == {"seed": 100.0 * share, "heuristics": 50.0 * share}
    assert ("milp_refused" in res.extra) == refused and res.sim.within_budget


def test_checkmate_refused_without_a_start_says_so(monkeypatch):
    inst = _inst(tiny(), share=0.8)  # no heuristic fits at 80 %
    monkeypatch.setattr(model_size, "available_host_bytes", lambda: 2**20)
    res = solve_checkmate(inst, frontier=False)
    assert res.status == "no_solution" and res.schedule is None
    assert "the full MILP was not built" in res.message and "1.0 MiB free" in res.message
