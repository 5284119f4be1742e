"""XEngine as a strategy: build the model, warm-start it, solve, check with the simulator."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from xengine import progress
from xengine.problem import Instance
from xengine.result import RelaxationRun, StrategyResult, check_with_simulator
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, simulate
from xengine.solvers import QUADRATIC_CAPABLE, SolverOptions, SolverUnavailable, solve
from xengine.solvers.model import MilpModel, SolveResult, relative_gap
from xengine.strategies.formulation import Formulation, build, default_free_rows
from xengine.strategies.model_size import milp_memory_problem
from xengine.strategies.start import never_slower

log = logging.getLogger(__name__)


class _ProgressLog:
    """The progress callback of one solve: logs each new incumbent (and a moved bound at
    most every :data:`BOUND_LOG_INTERVAL_S`), and keeps every report, in seconds, as
    ``points`` = [(elapsed_s, incumbent_s or None, bound_s or None)]: the gap over time that
    ``experiments/solver_benchmark.py`` turns into time-to-gap columns."""

    def __init__(self, label: str, scale: float) -> None:
        self.label, self.scale = label, scale
        self.points: list[tuple[float, float | None, float | None]] = []
        self._logged_incumbent: float | None = None
        self._logged_at_s = -np.inf

    def __call__(self, elapsed_s: float, incumbent: float | None, bound: float | None) -> None:
        incumbent = None if incumbent is None else incumbent * self.scale
        bound = None if bound is None else bound * self.scale
        self.points.append((float(elapsed_s), incumbent, bound))
        progress.report(incumbent_s=incumbent, bound_s=bound)
        new_incumbent = incumbent is not None and incumbent != self._logged_incumbent
        if not new_incumbent and elapsed_s - self._logged_at_s < BOUND_LOG_INTERVAL_S:
            return
        self._logged_incumbent, self._logged_at_s = incumbent, elapsed_s
        gap = None
        if incumbent is not None and bound is not None and incumbent:
            gap = abs(incumbent - bound) / abs(incumbent)
        log.info(
            "%s: %.1f s incumbent %s bound %s gap %s",
            self.label,
            elapsed_s,
            f"{incumbent:.6g}" if incumbent is not None else "-",
            f"{bound:.6g}" if bound is not None else "-",
            f"{100 * gap:.2f}%" if gap is not None else "-",
        )


BOUND_LOG_INTERVAL_S = 30.0


def solve_xengine(
    inst: Instance,
    solver: str = "highs",
    formulation: str = "exact",
    options: SolverOptions | None = None,
    warm_start: Schedule | None = None,
    strategy: str = "xengine",
    build_options: dict | None = None,
    placement: np.ndarray | None = None,
    builder: Callable[..., Formulation] = build,
    frontier: bool = True,
) -> StrategyResult:
    """Solve the heterogeneous model on ``inst`` (docs/design.md section 6).

    ``warm_start`` is any valid schedule on the same devices (typically the best single-device
    Checkmate schedule embedded with :meth:`Schedule.on_devices`); exact mode passes it to the
    solver as a MIP start. The returned schedule is replayed by the simulator; the model's own
    objective and peak are kept beside the simulator's figures. ``build_options`` go to
    ``builder`` (``free_rows``); formulation ``exact`` gets the FREE rows of
    :func:`~xengine.strategies.formulation.default_free_rows` for ``solver`` unless they say
    otherwise. ``builder`` is :func:`xengine.strategies.formulation.build` unless a caller
    measures another written form of the same model (``experiments/formulation_variants.py``),
    with the same arguments.

    ``placement`` (one device index per node, or -1 for a node left free) restricts the model:
    node ``i`` is computed and kept on ``placement[i]`` only (copies to other devices stay free
    to choose). The optimum of
    that smaller model is a feasible multi-device schedule, which is how
    :mod:`xengine.strategies.distribute` turns a placement into a start for the full model.

    With ``frontier`` (default), several devices, ``formulation="exact"`` and no placement, the
    frontier relaxation over the devices (:mod:`xengine.strategies.device_frontier`) runs first,
    for at most :data:`DEVICE_FRONTIER_SHARE` of the limit, as in Checkmate's solve: its bound
    holds for the whole problem and its solution, read back, is a schedule that often fits.
    When the best schedule meets its bound, that is the answer (optimal, no MILP); else the
    MILP starts from it with the bound as a floor, for the rest of the limit. On resnet18 b8
    over CPU + H200 (version-1 graphs, 50 %) the relaxation proves the optimum in 15 s, where
    the MILP alone took 25 minutes (docs/measurements.md).

    ``formulation="intervals"`` solves the retention-interval model of
    :mod:`xengine.strategies.intervals` instead (``solver`` must be ``cpsat``; ``build_options``
    may give ``max_computes`` and ``lp_bound=False``, which skips the LP relaxation where it is
    known not to solve in time, or ``lp_bound="alongside"``, which computes it in another
    process during the search).
    """
    options = options or SolverOptions()
    res = _solve(
        inst, solver, formulation, options, warm_start, strategy, build_options, placement,
        builder, frontier,
    )  # fmt: skip
    start_sim = None if warm_start is None else _fitting_sim(inst, warm_start)
    if start_sim is None or placement is not None:  # a restricted model answers for itself
        return res
    return never_slower(res, "the warm start", warm_start, start_sim, options.rel_gap)


def _solve(
    inst: Instance,
    solver: str,
    formulation: str,
    options: SolverOptions,
    warm_start: Schedule | None,
    strategy: str,
    build_options: dict | None,
    placement: np.ndarray | None,
    builder: Callable[..., Formulation],
    frontier: bool,
) -> StrategyResult:
    """:func:`solve_xengine` before its answer is held to its start."""
    if warm_start is not None and placement is None:
        done = _start_meets_bound(inst, warm_start, solver, options, strategy)
        if done is not None:  # nothing to solve
            return done
    if formulation == "intervals":
        return _solve_intervals(
            inst, solver, options, warm_start, strategy, build_options, placement
        )
    t0 = time.perf_counter()
    relaxed, refused = None, None
    if frontier and formulation == "exact" and placement is None and inst.n_devices > 1:
        relaxed, refused = _relax_first(inst, solver, options, warm_start, strategy)
    if relaxed is not None:
        if relaxed.answer is not None:
            return relaxed.answer
        warm_start = relaxed.start
        if options.time_limit_s is not None:  # the limit holds for the whole solve
            left_s = max(options.time_limit_s - (time.perf_counter() - t0), 1.0)
            options = dataclasses.replace(options, time_limit_s=left_s)
    linearize = solver not in QUADRATIC_CAPABLE
    build_options = dict(build_options or {})
    if formulation == "exact":
        build_options.setdefault("free_rows", default_free_rows(solver))
        tight = build_options["free_rows"] == "tight"
        too_big = milp_memory_problem(inst.graph, n_devices=inst.n_devices, tight_rows=tight)
        if too_big is not None:
            res = _not_built(inst, solver, options, warm_start, strategy, too_big, t0, relaxed)
            if refused is not None:
                res.extra["frontier_refused"] = refused
            return res
    form = builder(inst, mode=formulation, linearize=linearize, **build_options)
    if placement is not None:
        _restrict(form, placement)
    model, x0 = _model_and_start(form, warm_start if formulation == "exact" else None, relaxed)
    res = _unsolved(inst, strategy, solver, form, model, linearize, build_options)
    if refused is not None:
        res.extra["frontier_refused"] = refused
    if form.blocked is not None:
        return _blocked(res, form.blocked, strategy)
    trace = _ProgressLog(strategy, form.time_scale)
    if relaxed is not None:
        progress.report(phase="MILP")
    sr = solve(model, solver, options, warm_start=x0, progress=trace)
    _record_solve(res, sr, form, trace, relaxed, t0)
    if sr.x is None:
        log.info("%s: %s after %.1f s", strategy, sr.status, sr.solve_time_s)
        return res
    _read_solution(res, sr, form, inst, options, relaxed, placement is None, t0)
    return res


def _unsolved(
    inst: Instance,
    strategy: str,
    solver: str,
    form: Formulation,
    model: MilpModel,
    linearize: bool,
    build_options: dict,
) -> StrategyResult:
    """The result before the solve: the model's size and how it was written, status
    ``error`` until the solve says otherwise."""
    return StrategyResult(
        strategy=strategy,
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="error",
        solver=solver,
        build_time_s=form.build_time_s,
        n_vars=model.n_vars,
        n_rows=model.n_rows,
        n_integer=model.n_integer,
        nnz=int(model.A.nnz),
        extra={
            "mode": form.mode,
            "linearized": bool(linearize and form.mode == "paper"),
            "build_options": build_options,
        },
    )


def _read_solution(
    res: StrategyResult,
    sr: SolveResult,
    form: Formulation,
    inst: Instance,
    options: SolverOptions,
    relaxed: _Relaxed | None,
    whole_model: bool,
    t0: float,
) -> None:
    """The solver's point onto ``res``: the model's own objective and peak, a placement bound
    where the solve stopped short of optimal on the whole model (not a placement-restricted
    one), and the simulator's verdict on the schedule read back."""
    res.objective_s = form.objective_s(sr.x)
    res.model_peak_bytes = form.peak_bytes(sr.x)
    if whole_model and sr.status == "feasible":
        _tighten_with_placement_bound(res, inst, options, relaxed)
    check_with_simulator(
        res,
        inst,
        form.schedule_from(sr.x),
        "solver",
        form.mode == "exact",
        time.perf_counter() - t0,
    )


def _model_and_start(form: Formulation, warm_start: Schedule | None, relaxed: _Relaxed | None):
    """The model to solve (with the frontier relaxation's bound as a floor on its objective,
    where one ran) and the warm start as an assignment of its variables (None where there is
    none, or where it violates the model: a start the model rejects is logged, not used)."""
    x0 = None
    if warm_start is not None:
        x0 = form.assignment(warm_start)
        viol = form.model.max_violation(x0)
        if viol > 1e-6:
            log.warning("warm start violates the model by %.3g; not used", viol)
            x0 = None
    model = form.model
    if relaxed is not None and relaxed.bound_s is not None:
        model = model.with_floor(relaxed.bound_s / form.time_scale * (1 - FLOOR_RTOL))
    return model, x0


def _blocked(res: StrategyResult, blocked: tuple[int, int], strategy: str) -> StrategyResult:
    """``res`` as the answer when a node needs more than any device's budget: infeasible,
    with the least budget that could fit it, before any solve."""
    node, need = blocked
    res.status = "infeasible"
    res.message = (
        f"infeasible: node {node} needs {need} bytes (inputs + output + workspace) on one "
        f"device, more than any device's budget; every budget must be at least {need} bytes"
    )
    res.extra["min_budget_lower_bound_bytes"] = need
    log.info("%s: %s", strategy, res.message)
    return res


def _record_solve(res, sr, form: Formulation, trace, relaxed: _Relaxed | None, t0: float) -> None:
    """The solver's answer into ``res``: status, gap, bound, and the trace (the relaxation's
    reports first, where one ran, then the MILP's, ending where the solve ended). Where a
    relaxation ran, the solve time is the whole solve's, as Checkmate reports it, and the
    MILP's own is kept apart."""
    if sr.objective is not None or sr.best_bound is not None:  # where the solve ended
        end = (sr.objective, sr.best_bound)
        trace.points.append(
            (sr.solve_time_s, *(None if v is None else float(v) * form.time_scale for v in end))
        )
    res.trace = trace.points
    res.status = sr.status
    res.solve_time_s = sr.solve_time_s
    if relaxed is not None:
        res.frontier = relaxed.info
        res.trace = relaxed.points + [(relaxed.elapsed_s + e, i, b) for e, i, b in trace.points]
        res.extra["milp_solve_time_s"] = sr.solve_time_s
        res.solve_time_s = time.perf_counter() - t0
    res.message = "" if sr.status == "optimal" else sr.message
    res.gap = sr.gap
    res.time_to_first_s = sr.time_to_first_s
    if sr.best_bound is not None:
        res.best_bound_s = float(sr.best_bound) * form.time_scale


def _not_built(
    inst: Instance,
    solver: str,
    options: SolverOptions,
    start: Schedule | None,
    strategy: str,
    why: str,
    t0: float,
    relaxed: _Relaxed | None = None,
) -> StrategyResult:
    """The answer when the model would not fit in the host's memory
    (:mod:`xengine.strategies.model_size`, issue 30 item 5): refused before it is built, the
    start (when it fits) is kept, with the best bound at hand beside it (the placement
    bound's, or the frontier relaxation's)."""
    log.warning("%s %s: the model is not built: %s", strategy, inst.graph.name, why)
    res = StrategyResult(
        strategy=strategy,
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="no_solution",
        solver=solver,
        message=f"XEngine's model was not built ({why}) and no start fits",
        extra={"milp_refused": why},
    )
    sim = _fitting_sim(inst, start)
    if sim is not None:
        res.status, res.schedule, res.sim, res.objective_s = "feasible", start, sim, sim.time_s
        res.message = f"XEngine's model was not built ({why}); kept the start"
        _tighten_with_placement_bound(res, inst, options, relaxed)
    if relaxed is not None:
        res.frontier = relaxed.info
    res.solve_time_s = time.perf_counter() - t0
    return res


def _start_meets_bound(
    inst: Instance, start: Schedule, solver: str, options: SolverOptions, strategy: str
) -> StrategyResult | None:
    """The start, proven optimal without a solve, when its simulated time meets the placement
    bound (:func:`xengine.strategies.bounds.placement_bound_s`, a fraction of a second) within the
    relative gap: with memory to spare the keep-everything schedule on the fastest device
    often does. ``None`` otherwise (or when the start does not fit)."""
    from xengine.strategies.bounds import placement_bound_s

    t0 = time.perf_counter()
    sim = _fitting_sim(inst, start)
    if sim is None:
        return None
    bound = placement_bound_s(inst, options)
    if bound is None or sim.time_s > bound * (1 + options.rel_gap) + 1e-12:
        return None
    why = (
        "the start meets the placement bound (no memory limit can make a schedule faster than "
        "that): no solver run"
    )
    res = _start_proven(inst, strategy, solver, start, sim, bound, why, t0)
    res.nothing_to_solve, res.placement_bound_s = True, bound
    return res


def _start_proven(
    inst: Instance,
    strategy: str,
    solver: str,
    start: Schedule,
    sim,
    bound_s: float,
    message: str,
    t0: float,
) -> StrategyResult:
    """The start as the answer, proven optimal by ``bound_s`` (its simulation ``sim``)."""
    res = StrategyResult(
        strategy=strategy,
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="optimal",
        schedule=start,
        sim=sim,
        solver=solver,
        solve_time_s=time.perf_counter() - t0,
        objective_s=sim.time_s,
        best_bound_s=min(bound_s, sim.time_s),
        message=message,
    )
    res.gap = relative_gap(sim.time_s, res.best_bound_s)
    log.info("%s: %s (%.6g s)", strategy, res.message, sim.time_s)
    return res


def _tighten_with_placement_bound(
    res: StrategyResult,
    inst: Instance,
    options: SolverOptions,
    relaxed: _Relaxed | None = None,
) -> None:
    """A MILP stopped at its limit: its bound may be weaker than the placement bound
    (:func:`xengine.strategies.bounds.placement_bound_s`, valid for the whole problem, a fraction of
    a second) or the frontier relaxation's (``relaxed``). Report the best one; an incumbent that
    meets it is proven optimal."""
    from xengine.strategies.bounds import placement_bound_s

    bound = placement_bound_s(inst, options)
    res.placement_bound_s = bound
    what = "the placement bound"
    if relaxed is not None and relaxed.bound_s is not None:
        if bound is None or relaxed.bound_s > bound:
            bound, what = relaxed.bound_s, relaxed.bound_from
    if bound is None or res.objective_s is None:
        return
    if res.best_bound_s is None or bound > res.best_bound_s:
        res.best_bound_s = min(bound, res.objective_s)
        res.gap = relative_gap(res.objective_s, res.best_bound_s)
        res.extra["bound_from"] = what
        if res.gap is not None and res.gap <= options.rel_gap:
            res.status = "optimal"
            res.message = f"optimal: the schedule meets {what}"


DEVICE_FRONTIER_SHARE = 0.75
"""Of the time limit, what the frontier relaxation over several devices may use before the
MILP. More than Checkmate's half: on resnet18 b8 over CPU + H200 (version-2 graphs, 55 %) the
relaxation needs 74 s to prove its optimum, whose schedule fits, while the full MILP never
left its start in 60 or 120 s (docs/measurements.md, "Two devices: the frontier relaxation")."""
DEVICE_FRONTIER_MAX_NONZEROS = 1_000_000
"""The relaxation over several devices runs only where its estimated nonzeros
(:func:`xengine.strategies.model_size.frontier_nonzeros`, step rows aside) are at most this:
resnet18 b8 (0.3 M) is proven in 40-70 s, while on GPT-2 with 12 layers over ``cpu2+cpu1`` (2.6
M) the relaxation gave no bound in its 225 s of 300 and left the MILP 75 s, too little for its
root (docs/measurements.md). On resnet50 (2.1 M) and mobilenet_v2 (1.6 M) over CPU + H200 at
50 % it gave no bound in 97 s of 120; above the cap its LP runs on PDLP instead
(:data:`DEVICE_FRONTIER_LP_SHARE`)."""
DEVICE_FRONTIER_LP_SHARE = 0.75
"""Of the time limit, what the LP bound of the relaxation (PDLP) gets where the relaxation is
too large to solve as a MILP. GPT-2 with 12 layers over ``cpu2+cpu1`` at 50 %, 300 s limit
(docs/measurements.md): PDLP's bound after 150 s is 3,953 ms, where the MILP alone, given the
whole 300 s, proved nothing above every op once (3,742 ms) and kept its start (4,314.67 ms), as
it did with the other 150 s: the gap reported fell from 13.25 % to 8.37 %. Over CPU + H200 at
50 %, 120 s: resnet50 6.35 % -> 3.90 %, mobilenet_v2 5.04 % -> 2.08 %, the same schedules.
Half the limit until 2026-12-07; three quarters since the warm start counts against the limit
(:meth:`xengine.protocol.Job.settings`): on GPT-2 the solve then got 185 s of 300, PDLP's half
of it bounded at 3,884.88 ms (gap 9.07 %), and the MILP after it, as in every run above the
cap, kept its start."""
FLOOR_RTOL = 1e-7
"""The relaxation's bound handed to the MILP as a floor is lowered by this much, so that the
solver's tolerances never cut off the schedule that meets it."""


@dataclasses.dataclass
class _Relaxed:
    """What the frontier phase leaves: the best start (the caller's, or the relaxation's
    schedule where that fits and is faster), the proven bound, the run's record, its
    reports, and the answer when the phase settled the instance."""

    start: Schedule | None
    bound_s: float | None
    info: RelaxationRun
    points: list[tuple[float, float | None, float | None]]
    elapsed_s: float
    answer: StrategyResult | None = None
    bound_from: str = "the frontier relaxation's bound"


STAGE_CUT = "the stage-cut bound"


def _relax_first(
    inst: Instance, solver: str, options: SolverOptions, start: Schedule | None, strategy: str
) -> tuple[_Relaxed | None, str | None]:
    """The stage cut, then the frontier phase where it pays and fits the host: ``(what they
    left, None)``, or ``(None, why it was refused)``. The stage cut's bound replaces the
    relaxation's where it is higher; a start that meets it is the answer, with no relaxation."""
    pays = _frontier_pays(inst)
    refused = _frontier_refused(inst, steps=pays)
    if refused is not None:
        return None, refused
    cut = _stage_cut_phase(inst, solver, options, start, strategy)
    if cut is not None and cut.answer is not None:
        return cut, None
    if not pays:
        relaxed = _lp_phase(inst, options, start, strategy)
    else:
        relaxed = _frontier_phase(inst, solver, options, start, strategy)
    higher = cut is not None and (relaxed.bound_s is None or cut.bound_s > relaxed.bound_s)
    if higher and relaxed.answer is None:  # an answer stands: proven, or infeasible
        relaxed.bound_s, relaxed.bound_from = cut.bound_s, STAGE_CUT
        relaxed.points.append((relaxed.elapsed_s, cut.points[-1][1], cut.bound_s))
    return relaxed, None


def _stage_cut_phase(
    inst: Instance, solver: str, options: SolverOptions, start: Schedule | None, strategy: str
) -> _Relaxed | None:
    """The stage-cut bound for at most :data:`~xengine.strategies.stage_cut.CUT_SHARE` of the
    limit (``None`` when it has none); with the answer when the start meets it within the gap.
    On resnet18 b8 over CPU + H200 it proves the optimum at 60 and 70 % (and on the version-1
    graph at 50 %), where the relaxation took 41-66 s."""
    from xengine.strategies.stage_cut import CUT_SHARE, stage_cut_bound

    t0 = time.perf_counter()
    best, best_s = _fitting(inst, start)
    progress.report(phase="stage-cut bound", incumbent_s=best_s)
    cut = stage_cut_bound(inst, _share(options, CUT_SHARE), best_s)
    if cut is None:
        return None
    info = RelaxationRun("stage_cut", cut.bound_s, cut.time_s, 0.0, None, None)
    out = _Relaxed(best, cut.bound_s, info, [], time.perf_counter() - t0, bound_from=STAGE_CUT)
    out.points.append((out.elapsed_s, best_s, cut.bound_s))
    progress.report(incumbent_s=best_s, bound_s=cut.bound_s)
    gap = None if best_s is None else relative_gap(best_s, min(cut.bound_s, best_s))
    if gap is not None and gap <= options.rel_gap:
        why = (
            "proven optimal: the start meets the stage-cut bound (xengine/strategies/"
            "stage_cut.py), so neither the frontier relaxation nor the MILP was solved"
        )
        sim = simulate(inst, best)
        out.answer = _start_proven(inst, strategy, solver, best, sim, cut.bound_s, why, t0)
        out.answer.trace = out.points
        out.answer.extra = {"mode": "exact", "bound_from": STAGE_CUT}
    return out


def _frontier_pays(inst: Instance) -> bool:
    """Whether the relaxation is small enough to be worth its share of the limit
    (:data:`DEVICE_FRONTIER_MAX_NONZEROS`); logged when it is not."""
    from xengine.strategies.model_size import frontier_nonzeros

    nnz = frontier_nonzeros(inst.graph, inst.n_devices)
    if nnz <= DEVICE_FRONTIER_MAX_NONZEROS:
        return True
    log.info(
        "%s: the frontier relaxation over the devices is not solved as a MILP (~%s nonzeros, "
        "above %s): its LP gives the bound (PDLP)",
        inst.graph.name,
        f"{nnz:,}",
        f"{DEVICE_FRONTIER_MAX_NONZEROS:,}",
    )
    return False


def _frontier_refused(inst: Instance, steps: bool = True) -> str | None:
    """Why the frontier relaxation over the devices (with its step rows where they are
    added, ``steps``) is not built here (too large for the host's memory,
    :func:`xengine.strategies.model_size.frontier_memory_problem`), or None."""
    from xengine.strategies.device_frontier import STEP_ROWS_MAX_NONZEROS, step_row_nonzeros
    from xengine.strategies.model_size import frontier_memory_problem

    steps = step_row_nonzeros(inst) if steps else 0
    steps = steps if steps <= STEP_ROWS_MAX_NONZEROS else 0
    why = frontier_memory_problem(inst.graph, inst.n_devices, steps)
    if why is not None:
        log.warning("%s: the frontier relaxation is not built: %s", inst.graph.name, why)
    return why


def _frontier_phase(
    inst: Instance,
    solver: str,
    options: SolverOptions,
    start: Schedule | None,
    strategy: str,
) -> _Relaxed:
    """Solve the frontier relaxation over the devices (:mod:`xengine.strategies.device_frontier`)
    for at most :data:`DEVICE_FRONTIER_SHARE` of the limit; read its solution back as a
    schedule."""
    from xengine.strategies.device_frontier import solve_device_frontier

    t0 = time.perf_counter()
    fr_options = _share(options, DEVICE_FRONTIER_SHARE)
    best, best_s = _fitting(inst, start)
    trace = _ProgressLog(f"{strategy} (frontier relaxation)", 1.0)
    progress.report(phase="frontier relaxation")

    def shown(elapsed_s: float, _relaxed: float | None, bound: float | None) -> None:
        trace(elapsed_s, best_s, bound)  # its own incumbents are not schedules: show the start

    fr = solve_device_frontier(inst, solver, fr_options, start=best, progress=shown)
    info = RelaxationRun(
        fr.status, fr.bound_s, fr.solve_time_s, fr.build_time_s, fr.n_vars, fr.n_rows
    )
    read_back = False
    if fr.schedule is not None:
        sim = simulate(inst, fr.schedule, check_budget=False)
        info.schedule_time_s, info.schedule_fits = sim.time_s, sim.within_budget
        if sim.within_budget and (best_s is None or sim.time_s < best_s):
            best, best_s, read_back = fr.schedule, sim.time_s, True
    if fr.status == "infeasible" and best is not None:
        log.warning("%s: the frontier relaxation is infeasible, yet the start fits", strategy)
        info.contradiction = "the start"
        info.bound_s = None
    out = _Relaxed(best, info.bound_s, info, trace.points, time.perf_counter() - t0)
    if best_s is not None and out.bound_s is not None:
        out.points.append((out.elapsed_s, best_s, out.bound_s))
    if fr.status == "infeasible" and best is None:
        out.answer = _relaxation_answer(inst, solver, strategy, out, None, t0, options)
    elif best is not None and out.bound_s is not None:
        gap = relative_gap(best_s, min(out.bound_s, best_s))
        if gap is not None and gap <= options.rel_gap:
            out.answer = _relaxation_answer(inst, solver, strategy, out, read_back, t0, options)
    return out


def _fitting_sim(inst: Instance, start: Schedule | None):
    """The simulator's replay of ``start`` when it is valid and fits, else None."""
    if start is None:
        return None
    try:
        sim = simulate(inst, start, check_budget=False)
    except ScheduleError:
        return None
    return sim if sim.within_budget else None


def _fitting(inst: Instance, start: Schedule | None) -> tuple[Schedule | None, float | None]:
    """``(start, its simulated time)`` when it is valid and fits, else ``(None, None)``."""
    sim = _fitting_sim(inst, start)
    return (None, None) if sim is None else (start, sim.time_s)


def _share(options: SolverOptions, share: float) -> SolverOptions:
    """``options`` with ``share`` of their time limit (at least 1 s; no limit stays none)."""
    if options.time_limit_s is None:
        return options
    return dataclasses.replace(options, time_limit_s=max(options.time_limit_s * share, 1.0))


def _lp_phase(
    inst: Instance, options: SolverOptions, start: Schedule | None, strategy: str
) -> _Relaxed:
    """Where the relaxation over the devices is too large to solve as a MILP in the time, the
    bound of its LP (:func:`xengine.strategies.device_frontier.device_frontier_lp_bound`, PDLP)
    for :data:`DEVICE_FRONTIER_LP_SHARE` of the limit; no schedule comes from it."""
    from xengine.strategies.device_frontier import device_frontier_lp_bound

    t0 = time.perf_counter()
    lp_options = _share(options, DEVICE_FRONTIER_LP_SHARE)
    best, best_s = _fitting(inst, start)
    progress.report(phase="LP bound (PDLP)")
    log.info(
        "%s: the LP of the frontier relaxation by PDLP for %s",
        strategy,
        "-" if lp_options.time_limit_s is None else f"{lp_options.time_limit_s:.0f} s",
    )
    fr = device_frontier_lp_bound(inst, lp_options)
    info = RelaxationRun(
        fr.status, fr.bound_s, fr.solve_time_s, fr.build_time_s, fr.n_vars, fr.n_rows
    )
    out = _Relaxed(best, fr.bound_s, info, [], time.perf_counter() - t0)
    out.points.append((out.elapsed_s, best_s, out.bound_s))
    progress.report(incumbent_s=best_s, bound_s=out.bound_s)
    if best is not None and out.bound_s is not None:
        gap = relative_gap(best_s, min(out.bound_s, best_s))
        if gap is not None and gap <= options.rel_gap:
            out.answer = _relaxation_answer(inst, "pdlp", strategy, out, False, t0, options)
    return out


def _relaxation_answer(
    inst: Instance,
    solver: str,
    strategy: str,
    relaxed: _Relaxed,
    read_back: bool | None,
    t0: float,
    options: SolverOptions,
) -> StrategyResult:
    """The frontier phase settled the instance: infeasible (``read_back`` None: no schedule
    exists, the relaxation says), or its best schedule meets the bound (optimal)."""
    res = StrategyResult(
        strategy=strategy,
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="infeasible",
        solver=solver,
        build_time_s=relaxed.info.build_time_s,
        n_vars=relaxed.info.n_vars,
        n_rows=relaxed.info.n_rows,
        frontier=relaxed.info,
        trace=relaxed.points,
        extra={"mode": "exact", "bound_from": "the frontier relaxation's bound"},
    )
    if read_back is None:
        res.message = (
            "infeasible: the frontier relaxation over the devices "
            "(xengine/strategies/device_frontier.py) has no point, so no schedule fits"
        )
        res.solve_time_s = time.perf_counter() - t0
        log.info("%s: %s", strategy, res.message)
        return res
    sched = relaxed.start
    sim = simulate(inst, sched)
    res.status = "optimal"
    res.objective_s = sim.time_s
    res.best_bound_s = min(relaxed.bound_s, sim.time_s)
    res.gap = relative_gap(sim.time_s, res.best_bound_s)
    what = "its own solution, read back as a schedule," if read_back else "the start"
    res.message = (
        "proven optimal by the frontier relaxation over the devices "
        f"(xengine/strategies/device_frontier.py): {what} meets its bound, so the full "
        "MILP was not solved"
    )
    res.solve_time_s = time.perf_counter() - t0
    check_with_simulator(res, inst, sched, "frontier relaxation's", True, res.solve_time_s)
    return res


def _solve_intervals(inst, solver, options, warm_start, strategy, build_options, placement):
    """``mode="intervals"``: the retention-interval model of :mod:`xengine.strategies.intervals`."""
    from xengine.strategies.intervals import DEFAULT_MAX_COMPUTES, solve_intervals

    if solver != "cpsat":
        raise SolverUnavailable(
            f"formulation=intervals is a CP-SAT model; solver={solver} cannot take it "
            "(use solver=cpsat, or formulation=exact for the MILP)"
        )
    opts = dict(build_options or {})
    max_computes = int(opts.pop("max_computes", DEFAULT_MAX_COMPUTES))
    lp_bound = opts.pop("lp_bound", True)
    lp_bound = lp_bound if lp_bound == "alongside" else bool(lp_bound)
    if opts:
        raise ValueError(f"formulation=intervals has no option(s) {sorted(opts)}")
    return solve_intervals(
        inst,
        options,
        warm_start=warm_start,
        max_computes=max_computes,
        lp_bound=lp_bound,
        strategy=strategy,
        progress=_ProgressLog(strategy, 1.0),
        placement=placement,
    )


def _restrict(form, placement: np.ndarray) -> None:
    """Fix R, S (and the state's residency) of node ``i`` at zero on every device but
    ``placement[i]`` (in place)."""
    placement = np.asarray(placement, dtype=np.int64)
    D, _, n = form.Rix.shape
    if placement.shape != (n,) or placement.min() < -1 or placement.max() >= D:
        raise ValueError(
            f"placement needs one device index in 0..{D - 1} (or -1: free) for each of {n} nodes"
        )
    # (D, n): not this node's device; a node placed at -1 stays free on every device
    other = (np.arange(D)[:, None] != placement[None, :]) & (placement[None, :] >= 0)
    ub = form.model.ub.copy()
    for ix in (form.Rix, form.Six) + ((form.Aix,) if form.Aix is not None else ()):
        sel = ix[other[:, None, :].repeat(ix.shape[1], axis=1)]
        ub[sel[sel >= 0]] = 0.0
    form.model.ub = ub


def agree(res: StrategyResult, rel_tol: float = 1e-6) -> bool:
    """Whether the model's objective and per-device peak equal the simulator's (exact mode)."""
    if res.sim is None or res.objective_s is None or res.model_peak_bytes is None:
        return False
    t_ok = abs(res.objective_s - res.sim.time_s) <= rel_tol * max(1.0, abs(res.sim.time_s))
    m_ok = np.allclose(res.model_peak_bytes, res.sim.peak_bytes, rtol=rel_tol, atol=1.0)
    return bool(t_ok and m_ok)
