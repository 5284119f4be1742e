"""The stage-cut bound: one frontier step at a time, solved exactly.

Checkmate's stages (Jain et al., MLSys 2020, section 4: stage ``t`` ends by computing node ``t``)
give, for each stage ``t``, a small problem whose optimum any one-device schedule pays:

* at the frontier step of stage ``t`` everything kept for stage ``t + 1`` is on the device,
  with node ``t``'s inputs, value, state and workspace (the frontier relaxation's memory row,
  :mod:`xengine.strategies.frontier`);
* a tensor made by stage ``t`` or earlier and read by a node after ``t`` is either kept across
  the end of stage ``t`` (``k_x = 1``) or its node runs again in a later stage (``r_{p(x)} = 1``):
  nothing else brings it back;
* a node that runs again after ``t`` reads each input from a tensor kept across ``t`` or made
  again after ``t``;
* every node runs once in its own stage, and each node that runs again after ``t`` costs its
  time at least once more.

So, with binaries ``k`` (tensors made by node ``t`` or before) and ``r`` (nodes ``i <= t``)::

    min  sum_i c_i r_i
    s.t. k_x + r_{p(x)} >= 1          x made up to t and read after t        (need)
         k_u + r_{p(u)} >= r_i        u read by i <= t                        (closure)
         sum b_x k_x <= B - foot(t)   x neither read nor made by node t       (memory)

and ``sum_i c_i + opt(t)`` bounds every schedule's time, for every ``t``: a schedule's residency
at the start of ``t + 1`` and its set of nodes run again after ``t`` are a point of the model
that costs no more than its recomputations after ``t``. The frontier relaxation has the same
rows for every stage at once, and its integer points project onto each stage's model, so the
bound holds for it too. Why a separate model: the relaxation's LP spreads a recomputation over
many stages in small fractions, each of which needs its inputs only in that fraction; on
hf_gpt2 (12 layers) at 50 % its LP keeps no residual value across the loss step at all, and
its bound after 150 s stays 2 % under the best schedule. One stage is ``2 t`` binaries and one
knapsack row, which HiGHS solves exactly in under a second; the stage where it binds (the loss
there) gives 2,186.1 ms against the schedule's 2,192.1 (0.27 %; docs/measurements.md).

It sees nothing of memory after the cut and counts a node run again in several stages once,
so where memory binds at many steps (convolutional nets through their backward pass) it is
weaker than the relaxation; the solve reports the larger of the two.

Over several devices (XEngine, Schuler et al. 2022) the model also says where each node runs
up to the cut (``a``) and after it (``x``, and ``r`` for a node up to the cut run again), keeps
a tensor only on a device that made it (a copy lives only while its reader runs), charges a
read from another device the cheapest copy into the reader's device, and has one memory row per
device, node ``t``'s footprint counted where it runs (``f``). Its objective counts every
computation, so with one device it is the model above with every op once added, and over
several each stage's optimum is at least the placement bound's
(:func:`xengine.strategies.bounds.placement_bound_s`: the cut's point, read as a placement, is one
of its points at no more cost).
docs/design.md section 6 has the rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from xengine.problem import Instance
from xengine.solvers import ModelBuilder, SolverOptions, solve
from xengine.solvers.model import MilpModel
from xengine.strategies.frontier import (
    MEM_UNIT_BYTES,
    TIME_UNIT_S,
    Tensors,
    frontier_footprint_bytes,
    kept_across,
    tensors_of,
)

log = logging.getLogger(__name__)

CUT_SHARE = 0.1
"""Share of the time limit a solve gives the stage cut before its relaxation. Enough where it
settles an instance: every binding stage of hf_gpt2 (12 layers, 131 small MILPs) in 3.3 s, of
resnet18 b8 over CPU + H200 in 8-10 s, and it stops at the first stage that proves the start."""


@dataclass
class StageCut:
    """The bound and how it was found. ``bound_s`` is the largest proven optimum over the
    stages solved (``stage`` is that stage's node; ``None`` when none was above every op once,
    which is then the bound), ``above_once_s`` what it adds to every op once on its fastest
    device; ``complete`` says whether every stage where memory binds was solved to optimality
    within the time given."""

    bound_s: float
    stage: int | None
    above_once_s: float
    n_binding: int
    n_solved: int
    complete: bool
    time_s: float

    def record(self, names: list[str]) -> dict:
        """A flat record for the result's ``extra``."""
        return {
            "bound_s": self.bound_s,
            "stage": None if self.stage is None else names[self.stage],
            "above_once_s": self.above_once_s,
            "n_binding_stages": self.n_binding,
            "n_solved": self.n_solved,
            "complete": self.complete,
            "time_s": self.time_s,
        }


@dataclass
class _Cut:
    model: MilpModel
    k: np.ndarray  # (D, n_tensors) k[d, x]: x resident on d when stage t + 1 starts, or -1
    r: np.ndarray  # (D, t + 1) r[d, i]: i runs again on d in a stage after t
    a: np.ndarray  # (D, t + 1) a[d, i]: i runs on d in a stage up to t
    x: np.ndarray  # (D, n) x[d, j] for j > t: j runs on d (-1 for j <= t)
    f: np.ndarray  # (D,) node t runs on d in stage t
    copies: list  # (y, reader variable, variables that make the input available) per copy


def excess_bytes(inst: Instance, ts: Tensors, t: int, last_read: np.ndarray) -> int:
    """How far keeping every tensor that a later node reads overshoots the largest budget at
    stage ``t``'s frontier step (<= 0: on one device the stage forces no recomputation)."""
    needed = np.flatnonzero((ts.prod <= t) & (last_read > t))
    kept = kept_across(needed, ts, t)
    foot = min(frontier_footprint_bytes(inst, ts, t, d) for d in range(inst.n_devices))
    return int(ts.nbytes[kept].sum()) + foot - int(np.max(inst.budgets))


def build_cut(
    inst: Instance,
    ts: Tensors,
    t: int,
    last_read: np.ndarray,
    runs: np.ndarray | None = None,
    copy_ms: np.ndarray | None = None,
) -> _Cut:
    """The model of the module docstring for stage ``t`` over the instance's devices
    (objective in ms, every computation included). ``runs`` (:func:`can_run`) and ``copy_ms``
    (the cheapest copies) are the instance's, computed here unless a caller that builds many
    stages passes them."""
    D, n = inst.n_devices, inst.size
    C = inst.compute_s / TIME_UNIT_S
    copy_ms = _cheapest_copy_ms(inst) if copy_ms is None else copy_ms
    runs = (can_run(inst) if runs is None else runs).astype(float)  # only where it fits
    b = ModelBuilder(f"stage-cut-{inst.graph.name}-{t}")
    made_by_t = np.flatnonzero(ts.prod <= t)
    k = np.full((D, ts.prod.size), -1, dtype=np.int64)
    x = np.full((D, n), -1, dtype=np.int64)
    a = b.add_vars(D * (t + 1), 0.0, runs[:, : t + 1].ravel(), True).reshape(D, t + 1)
    r = b.add_vars(D * (t + 1), 0.0, runs[:, : t + 1].ravel(), True).reshape(D, t + 1)
    ub = runs[:, t + 1 :].ravel()
    x[:, t + 1 :] = b.add_vars(D * (n - t - 1), 0.0, ub, True).reshape(D, n - t - 1)
    k[:, made_by_t] = b.add_vars(D * made_by_t.size, 0.0, 1.0, True).reshape(D, -1)
    f = b.add_vars(D, 0.0, 1.0, True)
    for d in range(D):
        b.add_objective(a[d], C[d, : t + 1])
        b.add_objective(r[d], C[d, : t + 1])
        b.add_objective(x[d, t + 1 :], C[d, t + 1 :])
    _at_least_one(b, "once", a.T)
    _at_least_one(b, "once_after", x[:, t + 1 :].T)
    _at_least_one(b, "frontier", f[None, :])
    for d in range(D):
        _at_most(b, "frontier_ran", f[d : d + 1], a[d, t : t + 1])
        _at_most(b, "kept_made", k[d, made_by_t], a[d, ts.prod[made_by_t]])
    needed = made_by_t[last_read[made_by_t] > t]
    # a tensor read after t is kept or made again on some device: nothing else brings it back
    _at_least_one(b, "need", np.concatenate([k[:, needed], r[:, ts.prod[needed]]]).T)
    copies = _read_rows(b, _reads(ts, t, a, r, x, k), copy_ms)
    _memory_rows(b, inst, ts, t, k, f, made_by_t)
    return _Cut(b.build(), k, r, a, x, f, copies)


def _reads(ts: Tensors, t: int, a, r, x, k) -> list[tuple[int, int, int, int, int, bool]]:
    """Every computation that reads a tensor, per device: (device, the tensor, the
    computation's variable, two variables that have the tensor on the device without a copy
    (-1: none), whether a copy may serve it). A node up to t in a stage up to t: the tensor
    was made on the device in one; run again after t, or a node after t: the tensor was kept
    on the device across t or made there again after t (made up to t), or made there (made
    after t)."""
    out = []
    for i, (us, oks) in enumerate(zip(ts.reads, ts.copyable, strict=True)):
        for u, ok in zip(us, oks, strict=True):
            p = int(ts.prod[u])
            for d in range(a.shape[0]):
                if i <= t:
                    out.append((d, u, a[d, i], a[d, p], -1, ok))
                    out.append((d, u, r[d, i], k[d, u], r[d, p], ok))
                elif p <= t:
                    out.append((d, u, x[d, i], k[d, u], r[d, p], ok))
                else:
                    out.append((d, u, x[d, i], x[d, p], -1, ok))
    return out


def _read_rows(b: ModelBuilder, reads: list, copy_ms: np.ndarray) -> list:
    """``reader <= avail`` for a read no copy may serve; else ``y >= reader - avail`` with a
    copy ``y`` at the cheapest copy's cost (continuous: integral at the optimum, as in the
    placement bound). Returns (y, reader, avail) per copy."""
    if not reads:
        return []
    d, u, reader, av1, av2, ok = (np.array(c) for c in zip(*reads, strict=True))
    n = copy_ms.shape[1]  # tensors past the values are states: never copied
    cost = np.where(u < n, copy_ms[d, np.minimum(u, n - 1)], np.inf)
    copy = ok.astype(bool) & np.isfinite(cost)
    local = ~copy
    m = int(local.sum())
    rows = np.arange(m)
    b.add_rows(
        "local_read",
        m,
        np.r_[rows, rows, rows],
        np.r_[reader[local], av1[local], av2[local]],
        np.r_[-np.ones(m), np.ones(m), np.ones(m)],
        0.0,
        np.inf,
    )
    m = int(copy.sum())
    if not m:
        return []
    y = b.add_vars(m, 0.0, 1.0, False)
    b.add_objective(y, cost[copy])
    rows = np.arange(m)
    b.add_rows(
        "copied_read",
        m,
        np.r_[rows, rows, rows, rows],
        np.r_[y, reader[copy], av1[copy], av2[copy]],
        np.r_[np.ones(m), -np.ones(m), np.ones(m), np.ones(m)],
        0.0,
        np.inf,
    )
    return list(zip(y, reader[copy], av1[copy], av2[copy], strict=True))


def _memory_rows(b, inst, ts, t, k, f, made_by_t) -> None:
    """At the frontier step of t, each device holds what it keeps across the end of stage t
    (what node t neither reads nor makes) and, where node t runs, node t's footprint."""
    xs = kept_across(made_by_t, ts, t)
    for d in range(inst.n_devices):
        foot = frontier_footprint_bytes(inst, ts, t, d) / MEM_UNIT_BYTES
        cols = np.r_[k[d, xs], f[d]]
        vals = np.r_[ts.nbytes[xs] / MEM_UNIT_BYTES, foot]
        limit = float(inst.budgets[d]) / MEM_UNIT_BYTES
        b.add_rows(
            f"memory_{d}", 1, np.zeros(cols.size, dtype=np.int64), cols, vals, -np.inf, limit
        )


def _at_least_one(b, name: str, groups: np.ndarray) -> None:
    """Each row of ``groups`` (variable indices) sums to at least 1."""
    m, w = groups.shape
    b.add_rows(name, m, np.repeat(np.arange(m), w), groups.ravel(), 1.0, 1.0, np.inf)


def _at_most(b, name: str, lhs: np.ndarray, rhs: np.ndarray) -> None:
    """``lhs[i] <= sum(rhs[i])`` for each i (``rhs`` one variable or a row of them)."""
    rhs = rhs.reshape(lhs.size, -1)
    m, w = rhs.shape
    rows = np.arange(m)
    cols = np.concatenate([lhs, rhs.ravel()])
    vals = np.concatenate([-np.ones(m), np.ones(m * w)])
    b.add_rows(name, m, np.concatenate([rows, np.repeat(rows, w)]), cols, vals, 0.0, np.inf)


def can_run(inst: Instance) -> np.ndarray:
    """(D, n) whether node i's inputs, output and workspace fit device d's budget at once."""
    g = inst.graph
    foot = np.stack([g.node_lower_bound_bytes(dv) for dv in inst.devices])
    return foot <= np.asarray(inst.budgets)[:, None]


def _cheapest_copy_ms(inst: Instance) -> np.ndarray:
    """(D, n) the cheapest copy of each value into each device (inf with one device)."""
    D = inst.n_devices
    out = np.full((D, inst.size), np.inf)
    if D > 1:
        CP = inst.copy_s / TIME_UNIT_S
        off = ~np.eye(D, dtype=bool)
        for d in range(D):
            out[d] = CP[off[:, d], d].min(axis=0)
    return out


def last_reads(ts: Tensors, n_tensors: int) -> np.ndarray:
    """The last node that reads each tensor (-1: none)."""
    last = np.full(n_tensors, -1, dtype=np.int64)
    for j, xs in enumerate(ts.reads):
        last[xs] = j  # nodes in index order: the last write wins
    return last


def stage_cut_bound(
    inst: Instance,
    options: SolverOptions | None = None,
    target_s: float | None = None,
) -> StageCut | None:
    """The stage-cut bound of an instance (module docstring), or ``None`` when some cost is
    negative (running an op again could save time, so no bound of this kind holds) or some
    node fits no device (no schedule at all).

    Stages where memory binds are solved in order of how far keeping everything overshoots
    the largest budget, most first, within ``options.time_limit_s`` for all of them; each
    stage's proven bound counts, even when its solve stops at the limit. Stops early once the
    bound reaches ``target_s`` within ``options.rel_gap`` (the best schedule at hand: nothing
    more to prove). With no stage solved it is every op once on its fastest device."""
    options = options or SolverOptions()
    t0 = time.perf_counter()
    runs = can_run(inst)
    if (inst.compute_s < 0).any() or not runs.any(axis=0).all():
        return None
    copy_ms = _cheapest_copy_ms(inst)
    g = inst.graph
    once_ms = float(inst.compute_s.min(axis=0).sum()) / TIME_UNIT_S
    ts = tensors_of(g)
    last_read = last_reads(ts, ts.prod.size)
    excess = np.array([excess_bytes(inst, ts, t, last_read) for t in range(g.size - 1)])
    binding = np.flatnonzero(excess > 0)
    order = binding[np.argsort(-excess[binding], kind="stable")]
    best_ms, best_t, n_solved, complete = once_ms, None, 0, True
    for t in order.tolist():
        left_s = _left_s(options, t0)
        if left_s is not None and left_s <= 0:
            complete = False
            break
        cut = build_cut(inst, ts, t, last_read, runs, copy_ms)
        sr = solve(cut.model, "highs", SolverOptions(time_limit_s=left_s, rel_gap=1e-6))
        n_solved += 1
        complete &= sr.status == "optimal"
        proven = sr.objective if sr.status == "optimal" else sr.best_bound
        if proven is not None and proven > best_ms:
            best_ms, best_t = float(proven), t
        if target_s is not None and _meets(best_ms * TIME_UNIT_S, target_s, options):
            complete = complete and n_solved == order.size
            break
    out = StageCut(
        bound_s=best_ms * TIME_UNIT_S,
        stage=best_t,
        above_once_s=(best_ms - once_ms) * TIME_UNIT_S,
        n_binding=int(order.size),
        n_solved=n_solved,
        complete=complete,
        time_s=time.perf_counter() - t0,
    )
    log.info(
        "stage-cut bound of %s: %.3f ms (stage %s; %d of %d binding stages solved, %.1f s)",
        g.name,
        out.bound_s * 1e3,
        "-" if best_t is None else g.nodes[best_t].name,
        n_solved,
        order.size,
        out.time_s,
    )
    return out


def _left_s(options: SolverOptions, t0: float) -> float | None:
    if options.time_limit_s is None:
        return None
    return options.time_limit_s - (time.perf_counter() - t0)


def _meets(bound_s: float, target_s: float, options: SolverOptions) -> bool:
    return target_s - bound_s <= options.rel_gap * target_s
