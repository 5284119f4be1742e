"""HiGHS back-end (the default): open source, embedded, MIP with time limit, gap and callbacks.

The model goes in as one ``HighsLp`` (column-wise matrix, integrality unless ``relax``);
products of variables are rejected (formulation mode=paper linearises them for HiGHS).
:func:`solve_highs` runs in steps: options (:func:`_configure`), the model
(:func:`_pass_model`), callbacks (:func:`_subscribe`), the interruptible run, a second solve
when HiGHS hands back its MIP start with another solution's objective
(:func:`_solve_again`), and the result (:func:`_result`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from xengine.solvers.highs_process import solve_in_process, uses_own_process
from xengine.solvers.model import (
    SOLUTION_STATUSES,
    Backend,
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

BACKEND = Backend(
    name="highs",
    target=f"{__name__}:solve_highs",
    packages=("highspy",),
    takes_lp=True,
    takes_milp=True,
    takes_quadratic=False,
    statuses={  # HighsModelStatus member names; a limit keeps the incumbent, if any
        "kOptimal": "optimal",
        "kInfeasible": "infeasible",
        **dict.fromkeys(
            ("kTimeLimit", "kIterationLimit", "kInterrupt", "kSolutionLimit", "kUnknown"),
            "feasible",
        ),
    },
)
"""solver=highs (the default): LPs and MILPs; no products."""
BACKENDS = (BACKEND,)


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


def share_thread_pool(highspy, threads: int) -> None:
    """HiGHS keeps one thread pool per process, sized by the first solve (``threads`` 0: its
    default); a solve that asks for another size fails with "Not Set" unless the pool is
    reset, so it is reset whenever ``threads`` differs from the last solve's. solver=highs and
    cvxpy's inner HIGHS share the pool and this record of its size."""
    global _THREADS_SET
    if _THREADS_SET is not None and _THREADS_SET != threads:
        highspy.Highs.resetGlobalScheduler(True)
    _THREADS_SET = threads


def _configure(h, highspy, options: SolverOptions, presolve: bool) -> None:
    """The neutral options as HiGHS options (the thread pool: :func:`share_thread_pool`)."""
    h.setOptionValue("output_flag", bool(options.verbose))
    h.setOptionValue("log_to_console", bool(options.verbose))
    threads = int(options.threads or 0)  # 0: HiGHS's default
    share_thread_pool(highspy, threads)
    if threads:
        h.setOptionValue("threads", threads)
    if options.time_limit_s is not None:
        h.setOptionValue("time_limit", float(options.time_limit_s))
    h.setOptionValue("mip_rel_gap", float(options.rel_gap))
    h.setOptionValue("random_seed", int(options.seed))
    if not presolve:
        h.setOptionValue("presolve", "off")
    if options.relax and options.lp_method != "simplex":
        if options.lp_method != "ipm":
            raise ValueError(f"lp_method must be 'simplex' or 'ipm', not {options.lp_method!r}")
        h.setOptionValue("solver", "ipm")
        h.setOptionValue("run_crossover", "off")


def _pass_model(h, highspy, model: MilpModel, options: SolverOptions) -> None:
    """The model as one ``HighsLp`` (column-wise matrix): passing arrays at once, not rows one
    by one, keeps large models quick to hand over. Integrality only for a MIP not relaxed."""
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


def _subscribe(h, t0: float, first: list[float], progress, relax: bool, on_incumbent) -> None:
    """Callbacks: every improving incumbent (its time noted in ``first``, so that
    ``time_to_first_s`` is known without ``progress``; its values to ``on_incumbent``, when
    given, before ``progress`` sees its objective) and, with ``progress`` on a MIP, the
    bound's moves between incumbents, which a long solve's gap over time needs (issue 5's
    time-to-gap figures), at most once every :data:`BOUND_REPORT_INTERVAL_S`."""

    def _on_improve(e) -> None:  # noqa: ANN001 - highspy callback object
        el = time.perf_counter() - t0
        if not first:
            first.append(el)
        obj = float(e.data_out.objective_function_value)
        bound = float(e.data_out.mip_dual_bound)
        if on_incumbent is not None:
            on_incumbent(np.array(e.data_out.mip_solution, dtype=float))
        if progress is not None:
            progress(el, obj, bound)

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
        if progress is not None and not relax:
            h.cbMipInterrupt.subscribe(_on_interrupt)
    except Exception:  # pragma: no cover - older highspy without callbacks
        pass


def _solve_again(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray,
    progress: ProgressFn | None,
    elapsed: float,
    first_bound: float,
    on_incumbent: Callable[[np.ndarray], None] | None = None,
) -> SolveResult:
    """The model solved again with presolve off, in what is left of the time limit, after
    HiGHS reported one objective and handed back its MIP start (HiGHS 1.16, seen on small
    Checkmate models). Presolve off keeps the start as incumbent (a cold solve may find nothing
    in the time left) and returns solutions that match their objective. The first solve's
    bound still holds for the model (presolve keeps every optimum) and is kept if better."""
    left = options
    if options.time_limit_s is not None:
        left_s = max(float(options.time_limit_s) - elapsed, 1.0)
        left = dataclasses.replace(options, time_limit_s=left_s)
    again = solve_highs(
        model, left, warm_start, progress, _presolve=False, on_incumbent=on_incumbent
    )
    again.solve_time_s += elapsed
    if np.isfinite(first_bound) and (again.best_bound is None or first_bound > again.best_bound):
        again.best_bound = first_bound
        if again.objective is not None:
            again.gap = relative_gap(again.objective, min(first_bound, again.objective))
    return again


def _result(
    h,  # noqa: ANN001 - highspy.Highs
    model: MilpModel,
    options: SolverOptions,
    x: np.ndarray | None,
    obj: float | None,
    start_only: bool,
    late: bool,
    elapsed: float,
    first: list[float],
) -> SolveResult:
    """The finished solve as a :class:`SolveResult`: the model status through
    :data:`BACKEND`'s map (an incumbent kept at its true cost, ``start_only``, is never called
    optimal), the MIP bound, and the row multipliers of an LP (for
    :meth:`MilpModel.dual_bound`)."""
    ms = h.getModelStatus()
    info = h.getInfo()
    is_mip = model.n_integer > 0 and not options.relax
    bound = float(info.mip_dual_bound) if is_mip else obj
    status = BACKEND.status(ms.name, has_solution=x is not None)
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
        x=x if status in SOLUTION_STATUSES else None,
        objective=obj if status in SOLUTION_STATUSES else None,
        best_bound=bound,
        gap=(0.0 if status == "optimal" and not is_mip else relative_gap(obj, bound)),
        solve_time_s=elapsed,
        message=(
            f"time limit ({options.time_limit_s:g} s; stopped by xengine, HiGHS ran past it)"
            if late and ms.name == "kInterrupt"
            else h.modelStatusToString(ms)
        ),
        time_to_first_s=first[0] if first else (elapsed if x is not None else None),
        n_nodes=int(getattr(info, "mip_node_count", 0) or 0),
        row_dual=row_dual,
    )


def solve_highs(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
    _presolve: bool = True,
    on_incumbent: Callable[[np.ndarray], None] | None = None,
    _in_child: bool = False,
) -> SolveResult:
    """Solve with HiGHS (module docstring). Options: ``time_limit``, ``mip_rel_gap``,
    ``threads``, ``random_seed``, ``output_flag``; ``relax`` drops integrality (with
    ``lp_method="ipm"``: interior point without crossover). ``warm_start`` is the MIP start.
    ``_presolve=False`` is the second solve of :func:`_solve_again`. A large MIP with a time
    limit runs in a process of its own, which the limit can end
    (:mod:`xengine.solvers.highs_process`; ``_in_child``: this is that process);
    ``on_incumbent`` gets each improving incumbent's values."""
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
    if not _in_child and _presolve and uses_own_process(model, options):
        return solve_in_process(model, options, warm_start, progress, DEADLINE_GRACE_S)
    h = _new_highs(highspy)
    _configure(h, highspy, options, _presolve)
    _pass_model(h, highspy, model, options)
    t0 = time.perf_counter()
    first: list[float] = []
    _subscribe(h, t0, first, progress, options.relax, on_incumbent)
    if warm_start is not None and not options.relax:
        sol = highspy.HighsSolution()
        sol.col_value = list(np.asarray(warm_start, dtype=float))
        sol.value_valid = True
        h.setSolution(sol)
    late = _run_interruptibly(h, options.time_limit_s)
    elapsed = time.perf_counter() - t0
    info = h.getInfo()
    has_sol = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if has_sol else None
    obj = float(info.objective_function_value) if has_sol else None
    start_only = False
    if (
        x is not None
        and warm_start is not None
        and not np.isclose(model.objective(x), obj, rtol=1e-7, atol=1e-9)
    ):
        log.warning(
            "HiGHS returned its MIP start (objective %.9g) while reporting %.9g; solving again "
            "with presolve off",
            model.objective(x),
            obj,
        )
        if _presolve:
            return _solve_again(
                model,
                options,
                warm_start,
                progress,
                elapsed,
                float(info.mip_dual_bound),
                on_incumbent,
            )
        # still inconsistent: keep the start, which is a real feasible point, at its true cost,
        # and do not call it optimal
        obj = model.objective(x)
        start_only = True
    return _result(h, model, options, x, obj, start_only, late, elapsed, first)
