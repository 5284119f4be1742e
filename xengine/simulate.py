"""The simulator: the one definition of a valid schedule, its time and its memory.

It replays a schedule stage by stage exactly as docs/design.md section 5 states, and emits the list
of operations (compute, copy, free) that the executor performs. The exact MILP formulations
are written so that their objective and their memory rows equal what this module computes;
tests hold them to it.

Semantics, per stage ``t``:

* residents: ``S[d, t, i]``; nodes run in topological order, node ``i`` on every device ``d``
  with ``R[d, t, i]`` (devices in mix order);
* an input not on the running device is copied from the holder with the cheapest copy; the
  copy occupies the input's bytes on the running device only while the consumer runs;
* after all computations of node ``k``, every tensor whose last reader in this stage is ``k``
  is freed on every device that is not keeping it for stage ``t + 1``;
* a forward op's autograd state (``S_state``) is made on the device by every computation of
  ``F_v`` there, read only by ``B_v`` on that device, never copied, and freed after ``B_v`` (or
  at the end of the stage) unless kept for stage ``t + 1``; keeping it into a stage that
  computes ``F_v`` again on the same device is an error, as recomputing a resident value is;
* memory of device ``d`` at a step = everything alive on ``d`` (resident values and states,
  values and states made so far and not freed, including the step's own) + transient copies +
  the workspace of the node running on ``d`` (measured on ``d``);
* predicted time = all compute times + all copy times (devices run one after another).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xengine.graph.types import Graph
from xengine.problem import Instance
from xengine.schedule import Schedule, keep_all_schedule

BUDGET_TOLERANCE_BYTES = 0  # the simulator is exact; executors state their own tolerance


class ScheduleError(ValueError):
    """A schedule breaks the rules; the message names the stage, node and device."""


@dataclass(frozen=True)
class Op:
    """One instruction: ``compute`` node on device, ``copy`` node's value from src_device to
    device (transient, for the next compute on that device), ``free`` node's value on device,
    or ``free_state`` node's autograd state on device."""

    kind: str
    stage: int
    node: int
    device: int
    src_device: int | None = None


@dataclass
class Simulation:
    time_s: float
    compute_time_s: float
    copy_time_s: float
    n_computes: int
    n_recomputes: int
    n_copies: int
    copied_bytes: int
    peak_bytes: np.ndarray  # (D,)
    mem_bytes: np.ndarray  # (D, n_steps): memory of each device at each step
    steps: list[tuple[int, int]] = field(default_factory=list)  # (stage, node) per step
    ops: list[Op] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    # per computation of the loss, in op order: whether it lets go of the logits before its
    # gradient (:meth:`_Replay.loss_extra`); the executor follows it
    loss_releases: list[bool] = field(default_factory=list)

    @property
    def within_budget(self) -> bool:
        return not self.violations


def simulate(
    inst: Instance,
    sched: Schedule,
    check_budget: bool = True,
    memo: StageMemo | None = None,
) -> Simulation:
    """Replay ``sched`` on ``inst``.

    Raises :class:`ScheduleError` for a schedule that breaks the stage rules (a missing input,
    an output kept that was never on the device, computing ahead of the frontier) and, with
    ``check_budget``, for one that exceeds a device budget (the message names the first step
    that does). With ``check_budget=False`` budget excesses are listed in ``violations``.

    The whole-schedule rules are checked first (:func:`_check_structure`); then the stages
    are replayed in order (:class:`_Replay`, the semantics of the module docstring).

    ``memo`` (a :class:`StageMemo` of this instance) reuses the stages an earlier replay
    through it saw with the same inputs: the result is the same, to the bit.
    """
    g = inst.graph
    n, D = g.size, inst.n_devices
    if tuple(sched.devices) != tuple(inst.devices):
        raise ScheduleError(f"schedule is for devices {sched.devices}, instance has {inst.devices}")
    R, S = sched.R, sched.S
    if R.shape != (D, n, n):
        raise ScheduleError(f"schedule has shape {R.shape}, expected {(D, n, n)} (T = n stages)")
    A = sched.states_for(g)
    if memo is not None:
        return memo.replay(inst, sched, A, check_budget)
    replay = _Replay(inst, R, S, A, check_budget)
    _check_structure(g, R, S, A, replay.names)
    for t in range(n):
        replay.stage(t)
    return replay.result()


@dataclass(frozen=True)
class _StageRecord:
    """What replaying one stage appended to the replay (see :meth:`_Replay.mark`)."""

    ops: list[Op]
    steps: list[tuple[int, int]]
    mem_rel: np.ndarray  # (D, steps): each step's memory less the stage's untouched bytes
    loss_releases: list[bool]
    compute_terms: list[float]
    copy_terms: list[float]
    copied_bytes: int


class StageMemo:
    """Replayed stages of one instance, by their inputs, for callers that simulate many
    schedules that differ in a few stages.

    Why: the greedy heuristics (:func:`baselines.heuristics.solve_recompute_greedy`, holding a
    seed's recomputations) score every move with a full replay, and a move changes what a few
    stages do: on GPT-2 with 24 layers (781 nodes) a replay took ~73 ms, most of it stages seen
    before. A stage's replay depends on its index, ``R`` of the stage, and the residency
    (``S``, ``S_state``) of it and of the next stage, but of a tensor that the stage neither
    reads nor makes and that stays resident through it, only on its bytes: it is never
    touched, freed or copied, it only adds to every step's memory. So the key is the stage's
    index and its rows without those tensors, packed into bytes; the record keeps each step's
    memory less their bytes, and a reuse adds the present schedule's and checks the budgets
    again. Totals are summed term by term in replay order, so a memoised result equals an
    unmemoised one to the bit (``tests/test_simulate.py``).
    """

    def __init__(self, inst: Instance, max_bytes: int = 256 * 2**20) -> None:
        g = inst.graph
        self.inst = inst
        # keys take 5 D n / 8 bytes, a record about as much again: 256 MiB hold ~50k
        # stages of GPT-2 with 24 layers on two devices
        self.max_entries = max(1_000, max_bytes // (2 * (5 * inst.n_devices * g.size // 8 + 64)))
        self.entries: dict[tuple[int, bytes], _StageRecord] = {}
        self.hits = 0
        self.misses = 0
        # each node's inputs as one flat array (CSR style): the reads of a stage are gathered
        # from its computations' entries, not from its whole row
        counts = [len(p) for p in g.predecessors]
        self._pred_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._pred_idx = np.array([u for p in g.predecessors for u in p], dtype=np.int64)
        self._state_src = g.state_source
        self._nbytes = g.output_bytes.astype(np.float64)
        self._state_bytes = g.state_bytes.astype(np.float64)

    def keys(
        self, R: np.ndarray, S: np.ndarray, A: np.ndarray
    ) -> tuple[list[tuple[int, bytes]], np.ndarray]:
        """Each stage's key (its index and the packed rows its replay reads, untouched
        residents left out) and ``(D, T)`` the bytes of those residents."""
        D, T, _ = R.shape
        comp = R[0] if D == 1 else R.any(axis=0)  # (T, n) computed in the stage
        t_c, v_c = np.nonzero(comp)
        lo = self._pred_ptr[v_c]
        k = self._pred_ptr[v_c + 1] - lo  # inputs per computation
        first = np.cumsum(k) - k
        touched = comp.copy()  # what the stage computes and reads
        touched[
            np.repeat(t_c, k), self._pred_idx[np.repeat(lo - first, k) + np.arange(k.sum())]
        ] = True
        touched_st = comp.copy()  # states made or read (by a backward op) in the stage
        src = self._state_src[v_c]
        touched_st[t_c[src >= 0], src[src >= 0]] = True
        S_next = np.zeros_like(S)
        S_next[:, :-1] = S[:, 1:]
        A_next = np.zeros_like(A)
        A_next[:, :-1] = A[:, 1:]
        still = S & S_next & ~touched
        still_st = A & A_next & ~touched_st
        offset = _row_bytes(still, self._nbytes) + _row_bytes(still_st, self._state_bytes)
        parts = [R, S & ~still, A & ~still_st, S_next & ~still, A_next & ~still_st]
        packed = np.packbits(np.concatenate(parts), axis=-1)  # (5D, T, bytes)
        rows = packed.transpose(1, 0, 2).reshape(T, -1)
        return [(t, rows[t].tobytes()) for t in range(T)], offset

    def replay(self, inst: Instance, sched: Schedule, A: np.ndarray, check_budget: bool):
        """:func:`simulate` through the memo. Budgets are checked once, on the whole memory
        at the end; a schedule that breaks a rule is replayed again without the memo, so that
        its error is the first one a plain replay meets."""
        if inst is not self.inst:
            raise ValueError("a StageMemo replays the instance it was made for only")
        R, S = sched.R, sched.S
        keys, offset = self.keys(R, S, A)
        known = [self.entries.get(k) for k in keys]
        new = np.array([t for t, rec in enumerate(known) if rec is None], dtype=np.int64)
        replay = _Replay(inst, R, S, A, False, stages=new)
        if len(self.entries) + new.size > self.max_entries:
            self.entries.clear()
        try:
            if new.size:
                _check_structure(inst.graph, R, S, A, replay.names, stages=new)
            for t, rec in enumerate(known):
                if rec is None:
                    mark = replay.mark()
                    replay.stage(t)
                    known[t] = rec = replay.record_since(mark, offset[:, t])
                    self.entries[keys[t]] = rec
                else:
                    replay.reuse(rec)
        except ScheduleError:
            if not check_budget:
                raise
            return simulate(inst, sched, check_budget=True)  # raises the plain replay's error
        self.hits += len(keys) - new.size
        self.misses += new.size
        counts = [rec.mem_rel.shape[1] for rec in known]
        mem = np.concatenate([rec.mem_rel for rec in known], axis=1)
        mem += np.repeat(offset, counts, axis=1)
        replay.violations = []
        for j in np.flatnonzero((mem > inst.budgets[:, None] + BUDGET_TOLERANCE_BYTES).any(0)):
            t, v = replay.steps[j]
            replay.check_budget = check_budget
            replay._check_budgets(t, v, mem[:, j])
        return replay.result(mem)


class _Replay:
    """The simulator's state while it replays a schedule stage by stage (docs/design.md section
    5): the totals so far, the operations and the memory of every device at every step.

    Within a stage, ``alive``/``alive_st`` are the values and states on each device,
    ``alive_bytes`` their bytes, and ``keep_next``/``keep_st`` what stage ``t + 1`` keeps."""

    def __init__(
        self,
        inst: Instance,
        R: np.ndarray,
        S: np.ndarray,
        A: np.ndarray,
        check_budget: bool,
        stages: np.ndarray | None = None,
    ) -> None:
        g = inst.graph
        self.n, self.D = g.size, inst.n_devices
        self.R, self.S, self.A = R, S, A
        self.check_budget = check_budget
        # plain lists for the per-node look-ups of the replay's loops (a numpy element costs
        # several times a list's)
        self.m = g.output_bytes.tolist()
        self.sb = g.state_bytes.tolist()
        self.w = inst.workspace_bytes.tolist()
        self.C = inst.compute_s.tolist()
        self.CP = inst.copy_s
        self.budgets = inst.budgets
        self.in_edges = g.in_edges
        self.state_src = g.state_source.tolist()
        self.state_reader = g.state_reader.tolist()
        self.names = [v.name for v in g.nodes]
        self.dev = inst.devices

        # every compute and copy time in replay order, summed at the end (so that stages a
        # StageMemo reuses add up exactly as replayed ones)
        self.compute_terms: list[float] = []
        self.copy_terms: list[float] = []
        self.copied = 0
        self.ops: list[Op] = []
        self.mem_cols: list[np.ndarray] = []
        self.steps: list[tuple[int, int]] = []
        self.violations: list[str] = []
        self.logits = g.released_logits  # None: the loss has no release to model
        self.loss_releases: list[bool] = []
        # Whole-matrix work done once, not per stage: a replay of n stages spent most of its
        # time in per-row numpy calls (GPT-2, 781 nodes: 134 ms a replay, 150 us a stage).
        # ``stages``: only these are replayed (the others come from a StageMemo), so only
        # their rows, and the next stage's residents, are read.
        T = R.shape[1]
        if stages is None:
            self.resident = [_row_lists(S[d]) for d in range(self.D)]
            self.resident_st = [_row_lists(A[d]) for d in range(self.D)]
            self.resident_bytes = _row_bytes(S, g.output_bytes) + _row_bytes(A, g.state_bytes)
            self.computed = _row_lists(R.any(axis=0))  # nodes computed in each stage
            self.keep_breaks = _keep_breaks(R, S, A)  # stages where _check_kept raises
            return
        rows = np.union1d(stages, stages[stages + 1 < T] + 1)
        self.resident = [_rows_at(S[d], rows) for d in range(self.D)]
        self.resident_st = [_rows_at(A[d], rows) for d in range(self.D)]
        self.resident_bytes = np.zeros((self.D, T), dtype=np.int64)
        self.resident_bytes[:, stages] = _row_bytes(S[:, stages], g.output_bytes) + _row_bytes(
            A[:, stages], g.state_bytes
        )
        self.computed = _rows_at(R[:, stages].any(axis=0), stages, T)
        self.keep_breaks = np.zeros(T, dtype=bool)
        self.keep_breaks[stages] = _keep_breaks_at(R, S, A, stages)

    def mark(self) -> tuple[int, ...]:
        """Where each appended list stands now (:meth:`record_since` takes from there)."""
        return (
            len(self.ops),
            len(self.steps),
            len(self.mem_cols),  # reused stages append steps, not memory
            len(self.loss_releases),
            len(self.compute_terms),
            len(self.copy_terms),
            self.copied,
        )

    def record_since(self, mark: tuple[int, ...], offset: np.ndarray) -> _StageRecord:
        """What was appended since ``mark`` (one stage's replay), its memory less ``offset``
        (the bytes of residents it did not touch): for a StageMemo."""
        n_ops, n_steps, n_cols, n_rel, n_comp, n_copy, copied = mark
        cols = self.mem_cols[n_cols:]
        mem = np.stack(cols, axis=1) if cols else np.zeros((self.D, 0), dtype=np.int64)
        return _StageRecord(
            ops=self.ops[n_ops:],
            steps=self.steps[n_steps:],
            mem_rel=mem - offset[:, None],
            loss_releases=self.loss_releases[n_rel:],
            compute_terms=self.compute_terms[n_comp:],
            copy_terms=self.copy_terms[n_copy:],
            copied_bytes=self.copied - copied,
        )

    def reuse(self, rec: _StageRecord) -> None:
        """Append a stage replayed before with the same inputs (its memory is the caller's:
        :meth:`StageMemo.replay` assembles it for all stages at once)."""
        self.ops += rec.ops
        self.steps += rec.steps
        self.loss_releases += rec.loss_releases
        self.compute_terms += rec.compute_terms
        self.copy_terms += rec.copy_terms
        self.copied += rec.copied_bytes

    def stage(self, t: int) -> None:
        """Stage ``t``: start from its residents, run every node it computes in topological
        order (:meth:`step`), then drop what stage ``t + 1`` does not keep."""
        R, S, A, D, n = self.R, self.S, self.A, self.D, self.n
        if not R[:, t, t].any():
            raise ScheduleError(
                f"stage {t}: node {t} ({self.names[t]}) is not computed on any device"
            )
        last = t + 1 >= n
        if self.keep_breaks[t]:
            _check_kept(R, S, A, t, self.names, self.dev)
        res, res_st = self.resident, self.resident_st
        alive = [set(res[d][t]) for d in range(D)]
        alive_st = [set(res_st[d][t]) for d in range(D)]
        keep_next = [set() if last else set(res[d][t + 1]) for d in range(D)]
        keep_st = [set() if last else set(res_st[d][t + 1]) for d in range(D)]
        self.alive, self.alive_st = alive, alive_st
        self.keep_next, self.keep_st = keep_next, keep_st
        self.alive_bytes = self.resident_bytes[:, t].copy()
        comp_nodes = self.computed[t]  # topological order; none ahead of the frontier
        # last reader (by node index) of every value in this stage
        last_use: dict[int, int] = {}
        for v in comp_nodes:
            for e in self.in_edges[v]:
                last_use[e.src] = max(last_use.get(e.src, -1), v)
        frees_at: dict[int, list[int]] = {}
        for u, v in last_use.items():
            frees_at.setdefault(v, []).append(u)

        for v in comp_nodes:
            self.step(t, v, frees_at.get(v, []))
        # end of stage: drop what is neither used nor kept
        for d in range(D):
            for u in sorted(alive[d] - keep_next[d]):
                self.ops.append(Op("free", t, u, d))
            for u in sorted(alive_st[d] - keep_st[d]):
                self.ops.append(Op("free_state", t, u, d))

    def step(self, t: int, v: int, frees: list[int]) -> None:
        """One step: node ``v`` on every device that runs it in stage ``t``, the memory of
        every device during it (checked against the budgets), then the frees after it: the
        values whose last reader in the stage is ``v`` (``frees``) and the state ``v``
        read, where stage ``t + 1`` does not keep them."""
        R, D, m, sb, ops = self.R, self.D, self.m, self.sb, self.ops
        alive, alive_st, alive_bytes = self.alive, self.alive_st, self.alive_bytes
        step_mem = alive_bytes.copy()
        ran = [d for d in range(D) if R[d, t, v]]
        for d in ran:
            transient = self.compute(t, v, d)
            extra = self.loss_extra(t, v, d)
            step_mem[d] = alive_bytes[d] + transient + self.w[d][v] + extra
        # devices that did not run v hold what is alive on them (plus v on those that did)
        for d in range(D):
            if d not in ran:
                step_mem[d] = alive_bytes[d]
        self.mem_cols.append(step_mem)
        self.steps.append((t, v))
        self._check_budgets(t, v, step_mem)
        for u in frees:
            for d in range(D):
                if u in alive[d] and u not in self.keep_next[d]:
                    alive[d].discard(u)
                    alive_bytes[d] -= m[u]
                    ops.append(Op("free", t, u, d))
        u = self.state_src[v]
        if u >= 0:
            for d in range(D):
                if u in alive_st[d] and u not in self.keep_st[d]:
                    alive_st[d].discard(u)
                    alive_bytes[d] -= sb[u]
                    ops.append(Op("free_state", t, u, d))

    def loss_extra(self, t: int, v: int, d: int) -> int:
        """The bytes a computation of the loss needs beyond its measured workspace.

        The executor's loss lets go of the logits before it makes their gradient, as a plain
        step does (the workspace is measured so, docs/design.md section 8), when the logits
        are not kept on ``d`` into stage t + 1 and no other device runs the loss in this stage
        (it could be reading them from ``d``). Otherwise the logits stay while the gradient
        is made: their bytes more (measured: the loss's workspace with the logits kept is
        the released one plus the logits, cross-entropy on the decoder and the tiny net)."""
        u = self.logits
        if u is None or v != u + 1:
            return 0
        release = int(self.R[:, t, v].sum()) == 1 and u not in self.keep_next[d]
        self.loss_releases.append(release)
        return 0 if release else self.m[u]

    def compute(self, t: int, v: int, d: int) -> int:
        """Compute ``v`` on device ``d`` in stage ``t``: check that it is not there yet and
        that the state it reads is, copy each missing input from its cheapest holder, and
        count the time. Returns the bytes of the transient copies (alive while ``v`` runs)."""
        names, dev, m = self.names, self.dev, self.m
        alive, alive_st, alive_bytes = self.alive, self.alive_st, self.alive_bytes
        if v in alive[d]:
            raise ScheduleError(
                f"stage {t}: node {v} ({names[v]}) is recomputed on {dev[d]} while it "
                "is already there"
            )
        u = self.state_src[v]
        if u >= 0 and u not in alive_st[d]:
            raise ScheduleError(
                f"stage {t}: node {v} ({names[v]}) on {dev[d]} needs the autograd "
                f"state of node {u} ({names[u]}), which is not on {dev[d]} (a state "
                f"cannot be copied: {names[u]} must have run on {dev[d]} and its "
                "state must be kept there)"
            )
        transient = 0
        CP = self.CP
        for e in self.in_edges[v]:
            u = e.src
            if u in alive[d]:
                continue
            holders = [h for h in range(self.D) if u in alive[h]]
            if not holders:
                raise ScheduleError(
                    f"stage {t}: node {v} ({names[v]}) on {dev[d]} needs node {u} "
                    f"({names[u]}), which is on no device at that point"
                )
            if not e.copyable:
                raise ScheduleError(
                    f"stage {t}: node {v} ({names[v]}) on {dev[d]} needs the autograd "
                    f"state of node {u} ({names[u]}), which cannot be copied from "
                    f"{dev[holders[0]]}; it must be on {dev[d]}"
                )
            src = min(holders, key=lambda h: (CP[h, d, u], h))
            self.copy_terms.append(float(CP[src, d, u]))
            self.copied += m[u]
            transient += m[u]
            self.ops.append(Op("copy", t, u, d, src))
        self.ops.append(Op("compute", t, v, d))
        self.compute_terms.append(self.C[d][v])
        alive[d].add(v)
        alive_bytes[d] += m[v]
        if self.state_reader[v] >= 0:
            alive_st[d].add(v)
            alive_bytes[d] += self.sb[v]
        return transient

    def _check_budgets(self, t: int, v: int, step_mem: np.ndarray) -> None:
        """A device above its budget at this step: an error, or (``check_budget=False``) a
        violation listed in the result."""
        for d in range(self.D):
            if step_mem[d] > self.budgets[d] + BUDGET_TOLERANCE_BYTES:
                msg = (
                    f"stage {t}, node {v} ({self.names[v]}): {self.dev[d]} needs "
                    f"{int(step_mem[d])} bytes, budget {int(self.budgets[d])}"
                )
                if self.check_budget:
                    raise ScheduleError(msg)
                self.violations.append(msg)

    def result(self, mem: np.ndarray | None = None) -> Simulation:
        """The totals; ``mem`` (D, steps) when the caller assembled it (a StageMemo)."""
        D = self.D
        mem_cols = self.mem_cols
        if mem is None:
            mem = np.stack(mem_cols, axis=1) if mem_cols else np.zeros((D, 0), dtype=np.int64)
        time_compute = time_copy = 0.0
        for c in self.compute_terms:  # in replay order, one addition at a time
            time_compute += c
        for c in self.copy_terms:
            time_copy += c
        n_comp = len(self.compute_terms)
        return Simulation(
            time_s=time_compute + time_copy,
            compute_time_s=time_compute,
            copy_time_s=time_copy,
            n_computes=n_comp,
            # every stage computed its frontier node, so each node ran; the rest are again
            n_recomputes=n_comp - self.n,
            n_copies=len(self.copy_terms),
            copied_bytes=self.copied,
            peak_bytes=mem.max(axis=1) if mem.size else np.zeros(D, dtype=np.int64),
            mem_bytes=mem,
            steps=self.steps,
            ops=self.ops,
            violations=self.violations,
            loss_releases=self.loss_releases,
        )


def _check_structure(
    g, R: np.ndarray, S: np.ndarray, A: np.ndarray, names: list[str], stages=None
) -> None:
    """Stage structure: nothing resident before stage 0, no computation ahead of the frontier,
    nothing resident before its first computation, states only of ops that have one. Each
    rule reads one stage's rows; ``stages`` (ascending) checks only those."""
    n = g.size
    rows = np.arange(R.shape[1]) if stages is None else np.asarray(stages)
    if rows.size and rows[0] == 0 and (S[:, 0, :].any() or A[:, 0, :].any()):
        raise ScheduleError("stage 0: nothing can be resident before the first stage")
    if stages is not None:
        R, S, A = R[:, rows], S[:, rows], A[:, rows]
    col = np.arange(n)[None, :]
    upper = col > rows[:, None]
    if (R & upper).any():
        d, t, i = np.argwhere(R & upper)[0]
        raise ScheduleError(
            f"stage {rows[t]}: node {i} ({names[i]}) is computed ahead of the frontier"
        )
    not_yet = col >= rows[:, None]
    for what, X in (("", S), ("the state of ", A)):
        if (X & not_yet).any():
            d, t, i = np.argwhere(X & not_yet)[0]
            raise ScheduleError(
                f"stage {rows[t]}: {what}node {i} ({names[i]}) is resident before it was computed"
            )
    stateless = g.state_reader < 0
    if A[:, :, stateless].any():
        d, t, i = np.argwhere(A & stateless[None, None, :])[0]
        raise ScheduleError(
            f"stage {rows[t]}: the schedule keeps a state of node {i} ({names[i]}), which has none"
        )


def _row_lists(M: np.ndarray) -> list[list[int]]:
    """The column indices of each row of a bool matrix, ascending, as plain lists."""
    rows, cols = np.nonzero(M)
    bounds = np.searchsorted(rows, np.arange(M.shape[0] + 1)).tolist()
    cols = cols.tolist()
    return [cols[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _rows_at(M: np.ndarray, rows: np.ndarray, T: int | None = None) -> list:
    """:func:`_row_lists` of the given rows of ``M`` (all of ``M``'s rows, or ``T`` of them
    when ``M`` holds those rows only), ``None`` for the others."""
    T = M.shape[0] if T is None else T
    out: list = [None] * T
    lists = _row_lists(M[rows] if M.shape[0] == T else M)
    for r, cols in zip(rows.tolist(), lists, strict=True):
        out[r] = cols
    return out


def _row_bytes(X: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """``(D, T)`` bytes of what each row of ``X`` (D, T, n) holds. Summed in float64, exact
    below 2**53 bytes (a sum of integers), then back to int64."""
    return np.rint(X.astype(np.float64) @ nbytes.astype(np.float64)).astype(np.int64)


def _keep_breaks(R: np.ndarray, S: np.ndarray, A: np.ndarray) -> np.ndarray:
    """``(T,)`` the stages where :func:`_check_kept` finds a fault, all found at once."""
    bad = (A & R).any(axis=(0, 2))
    nxt = (S[:, 1:] & ~S[:, :-1] & ~R[:, :-1]) | (A[:, 1:] & ~A[:, :-1] & ~R[:, :-1])
    bad[:-1] |= nxt.any(axis=(0, 2))
    return bad


def _keep_breaks_at(R: np.ndarray, S: np.ndarray, A: np.ndarray, stages: np.ndarray):
    """:func:`_keep_breaks` of the given stages only."""
    T = R.shape[1]
    bad = (A[:, stages] & R[:, stages]).any(axis=(0, 2))
    inner = stages + 1 < T
    s = stages[inner]
    nxt = (S[:, s + 1] & ~S[:, s] & ~R[:, s]) | (A[:, s + 1] & ~A[:, s] & ~R[:, s])
    bad[inner] |= nxt.any(axis=(0, 2))
    return bad


def _check_kept(R, S, A, t, names, dev) -> None:
    """What stage ``t + 1`` keeps was on the device in stage ``t``; a state is not kept into a
    stage that makes it anew. (Whole rows at once: the replay's cost on graphs of thousands of
    nodes is in per-node loops like this one.)"""
    last = t + 1 >= S.shape[1]
    for d in range(S.shape[0]):
        made = R[d, t]
        if not last:
            bad = S[d, t + 1] & ~S[d, t] & ~made
            if bad.any():
                i = int(bad.argmax())
                raise ScheduleError(
                    f"stage {t + 1}: node {i} ({names[i]}) is kept on {dev[d]} but was "
                    f"neither resident nor computed there in stage {t}"
                )
            bad = A[d, t + 1] & ~A[d, t] & ~made
            if bad.any():
                i = int(bad.argmax())
                raise ScheduleError(
                    f"stage {t + 1}: the state of node {i} ({names[i]}) is kept on {dev[d]}, "
                    f"where {names[i]} has not run"
                )
        bad = A[d, t] & made
        if bad.any():
            i = int(bad.argmax())
            raise ScheduleError(
                f"stage {t}: the state of node {i} ({names[i]}) is kept on {dev[d]} into a "
                f"stage that computes {names[i]} there again (which makes a new state)"
            )


def keep_all_peak_bytes(graph: Graph, device: str | None = None) -> int:
    """Peak activation memory when every node runs once, each value stays until its last
    reader and each state until its backward op: a plain PyTorch step's activation peak,
    the "100 %" of percentage budgets. ``device`` picks whose workspaces count (default:
    the first device with costs, else the nodes' default workspaces)."""
    # memory does not depend on costs: a device without costs is simulated at zero cost
    if device is None:
        device = graph.devices[0] if graph.devices else "_"
    g = graph
    if device not in graph.devices:
        g = graph.with_costs({device: {v.name: 0.0 for v in graph.nodes}})
    inst = Instance.single(g, device, budget_bytes=None)
    return int(simulate(inst, keep_all_schedule(inst)).peak_bytes.max())
