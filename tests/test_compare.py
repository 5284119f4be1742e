"""The paper's protocol: XEngine against Checkmate on each device with the same total memory."""

from __future__ import annotations

import pytest

from tests.helpers import RESIDUAL, copy_models
from xengine.graph.synthetic import training_graph
from xengine.problem import Instance
from xengine.protocol import compare
from xengine.simulate import keep_all_peak_bytes
from xengine.solvers import SolverOptions

OPTS = SolverOptions(time_limit_s=60, rel_gap=1e-9)


def _split():
    fwd = {"a": [1.0, 1.0, 10.0, 10.0], "b": [10.0, 10.0, 1.0, 1.0]}
    return training_graph(
        "split",
        [(0, 1), (1, 2), (2, 3)],
        4,
        [1000] * 4,
        fwd,
        bwd_cost_s={d: [2 * c for c in cs] for d, cs in fwd.items()},
        loss_cost_s={"a": 0.5, "b": 0.5},
        copy_models=copy_models(("a", "b")),
    )


def test_protocol_reports_gain_over_fastest_single_device():
    g = _split()
    inst = Instance(g, ("a", "b"), (10**6, 10**6))
    cmp = compare(inst, options=OPTS)
    assert cmp.xengine.status == "optimal"
    assert cmp.best_single.strategy == "checkmate"
    assert cmp.best_single.predicted_time_s == pytest.approx(66.5)
    assert cmp.gain == pytest.approx((66.5 - 12.53) / 66.5)
    # every single-device strategy ran on each device with the total memory
    per_device = {(r.strategy, r.devices) for r in cmp.results if r.strategy != "xengine"}
    assert ("checkmate", ("a",)) in per_device and ("chen_greedy", ("b",)) in per_device
    assert all(r.budget_bytes == (2 * 10**6,) for r in cmp.results if r.strategy != "xengine")


def test_protocol_names_infeasible_single_devices():
    g = training_graph(
        "residual",
        RESIDUAL,
        4,
        [1000, 3000, 1000, 3000],
        {"a": [1.0] * 4, "b": [1.0] * 4},
        saves_input=False,
        copy_models=copy_models(("a", "b")),
    )
    # per-device budget 4500: the total 9000 is below what one device alone needs (10000)
    inst = Instance(g, ("a", "b"), (4500, 4500))
    cmp = compare(inst, strategies=("xengine", "checkmate"), options=OPTS)
    assert cmp.infeasible_single == ["checkmate.a", "checkmate.b"]  # row labels, as in run.py
    assert cmp.best_single is None
    assert cmp.xengine.status == "infeasible"  # 4500 is below the largest op's footprint
    inst = Instance(g, ("a", "b"), (9000, 9000))
    cmp = compare(inst, strategies=("xengine", "checkmate"), options=OPTS)
    assert cmp.infeasible_single == []  # 18000 total is plenty for one device


def _fast_b_chain() -> Instance:
    """A chain of 6 where device b is 10x faster, each device's budget 1 byte below
    keep-everything."""
    from xengine.graph.synthetic import chain

    g = chain(6, devices=("a", "b"))
    g = g.with_costs(
        {"a": {v.name: 10.0 for v in g.nodes}, "b": {v.name: 1.0 for v in g.nodes}},
        copy_models(("a", "b")),
    )
    budget = keep_all_peak_bytes(g) - 1
    return Instance(g, ("a", "b"), (budget, budget))


def test_warm_start_considers_the_cost_aware_heuristic_at_each_devices_own_budget():
    from baselines.heuristics import solve_recompute_greedy
    from xengine.protocol import warm_start

    # device b is 10x faster and a fast device's budget below keep-everything: no schedule
    # with the total memory fits the per-device budget, recompute_greedy on b alone does
    inst = _fast_b_chain()
    budget = int(inst.budget_bytes[1])
    ours = solve_recompute_greedy(inst.only_device(1, budget))
    assert ours.status == "feasible"
    # formulation "paper" has no placed model, so the candidates are the heuristic ones only
    what, sched, t = warm_start(
        inst, [], options=SolverOptions(time_limit_s=10), formulation="paper"
    )
    assert t <= ours.sim.time_s + 1e-9
    assert what == "recompute_greedy on b (its own memory)"


def _placed_model_ran(caplog) -> bool:
    return "placed model: XEngine with each node" in caplog.text


def test_exact_mode_skips_the_placed_model_once_a_start_fits(caplog):
    """The placed model takes half of what the starts left of the limit; in exact mode,
    once a start fits, the solve's own relaxation phase does its work (protocol's
    ``_placed_model_pays``). The interval model still gets it."""
    import logging

    from xengine.protocol import warm_start

    inst = _fast_b_chain()
    opts = SolverOptions(time_limit_s=10)
    with caplog.at_level(logging.INFO, logger="xengine"):
        found = warm_start(inst, [], options=opts, formulation="exact")
    assert found is not None and found[0] == "recompute_greedy on b (its own memory)"
    assert "placed model skipped" in caplog.text and not _placed_model_ran(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xengine"):
        warm_start(inst, [], solver="cpsat", options=opts, formulation="intervals")
    assert _placed_model_ran(caplog) and "placed model skipped" not in caplog.text


def test_exact_mode_runs_the_placed_model_while_no_start_fits(caplog, monkeypatch):
    """Neither device alone holds the residual graph at 9000 bytes (one op needs 10000), so
    no greedy start fits: the placed model over the best spread is still tried. (The
    offloaded starts are switched off here: they would fit, and then it is skipped.)"""
    import logging

    import xengine.protocol as protocol
    from tests.test_distribute import _residual
    from xengine.protocol import warm_start

    monkeypatch.setattr(protocol, "offload_starts", lambda inst, time_limit_s: [])
    inst = Instance(_residual(), ("a", "b"), (9000, 9000))
    with caplog.at_level(logging.INFO, logger="xengine"):
        found = warm_start(inst, [], options=SolverOptions(time_limit_s=10), formulation="exact")
    assert _placed_model_ran(caplog) and "placed model skipped" not in caplog.text
    assert found is not None


def test_the_placed_model_gets_half_of_what_the_other_starts_left(monkeypatch):
    """The limit is the strategy's: the placed model (run here, nothing else fits) gets half
    of what the offloaded starts left of it, never less than half of ``SOLVE_SHARE``."""
    import time

    import xengine.protocol as protocol
    from tests.test_distribute import _residual

    given = []

    def slow_offload(inst, time_limit_s):
        time.sleep(0.4)
        return []

    def candidates(inst, singles, solver, options, **kwargs):
        given.append(options.time_limit_s)
        return []

    monkeypatch.setattr(protocol, "offload_starts", slow_offload)
    monkeypatch.setattr(protocol, "start_candidates", candidates)
    monkeypatch.setattr(protocol, "_fallback_starts", lambda own, solver, options: [])
    inst = Instance(_residual(), ("a", "b"), (9000, 9000))
    protocol.warm_start(inst, [], options=SolverOptions(time_limit_s=2.0), formulation="exact")
    assert 0.7 <= given[0] <= 0.8  # (2.0 - 0.4 s and the greedy starts) / 2
    given.clear()
    protocol.warm_start(inst, [], options=SolverOptions(time_limit_s=0.5), formulation="exact")
    assert given == [pytest.approx(0.5 * protocol.SOLVE_SHARE / 2)]


def test_a_jobs_solve_gets_what_its_warm_start_left_of_the_limit():
    """:meth:`xengine.protocol.Job.settings`: the limit less the warm start's seconds, at
    least ``SOLVE_SHARE`` of it; no limit or no start leaves the settings as they are."""
    from xengine.protocol import SOLVE_SHARE, Job
    from xengine.strategies.registry import SolveSettings

    inst = _fast_b_chain()
    base = SolveSettings(options=SolverOptions(time_limit_s=100.0, rel_gap=0.01))
    assert Job("x", "xengine", inst, False).settings(base) == base
    got = Job("x", "xengine", inst, False, start_s=30.0).settings(base)
    assert got.options.time_limit_s == pytest.approx(70.0)
    assert got.options.rel_gap == 0.01 and got.solver == base.solver
    late = Job("x", "xengine", inst, False, start_s=90.0).settings(base)
    assert late.options.time_limit_s == pytest.approx(100.0 * SOLVE_SHARE)
    unlimited = SolveSettings(options=SolverOptions(time_limit_s=None))
    assert Job("x", "xengine", inst, False, start_s=30.0).settings(unlimited) == unlimited


def test_the_registry_names_every_heuristic_of_the_baselines():
    """The protocol's list of heuristics and the baselines' own table are the same names."""
    from baselines.heuristics import HEURISTICS as TABLE
    from xengine.strategies.registry import HEURISTICS, STRATEGIES, load

    assert tuple(TABLE) == HEURISTICS
    assert all(load(name) is TABLE[name] for name in HEURISTICS)
    assert all(STRATEGIES[name].one_device for name in HEURISTICS)


@pytest.mark.parametrize("formulation", ["exact", "intervals"])
@pytest.mark.parametrize("coarsen", [None, 2])
def test_each_strategy_declares_the_arguments_its_function_takes(formulation, coarsen):
    """The registry's flags are a strategy's calling convention: what :meth:`call` passes
    binds to the function it names, and a function's settings come from those flags (a
    solver strategy gets the run's options, XEngine its formulation and, unless coarsened,
    the warm start)."""
    import inspect

    from xengine.strategies.registry import STRATEGIES, SolveSettings

    settings = SolveSettings(
        solver="highs", options=OPTS, formulation=formulation, coarsen=coarsen, seed=7, n_steps=3
    )
    start, net = object(), object()
    for name, spec in STRATEGIES.items():
        fn, kwargs = spec.call(name, settings, start, progress=print, captured=net)
        inspect.signature(fn).bind(Instance.__new__(Instance), **kwargs)  # raises if not
        assert ("options" in kwargs) == (spec.uses_solver or spec.takes_options), name
        assert ("seed" in kwargs) == spec.takes_seed, name
        assert ("progress" in kwargs) == spec.shows_progress, name
        assert (kwargs.get("captured") is net) == spec.runs_in_pytorch, name
        assert (kwargs.get("n_steps") == 3) == spec.runs_in_pytorch, name
        if spec.runs_in_pytorch:  # PyTorch runs it: without the net it cannot run
            with pytest.raises(ValueError, match="needs the net"):
                spec.call(name, settings, start)
        assert (kwargs.get("warm_start") is start) == (spec.heterogeneous and coarsen is None)
        if spec.heterogeneous:
            assert kwargs["formulation"] == formulation
            assert kwargs["solver"] == ("cpsat" if formulation == "intervals" else "highs")
            assert ("max_group" in kwargs) == (coarsen is not None)


def test_one_run_path_solves_single_devices_first_and_warm_starts_the_mix(monkeypatch):
    """:func:`xengine.protocol.solve_jobs`: the single-device jobs come first, each on each
    device alone; a heterogeneous strategy gets the protocol's warm start, computed from
    the single-device results that came before it, and seen by ``on_start``."""
    import time

    from xengine import protocol
    from xengine.result import StrategyResult
    from xengine.strategies.registry import SolveSettings

    inst = Instance(_split(), ("a", "b"), (10**6, 10**6))
    seen: list[tuple[str, object]] = []
    handed: list[list[str]] = []

    def fake_warm_start(inst_, alone, *args):
        handed.append([r.strategy + "." + r.devices[0] for r in alone])
        time.sleep(0.2)
        return ("fake start", "SCHEDULE", 1.0)

    monkeypatch.setattr(protocol, "warm_start", fake_warm_start)
    start_s = []

    def solve(job, start):
        seen.append((job.label, start))
        start_s.append(job.start_s)
        return StrategyResult(job.name, job.inst.devices, job.inst.budget_bytes, "infeasible")

    said = []
    names = ("xengine", "chen_greedy", "checkmate")
    settings = SolveSettings()
    jobs = list(protocol.solve_jobs(inst, names, settings, solve, lambda s, t: said.append(s)))
    labels = [label for label, _ in seen]
    singles = ["chen_greedy.a", "chen_greedy.b", "checkmate.a", "checkmate.b"]
    assert labels == [*singles, "xengine"]  # the order asked for, the mix last
    assert all(start is None for _, start in seen[:-1])
    assert seen[-1][1] == "SCHEDULE"
    assert handed == [singles]
    assert said == [("fake start", "SCHEDULE", 1.0)]
    # the mix's job knows what its start took of the limit; the single-device jobs took none
    assert start_s[:-1] == [0.0] * 4 and start_s[-1] >= 0.2
    assert [job.label for job, _ in jobs] == labels
