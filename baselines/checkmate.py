"""Checkmate's optimal single-device rematerialization MILP (Jain et al., MLSys 2020).

With one device, :func:`xengine.strategies.formulation.build` (mode ``exact``) is Checkmate's model:
binary R, S, FREE with the hazard-count linearisation, the memory recurrence U and the
objective sum C_i R[t,i]. This module adds what Checkmate does around the solve: a warm start
from the best heuristic that fits, and the final pass that re-derives R from the solver's S.
The solver's own schedule, its simulated figures and the model's objective and peak stay in
the result, so that the model can be held to the simulator.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

import numpy as np

from baselines.heuristics import (
    best_fitting,
    evaluate,
    hold_recomputations,
    keep_all_if_it_fits,
    require_one_device,
    run_heuristics,
)
from xengine import progress as status
from xengine.checkpoints import budget_range_message, schedule_from_checkpoints, solve_r_opt
from xengine.problem import Instance
from xengine.result import RelaxationRun, StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, simulate
from xengine.solvers import ProgressFn, SolverOptions, solve
from xengine.solvers.model import SOLUTION_STATUSES, MilpModel, SolveResult, relative_gap
from xengine.strategies.bounds import once_bound_s
from xengine.strategies.formulation import Formulation, build
from xengine.strategies.frontier import FRONTIER_SHARE, solve_frontier
from xengine.strategies.model_size import milp_memory_problem
from xengine.strategies.stage_cut import CUT_SHARE, stage_cut_bound
from xengine.strategies.start import never_slower

log = logging.getLogger(__name__)

TIME_RTOL = 1e-9
FLOOR_RTOL = 1e-7
"""The frontier bound handed to the MILP as a floor is lowered by this much, so that the
solver's tolerances never cut off the schedule that meets it."""


def _consistent(model, res) -> bool:
    """The returned point has the objective the solver reports for it."""
    return bool(np.isclose(model.objective(res.x), res.objective, rtol=1e-7, atol=1e-9))


HEURISTIC_SHARE = 0.25
"""Share of the time limit the seeding heuristics may use (``recompute_greedy`` alone took
471 s on a 1,549-node GPT-2 graph, past a 240 s limit)."""
HOLD_SHARE = 0.15
"""Share of the time limit that holding the seed's recomputations gets at least, even when
the heuristics used up their share: on GPT-2 with 24 layers (781 nodes, 50 %, 240 s) it got
the 6-9 s left of the heuristics' 60 s and held 33-56 values (6,095.76 -> 5,674.88 ms);
unlimited it held 122 values in 63 s (5,576.61 ms), most of the gain early."""


MILP_LEAST_SHARE = 0.2
"""The full MILP runs only when at least this share of the time limit is left after the start
and the bounds; otherwise the best schedule at hand answers with the bound proven so far."""


def solve_checkmate(
    inst: Instance,
    solver: str = "highs",
    options: SolverOptions | None = None,
    warm_start: bool = True,
    progress: ProgressFn | None = None,
    frontier: bool = True,
    stage_cut: bool = True,
    starts: Mapping[str, Schedule] | None = None,
) -> StrategyResult:
    """Solve Checkmate's MILP for a one-device instance.

    The start is the fastest fitting schedule among the heuristics (each computed once per
    run and costs, :func:`baselines.heuristics.computed_once`) and ``starts`` (label ->
    schedule: what the run's other rows on this device gave, PyTorch's policies translated
    included), its recomputations held (:func:`_held`); the answer is never slower than it
    (:func:`xengine.strategies.start.never_slower`), so the gap is measured from it at worst.

    With ``frontier`` (default) the frontier relaxation (:mod:`xengine.strategies.frontier`)
    runs first, for at most :data:`FRONTIER_SHARE` of the time limit: its bound holds for this model
    and is far tighter than the MILP's own (resnet18 b4 at 70 %: a gap of 0.82 % after 5 s, where
    the MILP alone ends at 4.72 % after 10 s and 4.15 % after 120 s; docs/measurements.md), and its
    solution is often a schedule that fits. When the best fitting schedule meets that bound, it is
    optimal and the MILP is not needed; otherwise the MILP starts from it, with the bound as a floor
    on its objective, for the rest of the limit (which counts from the start, heuristics included).
    ``warm_start=False`` gives neither model a start. Before the relaxation, the stage-cut bound
    (:mod:`xengine.strategies.stage_cut`, at most :data:`CUT_SHARE` of the limit) can prove the
    start optimal alone (hf_gpt2 at 50 %: within 0.3 % in 5 s, where the relaxation leaves 2 %
    after 150 s); ``stage_cut=False`` leaves it out, for side-by-side measurements.

    The returned schedule is the solver's S with R re-derived by :func:`solve_r_opt` (unused
    residents dropped first); ``extra`` keeps the solver's raw schedule and its simulation
    (``raw_schedule``, ``raw_sim``), which is what ``objective_s`` and ``model_peak_bytes``
    describe. Status is the solver's: optimal, feasible (limit hit, incumbent kept),
    infeasible (the message names the smallest feasible budget known), no_solution or error.
    """
    require_one_device(inst, "checkmate")
    options = options or SolverOptions()
    t_start = time.perf_counter()
    g = inst.graph
    budget = int(inst.budget_bytes[0])
    if budget < int(g.node_lower_bound_bytes(inst.devices[0]).max()):
        # some op's inputs and output alone exceed the budget: no model needs building
        return _infeasible(inst, solver, budget_range_message(g))

    answer = keep_all_if_it_fits(inst, "checkmate", solver)
    if answer is not None:  # nothing to solve
        return answer

    limit_s = options.time_limit_s
    heuristics_s = None if limit_s is None else limit_s * HEURISTIC_SHARE
    hold_s = None if limit_s is None else limit_s * HOLD_SHARE
    best, extra = _heuristic_seed(inst, heuristics_s, hold_s, starts)
    if not warm_start:
        best = None
    out = _solve_from(
        inst,
        solver,
        options,
        best,
        extra,
        t_start,
        progress,
        frontier=frontier,
        stage_cut=stage_cut,
    )
    stopped = out.extra.get("start_stopped") if out.extra is extra else extra.get("start_stopped")
    if stopped:  # said in the row, not only in the log
        said = f"the time limit stopped {' and '.join(stopped)} before they gave its start"
        out.message = f"{out.message}; {said}" if out.message else said
    if best is None:
        return out
    return never_slower(out, best.strategy, best.schedule, best.sim, options.rel_gap)


def _solve_from(
    inst: Instance,
    solver: str,
    options: SolverOptions,
    best: StrategyResult | None,
    extra: dict,
    t_start: float,
    progress: ProgressFn | None,
    frontier: bool,
    stage_cut: bool,
) -> StrategyResult:
    """The phases after the start ``best``: the stage cut, the frontier relaxation, the MILP
    (:func:`solve_checkmate`)."""
    warm_start = best is not None
    bound_s = None
    too_big = milp_memory_problem(inst.graph)
    if frontier:
        cut_s = _cut_phase(inst, options, best, extra, t_start, progress) if stage_cut else None
        if best is not None and _meets(best, cut_s, options.rel_gap):
            extra["bound_source"] = STAGE_CUT
            out = _frontier_answer(inst, solver, best, cut_s, options.rel_gap, extra, t_start)
            return _typed(out, extra)
        best, bound_s, done = _frontier_phase(
            inst, solver, options, best, progress, extra, t_start, too_big is not None, cut_s
        )
        if done is not None:
            return _typed(done, extra)
    remaining = options  # the limit holds for the whole strategy, heuristics included
    if options.time_limit_s is not None:
        left_s = options.time_limit_s - (time.perf_counter() - t_start)
        remaining = dataclasses.replace(options, time_limit_s=max(left_s, 1.0))
        if left_s < MILP_LEAST_SHARE * options.time_limit_s and best is not None and not too_big:
            # the start and the bounds used the limit: a MILP given what is left would only
            # overrun it (efficientnet_b0, 657,616 variables: 7.6 s for a 0.9 s remainder)
            spent = f"the {options.time_limit_s:g} s limit was spent on the start and the bounds"
            log.info("checkmate %s: the full MILP is not run: %s", inst.graph.name, spent)
            extra["milp_skipped"] = spent
            out = _frontier_answer(
                inst, solver, best, bound_s, options.rel_gap, extra, t_start, refused=spent
            )
            return _typed(out, extra)
    start = best if warm_start else None
    if too_big is not None:  # refused before it is built: the best schedule at hand answers
        log.warning("checkmate %s: the full MILP is not built: %s", inst.graph.name, too_big)
        extra["milp_refused"] = too_big
        if best is None:
            return _typed(_not_built(inst, solver, too_big, t_start, extra), extra)
        out = _frontier_answer(
            inst, solver, best, bound_s, options.rel_gap, extra, t_start, refused=too_big
        )
        return _typed(out, extra)
    out = _solve_milp(inst, solver, remaining, start, bound_s, progress, extra)
    extra["milp_solve_time_s"] = out.solve_time_s
    out.solve_time_s = time.perf_counter() - t_start  # the strategy's, heuristics included
    if not frontier:  # the MILP alone: its bound too is never below every op once (HiGHS
        # can be ended before its root: GPT-2 of 12 layers at 240 s reported no bound)
        bound_s, extra["bound_source"] = once_bound_s(inst), ONCE
    _apply_bound(out, bound_s, options.rel_gap, extra.get("bound_source", FRONTIER))
    if not out.has_schedule and best is not None and best.strategy == FRONTIER:
        out = _frontier_answer(inst, solver, best, bound_s, options.rel_gap, extra, t_start, out)
    return _typed(out, extra)


def _typed(res: StrategyResult, extra: dict) -> StrategyResult:
    """What other modules read of the phases' record, onto the result's typed fields."""
    res.frontier = extra.pop("frontier", None)
    res.warm_start = extra.pop("warm_start", None)
    res.time_to_first_s = extra.pop("time_to_first_s", None)
    extra.pop("bound_source", None)  # the phases' note; bound_from says what was reported
    return res


def _infeasible(inst: Instance, solver: str, why: str, **fields) -> StrategyResult:
    return StrategyResult(
        strategy="checkmate",
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="infeasible",
        solver=solver,
        message=f"no schedule of {inst.graph.name!r} fits {int(inst.budget_bytes[0])} bytes: "
        + why,
        **fields,
    )


def _not_built(
    inst: Instance, solver: str, why: str, t_start: float, extra: dict
) -> StrategyResult:
    return StrategyResult(
        strategy="checkmate",
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="no_solution",
        solver=solver,
        solve_time_s=time.perf_counter() - t_start,
        message=f"the full MILP was not built ({why}) and no other schedule fits",
        extra=extra,
    )


def _heuristic_seed(
    inst: Instance,
    time_limit_s: float | None = None,
    hold_s: float | None = None,
    starts: Mapping[str, Schedule] | None = None,
) -> tuple[StrategyResult | None, dict]:
    """The fastest schedule that fits among the heuristics and ``starts``, with its
    recomputations held where that helps (:func:`_held`): the solve's start; and what each
    gave. ``time_limit_s`` bounds the heuristics that take a limit and the holding pass
    together, except that the holding pass gets at least ``hold_s`` (:data:`HOLD_SHARE`). A
    heuristic stopped by its limit is said in the log: the start is then weaker than the
    heuristic would give."""
    g = inst.graph
    t_heur = time.perf_counter()
    deadline = None if time_limit_s is None else t_heur + time_limit_s
    heur = run_heuristics(inst, time_limit_s=time_limit_s)
    stopped = [r.strategy for r in heur if r.message.startswith("stopped by its time limit")]
    for res in heur:
        if res.strategy in stopped:
            log.warning("checkmate's start: %s %s", res.strategy, res.message)
    given = _given_starts(inst, starts or {})
    seed = best_fitting([*heur, *given])
    extra: dict = {}
    if seed is None:
        # near the smallest budget no heuristic fits; the memory-frugal schedule (no forward
        # checkpoints, gradients kept) often does and gives the solver a start
        frugal = evaluate(
            inst,
            "no_checkpoints",
            schedule_from_checkpoints(g, (), inst.devices[0]),
            time.perf_counter(),
        )
        if frugal.sim.within_budget:
            seed = frugal
    if seed is not None:
        if deadline is not None and hold_s is not None:
            deadline = max(deadline, time.perf_counter() + hold_s)
        seed = _held(inst, seed, deadline, extra)
    extra["heuristics_time_s"] = time.perf_counter() - t_heur
    if stopped:
        extra["start_stopped"] = stopped
    extra["heuristics"] = {
        r.strategy: {
            "time_s": r.sim.time_s,
            "peak_bytes": int(r.sim.peak_bytes.max()),
            "fits": r.sim.within_budget,
        }
        for r in (*heur, *given)
    }
    return seed, extra


def _given_starts(inst: Instance, starts: Mapping[str, Schedule]) -> list[StrategyResult]:
    """The run's other schedules for this device (label -> schedule), simulated on this
    instance's costs; one the simulator rejects is logged and left out."""
    out = []
    for label, sched in starts.items():
        t0 = time.perf_counter()
        try:
            out.append(evaluate(inst, label, sched, t0))
        except ScheduleError as exc:
            log.info("checkmate's start: %s is not a schedule of this instance: %s", label, exc)
    return out


def _held(
    inst: Instance, seed: StrategyResult, deadline: float | None, extra: dict
) -> StrategyResult:
    """``seed`` with its values held between computations where that fits and is faster
    (:func:`baselines.heuristics.hold_recomputations`), labelled ``<heuristic>+held``."""
    t0 = time.perf_counter()
    sched, sim, n_held, n_sims = hold_recomputations(inst, seed.schedule, seed.sim, deadline)
    extra["seed_held"] = {
        "from": seed.strategy,
        "from_time_s": seed.sim.time_s,
        "time_s": sim.time_s,
        "n_held": n_held,
        "n_simulations": n_sims,
        "time_spent_s": time.perf_counter() - t0,
    }
    if n_held == 0:
        return seed
    log.info(
        "checkmate seed: %s %.2f ms -> %.2f ms with %d values held (%.1f s)",
        seed.strategy,
        1e3 * seed.sim.time_s,
        1e3 * sim.time_s,
        n_held,
        time.perf_counter() - t0,
    )
    return evaluate(inst, seed.strategy + HELD, sched, t0, sim=sim)


HELD = "+held"
"""Suffix of a seed improved by :func:`_held`."""
FRONTIER = "frontier"
"""The label of a schedule read from the frontier relaxation's solution, and the source of
its bound."""
ONCE = "every op once"
"""The source of a bound that is :func:`~xengine.strategies.bounds.once_bound_s`."""
STAGE_CUT = "stage cut"
"""The source of a bound that is :func:`~xengine.strategies.stage_cut.stage_cut_bound`'s."""
BOUND_WORDS = {
    FRONTIER: "the frontier relaxation's bound",
    ONCE: "the bound of every op run once",
    STAGE_CUT: "the stage-cut bound",
}


def _meets(seed: StrategyResult, bound_s: float | None, rel_gap: float) -> bool:
    """``seed``'s time is within ``rel_gap`` of ``bound_s``."""
    if bound_s is None:
        return False
    gap = relative_gap(seed.sim.time_s, min(bound_s, seed.sim.time_s))
    return gap is not None and gap <= rel_gap


def _cut_phase(
    inst: Instance,
    options: SolverOptions,
    seed: StrategyResult | None,
    extra: dict,
    t_start: float,
    progress: ProgressFn | None = None,
) -> float | None:
    """The stage-cut bound (:mod:`xengine.strategies.stage_cut`) in at most :data:`CUT_SHARE`
    of the limit, and no more than is left of it; ``None`` when it has none. It stops early
    once it proves ``seed`` within the gap."""
    limit = options.time_limit_s
    if limit is not None:
        limit = max(min(limit * CUT_SHARE, limit - (time.perf_counter() - t_start)), 1.0)
    seed_s = None if seed is None else seed.sim.time_s
    status.report(phase="stage-cut bound", incumbent_s=seed_s)
    t0 = time.perf_counter()
    cut = stage_cut_bound(inst, dataclasses.replace(options, time_limit_s=limit), seed_s)
    if cut is None:
        return None
    extra["stage_cut"] = cut.record([v.name for v in inst.graph.nodes])
    status.report(incumbent_s=seed_s, bound_s=cut.bound_s)
    if progress is not None:
        progress(time.perf_counter() - t0, seed_s, cut.bound_s)
    return cut.bound_s


def _frontier_phase(
    inst: Instance,
    solver: str,
    options: SolverOptions,
    seed: StrategyResult | None,
    progress: ProgressFn | None,
    extra: dict,
    t_start: float,
    whole: bool = False,
    cut_s: float | None = None,
) -> tuple[StrategyResult | None, float | None, StrategyResult | None]:
    """Solve the frontier relaxation: ``(best start, the best bound in s, the final answer when
    it settles the instance)``; the bound is the larger of the relaxation's, the stage cut's
    (``cut_s``) and every op once. Its schedule replaces the start when it fits and is faster. It
    gets :data:`FRONTIER_SHARE` of the limit, never more than is left of it: the heuristics
    can outrun their share on large graphs (137 s for their 96 s at 48 GPT-2 layers, 240 s).
    With ``whole`` (the full MILP will not be built: too large for the host) it gets all that
    is left; otherwise the strategy would end at about half its limit with time unused."""
    limit = options.time_limit_s
    if limit is not None:
        left_s = limit - (time.perf_counter() - t_start)
        limit = max(left_s if whole else min(limit * FRONTIER_SHARE, left_s), 1.0)
    fr_options = dataclasses.replace(options, time_limit_s=limit)
    seed_s = None if seed is None else seed.sim.time_s

    def shown(elapsed_s: float, _relaxed: float | None, bound: float | None) -> None:
        # the relaxation's own incumbents are not schedules: the incumbent shown is the start;
        # the bound shown is never below the stage cut's, proven before
        if cut_s is not None and (bound is None or bound < cut_s):
            bound = cut_s
        status.report(incumbent_s=seed_s, bound_s=bound)
        if progress is not None:
            progress(elapsed_s, seed_s, bound)

    status.report(phase="frontier relaxation", incumbent_s=seed_s)
    fr = solve_frontier(
        inst, solver, fr_options, start=None if seed is None else seed.schedule, progress=shown
    )
    info = RelaxationRun(
        fr.status, fr.bound_s, fr.solve_time_s, fr.build_time_s, fr.n_vars, fr.n_rows
    )
    extra["frontier"] = info  # onto the result by _typed
    if fr.status == "infeasible":
        if seed is None:
            why = "the frontier relaxation of Checkmate's model "
            why += "(xengine/strategies/frontier.py) is "
            why += "infeasible; " + budget_range_message(
                inst.graph, infeasible_at=int(inst.budget_bytes[0])
            )
            res = _infeasible(inst, solver, why, n_vars=fr.n_vars, n_rows=fr.n_rows)
            res.solve_time_s = time.perf_counter() - t_start
            res.extra = extra
            return None, None, res
        log.warning("the frontier relaxation is infeasible, yet %s fits", seed.strategy)
        info.contradiction = seed.strategy
        return seed, None, None
    if fr.S is not None:
        t0 = time.perf_counter()
        sched = solve_r_opt(inst.graph, fr.S, inst.devices[0], drop_unused=True)
        cand = evaluate(inst, FRONTIER, sched, t0)
        info.schedule_time_s, info.schedule_fits = cand.sim.time_s, cand.sim.within_budget
        if cand.sim.within_budget and (seed is None or cand.sim.time_s < seed.sim.time_s):
            seed = cand
    # the relaxation's when it proved one; every op once when it proved nothing in time
    found = [(b, src) for b, src in ((fr.bound_s, FRONTIER), (cut_s, STAGE_CUT)) if b is not None]
    once_s = once_bound_s(inst)
    found += [(once_s, ONCE)] if once_s is not None else []
    bound_s, source = max(found, key=lambda f: f[0], default=(None, FRONTIER))
    if source != FRONTIER:
        extra["bound_source"] = source
    if seed is not None and _meets(seed, bound_s, options.rel_gap):
        answer = _frontier_answer(inst, solver, seed, bound_s, options.rel_gap, extra, t_start)
        return seed, bound_s, answer
    return seed, bound_s, None


def _frontier_answer(
    inst: Instance,
    solver: str,
    seed: StrategyResult,
    bound_s: float | None,
    rel_gap: float,
    extra: dict,
    t_start: float,
    milp: StrategyResult | None = None,
    refused: str | None = None,
) -> StrategyResult:
    """The best schedule at hand as Checkmate's answer: optimal when it meets the frontier
    bound (no MILP run), else feasible (the MILP ran and found nothing better, or was
    ``refused``: too large to build here)."""
    time_s = seed.sim.time_s
    bound = None if bound_s is None else min(bound_s, time_s)
    gap = relative_gap(time_s, bound)
    optimal = gap is not None and gap <= rel_gap
    extra["warm_start"] = extra.get("warm_start", seed.strategy)
    source = extra.get("bound_source", FRONTIER)
    if bound is not None:
        extra["bound_from"] = source
    if refused is not None:
        message = f"the full MILP was not built ({refused}); kept the {seed.strategy} schedule"
    elif milp is None and source == FRONTIER:
        message = (
            f"proven optimal by the frontier relaxation (xengine/strategies/frontier.py): the "
            f"{seed.strategy} schedule meets its bound, so the full MILP was not run"
        )
    elif milp is None:
        message = (
            f"proven optimal: the {seed.strategy} schedule meets {BOUND_WORDS[source]}, so "
            "the full MILP was not run"
        )
    else:
        message = (
            f"the full MILP ended without a schedule ({milp.message}); "
            f"kept the {seed.strategy} schedule"
        )
    out = StrategyResult(
        strategy="checkmate",
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="optimal" if optimal else "feasible",
        schedule=seed.schedule,
        sim=seed.sim,
        solver=solver,
        solve_time_s=time.perf_counter() - t_start,
        objective_s=time_s,
        best_bound_s=bound,
        gap=gap,
        message=message,
        extra=extra,
    )
    fr = extra.get("frontier")
    size = (milp.n_vars, milp.n_rows) if milp else (fr.n_vars, fr.n_rows) if fr else (None, None)
    out.n_vars, out.n_rows = size
    log.info("checkmate %s: %s (%s)", inst.graph.name, out.status, message)
    return out


def _apply_bound(
    out: StrategyResult, bound_s: float | None, rel_gap: float, source: str = FRONTIER
) -> None:
    """Report the bound from before the MILP (the frontier relaxation's, or :data:`ONCE`)
    where it beats the MILP's; an incumbent that meets it is proven optimal."""
    if bound_s is None or out.objective_s is None or out.status not in SOLUTION_STATUSES:
        return
    if out.best_bound_s is None or bound_s > out.best_bound_s:
        out.best_bound_s = min(bound_s, out.objective_s)
        out.gap = relative_gap(out.objective_s, out.best_bound_s)
        out.extra["bound_from"] = source
        if out.status == "feasible" and out.gap is not None and out.gap <= rel_gap:
            out.status = "optimal"
            out.message = f"optimal: the schedule meets {BOUND_WORDS[source]}"


def _solve_milp(
    inst: Instance,
    solver: str,
    options: SolverOptions,
    seed: StrategyResult | None,
    bound_s: float | None,
    progress: ProgressFn | None,
    extra: dict,
) -> StrategyResult:
    """Checkmate's MILP itself, from ``seed`` (a fitting schedule, or None), with ``bound_s``
    (a proven bound, or None) as a floor on its objective."""
    g = inst.graph
    form = build(inst, mode="exact")
    model = form.model
    if bound_s is not None:
        model = model.with_floor(bound_s / form.time_scale * (1 - FLOOR_RTOL))
    x0 = _milp_start(form, model, seed, extra)

    status.report(phase="MILP")
    progress = _shown(progress, form.time_scale, bound_s)
    res, solve_time_s = _solve_checked(g.name, model, solver, options, x0, progress, extra)
    out = StrategyResult(
        strategy="checkmate",
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status=res.status,
        solver=res.solver,
        solve_time_s=solve_time_s,
        build_time_s=form.build_time_s,
        best_bound_s=(res.best_bound * form.time_scale if res.best_bound is not None else None),
        gap=res.gap,
        n_vars=model.n_vars,
        n_rows=model.n_rows,
        n_integer=model.n_integer,
        extra=extra,
    )
    extra.update(
        solver_message=res.message, time_to_first_s=res.time_to_first_s, n_nodes=res.n_nodes
    )
    log.info(
        "checkmate %s: the MILP ended %s in %.2f s (build %.2f s), %d vars, %d rows",
        g.name,
        res.status,
        res.solve_time_s,
        form.build_time_s,
        model.n_vars,
        model.n_rows,
    )
    if not res.has_solution:
        out.message = _no_solution_message(inst, res, seed)
        if res.status == "infeasible" and seed is not None:
            out.status = "error"
        return out
    if not _consistent(model, res):
        out.status = "error"
        out.message = (
            f"solver {res.solver} reports objective {res.objective:.9g} but its solution "
            f"costs {model.objective(res.x):.9g}"
        )
        return out
    _read_schedule(inst, form, res.x, out, extra)
    return out


def _milp_start(
    form: Formulation, model: MilpModel, seed: StrategyResult | None, extra: dict
) -> np.ndarray | None:
    """The seed schedule as a complete assignment of the model (None without a seed); a
    seed the model rejects is still handed over, and ``extra`` says by how much it breaks a
    row (the model and the simulator would disagree on a valid schedule)."""
    if seed is None:
        return None
    x0 = form.assignment(seed.schedule)
    viol = model.max_violation(x0)
    extra["warm_start"] = seed.strategy
    extra["warm_start_time_s"] = seed.sim.time_s
    if viol > 1e-6:
        log.warning("warm start from %s violates the model by %.3g", seed.strategy, viol)
        extra["warm_start_violation"] = viol
    return x0


def _solve_checked(
    name: str,
    model: MilpModel,
    solver: str,
    options: SolverOptions,
    x0: np.ndarray | None,
    progress: ProgressFn,
    extra: dict,
) -> tuple[SolveResult, float]:
    """Solve, and solve again without the start where the answer is not what the solver says.

    HiGHS 1.16 can report the optimum of its presolved model yet hand back the MIP start as
    the solution (seen on chain(3) at 4000 bytes: objective 10, x costs 12). Returns the
    result kept and the seconds of both solves."""
    res = solve(model, solver, options, warm_start=x0, progress=progress)
    solve_time_s = res.solve_time_s
    if x0 is not None and res.has_solution and not _consistent(model, res):
        log.warning(
            "%s: solver %s reports objective %.9g but its solution costs %.9g; "
            "solving again without the warm start",
            name,
            res.solver,
            res.objective,
            model.objective(res.x),
        )
        extra["warm_start_discarded"] = (
            f"solver reported {res.objective:.9g} for a solution costing "
            f"{model.objective(res.x):.9g}"
        )
        res = solve(model, solver, options, warm_start=None, progress=progress)
        solve_time_s += res.solve_time_s
    return res, solve_time_s


def _no_solution_message(inst: Instance, res: SolveResult, seed: StrategyResult | None) -> str:
    """Why the MILP gave no schedule. An infeasible answer with a fitting seed means the
    model is wrong for this graph (the caller makes that an error)."""
    g = inst.graph
    budget = int(inst.budget_bytes[0])
    if res.status == "infeasible":
        if seed is not None:
            return (
                f"solver {res.solver} reports budget {budget} bytes infeasible, yet the "
                f"{seed.strategy} schedule fits it (peak {int(seed.sim.peak_bytes.max())} "
                "bytes): the model is wrong for this graph"
            )
        return f"no schedule of {g.name!r} fits {budget} bytes: " + (
            budget_range_message(g, infeasible_at=budget)
        )
    hint = f"; best heuristic that fits: {seed.strategy}" if seed is not None else ""
    return f"solver {res.solver}: {res.status} ({res.message}){hint}"


def _read_schedule(
    inst: Instance, form: Formulation, x: np.ndarray, out: StrategyResult, extra: dict
) -> None:
    """The solver's point as ``out``'s schedule: its raw schedule simulated (kept in
    ``extra``), then R re-derived from its S by Checkmate's pass, which never costs time or
    memory. A raw schedule the simulator rejects or finds over the budget is an error; an
    objective other than the simulated time is said in the message."""
    g = inst.graph
    out.objective_s = form.objective_s(x)
    out.model_peak_bytes = form.peak_bytes(x)
    raw = form.schedule_from(x)
    try:
        raw_sim = simulate(inst, raw, check_budget=False)
    except ScheduleError as exc:
        out.status = "error"
        out.message = f"the solver's schedule is invalid for the simulator: {exc}"
        return
    extra.update(
        raw_schedule=raw,
        raw_sim=raw_sim,
        raw_time_s=raw_sim.time_s,
        raw_peak_bytes=int(raw_sim.peak_bytes.max()),
    )

    final = solve_r_opt(g, raw.S, inst.devices[0], drop_unused=True, S_state=raw.S_state)
    sim = simulate(inst, final, check_budget=False)
    assert sim.time_s <= raw_sim.time_s * (1 + TIME_RTOL) + 1e-12, (sim.time_s, raw_sim.time_s)
    assert int(sim.peak_bytes.max()) <= int(raw_sim.peak_bytes.max()), (
        sim.peak_bytes,
        raw_sim.peak_bytes,
    )
    out.schedule, out.sim = final, sim
    if not raw_sim.within_budget:
        out.status = "error"
        out.message = (
            f"the solver's schedule breaks the budget in the simulator: {raw_sim.violations[0]}"
        )
    elif not np.isclose(out.objective_s, raw_sim.time_s, rtol=1e-6, atol=1e-9):
        out.message = (
            f"model objective {out.objective_s:.6g} s differs from the simulated "
            f"{raw_sim.time_s:.6g} s"
        )
        log.warning("%s: %s", g.name, out.message)


def _shown(
    progress: ProgressFn | None, time_scale: float, proven_s: float | None = None
) -> ProgressFn:
    """The solver's progress in seconds, to ``progress`` and to the live status line, its
    bound never below ``proven_s`` (the frontier relaxation's, which the final gap uses: the
    MILP's own bound can stay below it for minutes, and the line would show a gap of 2.4 %
    where 0.7 % is proven, as on hf_gpt2 at 70 %)."""

    def report(elapsed_s: float, incumbent: float | None, bound: float | None) -> None:
        inc_s = None if incumbent is None else incumbent * time_scale
        bound_s = None if bound is None else bound * time_scale
        if proven_s is not None and (bound_s is None or bound_s < proven_s):
            bound_s = proven_s if inc_s is None else min(proven_s, inc_s)
        status.report(incumbent_s=inc_s, bound_s=bound_s)
        if progress is not None:
            progress(elapsed_s, inc_s, bound_s)

    return report
