"""The one result type every strategy returns, exact or heuristic."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, Simulation, simulate
from xengine.solvers.model import SOLUTION_STATUSES

log = logging.getLogger(__name__)


@dataclass
class StrategyResult:
    """A strategy's schedule with the simulator's verdict and, for solvers, the model's view.

    ``status``: optimal | feasible | infeasible | no_solution | over_budget | error.
    Heuristics report ``feasible`` when their schedule fits the budget and ``infeasible`` when
    it does not; ``over_budget`` is a solver's schedule that the simulator finds over a budget
    (the solver's own verdict is then in ``extra["solver_status"]``).
    ``objective_s`` / ``model_peak_bytes`` are the model's own figures (solvers only); the
    simulator's are in ``sim``. For exact formulations they must agree (tested).
    """

    strategy: str
    devices: tuple[str, ...]
    budget_bytes: tuple[int, ...]
    status: str
    schedule: Schedule | None = None
    sim: Simulation | None = None
    solver: str | None = None
    solve_time_s: float = 0.0
    build_time_s: float = 0.0
    objective_s: float | None = None
    best_bound_s: float | None = None
    gap: float | None = None
    model_peak_bytes: np.ndarray | None = None
    n_vars: int | None = None
    n_rows: int | None = None
    n_integer: int | None = None
    message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def has_schedule(self) -> bool:
        return self.schedule is not None and self.sim is not None

    @property
    def fits(self) -> bool:
        """The one definition of "the schedule fits" (the paper's protocol, section 6): a
        schedule with a solution status that the simulator finds within every budget."""
        return (
            self.has_schedule and self.sim.within_budget and self.status in SOLUTION_STATUSES
        )

    @property
    def predicted_time_s(self) -> float | None:
        return self.sim.time_s if self.sim is not None else None

    @property
    def predicted_peak_bytes(self) -> np.ndarray | None:
        return self.sim.peak_bytes if self.sim is not None else None

    @property
    def label(self) -> str:
        dev = "+".join(self.devices)
        return f"{self.strategy}[{dev}]"


def check_with_simulator(
    res: StrategyResult,
    inst: Instance,
    sched: Schedule,
    what: str,
    over_budget_is_error: bool,
    elapsed_s: float,
) -> None:
    """Replay a solver's schedule and attach it and its simulation to ``res`` (in place).

    A schedule the simulator rejects, or (``over_budget_is_error``: models exact about
    memory) one over a budget, turns ``res`` into an error naming the reason.
    """
    try:
        sim = simulate(inst, sched, check_budget=False)
    except ScheduleError as exc:
        res.status = "error"
        res.message = f"{what} schedule rejected by the simulator: {exc}"
        log.error("%s: %s", res.strategy, res.message)
        return
    res.schedule = sched
    res.sim = sim
    if sim.violations:
        res.message = f"over budget in the simulator: {sim.violations[0]}"
        if over_budget_is_error:
            res.status = "error"
    log.info(
        "%s: %s, objective %.6g s (simulator %.6g s), gap %s, %.1f s total",
        res.strategy,
        res.status,
        res.objective_s,
        sim.time_s,
        "-" if res.gap is None else f"{100 * res.gap:.3f}%",
        elapsed_s,
    )
