"""The frontier relaxation over several devices: a lower bound for XEngine's problem.

The one-device relaxation (:mod:`xengine.strategies.frontier`) drops the order of operations
inside a stage and keeps memory only at the frontier step; on one device its bound is within
1-2 % of the best schedules on GPT-2 graphs, where the LP relaxation of the exact MILP is 10 %
below. XEngine's exact MILP over two devices has the same weak relaxation: on resnet18 b8 (CPU +
H200 costs, 55 %) HiGHS's bound after 120 s is 19 % below its start. This module writes the same
relaxation with a device index (Schuler et al., TACO 2022, section 4: every node runs on one device
or more per stage, a value read on a device that does not hold it is copied from one that does):

* ``H[d, t, x]``: tensor ``x`` (value or autograd state) is resident on ``d`` when stage ``t``
  starts; ``C[d, t, i]`` (``i <= t``): node ``i`` is computed on ``d`` in stage ``t`` (the
  diagonal is the frontier); ``K[d, t, x]``: value ``x`` is copied into ``d`` in stage ``t`` (at
  least once).
* **frontier**: ``sum_d C[d, t, t] >= 1``;
* **reads**: node ``i`` computed on ``d`` in stage ``t`` reads ``x``:
  ``H[d, t, x] + C[d, t, p(x)] + K[d, t, x] >= C[d, t, i]`` (no ``K`` for a state or a value
  edge that cannot be copied);
* **source**: a copy needs a holder elsewhere: ``K[d, t, x] <= sum_{a != d} H[a, t, x] +
  C[a, t, p(x)]``;
* **carry**: ``H[d, t + 1, x] <= H[d, t, x] + C[d, t, p(x)]`` (``<= C[d, t, t]`` for what
  stage ``t``'s frontier makes);
* **frontier memory**, on every device ``d`` at the frontier step of stage ``t``: what ``d``
  keeps for stage ``t + 1`` (it exists already: nodes run in index order, the frontier last)
  plus, where the frontier runs on ``d``, its inputs, value, state and workspace there:
  ``sum b_x H[d, t+1, x] + foot_d(t) C[d, t, t] <= B_d`` (``x`` neither read nor made by ``t``);
* a node whose footprint exceeds ``B_d`` is never computed on ``d``.

The objective is every computation's time on its device plus, per copy, the cheapest copy into
its device. A valid schedule of the simulator (docs/design.md section 5) gives a point of this
model (``H = S``, ``C = R``, ``K`` where a read was copied) whose objective is at most its
simulated time (two copies of one value into one device in a stage count once), so the model's
optimum and its solver's bound are lower bounds on XEngine's optimum. With one device it is the
one-device relaxation with the frontier written as a variable fixed at one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.solvers import ModelBuilder, ProgressFn, SolverOptions
from xengine.solvers.model import MilpModel
from xengine.strategies.frontier import (
    MEM_UNIT_BYTES,
    TIME_UNIT_S,
    FrontierResult,
    solve_relaxation,
    tensors_of,
)

log = logging.getLogger(__name__)


@dataclass
class DeviceFrontierModel:
    inst: Instance
    model: MilpModel
    Hix: np.ndarray  # (D, T, n_tensors) variable index or -1
    Cix: np.ndarray  # (D, T, n) variable index or -1, i <= t
    Kix: np.ndarray  # (D, T, n) variable index or -1: value copied into d in stage t
    prod: np.ndarray  # (n_tensors,) the node that makes each tensor
    reads: list[list[int]]  # per node: the tensors it reads
    copyable: list[list[bool]]  # per node and read: may it come by copy

    def assignment(self, sched: Schedule) -> np.ndarray:
        """The point of this model that a valid schedule gives; its objective is at most the
        schedule's simulated time (equal unless a value is copied twice into one device in
        one stage)."""
        g = self.inst.graph
        n = g.size
        R = sched.R.astype(bool)
        resident = np.concatenate([sched.S, sched.states_for(g)[:, :, self.prod[n:]]], axis=2)
        here = resident[:, :, :n] | R  # (D, T, n): the value is on d at its reads in stage t
        copied = np.zeros_like(R)
        for i in range(n):
            for x, ok in zip(self.reads[i], self.copyable[i], strict=True):
                if ok:
                    copied[:, :, x] |= R[:, :, i] & ~here[:, :, x]
        x = np.zeros(self.model.n_vars)
        for ix, val in ((self.Hix, resident), (self.Cix, R), (self.Kix, copied)):
            mask = ix >= 0
            x[ix[mask]] = val[mask]
        return x

    def schedule_from(self, x: np.ndarray) -> Schedule:
        """A schedule the simulator accepts, read from a solution (:func:`complete_schedule`
        on its computations and residency). Its time is at most the solution's objective plus
        what order and memory force: where the solution is a schedule, it is that schedule."""
        g = self.inst.graph
        n = g.size

        def chosen(ix: np.ndarray) -> np.ndarray:
            return np.where(ix >= 0, x[np.maximum(ix, 0)] > 0.5, False)

        H = chosen(self.Hix)
        states = np.zeros((self.inst.n_devices, n, n), dtype=bool)
        states[:, :, self.prod[n:]] = H[:, :, n:]
        return complete_schedule(g, self.inst.devices, chosen(self.Cix), H[:, :, :n], states)


def complete_schedule(g, devices, compute, keep, keep_state) -> Schedule:
    """A valid schedule (docs/design.md section 5) from a relaxation's computations
    ``compute`` and residency ``keep`` / ``keep_state`` (each (D, T, n), boolean).

    The relaxation ignores the order inside a stage, so its point need not be a schedule: a
    value it keeps may not exist, a state it keeps may be made again in the stage, an input
    it reads may have no holder. Stage by stage this keeps only what the previous stage had,
    runs the relaxation's computations in index order (a value or state already on the device
    is not made again), and makes every missing input on demand: on a device where the
    relaxation computes it in this stage, else on the reader's. Last, residents that nobody
    reads in their stage and that are not kept on are dropped (:func:`_drop_unread`): they
    would occupy memory to the stage's end for nothing."""
    D, T, n = compute.shape
    R = np.zeros((D, T, n), dtype=bool)
    S = np.zeros_like(R)
    A = np.zeros_like(R)
    reader = g.state_reader
    source = g.state_source
    for t in range(T):
        if t > 0:
            S[:, t, :t] = keep[:, t, :t] & (R[:, t - 1, :t] | S[:, t - 1, :t])
            A[:, t, :t] = (
                keep_state[:, t, :t] & (R[:, t - 1, :t] | A[:, t - 1, :t]) & (reader[:t] >= t)
            )

        def run(v: int, d: int, t: int = t) -> None:
            if R[d, t, v]:
                return
            S[d, t, v] = A[d, t, v] = False  # made anew here: a kept copy would be an error
            for e in g.in_edges[v]:
                u = e.src
                if S[d, t, u] or R[d, t, u]:
                    continue
                if e.copyable and (S[:, t, u] | R[:, t, u]).any():
                    continue  # the simulator copies it from a holder
                where = np.flatnonzero(compute[:, t, u])
                here = not e.copyable or where.size == 0 or compute[d, t, u]
                run(u, d if here else int(where[0]))
            u = int(source[v])
            if u >= 0 and not (A[d, t, u] or R[d, t, u]):
                run(u, d)  # a state is never copied
            R[d, t, v] = True

        for i in range(t + 1):
            for d in np.flatnonzero(compute[:, t, i]).tolist():
                state_ok = reader[i] < 0 or reader[i] < t or A[d, t, i]
                if i < t and S[d, t, i] and state_ok:
                    continue  # already there: nothing to make
                run(i, d)
        if not R[:, t, t].any():
            run(t, int(np.argmax(compute[:, t, t])))
    return _drop_unread(g, Schedule(tuple(devices), R, S, A if g.has_states else None))


def _drop_unread(g, sched: Schedule) -> Schedule:
    """``sched`` without the residents that no computation of their stage reads (on any
    device) and that the next stage does not keep, last stage first."""
    R, S = sched.R, sched.S.copy()
    A = None if sched.S_state is None else sched.S_state.copy()
    D, T, n = R.shape
    ran = R.any(axis=0)  # (T, n): computed somewhere in the stage
    read = np.zeros((T, n), dtype=bool)
    for x, readers in enumerate(g.successors):
        if readers:
            read[:, x] = ran[:, list(readers)].any(axis=1)
    reader = g.state_reader
    has = reader >= 0
    nothing = np.zeros((D, n), dtype=bool)
    for t in range(T - 1, -1, -1):
        S[:, t] &= read[t][None, :] | (S[:, t + 1] if t + 1 < T else nothing)
        if A is not None:
            reads_state = np.zeros((D, n), dtype=bool)
            reads_state[:, has] = R[:, t, reader[has]]
            A[:, t] &= reads_state | (A[:, t + 1] if t + 1 < T else nothing)
    return Schedule(sched.devices, R, S, A)


def build_device_frontier(inst: Instance, steps: bool = False) -> DeviceFrontierModel:
    """The model above for an instance of any number of devices (``T = n`` stages); with
    ``steps`` the memory rows hold at every step, not only the frontier's."""
    g = inst.graph
    n, D = g.size, inst.n_devices
    ts = tensors_of(g)
    prod, nbytes, reads, copyable = ts.prod, ts.nbytes, ts.reads, ts.copyable
    nx = prod.size
    read_by_someone = np.zeros(nx, dtype=bool)
    for r in reads:
        read_by_someone[r] = True
    can_copy = np.zeros(n, dtype=bool)  # a value some reader may receive by copy
    for r, ok in zip(reads, copyable, strict=True):
        for x, c in zip(r, ok, strict=True):
            if c:  # only value edges may be copyable
                can_copy[x] = True
    foot = np.stack([g.node_lower_bound_bytes(d) for d in inst.devices])  # (D, n)
    fits = foot <= inst.budgets[:, None]

    b = ModelBuilder(f"frontier-D{D}-{g.name}")
    stage = np.arange(n)[:, None]
    Hmask = np.broadcast_to((prod[None, :] < stage) & read_by_someone[None, :], (D, n, nx))
    Hix = np.full((D, n, nx), -1, dtype=np.int64)
    Hix[Hmask] = b.add_vars(int(Hmask.sum()), 0.0, 1.0, integer=True)
    Cmask = np.tril(np.ones((n, n), dtype=bool))[None, :, :] & fits[:, None, :]
    Cix = np.full((D, n, n), -1, dtype=np.int64)
    Cix[Cmask] = b.add_vars(int(Cmask.sum()), 0.0, 1.0, integer=True)
    Kmask = np.zeros((D, n, n), dtype=bool)
    if D > 1:
        Kmask[:] = (np.arange(n)[None, :] < stage) & can_copy[None, :]
    Kix = np.full((D, n, n), -1, dtype=np.int64)
    Kix[Kmask] = b.add_vars(int(Kmask.sum()), 0.0, 1.0, integer=False)

    d_idx, _, i_idx = np.nonzero(Cmask)
    b.add_objective(Cix[Cmask], inst.compute_s[d_idx, i_idx] / TIME_UNIT_S)
    if D > 1:
        cheapest = np.full((D, n), np.inf)  # the cheapest copy into d
        for a in range(D):
            for d in range(D):
                if a != d:
                    cheapest[d] = np.minimum(cheapest[d], inst.copy_s[a, d])
        d_idx, _, x_idx = np.nonzero(Kmask)
        b.add_objective(Kix[Kmask], cheapest[d_idx, x_idx] / TIME_UNIT_S)

    m = DeviceFrontierModel(inst, None, Hix, Cix, Kix, prod, reads, copyable)  # type: ignore[arg-type]
    _frontier_rows(b, m)
    _read_rows(b, m)
    _source_rows(b, m)
    _carry_rows(b, m)
    _memory_rows(b, m, nbytes, foot, steps)
    m.model = b.build()
    return m


def _frontier_rows(b: ModelBuilder, m: DeviceFrontierModel) -> None:
    """Node t runs in stage t on some device."""
    D, n = m.Cix.shape[0], m.Cix.shape[1]
    diag = m.Cix[:, np.arange(n), np.arange(n)]  # (D, n)
    rows = np.broadcast_to(np.arange(n), (D, n))
    ok = diag >= 0
    b.add_rows("frontier", n, rows[ok], diag[ok], 1.0, 1.0, np.inf)


def _read_rows(b: ModelBuilder, m: DeviceFrontierModel) -> None:
    """A node computed on d reads x: x is resident on d, made on d in the stage, or copied in."""
    D, n = m.Cix.shape[0], m.Cix.shape[1]
    i_r, x_r, ok_r = [], [], []
    for i, (r, ok) in enumerate(zip(m.reads, m.copyable, strict=True)):
        i_r += [i] * len(r)
        x_r += r
        ok_r += ok
    i_r, x_r = np.array(i_r, dtype=np.int64), np.array(x_r, dtype=np.int64)
    t = np.concatenate([np.arange(i, n) for i in i_r]) if i_r.size else np.zeros(0, np.int64)
    reps = n - i_r
    i, x, ok = np.repeat(i_r, reps), np.repeat(x_r, reps), np.repeat(np.array(ok_r, bool), reps)
    d = np.repeat(np.arange(D), t.size)
    t, i, x, ok = np.tile(t, D), np.tile(i, D), np.tile(x, D), np.tile(ok, D)
    c_read = m.Cix[d, t, i]
    keep = c_read >= 0  # the reader never runs on d: no row
    d, t, i, x, ok, c_read = d[keep], t[keep], i[keep], x[keep], ok[keep], c_read[keep]
    k = t.size
    rows = np.arange(k)
    copy = np.where(ok, m.Kix[d, t, np.where(ok, x, 0)], -1)  # a state never comes by copy
    cols = [m.Hix[d, t, x], m.Cix[d, t, m.prod[x]], copy, c_read]
    vals = [np.ones(k), np.ones(k), np.ones(k), -np.ones(k)]
    _add(b, "reads", k, rows, cols, vals, 0.0, np.inf)


def _source_rows(b: ModelBuilder, m: DeviceFrontierModel) -> None:
    """A copy into d needs the value on another device in that stage."""
    D = m.Kix.shape[0]
    d, t, x = np.nonzero(m.Kix >= 0)
    k = t.size
    if not k:
        return
    rows = np.arange(k)
    cols, vals = [m.Kix[d, t, x]], [np.ones(k)]
    for shift in range(1, D):
        a = (d + shift) % D
        cols += [m.Hix[a, t, x], m.Cix[a, t, m.prod[x]]]
        vals += [-np.ones(k), -np.ones(k)]
    _add(b, "copy_source", k, rows, cols, vals, -np.inf, 0.0)


def _carry_rows(b: ModelBuilder, m: DeviceFrontierModel) -> None:
    """Resident on d at t + 1 only if resident on d at t or made on d in stage t."""
    d, t, x = np.nonzero(m.Hix[:, 1:] >= 0)
    t = t + 1  # H[d, t, x] exists for t >= 1; the row is about t -> t + 1
    keep = t + 1 < m.Hix.shape[1]
    d, t, x = d[keep], t[keep], x[keep]
    k = t.size
    rows = np.arange(k)
    # H[d,t,x] exists only when x was made before t; for x made in stage t it is -1 here
    cols = [m.Hix[d, t + 1, x], m.Hix[d, t, x], m.Cix[d, t, m.prod[x]]]
    vals = [np.ones(k), -np.ones(k), -np.ones(k)]
    _add(b, "carry", k, rows, cols, vals, -np.inf, 0.0)
    # what the frontier of stage t makes and stage t + 1 keeps
    D, n = m.Hix.shape[0], m.Hix.shape[1]
    xs = np.flatnonzero(m.prod < n - 1)
    d, x = np.repeat(np.arange(D), xs.size), np.tile(xs, D)
    t = m.prod[x]
    h = m.Hix[d, t + 1, x]
    keep = h >= 0
    d, t, x, h = d[keep], t[keep], x[keep], h[keep]
    k = t.size
    rows = np.arange(k)
    _add(b, "carry_new", k, rows, [h, m.Cix[d, t, t]], [np.ones(k), -np.ones(k)], -np.inf, 0.0)


def _memory_rows(
    b: ModelBuilder, m: DeviceFrontierModel, nbytes, foot, steps: bool = False
) -> None:
    """Each device's memory at each frontier step (the module docstring's row); with ``steps``
    also at every step (t, i < t): what d keeps for t + 1 and was made before i exists then
    (nodes run in index order), plus i's footprint where i runs on d."""
    inst = m.inst
    D, n = m.Cix.shape[0], m.Cix.shape[1]
    made: dict[int, list[int]] = {t: [t] for t in range(n)}
    for x in range(n, m.prod.size):
        made[int(m.prod[x])].append(x)
    rows, cols, vals, ub = [], [], [], []
    r = 0
    for d in range(D):
        budget = float(inst.budgets[d])
        for t in range(n - 1):
            kept = np.flatnonzero(m.Hix[d, t + 1] >= 0)
            for i in range(t + 1) if steps else (t,):
                c = m.Cix[d, t, i]
                if i < t and c < 0:
                    continue
                fixed = set(m.reads[i]) | set(made[i])
                xs = kept[m.prod[kept] < i] if i < t else kept
                xs = xs[[x not in fixed for x in xs.tolist()]] if xs.size else xs
                rows.append(np.full(xs.size + (c >= 0), r))
                cols.append(np.r_[m.Hix[d, t + 1, xs], [c] if c >= 0 else []].astype(np.int64))
                vals.append(np.r_[nbytes[xs], [foot[d, i]] if c >= 0 else []] / MEM_UNIT_BYTES)
                ub.append(budget / MEM_UNIT_BYTES)
                r += 1
    b.add_rows(
        "frontier_memory",
        r,
        np.concatenate(rows),
        np.concatenate(cols),
        np.concatenate(vals),
        -np.inf,
        np.array(ub),
    )


def _add(b: ModelBuilder, name, k, rows, cols, vals, lo, hi) -> None:
    """Rows of several terms each, a term dropped where its variable does not exist (-1)."""
    r = np.concatenate([rows] * len(cols))
    c = np.concatenate(cols)
    v = np.concatenate(vals)
    keep = c >= 0
    b.add_rows(name, k, r[keep], c[keep], v[keep], lo, hi)


STEP_ROWS_MAX_NONZEROS = 3_000_000
"""The memory rows at every step are added when their nonzeros stay below this
(:func:`step_row_nonzeros`): on resnet18 b8 over CPU + H200 at 50 % (version-1 graphs, about 0.9
M of them) the relaxation's optimum without them, reached from the greedy start, read back
12 MiB over the budget; with them it fit and was proven optimal in 42 s (one thread, against 20
s). On GPT-2 with 12 layers they would be some 40 M."""


def step_row_nonzeros(inst: Instance) -> int:
    """An upper estimate of the step rows' nonzeros: per device, stage t and step i < t, every
    tensor made before i."""
    g = inst.graph
    made_before = np.cumsum(np.r_[0, 1 + (g.state_reader >= 0)[:-1]])  # tensors before node i
    n = g.size
    return int(inst.n_devices * (made_before * (n - 1 - np.arange(n))).sum())


def solve_device_frontier(
    inst: Instance,
    solver: str = "highs",
    options: SolverOptions | None = None,
    start: Schedule | None = None,
    progress: ProgressFn | None = None,
    steps: bool | None = None,
) -> FrontierResult:
    """Solve the relaxation; ``start`` (a valid schedule) is its MIP start. The result has
    the solver's bound and, when it found a solution, the schedule read from it
    (:meth:`DeviceFrontierModel.schedule_from`). ``steps``: memory rows at every step
    (``None``: where :func:`step_row_nonzeros` is at most :data:`STEP_ROWS_MAX_NONZEROS`)."""
    t0 = time.perf_counter()
    if steps is None:
        steps = step_row_nonzeros(inst) <= STEP_ROWS_MAX_NONZEROS
    fm = build_device_frontier(inst, steps=steps)
    build_s = time.perf_counter() - t0
    x0 = None if start is None else fm.assignment(start)
    sr, bound = solve_relaxation(fm.model, solver, options, x0, progress)
    schedule = None if sr.x is None else fm.schedule_from(sr.x)
    log.info(
        "frontier relaxation of %s over %d devices%s: %s in %.1f s, bound %s, %d vars, %d rows",
        inst.graph.name,
        inst.n_devices,
        " (memory rows at every step)" if steps else "",
        sr.status,
        sr.solve_time_s,
        "-" if bound is None else f"{bound * 1e3:.3f} ms",
        fm.model.n_vars,
        fm.model.n_rows,
    )
    return FrontierResult(
        status=sr.status,
        bound_s=bound,
        objective_s=None if sr.objective is None else sr.objective * TIME_UNIT_S,
        S=None,
        solve_time_s=sr.solve_time_s,
        build_time_s=build_s,
        n_vars=fm.model.n_vars,
        n_rows=fm.model.n_rows,
        extra={"solver_message": sr.message, "step_rows": steps},
        schedule=schedule,
    )


def device_frontier_lp_bound(
    inst: Instance, options: SolverOptions | None = None
) -> FrontierResult:
    """The LP relaxation of the relaxation (no step rows), by PDLP for ``options.time_limit_s``:
    a proven bound where the relaxation itself is too large to solve in the time.

    PDLP (:mod:`xengine.solvers.pdlp`) is a first-order method whose every dual iterate bounds
    the LP through :meth:`~xengine.solvers.model.MilpModel.dual_bound`, so a stop at the limit
    still gives a bound, weaker the earlier it stops. On GPT-2 with 12 layers over ``cpu2+cpu1``
    at 50 % (590k variables, 2.6 M nonzeros), where the relaxation as a MILP gave no bound in
    225 s and HiGHS's interior point no LP solution in 400 s, PDLP bounds at 3,854 ms after
    120 s and 3,959 ms after 300 s, against 3,742 ms for every op once on its fastest device
    (docs/measurements.md, "Two devices: the frontier relaxation")."""
    from xengine.solvers.pdlp import pdlp_row_duals

    options = options or SolverOptions()
    t0 = time.perf_counter()
    fm = build_device_frontier(inst, steps=False)
    build_s = time.perf_counter() - t0
    y, solve_s, reason = pdlp_row_duals(fm.model, options.time_limit_s, options.threads)
    bound = fm.model.dual_bound(y)
    bound_s = float(bound) * TIME_UNIT_S if np.isfinite(bound) else None
    log.info(
        "LP of the frontier relaxation of %s over %d devices (PDLP): %s after %.1f s, bound %s",
        inst.graph.name,
        inst.n_devices,
        reason,
        solve_s,
        "-" if bound_s is None else f"{bound_s * 1e3:.3f} ms",
    )
    return FrontierResult(
        status="lp_bound",
        bound_s=bound_s,
        objective_s=None,
        S=None,
        solve_time_s=solve_s,
        build_time_s=build_s,
        n_vars=fm.model.n_vars,
        n_rows=fm.model.n_rows,
        extra={"solver_message": reason, "step_rows": False},
    )
