"""Profile-guided solving: a strategy solved again with the costs its own schedule pays
(docs/design.md section 4, "in context"; issue 28).

The profile's costs are keep-everything's (:mod:`xengine.profile.profiler`); a recomputing
schedule pays more per node (:mod:`xengine.profile.context`). So a schedule that fits is run
once, its instructions timed in its own steps, those nodes re-costed, and the strategy runs
again on the re-costed instance. A round ends when the strategy returns the schedule its
costs were measured on (``stable``): the prediction is then the simulator's sum of that very
schedule's measured per-node costs, and the solver optimised it against the costs a schedule
near it pays. Costs measured in an earlier round are kept for nodes the newer schedule does
not compute again. After ``rounds`` rounds without a stable schedule the last one is timed in
its own context once more and re-simulated (not solved again): its prediction is still in its
own context, but the solver saw the previous schedule's costs.

A policy that PyTorch runs itself and that translates into a schedule of ours
(``torch_checkpoint``, ``torch_sac``: ``PolicyRun.schedule``) is timed once in its own context
and its prediction replayed on those costs; there is nothing to solve again.

What the row reports: ``predicted_time_s`` is the in-context prediction, and
``profile_time_s`` the same schedule's prediction on the keep-everything profile's costs, so
that both the refined and the unrefined error can be shown (experiments/time_fidelity.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from xengine.graph.capture import CapturedModel
from xengine.problem import Instance
from xengine.profile.context import (
    ContextTiming,
    supports,
    time_in_context,
    with_context_costs,
)
from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import simulate
from xengine.strategies.registry import SolveSettings, run_strategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextRounds:
    """How a row's costs were refined: rounds run (``rounds``), whether the last solve
    returned the schedule its costs came from, and the prediction of the returned schedule on
    the keep-everything profile's costs (``profile_time_s``)."""

    rounds: int
    stable: bool
    profile_time_s: float
    # the last timing in context: its instructions' median sum and a plain step beside it,
    # and the sum's standard error (relative; xengine.profile.context.ContextTiming.step_se)
    context_step_s: float | None = None
    context_plain_step_s: float | None = None
    context_se: float = float("nan")


def solve_in_context(
    name: str,
    inst: Instance,
    settings: SolveSettings,
    captured: CapturedModel | None,
    *,
    rounds: int,
    repeats: int = 5,
    warmup: int = 2,
    min_s: float = 3.0,
    warm_start: Schedule | None = None,
    label: str | None = None,
    status_line: bool = False,
    starts: Mapping[str, Schedule] | None = None,
) -> tuple[StrategyResult, Instance, ContextRounds | None]:
    """Run strategy ``name`` (:func:`run_strategy`), then refine it in context for up to
    ``rounds`` rounds (module docstring); each timing in context is at least ``repeats``
    steps after ``warmup`` and at least ``min_s`` seconds of them (25 steps at most).
    ``starts`` go to every solve (:func:`run_strategy`). Returns the result, the instance
    whose costs its prediction used, and the rounds (None:
    not refined: ``rounds`` is 0, no captured model, a CUDA device in the mix, or no schedule
    that fits)."""
    label = label or name
    res = run_strategy(name, inst, settings, warm_start, label, status_line, captured, starts)
    policy = res.pytorch is not None and res.pytorch.schedule is not None
    if rounds <= 0 or captured is None or not (policy or _fits(res)):
        return res, inst, None
    if not supports(inst):
        log.info("%s: costs not refined in context on %s (CPU only)", label, "+".join(inst.devices))
        return res, inst, None
    if policy:
        return _policy_in_context(label, res, inst, captured, (repeats, warmup, min_s))
    measured: dict[str, dict[str, float]] = {d: {} for d in inst.devices}
    here, stable, r = inst, False, 0
    for r in range(1, rounds + 1):
        timing = _measure_into(measured, captured, here, res.schedule, (repeats, warmup, min_s))
        here = with_context_costs(inst, measured)
        again = run_strategy(name, here, settings, warm_start, label, status_line, starts=starts)
        if not _fits(again):  # keep the schedule that fits, costed in its own context
            log.info("%s: round %d in context found no schedule that fits", label, r)
            break
        if _same(again.schedule, res.schedule, inst):
            log.info("%s: stable after %d round(s) in context", label, r)
            res, stable = again, True
            break
        log.info(
            "%s: round %d in context changed the schedule (%.2f -> %.2f ms predicted)",
            label,
            r,
            simulate(here, res.schedule, check_budget=False).time_s * 1e3,
            again.sim.time_s * 1e3,
        )
        res = again
    else:  # no stable schedule: the last one is timed in its own context, not solved again
        timing = _measure_into(measured, captured, here, res.schedule, (repeats, warmup, min_s))
        here = with_context_costs(inst, measured)
    if not stable:
        res = _resimulated(res, here)
    profile_time_s = float(simulate(inst, res.schedule, check_budget=False).time_s)
    done = ContextRounds(
        r, stable, profile_time_s, timing.step_s, timing.plain_step_s, timing.step_se
    )
    return res, here, done


def _policy_in_context(
    label: str, res: StrategyResult, inst: Instance, captured: CapturedModel, steps
) -> tuple[StrategyResult, Instance, ContextRounds]:
    """A policy PyTorch ran itself, translated into a schedule of ours (``PolicyRun.sim``,
    the row's prediction): there is nothing to solve again, so the schedule is timed once in
    its own steps and replayed on those costs, as every other row's prediction is. On the
    profile's costs alone the translations were 6-27 % below our executor's run of the same
    schedule (docs/measurements.md, "Against PyTorch's own checkpointing")."""
    run = res.pytorch
    measured: dict[str, dict[str, float]] = {d: {} for d in inst.devices}
    timing = _measure_into(measured, captured, inst, run.schedule, steps)
    here = with_context_costs(inst, measured)
    profile_time_s = float(run.sim.time_s)
    run.sim = simulate(here, run.schedule, check_budget=False)
    log.info(
        "%s: its schedule of ours timed in context: %.2f -> %.2f ms predicted",
        label,
        profile_time_s * 1e3,
        run.sim.time_s * 1e3,
    )
    rounds = ContextRounds(
        1, True, profile_time_s, timing.step_s, timing.plain_step_s, timing.step_se
    )
    return res, here, rounds


def _measure_into(measured, captured, inst, sched, steps) -> ContextTiming:
    repeats, warmup, min_s = steps
    timing = time_in_context(captured, inst, sched, repeats, warmup, min_s=min_s)
    for d, table in timing.cost_s.items():
        measured[d].update(table)
    return timing


def _fits(res: StrategyResult) -> bool:
    return res.has_schedule and res.sim is not None and res.sim.within_budget


def _same(a: Schedule, b: Schedule, inst: Instance) -> bool:
    g = inst.graph
    return (
        np.array_equal(a.R, b.R)
        and np.array_equal(a.S, b.S)
        and np.array_equal(a.states_for(g), b.states_for(g))
    )


def _resimulated(res: StrategyResult, inst: Instance) -> StrategyResult:
    """``res`` with its schedule simulated on ``inst``'s costs (memory does not change)."""
    return replace(res, sim=simulate(inst, res.schedule, check_budget=False))


__all__ = ["ContextRounds", "solve_in_context"]
