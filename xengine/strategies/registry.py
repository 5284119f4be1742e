"""Every strategy by name: where it lives, how it is called, and the one way to run it.

A strategy takes an :class:`~xengine.problem.Instance` and returns a
:class:`~xengine.result.StrategyResult` (docs/design.md section 6). XEngine's own model lives in
:mod:`xengine.strategies`; Checkmate, LP rounding and the heuristics live in the top-level
``baselines`` package, which imports ``xengine`` and is never imported by it: this table names
each strategy by its import path (``module:function``, like Hydra's ``_target_``) and
:func:`load` imports it when a run asks for it. That keeps the dependency one way
(``baselines -> xengine``) while ``run.py``, the library's :func:`xengine.protocol.compare` and
the benchmarks all run strategies through :func:`run_strategy`, which also replays every
schedule in the simulator.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from xengine.problem import Instance
from xengine.progress import StatusLine
from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, simulate
from xengine.solvers import SolverOptions
from xengine.solvers.model import SOLUTION_STATUSES, ProgressFn
from xengine.units import format_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StrategySpec:
    """What a strategy is and what it declares it needs: where it lives (``target``,
    ``module:function``) and which of a run's settings its function takes. This is the one
    place that knows a strategy's calling convention; the protocol, the pipeline and the
    benchmarks read these flags and never a strategy's name.

    * ``one_device``: it takes a single-device instance (Checkmate and its heuristics); with
      several devices it runs once per device, alone with the total memory of all devices, as
      in the paper's protocol;
    * ``uses_solver``: it takes ``solver=`` and ``options=``; ``takes_options``: ``options=``
      alone (LP rounding's LP); ``takes_seed``: ``seed=`` (randomised rounding);
    * ``shows_progress``: it takes ``progress=`` and reports its incumbent during a long solve;
    * ``runs_in_pytorch``: PyTorch runs the strategy's policy itself (``baselines.pytorch``):
      it takes the captured net (``captured=``) and the run's ``n_steps`` and ``warmup``, and
      returns its measured execution instead of a schedule of ours, so it needs a net to run
      (not ``graph=``, not ``execute=false``);
    * ``takes_limit``: it takes ``time_limit_s=`` and stops there, saying so (the slower
      heuristics, when a start for another strategy must keep that one's limit);
    * ``takes_starts``: it takes ``starts=``, the schedules the run's other rows gave on its
      device (label -> schedule), and answers no slower than the fastest that fits (Checkmate;
      the protocol solves it after them, :func:`xengine.protocol.plan`);
    * ``heterogeneous``: XEngine's model over every device of the mix. It joins every run
      over several devices, takes the protocol's warm start (the fastest single-device
      schedule, :func:`xengine.protocol.warm_start`) and the formulation settings
      (``formulation``, ``max_computes``, ``lp_bound``, ``coarsen``).
    """

    target: str
    one_device: bool
    uses_solver: bool
    takes_options: bool = False
    takes_seed: bool = False
    shows_progress: bool = False
    runs_in_pytorch: bool = False
    heterogeneous: bool = False
    takes_limit: bool = False
    takes_starts: bool = False

    def call(
        self,
        name: str,
        settings: SolveSettings,
        warm_start: Schedule | None = None,
        progress: ProgressFn | None = None,
        captured: Any = None,
        starts: Mapping[str, Schedule] | None = None,
    ) -> tuple[Callable[..., StrategyResult], dict[str, Any]]:
        """The function that runs strategy ``name`` under ``settings`` and the keyword
        arguments it takes, from the flags above (``captured``: the net, a
        :class:`~xengine.graph.capture.CapturedModel`, for those that PyTorch runs)."""
        kwargs: dict[str, Any] = {}
        if self.runs_in_pytorch:
            if captured is None:
                raise ValueError(
                    f"{name} is run by PyTorch itself and needs the net: not with graph= or "
                    "execute=false"
                )
            kwargs.update(captured=captured, n_steps=settings.n_steps, warmup=settings.warmup)
        if self.uses_solver or self.takes_options:
            kwargs["options"] = settings.options
        if self.uses_solver:
            kwargs["solver"] = settings.solver
        if self.takes_seed:
            kwargs["seed"] = settings.seed
        if self.shows_progress and progress is not None:
            kwargs["progress"] = progress
        if self.takes_starts and starts:
            kwargs["starts"] = starts
        target = _load(self.target)
        if not self.heterogeneous:
            return target, kwargs
        kwargs.update(solver=settings.xengine_solver, formulation=settings.formulation)
        if settings.formulation == "intervals":
            kwargs["build_options"] = {
                "max_computes": settings.max_computes,
                "lp_bound": LP_BOUND_MODES[settings.lp_bound],
            }
        if settings.coarsen is None:
            return target, {**kwargs, "warm_start": warm_start}
        # the coarse model is solved and its schedule expanded to this graph; a start for the
        # fine graph does not fit the coarse one, so the coarse model starts without one
        from xengine.strategies.coarsen import solve_coarse

        return solve_coarse, {**kwargs, "max_group": settings.coarsen, "strategy": name}


STRATEGIES: dict[str, StrategySpec] = {
    "checkmate": StrategySpec(
        "baselines.checkmate:solve_checkmate", True, True, shows_progress=True, takes_starts=True
    ),
    "lp_rounding": StrategySpec(
        "baselines.lp_rounding:solve_lp_rounding",
        True,
        False,
        takes_options=True,
        takes_seed=True,
    ),
    "checkpoint_all": StrategySpec("baselines.heuristics:solve_checkpoint_all", True, False),
    "chen_sqrtn": StrategySpec("baselines.heuristics:solve_chen_sqrtn", True, False),
    "chen_greedy": StrategySpec(
        "baselines.heuristics:solve_chen_greedy", True, False, takes_limit=True
    ),
    "recompute_greedy": StrategySpec(
        "baselines.heuristics:solve_recompute_greedy", True, False, takes_limit=True
    ),
    "xengine": StrategySpec(
        "xengine.strategies.solve:solve_xengine", False, True, heterogeneous=True
    ),
    "torch_checkpoint": StrategySpec(
        "baselines.pytorch:solve_torch_checkpoint", True, False, runs_in_pytorch=True
    ),
    "torch_sac": StrategySpec(
        "baselines.pytorch:solve_torch_sac", True, False, runs_in_pytorch=True
    ),
    "torch_budget": StrategySpec(
        "baselines.pytorch:solve_torch_budget", True, False, runs_in_pytorch=True
    ),
    "torch_budget_aot": StrategySpec(
        "baselines.pytorch:solve_torch_budget_aot", True, False, runs_in_pytorch=True
    ),
}
HEURISTICS = ("checkpoint_all", "chen_sqrtn", "chen_greedy", "recompute_greedy")
PYTORCH_POLICIES = tuple(name for name, spec in STRATEGIES.items() if spec.runs_in_pytorch)
"""PyTorch's own checkpointing, run by PyTorch (``baselines.pytorch``)."""
SINGLE_DEVICE = tuple(
    name for name, spec in STRATEGIES.items() if spec.one_device and not spec.runs_in_pytorch
)
"""The single-device strategies that give a schedule of ours (solve-only runs have them all)."""
DEFAULT_STRATEGIES = ("checkmate", *HEURISTICS)
"""What ``run.py`` runs unless told otherwise (``strategy=[...]``); lp_rounding on request."""


def joining_mixes() -> tuple[str, ...]:
    """The strategies that join every run over several devices (XEngine's model)."""
    return tuple(name for name, spec in STRATEGIES.items() if spec.heterogeneous)


FORMULATIONS = ("exact", "paper", "intervals")
"""XEngine's model: ``exact`` (linear, equal to the simulator), ``paper`` (the published
MIQP), ``intervals`` (retention intervals on CP-SAT, :mod:`xengine.strategies.intervals`)."""

LP_BOUND_MODES: dict[str, bool | str] = {"before": True, "alongside": "alongside", "none": False}
"""``lp_bound=`` for formulation=intervals (:func:`xengine.strategies.intervals.solve_intervals`):
the LP bound first, for at most half the time limit; in its own process on one CPU during the
whole search; or not at all (the placement bound only)."""


@dataclass(frozen=True)
class SolveSettings:
    """How the strategies of one run are called: the MILP back-end and its options, XEngine's
    formulation and its knobs, and the seed of the randomised strategies."""

    solver: str = "highs"
    options: SolverOptions = field(default_factory=SolverOptions)
    formulation: str = "exact"
    max_computes: int = 2
    lp_bound: str = "before"
    coarsen: int | None = None
    seed: int = 0
    n_steps: int = 5  # timed steps of a policy that PyTorch runs itself, after ``warmup``
    warmup: int = 1

    @property
    def xengine_solver(self) -> str:
        """The interval model is CP-SAT's; ``solver=`` stays the one of the MILPs."""
        return "cpsat" if self.formulation == "intervals" else self.solver


def _load(target: str) -> Callable[..., Any]:
    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)


def load(name: str) -> Callable[..., StrategyResult]:
    """The function of strategy ``name``; an unknown name is a ``ValueError`` listing them."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose from {', '.join(STRATEGIES)}")
    return _load(STRATEGIES[name].target)


def run_strategy(
    name: str,
    inst: Instance,
    settings: SolveSettings,
    warm_start: Schedule | None = None,
    label: str | None = None,
    status_line: bool = False,
    captured: Any = None,
    starts: Mapping[str, Schedule] | None = None,
) -> StrategyResult:
    """Run one strategy and replay its schedule in the simulator.

    Any failure becomes a result with status ``error`` and a message (a run goes on); an
    instance with an op that fits no device's budget (:meth:`Instance.unfit_message`) is
    ``infeasible`` without a solve; a schedule the simulator
    finds over budget is ``over_budget`` whatever the solver said (:func:`overrule_by_simulator`).
    ``status_line`` shows the live status line of :class:`~xengine.progress.StatusLine`.
    ``captured``: the net, for a strategy that PyTorch runs itself
    (:attr:`StrategySpec.runs_in_pytorch`). ``starts``: the run's other schedules on its
    device, for a strategy that takes them (:attr:`StrategySpec.takes_starts`).
    """
    label = label or name
    spec = STRATEGIES[name]
    unfit = inst.unfit_message()
    if unfit is not None and not spec.runs_in_pytorch:  # PyTorch's policies are measured
        return StrategyResult(name, inst.devices, inst.budget_bytes, "infeasible", message=unfit)
    budgets = ", ".join(format_bytes(b) for b in inst.budget_bytes)
    log.info("%s: solving on %s, budget %s", label, ",".join(inst.devices), budgets)
    t0 = time.perf_counter()
    try:
        target, kwargs = spec.call(name, settings, warm_start, _progress(label), captured, starts)
        with StatusLine(label, str(kwargs.get("solver", "")), enabled=status_line):
            res = target(inst, **kwargs)
    except Exception as exc:  # a failing strategy is recorded, the run goes on
        log.warning("%s failed: %s: %s", label, type(exc).__name__, exc)
        log.info("%s traceback", label, exc_info=True)
        return StrategyResult(
            name,
            inst.devices,
            inst.budget_bytes,
            "error",
            solve_time_s=time.perf_counter() - t0,
            message=f"{type(exc).__name__}: {exc}",
        )
    _replay(res, inst)
    overrule_by_simulator(res)
    predicted = f", predicted {res.sim.time_s * 1e3:.2f} ms" if res.sim is not None else ""
    log.info("%s: %s%s", label, res.status, predicted)
    return res


def _replay(res: StrategyResult, inst: Instance) -> None:
    """Every strategy's schedule goes through the same simulator (heuristics simulate their own;
    a schedule it rejects is an error)."""
    if res.schedule is None or res.sim is not None:
        return
    try:
        res.sim = simulate(inst, res.schedule, check_budget=False)
    except ScheduleError as exc:
        res.status, res.message = "error", f"schedule rejected by the simulator: {exc}"
        res.schedule = None


def overrule_by_simulator(res: StrategyResult) -> None:
    """A schedule the simulator finds over budget is not ``optimal`` or ``feasible``, whatever
    its solver said (the published model does not count every byte): its status becomes
    ``over_budget``, the solver's verdict stays in the message and in ``solver_status``."""
    if res.sim is None or res.sim.within_budget or res.status not in SOLUTION_STATUSES:
        return
    res.solver_status = res.status
    why = f"over budget in the simulator: {res.sim.violations[0]}"
    said = f"{res.solver} said {res.status}" if res.solver else f"reported {res.status}"
    res.message = "; ".join(
        x for x in (why if why not in res.message else "", said, res.message) if x
    )
    res.status = "over_budget"


def _progress(
    label: str, every_s: float = 10.0
) -> Callable[[float, float | None, float | None], None]:
    """Log the incumbent's gap during a long solve, at most once every ``every_s`` seconds."""
    last = [-every_s]

    def report(elapsed_s: float, incumbent: float | None, bound: float | None) -> None:
        if elapsed_s - last[0] < every_s:
            return
        last[0] = elapsed_s
        gap = ""
        if incumbent and bound is not None:
            gap = f", gap {100 * abs(incumbent - bound) / abs(incumbent):.2f}%"
        log.info("%s: %.1f s, new incumbent%s", label, elapsed_s, gap)

    return report
