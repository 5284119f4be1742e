"""Solver back-ends behind one interface (DESIGN.md section 7).

``solve(model, solver, options)`` dispatches by name; an unknown or unavailable solver is a
:class:`SolverUnavailable` error naming the fix. There is no silent fallback to another solver.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from xengine.solvers.model import (
    STATUSES,
    MilpModel,
    ModelBuilder,
    ProgressFn,
    SolveResult,
    SolverOptions,
    SolverUnavailable,
)

SOLVERS: dict[str, str] = {
    "highs": "xengine.solvers.highs:solve_highs",
    "gurobi": "xengine.solvers.gurobi:solve_gurobi",
    "scip": "xengine.solvers.scip:solve_scip",
    "cpsat": "xengine.solvers.cpsat:solve_cpsat",
    "cvxpy": "xengine.solvers.cvxpy_backend:solve_cvxpy",
    "cvxpy-scip": "xengine.solvers.cvxpy_backend:solve_cvxpy_scip",
    "cvxpy-gurobi": "xengine.solvers.cvxpy_backend:solve_cvxpy_gurobi",
}
"""Registered back-ends: name -> 'module:function'. Imported lazily so that a missing optional
solver only matters when it is asked for."""

QUADRATIC_CAPABLE: set[str] = {"gurobi", "scip"}
"""Back-ends that take products of variables (the paper's MIQP) without linearisation."""


def available_solvers() -> tuple[str, ...]:
    return tuple(SOLVERS)


def _resolve(solver: str) -> Callable[..., SolveResult]:
    import importlib

    key = solver.lower()
    if key not in SOLVERS:
        raise SolverUnavailable(
            f"unknown solver {solver!r}: choose one of {', '.join(sorted(SOLVERS))}"
        )
    mod, fn = SOLVERS[key].split(":")
    return getattr(importlib.import_module(mod), fn)


def solve(
    model: MilpModel,
    solver: str = "highs",
    options: SolverOptions | None = None,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
) -> SolveResult:
    return _resolve(solver)(
        model, options or SolverOptions(), warm_start=warm_start, progress=progress
    )


__all__ = [
    "STATUSES",
    "MilpModel",
    "ModelBuilder",
    "ProgressFn",
    "QUADRATIC_CAPABLE",
    "SOLVERS",
    "SolveResult",
    "SolverOptions",
    "SolverUnavailable",
    "available_solvers",
    "solve",
]
