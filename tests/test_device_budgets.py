"""Budgets with several devices whose workspaces differ (issue 27, docs/design.md sections 9
and 10): a percentage is of each device's own keep-everything peak, and XEngine is infeasible
without a solve only when some op fits no device's budget."""

from __future__ import annotations

import dataclasses

from tests.helpers import random_graph
from xengine.config import RunConfig
from xengine.graph.io import save_graph
from xengine.pipeline import run_pipeline
from xengine.prepare import prepare
from xengine.problem import Instance
from xengine.simulate import keep_all_peak_bytes
from xengine.strategies.registry import SolveSettings, run_strategy

BIG = 40_000  # a workspace that only device "a" needs (two threads, say)


def _graph():
    """A small training graph whose node f1 needs BIG bytes of workspace on "a" and none on
    "b", so each device has its own keep-everything peak and its own smallest budget."""
    g = random_graph(1, devices=("a", "b"), states=True)
    nodes = list(g.nodes)
    k = next(i for i, v in enumerate(nodes) if v.name == "f1")
    nodes[k] = dataclasses.replace(
        nodes[k], workspace_bytes=BIG, device_workspace_bytes={"a": BIG, "b": 0}
    )
    return dataclasses.replace(g, nodes=tuple(nodes))


def test_a_percentage_is_of_each_devices_own_peak(tmp_path):
    g = _graph()
    peak_a, peak_b = keep_all_peak_bytes(g, "a"), keep_all_peak_bytes(g, "b")
    assert peak_a > peak_b  # the workspaces differ, so do the peaks
    path = tmp_path / "g.json"
    save_graph(g, path)
    prep = prepare(RunConfig(graph_path=str(path), devices=("a", "b"), mem=("70%",)))
    assert prep.keep_all_by_device_bytes == (peak_a, peak_b)
    assert prep.budget_bytes == (int(0.7 * peak_a), int(0.7 * peak_b))


def test_an_op_that_fits_one_device_is_solved_not_infeasible():
    g = _graph()
    foot_a = int(g.node_lower_bound_bytes("a").max())
    foot_b = int(g.node_lower_bound_bytes("b").max())
    assert foot_a > foot_b
    budget = (foot_b + foot_a) // 2  # f1 fits on b only
    inst = Instance(g, ("a", "b"), (budget, budget))
    assert inst.unfit_message() is None
    res = run_strategy("xengine", inst, SolveSettings())
    assert res.status == "optimal" and res.sim.within_budget, res.message
    assert not res.schedule.R[0, :, 1].any()  # f1 never runs on a
    # "a" alone cannot run f1: the single-device baseline there is infeasible without a solve
    alone = run_strategy("checkpoint_all", inst.only_device(0, budget), SolveSettings())
    assert alone.status == "infeasible" and "f1" in alone.message


def test_a_run_solves_xengine_where_one_device_holds_every_op(tmp_path):
    """The run's own path: budgets in bytes that f1 fits on b only (the graph's default
    workspace, a's, would call every budget infeasible)."""
    g = _graph()
    budget = (
        int(g.node_lower_bound_bytes("a").max()) + int(g.node_lower_bound_bytes("b").max())
    ) // 2
    path = tmp_path / "g.json"
    save_graph(g, path)
    cfg = RunConfig(
        graph_path=str(path), devices=("a", "b"), mem=(f"{budget}B",), strategies=("checkmate",)
    )
    xe = {r.label: r for r in run_pipeline(cfg)}["xengine"]
    assert xe.status == "optimal", xe.note


def test_an_op_that_fits_no_device_is_infeasible_naming_each_devices_smallest_budget():
    g = _graph()
    foot_b = int(g.node_lower_bound_bytes("b").max())
    inst = Instance(g, ("a", "b"), (foot_b - 1, foot_b - 1))
    res = run_strategy("xengine", inst, SolveSettings())
    assert res.status == "infeasible" and res.solver is None  # no solve
    assert res.message == inst.unfit_message()
    v = g.node_lower_bound_bytes("b").argmax()  # the op that needs most on either device
    need_a, need_b = (int(g.node_lower_bound_bytes(d)[v]) for d in ("a", "b"))
    assert f"fits op {g.nodes[v].name} on no device" in res.message, res.message
    assert f"({need_a} bytes), b " in res.message and f"({need_b} bytes))" in res.message
    assert "the smallest budget on each device alone: a " in res.message


def test_the_run_resolves_percentages_per_device(tmp_path):
    path = tmp_path / "g.json"
    save_graph(_graph(), path)
    cfg = RunConfig(
        graph_path=str(path), devices=("a", "b"), mem=("70%",), strategies=("checkpoint_all",)
    )
    rows = run_pipeline(cfg)
    budgets = {r.label: r.budget_bytes for r in rows}
    g = _graph()
    own = (int(0.7 * keep_all_peak_bytes(g, "a")), int(0.7 * keep_all_peak_bytes(g, "b")))
    assert budgets["checkpoint_all.a"] == (sum(own),)  # the protocol's total on one device
