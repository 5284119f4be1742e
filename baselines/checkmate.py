"""Checkmate's optimal single-device rematerialization MILP (Jain et al., MLSys 2020).

With one device, :func:`xengine.formulation.build` (mode ``exact``) is Checkmate's model:
binary R, S, FREE with the hazard-count linearisation, the memory recurrence U and the
objective sum C_i R[t,i]. This module adds what Checkmate does around the solve: a warm start
from the best heuristic that fits, and the final pass that re-derives R from the solver's S.
The solver's own schedule, its simulated figures and the model's objective and peak stay in
the result, so that the model can be held to the simulator.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from baselines.common import device_name, schedule_from_checkpoints, solve_r_opt
from baselines.heuristics import (
    best_fitting,
    keep_all_if_it_fits,
    require_one_device,
    run_heuristics,
)
from xengine import progress as status
from xengine.formulation import build
from xengine.graph.types import Graph
from xengine.problem import Instance
from xengine.result import StrategyResult
from xengine.simulate import ScheduleError, simulate
from xengine.solvers import ProgressFn, SolverOptions, solve

log = logging.getLogger(__name__)

TIME_RTOL = 1e-9


def _consistent(model, res) -> bool:
    """The returned point has the objective the solver reports for it."""
    return bool(np.isclose(model.objective(res.x), res.objective, rtol=1e-7, atol=1e-9))


def min_feasible_budget_bytes(graph: Graph) -> tuple[int, int]:
    """``(lower_bound, known_feasible)`` for the smallest activation budget of ``graph``.

    The lower bound is the largest (inputs + output + workspace) of any node, which must be
    on the device at once. The known feasible budget is the peak of the most memory-frugal
    schedule at hand: no forward checkpoints, each backward stage recomputing its forward
    inputs (the gradients are kept), or keep-everything if that is smaller. When the two
    numbers are equal, that is the smallest feasible budget.
    """
    inst = Instance.single(graph, device_name(graph, 0), budget_bytes=None)
    lower = int(graph.node_lower_bound_bytes(inst.devices[0]).max())
    peaks = [
        int(
            simulate(inst, schedule_from_checkpoints(graph, keep, inst.devices[0])).peak_bytes.max()
        )
        for keep in ((), graph.forward_indices)
    ]
    return lower, max(lower, min(peaks))


def budget_range_message(graph: Graph, infeasible_at: int | None = None) -> str:
    """Names the smallest feasible budget, or the range it lies in. ``infeasible_at``: a
    budget proven infeasible (the smallest feasible one is then above it)."""
    lower, known = min_feasible_budget_bytes(graph)
    if infeasible_at is not None:
        lower = max(lower, int(infeasible_at) + 1)
    if lower >= known:
        return f"the smallest feasible budget is {known} bytes"
    why = "inputs + output of the largest op" if infeasible_at is None else "proven so"
    return (
        f"the smallest feasible budget is between {lower} bytes ({why}) and {known} bytes "
        "(a recompute-heavy schedule fits)"
    )


def solve_checkmate(
    inst: Instance,
    solver: str = "highs",
    options: SolverOptions | None = None,
    warm_start: bool = True,
    progress: ProgressFn | None = None,
) -> StrategyResult:
    """Solve Checkmate's MILP for a one-device instance.

    The returned schedule is the solver's S with R re-derived by :func:`solve_r_opt` (unused
    residents dropped first); ``extra`` keeps the solver's raw schedule and its simulation
    (``raw_schedule``, ``raw_sim``), which is what ``objective_s`` and ``model_peak_bytes``
    describe. Status is the solver's: optimal, feasible (limit hit, incumbent kept),
    infeasible (the message names the smallest feasible budget known), no_solution or error.
    """
    require_one_device(inst, "checkmate")
    options = options or SolverOptions()
    g = inst.graph
    budget = int(inst.budget_bytes[0])
    extra: dict = {}
    if budget < int(g.node_lower_bound_bytes(inst.devices[0]).max()):
        # some op's inputs and output alone exceed the budget: no model needs building
        return StrategyResult(
            strategy="checkmate",
            devices=inst.devices,
            budget_bytes=inst.budget_bytes,
            status="infeasible",
            solver=solver,
            message=f"no schedule of {g.name!r} fits {budget} bytes: " + budget_range_message(g),
        )

    answer = keep_all_if_it_fits(inst, "checkmate", solver)
    if answer is not None:  # nothing to solve
        return answer

    t_heur = time.perf_counter()
    heur = run_heuristics(inst)
    seed = best_fitting(heur)
    if seed is None:
        # near the smallest budget no heuristic fits; the memory-frugal schedule (no forward
        # checkpoints, gradients kept) often does and gives the solver a start
        from baselines.heuristics import evaluate

        frugal = evaluate(
            inst,
            "no_checkpoints",
            schedule_from_checkpoints(g, (), inst.devices[0]),
            time.perf_counter(),
        )
        if frugal.sim.within_budget:
            seed = frugal
    extra["heuristics_time_s"] = time.perf_counter() - t_heur
    extra["heuristics"] = {
        r.strategy: {
            "time_s": r.sim.time_s,
            "peak_bytes": int(r.sim.peak_bytes.max()),
            "fits": r.sim.within_budget,
        }
        for r in heur
    }

    form = build(inst, mode="exact")
    model = form.model
    x0 = None
    if warm_start and seed is not None:
        x0 = form.assignment(seed.schedule)
        viol = model.max_violation(x0)
        extra["warm_start"] = seed.strategy
        extra["warm_start_time_s"] = seed.sim.time_s
        if viol > 1e-6:  # the model and the simulator disagree on a valid schedule
            log.warning("warm start from %s violates the model by %.3g", seed.strategy, viol)
            extra["warm_start_violation"] = viol

    progress = _shown(progress, form.time_scale)
    res = solve(model, solver, options, warm_start=x0, progress=progress)
    solve_time_s = res.solve_time_s
    if x0 is not None and res.has_solution and not _consistent(model, res):
        # HiGHS 1.16 can report the optimum of its presolved model yet hand back the MIP
        # start as the solution (seen on chain(3) at 4000 bytes: objective 10, x costs 12).
        # Keep the solver's answer only when x is what it says; otherwise solve cold.
        log.warning(
            "%s: solver %s reports objective %.9g but its solution costs %.9g; "
            "solving again without the warm start",
            g.name,
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
        "checkmate %s: %s in %.2f s (build %.2f s), %d vars, %d rows",
        g.name,
        res.status,
        res.solve_time_s,
        form.build_time_s,
        model.n_vars,
        model.n_rows,
    )

    if not res.has_solution:
        if res.status == "infeasible":
            if seed is not None:
                out.status = "error"
                out.message = (
                    f"solver {res.solver} reports budget {budget} bytes infeasible, yet the "
                    f"{seed.strategy} schedule fits it (peak {int(seed.sim.peak_bytes.max())} "
                    "bytes): the model is wrong for this graph"
                )
            else:
                out.message = f"no schedule of {g.name!r} fits {budget} bytes: " + (
                    budget_range_message(g, infeasible_at=budget)
                )
        else:
            hint = f"; best heuristic that fits: {seed.strategy}" if seed is not None else ""
            out.message = f"solver {res.solver}: {res.status} ({res.message}){hint}"
        return out

    x = res.x
    if not _consistent(model, res):
        out.status = "error"
        out.message = (
            f"solver {res.solver} reports objective {res.objective:.9g} but its solution "
            f"costs {model.objective(x):.9g}"
        )
        return out
    out.objective_s = form.objective_s(x)
    out.model_peak_bytes = form.peak_bytes(x)
    raw = form.schedule_from(x)
    try:
        raw_sim = simulate(inst, raw, check_budget=False)
    except ScheduleError as exc:
        out.status = "error"
        out.message = f"the solver's schedule is invalid for the simulator: {exc}"
        return out
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
    return out


def _shown(progress: ProgressFn | None, time_scale: float) -> ProgressFn:
    """``progress``, and the live status line (its incumbent and bound in seconds)."""

    def report(elapsed_s: float, incumbent: float | None, bound: float | None) -> None:
        status.report(
            incumbent_s=None if incumbent is None else incumbent * time_scale,
            bound_s=None if bound is None else bound * time_scale,
        )
        if progress is not None:
            progress(elapsed_s, incumbent, bound)

    return report
