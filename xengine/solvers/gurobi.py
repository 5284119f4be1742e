"""Gurobi back-end (the paper's solver) through gurobipy's matrix API.

The model goes in as is: sparse rows via ``addMConstr``, the product triplets as the quadratic
part of the objective (the paper's MIQP needs no linearisation here).

The pip wheel ships a size-limited licence (shared/reference/dependencies.md section 3): at most
2000 variables and 2000 constraints, 200 variables once anything is quadratic; a larger model
fails at ``optimize()`` with error 10010. That is turned into :class:`SolverUnavailable` with
the model's size and what to do; there is never a switch to another solver.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import scipy.sparse as sp

from xengine.interrupt import Interrupted, run_stoppable
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

# Limits of gurobipy's size-limited (pip) licence, measured with gurobipy 13.0.3.
LICENCE_MAX_VARS = 2000
LICENCE_MAX_ROWS = 2000
LICENCE_MAX_VARS_QUADRATIC = 200
SIZE_LIMIT_ERRNO = 10010

# gurobipy status codes (GRB.Status), kept here so the mapping is testable without gurobipy.
_OPTIMAL = 2
_INFEASIBLE = 3
_INF_OR_UNBD = 4
_UNBOUNDED = 5
_INTERRUPTED = 11  # Ctrl-C that Gurobi caught itself: passed on as an interrupt
_LIMITS = {
    7: "iteration limit",
    8: "node limit",
    9: "time limit",
    10: "solution limit",
    13: "suboptimal",
    15: "objective limit",
    16: "work limit",
    17: "memory limit",
}
_NAMES = {
    1: "loaded",
    2: "optimal",
    3: "infeasible",
    4: "infeasible or unbounded",
    5: "unbounded",
    6: "cutoff",
    11: "interrupted",
    12: "numeric trouble",
    14: "in progress",
}


BACKEND = Backend(
    name="gurobi",
    target=f"{__name__}:solve_gurobi",
    packages=("gurobipy",),
    takes_lp=True,
    takes_milp=True,
    takes_quadratic=True,
    statuses={_OPTIMAL: "optimal", _INFEASIBLE: "infeasible", **dict.fromkeys(_LIMITS, "feasible")},
)
"""solver=gurobi: LP, MILP and the paper's MIQP as is (size-limited by the pip licence)."""
BACKENDS = (BACKEND,)


def map_status(code: int, sol_count: int) -> str:
    """Gurobi ``Model.Status`` (plus whether an incumbent exists) -> one of STATUSES.

    Infeasible-or-unbounded must be resolved by the caller (see :func:`solve_gurobi`)."""
    return BACKEND.status(code, has_solution=sol_count > 0)


def status_name(code: int) -> str:
    return _LIMITS.get(code) or _NAMES.get(code) or f"status {code}"


def licence_message(
    model: MilpModel, grb_vars: int | None = None, grb_rows: int | None = None
) -> str:
    """One line: the model's size, the size-limited licence's limits, and how to proceed."""
    quad = model.is_quadratic
    seen = ""
    if grb_vars is not None and (grb_vars, grb_rows) != (model.n_vars, model.n_rows):
        seen = f" (as Gurobi rows: {grb_rows})"
    return (
        f"solver=gurobi: model {model.name!r} has {model.n_vars} variables, {model.n_rows} rows"
        f"{seen}, {'with' if quad else 'no'} products; gurobipy's size-limited licence takes at "
        f"most {LICENCE_MAX_VARS} variables and {LICENCE_MAX_ROWS} rows "
        f"({LICENCE_MAX_VARS_QUADRATIC} variables if anything is quadratic; Gurobi error "
        f"{SIZE_LIMIT_ERRNO}); use solver=highs (default) or install a full Gurobi licence "
        f"(GRB_LICENSE_FILE)"
    )


def _split_rows(model: MilpModel) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """Ranged rows ``lb <= Ax <= ub`` -> one-sided rows with senses ``=``, ``<``, ``>``."""
    lo, hi = model.row_lb, model.row_ub
    eq = np.isfinite(lo) & np.isfinite(hi) & (lo == hi)
    le = np.isfinite(hi) & ~eq
    ge = np.isfinite(lo) & ~eq
    A = model.A.tocsr()
    parts = [(eq, "=", lo), (le, "<", hi), (ge, ">", lo)]
    mats = [A[mask] for mask, _, _ in parts]
    senses = np.concatenate([np.full(int(mask.sum()), s) for mask, s, _ in parts])
    rhs = np.concatenate([side[mask] for mask, _, side in parts])
    return sp.vstack(mats, format="csr"), senses, rhs


def _start_env(gp, options: SolverOptions):
    """A quiet environment (no licence banner unless verbose); a licence that does not start is
    :class:`SolverUnavailable` naming what to do."""
    try:
        env = gp.Env(empty=True)
        env.setParam("OutputFlag", 1 if options.verbose else 0)
        env.start()
    except gp.GurobiError as exc:
        raise SolverUnavailable(
            f"solver=gurobi: gurobipy cannot start (Gurobi error {exc.errno}: {exc}); "
            "use solver=highs (default) or set up a Gurobi licence (GRB_LICENSE_FILE)"
        ) from exc
    return env


def _build(m, GRB, model: MilpModel, options: SolverOptions, warm_start):
    """The model into ``m`` through the matrix API: columns, one-sided rows, the objective with
    its products, the neutral options and the MIP start. Returns the column MVar."""
    n = model.n_vars
    if options.relax:
        vtype = np.full(n, GRB.CONTINUOUS)
    else:
        binary = model.integrality & (model.lb >= 0) & (model.ub <= 1)
        vtype = np.where(
            binary, GRB.BINARY, np.where(model.integrality, GRB.INTEGER, GRB.CONTINUOUS)
        )
    x = m.addMVar(n, lb=model.lb, ub=model.ub, vtype=vtype, name="x")
    A, senses, rhs = _split_rows(model)
    if A.shape[0]:
        m.addMConstr(A, x, senses, rhs)
    if model.is_quadratic:
        Q = sp.coo_matrix((model.q_val, (model.q_i, model.q_j)), shape=(n, n))
        m.setMObjective(Q, model.c, float(model.offset), sense=GRB.MINIMIZE)
    else:
        m.setMObjective(None, model.c, float(model.offset), sense=GRB.MINIMIZE)
    if options.time_limit_s is not None:
        m.Params.TimeLimit = float(options.time_limit_s)
    m.Params.MIPGap = float(options.rel_gap)
    if options.threads:
        m.Params.Threads = int(options.threads)
    m.Params.Seed = int(options.seed)
    if warm_start is not None and not options.relax:
        x.Start = np.asarray(warm_start, dtype=float)
    m.update()
    return x


def _incumbent_callback(GRB, t0: float, first: list[float], progress: ProgressFn | None):
    """The MIPSOL callback: notes the time of the first incumbent in ``first`` and passes
    every improving one to ``progress``."""
    best = [np.inf]

    def _cb(mod, where) -> None:  # noqa: ANN001 - gurobipy callback signature
        if where != GRB.Callback.MIPSOL:
            return
        obj = float(mod.cbGet(GRB.Callback.MIPSOL_OBJ))
        if obj >= best[0]:
            return
        best[0] = obj
        el = time.perf_counter() - t0
        if not first:
            first.append(el)
        if progress is not None:
            bnd = float(mod.cbGet(GRB.Callback.MIPSOL_OBJBND))
            progress(el, obj, bnd if abs(bnd) < GRB.INFINITY else None)

    return _cb


def _optimize(m, cb, model: MilpModel, options: SolverOptions, t0: float) -> int:
    """Run the solve (stoppable) and return its status code, with infeasible-or-unbounded
    resolved: infeasible when every column is bounded, else solved again without dual
    reductions in what is left of the time limit."""
    run_stoppable(lambda: m.optimize(cb), m.terminate, "gurobi")
    if m.Status == _INTERRUPTED:
        raise Interrupted()
    if m.Status != _INF_OR_UNBD:
        return m.Status
    if np.all(np.isfinite(model.lb)) and np.all(np.isfinite(model.ub)):
        return _INFEASIBLE  # every column is bounded, so it cannot be unbounded
    m.Params.DualReductions = 0
    if options.time_limit_s is not None:
        left = float(options.time_limit_s) - (time.perf_counter() - t0)
        m.Params.TimeLimit = max(left, 0.0)
    run_stoppable(lambda: m.optimize(cb), m.terminate, "gurobi")
    return m.Status


def _result(gp, GRB, m, x, model: MilpModel, code: int, elapsed: float, first) -> SolveResult:
    """The solved model ``m`` as a :class:`SolveResult` (objective recomputed from ``x``)."""
    sol_count = int(m.SolCount)
    status = map_status(code, sol_count)
    xv = np.asarray(x.X, dtype=float).copy() if sol_count > 0 else None
    if status not in SOLUTION_STATUSES:
        xv = None
    obj = model.objective(xv) if xv is not None else None
    is_mip = bool(m.IsMIP)
    bound: float | None = None
    if is_mip:
        try:
            bound = float(m.ObjBound)
        except (gp.GurobiError, AttributeError):
            bound = None
        if bound is not None and not abs(bound) < GRB.INFINITY:
            bound = None
    elif status == "optimal":
        bound = obj
    return SolveResult(
        solver="gurobi",
        status=status,
        x=xv,
        objective=obj,
        best_bound=bound,
        gap=0.0 if (status == "optimal" and not is_mip) else relative_gap(obj, bound),
        solve_time_s=elapsed,
        message=status_name(code),
        time_to_first_s=first[0] if first else (elapsed if xv is not None else None),
        n_nodes=int(m.NodeCount) if is_mip else 0,
    )


def solve_gurobi(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
) -> SolveResult:
    """Solve with Gurobi. Options: ``TimeLimit``, ``MIPGap``, ``Threads``, ``Seed``,
    ``OutputFlag``; ``relax`` builds every column continuous. ``warm_start`` is the MIP start
    (``Start`` of every column). ``progress`` is called from the MIPSOL callback whenever the
    incumbent improves."""
    try:
        import gurobipy as gp
        from gurobipy import GRB
    except ImportError as exc:
        raise SolverUnavailable(
            "solver=gurobi needs the 'gurobipy' package: pip install gurobipy"
        ) from exc

    env = _start_env(gp, options)
    t_build = time.perf_counter()
    m = gp.Model(model.name, env=env)
    try:
        x = _build(m, GRB, model, options, warm_start)
        grb_vars, grb_rows = m.NumVars, m.NumConstrs
        log.info(
            "gurobi: %d vars, %d rows (%d as Gurobi rows), %d products, built in %.2f s",
            model.n_vars,
            model.n_rows,
            grb_rows,
            model.q_val.size,
            time.perf_counter() - t_build,
        )
        t0 = time.perf_counter()
        first: list[float] = []
        cb = _incumbent_callback(GRB, t0, first, progress)
        try:
            code = _optimize(m, cb, model, options, t0)
        except gp.GurobiError as exc:
            if exc.errno == SIZE_LIMIT_ERRNO:
                raise SolverUnavailable(licence_message(model, grb_vars, grb_rows)) from exc
            return SolveResult.failed(
                "gurobi", time.perf_counter() - t0, f"Gurobi error {exc.errno}: {exc}"
            )
        return _result(gp, GRB, m, x, model, code, time.perf_counter() - t0, first)
    finally:
        m.dispose()
        env.dispose()
