"""Checkmate's heuristic baselines on one device: checkpoint-all, Chen sqrt(n), Chen greedy.

Each picks a set of forward checkpoints, turns it into a schedule with
:func:`baselines.common.schedule_from_checkpoints` and lets the simulator judge it. A
heuristic's result is ``feasible`` when its schedule fits the budget and ``infeasible`` (with
the schedule still attached) when it does not.

Chen et al. (2016) place a checkpoint every sqrt(n) layers of a chain, or greedily whenever
the activations since the last checkpoint exceed a segment budget; Checkmate generalises both
to DAGs by taking the candidates from the articulation points of the forward graph.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import numpy as np

from baselines.common import articulation_points, is_forward_chain, schedule_from_checkpoints
from xengine.problem import Instance
from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import Simulation, simulate

GREEDY_SWEEP = np.arange(300) / 100.0
"""Segment budgets of Chen greedy, as multiples of the sqrt(n) schedule's peak (Checkmate's
budget sweep: 0 to 3x in 1 % steps)."""


def require_one_device(inst: Instance, who: str) -> None:
    if inst.n_devices != 1:
        raise ValueError(
            f"{who} schedules one device; this instance has {inst.n_devices} "
            f"({', '.join(inst.devices)}): use inst.only_device(d, budget)"
        )


def over_budget_message(sim: Simulation, budget: int) -> str:
    peak = int(sim.peak_bytes.max())
    over = peak - int(budget)
    return (
        f"peak {peak} bytes is over the budget of {int(budget)} bytes by {over} bytes "
        f"({100.0 * over / max(int(budget), 1):.1f} %)"
    )


def evaluate(
    inst: Instance,
    strategy: str,
    sched: Schedule,
    t0: float,
    sim: Simulation | None = None,
    extra: dict | None = None,
) -> StrategyResult:
    """Wrap a heuristic schedule in a result, simulated without stopping at the budget."""
    sim = sim if sim is not None else simulate(inst, sched, check_budget=False)
    budget = int(inst.budget_bytes[0])
    fits = sim.within_budget
    return StrategyResult(
        strategy=strategy,
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="feasible" if fits else "infeasible",
        schedule=sched,
        sim=sim,
        solve_time_s=time.perf_counter() - t0,
        message="" if fits else over_budget_message(sim, budget),
        extra=dict(extra or {}),
    )


def checkpoint_candidates(inst_or_graph) -> list[int]:
    """Chen's candidates: every forward op on a chain, the articulation points otherwise."""
    g = getattr(inst_or_graph, "graph", inst_or_graph)
    if is_forward_chain(g):
        return list(g.forward_indices)
    return articulation_points(g)


def sqrtn_checkpoints(candidates: list[int]) -> list[int]:
    """Every floor(sqrt(|C|))-th candidate (the k-th, 2k-th, ...), as Checkmate takes them."""
    if not candidates:
        return []
    k = max(1, math.isqrt(len(candidates)))
    return [v for j, v in enumerate(candidates) if (j + 1) % k == 0]


def greedy_checkpoints(
    inst: Instance, candidates: Iterable[int], segment_bytes: float
) -> list[int]:
    """Walk the forward ops in order, adding up their bytes; checkpoint a candidate as soon as
    the running segment exceeds ``segment_bytes``, then start a new segment."""
    g = inst.graph
    cand = set(candidates)
    m = g.output_bytes
    keep, acc = [], 0
    for v in g.forward_indices:
        acc += int(m[v])
        if v in cand and acc > segment_bytes:
            keep.append(v)
            acc = 0
    return keep


def solve_checkpoint_all(inst: Instance) -> StrategyResult:
    """Keep every forward output until its last reader: no recomputation, the most memory."""
    require_one_device(inst, "checkpoint_all")
    t0 = time.perf_counter()
    keep = list(inst.graph.forward_indices)
    sched = schedule_from_checkpoints(inst.graph, keep, inst.devices[0])
    return evaluate(inst, "checkpoint_all", sched, t0, extra={"checkpoints": keep})


def solve_chen_sqrtn(inst: Instance) -> StrategyResult:
    """Checkpoint every floor(sqrt(|C|))-th candidate."""
    require_one_device(inst, "chen_sqrtn")
    t0 = time.perf_counter()
    cand = checkpoint_candidates(inst)
    keep = sqrtn_checkpoints(cand)
    sched = schedule_from_checkpoints(inst.graph, keep, inst.devices[0])
    return evaluate(
        inst, "chen_sqrtn", sched, t0, extra={"checkpoints": keep, "n_candidates": len(cand)}
    )


def solve_chen_greedy(inst: Instance) -> StrategyResult:
    """Chen's greedy segments over Checkmate's sweep of segment budgets; the fastest schedule
    that fits the budget wins (the smallest peak, then the fastest, when none fits)."""
    require_one_device(inst, "chen_greedy")
    t0 = time.perf_counter()
    g, dev = inst.graph, inst.devices[0]
    cand = checkpoint_candidates(inst)
    sqrt_sched = schedule_from_checkpoints(g, sqrtn_checkpoints(cand), dev)
    scale = float(simulate(inst, sqrt_sched, check_budget=False).peak_bytes.max())
    tried: dict[tuple[int, ...], float] = {}
    best = None
    for f in GREEDY_SWEEP:
        keep = tuple(greedy_checkpoints(inst, cand, f * scale))
        if keep in tried:
            continue
        tried[keep] = f * scale
        sched = schedule_from_checkpoints(g, keep, dev)
        sim = simulate(inst, sched, check_budget=False)
        key = (
            (0, sim.time_s, int(sim.peak_bytes.max()))
            if sim.within_budget
            else (1, int(sim.peak_bytes.max()), sim.time_s)
        )
        if best is None or key < best[0]:
            best = (key, keep, sched, sim)
    _, keep, sched, sim = best
    return evaluate(
        inst,
        "chen_greedy",
        sched,
        t0,
        sim=sim,
        extra={
            "checkpoints": list(keep),
            "segment_bytes": tried[keep],
            "n_checkpoint_sets": len(tried),
            "n_candidates": len(cand),
        },
    )


HEURISTICS: dict[str, Callable[[Instance], StrategyResult]] = {
    "checkpoint_all": solve_checkpoint_all,
    "chen_sqrtn": solve_chen_sqrtn,
    "chen_greedy": solve_chen_greedy,
}
"""Name -> heuristic, for the command line and the Checkmate warm start."""


def run_heuristics(inst: Instance, names: Iterable[str] | None = None) -> list[StrategyResult]:
    return [HEURISTICS[name](inst) for name in (names or HEURISTICS)]


def best_fitting(results: Iterable[StrategyResult]) -> StrategyResult | None:
    """The fastest result whose schedule fits its budget (None if none does)."""
    fits = [r for r in results if r.has_schedule and r.sim.within_budget]
    return min(fits, key=lambda r: (r.sim.time_s, int(r.sim.peak_bytes.max())), default=None)
