"""The paper's comparison protocol, defined once (Schuler et al. 2022, section 6; docs/design.md
section 9). ``run.py`` (through :func:`xengine.pipeline.run_pipeline`), the library's
:func:`compare` and the benchmarks all use these functions:

* **which rows**: XEngine gets budget ``b_d`` on every device ``d``; each single-device
  strategy (Checkmate, LP rounding, the heuristics) runs on each device alone with the *total*
  memory ``sum_d b_d``, the other devices unused (:func:`plan`);
* **what fits**: :attr:`xengine.result.StrategyResult.fits`, a schedule with a solution status
  that the simulator finds within every budget;
* **the gain**: (fastest fitting single-device time - XEngine's time) / that single time,
  predicted by the simulator and, when both were executed, measured (:class:`Summary`);
* **the infeasible list**: the single-device rows with no schedule that fits (:func:`summarize`);
* **the warm start**: XEngine starts from the fastest valid schedule among those rows and their
  spreads over the devices (:func:`warm_start`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from xengine.problem import Instance
from xengine.result import RunRow, StrategyResult, row_of
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, simulate
from xengine.solvers import SolverOptions
from xengine.strategies.distribute import offload_starts, start_candidates
from xengine.strategies.registry import (
    HEURISTICS,
    SINGLE_DEVICE,
    STRATEGIES,
    SolveSettings,
    load,
    run_strategy,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


# ------------------------------------------------------------------------------ which rows
@dataclass(frozen=True)
class Job:
    """One row of the protocol: strategy ``name`` on ``inst`` (for a single-device strategy
    over several devices: device ``device`` alone with the total memory)."""

    label: str
    name: str
    inst: Instance
    alone: bool
    start_s: float = 0.0  # seconds its warm start took, counted against its time limit
    # what the run's rows before it gave on its device (label -> schedule), for a strategy
    # that starts from them (StrategySpec.takes_starts)
    starts: Mapping[str, Schedule] = field(default_factory=dict)

    def settings(self, base: SolveSettings) -> SolveSettings:
        """``base`` with what the job's warm start took off the time limit: the limit is the
        strategy's, starts included (at d3f3e28 a two-device run of 300 s took 430 s, its
        starts 100 s of it), though never below :data:`SOLVE_SHARE` of it, so that the solve
        itself always gets some."""
        limit_s = base.options.time_limit_s
        if limit_s is None or self.start_s <= 0:
            return base
        left_s = _left_s(limit_s, self.start_s)
        return replace(base, options=replace(base.options, time_limit_s=left_s))


def plan(inst: Instance, names: Sequence[str]) -> list[Job]:
    """The rows of a run in protocol order: the single-device strategies first, each on every
    device alone with the total memory, those that start from the others' schedules
    (Checkmate: :attr:`StrategySpec.takes_starts`) after the others; then the strategies over
    all devices (XEngine), which start from all of them. The table shows the rows in the
    order asked for (:func:`in_asked_order`)."""
    several = inst.n_devices > 1
    total = int(sum(inst.budget_bytes))
    jobs: list[Job] = []
    for name in sorted(names, key=_solve_order):
        if not STRATEGIES[name].one_device:
            jobs.append(Job(name, name, inst, alone=False))
            continue
        for d, device in enumerate(inst.devices):
            label = f"{name}.{device}" if several else name
            jobs.append(Job(label, name, inst.only_device(d, total), alone=several))
    return jobs


def _solve_order(name: str) -> tuple[bool, bool]:
    spec = STRATEGIES[name]
    return not spec.one_device, spec.takes_starts


def in_asked_order(
    rows: Sequence[T], names: Sequence[str], name_of=lambda r: r.strategy
) -> list[T]:
    """``rows`` in the order of ``names`` (a strategy's rows keep their own order; rows of
    no strategy in ``names``, the plain-step references, first)."""
    rank = {name: i for i, name in enumerate(names)}
    return sorted(rows, key=lambda r: rank.get(name_of(r), -1))


def run_schedules(inst: Instance, alone: Sequence[StrategyResult]) -> dict[str, Schedule]:
    """What the single-device rows solved so far gave on ``inst``'s one device: each row's
    schedule, and the schedule of ours that a PyTorch policy translates into (label ->
    schedule). Checkmate starts from the fastest of them that fits (issue 57)."""
    out: dict[str, Schedule] = {}
    for res in alone:
        if tuple(res.devices) != tuple(inst.devices):
            continue
        if res.has_schedule:
            out[res.strategy] = res.schedule
        translated = res.pytorch.schedule if res.pytorch is not None else None
        if translated is not None:
            out[f"{res.strategy} (translated)"] = translated
    return out


def solve_jobs(
    inst: Instance,
    names: Sequence[str],
    settings: SolveSettings,
    solve: Callable[[Job, Schedule | None], T],
    on_start: Callable[[tuple[str, Schedule, float] | None, float], None] | None = None,
    result_of: Callable[[T], StrategyResult] = lambda solved: solved,
) -> Iterator[tuple[Job, T]]:
    """The one run path of the protocol (``run.py``'s pipeline, :func:`compare` and the
    benchmarks): every job of :func:`plan` in order, each solved by ``solve(job, start)``
    (the caller's way: plain, or refined in context; ``result_of`` finds the
    :class:`StrategyResult` in what it returns). A strategy that takes a warm start
    (:attr:`StrategySpec.heterogeneous`) gets :func:`warm_start` from the single-device
    results before it, which ``on_start(start, seconds)`` sees first. Yields each job with
    what ``solve`` returned as soon as it is solved, so that a caller can execute and record
    it before the next solve."""
    alone: list[StrategyResult] = []
    for job in plan(inst, names):
        start = None
        if STRATEGIES[job.name].heterogeneous:
            t0 = time.perf_counter()
            found = warm_start(inst, alone, settings.solver, settings.options, settings.formulation)
            job = replace(job, start_s=time.perf_counter() - t0)
            limit_s = settings.options.time_limit_s
            if limit_s is not None:
                log.info(
                    "%s: the warm start took %.1f s; the solve gets %.1f s of the %g s limit",
                    job.label,
                    job.start_s,
                    job.settings(settings).options.time_limit_s,
                    limit_s,
                )
            if on_start is not None:
                on_start(found, job.start_s)
            start = None if found is None else found[1]
        if STRATEGIES[job.name].takes_starts:
            job = replace(job, starts=run_schedules(job.inst, alone))
        solved = solve(job, start)
        if STRATEGIES[job.name].one_device:
            alone.append(result_of(solved))
        yield job, solved


# ------------------------------------------------------------------------------ warm start
GREEDY_START = "recompute_greedy"
"""Step 1's start on each device alone with its own budget: seconds and no solver. Its
recomputations are held (``hold=True``): on GPT-2 (12 layers, 50 %, cpu2+cpu1) the unheld
schedule, 4,054.91 ms on cpu2, was XEngine's start and its answer after 300 s
(docs/measurements.md, "Transformers models")."""
GREEDY_SHARE = 0.25
"""Of the time limit, what the greedy start (and its holding) may take on each device."""
OFFLOAD_SHARE = 0.25
"""Of the time limit, what the offloaded greedy starts may take together
(:func:`xengine.strategies.distribute.offload_starts`; GPT-2's 12 layers over two CPU
sub-devices need some 45 s per fraction, resnet18 about 1 s)."""
OFFLOAD_DEFAULT_S = 120.0
"""Their time without a limit."""
SOLVE_SHARE = 0.25
"""Of the time limit, the least that XEngine's own solve gets after its warm start
(:meth:`Job.settings`); the starts themselves take at most :data:`GREEDY_SHARE` per device
and :data:`OFFLOAD_SHARE`, plus the placed model where nothing else fits."""


def _what(res: StrategyResult, memory: str) -> str:
    return f"{res.strategy} on {res.devices[0]} ({memory} memory)"


def warm_start(
    inst: Instance,
    alone: Sequence[StrategyResult],
    solver: str = "highs",
    options: SolverOptions | None = None,
    formulation: str = "exact",
) -> tuple[str, Schedule, float] | None:
    """XEngine's start on ``inst``: ``(what, schedule, predicted time)`` of the fastest valid
    schedule within the per-device budgets, found among

    1. ``alone``: the single-device schedules solved with the total memory, each embedded on
       its device (the protocol computes them anyway), and (several devices)
       ``recompute_greedy`` on each device alone with that device's own budget: seconds and
       no solver (resnet50 at 50 %, H200 costs: 48.85 ms; the placed model of step 2 reached
       48.2-48.4 ms in 60 s), so a start exists even when step 2 runs out of time;
    2. (exact and intervals modes, several devices) ``recompute_greedy`` on the fastest
       device with a little more than its budget, pairs offloaded to the others until every
       budget holds (:func:`xengine.strategies.distribute.offload_starts`, within
       :data:`OFFLOAD_SHARE` of the limit); those schedules and keep-everything
       spread over the devices, and XEngine's model restricted to the best spread's placement
       (:func:`xengine.strategies.distribute.start_candidates`; half of what the starts
       before it left of the time limit, and the run's gap; in exact mode only while nothing
       fits, :func:`_placed_model_pays`);
    3. only when none of those fits: Checkmate and the heuristics on each device alone with
       that device's own budget (docs/design.md section 6: each is a feasible point of
       XEngine's model), Checkmate with a quarter of the time limit and a 5 % gap: a start
       needs a good schedule, not a proof. Devices whose budget holds not every op alone
       are skipped.

    ``None`` when nothing fits (the solver then starts cold).
    """
    t0 = time.perf_counter()
    options = options or SolverOptions()
    cands: list[tuple[float, str, Schedule]] = []

    def add(what: str, sched: Schedule) -> None:
        try:
            sim = simulate(inst, sched, check_budget=False)
        except ScheduleError:
            return
        if sim.within_budget:
            cands.append((float(sim.time_s), what, sched))

    for res in alone:
        if res.fits and res.has_schedule:
            add(_what(res, "total"), res.schedule.on_devices(inst.devices))
        translated = res.pytorch.schedule if res.pytorch is not None else None
        if res.fits and translated is not None:  # a PyTorch policy's, as a schedule of ours
            add(_what(res, "total") + ", translated", translated.on_devices(inst.devices))
    own = _own_budget_instances(inst)
    limit_s = options.time_limit_s
    for sub in own:
        for res in _own_heuristics(sub, None if limit_s is None else limit_s * GREEDY_SHARE):
            if res.fits:
                add(_what(res, "its own"), res.schedule.on_devices(inst.devices))
    if inst.n_devices > 1 and formulation in ("exact", "intervals"):
        singles = [(_what(r, "total"), r.schedule) for r in alone if r.has_schedule]
        xe_solver = SolveSettings(solver=solver, formulation=formulation).xengine_solver
        offload_s = OFFLOAD_DEFAULT_S if limit_s is None else limit_s * OFFLOAD_SHARE
        for what, sched in offload_starts(inst, offload_s):
            add(what, sched)
        placed = _placed_model_pays(formulation, has_start=bool(cands))
        placed_opts = options
        if limit_s is not None:  # the solve after it gets the other half
            spent_s = time.perf_counter() - t0
            placed_opts = replace(options, time_limit_s=_left_s(limit_s, spent_s) / 2)
        for what, sched in start_candidates(
            inst, singles, xe_solver, placed_opts, formulation=formulation, placed_model=placed
        ):
            add(what, sched)
        if not placed:
            log.info("placed model skipped: a start fits and the solve begins with its relaxation")
    if not cands:
        for what, sched in _fallback_starts(own, solver, options):
            add(what, sched.on_devices(inst.devices))
    if not cands:
        return None
    t, what, sched = min(cands, key=lambda c: c[0])
    return what, sched, t


def _own_heuristics(sub: Instance, limit_s: float | None) -> list[StrategyResult]:
    """Step 1's heuristics on one device with its own budget, within ``limit_s`` together:
    ``recompute_greedy`` held first (:data:`GREEDY_START`), then the others, each computed
    once per run and costs (:func:`baselines.heuristics.computed_once`), so that XEngine's
    answer is never slower than what any of them gives for that device and budget."""
    t0 = time.perf_counter()
    out = [load(GREEDY_START)(sub, time_limit_s=limit_s, hold=True)]
    for name in HEURISTICS:
        left_s = None if limit_s is None else max(limit_s - (time.perf_counter() - t0), 0.0)
        kwargs = {"time_limit_s": left_s} if STRATEGIES[name].takes_limit else {}
        if left_s is not None and left_s <= 0:
            log.warning("warm start: no time left for %s on %s", name, sub.devices[0])
            break
        out.append(load(name)(sub, **kwargs))
    for res in out:
        if res.message.startswith("stopped by its time limit"):
            log.warning(
                "warm start: %s on %s alone (its own budget), XEngine's start may be weaker: %s",
                res.strategy,
                sub.devices[0],
                res.message,
            )
    return out


def _left_s(limit_s: float, spent_s: float) -> float:
    """What is left of a strategy's time limit ``limit_s`` after ``spent_s``, never below
    :data:`SOLVE_SHARE` of it."""
    return max(limit_s - spent_s, SOLVE_SHARE * limit_s)


def _placed_model_pays(formulation: str, has_start: bool) -> bool:
    """Whether step 2's placed model is worth its time (half of what the other starts left of the
    limit; the run's whole limit when measured below). In exact mode, once a start fits, it is
    not: the full solve begins with the frontier relaxation over the devices (or its LP), which
    bounds the whole problem and reads back schedules of every placement. Measured with run.py,
    solve only (docs/measurements.md, "Two devices"): resnet18 over CPU + H200 at 55 % and over
    cpu2+cpu1 at 50 % (120 s, at 4da8a71), GPT-2 over cpu2+cpu1 at 50 % (300 s, at ab6920d): the
    placed model took its whole limit and ended slower than the held greedy start (39.66 against
    21.56 ms, 596.0 against 389.4 ms, 5,048.8 against 4,314.7 ms). The interval model (CP-SAT)
    has no such phase, and there the placed model did help (resnet50: 48.15 ms from 48.85)."""
    return formulation == "intervals" or not has_start


def _own_budget_instances(inst: Instance) -> list[Instance]:
    """With several devices, each device alone with its own budget, skipping those where some
    op does not fit (no schedule fits them alone); none with one device."""
    if inst.n_devices < 2:
        return []
    smallest = inst.smallest_budgets_bytes()
    return [
        inst.only_device(d, inst.budget_bytes[d])
        for d in range(inst.n_devices)
        if inst.budget_bytes[d] >= smallest[d]
    ]


FALLBACK_STARTS = tuple(name for name in ("checkmate", *HEURISTICS) if name != GREEDY_START)
"""Step 3 of :func:`warm_start`: the single-device strategies tried on each device alone with
its own budget when nothing else fits (``recompute_greedy`` was already tried in step 1)."""


def _fallback_starts(
    own: Sequence[Instance], solver: str, options: SolverOptions
) -> list[tuple[str, Schedule]]:
    """Step 3 of :func:`warm_start`: Checkmate (a quarter of the limit, a 5 % gap) and the
    heuristics other than ``recompute_greedy`` (already tried) on each device alone with its
    own budget; their schedules, fitting or not (the caller keeps those that fit)."""
    opts = replace(
        options,
        time_limit_s=None if options.time_limit_s is None else options.time_limit_s / 4,
        rel_gap=max(options.rel_gap, 0.05),
    )
    settings = SolveSettings(solver=solver, options=opts)
    out = []
    for sub in own:
        for name in FALLBACK_STARTS:
            log.info("warm start: %s on %s alone with its own budget", name, sub.devices[0])
            res = run_strategy(name, sub, settings)
            if res.status == "error":  # a start is optional
                log.info("warm start candidate %s failed: %s", name, res.message)
            elif res.schedule is not None:
                out.append((_what(res, "its own"), res.schedule))
    return out


# ------------------------------------------------------------------------------ the headline
@dataclass
class Summary:
    """The headline of a run over several devices: XEngine against the fastest single-device
    schedule that fits the total memory (predicted by the simulator, and measured when both
    were executed). ``gain`` = (best single time - XEngine time) / best single time."""

    total_budget_bytes: int | None
    xengine: RunRow | None
    best_single: RunRow | None
    infeasible_single: list[str]

    @property
    def gain(self) -> float | None:
        x, b = self.xengine, self.best_single
        if x is None or b is None or x.result is None or not x.result.fits:
            return None
        if not b.predicted_time_s:
            return None
        return (b.predicted_time_s - x.predicted_time_s) / b.predicted_time_s

    @property
    def measured_gain(self) -> float | None:
        x, b = self.xengine, self.best_single
        if self.gain is None or x.measured_time_s is None or not b.measured_time_s:
            return None
        return (b.measured_time_s - x.measured_time_s) / b.measured_time_s


def _fits(row: RunRow) -> bool:
    return row.result is not None and row.result.fits


def _predicted_fit(row: RunRow) -> bool:
    """A row that fits with a predicted time (PyTorch's own policies are measured only)."""
    return _fits(row) and row.predicted_time_s is not None


def _over_the_mix(row: RunRow) -> bool:
    """A row of a strategy over every device of the mix (XEngine's model)."""
    spec = STRATEGIES.get(row.strategy)
    return spec is not None and spec.heterogeneous


def summarize(rows: Sequence[RunRow]) -> Summary:
    """Best single-device row, XEngine's row, and the single-device rows with no schedule
    that fits the total memory, from the rows of a run over several devices."""
    singles = [r for r in rows if r.alone]
    xe = next((r for r in rows if _over_the_mix(r) and not r.alone), None)
    fitting = [r for r in singles if _predicted_fit(r)]
    best = min(fitting, key=lambda r: r.predicted_time_s) if fitting else None
    total = xe.budget_bytes if xe is not None else None
    return Summary(
        total_budget_bytes=None if not total else int(sum(total)),
        xengine=xe,
        best_single=best,
        infeasible_single=[r.label for r in singles if not _fits(r)],
    )


# ------------------------------------------------------------------------------ library API
@dataclass
class Comparison:
    """Every row of one protocol run (solved and simulated, not executed) and its headline."""

    rows: list[RunRow] = field(default_factory=list)
    summary: Summary | None = None

    @property
    def results(self) -> list[StrategyResult]:
        return [r.result for r in self.rows if r.result is not None]

    @property
    def xengine(self) -> StrategyResult | None:
        x = self.summary.xengine if self.summary else None
        return None if x is None else x.result

    @property
    def best_single(self) -> StrategyResult | None:
        b = self.summary.best_single if self.summary else None
        return None if b is None else b.result

    @property
    def infeasible_single(self) -> list[str]:
        return self.summary.infeasible_single if self.summary else []

    @property
    def gain(self) -> float | None:
        return self.summary.gain if self.summary else None


def compare(
    inst: Instance,
    strategies: Sequence[str] = ("xengine", *SINGLE_DEVICE),
    solver: str = "highs",
    formulation: str = "exact",
    options: SolverOptions | None = None,
) -> Comparison:
    """Run the protocol on a multi-device ``inst`` without executing anything (a one-device
    instance also works: then the single-device strategies get that device's budget)."""
    settings = SolveSettings(
        solver=solver, options=options or SolverOptions(), formulation=formulation
    )
    out = Comparison()

    def solve(job: Job, start: Schedule | None) -> StrategyResult:
        return run_strategy(
            job.name,
            job.inst,
            job.settings(settings),
            warm_start=start,
            label=job.label,
            starts=job.starts,
        )

    def said(start: tuple[str, Schedule, float] | None, _seconds: float) -> None:
        if start is not None:
            log.info("warm start: %s (%.4g s)", start[0], start[2])

    asked: dict[str, str] = {}
    for job, res in solve_jobs(inst, strategies, settings, solve, said):
        asked[job.label] = job.name
        row = row_of(job.label, res)
        row.alone = STRATEGIES[job.name].one_device  # one device too: the rows to beat
        out.rows.append(row)
    out.rows = in_asked_order(out.rows, strategies, lambda r: asked.get(r.label))
    out.summary = summarize(out.rows)
    return out
