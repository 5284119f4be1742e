"""The paper's comparison protocol (Schuler et al. 2022, section 6; DESIGN.md section 9).

XEngine gets budget ``b_d`` on every device ``d``; each single device runs Checkmate (and the
heuristics) alone with the same *total* memory ``sum_d b_d``, the other devices unused. The
gain is measured against the fastest single-device schedule that fits. XEngine is warm-started
from the fastest of: the single-device schedules that are also feasible at the per-device
budgets, and those schedules spread over the devices (:mod:`xengine.strategies.distribute`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from xengine.problem import Instance
from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, simulate
from xengine.solvers import SolverOptions
from xengine.strategies.distribute import start_candidates
from xengine.strategies.solve import solve_xengine

log = logging.getLogger(__name__)

HEURISTICS = ("checkpoint_all", "chen_sqrtn", "chen_greedy", "recompute_greedy")
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
    from baselines.heuristics import HEURISTICS as TABLE
    from baselines.lp_rounding import solve_lp_rounding

    if strategy == "checkmate":
        return solve_checkmate(inst, solver=solver, options=options)
    if strategy == "lp_rounding":
        return solve_lp_rounding(inst, options=options)
    if strategy not in TABLE:
        raise ValueError(
            f"unknown strategy {strategy!r}: choose from xengine, {', '.join(SINGLE_DEVICE)}"
        )
    return TABLE[strategy](inst)


def _what(res: StrategyResult, memory: str) -> str:
    return f"{res.strategy} on {res.devices[0]} ({memory} memory)"


def warm_start(
    inst: Instance,
    alone: Sequence[StrategyResult],
    solver: str = "highs",
    options: SolverOptions | None = None,
    mode: str = "exact",
    min_budget_bytes: int = 0,
) -> tuple[str, Schedule, float] | None:
    """XEngine's start on ``inst``: ``(what, schedule, predicted time)`` of the fastest valid
    schedule within the per-device budgets, found among

    1. ``alone``: the single-device schedules solved with the total memory, each embedded on
       its device (the paper's protocol computes them anyway), and (several devices)
       ``recompute_greedy`` on each device alone with that device's own budget: seconds and
       no solver (resnet50 at 50 %, H200 costs: 48.85 ms; the placed model of step 2 reached
       48.2-48.4 ms in 60 s), so a start exists even when step 2 runs out of time;
    2. (exact and intervals modes, several devices) those schedules and keep-everything
       spread over the devices, and XEngine's model restricted to the best spread's placement
       (:func:`xengine.strategies.distribute.start_candidates`; the run's time limit and gap);
    3. only when none of those fits: Checkmate and the heuristics on each device alone with
       that device's own budget (DESIGN.md section 6: each is a feasible point of XEngine's
       model), Checkmate with a quarter of the time limit and a 5 % gap: a start needs a good
       schedule, not a proof. Devices whose budget is below ``min_budget_bytes`` are skipped.

    ``None`` when nothing fits (the solver then starts cold).
    """
    options = options or SolverOptions()
    cands: list[tuple[float, str, Schedule]] = []

    def add(what: str, sched: Schedule) -> None:
        try:
            sim = simulate(inst, sched, check_budget=False)
        except ScheduleError:
            return
        if sim.within_budget:
            cands.append((float(sim.time_s), what, sched))

    for res in alone:
        if _fits(res):
            add(_what(res, "total"), res.schedule.on_devices(inst.devices))
    if inst.n_devices > 1:
        from baselines.heuristics import solve_recompute_greedy

        for d in range(inst.n_devices):
            if inst.budget_bytes[d] < min_budget_bytes:  # no schedule fits this device alone
                continue
            res = solve_recompute_greedy(inst.only_device(d, inst.budget_bytes[d]))
            if _fits(res):
                add(_what(res, "its own"), res.schedule.on_devices(inst.devices))
    if inst.n_devices > 1 and mode in ("exact", "intervals"):
        singles = [(_what(r, "total"), r.schedule) for r in alone if r.has_schedule]
        xe_solver = "cpsat" if mode == "intervals" else solver
        for what, sched in start_candidates(inst, singles, xe_solver, options, mode=mode):
            add(what, sched)
    if not cands and inst.n_devices > 1:
        opts = replace(
            options,
            time_limit_s=None if options.time_limit_s is None else options.time_limit_s / 4,
            rel_gap=max(options.rel_gap, 0.05),
        )
        for d in range(inst.n_devices):
            if inst.budget_bytes[d] < min_budget_bytes:  # no schedule fits this device alone
                continue
            sub = inst.only_device(d, inst.budget_bytes[d])
            for name in ("checkmate", *HEURISTICS):
                if name == "recompute_greedy":  # already tried above, with this budget
                    continue
                log.info("warm start: %s on %s alone with its own budget", name, sub.devices[0])
                try:
                    res = run_single_device(sub, name, solver=solver, options=opts)
                except Exception as exc:  # a start is optional
                    log.info("warm start candidate %s failed: %s", name, exc)
                    continue
                if res.schedule is not None:
                    add(_what(res, "its own"), res.schedule.on_devices(inst.devices))
    if not cands:
        return None
    t, what, sched = min(cands, key=lambda c: c[0])
    return what, sched, t


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
        start = warm_start(inst, out.results, solver, options, mode)
        warm = None
        if start is not None:
            log.info("warm start: %s (%.4g s)", start[0], start[2])
            warm = start[1]
        xe_solver = "cpsat" if mode == "intervals" else solver  # the interval model is CP-SAT's
        xe = solve_xengine(inst, solver=xe_solver, mode=mode, options=options, warm_start=warm)
        out.results.insert(0, xe)
        out.xengine = xe
    return out
