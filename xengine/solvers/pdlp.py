"""OR-Tools PDLP (primal-dual hybrid gradient) for LP relaxations too large for simplex or
interior point on this machine.

PDLP is a first-order method: each iteration is two sparse matrix-vector products, so it runs
on resnet50's two-device relaxation (705k columns, 1.5M rows) where HiGHS's simplex and
interior point do not finish in 600 s (``experiments/lp_bound_speed.py``). It returns its
current iterate when stopped at a time limit, and every dual iterate gives a proven bound
through :meth:`xengine.solvers.model.MilpModel.dual_bound`, so a bound improves with the time
given and is never wrong. (HiGHS's own PDLP returns no multipliers at a time limit.)
"""

from __future__ import annotations

import logging
import time

import numpy as np

from xengine.interrupt import run_stoppable
from xengine.solvers.model import MilpModel, SolverUnavailable

log = logging.getLogger(__name__)


def pdlp_row_duals(
    model: MilpModel,
    time_limit_s: float | None,
    threads: int | None = None,
    rel_tol: float = 1e-6,
) -> tuple[np.ndarray, float, str]:
    """(row multipliers, seconds, termination reason) of PDLP on ``model``'s relaxation.

    Stops at ``rel_tol`` (relative primal, dual residual and gap) or at the time limit; the
    multipliers are the last iterate either way (meant for ``model.dual_bound``)."""
    try:
        from ortools.pdlp import solve_log_pb2, solvers_pb2
        from ortools.pdlp.python import pdlp
    except ImportError as exc:  # pragma: no cover - ortools is a hard dependency
        raise SolverUnavailable("the PDLP bound needs OR-Tools: pip install ortools") from exc
    if model.is_quadratic:
        raise SolverUnavailable("PDLP bounds are for linear models")
    qp = pdlp.QuadraticProgram()
    qp.objective_vector = model.c
    qp.objective_offset = model.offset
    qp.constraint_matrix = model.A.tocsc()
    qp.constraint_lower_bounds = model.row_lb
    qp.constraint_upper_bounds = model.row_ub
    qp.variable_lower_bounds = model.lb
    qp.variable_upper_bounds = model.ub
    params = solvers_pb2.PrimalDualHybridGradientParams()
    crit = params.termination_criteria.simple_optimality_criteria
    crit.eps_optimal_relative = rel_tol
    crit.eps_optimal_absolute = rel_tol
    if time_limit_s is not None:
        params.termination_criteria.time_sec_limit = float(time_limit_s)
    params.num_threads = int(threads or 1)
    t0 = time.perf_counter()
    # no cancel from Python: on an interrupt the iterations are left to end with the process
    result = run_stoppable(lambda: pdlp.primal_dual_hybrid_gradient(qp, params), None, "pdlp")
    elapsed = time.perf_counter() - t0
    reason = solve_log_pb2.TerminationReason.Name(result.solve_log.termination_reason)
    log.info("PDLP: %s after %.1f s", reason, elapsed)
    return np.asarray(result.dual_solution, dtype=float), elapsed, reason


__all__ = ["pdlp_row_duals"]
