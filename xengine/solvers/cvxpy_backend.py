"""cvxpy back-end: the same model through cvxpy to any MILP solver it has (Checkmate's path).

One vector variable and at most three vectorised constraints (``A_eq @ x == b``,
``A_le @ x <= u``, ``A_ge @ x >= l``), never one cvxpy constraint per row (section 4 of
shared/reference/dependencies.md: per-row constraints cost ~4 ms each). Integer columns are
cvxpy ``integer`` indices unless ``options.relax`` (then the LP relaxation, as Checkmate does).

Registered names: ``cvxpy`` (inner solver HIGHS), ``cvxpy-scip``, ``cvxpy-gurobi``; any other
installed cvxpy solver through ``solve_cvxpy(..., cvxpy_solver="NAME")``. A missing inner
solver is :class:`SolverUnavailable` naming it.

Limits: products are rejected (a product of variables is not DCP). cvxpy exposes no callbacks:
``progress`` is called once at the end with the final incumbent, and ``time_to_first_s`` is the
whole solve time (an upper bound). Neutral options map to the inner solver's names for HIGHS,
SCIP, GUROBI and SCIPY; for others only the defaults are used (logged).
"""

from __future__ import annotations

import logging
import time
import warnings

import numpy as np

from xengine.interrupt import run_stoppable
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

FEAS_TOL = 1e-6  # a returned point violating the model by more is not an incumbent
_INSTALL = {
    "HIGHS": "pip install highspy",
    "SCIP": "pip install pyscipopt",
    "GUROBI": "pip install gurobipy",
    "CBC": "pip install cylp",
    "SCIPY": "pip install scipy",
}


_STATUSES = {
    "optimal": "optimal",
    "infeasible": "infeasible",
    "infeasible_inaccurate": "infeasible",
    "user_limit": "feasible",
    "optimal_inaccurate": "feasible",
}
"""cvxpy's ``Problem.status`` -> STATUSES (the inner solver's own status is read where cvxpy
passes it on, see :func:`_inner`)."""


def _declare(name: str, function: str, inner_package: str) -> Backend:
    """One registered name: cvxpy plus the package of its inner solver; LP and MILP, no
    products (a product of variables is not DCP)."""
    return Backend(
        name=name,
        target=f"{__name__}:{function}",
        packages=("cvxpy", inner_package),
        takes_lp=True,
        takes_milp=True,
        takes_quadratic=False,
        statuses=_STATUSES,
    )


BACKENDS = (
    _declare("cvxpy", "solve_cvxpy", "highspy"),  # inner solver HIGHS
    _declare("cvxpy-scip", "solve_cvxpy_scip", "pyscipopt"),
    _declare("cvxpy-gurobi", "solve_cvxpy_gurobi", "gurobipy"),
)


def map_status(cvxpy_status: str, has_solution: bool) -> str:
    """cvxpy ``Problem.status`` -> one of STATUSES, used when the inner solver's own status is
    not available. ``user_limit`` / ``optimal_inaccurate`` keep the incumbent as feasible."""
    status = BACKENDS[0].status(cvxpy_status, has_solution)
    if status == "optimal" and not has_solution:
        return "error"
    return status


def _solver_options(name: str, options: SolverOptions, is_mip: bool) -> dict:
    o: dict = {}
    tl = options.time_limit_s
    if name == "HIGHS":
        if tl is not None:
            o["time_limit"] = float(tl)
        o["mip_rel_gap"] = float(options.rel_gap)
        o["random_seed"] = int(options.seed)
        if options.threads:
            # HiGHS keeps one thread pool per process (shared with solver=highs).
            import highspy

            from xengine.solvers.highs import share_thread_pool

            share_thread_pool(highspy, int(options.threads))
            o["threads"] = int(options.threads)
    elif name == "SCIP":
        p = {
            "limits/gap": float(options.rel_gap),
            "randomization/randomseedshift": int(options.seed),
        }
        if tl is not None:
            p["limits/time"] = float(tl)
        o["scip_params"] = p
    elif name == "GUROBI":
        import gurobipy as gp

        try:
            env = gp.Env(empty=True)  # a quiet environment: no licence banner unless verbose
            env.setParam("OutputFlag", 1 if options.verbose else 0)
            env.start()
        except gp.GurobiError as exc:
            raise SolverUnavailable(
                f"solver=cvxpy-gurobi: gurobipy cannot start (Gurobi error {exc.errno}: {exc}); "
                "use solver=highs (default) or set up a Gurobi licence (GRB_LICENSE_FILE)"
            ) from exc
        o["env"] = env
        if tl is not None:
            o["TimeLimit"] = float(tl)
        o["MIPGap"] = float(options.rel_gap)
        o["Seed"] = int(options.seed)
        if options.threads:
            o["Threads"] = int(options.threads)
    elif name == "SCIPY":
        so = {}
        if tl is not None:
            so["time_limit"] = float(tl)
        if is_mip:
            so["mip_rel_gap"] = float(options.rel_gap)
        o["scipy_options"] = so
    else:
        log.info("cvxpy: neutral options are not mapped for inner solver %s (defaults used)", name)
    return o


def _inner(name: str, stats, fallback: str, has_sol: bool, bounded: bool):  # noqa: ANN001
    """(status, best bound, nodes) from the inner solver's own report where cvxpy passes it on."""
    extra = getattr(stats, "extra_stats", None) if stats is not None else None
    if extra is None:
        return map_status(fallback, has_sol), None, None
    try:
        if name == "SCIP" and isinstance(extra, dict) and "scip_status" in extra:
            from xengine.solvers.scip import map_status as scip_map

            mdl = extra.get("model")
            bnd = float(mdl.getDualbound()) if mdl is not None else None
            if bnd is not None and abs(bnd) >= mdl.infinity():
                bnd = None
            nodes = int(mdl.getNTotalNodes()) if mdl is not None else None
            return scip_map(extra["scip_status"], has_sol, bounded), bnd, nodes
        if name == "GUROBI" and hasattr(extra, "Status"):
            from xengine.solvers.gurobi import map_status as grb_map

            code = int(extra.Status)
            st = grb_map(code, int(extra.SolCount) if has_sol else 0)
            if code == 4 and bounded:
                st = "infeasible"
            if st == "optimal" and not has_sol:
                st = "error"
            bnd = None
            if extra.IsMIP:
                try:
                    bnd = float(extra.ObjBound)
                except Exception:  # noqa: BLE001 - no bound available
                    bnd = None
            if bnd is not None and not abs(bnd) < 1e100:
                bnd = None
            nodes = int(extra.NodeCount) if extra.IsMIP else 0
            return st, bnd, nodes
        if name == "HIGHS" and hasattr(extra, "mip_dual_bound"):
            bnd = float(extra.mip_dual_bound)
            if int(getattr(extra, "primal_solution_status", 2)) != 2:
                has_sol = False  # HiGHS has no feasible point; cvxpy passes on zeros
            nodes = int(getattr(extra, "mip_node_count", 0) or 0)
            bnd = bnd if np.isfinite(bnd) else None
            return map_status(fallback, has_sol), bnd, nodes
    except Exception as exc:  # noqa: BLE001 - inner report unreadable: fall back to cvxpy's
        log.debug("cvxpy: could not read %s's own report: %s", name, exc)
    return map_status(fallback, has_sol), None, None


def _import_cvxpy(label: str, name: str):  # noqa: ANN202 - the cvxpy module
    """cvxpy, with inner solver ``name`` installed, else :class:`SolverUnavailable` naming
    what to install."""
    try:
        import cvxpy as cp
    except ImportError as exc:
        raise SolverUnavailable(
            f"solver={label} needs the 'cvxpy' package: pip install cvxpy"
        ) from exc
    if name not in cp.installed_solvers():
        hint = _INSTALL.get(name, f"install {name} for cvxpy")
        raise SolverUnavailable(
            f"solver={label}: cvxpy's inner solver {name} is not installed ({hint}); "
            f"installed: {', '.join(cp.installed_solvers())}"
        )
    return cp


def _build(cp, model: MilpModel, options: SolverOptions, warm_start, is_mip: bool):
    """One vector variable and at most three vectorised constraints (module docstring).
    Returns (problem, variable, constraints)."""
    kw: dict = {}
    if is_mip:
        kw["integer"] = (np.flatnonzero(model.integrality),)
    x = cp.Variable(model.n_vars, bounds=[model.lb.astype(float), model.ub.astype(float)], **kw)
    A = model.A.tocsr()
    lo, hi = model.row_lb, model.row_ub
    eq = np.isfinite(lo) & np.isfinite(hi) & (lo == hi)
    le = np.isfinite(hi) & ~eq
    ge = np.isfinite(lo) & ~eq
    cons = []
    if eq.any():
        cons.append(A[eq] @ x == lo[eq])
    if le.any():
        cons.append(A[le] @ x <= hi[le])
    if ge.any():
        cons.append(A[ge] @ x >= lo[ge])
    prob = cp.Problem(cp.Minimize(model.c @ x + float(model.offset)), cons)
    if warm_start is not None and not options.relax:
        x.value = np.asarray(warm_start, dtype=float)
    return prob, x, cons


def _solver_error(
    exc: Exception, label: str, name: str, model: MilpModel, options: SolverOptions, elapsed: float
) -> SolveResult:
    """cvxpy's ``SolverError`` as a result: Gurobi's size-limited licence is
    :class:`SolverUnavailable` (as for solver=gurobi), a failure at the time limit is
    ``no_solution`` (cvxpy turns "time limit, no incumbent" into a failure for some solvers,
    SCIP), anything else an ``error``."""
    if name == "GUROBI":
        from xengine.solvers.gurobi import (
            LICENCE_MAX_ROWS,
            LICENCE_MAX_VARS,
            LICENCE_MAX_VARS_QUADRATIC,
            licence_message,
        )

        limit = LICENCE_MAX_VARS_QUADRATIC if model.is_quadratic else LICENCE_MAX_VARS
        if model.n_vars > limit or model.n_rows > LICENCE_MAX_ROWS:
            raise SolverUnavailable(
                licence_message(model).replace("solver=gurobi", f"solver={label}")
                + f" (cvxpy said: {exc})"
            ) from exc
    tl = options.time_limit_s
    if tl is not None and elapsed >= 0.9 * tl:
        return SolveResult(
            solver=label,
            status="no_solution",
            x=None,
            objective=None,
            best_bound=None,
            gap=None,
            solve_time_s=elapsed,
            message=f"cvxpy/{name} failed at the time limit ({tl:g} s): {exc}",
        )
    return SolveResult.failed(label, elapsed, f"cvxpy/{name}: {exc}")


def _incumbent(x, model: MilpModel, is_mip: bool) -> np.ndarray | None:  # noqa: ANN001
    """cvxpy's point if it is one of the model (of its relaxation for an LP) within
    :data:`FEAS_TOL`; cvxpy may hand back values where the inner solver has none."""
    if x.value is None:
        return None
    cand = np.asarray(x.value, dtype=float).reshape(-1)
    if cand.shape == (model.n_vars,) and np.all(np.isfinite(cand)):
        check = model if is_mip else _relaxed(model)
        if check.max_violation(cand) <= FEAS_TOL * max(1.0, float(np.abs(cand).max(initial=0))):
            return cand
    return None


def solve_cvxpy(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
    cvxpy_solver: str = "HIGHS",
) -> SolveResult:
    """Solve through cvxpy with inner solver ``cvxpy_solver`` (see the module docstring)."""
    label = "cvxpy" if cvxpy_solver.upper() == "HIGHS" else f"cvxpy-{cvxpy_solver.lower()}"
    name = cvxpy_solver.upper()
    cp = _import_cvxpy(label, name)
    if model.is_quadratic:
        raise SolverUnavailable(
            f"solver={label} cannot take products of variables (not DCP); build the linearised "
            "model (formulation mode=paper, linearize=True) or use solver=scip / gurobi"
        )

    t_build = time.perf_counter()
    is_mip = bool(model.n_integer) and not options.relax
    prob, x, cons = _build(cp, model, options, warm_start, is_mip)
    solver_opts = _solver_options(name, options, is_mip)
    log.info(
        "%s: %d vars, %d rows as %d cvxpy constraints, built in %.2f s",
        label,
        model.n_vars,
        model.n_rows,
        len(cons),
        time.perf_counter() - t_build,
    )

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # "Solution may be inaccurate": the status mapping below reports it
            warnings.filterwarnings("ignore", message="Solution may be inaccurate")
            # cvxpy has no cancel: on an interrupt its solve is left to end with the process
            run_stoppable(
                lambda: prob.solve(
                    solver=name,
                    verbose=bool(options.verbose),
                    warm_start=warm_start is not None,
                    **solver_opts,
                ),
                None,
                label,
            )
    except cp.error.SolverError as exc:
        return _solver_error(exc, label, name, model, options, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    xv = _incumbent(x, model, is_mip)
    bounded = bool(np.all(np.isfinite(model.lb)) and np.all(np.isfinite(model.ub)))
    stats = getattr(prob, "solver_stats", None)
    status, bound, nodes = _inner(name, stats, prob.status, xv is not None, bounded)
    if "env" in solver_opts:
        solver_opts["env"].dispose()
    if bound is not None:
        bound += float(model.offset)  # cvxpy keeps the constant out of the inner solver
    if status not in SOLUTION_STATUSES:
        xv = None
    obj = model.objective(xv) if xv is not None else None
    if not is_mip and status == "optimal":
        bound = obj
    if status == "infeasible":
        bound = None
    if xv is not None and progress is not None:
        progress(elapsed, obj, bound)
    return SolveResult(
        solver=label,
        status=status,
        x=xv,
        objective=obj,
        best_bound=bound,
        gap=relative_gap(obj, bound),
        solve_time_s=elapsed,
        message=f"cvxpy status {prob.status}",
        time_to_first_s=elapsed if xv is not None else None,
        n_nodes=nodes,
    )


def _relaxed(model: MilpModel) -> MilpModel:
    from dataclasses import replace

    return replace(model, integrality=np.zeros_like(model.integrality))


def solve_cvxpy_scip(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
) -> SolveResult:
    """cvxpy with SCIP as the inner solver (registered as ``cvxpy-scip``)."""
    return solve_cvxpy(model, options, warm_start, progress, cvxpy_solver="SCIP")


def solve_cvxpy_gurobi(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
) -> SolveResult:
    """cvxpy with Gurobi as the inner solver (registered as ``cvxpy-gurobi``; same size-limited
    licence as solver=gurobi)."""
    return solve_cvxpy(model, options, warm_start, progress, cvxpy_solver="GUROBI")
