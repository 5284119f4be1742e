"""SCIP back-end (pyscipopt): takes the paper's exact MIQP with its products.

SCIP's objective must be linear, so the products ``sum q * x_i * x_j`` go into one auxiliary
free column ``z`` with the quadratic constraint ``z >= sum q * x_i * x_j`` and ``z`` is added to
the objective (at a minimum ``z`` equals the product sum). SCIP handles the non-convex products
itself (spatial branching; for binaries it reformulates).

Threads: ``Model.optimize()`` is single-threaded; ``options.threads`` is ignored here (SCIP's
``solveConcurrent`` exists but is a different, racing solve and is not used).
"""

from __future__ import annotations

import logging
import time

import numpy as np

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

_LIMITS = {
    "timelimit",
    "nodelimit",
    "totalnodelimit",
    "stallnodelimit",
    "memlimit",
    "sollimit",
    "bestsollimit",
    "restartlimit",
    "userinterrupt",
    "primallimit",
    "duallimit",
}


BACKEND = Backend(
    name="scip",
    target=f"{__name__}:solve_scip",
    packages=("pyscipopt",),
    takes_lp=True,
    takes_milp=True,
    takes_quadratic=True,
    statuses={
        "optimal": "optimal",
        "gaplimit": "optimal",
        "infeasible": "infeasible",
        **dict.fromkeys(_LIMITS, "feasible"),
    },
)
"""solver=scip: LP, MILP and the paper's MIQP (products through one quadratic row)."""
BACKENDS = (BACKEND,)


def map_status(scip_status: str, has_solution: bool, bounded: bool = False) -> str:
    """SCIP ``getStatus()`` -> one of STATUSES.

    ``gaplimit`` means the relative gap reached ``options.rel_gap``, which every other back-end
    reports as optimal too. ``inforunbd`` is infeasible when every column has finite bounds
    (``bounded``); otherwise it is left as an error."""
    s = scip_status.lower()
    if s == "inforunbd" and bounded:
        return "infeasible"
    status = BACKEND.status(s, has_solution)
    if status == "optimal" and not has_solution:
        return "error"
    return status


def _build(s, Expr, ExprCons, Term, model: MilpModel, options: SolverOptions):
    """The model into SCIP ``s``: columns, ranged rows, and the linear objective with the
    products moved into one quadratic row on the free column ``z`` (module docstring).
    Returns the columns and ``z`` (None without products)."""
    n = model.n_vars
    lb, ub = model.lb, model.ub
    if options.relax:
        vt = ["C"] * n
    else:
        binary = model.integrality & (lb >= 0) & (ub <= 1)
        vt = np.where(binary, "B", np.where(model.integrality, "I", "C")).tolist()
    lbl = [None if not np.isfinite(v) else float(v) for v in lb]
    ubl = [None if not np.isfinite(v) else float(v) for v in ub]
    xs = [s.addVar(f"x{j}", vtype=vt[j], lb=lbl[j], ub=ubl[j]) for j in range(n)]

    A = model.A.tocsr().copy()
    A.sum_duplicates()
    indptr, indices, data = A.indptr, A.indices.tolist(), A.data.tolist()
    rlb = [None if not np.isfinite(v) else float(v) for v in model.row_lb]
    rub = [None if not np.isfinite(v) else float(v) for v in model.row_ub]
    for r in range(model.n_rows):
        a, b = int(indptr[r]), int(indptr[r + 1])
        if rlb[r] is None and rub[r] is None:
            continue
        expr = Expr({Term(xs[indices[k]]): data[k] for k in range(a, b)})
        s.addCons(ExprCons(expr, lhs=rlb[r], rhs=rub[r]), name=f"r{r}")

    terms: dict = {}
    for j in np.flatnonzero(model.c):
        terms[Term(xs[j])] = float(model.c[j])
    z = None
    if model.is_quadratic:
        z = s.addVar("z_products", vtype="C", lb=None, ub=None)
        q: dict = {Term(z): 1.0}
        for i, j, v in zip(
            model.q_i.tolist(), model.q_j.tolist(), model.q_val.tolist(), strict=True
        ):
            key = Term(xs[i], xs[j])
            q[key] = q.get(key, 0.0) - v
        s.addCons(ExprCons(Expr(q), lhs=0.0), name="products")
        terms[Term(z)] = 1.0
    s.setObjective(Expr(terms), "minimize")
    if model.offset:
        s.addObjoffset(float(model.offset))
    return xs, z


def _add_start(s, xs, z, model: MilpModel, warm_start: np.ndarray) -> None:
    """The warm start as a complete solution (``z`` set to its product sum)."""
    w = np.asarray(warm_start, dtype=float)
    sol = s.createSol()
    for j in range(model.n_vars):
        s.setSolVal(sol, xs[j], float(w[j]))
    if z is not None:
        s.setSolVal(sol, z, float(np.sum(model.q_val * w[model.q_i] * w[model.q_j])))
    if not s.addSol(sol, free=True):
        log.info("scip: the warm start was not accepted")


def _progress_handler(SCIP_EVENTTYPE, Eventhdlr, t0, first, progress, inf):
    """A BESTSOLFOUND event handler: notes the time of the first incumbent in ``first`` and
    passes every new best one to ``progress``."""

    class _Progress(Eventhdlr):
        def eventinit(self) -> None:
            self.model.catchEvent(SCIP_EVENTTYPE.BESTSOLFOUND, self)

        def eventexit(self) -> None:
            self.model.dropEvent(SCIP_EVENTTYPE.BESTSOLFOUND, self)

        def eventexec(self, event) -> None:  # noqa: ANN001 - pyscipopt event
            el = time.perf_counter() - t0
            if not first:
                first.append(el)
            if progress is not None:
                obj = float(self.model.getSolObjVal(self.model.getBestSol()))
                bnd = float(self.model.getDualbound())
                progress(el, obj, bnd if abs(bnd) < inf else None)

    return _Progress()


def solve_scip(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
) -> SolveResult:
    """Solve with SCIP. Options: ``limits/time``, ``limits/gap``,
    ``randomization/randomseedshift``; ``verbose`` shows SCIP's log; ``relax`` builds every
    column continuous (with products that is a non-convex continuous problem, still solved
    globally). ``threads`` is ignored: SCIP's optimize is single-threaded. ``warm_start`` is
    added as a complete solution (``z`` set to its product sum). ``progress`` is called from a
    BESTSOLFOUND event handler."""
    try:
        from pyscipopt import SCIP_EVENTTYPE, Eventhdlr, Model
        from pyscipopt.scip import Expr, ExprCons, Term
    except ImportError as exc:
        raise SolverUnavailable(
            "solver=scip needs the 'pyscipopt' package: pip install pyscipopt"
        ) from exc

    t_build = time.perf_counter()
    s = Model(model.name)
    s.hideOutput(not options.verbose)
    inf = s.infinity()
    xs, z = _build(s, Expr, ExprCons, Term, model, options)
    if options.time_limit_s is not None:
        s.setParam("limits/time", float(options.time_limit_s))
    s.setParam("limits/gap", float(options.rel_gap))
    s.setParam("randomization/randomseedshift", int(options.seed))
    if warm_start is not None and not options.relax:
        _add_start(s, xs, z, model, warm_start)

    t0 = time.perf_counter()
    first: list[float] = []
    handler = _progress_handler(SCIP_EVENTTYPE, Eventhdlr, t0, first, progress, inf)
    s.includeEventhdlr(handler, "xengine_progress", "reports improving incumbents")
    log.info(
        "scip: %d vars, %d rows, %d products, built in %.2f s",
        model.n_vars,
        model.n_rows,
        model.q_val.size,
        t0 - t_build,
    )
    # SCIP's own Ctrl-C handler would end the solve as "userinterrupt", a limit like any
    # other: the signal goes to Python instead, which stops the solve and passes it on
    s.setBoolParam("misc/catchctrlc", False)
    try:
        run_stoppable(s.optimizeNogil, s.interruptSolve, "scip")
    except Exception as exc:  # noqa: BLE001 - SCIP errors surface as generic exceptions
        return SolveResult.failed("scip", time.perf_counter() - t0, f"SCIP error: {exc}")
    elapsed = time.perf_counter() - t0
    raw = s.getStatus()
    if raw == "userinterrupt":  # not ours: a signal SCIP caught after all
        raise Interrupted()
    has_sol = s.getNSols() > 0
    bounded = bool(np.all(np.isfinite(model.lb)) and np.all(np.isfinite(model.ub)))
    status = map_status(raw, has_sol, bounded)
    xv = None
    if status in SOLUTION_STATUSES:
        best = s.getBestSol()
        xv = np.array([s.getSolVal(best, v) for v in xs], dtype=float)
    obj = model.objective(xv) if xv is not None else None
    bnd = float(s.getDualbound())
    bound = bnd if abs(bnd) < inf else None
    if status == "infeasible":
        bound = None
    return SolveResult(
        solver="scip",
        status=status,
        x=xv,
        objective=obj,
        best_bound=bound,
        gap=relative_gap(obj, bound),
        solve_time_s=elapsed,
        message=raw,
        time_to_first_s=first[0] if first else (elapsed if xv is not None else None),
        n_nodes=int(s.getNTotalNodes()),
    )
