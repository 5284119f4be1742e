"""A solver-neutral mixed-integer model: sparse rows, bounds, integrality, optional products.

Formulations build one :class:`MilpModel` with numpy index arithmetic (no per-row Python
objects, see shared/reference/dependencies.md section 4 for why) and every back-end takes the
same object. Variables that the stage structure fixes at zero are never created: their index is
``-1`` and the builder drops them from rows.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

STATUSES = ("optimal", "feasible", "infeasible", "no_solution", "error")
SOLUTION_STATUSES = ("optimal", "feasible")
"""The statuses that come with a solution (a schedule); every other one has none."""


@dataclass(frozen=True)
class Backend:
    """What one solver back-end takes, what it needs installed and how its statuses read.

    Each back-end module declares its own (module-level ``BACKENDS``) and
    :mod:`xengine.solvers` builds the registry from them, so a back-end is described in one
    place. ``target`` is ``"module:function"``, the solve function with the common signature
    ``(model, options, warm_start, progress)``; it is imported only when the back-end is asked
    for. ``packages`` are the top-level Python packages it needs (all of them).

    ``statuses`` maps the solver's own status codes (ints or names, as the solver reports
    them) to :data:`STATUSES`; a code that stops the solve at a limit maps to ``feasible``,
    which :meth:`status` turns into ``no_solution`` when there is no incumbent. Anything not
    in the map is an ``error``. Rules that need more than the code (Gurobi's
    infeasible-or-unbounded, SCIP's ``inforunbd``) stay in the back-end's ``map_status``.
    """

    name: str
    target: str
    packages: tuple[str, ...]
    takes_lp: bool  # solves an LP relaxation (``options.relax``)
    takes_milp: bool
    takes_quadratic: bool  # products of variables (the paper's MIQP) without linearisation
    integer_only: bool = False  # continuous columns only where they are integers in disguise
    statuses: Mapping[object, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = sorted({str(v) for v in self.statuses.values()} - set(STATUSES))
        if bad:
            raise ValueError(f"back-end {self.name!r} maps statuses to {bad}, not in STATUSES")

    def installed(self) -> bool:
        """Whether every package it needs can be imported (found, not imported: cheap)."""
        return all(importlib.util.find_spec(p) is not None for p in self.packages)

    def status(self, code: object, has_solution: bool | None = None) -> str:
        """The solver's status ``code`` as one of :data:`STATUSES` (``error`` when unmapped);
        with ``has_solution=False`` a limit (``feasible``) is ``no_solution``."""
        s = self.statuses.get(code, "error")
        if s == "feasible" and has_solution is False:
            return "no_solution"
        return s


class SolverUnavailable(RuntimeError):
    """The requested solver (or its licence) cannot take this model; the message says why and
    what to do instead. Never caught to switch solvers silently."""


@dataclass
class MilpModel:
    """minimise ``c @ x + offset + sum(q * x[qi] * x[qj])`` subject to
    ``row_lb <= A @ x <= row_ub``, ``lb <= x <= ub``, ``x[integrality]`` integer."""

    c: np.ndarray
    A: sp.csr_matrix
    row_lb: np.ndarray
    row_ub: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integrality: np.ndarray
    offset: float = 0.0
    q_i: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    q_j: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    q_val: np.ndarray = field(default_factory=lambda: np.zeros(0))
    name: str = "model"

    @property
    def n_vars(self) -> int:
        return int(self.c.shape[0])

    @property
    def n_rows(self) -> int:
        return int(self.A.shape[0])

    @property
    def n_integer(self) -> int:
        return int(self.integrality.sum())

    @property
    def is_quadratic(self) -> bool:
        return self.q_val.size > 0

    def objective(self, x: np.ndarray) -> float:
        val = float(self.c @ x) + self.offset
        if self.is_quadratic:
            val += float(np.sum(self.q_val * x[self.q_i] * x[self.q_j]))
        return val

    def with_floor(self, floor: float) -> MilpModel:
        """This model with the row ``objective >= floor``: a bound proven elsewhere (a
        relaxation's) handed to the solver, so that its gap starts there and it stops once an
        incumbent meets it."""
        import dataclasses

        A = sp.vstack([self.A, sp.csr_matrix(self.c[None, :])]).tocsr()
        return dataclasses.replace(
            self,
            A=A,
            row_lb=np.r_[self.row_lb, floor - self.offset],
            row_ub=np.r_[self.row_ub, np.inf],
        )

    def max_violation(self, x: np.ndarray) -> float:
        """Largest violation of rows, bounds or integrality by ``x`` (0 for a feasible point)."""
        ax = self.A @ x
        viol = [
            np.max(self.row_lb - ax, initial=0.0),
            np.max(ax - self.row_ub, initial=0.0),
            np.max(self.lb - x, initial=0.0),
            np.max(x - self.ub, initial=0.0),
        ]
        xi = x[self.integrality]
        viol.append(np.max(np.abs(xi - np.round(xi)), initial=0.0))
        return float(max(viol))

    def dual_bound(self, row_dual: np.ndarray) -> float:
        """A lower bound on the LP relaxation's optimum (so on the MILP's) from *any* row
        multipliers ``y``, however inexact: weak duality with the box on ``x``.

        For every x in the box with ``row_lb <= A x <= row_ub``: ``y_i (A x)_i >= y_i row_lb_i``
        when ``y_i > 0`` and ``>= y_i row_ub_i`` when ``y_i < 0``, and with the reduced costs
        ``r = c - A^T y``, ``r @ x >= sum_j min(r_j lb_j, r_j ub_j)``. Adding both bounds
        ``c @ x`` from below. Multipliers that point at an infinite side are dropped (set to
        0), which keeps the bound valid. This is the "safe" bound of Neumaier and Shcherbina
        (Math. Programming 99, 2004): it does not trust the LP solver's tolerances, so an
        interior-point solution without crossover gives a proven bound, equal to the optimum
        up to the solver's duality gap. ``-inf`` when a column is unbounded on the side its
        reduced cost favours. Quadratic terms are not covered.
        """
        if self.is_quadratic:
            raise ValueError("dual_bound covers linear models only")
        y = np.array(row_dual, dtype=float)
        if y.shape != (self.n_rows,):
            raise ValueError(f"row_dual has shape {y.shape}, the model has {self.n_rows} rows")
        y[(y > 0) & ~np.isfinite(self.row_lb)] = 0.0
        y[(y < 0) & ~np.isfinite(self.row_ub)] = 0.0
        rows = np.where(
            y > 0,
            y * np.where(np.isfinite(self.row_lb), self.row_lb, 0.0),
            y * np.where(np.isfinite(self.row_ub), self.row_ub, 0.0),
        )
        r = self.c - self.A.T @ y
        with np.errstate(invalid="ignore"):  # r * inf where r == 0 is never selected
            cols = np.where(r > 0, r * self.lb, np.where(r < 0, r * self.ub, 0.0))
        return float(self.offset + rows.sum() + cols.sum())


class ModelBuilder:
    """Accumulates variables and row families as COO triplets, then emits a :class:`MilpModel`."""

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self._lb: list[np.ndarray] = []
        self._ub: list[np.ndarray] = []
        self._int: list[np.ndarray] = []
        self._n = 0
        self._rows_r: list[np.ndarray] = []
        self._rows_c: list[np.ndarray] = []
        self._rows_v: list[np.ndarray] = []
        self._rlb: list[np.ndarray] = []
        self._rub: list[np.ndarray] = []
        self._m = 0
        self.c: dict[int, float] = {}
        self._c_idx: list[np.ndarray] = []
        self._c_val: list[np.ndarray] = []
        self._q: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.row_families: dict[str, tuple[int, int]] = {}

    def add_vars(
        self, count: int, lb: float | np.ndarray, ub: float | np.ndarray, integer: bool
    ) -> np.ndarray:
        idx = np.arange(self._n, self._n + count, dtype=np.int64)
        self._lb.append(np.broadcast_to(np.asarray(lb, dtype=float), (count,)).copy())
        self._ub.append(np.broadcast_to(np.asarray(ub, dtype=float), (count,)).copy())
        self._int.append(np.full(count, integer, dtype=bool))
        self._n += count
        return idx

    def add_rows(
        self,
        family: str,
        n_rows: int,
        row: np.ndarray,
        col: np.ndarray,
        val: np.ndarray | float,
        lb: np.ndarray | float,
        ub: np.ndarray | float,
    ) -> None:
        """Rows ``lb <= sum(val * x[col]) <= ub`` with local row ids ``row`` in 0..n_rows-1.
        Entries whose ``col`` is -1 (a variable fixed at zero) are dropped."""
        if n_rows == 0:
            return
        row = np.asarray(row, dtype=np.int64)
        col = np.asarray(col, dtype=np.int64)
        val = np.broadcast_to(np.asarray(val, dtype=float), row.shape)
        keep = col >= 0
        self._rows_r.append(row[keep] + self._m)
        self._rows_c.append(col[keep])
        self._rows_v.append(val[keep])
        self._rlb.append(np.broadcast_to(np.asarray(lb, dtype=float), (n_rows,)).copy())
        self._rub.append(np.broadcast_to(np.asarray(ub, dtype=float), (n_rows,)).copy())
        start = self._m
        self._m += n_rows
        prev = self.row_families.get(family)
        self.row_families[family] = (prev[0] if prev else start, self._m)

    def add_objective(self, col: np.ndarray, val: np.ndarray | float) -> None:
        col = np.asarray(col, dtype=np.int64)
        val = np.broadcast_to(np.asarray(val, dtype=float), col.shape)
        keep = col >= 0
        self._c_idx.append(col[keep])
        self._c_val.append(val[keep])

    def add_products(self, i: np.ndarray, j: np.ndarray, val: np.ndarray) -> None:
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        val = np.broadcast_to(np.asarray(val, dtype=float), i.shape)
        keep = (i >= 0) & (j >= 0) & (val != 0)
        self._q.append((i[keep], j[keep], val[keep]))

    def fix(self, idx: np.ndarray, value: float) -> None:
        """Fix variables by their bounds (presolve-free, as Checkmate's stage structure does)."""
        lb = np.concatenate(self._lb) if self._lb else np.zeros(0)
        ub = np.concatenate(self._ub) if self._ub else np.zeros(0)
        idx = np.asarray(idx, dtype=np.int64)
        idx = idx[idx >= 0]
        lb[idx] = value
        ub[idx] = value
        self._lb, self._ub = [lb], [ub]

    def build(self) -> MilpModel:
        n = self._n
        c = np.zeros(n)
        if self._c_idx:
            np.add.at(c, np.concatenate(self._c_idx), np.concatenate(self._c_val))
        if self._rows_r:
            r = np.concatenate(self._rows_r)
            cc = np.concatenate(self._rows_c)
            v = np.concatenate(self._rows_v)
        else:
            r = cc = np.zeros(0, dtype=np.int64)
            v = np.zeros(0)
        A = sp.csr_matrix((v, (r, cc)), shape=(self._m, n))
        A.sum_duplicates()
        if self._q:
            qi = np.concatenate([q[0] for q in self._q])
            qj = np.concatenate([q[1] for q in self._q])
            qv = np.concatenate([q[2] for q in self._q])
        else:
            qi = qj = np.zeros(0, dtype=np.int64)
            qv = np.zeros(0)
        return MilpModel(
            c=c,
            A=A,
            row_lb=np.concatenate(self._rlb) if self._rlb else np.zeros(0),
            row_ub=np.concatenate(self._rub) if self._rub else np.zeros(0),
            lb=np.concatenate(self._lb) if self._lb else np.zeros(0),
            ub=np.concatenate(self._ub) if self._ub else np.zeros(0),
            integrality=np.concatenate(self._int) if self._int else np.zeros(0, dtype=bool),
            q_i=qi,
            q_j=qj,
            q_val=qv,
            name=self.name,
        )


@dataclass(frozen=True)
class SolverOptions:
    """Options every back-end understands; each maps them to its own names."""

    time_limit_s: float | None = None
    rel_gap: float = 1e-4
    threads: int | None = None
    seed: int = 0
    verbose: bool = False
    relax: bool = False  # solve the LP relaxation (integrality dropped)
    lp_method: str = "simplex"
    """With ``relax`` on HiGHS: ``simplex``, or ``ipm`` (interior point without crossover:
    faster on large relaxations, exact only up to its tolerance; use the returned
    ``row_dual`` with :meth:`MilpModel.dual_bound` for a proven bound)."""


@dataclass
class SolveResult:
    """What a back-end found. ``status`` is one of :data:`STATUSES`; ``x`` is the incumbent
    (None for infeasible / no_solution / error)."""

    solver: str
    status: str
    x: np.ndarray | None
    objective: float | None
    best_bound: float | None
    gap: float | None
    solve_time_s: float
    message: str = ""
    time_to_first_s: float | None = None
    n_nodes: int | None = None
    row_dual: np.ndarray | None = None  # LP relaxations on HiGHS: the row multipliers

    @property
    def has_solution(self) -> bool:
        return self.x is not None and self.status in SOLUTION_STATUSES

    @classmethod
    def failed(cls, solver: str, solve_time_s: float, message: str) -> SolveResult:
        """The solver itself raised: status ``error``, no solution, the reason kept."""
        return cls(solver, "error", None, None, None, None, solve_time_s, message)


ProgressFn = Callable[[float, float | None, float | None], None]
"""Called with (elapsed_s, incumbent objective or None, best bound or None) whenever the
incumbent improves; HiGHS also calls it when its bound moves (at most once a second), so a
caller can record the gap over time."""


def relative_gap(obj: float | None, bound: float | None) -> float | None:
    if obj is None or bound is None or not np.isfinite(bound):
        return None
    return abs(obj - bound) / max(abs(obj), 1e-12)
