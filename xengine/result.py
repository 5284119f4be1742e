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


@dataclass(frozen=True)
class GradCheck:
    """The two steps whose loss and gradients a policy's row compares, where they are not the
    timed step and the run's plain step (compiled code: compared per tensor, since fused
    kernels add up in another order, and with dropout off when the net draws random numbers,
    since compiled code draws its own); ``how`` says which, for the row's note."""

    run: Any  # ExecutionResult
    plain: Any  # ExecutionResult
    how: str


@dataclass
class PolicyRun:
    """What a strategy that PyTorch runs itself (``baselines.pytorch``: its own checkpointing
    around blocks, selective checkpointing) chose and measured; it has no schedule of ours.

    ``policy``: the level chosen, in words, and ``level`` its index among the policy's
    levels (0: no checkpoint; -1: none fits); ``tried``: ``(level, measured peak bytes)``
    for every level measured during the search, in the order tried (the policy's own memory
    frontier); ``execution``: the chosen level's timed step (an
    :class:`~xengine.execute.executor.ExecutionResult`), None when no level fits; ``sim``:
    where the policy translates into a schedule of ours (``torch_checkpoint``,
    ``torch_sac``), the simulator's replay of the chosen level (``schedule``), the row's
    prediction (on the costs of its own steps after :mod:`xengine.refine`), and ``ours``
    that schedule executed by our executor in the same run; ``untranslated``: why the
    chosen level does not translate (``baselines.translate.Untranslatable``)."""

    policy: str
    level: int = -1
    tried: list[tuple[str, int]] = field(default_factory=list)
    execution: Any = None
    compile_time_s: float | None = None  # compiled policies: the chosen level's first step
    grad_check: GradCheck | None = None  # compiled policies check their own gradients
    sim: Simulation | None = None  # the chosen level as a schedule of ours, replayed
    schedule: Schedule | None = None  # that schedule (timed in its own context by xengine.refine)
    ours: Any = None  # that schedule run by our executor (an ExecutionResult), beside PyTorch's
    untranslated: str | None = None  # why the chosen level has no schedule of ours

    @property
    def smallest_peak(self) -> tuple[str, int] | None:
        """The level with the smallest measured peak, and that peak."""
        return min(self.tried, key=lambda t: t[1]) if self.tried else None


@dataclass
class RelaxationRun:
    """A relaxation solved for its bound before the model itself (Checkmate's frontier
    relaxation, :mod:`xengine.strategies.frontier`): its status, bound, cost and size, and
    (when read back) its schedule's simulated time and whether it fits."""

    status: str
    bound_s: float | None
    solve_time_s: float
    build_time_s: float
    n_vars: int | None
    n_rows: int | None
    schedule_time_s: float | None = None
    schedule_fits: bool | None = None
    contradiction: str | None = None  # a schedule that fits where it says infeasible


@dataclass
class CoarseSolve:
    """The coarse model behind a schedule solved on a coarsened graph
    (:func:`xengine.strategies.coarsen.solve_coarse`). Its figures are the coarse graph's and
    bound nothing on the fine graph, so they are kept here and not in the result's own."""

    nodes: int
    status: str
    objective_s: float | None
    best_bound_s: float | None
    sim_time_s: float | None
    peak_bytes: list[int] | None
    placement_bound_s: float | None = None
    lp_bound_s: float | None = None
    trace: list[tuple[float, float | None, float | None]] = field(default_factory=list)


@dataclass
class StrategyResult:
    """A strategy's schedule with the simulator's verdict and, for solvers, the model's view.

    ``status``: optimal | feasible | infeasible | no_solution | over_budget | error.
    Heuristics report ``feasible`` when their schedule fits the budget and ``infeasible`` when
    it does not; ``over_budget`` is a solver's schedule that the simulator finds over a budget
    (the solver's own verdict is then in ``solver_status``).
    ``objective_s`` / ``model_peak_bytes`` are the model's own figures (solvers only); the
    simulator's are in ``sim``. For exact formulations they must agree (tested).

    The typed fields after ``message`` are what other modules read (the pipeline, the
    benchmarks, the coarse wrapper); ``extra`` keeps a strategy's own diagnostics, read by
    nobody else.
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
    nnz: int | None = None  # the model's nonzeros, beside n_vars and n_rows
    time_to_first_s: float | None = None  # the solver's first incumbent
    # (seconds, incumbent s, bound s) as the solve went on
    trace: list[tuple[float, float | None, float | None]] = field(default_factory=list)
    lp_bound_s: float | None = None  # bounds of the whole problem (xengine.strategies.bounds)
    placement_bound_s: float | None = None
    nothing_to_solve: bool = False  # answered without a solver run (keep-all, a start at a bound)
    solver_status: str | None = None  # the solver's verdict where the simulator overruled it
    warm_start: str | None = None  # what the solve started from
    frontier: RelaxationRun | None = None  # Checkmate's frontier relaxation
    coarse: CoarseSolve | None = None  # solved on a coarsened graph
    pytorch: PolicyRun | None = None  # set by the strategies that PyTorch runs itself
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def has_schedule(self) -> bool:
        return self.schedule is not None and self.sim is not None

    @property
    def fits(self) -> bool:
        """The one definition of "the schedule fits" (the paper's protocol, section 6): a
        schedule with a solution status that the simulator finds within every budget; for a
        policy that PyTorch runs itself (no schedule of ours), its measured peak within every
        budget."""
        if self.status not in SOLUTION_STATUSES:
            return False
        if self.pytorch is not None:
            ex = self.pytorch.execution
            return ex is not None and all(
                ex.peak_bytes.get(d, 0) <= b
                for d, b in zip(self.devices, self.budget_bytes, strict=True)
            )
        return self.has_schedule and self.sim.within_budget

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


MIB = 2**20


@dataclass
class RunRow:
    """One line of the comparison table (and of ``table.csv``).

    ``alone``: a single-device strategy in a run over several devices, on one device with the
    total memory of all of them (the paper's baseline). ``wrong``: why the executed schedule
    is not a right answer (its loss or gradients differ from plain PyTorch's, or its measured
    peak is over a budget by more than the executor's tolerance); empty when it is right or
    was not executed. One wrong row makes the whole run ``wrong`` (:func:`run_status`)."""

    label: str
    strategy: str
    devices: tuple[str, ...]
    status: str
    budget_bytes: tuple[int, ...] | None = None
    predicted_time_s: float | None = None
    predicted_peak_bytes: tuple[int, ...] | None = None
    # the prediction from the keep-everything profile alone, before the rounds in context
    # (xengine.refine); None when the costs were not refined
    profile_time_s: float | None = None
    context_rounds: int | None = None
    context_stable: bool | None = None
    context_plain_time_s: float | None = None  # a plain step beside the last timing in context
    # keep-everything's prediction on the costs this row's prediction used (one device)
    keep_all_time_s: float | None = None
    # device -> node -> seconds: the costs the prediction used where they are not graph.json's
    context_cost_s: dict[str, dict[str, float]] | None = field(default=None, repr=False)
    measured_time_s: float | None = None
    # median of each measured step over the plain step timed just before it (None: not paired)
    measured_over_plain: float | None = None
    measured_peak_bytes: tuple[int, ...] | None = None
    fixed_bytes: int | None = None
    solve_time_s: float | None = None
    build_time_s: float | None = None
    compile_time_s: float | None = None  # a compiled policy's first step (torch.compile)
    # a policy translated into a schedule of ours, run by our executor (PolicyRun.ours)
    ours_time_s: float | None = None
    ours_over_plain: float | None = None
    ours_peak_bytes: int | None = None
    gap: float | None = None
    n_recomputes: int | None = None
    grads_match: bool | None = None
    grads_max_rel_diff: float | None = None
    note: str = ""
    alone: bool = False
    wrong: str = ""
    result: StrategyResult | None = field(default=None, repr=False)
    execution: Any = field(default=None, repr=False)

    @property
    def predicted_over_plain(self) -> float | None:
        """The prediction in plain steps, set against ``measured_over_plain``: neither depends
        on the machine's speed that minute. With rounds in context, over the plain step timed
        beside the last timing in context, whose costs the prediction used
        (:mod:`xengine.refine`); without, over keep-everything's prediction on the same costs
        (a plain step's op costs: keep-everything measures as one plain step, 1.00-1.04x).
        None when neither is known (a policy PyTorch runs itself, several devices)."""
        if self.predicted_time_s is None:
            return None
        if self.context_plain_time_s:
            return self.predicted_time_s / self.context_plain_time_s
        if self.keep_all_time_s:
            return self.predicted_time_s / self.keep_all_time_s
        return None

    def metrics(self) -> dict[str, float]:
        """MLflow metrics under ``<label>/``, units in the names."""
        out: dict[str, float | None] = {
            "predicted_time_ms": _ms(self.predicted_time_s),
            "profile_predicted_time_ms": _ms(self.profile_time_s),
            "context_rounds": self.context_rounds,
            "context_stable": None if self.context_stable is None else float(self.context_stable),
            "context_plain_time_ms": _ms(self.context_plain_time_s),
            "measured_time_ms": _ms(self.measured_time_s),
            "predicted_over_plain": self.predicted_over_plain,
            "measured_over_plain": self.measured_over_plain,
            "predicted_peak_mib": _mib_max(self.predicted_peak_bytes),
            "measured_peak_mib": _mib_max(self.measured_peak_bytes),
            "budget_mib": _mib_max(self.budget_bytes),
            "fixed_mib": None if self.fixed_bytes is None else self.fixed_bytes / MIB,
            "solve_time_s": self.solve_time_s,
            "build_time_s": self.build_time_s,
            "compile_time_s": self.compile_time_s,
            "ours_measured_time_ms": _ms(self.ours_time_s),
            "ours_measured_over_plain": self.ours_over_plain,
            "ours_measured_peak_mib": None
            if self.ours_peak_bytes is None
            else self.ours_peak_bytes / MIB,
            "gap": self.gap,
            "n_recomputes": self.n_recomputes,
            "grads_match": None if self.grads_match is None else float(self.grads_match),
            "grads_max_rel_diff": self.grads_max_rel_diff,
        }
        if len(self.devices) > 1:
            for name, vals in (
                ("predicted_peak_mib", self.predicted_peak_bytes),
                ("measured_peak_mib", self.measured_peak_bytes),
                ("budget_mib", self.budget_bytes),
            ):
                for dev, v in zip(self.devices, vals or (), strict=False):
                    out[f"{name}.{dev}"] = v / MIB
        return {f"{self.label}/{k}": float(v) for k, v in out.items() if v is not None}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _mib_max(values: tuple[int, ...] | None) -> float | None:
    return None if not values else max(values) / MIB


def row_of(label: str, res: StrategyResult) -> RunRow:
    sim = res.sim if res.pytorch is None else res.pytorch.sim  # a policy's translated level
    row = RunRow(
        label=label,
        strategy=res.strategy,
        devices=tuple(res.devices),
        status=res.status,
        budget_bytes=tuple(int(b) for b in res.budget_bytes),
        solve_time_s=res.solve_time_s,
        build_time_s=res.build_time_s or None,
        gap=res.gap,
        note="" if res.message.strip().lower() in ("optimal", res.status) else res.message,
        result=res,
    )
    if sim is not None:
        row.predicted_time_s = float(sim.time_s)
        row.predicted_peak_bytes = tuple(int(p) for p in sim.peak_bytes)
        row.n_recomputes = int(sim.n_recomputes)
        if sim.violations and not row.note:
            row.note = f"over budget in the simulator: {sim.violations[0]}"
    return row


def run_status(rows: list[RunRow]) -> str:
    """The run's ``xe.status`` (docs/design.md section 10: no silent wrong answers):
    ``wrong`` when an executed schedule is not a right answer (:attr:`RunRow.wrong`), else
    ``partial`` when a strategy or an execution failed, else ``ok``. A resumed sweep runs a
    ``wrong`` point again (``xengine.records.sweep.BAD_STATUSES``)."""
    if any(r.wrong for r in rows):
        return "wrong"
    bad = [r for r in rows if r.status == "error" or r.note.startswith("execution failed")]
    return "partial" if bad else "ok"


def wrong_lines(rows: list[RunRow]) -> list[str]:
    """The lines under the table that name every wrong row and why."""
    wrong = [r for r in rows if r.wrong]
    if not wrong:
        return []
    return ["WRONG (run status: wrong):", *(f"  {r.label}: {r.wrong}" for r in wrong)]
