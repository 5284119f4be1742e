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
from xengine.solvers import SolverOptions
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


def test_checkmate_refused_without_a_start_says_so(monkeypatch):
    inst = _inst(tiny(), share=0.8)  # no heuristic fits at 80 %
    monkeypatch.setattr(model_size, "available_host_bytes", lambda: 2**20)
    res = solve_checkmate(inst, frontier=False)
    assert res.status == "no_solution" and res.schedule is None
    assert "the full MILP was not built" in res.message and "1.0 MiB free" in res.message


def _two(cap, share=0.6):
    g = costed(cap.graph, ["cpu", "cpu1"])
    b = int(share * keep_all_peak_bytes(g, "cpu"))
    return Instance(g, ("cpu", "cpu1"), (b, b))


@pytest.mark.parametrize("cap", [tiny, resnet18_small], ids=["tiny", "resnet18"])
def test_the_estimate_covers_xengines_model_on_two_devices(cap):
    # measured: 1.08 (tiny) and 1.11 (resnet18) of the model built, before the tight-rows factor
    inst = _two(cap())
    nnz = build(inst, mode="exact", free_rows="tight").model.A.nnz
    est = model_size.milp_nonzeros(inst.graph, n_devices=2, tight_rows=True)
    assert nnz <= est <= 1.2 * nnz, (nnz, est)


def test_xengine_refuses_its_model_and_keeps_the_start(monkeypatch):
    from baselines.heuristics import solve_recompute_greedy
    from xengine.strategies.solve import solve_xengine

    inst = _two(tiny(), share=0.9)  # a heuristic fits at 90 % (above)
    alone = solve_recompute_greedy(inst.only_device(0, int(inst.budget_bytes[0])))
    assert alone.status == "feasible" and alone.sim.n_recomputes > 0  # slower than the bound
    start = alone.schedule.on_devices(inst.devices)
    monkeypatch.setattr(model_size, "available_host_bytes", lambda: 2**20)  # 1 MiB free
    # the MILP's refusal alone: the frontier relaxation first would settle this small instance
    res = solve_xengine(inst, warm_start=start, options=SolverOptions(), frontier=False)
    assert res.status == "feasible" and res.schedule is start
    assert "XEngine's model was not built" in res.message and "over 2 devices" in res.message
    assert "1.0 MiB free" in res.extra["milp_refused"] and res.n_vars is None
    assert res.sim.within_budget and res.best_bound_s is not None  # the placement bound
    cold = solve_xengine(inst, options=SolverOptions(), frontier=False)
    assert cold.status == "no_solution" and cold.schedule is None
    assert "no start fits" in cold.message
