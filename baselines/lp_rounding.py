"""Checkmate's LP relaxation with two-phase rounding, solved through cvxpy as Checkmate ships it.

The relaxation is the exact single-device model of :func:`xengine.strategies.formulation.build` with
integrality dropped; its optimum is a lower bound on every schedule's time at this budget.
Phase one rounds the fractional checkpoint matrix S only (a sweep of thresholds 0.1..0.9 and
Bernoulli samples with a fixed seed); phase two derives R with :func:`solve_r_opt`. Every
candidate is simulated and the fastest that fits the budget is kept; the LP's own R and FREE
are ignored. As Checkmate does, the LP can also be solved at a tighter budget (0.9 x B by
default) to get candidates that leave room for rounding; the bound comes from the LP at B.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from baselines.heuristics import (
    evaluate,
    keep_all_if_it_fits,
    over_budget_message,
    require_one_device,
)
from xengine.checkpoints import budget_range_message, solve_r_opt
from xengine.problem import Instance
from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import Simulation, simulate
from xengine.solvers import MilpModel, SolverOptions, SolverUnavailable
from xengine.solvers.model import relative_gap
from xengine.strategies.formulation import build

log = logging.getLogger(__name__)

THRESHOLDS = tuple(np.round(np.arange(1, 10) / 10, 1))
_ROUND_TOL = 1e-6  # LP values within this of a threshold count as reaching it


def to_cvxpy(model: MilpModel):
    """``(problem, x)``: the LP relaxation of ``model`` as one cvxpy problem with vectorised
    constraints (a handful of ``A @ x`` blocks, never one object per row)."""
    import cvxpy as cp

    if model.is_quadratic:
        raise ValueError("the LP relaxation takes linear models only (use formulation mode=exact)")
    x = cp.Variable(model.n_vars, name="x")
    cons = []
    lb, ub = model.lb, model.ub
    fixed = np.isfinite(lb) & (lb == ub)
    for mask, make in (
        (fixed, lambda i: x[i] == lb[i]),
        (np.isfinite(lb) & ~fixed, lambda i: x[i] >= lb[i]),
        (np.isfinite(ub) & ~fixed, lambda i: x[i] <= ub[i]),
    ):
        idx = np.flatnonzero(mask)
        if idx.size:
            cons.append(make(idx))
    A, rlb, rub = model.A.tocsr(), model.row_lb, model.row_ub
    eq = np.isfinite(rlb) & (rlb == rub)
    for mask, bound, sense in (
        (eq, rlb, "=="),
        (np.isfinite(rlb) & ~eq, rlb, ">="),
        (np.isfinite(rub) & ~eq, rub, "<="),
    ):
        rows = np.flatnonzero(mask)
        if rows.size == 0:
            continue
        lhs = A[rows] @ x
        cons.append(
            lhs == bound[rows]
            if sense == "=="
            else lhs >= bound[rows]
            if sense == ">="
            else lhs <= bound[rows]
        )
    prob = cp.Problem(cp.Minimize(model.c @ x + model.offset), cons)
    return prob, x


def solve_lp(model: MilpModel, time_limit_s: float | None = None, verbose: bool = False):
    """Solve the relaxation with HiGHS through cvxpy: ``(status, x, objective, seconds,
    solver's word)``, status ``optimal``, ``infeasible``, ``limit`` (stopped by its time limit:
    no verdict, not an error) or ``error``.

    Never switches to another cvxpy solver: without HiGHS it raises :class:`SolverUnavailable`.
    """
    import cvxpy as cp

    if "HIGHS" not in cp.installed_solvers():
        raise SolverUnavailable(
            "the LP relaxation is solved with HiGHS through cvxpy, which cvxpy cannot find: "
            "pip install highspy"
        )
    prob, x = to_cvxpy(model)
    opts = {"time_limit": float(time_limit_s)} if time_limit_s is not None else {}
    t0 = time.perf_counter()
    try:
        prob.solve(solver=cp.HIGHS, verbose=verbose, **opts)
    except cp.error.SolverError as exc:
        return "error", None, None, time.perf_counter() - t0, str(exc)
    dt = time.perf_counter() - t0
    st = prob.status
    if st == cp.OPTIMAL:
        return "optimal", np.asarray(x.value, dtype=float), float(prob.value), dt, st
    if st in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        return "infeasible", None, None, dt, st
    if st == cp.USER_LIMIT:
        return "limit", None, None, dt, st
    return "error", None, None, dt, st


def solve_lp_rounding(
    inst: Instance,
    seed: int = 0,
    n_random: int = 20,
    thresholds: Sequence[float] = THRESHOLDS,
    tighter_budgets: Sequence[float] = (0.9,),
    options: SolverOptions | None = None,
) -> StrategyResult:
    """LP relaxation + two-phase rounding on a one-device instance.

    ``best_bound_s`` is the LP optimum at the instance's budget (a lower bound on any
    schedule's time there) and ``gap`` the relative distance of the kept schedule to it.
    Status ``feasible`` when a rounded schedule fits the budget; ``infeasible`` when the LP
    itself is (the budget is then infeasible, the message names the smallest feasible budget
    known) or when no rounding fits (the lowest-peak candidate is attached and the message
    says by how much it is over: the budget may still be feasible for the exact MILP).
    """
    require_one_device(inst, "lp_rounding")
    options = options or SolverOptions()
    t0 = time.perf_counter()
    g, dev = inst.graph, inst.devices[0]
    budget = int(inst.budget_bytes[0])
    rng = np.random.default_rng(seed)

    extra: dict = {"lp": []}
    lower = int(g.node_lower_bound_bytes(dev).max())
    if budget < lower:
        # the relaxation may still be feasible (fractional frees), but no schedule is
        return StrategyResult(
            strategy="lp_rounding",
            devices=inst.devices,
            budget_bytes=inst.budget_bytes,
            status="infeasible",
            solve_time_s=time.perf_counter() - t0,
            message=f"no schedule of {g.name!r} fits {budget} bytes: " + budget_range_message(g),
        )
    answer = keep_all_if_it_fits(inst, "lp_rounding", "cvxpy:HIGHS")
    if answer is not None:  # nothing to relax or round
        return answer
    bound_s = None
    candidates: dict[bytes, tuple[str, np.ndarray]] = {}
    build_s = 0.0
    lp_s = 0.0
    for frac in (1.0, *tighter_budgets):
        b = budget if frac == 1.0 else int(frac * budget)
        form = build(inst.with_budgets((b,)), mode="exact")
        build_s += form.build_time_s
        status, x, obj, dt, msg = solve_lp(form.model, options.time_limit_s, options.verbose)
        lp_s += dt
        extra["lp"].append({"budget_bytes": b, "status": status, "solve_time_s": dt})
        if frac == 1.0:
            n_vars, n_rows = form.model.n_vars, form.model.n_rows
            if status != "optimal":
                res = _lp_failed(inst, status, msg, options.time_limit_s, extra)
                res.solve_time_s, res.build_time_s = lp_s, build_s
                res.n_vars, res.n_rows = n_vars, n_rows
                return res
            bound_s = form.objective_s(x)
        if status != "optimal":
            continue
        six = form.Six[0]
        s_frac = np.where(six >= 0, x[np.maximum(six, 0)], 0.0)
        tag = "" if frac == 1.0 else f" at {frac:g}B"
        for tau in thresholds:
            _add(candidates, f"threshold {tau:g}{tag}", s_frac >= tau - _ROUND_TOL)
        for k in range(n_random):
            _add(candidates, f"bernoulli #{k}{tag}", rng.random(s_frac.shape) < s_frac)

    label, sched, sim, n_fit = _best_candidate(inst, candidates)
    extra.update(
        lp_objective_s=bound_s, n_candidates=len(candidates), n_within_budget=n_fit, rounding=label
    )
    res = evaluate(inst, "lp_rounding", sched, t0, sim=sim, extra=extra)
    res.solver = "cvxpy:HIGHS"
    res.build_time_s = build_s
    res.best_bound_s = bound_s
    res.gap = relative_gap(sim.time_s, bound_s) if sim.within_budget else None
    res.n_vars, res.n_rows = n_vars, n_rows
    if not sim.within_budget:
        res.message = (
            f"no rounding of the LP solution fits (the LP is feasible, so the exact MILP may "
            f"still find a schedule); the lowest peak ({label}): "
            + over_budget_message(sim, budget)
        )
    log.info(
        "lp_rounding %s: bound %.6g s, kept %s at %.6g s (%d/%d candidates fit), LP %.2f s",
        g.name,
        bound_s,
        label,
        sim.time_s,
        n_fit,
        len(candidates),
        lp_s,
    )
    return res


def _lp_failed(
    inst: Instance, status: str, msg: str, limit_s: float | None, extra: dict
) -> StrategyResult:
    """The answer when the LP at the instance's budget has no optimum: infeasible (so is
    every schedule), stopped at the limit (nothing to round), or failed."""
    g, budget = inst.graph, int(inst.budget_bytes[0])
    res = StrategyResult(
        strategy="lp_rounding",
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status={"infeasible": "infeasible", "limit": "no_solution"}.get(status, "error"),
        solver="cvxpy:HIGHS",
        extra=extra,
    )
    res.message = {
        "infeasible": f"the LP relaxation is infeasible, so no schedule of "
        f"{g.name!r} fits {budget} bytes: " + budget_range_message(g),
        "limit": f"the LP relaxation reached its time limit ({limit_s:g}"
        " s) before an optimum, so there is nothing to round; a larger "
        "solver.time_limit_s gives it time",
    }.get(status, f"the LP relaxation failed: {msg}")
    return res


def _best_candidate(
    inst: Instance, candidates: dict[bytes, tuple[str, np.ndarray]]
) -> tuple[str, Schedule, Simulation, int]:
    """Each rounded S completed by Checkmate's R pass and simulated: the fastest that fits,
    else the one of the lowest peak; with the number that fit."""
    g, dev = inst.graph, inst.devices[0]
    best = None
    n_fit = 0
    for label, S in candidates.values():
        sched = solve_r_opt(g, S, dev, drop_unused=True)
        sim = simulate(inst, sched, check_budget=False)
        n_fit += sim.within_budget
        peak = int(sim.peak_bytes.max())
        key = (0, sim.time_s, peak) if sim.within_budget else (1, peak, sim.time_s)
        if best is None or key < best[0]:
            best = (key, label, sched, sim)
    _, label, sched, sim = best
    return label, sched, sim, n_fit


def _add(candidates: dict, label: str, S: np.ndarray) -> None:
    S = np.tril(S, k=-1)
    key = np.packbits(S).tobytes()
    candidates.setdefault(key, (label, S))
