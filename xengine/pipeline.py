"""One run end to end (docs/design.md sections 2 and 9).

config -> graph (captured from a net, or a graph JSON file) and budgets
(:func:`xengine.prepare.prepare`) -> cost profile (cached) -> every strategy on the instance in
the order of the paper's protocol (:mod:`xengine.protocol`), each through the simulator
(:func:`xengine.strategies.registry.run_strategy`) -> execution of each schedule that fits ->
one row per strategy, beside a plain PyTorch step as the reference, each recorded as soon as it
is complete (:mod:`xengine.records.record`).

This module takes plain dataclasses; the Hydra entry point (``run.py``) builds a
:class:`~xengine.config.RunConfig` from the composed config. A strategy that fails is recorded
with status ``error`` and the run carries on.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from functools import partial
from operator import itemgetter
from typing import Any

import numpy as np

from xengine.config import RunConfig
from xengine.execute.grads import (
    check_grads,
    grads_match,
    grads_max_rel_diff,
    reference_devices,
    reference_of,
)
from xengine.prepare import Prepared, measure_profile, prepare
from xengine.problem import Instance
from xengine.progress import StatusLine
from xengine.protocol import Job, in_asked_order, solve_jobs, summarize
from xengine.records.record import (
    NullTracker,
    Tracker,
    record_figures,
    record_graph,
    record_profile,
    record_row,
    record_summary,
)
from xengine.refine import solve_in_context
from xengine.result import MIB, RunRow, StrategyResult, row_of
from xengine.schedule import Schedule, keep_all_schedule
from xengine.simulate import simulate
from xengine.strategies.registry import STRATEGIES
from xengine.units import format_bytes

log = logging.getLogger(__name__)


def run_pipeline(
    cfg: RunConfig, tracker: Tracker | None = None, prepared: Prepared | None = None
) -> list[RunRow]:
    """Run every strategy of ``cfg``; rows come back in table order (reference first).

    Each row is handed to ``tracker`` as soon as it is complete (metrics, schedule, figures),
    so a crash later in the run loses nothing already measured. With several devices the
    single-device strategies get the total memory on each device alone, ``xengine`` joins,
    and the gain over the fastest single-device schedule is recorded
    (:func:`xengine.protocol.summarize`).
    """
    tracker = tracker or NullTracker()
    prep = prepared or prepare(cfg)
    inst = _instance(cfg, prep, tracker)
    rows = _references(cfg, prep, tracker) if cfg.executes else []
    references = {r.devices[0]: r.execution for r in rows if r.execution is not None}
    executed: dict[str, tuple[str, Any]] = {}  # schedule key -> (label, its execution)
    asked: dict[str, str] = {}  # row label -> its strategy, for the table's order

    def solve(job: Job, start: Schedule | None):
        if STRATEGIES[job.name].runs_in_pytorch and cfg.executes:
            prep.start_state.restore()  # PyTorch runs it now, from the step's start
        return solve_in_context(
            job.name,
            job.inst,
            job.settings(cfg.settings),
            prep.captured if cfg.executes else None,
            rounds=cfg.context_rounds,
            repeats=cfg.profile_repeats,
            warmup=cfg.profile_warmup,
            warm_start=start,
            label=job.label,
            status_line=cfg.progress,
            starts=job.starts,
        )

    started = partial(_warm_start_said, tracker=tracker)
    jobs = solve_jobs(inst, cfg.run_strategies, cfg.settings, solve, started, itemgetter(0))
    plains = _plain_steps(cfg, prep)
    try:
        for job, (res, costed, rounds) in jobs:
            row = row_of(job.label, res)
            row.alone = job.alone
            asked[row.label] = job.name
            if rounds is not None:
                row.profile_time_s = rounds.profile_time_s
                row.context_rounds, row.context_stable = rounds.rounds, rounds.stable
                row.context_plain_time_s = rounds.context_plain_step_s
                row.context_cost_s = {
                    d: {v.name: v.cost_s[d] for v in costed.graph.nodes} for d in costed.devices
                }
            elif res.sim is not None and len(costed.devices) == 1:
                keep_all = simulate(costed, keep_all_schedule(costed), check_budget=False)
                row.keep_all_time_s = keep_all.time_s
            if cfg.executes and prep.captured is not None:
                _execute_into(row, res, costed, cfg, prep, references, executed, plains)
            rows.append(row)
            record_row(tracker, row)
            record_figures(tracker, row, job.inst)
    finally:
        for plain in plains.values():
            plain.close()
    if len(cfg.devices) > 1:
        record_summary(tracker, summarize(rows))
    return in_asked_order(rows, cfg.run_strategies, lambda r: asked.get(r.label))


def _instance(cfg: RunConfig, prep: Prepared, tracker: Tracker) -> Instance:
    """The instance the strategies solve: the prepared graph with its measured (or cached, or
    given) costs; the graph's figures, the profile and the graph itself are recorded."""
    graph = prep.graph
    tracker.metrics(
        {
            "graph/num_nodes": graph.size,
            "graph/num_edges": len(graph.edges),
            "graph/keep_all_peak_mib": prep.keep_all_peak_bytes / MIB,
            "graph/min_budget_mib": prep.min_budget_bytes / MIB,
            "graph/fixed_mib": graph.fixed_bytes / MIB,
        }
    )
    if prep.captured is not None:
        profile, profile_file = prep.profile, cfg.profile_path
        if profile is None:
            profile, profile_file, graph = measure_profile(cfg, prep)
        record_profile(profile, str(profile_file), tracker)
        prep.graph = graph
        prep.resolve_budgets(cfg)  # each device's percentage of its own measured peak
    for d, k, b in zip(cfg.devices, prep.keep_all_by_device_bytes, prep.budget_bytes, strict=True):
        log.info("%s: keep-everything peak %s, budget %s", d, format_bytes(k), format_bytes(b))
        if len(cfg.devices) > 1:
            tracker.metrics(
                {f"graph/keep_all_peak_mib.{d}": k / MIB, f"graph/budget_mib.{d}": b / MIB}
            )
    # after profiling: a percentage is of each device's measured peak (resolve_budgets)
    tracker.metrics({"protocol/total_budget_mib": int(sum(prep.budget_bytes)) / MIB})
    inst = Instance(graph, cfg.devices, prep.budget_bytes)
    record_graph(tracker, inst)
    return inst


def _references(cfg: RunConfig, prep: Prepared, tracker: Tracker) -> list[RunRow]:
    """A plain PyTorch step on each device kind of the mix, the rows the others compare with
    (:func:`xengine.execute.grads.reference_devices`)."""
    rows = []
    for device in reference_devices(cfg.devices):
        row = _reference(cfg, prep, device)
        rows.append(row)
        record_row(tracker, row)
    return rows


def _warm_start_said(
    start: tuple[str, Schedule, float] | None, seconds: float, tracker: Tracker
) -> None:
    """XEngine's start (:func:`xengine.protocol.warm_start`), logged, timed and tagged
    (``xengine/warm_start_time_s``, ``xe.warm_start``)."""
    tracker.metrics({"xengine/warm_start_time_s": seconds})
    if start is None:
        log.info("xengine: no schedule found that fits the per-device budgets; cold start")
        tracker.tags({"xe.warm_start": "none"})
        return
    what, _sched, t = start
    log.info("xengine: warm start from %s, predicted %.4g s", what, t)
    tracker.tags({"xe.warm_start": what})


def _reference(cfg: RunConfig, prep: Prepared, device: str) -> RunRow:
    """The plain step's row; its ``execution`` is None when the step failed."""
    from xengine.execute.executor import reference_step

    log.info(
        "reference: plain PyTorch step on %s, %d steps after %d warm-up",
        device,
        cfg.n_steps,
        cfg.warmup,
    )
    label = "pytorch" if device == cfg.devices[0] else f"pytorch.{device}"
    row = RunRow(label=label, strategy="pytorch", devices=(device,), status="reference")
    try:
        prep.start_state.restore()
        with StatusLine(f"plain PyTorch step on {device}", enabled=cfg.progress):
            ref = reference_step(
                prep.captured, n_steps=cfg.n_steps, warmup=cfg.warmup, device=device
            )
    except Exception as exc:
        log.warning("reference step failed: %s: %s", type(exc).__name__, exc)
        log.info("reference traceback", exc_info=True)
        row.status, row.note = "error", f"{type(exc).__name__}: {exc}"
        return row
    _fill_measurement(row, ref)
    row.execution = ref
    return row


def _plain_steps(cfg: RunConfig, prep: Prepared) -> dict[str, Any]:
    """Reference device -> a plain PyTorch step timed before every step of each schedule
    executed on that kind of device (the executor's ``beside``), so that each row also has
    its time in plain steps, which the machine's drift between rows does not move; empty when
    nothing is executed."""
    if not cfg.executes or prep.captured is None:
        return {}
    from xengine.execute.executor import PlainStep

    prep.start_state.restore()
    plains = {}
    for d in reference_devices(cfg.devices):
        try:  # on a GPU it is a copy of the model, which may not fit beside the run's
            plains[d] = PlainStep(prep.captured, d)
        except Exception as exc:
            log.warning(
                "no plain step on %s to time the schedules beside (%s: %s): their rows have "
                "milliseconds only",
                d,
                type(exc).__name__,
                exc,
            )
    return plains


def _fill_measurement(row: RunRow, ex: Any) -> None:
    row.measured_time_s = float(ex.step_time_s)
    row.measured_over_plain = ex.over_plain
    row.measured_peak_bytes = tuple(int(ex.peak_bytes.get(d, 0)) for d in row.devices)
    fixed = ex.fixed_bytes
    row.fixed_bytes = int(sum(fixed.values()) if isinstance(fixed, Mapping) else fixed)


def _execute_into(
    row: RunRow,
    res: StrategyResult,
    inst: Instance,
    cfg: RunConfig,
    prep: Prepared,
    references: Mapping[str, Any],
    executed: dict[str, tuple[str, Any]] | None = None,
    plains: Mapping[str, Any] | None = None,
) -> None:
    """Run ``res``'s schedule for real when it has one that fits, and compare with PyTorch.

    A schedule already executed in this run on the same devices and budgets (keep-everything
    is often the answer of four strategies) is not run again: the row takes that measurement
    and says so in its note, so that one schedule has one measured time. A policy that
    PyTorch ran itself (``res.pytorch``) brings its own execution, checked the same way."""
    if res.pytorch is not None:
        if res.pytorch.execution is None:
            return
        ex = res.pytorch.execution
    else:
        ex = _execution_of(row, res, inst, cfg, prep, executed, plains)
        if ex is None:
            return
    row.execution = ex
    _fill_measurement(row, ex)
    if res.pytorch is not None:
        row.compile_time_s = res.pytorch.compile_time_s
    wrong = list(ex.violations)  # measured peak above budget + the executor's stated tolerance
    wrong += _ours_beside(row, res, references, cfg)
    checked = _checked_grads(row, res, references, cfg)
    if checked is not None:  # None: a reference step failed, nothing to compare with
        row.grads_match, row.grads_max_rel_diff = checked
        if not row.grads_match:
            diff = row.grads_max_rel_diff
            wrong.insert(
                0,
                "loss or gradients differ from plain PyTorch's (largest difference "
                f"{'unknown' if diff is None else f'{diff:.3g}'} of the tensor's largest "
                f"magnitude; rtol {cfg.grad_rtol:g}, atol {cfg.grad_atol:g})",
            )
    if wrong:
        row.wrong = "; ".join(wrong)
        log.error("%s: WRONG: %s", row.label, row.wrong)


def _ours_beside(
    row: RunRow, res: StrategyResult, references: Mapping[str, Any], cfg: RunConfig
) -> list[str]:
    """A policy translated into a schedule of ours (``PolicyRun.ours``): its time and peak
    under our executor on the row, and what is wrong with that run (its loss or gradients,
    its measured peak over the budget)."""
    ours = res.pytorch.ours if res.pytorch is not None else None
    if ours is None:
        if res.pytorch is not None and res.pytorch.untranslated:
            why = f"no schedule of ours: {res.pytorch.untranslated}"
            row.note = "; ".join(filter(None, (row.note, why)))
        return []
    device = row.devices[0]
    row.ours_time_s, row.ours_peak_bytes = float(ours.step_time_s), int(ours.peak_bytes[device])
    row.ours_over_plain = ours.over_plain
    beside = "" if ours.over_plain is None else f" ({ours.over_plain:.3f} plain steps)"
    row.note = "; ".join(
        filter(
            None,
            (
                row.note,
                f"our executor on the same checkpoints: {ours.step_time_s * 1e3:.2f} ms"
                f"{beside}, peak {format_bytes(row.ours_peak_bytes)}",
            ),
        )
    )
    wrong = [f"our executor's run of its schedule: {v}" for v in ours.violations]
    checked = check_grads(ours, row.devices, references, cfg.grad_rtol, cfg.grad_atol)
    if checked is not None and not checked[0]:
        wrong.append("our executor's run of its schedule: loss or gradients differ from plain")
    return wrong


def _checked_grads(
    row: RunRow, res: StrategyResult, references: Mapping[str, Any], cfg: RunConfig
) -> tuple[bool, float | None] | None:
    """The row's loss and gradients against plain PyTorch's (:func:`check_grads`), or, for a
    compiled policy, its own pair of steps compared per tensor
    (:class:`~xengine.result.GradCheck`)."""
    own = res.pytorch.grad_check if res.pytorch is not None else None
    if own is None:
        return check_grads(row.execution, row.devices, references, cfg.grad_rtol, cfg.grad_atol)
    row.note = "; ".join(filter(None, (row.note, f"gradients checked {own.how}")))
    match = grads_match(own.run, own.plain, cfg.grad_rtol, cfg.grad_atol, per_tensor=True)
    return match, grads_max_rel_diff(own.run, own.plain)


def _execution_of(
    row: RunRow,
    res: StrategyResult,
    inst: Instance,
    cfg: RunConfig,
    prep: Prepared,
    executed: dict[str, tuple[str, Any]] | None,
    plains: Mapping[str, Any] | None = None,
) -> Any:
    """The execution of ``res``'s schedule: run now, or the one of the same schedule earlier
    in this run; None when there is none (no schedule, over budget, or it failed: the row's
    note says which)."""
    if not res.has_schedule:
        return None
    if not res.sim.within_budget:
        row.note = row.note or "not executed: over budget in the simulator"
        return None
    from xengine.execute.executor import execute

    key = _schedule_key(res.schedule, inst)
    if executed is not None and key in executed:
        first, ex = executed[key]
        row.note = "; ".join(
            x for x in (row.note, f"measured once with {first}: the same schedule") if x
        )
    else:
        log.info("%s: executing %d steps after %d warm-up", row.label, cfg.n_steps, cfg.warmup)
        try:
            prep.start_state.restore()
            with StatusLine(f"executing {row.label}", enabled=cfg.progress):
                ex = execute(
                    prep.captured,
                    inst,
                    res.schedule,
                    n_steps=cfg.n_steps,
                    warmup=cfg.warmup,
                    beside=_beside(plains, row.devices[0]),
                )
        except Exception as exc:
            log.warning("%s: execution failed: %s: %s", row.label, type(exc).__name__, exc)
            log.info("%s execution traceback", row.label, exc_info=True)
            row.note = f"execution failed: {type(exc).__name__}: {exc}"
            return None
        if executed is not None:
            executed[key] = (row.label, ex)
    return ex


def _beside(plains: Mapping[str, Any] | None, device: str) -> Any:
    """The plain step a row on ``device`` is timed beside: that of the table's plain row it
    is compared with (the same kind of device), or None."""
    if not plains:
        return None
    ref = reference_of(device, plains)
    return None if ref is None else plains[ref]


def _schedule_key(sched: Schedule, inst: Instance) -> str:
    """What makes two executions the same: devices, budgets, and the schedule's R, S and
    state residency (an implicit minimal residency equals the same made explicit)."""
    h = hashlib.sha256()
    h.update(repr((tuple(inst.devices), tuple(int(b) for b in inst.budget_bytes))).encode())
    for a in (sched.R, sched.S, sched.states_for(inst.graph)):
        a = np.ascontiguousarray(a, dtype=bool)
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()
