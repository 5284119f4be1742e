"""HiGHS back-end (the default): open source, embedded, MIP with time limit, gap and callbacks."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from xengine.solvers.model import (
    MilpModel,
    ProgressFn,
    SolveResult,
    SolverOptions,
    SolverUnavailable,
    relative_gap,
)

log = logging.getLogger(__name__)
BOUND_REPORT_INTERVAL_S = 1.0
"""A moved MIP bound is passed to ``progress`` at most this often (incumbents always are)."""
_THREADS_SET: int | None = None


def _new_highs(highspy):  # noqa: ANN001, ANN202
    """A Highs object; the first one in a process prints a banner on stdout, which belongs to
    the run's table, so the process's stdout is pointed at stderr while it is made."""
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


DEADLINE_GRACE_S = 2.0
"""HiGHS checks its time limit in some phases only (resnet18's Checkmate MILP ran 33 s under
a limit of 12 s, in presolve and the root LP); past the limit and this grace the solve is
cancelled through its interrupt callbacks, which the simplex and the MIP search poll."""


def _run_interruptibly(h, time_limit_s: float | None) -> bool:  # noqa: ANN001 - highspy.Highs
    """``h.run()`` in highspy's solver thread while this one waits in Python, so that Ctrl-C
    or SIGTERM reach Python at once; the solve is then cancelled through HiGHS's interrupt
    callbacks and the interrupt raised again (inside a callback HiGHS would have turned it
    into a solver error, and a run in native code would not see it until the end). Returns
    whether the solve was cancelled for running past ``time_limit_s`` (plus the grace)."""
    h.HandleUserInterrupt = True
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    late = False
    h.startSolve()
    try:
        while not h.wait(0.1)[0]:
            if (
                not late
                and deadline is not None
                and time.perf_counter() > deadline + DEADLINE_GRACE_S
            ):
                late = True
                h.cancelSolve()
    except KeyboardInterrupt:
        h.cancelSolve()
        while not h.wait(0.1)[0]:
            pass
        raise
    return late


def solve_highs(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
    _presolve: bool = True,
) -> SolveResult:
    global _THREADS_SET
    try:
        import highspy
    except ImportError as exc:  # pragma: no cover - highspy is a hard dependency
        raise SolverUnavailable(
            "solver=highs needs the 'highspy' package: pip install highspy"
        ) from exc
    if model.is_quadratic:
        raise SolverUnavailable(
            "HiGHS cannot take products of variables; build the linearised model "
            "(formulation mode=paper linearises automatically for solver=highs)"
        )
    h = _new_highs(highspy)
    h.setOptionValue("output_flag", bool(options.verbose))
    h.setOptionValue("log_to_console", bool(options.verbose))
    # HiGHS keeps one thread pool per process, sized by the first solve (threads 0 = its
    # default); a solve that asks for another size fails with "Not Set" unless it is reset.
    threads = int(options.threads or 0)
    if _THREADS_SET is not None and _THREADS_SET != threads:
        highspy.Highs.resetGlobalScheduler(True)
    if threads:
        h.setOptionValue("threads", threads)
    _THREADS_SET = threads
    if options.time_limit_s is not None:
        h.setOptionValue("time_limit", float(options.time_limit_s))
    h.setOptionValue("mip_rel_gap", float(options.rel_gap))
    h.setOptionValue("random_seed", int(options.seed))
    if not _presolve:
        h.setOptionValue("presolve", "off")
    if options.relax and options.lp_method != "simplex":
        if options.lp_method != "ipm":
            raise ValueError(f"lp_method must be 'simplex' or 'ipm', not {options.lp_method!r}")
        h.setOptionValue("solver", "ipm")
        h.setOptionValue("run_crossover", "off")

    lp = highspy.HighsLp()
    lp.num_col_ = model.n_vars
    lp.num_row_ = model.n_rows
    lp.col_cost_ = model.c
    lp.col_lower_ = model.lb
    lp.col_upper_ = model.ub
    lp.row_lower_ = model.row_lb
    lp.row_upper_ = model.row_ub
    lp.offset_ = model.offset
    csc = model.A.tocsc()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = csc.indptr
    lp.a_matrix_.index_ = csc.indices
    lp.a_matrix_.value_ = csc.data
    lp.a_matrix_.num_col_ = model.n_vars
    lp.a_matrix_.num_row_ = model.n_rows
    if not options.relax and model.n_integer:
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
            for b in model.integrality
        ]
    h.passModel(lp)

    t0 = time.perf_counter()
    first: list[float] = []
    if progress is not None or True:

        def _on_improve(e) -> None:  # noqa: ANN001 - highspy callback object
            el = time.perf_counter() - t0
            if not first:
                first.append(el)
            obj = float(e.data_out.objective_function_value)
            bound = float(e.data_out.mip_dual_bound)
            if progress is not None:
                progress(el, obj, bound)

        # The bound moves between incumbents too; a long solve's gap over time (issue 5's
        # time-to-gap figures) needs those moves, reported at most once a second.
        last_bound = [-np.inf, -np.inf]  # bound, elapsed at its report

        def _on_interrupt(e) -> None:  # noqa: ANN001 - highspy callback object
            bound = float(e.data_out.mip_dual_bound)
            if not np.isfinite(bound) or bound <= last_bound[0] + 1e-9 * max(1.0, abs(bound)):
                return
            el = time.perf_counter() - t0
            if el - last_bound[1] < BOUND_REPORT_INTERVAL_S:
                return
            last_bound[:] = [bound, el]
            inc = float(e.data_out.mip_primal_bound)
            progress(el, inc if np.isfinite(inc) else None, bound)

        try:
            h.cbMipImprovingSolution.subscribe(_on_improve)
            if progress is not None and not options.relax:
                h.cbMipInterrupt.subscribe(_on_interrupt)
        except Exception:  # pragma: no cover - older highspy without callbacks
            pass
    if warm_start is not None and not options.relax:
        sol = highspy.HighsSolution()
        sol.col_value = list(np.asarray(warm_start, dtype=float))
        sol.value_valid = True
        h.setSolution(sol)
    late = _run_interruptibly(h, options.time_limit_s)
    elapsed = time.perf_counter() - t0
    ms = h.getModelStatus()
    info = h.getInfo()
    S = highspy.HighsModelStatus
    has_sol = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if has_sol else None
    obj = float(info.objective_function_value) if has_sol else None
    start_only = False
    if (
        x is not None
        and warm_start is not None
        and not np.isclose(model.objective(x), obj, rtol=1e-7, atol=1e-9)
    ):
        # HiGHS 1.16 can report the optimum found after presolve yet hand back the MIP
        # start's values (seen on small Checkmate models); the start is dropped and the
        # model solved again, so the schedule returned is the one the objective describes.
        # Solving again with presolve off keeps the start as incumbent (a cold solve may
        # find nothing in the time left) and returns solutions that match their objective.
        log.warning(
            "HiGHS returned its MIP start (objective %.9g) while reporting %.9g; solving again "
            "with presolve off",
            model.objective(x),
            obj,
        )
        if _presolve:
            # the second solve gets what is left of the limit, so the two stay within it
            left = options
            if options.time_limit_s is not None:
                left_s = max(float(options.time_limit_s) - elapsed, 1.0)
                left = dataclasses.replace(options, time_limit_s=left_s)
            again = solve_highs(model, left, warm_start, progress, _presolve=False)
            again.solve_time_s += elapsed
            # the first solve's bound holds for the model (presolve keeps every optimum)
            first_bound = float(info.mip_dual_bound)
            if np.isfinite(first_bound) and (
                again.best_bound is None or first_bound > again.best_bound
            ):
                again.best_bound = first_bound
                if again.objective is not None:
                    again.gap = relative_gap(again.objective, min(first_bound, again.objective))
            return again
        # still inconsistent: keep the start, which is a real feasible point, at its true cost,
        # and do not call it optimal
        obj = model.objective(x)
        start_only = True
    is_mip = model.n_integer > 0 and not options.relax
    bound = float(info.mip_dual_bound) if is_mip else obj
    if ms == S.kOptimal:
        status = "optimal"
    elif ms == S.kInfeasible:
        status = "infeasible"
    elif ms in (S.kTimeLimit, S.kIterationLimit, S.kInterrupt, S.kSolutionLimit, S.kUnknown):
        status = "feasible" if x is not None else "no_solution"
    else:
        status = "error"
    if start_only and status == "optimal":
        status = "feasible"
    if is_mip and bound is not None and not np.isfinite(bound):
        bound = None
    row_dual = None
    if not is_mip:
        sol = h.getSolution()
        if sol.dual_valid:
            row_dual = np.array(sol.row_dual, dtype=float)
    return SolveResult(
        solver="highs",
        status=status,
        x=x if status in ("optimal", "feasible") else None,
        objective=obj if status in ("optimal", "feasible") else None,
        best_bound=bound,
        gap=(0.0 if status == "optimal" and not is_mip else relative_gap(obj, bound)),
        solve_time_s=elapsed,
        message=(
            f"time limit ({options.time_limit_s:g} s; stopped by xengine, HiGHS ran past it)"
            if late and ms == S.kInterrupt
            else h.modelStatusToString(ms)
        ),
        time_to_first_s=first[0] if first else (elapsed if x is not None else None),
        n_nodes=int(getattr(info, "mip_node_count", 0) or 0),
        row_dual=row_dual,
    )
