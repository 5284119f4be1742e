"""Compute times in a schedule's own context (docs/design.md section 4, "in context").

The profile times every node inside keep-everything steps: forward ops whose saved tensors
autograd keeps itself and one fused backward pass. A schedule that recomputes pays more per
node: its forward ops run with the executor's saved-tensor hooks and taps, its backward may
run as several autograd passes (where a recomputation cannot run inside the pass,
docs/design.md section 8), each with its own start, and the allocator sees other patterns. On
many small ops this is up to 2x the keep-everything cost (issue 28: shufflenet_v2_x0_5, 96 px).

:func:`time_in_context` runs a schedule with the compiled executor and times each of its
instructions as a step pays for it, the way :func:`xengine.profile.profiler._time_step` times
keep-everything: a compute's time is the interval from its start to the next instruction's
start (the frees after it included); a fused pass's start goes to its first backward node;
copies are timed apart (the copy model stays the profile's). A node computed several times
costs the mean of its computations, so that the simulator's sum over the schedule is the
measured sum. The median over ``repeats`` steps is taken.

The marks themselves cost time (a clock read and a record per instruction, a few percent of a
step of many small ops), so each marked step is followed by a plain PyTorch step and an
unmarked step of the same compiled schedule, and the per-node costs are scaled to the
unmarked steps. This machine's speed drifts by 10-30 % within minutes and a step's time
correlates with the next one's, so the step time is taken as the median ratio of each unmarked
step to the plain step before it (one pair of :mod:`xengine.profile.paired`, as the benchmarks
measure), times the plain steps' median: the schedule's time at the machine's median speed over
the timing, not at whichever speed its own steps happened to meet. Its standard error goes
with it: a later measurement of the same schedule differs by about that much by chance.

CPU devices only: on CUDA each mark would need a synchronisation or an event per
instruction; a mix with a CUDA device keeps the profile's costs (the caller says so).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

from xengine.graph.capture import CapturedModel
from xengine.problem import Instance
from xengine.profile.paired import median_se, ratios
from xengine.schedule import Schedule


def supports(inst: Instance) -> bool:
    """Whether the schedule's context can be timed on these devices (CPU only)."""
    from xengine.execute.executor import parse_device

    return not any(parse_device(d).is_cuda for d in inst.devices)


@dataclass(frozen=True)
class ContextTiming:
    """A schedule timed in its own steps: ``cost_s[device][node]`` seconds per computation;
    ``step_s``, the schedule's unmarked step time (module docstring); ``plain_step_s``, the
    median of plain PyTorch steps run between them (the machine's speed at that moment: what a
    measured step time is compared with later); ``over_plain``, the median ratio of the
    unmarked steps to the plain steps beside them (None without plain steps); ``step_se``,
    the standard error of ``step_s`` (relative: of ``over_plain`` where there are plain
    steps), from ``steps`` unmarked steps: how far a later measurement of the same schedule
    may fall from it by chance."""

    cost_s: dict[str, dict[str, float]]
    step_s: float
    plain_step_s: float | None
    over_plain: float | None = None
    step_se: float = float("nan")
    steps: int = 0


def time_in_context(
    captured: CapturedModel,
    inst: Instance,
    sched: Schedule,
    repeats: int = 5,
    warmup: int = 2,
    plain: bool = True,
    min_s: float = 0.0,
    most: int = 25,
) -> ContextTiming:
    """Every node the schedule computes, timed inside the schedule's own steps (module
    docstring), ``warmup`` steps and then at least ``repeats``, more until they took
    ``min_s`` seconds (``most`` at most: a short step is as noisy as a long one, and its
    median needs as many of them), each followed by a plain step (``plain``) and an unmarked
    step.

    Per node the median over the steps is taken, and all of them are then scaled by one
    factor so that their sum is the unmarked step time (less its copies' share): the rare
    slow instruction (a page fault, a garbage collection) hits another node in every step, so
    per-node medians alone miss it, while a step pays for it; and the marks' own cost is not
    the schedule's."""
    from xengine.execute.executor import CompiledSchedule, PlainStep

    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    if not supports(inst):
        raise ValueError(f"time_in_context runs on CPU devices only, not {list(inst.devices)}")
    g = inst.graph
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    unmarked_s: list[float] = []
    computing: list[float] = []  # the share of a marked step that is not copies
    plain_s: list[float] = []
    ref = PlainStep(captured, inst.devices[0]) if plain else None
    with CompiledSchedule(captured, inst, sched) as exe:
        program = _marked_program(exe)
        spent_s, r = 0.0, 0
        while r < warmup + repeats or (spent_s < min_s and r < warmup + most):
            t0 = time.perf_counter()
            spans, marked_s = _one_step(exe, program)
            # then one pair as the benchmarks take them (xengine.profile.paired): the plain
            # step first, so that the schedule's step follows a plain step, as it does there
            dt_plain = ref.step()[0] if ref is not None else None
            dt_step = exe.step()[0]
            r += 1
            if r <= warmup:
                continue
            spent_s += time.perf_counter() - t0
            total: dict[tuple[str, int], float] = defaultdict(float)
            count: dict[tuple[str, int], int] = defaultdict(int)
            for key, dt, new in spans:
                total[key] += dt
                count[key] += new
            for key, t in total.items():
                samples[key].append(t / max(count[key], 1))
            unmarked_s.append(dt_step)
            computing.append(sum(total.values()) / marked_s if marked_s > 0 else 1.0)
            if dt_plain is not None:
                plain_s.append(dt_plain)
        exe.rt.reset()
        exe.rt.zero_grads()
    if ref is not None:
        ref.close()
    medians = {key: statistics.median(ts) for key, ts in samples.items()}
    counts = dict(count)  # the same in every step
    summed = sum(medians[k] * max(counts.get(k, 1), 1) for k in medians)
    plain_step_s = over_plain = None
    se = median_se(unmarked_s)
    if plain_s:
        plain_step_s = float(statistics.median(plain_s))
        over = ratios(unmarked_s, plain_s)
        over_plain, se = float(statistics.median(over)), median_se(over)
        step_s = over_plain * plain_step_s
    else:
        step_s = float(statistics.median(unmarked_s))
    # the copies keep the profile's model, so the computes get the rest of the step
    scale = step_s * statistics.median(computing) / summed if summed > 0 else 1.0
    out: dict[str, dict[str, float]] = {d: {} for d in inst.devices}
    for (d, v), t in medians.items():
        out[d][g.nodes[v].name] = float(t * scale)
    return ContextTiming(out, step_s, plain_step_s, over_plain, float(se), len(unmarked_s))


def _marked_program(exe) -> list[tuple]:
    """The program with each instruction's mark resolved once: ``(fn, key, pass device,
    first node of a pass)``; ``key`` is ``(device, node)`` for a compute or a pass, ``None``
    for a copy (timed apart) and ``False`` for a free (its time goes to the compute before)."""
    out = []
    for fn, label in exe.program:
        kind, dev, node = label.split("|")[1:4]
        if kind in ("compute", "group"):
            key = (dev, int(node))
        else:
            key = None if kind == "copy" else False
        out.append((fn, key, dev if kind == "group" else None, int(node)))
    return out


def _one_step(
    exe, program: list[tuple] | None = None
) -> tuple[list[tuple[tuple[str, int], float, int]], float]:
    """One step of ``exe`` with a mark at every instruction: per interval, ``(device, node)``
    of the compute it belongs to, its seconds, and 1 where a computation starts (0 for a
    second interval of the same one), copy intervals left out; and the marked program's
    seconds, copies included."""
    rt = exe.rt
    program = program if program is not None else _marked_program(exe)
    exe._restore()
    rt.reset()
    rt.zero_grads()
    clock = time.perf_counter
    marks: list[tuple[tuple[str, int] | None, float, int]] = []
    append = marks.append
    here = {"device": "", "skip": -1}  # a pass's device; its first node, marked at its start

    def tick(node: int) -> None:
        if here["skip"] == node:
            here["skip"] = -1
            return
        append(((here["device"], node), clock(), 1))

    rt.clock = tick
    try:
        for fn, key, pass_device, node in program:
            if key is not False:
                if pass_device is not None:
                    here["device"], here["skip"] = pass_device, node
                append((key, clock(), 1))
            fn()
        append((None, clock(), 0))
    finally:
        rt.clock = None
    if rt.live_count():
        raise RuntimeError(f"executor: {rt.live_count()} registers alive after the step")
    spans = [
        (key, b - a, new)
        for (key, a, new), (_, b, _) in zip(marks, marks[1:], strict=False)
        if key is not None
    ]
    return spans, marks[-1][1] - marks[0][1]


def with_context_costs(inst: Instance, measured: dict[str, dict[str, float]]) -> Instance:
    """``inst`` with the nodes ``measured`` names costed as measured (per device); every
    other node keeps its cost."""
    g = inst.graph
    compute = {
        d: {v.name: float(measured.get(d, {}).get(v.name, v.cost_s[d])) for v in g.nodes}
        for d in inst.devices
    }
    return Instance(g.with_costs(compute), inst.devices, inst.budget_bytes)


__all__ = ["ContextTiming", "supports", "time_in_context", "with_context_costs"]
