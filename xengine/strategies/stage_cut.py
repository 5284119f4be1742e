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


@dataclass
class StageCut:
    """The bound and how it was found. ``bound_s`` is every op once plus the largest proven
    recomputation time over the stages solved (``stage`` is that stage's node, ``None`` when
    no stage needed any); ``complete`` says whether every stage where memory binds was solved
    to optimality within the time given."""

    bound_s: float
    stage: int | None
    recompute_s: float
    n_binding: int
    n_solved: int
    complete: bool
    time_s: float

    def record(self, names: list[str]) -> dict:
        """A flat record for the result's ``extra``."""
        return {
            "bound_s": self.bound_s,
            "stage": None if self.stage is None else names[self.stage],
            "recompute_s": self.recompute_s,
            "n_binding_stages": self.n_binding,
            "n_solved": self.n_solved,
            "complete": self.complete,
            "time_s": self.time_s,
        }


@dataclass
class _Cut:
    model: MilpModel
    k: np.ndarray  # (n_tensors,) variable index of k_x or -1
    r: np.ndarray  # (t + 1,) variable index of r_i


def excess_bytes(inst: Instance, ts: Tensors, t: int, last_read: np.ndarray) -> int:
    """How far keeping every tensor that a later node reads overshoots the budget at stage
    ``t``'s frontier step (<= 0: the stage forces no recomputation)."""
    needed = np.flatnonzero((ts.prod <= t) & (last_read > t))
    kept = kept_across(needed, ts, t)
    foot = frontier_footprint_bytes(inst, ts, t)
    return int(ts.nbytes[kept].sum()) + foot - int(inst.budgets[0])


def build_cut(inst: Instance, ts: Tensors, t: int, last_read: np.ndarray) -> _Cut:
    """The model of the module docstring for stage ``t`` (objective in ms)."""
    n_x = ts.prod.size
    b = ModelBuilder(f"stage-cut-{inst.graph.name}-{t}")
    made_by_t = np.flatnonzero(ts.prod <= t)
    k = np.full(n_x, -1, dtype=np.int64)
    k[made_by_t] = b.add_vars(made_by_t.size, 0.0, 1.0, True)
    r = b.add_vars(t + 1, 0.0, 1.0, True)
    b.add_objective(r, inst.compute_s[0][: t + 1] / TIME_UNIT_S)
    needed = made_by_t[last_read[made_by_t] > t]
    m = needed.size
    rows = np.arange(m)
    b.add_rows("need", m, np.r_[rows, rows], np.r_[k[needed], r[ts.prod[needed]]], 1.0, 1.0, np.inf)
    pairs = [(i, u) for i in range(t + 1) for u in ts.reads[i]]
    if pairs:
        i, u = (np.array(c, dtype=np.int64) for c in zip(*pairs, strict=True))
        m = i.size
        rows = np.arange(m)
        b.add_rows(
            "closure",
            m,
            np.r_[rows, rows, rows],
            np.r_[k[u], r[ts.prod[u]], r[i]],
            np.r_[np.ones(m), np.ones(m), -np.ones(m)],
            0.0,
            np.inf,
        )
    xs = kept_across(made_by_t, ts, t)
    room = float(inst.budgets[0]) - frontier_footprint_bytes(inst, ts, t)
    b.add_rows(
        "memory",
        1,
        np.zeros(xs.size, dtype=np.int64),
        k[xs],
        ts.nbytes[xs] / MEM_UNIT_BYTES,
        -np.inf,
        room / MEM_UNIT_BYTES,
    )
    return _Cut(b.build(), k, r)


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
    """The stage-cut bound of a one-device instance (module docstring), or ``None`` when some
    cost is negative (running an op again could save time, so no bound of this kind holds).

    Stages where memory binds are solved in order of how far keeping everything overshoots
    the budget, most first, within ``options.time_limit_s`` for all of them; each stage's
    proven bound counts, even when its solve stops at the limit. Stops early once the bound
    reaches ``target_s`` within ``options.rel_gap`` (the best schedule at hand: nothing more
    to prove)."""
    options = options or SolverOptions()
    t0 = time.perf_counter()
    if (inst.compute_s[0] < 0).any():
        return None
    g = inst.graph
    once_s = float(inst.compute_s[0].sum())
    ts = tensors_of(g)
    last_read = last_reads(ts, ts.prod.size)
    excess = np.array([excess_bytes(inst, ts, t, last_read) for t in range(g.size - 1)])
    binding = np.flatnonzero(excess > 0)
    order = binding[np.argsort(-excess[binding], kind="stable")]
    best_ms, best_t, n_solved, complete = 0.0, None, 0, True
    for t in order.tolist():
        left_s = _left_s(options, t0)
        if left_s is not None and left_s <= 0:
            complete = False
            break
        cut = build_cut(inst, ts, t, last_read)
        sr = solve(cut.model, "highs", SolverOptions(time_limit_s=left_s, rel_gap=1e-6))
        n_solved += 1
        complete &= sr.status == "optimal"
        proven = sr.objective if sr.status == "optimal" else sr.best_bound
        if proven is not None and proven > best_ms:
            best_ms, best_t = float(proven), t
        if target_s is not None and _meets(once_s + best_ms * TIME_UNIT_S, target_s, options):
            complete = complete and n_solved == order.size
            break
    out = StageCut(
        bound_s=once_s + best_ms * TIME_UNIT_S,
        stage=best_t,
        recompute_s=best_ms * TIME_UNIT_S,
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
