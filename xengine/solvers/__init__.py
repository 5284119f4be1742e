"""Solver back-ends behind one interface (docs/design.md section 7).

``solve(model, solver, options)`` dispatches by name; an unknown or unavailable solver is a
:class:`SolverUnavailable` error naming the fix. There is no silent fallback to another solver.

Each back-end module declares what it takes in its module-level ``BACKENDS``
(:class:`~xengine.solvers.model.Backend`: LP, MILP, products, integer-only columns, the
packages it needs and its status map); the registry below is built from those declarations.
The back-end modules import their solver package only inside the solve function, so reading
the declarations imports no solver.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np

from xengine.solvers import cpsat, cvxpy_backend, gurobi, highs, scip
from xengine.solvers.model import (
    SOLUTION_STATUSES,
    STATUSES,
    Backend,
    MilpModel,
    ModelBuilder,
    ProgressFn,
    SolveResult,
    SolverOptions,
    SolverUnavailable,
)

BACKENDS: dict[str, Backend] = {
    b.name: b for mod in (highs, gurobi, scip, cpsat, cvxpy_backend) for b in mod.BACKENDS
}
"""Registered back-ends by name, from each back-end module's declaration."""

SOLVERS: dict[str, str] = {name: b.target for name, b in BACKENDS.items()}
"""Registered back-ends: name -> 'module:function' (from :data:`BACKENDS`). The function is
imported only when the back-end is asked for, so that a missing optional solver only matters
then."""

QUADRATIC_CAPABLE: frozenset[str] = frozenset(n for n, b in BACKENDS.items() if b.takes_quadratic)
"""Back-ends that take products of variables (the paper's MIQP) without linearisation, whether
installed or not (from :data:`BACKENDS`)."""


def available_solvers() -> tuple[str, ...]:
    """The registered back-ends whose packages are installed (:meth:`Backend.installed`), in
    registry order. A registered name missing here is known but not installed: asking for it
    raises the back-end's own :class:`SolverUnavailable` naming the package to install; all
    registered names are :data:`SOLVERS`."""
    return tuple(name for name, b in BACKENDS.items() if b.installed())


def describe_solvers() -> str:
    """Every registered name, sorted, those not installed marked: for messages that list the
    choices."""
    return ", ".join(
        name if b.installed() else f"{name} (not installed)" for name, b in sorted(BACKENDS.items())
    )


def _resolve(solver: str) -> Callable[..., SolveResult]:
    key = solver.lower()
    if key not in BACKENDS:
        raise SolverUnavailable(f"unknown solver {solver!r}: choose one of {describe_solvers()}")
    mod, fn = BACKENDS[key].target.split(":")
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
    "BACKENDS",
    "SOLUTION_STATUSES",
    "STATUSES",
    "Backend",
    "MilpModel",
    "ModelBuilder",
    "ProgressFn",
    "QUADRATIC_CAPABLE",
    "SOLVERS",
    "SolveResult",
    "SolverOptions",
    "SolverUnavailable",
    "available_solvers",
    "describe_solvers",
    "solve",
]
