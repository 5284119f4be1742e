"""The frontier relaxation: a small MILP whose optimum bounds any one-device schedule's time.

Checkmate's MILP (Jain et al., MLSys 2020, eq. 1-9; :mod:`xengine.strategies.formulation` with one
device) tracks memory after every operation of every stage, through the FREE and U variables. Its LP
relaxation is weak: on resnet18 b4 at 70 % it barely leaves the keep-everything time, and HiGHS
moves its bound by 1 ms in 120 s (docs/measurements.md, "The frontier relaxation"). This model keeps
only what can be stated without the order of operations inside a stage:

* ``H[t, x]``: tensor ``x`` (a value, or a forward op's autograd state) is resident when stage
  ``t`` starts; ``C[t, i]``: node ``i < t`` is computed again in stage ``t``.
* **need**: the frontier node ``t`` reads ``x``: ``H[t, x] + C[t, p(x)] >= 1`` (``p(x)``, the node
  that makes ``x``);
* **closure**: a recomputed node reads ``x``: ``H[t, x] + C[t, p(x)] >= C[t, i]``;
* **carry**: ``x`` is resident at ``t + 1`` only if it was at ``t`` or was made in stage ``t``:
  ``H[t+1, x] <= H[t, x] + C[t, p(x)]`` (free when ``p(x) = t``);
* **frontier memory**: when stage ``t`` computes node ``t`` (its last step), everything kept for
  stage ``t + 1`` that exists already, node ``t``'s inputs, its value, its state and its
  workspace are on the device at once: ``sum b_x H[t+1, x]`` (over ``x`` neither read nor made
  by ``t``) ``+ bytes(inputs) + out + state + workspace <= budget``.

The objective is ``sum_i c_i`` (every node's first computation, in its own stage) ``+ sum c_i
C[t, i]``. Every valid schedule of the simulator (docs/design.md section 5) gives a point of this
model with the same objective (``H = S``, ``C = R`` below the diagonal; see :meth:`assignment`),
so its optimum, and the solver's bound on it, are lower bounds on Checkmate's optimum. What
it drops is the memory of the recomputation steps, so its solution is not always a schedule:
its residency ``S = H``, with ``R`` derived by Checkmate's pass, is one, and the simulator says
whether that fits. Measured on
resnet18 b4 at 70 % it does, and it beats the best schedule the full MILP finds in 120 s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.solvers import ModelBuilder, ProgressFn, SolverOptions, solve
from xengine.solvers.model import MilpModel

log = logging.getLogger(__name__)

MEM_UNIT_BYTES = 2**20
"""Memory rows are written in MiB, which keeps their coefficients near 1."""
TIME_UNIT_S = 1e-3
"""The objective is written in ms."""
FRONTIER_SHARE = 0.5
"""Share of the time limit the frontier relaxation may use before Checkmate's full MILP starts
(``baselines/checkmate.py``)."""


@dataclass
class FrontierModel:
    inst: Instance
    model: MilpModel
    Hix: np.ndarray  # (T, n_tensors) variable index or -1
    Cix: np.ndarray  # (T, n) variable index or -1
    prod: np.ndarray  # (n_tensors,) the node that makes each tensor

    def assignment(self, sched: Schedule) -> np.ndarray:
        """The point of this model that a valid one-device schedule gives (its residency and
        its recomputations); its objective is the schedule's simulated time."""
        g = self.inst.graph
        n = g.size
        resident = np.concatenate(
            [sched.S[0], sched.states_for(g)[0][:, self.prod[n:]]], axis=1
        ).astype(float)
        x = np.zeros(self.model.n_vars)
        for ix, val in ((self.Hix, resident), (self.Cix, sched.R[0].astype(float))):
            mask = ix >= 0
            x[ix[mask]] = val[mask]
        return x

    @staticmethod
    def seconds(value: float) -> float:
        """A value of the objective (ms) in seconds."""
        return float(value) * TIME_UNIT_S

    def residency_from(self, x: np.ndarray) -> np.ndarray:
        """``S`` (T, n) read from a solution: the values it keeps. With Checkmate's pass
        (:func:`xengine.checkpoints.solve_r_opt`, which derives the least ``R`` and drops residents
        nobody reads) it is a schedule; whether that fits is the simulator's call."""
        H = self.Hix[:, : self.inst.graph.size]
        return np.where(H >= 0, x[np.maximum(H, 0)] > 0.5, False)


@dataclass(frozen=True)
class Tensors:
    """What the relaxations keep track of: every node's value (index = node), then the
    autograd state of every forward op that has one."""

    prod: np.ndarray  # (n_tensors,) the node that makes each tensor
    nbytes: np.ndarray  # (n_tensors,) its size
    reads: list[list[int]]  # per node, the tensors it reads (values, then its state)
    made: list[list[int]]  # per node, the tensors it makes (its value, then its state)
    copyable: list[list[bool]]  # per node and read: may a copy from another device serve it


def tensors_of(g) -> Tensors:
    """The tensors of graph ``g`` (:class:`Tensors`)."""
    n = g.size
    state_of = np.flatnonzero(g.state_reader >= 0)
    prod = np.concatenate([np.arange(n), state_of]).astype(np.int64)
    slot = {int(v): n + k for k, v in enumerate(state_of)}
    nbytes = np.concatenate([g.output_bytes, g.state_bytes[state_of]]).astype(np.int64)
    reads = [[e.src for e in g.in_edges[i]] for i in range(n)]
    copyable = [[bool(e.copyable) for e in g.in_edges[i]] for i in range(n)]
    for j, v in enumerate(g.state_source.tolist()):
        if v >= 0:
            reads[j].append(slot[v])
            copyable[j].append(False)  # a state stays on the device that made it
    made = [[t] for t in range(n)]
    for x in range(n, prod.size):
        made[int(prod[x])].append(x)
    return Tensors(prod, nbytes, reads, made, copyable)


def frontier_footprint_bytes(inst: Instance, ts: Tensors, t: int, device: int = 0) -> int:
    """What the frontier step of stage ``t`` holds on a device that runs it, whatever is kept:
    node ``t``'s inputs, its value, its state and its workspace there."""
    reads = list(set(ts.reads[t]))
    made = ts.made[t]
    ws = inst.workspace_bytes[device][t]
    return int(ts.nbytes[reads].sum() + ts.nbytes[made].sum() + ws)


def kept_across(xs: np.ndarray, ts: Tensors, t: int) -> np.ndarray:
    """Of the tensors ``xs``, those whose keeping across the end of stage ``t`` adds to its
    frontier step's memory: all but the ones node ``t`` reads or makes (already in
    :func:`frontier_footprint_bytes`)."""
    fixed = np.array(sorted(set(ts.reads[t]) | set(ts.made[t])), dtype=np.int64)
    return xs[~np.isin(xs, fixed)]


def build_frontier(inst: Instance) -> FrontierModel:
    """The model above for a one-device instance (Checkmate's stages: ``T = n``)."""
    if inst.n_devices != 1:
        raise ValueError("the frontier relaxation takes one device")
    g = inst.graph
    n = g.size
    ts = tensors_of(g)
    prod, reads = ts.prod, ts.reads
    read_by_someone = np.zeros(prod.size, dtype=bool)
    for r in reads:
        read_by_someone[r] = True

    b = ModelBuilder(f"frontier-{g.name}")
    nx = prod.size
    # H[t, x] for x made before stage t and read by someone; C[t, i] for i < t
    Hmask = (prod[None, :] < np.arange(n)[:, None]) & read_by_someone[None, :]
    Hix = np.full((n, nx), -1, dtype=np.int64)
    Hix[Hmask] = b.add_vars(int(Hmask.sum()), 0.0, 1.0, integer=True)
    Cmask = np.tril(np.ones((n, n), dtype=bool), k=-1)
    Cix = np.full((n, n), -1, dtype=np.int64)
    # with H integer, C's least values are 0 or 1 anyway (every row bounds a C from below by an
    # integer expression), but declared integer HiGHS cuts on it: on resnet18 at 70 % the bound
    # after 30 s was 297.70 ms, against 288.35 with C continuous
    Cix[Cmask] = b.add_vars(int(Cmask.sum()), 0.0, 1.0, integer=True)
    cost_ms = inst.compute_s[0] / TIME_UNIT_S
    t_idx, i_idx = np.nonzero(Cmask)
    b.add_objective(Cix[t_idx, i_idx], cost_ms[i_idx])

    _need_rows(b, Hix, Cix, prod, reads)
    _closure_rows(b, Hix, Cix, prod, reads)
    _carry_rows(b, Hix, Cix, prod)
    _frontier_memory_rows(b, inst, Hix, ts)
    model = b.build()
    model.offset = float(inst.compute_s[0].sum()) / TIME_UNIT_S  # every node once
    return FrontierModel(inst, model, Hix, Cix, prod)


def _need_rows(b: ModelBuilder, Hix, Cix, prod, reads) -> None:
    """The frontier node reads x: x is resident or made again in its stage."""
    t, x = zip(*[(t, x) for t in range(1, len(reads)) for x in reads[t]], strict=True)
    t, x = np.array(t), np.array(x)
    k = t.size
    rows = np.arange(k)
    b.add_rows("need", k, np.r_[rows, rows], np.r_[Hix[t, x], Cix[t, prod[x]]], 1.0, 1.0, np.inf)


def _closure_rows(b: ModelBuilder, Hix, Cix, prod, reads) -> None:
    """A node computed again reads x: x is resident or made again in the same stage."""
    n = len(reads)
    i_r, x_r = zip(*[(i, x) for i in range(n) for x in reads[i]], strict=True)
    i_r, x_r = np.array(i_r), np.array(x_r)
    t = np.concatenate([np.arange(i + 1, n) for i in i_r]) if i_r.size else np.zeros(0, int)
    reps = n - 1 - i_r
    i, x = np.repeat(i_r, reps), np.repeat(x_r, reps)
    k = t.size
    rows = np.arange(k)
    b.add_rows(
        "closure",
        k,
        np.r_[rows, rows, rows],
        np.r_[Hix[t, x], Cix[t, prod[x]], Cix[t, i]],
        np.r_[np.ones(k), np.ones(k), -np.ones(k)],
        0.0,
        np.inf,
    )


def _carry_rows(b: ModelBuilder, Hix, Cix, prod) -> None:
    """Resident at t + 1 only if resident at t or made in stage t (its own stage is free)."""
    t, x = np.nonzero(Hix[1:-1] >= 0)
    t = t + 1
    keep = prod[x] < t  # x made in stage t itself may be kept without condition
    t, x = t[keep], x[keep]
    k = t.size
    rows = np.arange(k)
    b.add_rows(
        "carry",
        k,
        np.r_[rows, rows, rows],
        np.r_[Hix[t + 1, x], Hix[t, x], Cix[t, prod[x]]],
        np.r_[np.ones(k), -np.ones(k), -np.ones(k)],
        -np.inf,
        0.0,
    )


def _frontier_memory_rows(b: ModelBuilder, inst: Instance, Hix, ts: Tensors) -> None:
    """Memory at each frontier step: what is kept for the next stage and exists already, plus
    the step's inputs, output, state and workspace (docs/design.md section 5's step memory)."""
    n = inst.graph.size
    budget = float(inst.budgets[0])
    rows, cols, vals, ub = [], [], [], []
    for t in range(n - 1):
        xs = kept_across(np.flatnonzero(Hix[t + 1] >= 0), ts, t)
        rows.append(np.full(xs.size, t))
        cols.append(Hix[t + 1, xs])
        vals.append(ts.nbytes[xs] / MEM_UNIT_BYTES)
        ub.append((budget - frontier_footprint_bytes(inst, ts, t)) / MEM_UNIT_BYTES)
    b.add_rows(
        "frontier_memory",
        n - 1,
        np.concatenate(rows),
        np.concatenate(cols),
        np.concatenate(vals),
        -np.inf,
        np.array(ub),
    )


@dataclass
class FrontierResult:
    """What the relaxation gave: a proven lower bound on any schedule's time (``bound_s``,
    ``None`` when the solver proved none), and the residency ``S`` of its best solution
    (``None`` when there was none; see :meth:`FrontierModel.residency_from`). Over several
    devices (:mod:`xengine.strategies.device_frontier`) ``S`` is ``None`` and ``schedule`` the
    valid schedule read from the solution (whether it fits is the simulator's call)."""

    status: str
    bound_s: float | None
    objective_s: float | None
    S: np.ndarray | None
    solve_time_s: float
    build_time_s: float
    n_vars: int
    n_rows: int
    extra: dict = field(default_factory=dict)
    schedule: Schedule | None = None


def solve_relaxation(
    model: MilpModel,
    solver: str,
    options: SolverOptions | None,
    x0: np.ndarray | None,
    progress: ProgressFn | None,
):
    """Solve a frontier relaxation (objective in ms) from the point ``x0`` of a valid schedule
    (dropped, with a warning, if it violates a row: it never should); ``progress`` gets
    seconds. Returns the solver's result and the proven bound in seconds (``None`` if none)."""
    if x0 is not None and model.max_violation(x0) > 1e-6:
        log.warning(
            "the start violates the frontier relaxation by %.3g; not used", model.max_violation(x0)
        )
        x0 = None

    def shown(el: float, obj: float | None, bound: float | None) -> None:
        if progress is not None:
            progress(
                el,
                None if obj is None else obj * TIME_UNIT_S,
                None if bound is None else bound * TIME_UNIT_S,
            )

    sr = solve(model, solver, options or SolverOptions(), warm_start=x0, progress=shown)
    bound = None if sr.best_bound is None else sr.best_bound * TIME_UNIT_S
    if sr.status == "optimal" and sr.objective is not None:
        bound = sr.objective * TIME_UNIT_S if bound is None else bound
    return sr, bound


def solve_frontier(
    inst: Instance,
    solver: str = "highs",
    options: SolverOptions | None = None,
    start: Schedule | None = None,
    progress: ProgressFn | None = None,
) -> FrontierResult:
    """Solve the frontier relaxation; ``start`` (a valid schedule) is its MIP start.

    The bound is the solver's (its proven bound when stopped by the limit). ``progress`` is
    called as for any solve, with objective and bound in seconds."""
    t0 = time.perf_counter()
    fm = build_frontier(inst)
    build_s = time.perf_counter() - t0
    x0 = None if start is None else fm.assignment(start)
    sr, bound = solve_relaxation(fm.model, solver, options, x0, progress)
    log.info(
        "frontier relaxation of %s: %s in %.1f s, bound %s, %d vars, %d rows",
        inst.graph.name,
        sr.status,
        sr.solve_time_s,
        "-" if bound is None else f"{bound * 1e3:.3f} ms",
        fm.model.n_vars,
        fm.model.n_rows,
    )
    return FrontierResult(
        status=sr.status,
        bound_s=bound,
        objective_s=None if sr.objective is None else fm.seconds(sr.objective),
        S=None if sr.x is None else fm.residency_from(sr.x),
        solve_time_s=sr.solve_time_s,
        build_time_s=build_s,
        n_vars=fm.model.n_vars,
        n_rows=fm.model.n_rows,
        extra={"solver_message": sr.message},
    )
