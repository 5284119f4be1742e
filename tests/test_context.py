"""Costs in the schedule's context (xengine.profile.context) and the profile-guided rounds
(xengine.refine): the mechanism, not the speed (experiments/time_fidelity.py measures that)."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.heuristics import solve_chen_sqrtn
from tests._nets import costed, run_beside_reference, tiny
from xengine.execute.executor import CompiledSchedule
from xengine.problem import Instance
from xengine.profile.context import _marked_program, time_in_context, with_context_costs
from xengine.refine import solve_in_context
from xengine.schedule import keep_all_schedule
from xengine.simulate import keep_all_peak_bytes, simulate
from xengine.strategies.registry import SolveSettings


def _recomputing(cap):
    """Tiny with unit costs and Chen's sqrt(n) checkpoints: a schedule that recomputes, within
    the budget of its own peak."""
    g = costed(cap.graph, ["cpu"])
    res = solve_chen_sqrtn(Instance.single(g, "cpu", None))
    inst = Instance.single(g, "cpu", int(res.sim.peak_bytes[0]))
    assert int(res.sim.peak_bytes[0]) < keep_all_peak_bytes(g, "cpu")
    res = solve_chen_sqrtn(inst)
    assert res.sim.within_budget and res.sim.n_recomputes > 0
    return inst, res.schedule


def test_every_instruction_is_counted_once():
    """The simulated time on the measured costs is the median step's sum of timed
    instructions: a node computed k times costs k times its per-computation mean, and a fused
    pass's start is charged once, to its first node."""
    cap = tiny()
    inst, sched = _recomputing(cap)
    timing = time_in_context(cap, inst, sched, repeats=3, warmup=1)
    refined = with_context_costs(inst, timing.cost_s)
    assert simulate(refined, sched).time_s == pytest.approx(timing.step_s, rel=1e-9)
    assert timing.plain_step_s is not None and timing.plain_step_s > 0
    # the step time is at the plain steps' median speed: their median times the median ratio
    assert timing.step_s == pytest.approx(timing.over_plain * timing.plain_step_s, rel=1e-12)
    # every compute of the program is marked: one mark per compute op or fused pass (the
    # nodes inside a pass, recomputations that refill a state included, are marked by the
    # runtime as autograd reaches them: the sum above counts them)
    with CompiledSchedule(cap, inst, sched) as exe:
        marks = [key for _, key, _, _ in _marked_program(exe) if key]
        computes = [op for op in exe.sim.ops if op.kind == "compute"]
        groups = _groups(exe)
        fused = sum(len(g.computes) - 1 + len(g.refills) for g in groups)
        assert any(g.refills for g in groups)
        assert len(marks) == len(computes) - fused


def _groups(exe):
    from xengine.execute.program import compile_plan

    rt = exe.rt
    plan = compile_plan(
        exe.sim.ops,
        rt.g,
        [s.grad_inputs for s in rt.ops],
        [s.requires_grad for s in rt.ops],
        mutates_buffers=[s.mutates_buffers for s in rt.ops],
    )
    return list(plan.groups.values())


def test_refined_costs_replace_only_what_the_schedule_computes():
    cap = tiny()
    inst, sched = _recomputing(cap)
    computed = {cap.graph.nodes[i].name for i in np.flatnonzero(sched.R.any(axis=(0, 1)))}
    measured = {"cpu": {name: 0.5 for name in computed if name.startswith("grad_")}}
    refined = with_context_costs(inst, measured)
    for v, w in zip(inst.graph.nodes, refined.graph.nodes, strict=True):
        want = 0.5 if v.name in measured["cpu"] else v.cost_s["cpu"]
        assert w.cost_s["cpu"] == want
    assert refined.budget_bytes == inst.budget_bytes
    assert refined.graph.copy_models == inst.graph.copy_models


def test_context_changes_the_costs_a_recomputing_schedule_changes():
    """Keep-everything timed in its own context costs what it costs; the same nodes inside a
    recomputing schedule (hooks, taps, short passes) are measured apart: a recomputed forward
    node is charged its mean over its computations there, not keep-everything's."""
    cap = tiny()
    inst, sched = _recomputing(cap)
    keep = Instance.single(inst.graph, "cpu", None)
    ka = time_in_context(cap, keep, keep_all_schedule(keep), repeats=3, warmup=1).cost_s["cpu"]
    rc = time_in_context(cap, inst, sched, repeats=3, warmup=1).cost_s["cpu"]
    assert set(ka) == {v.name for v in inst.graph.nodes}
    assert set(rc) == set(ka)  # the schedule computes every node at least once
    assert any(abs(rc[n] - ka[n]) > 0 for n in ka)


def test_the_rounds_stop_when_the_schedule_is_stable():
    """chen_sqrtn's schedule does not depend on costs: one round measures it, the second solve
    returns it, and the prediction is that schedule on its own measured costs."""
    cap = tiny()
    inst, _ = _recomputing(cap)
    res, here, rounds = solve_in_context(
        "chen_sqrtn", inst, SolveSettings(), cap, rounds=2, repeats=3, warmup=1
    )
    assert rounds is not None and rounds.rounds == 1 and rounds.stable
    assert rounds.profile_time_s == pytest.approx(simulate(inst, res.schedule).time_s)
    assert res.sim.time_s == pytest.approx(simulate(here, res.schedule).time_s)
    assert res.sim.time_s != pytest.approx(rounds.profile_time_s)  # unit costs are not seconds
    off, same, none = solve_in_context("chen_sqrtn", inst, SolveSettings(), cap, rounds=0)
    assert none is None and same is inst


def test_the_plain_forward_path_is_the_same_step():
    """Keep-everything runs every forward compute on :meth:`compute_native` (no hooks, no
    taps): the loss, gradients and buffers are a plain step's, as before."""
    cap = tiny()
    inst = Instance.single(costed(cap.graph, ["cpu"]), "cpu", None)
    sched = keep_all_schedule(inst)
    with CompiledSchedule(cap, inst, sched) as exe:
        names = {getattr(fn, "func", None).__name__ for fn, _ in exe.program if hasattr(fn, "func")}
    assert "compute_native" in names
    run_beside_reference(cap, inst, sched, rtol=0, atol=0)


def test_a_pair_is_a_plain_step_then_the_schedule():
    """One pair protocol (xengine.profile.paired): a plain step first, then the schedule's,
    warm-up pairs dropped, at least ``rounds`` pairs and ``min_s`` seconds, ``most`` at most."""
    from xengine.profile.paired import median_se, pairs

    order: list[str] = []

    def plain() -> float:
        order.append("plain")
        return 1.0

    def mine() -> float:
        order.append("mine")
        return 2.0

    a, b = pairs(plain, mine, warmup=1, rounds=2, min_s=7.5, most=10)
    assert order == ["plain", "mine"] * 4  # 1 warm-up, then 3 pairs: 9 s >= 7.5 s
    assert a == [2.0] * 3 and b == [1.0] * 3
    assert len(pairs(plain, mine, 0, 1, 1e9, most=4)[0]) == 4
    assert np.isnan(median_se([1.0, 2.0, 3.0])) and median_se([1.0] * 4) == 0.0


def test_the_timing_in_context_takes_its_pairs_as_the_benchmarks_do(monkeypatch):
    """After each marked step, a plain step and then an unmarked step of the schedule (the
    measurement's order: the schedule's step follows a plain step in both); the standard
    error of the median ratio comes with the timing."""
    from xengine.execute.executor import PlainStep

    cap = tiny()
    inst, sched = _recomputing(cap)
    order: list[str] = []
    for cls, tag in ((PlainStep, "plain"), (CompiledSchedule, "mine")):
        step = cls.step

        def logged(self, _step=step, _tag=tag):
            order.append(_tag)
            return _step(self)

        monkeypatch.setattr(cls, "step", logged)
    timing = time_in_context(cap, inst, sched, repeats=4, warmup=1)
    assert order == ["plain", "mine"] * 5
    assert timing.steps == 4 and np.isfinite(timing.step_se) and timing.step_se >= 0
