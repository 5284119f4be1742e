"""The paper's comparison protocol (Schuler et al. 2022, section 6; DESIGN.md section 9).

XEngine gets budget ``b_d`` on every device ``d``; each single device runs Checkmate (and the
heuristics) alone with the same *total* memory ``sum_d b_d``, the other devices unused. The
gain is measured against the fastest single-device schedule that fits. XEngine is warm-started
from the fastest of: the single-device schedules that are also feasible at the per-device
budgets, and those schedules spread over the devices (:mod:`xengine.distribute`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from xengine.distribute import start_candidates
from xengine.problem import Instance
from xengine.result import StrategyResult
from xengine.simulate import simulate
from xengine.solve import solve_xengine
from xengine.solvers import SolverOptions

log = logging.getLogger(__name__)

HEURISTICS = ("checkpoint_all", "chen_sqrtn", "chen_greedy")
SINGLE_DEVICE = ("checkmate", "lp_rounding") + HEURISTICS


@dataclass
class Comparison:
    """Every result of one protocol run, plus the headline numbers."""

    results: list[StrategyResult] = field(default_factory=list)
    xengine: StrategyResult | None = None
    best_single: StrategyResult | None = None
    infeasible_single: list[str] = field(default_factory=list)

    @property
    def gain(self) -> float | None:
        """(best single-device time - XEngine time) / best single-device time, simulated."""
        if self.xengine is None or not self.xengine.has_schedule or self.best_single is None:
            return None
        best = self.best_single.predicted_time_s
        return (best - self.xengine.predicted_time_s) / best


def _fits(res: StrategyResult) -> bool:
    return res.has_schedule and res.sim.within_budget and res.status in ("optimal", "feasible")


def run_single_device(
    inst: Instance,
    strategy: str,
    solver: str = "highs",
    options: SolverOptions | None = None,
) -> StrategyResult:
    """One single-device strategy by name on a one-device instance."""
    from baselines.checkmate import solve_checkmate
    from baselines.heuristics import solve_checkpoint_all, solve_chen_greedy, solve_chen_sqrtn
    from baselines.lp_rounding import solve_lp_rounding

    if strategy == "checkmate":
        return solve_checkmate(inst, solver=solver, options=options)
    if strategy == "lp_rounding":
        return solve_lp_rounding(inst, options=options)
    table = {
        "checkpoint_all": solve_checkpoint_all,
        "chen_sqrtn": solve_chen_sqrtn,
        "chen_greedy": solve_chen_greedy,
    }
    if strategy not in table:
        raise ValueError(
            f"unknown strategy {strategy!r}: choose from xengine, {', '.join(SINGLE_DEVICE)}"
        )
    return table[strategy](inst)


def compare(
    inst: Instance,
    strategies: Sequence[str] = ("xengine",) + SINGLE_DEVICE,
    solver: str = "highs",
    mode: str = "exact",
    options: SolverOptions | None = None,
) -> Comparison:
    """Run the protocol on a multi-device ``inst`` (a one-device instance also works: then
    the single-device strategies get that device's budget and XEngine equals Checkmate)."""
    options = options or SolverOptions()
    out = Comparison()
    total = int(sum(inst.budget_bytes))
    singles = [s for s in strategies if s != "xengine"]
    for d, name in enumerate(inst.devices):
        single = inst.only_device(d, total)
        for strat in singles:
            log.info("%s on %s alone with %d bytes", strat, name, total)
            try:
                res = run_single_device(single, strat, solver=solver, options=options)
            except Exception as exc:  # recorded, never lost: the run goes on
                log.exception("%s on %s failed", strat, name)
                res = StrategyResult(
                    strat,
                    single.devices,
                    single.budget_bytes,
                    "error",
                    message=f"{type(exc).__name__}: {exc}",
                )
            out.results.append(res)
            if strat == "checkmate" and not _fits(res):
                out.infeasible_single.append(name)
    fitting = [r for r in out.results if _fits(r)]
    if fitting:
        out.best_single = min(fitting, key=lambda r: r.predicted_time_s)
    if "xengine" in strategies:
        # the fastest of: a single-device schedule that also fits the per-device budgets, the
        # single-device schedules spread over the devices, the placed model's optimum
        cands = [(r.label, r.schedule.on_devices(inst.devices)) for r in fitting]
        if mode == "exact" and inst.n_devices > 1:
            singles = [(r.label, r.schedule) for r in out.results if r.has_schedule]
            cands += start_candidates(inst, singles, solver, options)
        warm, warm_s = None, float("inf")
        for label, sched in cands:
            sim = simulate(inst, sched, check_budget=False)
            if sim.within_budget and sim.time_s < warm_s:
                warm, warm_s = sched, sim.time_s
                log.info("warm start candidate: %s (%.4g s)", label, sim.time_s)
        xe = solve_xengine(inst, solver=solver, mode=mode, options=options, warm_start=warm)
        out.results.insert(0, xe)
        out.xengine = xe
    return out
