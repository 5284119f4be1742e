"""Spread a single-device schedule over several devices: XEngine's multi-device starting point.

A MILP solver started from a one-device schedule rarely finds on its own that a second device
helps: on resnet18 with two CPU sub-devices (111k variables) HiGHS kept its one-device start
for 600 s. And when each device's budget is below what one device needs, there is no
one-device start at all. This module builds a start that uses every device, cheaply:

* a single-device schedule ``(R, S)`` (stage structure of Checkmate) plus a *placement*
  ``node -> device`` gives a multi-device schedule: node ``i`` is computed and kept exactly as
  before, on device ``placement[i]``; the simulator inserts the copies an input on another
  device needs (docs/design.md section 5), so every placement of a valid schedule is valid;
* a forward node and its backward node are placed together (the backward reads the forward's
  autograd state, which cannot be copied: a state edge);
* the search tries every cut of the forward order into a prefix on one device and a suffix on
  another (early layers hold the largest activations, so a cut moves memory where it is
  free), then moves single (forward, backward) pairs while that lowers the simulated time or
  the excess over the budgets.

Each candidate is scored by :func:`xengine.simulate.simulate` itself, so the result's time and
per-device peaks are the simulator's. The search is a heuristic: the MILP (warm-started from
it) is what proves anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, StageMemo, simulate
from xengine.solvers import SolverOptions, SolverUnavailable

log = logging.getLogger(__name__)


def place(single: Schedule, devices: tuple[str, ...], placement: Sequence[int]) -> Schedule:
    """``single`` (one device) with node ``i`` computed and kept on ``devices[placement[i]]``."""
    if single.R.shape[0] != 1:
        raise ValueError(f"place() spreads a one-device schedule; got {single.R.shape[0]} devices")
    placement = np.asarray(placement, dtype=np.int64)
    _, T, n = single.R.shape
    if placement.shape != (n,):
        raise ValueError(f"placement has {placement.size} entries for {n} nodes")
    if placement.min(initial=0) < 0 or placement.max(initial=0) >= len(devices):
        raise ValueError(f"placement names a device outside 0..{len(devices) - 1}")
    R = np.zeros((len(devices), T, n), dtype=bool)
    S = np.zeros((len(devices), T, n), dtype=bool)
    cols = np.arange(n)
    R[placement, :, cols] = single.R[0].T
    S[placement, :, cols] = single.S[0].T
    A = None
    if single.S_state is not None:  # a state stays with its forward op's device
        A = np.zeros((len(devices), T, n), dtype=bool)
        A[placement, :, cols] = single.S_state[0].T
    return Schedule(devices, R, S, A)


def units(inst: Instance) -> np.ndarray:
    """Per node, the index of its placement unit: a forward node with its backward node (and
    the loss with the last forward node), so that no autograd state has to move."""
    g = inst.graph
    owner = list(range(g.size))
    last_fwd = None
    for i, v in enumerate(g.nodes):
        if v.kind == "bwd" and v.fwd_index is not None:
            owner[i] = v.fwd_index
        elif v.kind == "loss" and last_fwd is not None:
            owner[i] = last_fwd
        elif v.kind == "fwd":
            last_fwd = i
    ids: dict[int, int] = {}  # numbered in topological order of the unit's first node
    return np.array([ids.setdefault(o, len(ids)) for o in owner], dtype=np.int64)


@dataclass(frozen=True)
class Spread:
    """The best placement found: the schedule, its simulated time and per-device peaks."""

    schedule: Schedule
    time_s: float
    peak_bytes: np.ndarray
    source: str  # which single-device schedule it came from
    placement: np.ndarray
    evaluations: int
    excess_bytes: float  # summed over devices; 0 when the schedule fits every budget

    @property
    def fits(self) -> bool:
        return self.excess_bytes == 0

    @property
    def devices_used(self) -> int:
        return int((self.schedule.R.sum(axis=(1, 2)) > 0).sum())


def _score(
    inst: Instance, sched: Schedule, memo: StageMemo | None = None
) -> tuple[float, float, np.ndarray] | None:
    """(excess over budgets in bytes, time, peaks), lexicographic: fitting comes first."""
    try:
        sim = simulate(inst, sched, check_budget=False, memo=memo)
    except ScheduleError:
        return None
    excess = float(np.maximum(sim.peak_bytes - inst.budgets, 0).sum())
    return excess, float(sim.time_s), sim.peak_bytes


def spread(
    inst: Instance,
    singles: Sequence[tuple[str, Schedule]],
    time_limit_s: float = 30.0,
    min_devices_used: int = 1,
) -> Spread | None:
    """The best placement over all ``singles`` (``(label, one-device schedule)``): the fastest
    that fits every device's budget, or else the one least over them (``Spread.fits``).
    ``None`` only when there is nothing to place. With ``min_devices_used=2`` only placements
    that use two devices or more count (the placed model needs one even when a one-device
    schedule is the best fit as it stands).

    Every schedule's cuts are always tried; the single-pair moves of each get an equal share
    of what is left of ``time_limit_s`` (a first schedule must not use up the time of the
    others: on resnet50 one schedule's moves alone take more than 30 s).
    """
    D = inst.n_devices
    # the same schedule solved on several devices (heuristics ignore costs) is placed once
    seen: set[bytes] = set()
    unique = []
    for label, single in singles:
        key = np.packbits(single.R).tobytes() + np.packbits(single.S).tobytes()
        if key not in seen:
            seen.add(key)
            unique.append((label, single))
    singles = unique
    if D < 2 or not singles:
        return None
    t0 = time.perf_counter()
    unit = units(inst)
    n_units = int(unit.max()) + 1
    evals = 0
    best: tuple[tuple[float, float], str, np.ndarray, Schedule, np.ndarray] | None = None
    memo = StageMemo(inst)  # a move changes the stages of one (forward, backward) pair

    def consider(label: str, single: Schedule, unit_dev: np.ndarray):
        nonlocal evals, best
        if len(np.unique(unit_dev)) < min_devices_used:
            return None
        evals += 1
        sched = place(single, inst.devices, unit_dev[unit])
        sc = _score(inst, sched, memo)
        if sc is None:
            return None
        key = (sc[0], sc[1])
        if best is None or key < best[0]:
            best = (key, label, unit_dev.copy(), sched, sc[2])
        return key

    for k, (label, single) in enumerate(singles):
        # every schedule gets its cuts and an equal share of what is left for moves
        t_single = time.perf_counter()
        share_s = max(0.0, time_limit_s - (t_single - t0)) / (len(singles) - k)
        # cuts: units before the cut on device a, the rest on device b
        local_best: tuple[tuple[float, float], np.ndarray] | None = None
        for a in range(D):
            for b in range(D):
                if a == b:
                    continue
                for cut in range(n_units + 1):
                    unit_dev = np.full(n_units, b, dtype=np.int64)
                    unit_dev[:cut] = a
                    key = consider(label, single, unit_dev)
                    if key is not None and (local_best is None or key < local_best[0]):
                        local_best = (key, unit_dev)
        if local_best is None:
            continue
        # moves: one unit to another device, first improvement, until none helps
        key, unit_dev = local_best
        improved = True
        while improved and time.perf_counter() - t_single <= share_s:
            improved = False
            for u in range(n_units):
                for d in range(D):
                    if d == unit_dev[u]:
                        continue
                    trial = unit_dev.copy()
                    trial[u] = d
                    tkey = consider(label, single, trial)
                    if tkey is not None and tkey < key:
                        key, unit_dev, improved = tkey, trial, True
                        break
                if time.perf_counter() - t_single > share_s:
                    break
    if best is None:
        return None
    (excess, t_s), label, unit_dev, sched, peaks = best
    out = Spread(sched, t_s, peaks, label, unit_dev[unit], evals, excess)
    log.info(
        "spread: %s over %d device(s), predicted %.4g s, peaks %s MiB%s (%d evaluations, %.1f s)",
        label,
        out.devices_used,
        t_s,
        ", ".join(f"{p / 2**20:.1f}" for p in peaks),
        "" if out.fits else f", {excess / 2**20:.1f} MiB over the budgets",
        evals,
        time.perf_counter() - t0,
    )
    return out


def start_candidates(
    inst: Instance,
    singles: Sequence[tuple[str, Schedule]],
    solver: str = "highs",
    options: SolverOptions | None = None,
    spread_time_limit_s: float = 30.0,
    formulation: str = "exact",
    placed_model: bool = True,
) -> list[tuple[str, Schedule]]:
    """Multi-device schedules to warm-start XEngine with, each valid on ``inst``:

    1. the best placement of ``singles`` (and of keep-everything and Chen's greedy schedule
       with the total memory on the device that is fastest overall) that fits;
    2. the optimum of XEngine's model restricted to the best placement over several devices
       (fitting or, failing that, least over the budgets; each node on its
       placed device only; :func:`xengine.strategies.solve.solve_xengine` with ``placement``),
       solved with ``options`` as they are: on resnet18 with two CPU sub-devices it reached a 0.5 %
       gap only after 78 s (32 % at 22 s), so a shorter limit or a looser gap costs most of its
       value. Skipped when the placement uses one device. ``formulation`` is XEngine's model
       (``exact`` MILP or ``intervals``, :mod:`xengine.strategies.intervals`). Skipped too
       when ``placed_model`` is false (the caller has a start and a better use for the time).

    Candidates may exceed the budgets only if the caller checks; both kinds here fit.
    """
    from xengine.schedule import keep_all_schedule
    from xengine.strategies.registry import load
    from xengine.strategies.solve import solve_xengine

    if inst.n_devices < 2:
        return []
    # two cheap one-device schedules with the total memory, on the device fastest overall
    fastest = inst.fastest_device
    alone = inst.only_device(fastest, int(inst.budgets.sum()))
    extra = [("keep-all", keep_all_schedule(alone))]
    greedy = load("chen_greedy")(alone)  # a baseline: looked up, never imported
    if greedy.has_schedule:
        extra.append((f"chen_greedy on {inst.devices[fastest]}", greedy.schedule))
    cands = [*singles, *extra]
    sp = spread(inst, cands, time_limit_s=spread_time_limit_s)
    out: list[tuple[str, Schedule]] = []
    if sp is None:
        return out
    if sp.fits:
        where = "spread over the devices" if sp.devices_used > 1 else "placed on one device"
        out.append((f"{sp.source} {where}", sp.schedule))
    if not placed_model:
        return out
    if sp.devices_used < 2:
        # the best fit as it stands is one device alone; the placed model still needs (and
        # may do much better from) the best placement over several devices
        sp = spread(inst, cands, time_limit_s=spread_time_limit_s, min_devices_used=2)
        if sp is None:
            return out
    log.info("placed model: XEngine with each node on the device of the best placement")
    try:
        res = solve_xengine(
            inst,
            solver=solver,
            options=options,
            formulation=formulation,
            placement=sp.placement,
            warm_start=sp.schedule if sp.fits else None,
            strategy="xengine.placed",
        )
    except SolverUnavailable as exc:  # the full solve will say so; a start is optional
        log.warning("placed model skipped: %s", str(exc).splitlines()[0])
        return out
    if res.fits:
        out.append((f"XEngine restricted to the placement of {sp.source}", res.schedule))
    return out


# ------------------------------------------------------------------------------ offloading
OFFLOAD_FRACTIONS = (0.1, 0.2, 0.05, 0.3)
"""How far above its own budget the fastest device's greedy schedule may go before units are
offloaded: that fraction of the other devices' budgets, in the order tried. On GPT-2 (12
layers, cpu2+cpu1, 50 %) 0.1 was best (4,272.5 ms against 4,288.3 at 0.05, 4,296.0 at 0.15),
on resnet18 (cpu2+cpu1, 50 %) 0.3 (386.2 ms against 386.8 at 0.2)."""


def offload_starts(inst: Instance, time_limit_s: float) -> list[tuple[str, Schedule]]:
    """Schedules that recompute on the fastest device and keep some values on the others.

    For each fraction f of :data:`OFFLOAD_FRACTIONS`: ``recompute_greedy`` (held) on the
    fastest device alone with its budget plus f of the others' (fewer recomputations), then
    (forward, backward) pairs moved to other devices, the cheapest in time per byte of excess
    first, until every budget holds (:func:`_offload`). Why: the spread's cuts and single moves
    start from half the net on the slow device; this starts from the fast one and moves only
    what the memory needs. On two CPU sub-devices at 50 % it found the first schedules faster
    than the one-device start on the profile's costs (GPT-2 12 layers: 4,272.5 against
    4,314.7 ms; resnet18: 386.2 against 389.4 ms); executed side by side with one device, they
    were not faster on resnet18 or mobilenet_v2 (``experiments/second_device.py``,
    docs/measurements.md). Stops trying fractions after ``time_limit_s``; only schedules that
    fit are returned."""
    from xengine.strategies.registry import load

    if inst.n_devices < 2:
        return []
    t0 = time.perf_counter()
    fast = inst.fastest_device
    others_bytes = int(inst.budgets.sum() - inst.budgets[fast])
    greedy = load("recompute_greedy")
    out = []
    for frac in OFFLOAD_FRACTIONS:
        left_s = time_limit_s - (time.perf_counter() - t0)
        if left_s <= 0:
            break
        budget = int(inst.budget_bytes[fast] + frac * others_bytes)
        res = greedy(inst.only_device(fast, budget), time_limit_s=left_s / 2, hold=True)
        if not res.has_schedule:
            continue
        sched = _offload(inst, res.schedule, fast, t0 + time_limit_s)
        if sched is not None:
            what = f"its budget + {frac:.0%} of the others'"
            out.append(
                (f"recompute_greedy+held on {inst.devices[fast]} ({what}), offloaded", sched)
            )
    return out


def _offload(inst: Instance, single: Schedule, fast: int, deadline: float) -> Schedule | None:
    """``single`` (one device) placed on ``fast``, then, while some budget is exceeded, the
    pair whose move to another device adds the least time per byte of excess it removes; then
    pairs moved back while that is faster and still fits. None when it does not fit in time."""
    unit = units(inst)
    memo = StageMemo(inst)
    unit_dev = np.full(int(unit.max()) + 1, fast, dtype=np.int64)

    def score(ud: np.ndarray):
        return _score(inst, place(single, inst.devices, ud[unit]), memo)

    cur = score(unit_dev)
    while cur is not None and cur[0] > 0 and time.perf_counter() < deadline:
        best = None
        for u, d in _moves(unit_dev, inst.n_devices, away_from=fast):
            if time.perf_counter() > deadline:  # one sweep may be long (800 pairs at 48 layers)
                return None
            trial = unit_dev.copy()
            trial[u] = d
            sc = score(trial)
            if sc is None or sc[0] >= cur[0]:
                continue
            per_byte = (sc[1] - cur[1]) / (cur[0] - sc[0])
            if best is None or per_byte < best[0]:
                best = (per_byte, trial, sc)
        if best is None:
            return None
        _, unit_dev, cur = best
    if cur is None or cur[0] > 0:
        return None
    for u in np.flatnonzero(unit_dev != fast):  # back where it is faster and still fits
        trial = unit_dev.copy()
        trial[u] = fast
        sc = score(trial)
        if sc is not None and sc[0] == 0 and sc[1] < cur[1]:
            unit_dev, cur = trial, sc
    return place(single, inst.devices, unit_dev[unit])


def _moves(unit_dev: np.ndarray, n_devices: int, away_from: int):
    """Every (unit, device) move of a unit still on ``away_from`` to another device."""
    for u in np.flatnonzero(unit_dev == away_from):
        for d in range(n_devices):
            if d != away_from:
                yield int(u), d
