"""An exact strategy never answers with a schedule slower than the start it was given.

Why (issue 57): a MILP stopped by its time limit, or one whose start the solver dropped, can
hand back an incumbent slower than the heuristic schedule it started from; on efficientnet_b0
at 60 % Checkmate answered 258 ms beside ``recompute_greedy``'s 135 ms in the same table.
Every schedule of the run that fits the instance is a feasible point of the model, so the
answer is the better of the two, and the gap is measured from it. Checkmate
(:mod:`baselines.checkmate`) and XEngine (:mod:`xengine.strategies.solve`) both end here.
"""

from __future__ import annotations

import logging

from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import Simulation
from xengine.solvers.model import SOLUTION_STATUSES, relative_gap

log = logging.getLogger(__name__)

TIME_RTOL = 1e-9
"""Two predicted times closer than this are equal (the simulator adds the same costs in
another order)."""
_SOLVER_ONLY = ("raw_schedule", "raw_sim", "raw_time_s", "raw_peak_bytes")
"""``extra`` entries that describe the solver's own point, gone when the start answers."""


def never_slower(
    res: StrategyResult,
    start_label: str,
    start: Schedule,
    start_sim: Simulation,
    rel_gap: float,
) -> StrategyResult:
    """``res``, or the start in its place where it fits and ``res`` is slower or has no
    schedule. A result in ``error``, or whose schedule the simulator finds over the budget,
    stays as it is: a model that rejects a fitting start, or miscounts memory, is a defect to
    see, not to hide (:func:`xengine.strategies.registry.overrule_by_simulator`). The start
    keeps ``res``'s bound: optimal when the bound meets it within ``rel_gap``, else feasible
    with the gap from it."""
    if not start_sim.within_budget or res.status not in (*SOLUTION_STATUSES, "no_solution"):
        return res
    if res.has_schedule and res.sim is not None:
        if not res.sim.within_budget:  # the model miscounts memory (the published one does
            return res  # not count copies): the row says over_budget, as it should
        if res.sim.time_s <= start_sim.time_s * (1 + TIME_RTOL):
            return res
    was = (
        f"{res.sim.time_s * 1e3:.2f} ms"
        if res.has_schedule and res.sim is not None
        else f"no schedule ({res.status})"
    )
    time_s = float(start_sim.time_s)
    bound = None if res.best_bound_s is None else min(res.best_bound_s, time_s)
    gap = relative_gap(time_s, bound)
    res.schedule, res.sim, res.objective_s = start, start_sim, time_s
    res.best_bound_s, res.gap = bound, gap
    res.model_peak_bytes = None
    res.status = "optimal" if gap is not None and gap <= rel_gap else "feasible"
    res.warm_start = start_label
    for key in _SOLVER_ONLY:
        res.extra.pop(key, None)
    res.extra["start_kept"] = {"start": start_label, "solver_answer": was}
    said = f"kept its start, {start_label} ({time_s * 1e3:.2f} ms): the solve's answer was {was}"
    res.message = f"{said}; {res.message}" if res.message else said
    log.info("%s: %s", res.strategy, said)
    return res
