"""OR-Tools CP-SAT back-end: integer variables and integer row coefficients only.

CP-SAT is not given a discretised model. A model is accepted only if every continuous column
can be made an integer variable *without changing the optimum*; otherwise
:class:`SolverUnavailable` says which column stops it. Two rules (see :func:`integerise`):

1. **Defined by an equality.** A continuous column ``x_j`` alone (among unresolved continuous
   columns) in an equality row whose other columns are integer (or already resolved) is a fixed
   combination of integers: ``sigma_j * x_j`` is an integer at *every* feasible point for the
   ``sigma_j`` found by a floating-point gcd of the row's ratios. The memory columns ``U`` of
   :mod:`xengine.strategies.formulation` (sums of tensor sizes) are resolved this way, in units of
   the gcd of the tensor sizes.
2. **Implied integer.** A continuous column with integer bounds whose "good" rows (all other
   columns integer/resolved-by-1, coefficients and sides integer after dividing by its
   coefficient) bound it by integers, while every other row only bounds it from the side the
   objective pushes away from (``c_j >= 0``: upper bounds only). Moving it to its smallest
   (largest) value allowed by the good rows keeps every point feasible and no worse, so an
   integer optimum exists. The copy indicators ``X`` and AND columns ``W`` are of this kind.

Every row is then multiplied by ``1 / gcd`` of its coefficients (on the integer variables) and
rounded; the largest relative rounding error is reported in ``SolveResult.message`` (it is 0 or
~1e-12 for xengine's models). The objective stays floating point (CP-SAT supports that). The
returned objective is ``model.objective(x)`` of the unscaled ``x``. Products and LP
relaxations are rejected. ``options.threads`` maps to ``num_workers`` (CP-SAT's default uses
every core).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

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

RTOL = 1e-9  # relative tolerance for "is an integer multiple"
MAX_RATIO = 2.0**40  # largest integer coefficient (max / gcd) accepted in a row
BACKEND = Backend(
    name="cpsat",
    target=f"{__name__}:solve_cpsat",
    packages=("ortools",),
    takes_lp=False,
    takes_milp=True,
    takes_quadratic=False,
    integer_only=True,
    statuses={
        "OPTIMAL": "optimal",
        "FEASIBLE": "feasible",
        "INFEASIBLE": "infeasible",
        "UNKNOWN": "no_solution",
        "MODEL_INVALID": "error",
    },
)
"""solver=cpsat: MILPs whose continuous columns are integers in disguise (module docstring);
no LP relaxations, no products. Its status map is also the interval model's
(:mod:`xengine.strategies.intervals`)."""
BACKENDS = (BACKEND,)


def map_status(name: str) -> str:
    """CP-SAT status name -> one of STATUSES (CP-SAT reports OPTIMAL once the gap limit is
    reached, like the others; FEASIBLE means a limit stopped it with an incumbent)."""
    return BACKEND.status(name)


def fgcd(values: np.ndarray, rtol: float = RTOL) -> float | None:
    """Largest g with every value an integer multiple of g (within ``rtol``), or None when the
    values are not commensurable within ``MAX_RATIO``. Zero values are ignored; all-zero -> 1."""
    v = np.abs(np.asarray(values, dtype=float))
    v = v[v > 0]
    if v.size == 0:
        return 1.0
    vmax = float(v.max())
    tol = max(vmax / MAX_RATIO, vmax * 1e-15) * 0.5
    g = float(v[0])
    for b in v[1:].tolist():
        a = g
        while b > tol:
            r = abs(a - round(a / b) * b)
            a, b = b, r
        g = a
        if g <= tol:
            return None
    k = v / g
    if float(k.max()) > MAX_RATIO or np.any(np.abs(k - np.round(k)) > rtol * np.maximum(1.0, k)):
        return None
    # re-fit g from the rounded multiples (least squares) to remove drift
    kr = np.round(k)
    return float(np.dot(kr, v) / np.dot(kr, kr))


@dataclass
class Integerised:
    """``x = y / sigma`` with integer ``y`` in [ylb, yub]; ``rule`` 0 integer, 1 equality, 2
    implied integer, 3 fixed."""

    sigma: np.ndarray
    ylb: np.ndarray
    yub: np.ndarray
    rule: np.ndarray


def _ceil(v: float) -> float:
    if not np.isfinite(v):
        return float(v)
    return float(math.ceil(v - RTOL * max(1.0, abs(v))))


def _floor(v: float) -> float:
    if not np.isfinite(v):
        return float(v)
    return float(math.floor(v + RTOL * max(1.0, abs(v))))


def _start(model: MilpModel) -> Integerised:
    """The columns resolved before any rule: integer columns (rule 0, integer bounds, which
    must be finite) and fixed continuous ones (rule 3, ``y = sign`` of the fixed value)."""
    n = model.n_vars
    lb, ub = model.lb.astype(float), model.ub.astype(float)
    integ = Integerised(
        sigma=np.ones(n),
        ylb=np.full(n, -np.inf),
        yub=np.full(n, np.inf),
        rule=np.full(n, -1, dtype=np.int64),
    )
    sigma, ylb, yub, rule = integ.sigma, integ.ylb, integ.yub, integ.rule
    ints = np.flatnonzero(model.integrality)
    rule[ints] = 0
    for j in ints.tolist():
        ylb[j], yub[j] = _ceil(lb[j]), _floor(ub[j])
    bad_int = ints[~(np.isfinite(ylb[ints]) & np.isfinite(yub[ints]))]
    if bad_int.size:
        raise SolverUnavailable(
            f"solver=cpsat needs finite bounds on integer columns; {bad_int.size} have none "
            f"(e.g. column {int(bad_int[0])}); use solver=highs (default)"
        )
    for j in np.flatnonzero(~model.integrality).tolist():
        if lb[j] == ub[j]:
            rule[j] = 3
            sigma[j] = 1.0 / abs(lb[j]) if lb[j] != 0 else 1.0
            ylb[j] = yub[j] = float(np.sign(lb[j]))
    return integ


def _defined_by_equalities(model: MilpModel, A, C, integ: Integerised) -> None:
    """Rule 1 (module docstring), in place: a queue of equality rows with one unresolved
    continuous column; resolving a column may leave another row with one."""
    lb, ub = model.lb.astype(float), model.ub.astype(float)
    sigma, ylb, yub, rule = integ.sigma, integ.ylb, integ.yub, integ.rule
    eq = np.isfinite(model.row_lb) & (model.row_lb == model.row_ub)
    unresolved = rule < 0
    cnt = np.zeros(model.n_rows, dtype=np.int64)
    rows_of_unres = A[:, unresolved]
    cnt[:] = np.diff((rows_of_unres != 0).astype(np.int8).tocsr().indptr)
    queue = deque(np.flatnonzero(eq & (cnt == 1)).tolist())
    indptr, indices, data = A.indptr, A.indices, A.data
    cptr, crow = C.indptr, C.indices
    while queue:
        r = queue.popleft()
        if cnt[r] != 1:
            continue
        cols = indices[indptr[r] : indptr[r + 1]]
        vals = data[indptr[r] : indptr[r + 1]]
        k = np.flatnonzero(rule[cols] < 0)
        if k.size != 1:
            continue
        j, a = int(cols[k[0]]), float(vals[k[0]])
        other = np.ones(cols.size, dtype=bool)
        other[k[0]] = False
        oc, ov = cols[other], vals[other]
        ratio = ov / (a * sigma[oc])  # x_j = b/a - sum ratio * y_i
        b_over_a = float(model.row_lb[r]) / a
        g = fgcd(np.concatenate([ratio, [b_over_a]]))
        if g is None:
            continue
        s_j = 1.0 / g
        # interval of y_j = s_j * (b/a - sum ratio * y_i)
        coef = -s_j * ratio
        lo = s_j * b_over_a + float(np.sum(np.minimum(coef * ylb[oc], coef * yub[oc])))
        hi = s_j * b_over_a + float(np.sum(np.maximum(coef * ylb[oc], coef * yub[oc])))
        lo = max(lo, s_j * lb[j]) if np.isfinite(lb[j]) else lo
        hi = min(hi, s_j * ub[j]) if np.isfinite(ub[j]) else hi
        if not (np.isfinite(lo) and np.isfinite(hi)):
            continue
        sigma[j], rule[j] = s_j, 1
        ylb[j], yub[j] = _ceil(lo), _floor(hi)
        for rr in crow[cptr[j] : cptr[j + 1]].tolist():
            cnt[rr] -= 1
            if eq[rr] and cnt[rr] == 1:
                queue.append(rr)


def _implied_integers(model: MilpModel, A, C, integ: Integerised) -> None:
    """Rule 2 (module docstring), in place, checked against the columns resolved so far
    (integer, rule 1, fixed) only."""
    lb, ub = model.lb.astype(float), model.ub.astype(float)
    sigma, ylb, yub, rule = integ.sigma, integ.ylb, integ.yub, integ.rule
    indptr, indices, data = A.indptr, A.indices, A.data
    cptr, crow = C.indptr, C.indices
    base = rule >= 0
    for j in np.flatnonzero(rule < 0).tolist():
        lo_j, hi_j = _ceil(lb[j]), _floor(ub[j])
        if (
            not (np.isfinite(lb[j]) and np.isfinite(ub[j]))
            or abs(lo_j - lb[j]) > 1e-9
            or abs(hi_j - ub[j]) > 1e-9
        ):
            continue
        bad_up = bad_down = False  # some non-integral row bounds x_j from above / below
        for r in crow[cptr[j] : cptr[j + 1]].tolist():
            cols = indices[indptr[r] : indptr[r + 1]]
            vals = data[indptr[r] : indptr[r + 1]]
            pos = int(np.flatnonzero(cols == j)[0])
            a = float(vals[pos])
            other = np.ones(cols.size, dtype=bool)
            other[pos] = False
            oc, ov = cols[other], vals[other]
            good = bool(np.all(base[oc]))
            if good:
                k = ov / (a * sigma[oc])
                sides = [v / a for v in (model.row_lb[r], model.row_ub[r]) if np.isfinite(v)]
                k = np.concatenate([k, sides])
                good = bool(np.all(np.abs(k - np.round(k)) <= RTOL * np.maximum(1.0, np.abs(k))))
            if good:
                continue
            caps_up = (a > 0 and np.isfinite(model.row_ub[r])) or (
                a < 0 and np.isfinite(model.row_lb[r])
            )
            caps_down = (a > 0 and np.isfinite(model.row_lb[r])) or (
                a < 0 and np.isfinite(model.row_ub[r])
            )
            bad_up |= bool(caps_up)
            bad_down |= bool(caps_down)
        cj = float(model.c[j])
        if (bad_up and bad_down) or (bad_up and cj < 0) or (bad_down and cj > 0):
            continue
        rule[j], sigma[j] = 2, 1.0
        ylb[j], yub[j] = lo_j, hi_j


def integerise(model: MilpModel) -> Integerised:
    """Find ``sigma`` per column (1 for integer columns) such that the model with
    ``y = sigma * x`` integer has the same optimum. Raises :class:`SolverUnavailable`."""
    A = model.A.tocsr().copy()
    A.sum_duplicates()
    A.eliminate_zeros()
    C = A.tocsc()
    integ = _start(model)
    _defined_by_equalities(model, A, C, integ)
    _implied_integers(model, A, C, integ)
    left = np.flatnonzero(integ.rule < 0)
    if left.size:
        n_cont = int((~model.integrality).sum())
        raise SolverUnavailable(
            f"solver=cpsat takes integer variables only: {left.size} of the model's "
            f"{n_cont} continuous columns (e.g. column {int(left[0])}) are neither defined "
            "by an equality over integer columns nor implied integer, so CP-SAT could only "
            "solve a discretised model; use solver=highs (default), scip or gurobi"
        )
    return integ


def scaled_rows(model: MilpModel, sigma: np.ndarray):
    """Rows over ``y`` with integer coefficients: a list of (cols, int coefs, lo, hi), the
    largest relative coefficient rounding error, and the first row no integer point can
    satisfy (or None). Raises SolverUnavailable when a row cannot be scaled to integers."""
    A = model.A.tocsr().copy()
    A.sum_duplicates()
    A.eliminate_zeros()
    out = []
    worst = 0.0
    empty_infeasible: int | None = None
    for r in range(model.n_rows):
        lo_r, hi_r = float(model.row_lb[r]), float(model.row_ub[r])
        if not (np.isfinite(lo_r) or np.isfinite(hi_r)):
            continue
        a, b = A.indptr[r], A.indptr[r + 1]
        cols = A.indices[a:b]
        v = A.data[a:b] / sigma[cols]
        if v.size == 0:
            if lo_r > 1e-9 or hi_r < -1e-9:
                empty_infeasible = r if empty_infeasible is None else empty_infeasible
            continue
        g = fgcd(v)
        if g is None:
            raise SolverUnavailable(
                f"solver=cpsat needs integer coefficients: row {r} of {model.name!r} cannot be "
                f"scaled to integers (coefficient ratios beyond {MAX_RATIO:.0e} or not "
                f"commensurable within {RTOL:g}); use solver=highs (default)"
            )
        k = v / g
        kr = np.round(k)
        worst = max(worst, float(np.max(np.abs(k - kr) / np.maximum(np.abs(k), 1.0))))
        lo = _ceil(lo_r / g) if np.isfinite(lo_r) else -np.inf
        hi = _floor(hi_r / g) if np.isfinite(hi_r) else np.inf
        if lo > hi:  # e.g. 2 y == 1: no integer point
            empty_infeasible = r if empty_infeasible is None else empty_infeasible
            continue
        out.append((cols, kr.astype(np.int64).tolist(), lo, hi))
    return out, worst, empty_infeasible


def run_cpsat(
    cp_model_module,
    model,
    options: SolverOptions,
    progress: ProgressFn | None = None,
    scale: float = 1.0,
    time_limit_s: float | None = None,
):
    """Solve a built CP-SAT ``model`` with xengine's neutral options and a progress callback
    (objective and bound times ``scale``); ``time_limit_s`` overrides ``options``' limit.
    Returns ``(solver, status_code, elapsed_s, time_to_first_s or None)``."""
    solver = cp_model_module.CpSolver()
    p = solver.parameters
    limit = options.time_limit_s if time_limit_s is None else time_limit_s
    if limit is not None:
        p.max_time_in_seconds = float(limit)
    p.relative_gap_limit = float(options.rel_gap)
    if options.threads:
        p.num_workers = int(options.threads)
        # one worker alone runs one search strategy, without large-neighbourhood search: on
        # resnet50 (two devices, 50 %) it never left a 48.85 ms warm start in 150 s. With
        # interleave_search the one thread takes turns with CP-SAT's whole portfolio, LNS
        # included (48.46 ms in 100 s); deterministic either way.
        p.interleave_search = int(options.threads) == 1
    p.random_seed = int(options.seed)
    p.log_search_progress = bool(options.verbose)

    t0 = time.perf_counter()
    first: list[float] = []

    class _Cb(cp_model_module.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            el = time.perf_counter() - t0
            if not first:
                first.append(el)
            if progress is not None:
                obj, bound = float(self.objective_value), float(self.best_objective_bound)
                progress(el, obj * scale, bound * scale)

    # CP-SAT's own SIGINT handler would end the search as if by a limit: the signal goes to
    # Python instead, which stops the search and passes it on
    p.catch_sigint_signal = False
    code = run_stoppable(lambda: solver.solve(model, _Cb()), solver.stop_search, "cpsat")
    return solver, code, time.perf_counter() - t0, (first[0] if first else None)


def _no_integer_point(integ: Integerised, empty_bad: int | None) -> SolveResult | None:
    """``infeasible`` without a search when a column's integer range or a scaled row without
    columns is empty (CP-SAT would reject such a model as invalid)."""
    why = None
    if np.any(integ.ylb > integ.yub):
        why = f"column {int(np.flatnonzero(integ.ylb > integ.yub)[0])} has no integer value"
    elif empty_bad is not None:
        why = f"row {empty_bad} has no integer solution"
    if why is None:
        return None
    return SolveResult(
        solver="cpsat",
        status="infeasible",
        x=None,
        objective=None,
        best_bound=None,
        gap=None,
        solve_time_s=0.0,
        message=why,
    )


def _build(cp_model, model: MilpModel, integ: Integerised, rows, warm_start):
    """The CP-SAT model over ``y = sigma * x``: integer columns, the scaled rows, the
    floating-point objective and the warm start as a full hint. Returns (model, columns)."""
    n = model.n_vars
    m = cp_model.CpModel()
    ys = [m.new_int_var(int(integ.ylb[j]), int(integ.yub[j]), f"y{j}") for j in range(n)]
    for cols, coefs, lo, hi in rows:
        expr = cp_model.LinearExpr.weighted_sum([ys[c] for c in cols.tolist()], coefs)
        if np.isfinite(lo) and np.isfinite(hi):
            m.add_linear_constraint(expr, int(lo), int(hi))
        elif np.isfinite(hi):
            m.add(expr <= int(hi))
        else:
            m.add(expr >= int(lo))
    cobj = model.c / integ.sigma
    nz = np.flatnonzero(cobj)
    m.minimize(
        cp_model.LinearExpr.weighted_sum([ys[j] for j in nz.tolist()], cobj[nz].tolist())
        + float(model.offset)
    )
    if warm_start is not None:
        w = np.round(np.asarray(warm_start, dtype=float) * integ.sigma)
        w = np.clip(w, integ.ylb, integ.yub)
        for j in range(n):
            m.add_hint(ys[j], int(w[j]))
    return m, ys


def _result(solver, code, elapsed, first_s, model: MilpModel, integ, ys, worst) -> SolveResult:
    """The search's outcome in ``x = y / sigma``, with the objective of the unscaled model and
    any rounding or violation of the original model in the message."""
    name = solver.status_name(code)
    status = map_status(name)
    xv = None
    if status in SOLUTION_STATUSES:
        y = np.array([solver.value(v) for v in ys], dtype=float)
        xv = y / integ.sigma
    obj = model.objective(xv) if xv is not None else None
    bound = float(solver.best_objective_bound) if status in SOLUTION_STATUSES else None
    msg = name
    if worst > 1e-12:
        msg += f"; max relative coefficient rounding {worst:.1e}"
    if xv is not None:
        viol = model.max_violation(xv)
        if viol > 1e-6:
            msg += f"; max violation of the original model {viol:.1e}"
    return SolveResult(
        solver="cpsat",
        status=status,
        x=xv,
        objective=obj,
        best_bound=bound,
        gap=relative_gap(obj, bound),
        solve_time_s=elapsed,
        message=msg,
        time_to_first_s=first_s if first_s is not None else (elapsed if xv is not None else None),
        n_nodes=int(solver.num_branches),
    )


def solve_cpsat(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
) -> SolveResult:
    """Solve with CP-SAT after :func:`integerise` (see the module docstring). Options:
    ``max_time_in_seconds``, ``relative_gap_limit``, ``num_workers``, ``random_seed``,
    ``log_search_progress``. ``warm_start`` becomes a full hint; ``progress`` is called from a
    solution callback (CP-SAT only reports improving solutions)."""
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:
        raise SolverUnavailable(
            "solver=cpsat needs the 'ortools' package: pip install ortools"
        ) from exc
    if model.is_quadratic:
        raise SolverUnavailable(
            "solver=cpsat cannot take products of variables; build the linearised model "
            "(formulation mode=paper, linearize=True) or use solver=scip / gurobi"
        )
    if options.relax:
        raise SolverUnavailable(
            "solver=cpsat cannot solve an LP relaxation (relax=True); use solver=highs or cvxpy"
        )
    t_build = time.perf_counter()
    integ = integerise(model)
    rows, worst, empty_bad = scaled_rows(model, integ.sigma)
    infeasible = _no_integer_point(integ, empty_bad)
    if infeasible is not None:
        return infeasible
    m, ys = _build(cp_model, model, integ, rows, warm_start)
    invalid = m.validate()
    if invalid:
        raise SolverUnavailable(f"solver=cpsat cannot represent {model.name!r}: {invalid}")

    log.info(
        "cpsat: %d vars (%d resolved by equalities, %d implied integer), %d rows, max coefficient "
        "rounding %.1e, built in %.2f s",
        model.n_vars,
        int((integ.rule == 1).sum()),
        int((integ.rule == 2).sum()),
        len(rows),
        worst,
        time.perf_counter() - t_build,
    )
    solver, code, elapsed, first_s = run_cpsat(cp_model, m, options, progress)
    return _result(solver, code, elapsed, first_s, model, integ, ys, worst)
