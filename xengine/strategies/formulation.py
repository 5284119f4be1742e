"""The XEngine mixed-integer model over D devices (Schuler et al., TACO 2022, section 4).

With one device it is exactly Checkmate's MILP (Jain et al., MLSys 2020, eq. 1-9):
frontier-advancing stages, binary R, S, FREE with the hazard-count linearisation, and the
memory recurrence U. The device index adds, per DESIGN.md section 6:

``mode="exact"`` (default): linear and exact with respect to :mod:`xengine.simulate`.
    * ``sum_d R[d,t,i] <= 1`` and ``R + S <= 1`` (never beneficial to break; they make the
      presence ``Z = R + S`` linear without a helper variable);
    * a copy indicator ``X[d,t,(u,v)] = R[d,t,v] AND NOT Z[d,t,u]``, charged once at the
      cheapest holder's copy cost (helper ``Y`` for D >= 3) and counted as transient memory on
      the receiving device while ``v`` runs;
    * FREE per device: ``u`` leaves device ``d`` after its last reader in the stage on *any*
      device, unless ``d`` keeps it for the next stage (the simulator's rule).
``mode="paper"``: the published MIQP, its copy term ``c * R[d',t,v] * Z[d,t,u]`` charged for
    every other device holding ``u`` and no memory for copies, with per-device hazard rows.
    It does *not* copy the released code's defects (shared/reference/xengine-paper-and-code.md
    section 1.6): initial memory and FREE rows are per device, the freed amount is the
    predecessor's size, and copy costs are read src -> dst. ``linearize=True`` replaces the
    product by an AND variable ``W >= R + Z - 1`` for solvers without products (HiGHS).

Autograd states (DESIGN.md section 3) are tensors of their own: state ``k`` of forward node
``v`` has its residency ``SA[d,t,k]`` (``Aix``), is made by every ``R[d,t,v]``, is read only by
``B_v`` over a local (non-copyable) edge and is freed by the same FREE rows as a value, with
``R[d,t,v] + SA[d,t,k] <= 1`` (keeping a state into a stage that makes it anew never helps
and the simulator rejects it). The rows below run over *tensors* (values, then states) where
they are about residency and freeing, and over nodes where they are about computing. Value
edges with ``copyable=False`` (version-1 graphs) are local in both modes too.

Two switches change how the same model is written, never its optimum:

``reference=True``: the formulation as published, for side-by-side speed measurements
    (issue 5): full T x n matrices for R, S, U (and Z) and FREE over every (t, e), the stage
    structure (R above the diagonal, S on and above it) fixed by *rows*, hazard-count FREE
    rows over every later reader, and none of the reductions of the default model (the
    triangular allocation, the frontier fixed by bounds on one device, R fixed at zero on
    devices whose budget cannot hold a node). Slow by design; never the default.
``free_rows="tight"``: FREE as an AND linearisation instead of the hazard count: F continuous
    in [0, 1], ``F <= c`` for every condition ``c`` and ``F >= sum(c) - (k - 1)``. At integer
    R, S the rows force F to the same 0/1 value as the hazard rows, and the LP relaxation is
    at least as tight (the hazard row ``kappa (1 - F) >= h`` is the sum of the ``F <= c``
    rows). Whether it is faster is measured by ``experiments/solver_benchmark.py``. CP-SAT
    refuses this form (continuous F sits in the memory equalities, so it is not implied
    integer).
``free_rows="tight"`` is what :func:`default_free_rows` picks for every MILP solver (the
    callers :func:`xengine.strategies.solve.solve_xengine` and
    :func:`xengine.strategies.bounds.lp_bound_s` apply it
    when not told otherwise); ``build`` itself keeps ``hazard`` as its default, the published
    rows, which Checkmate's baseline and its LP rounding use.
``break_symmetry=True``: when devices are interchangeable (:func:`twin_of_first`: same costs,
    budget and copy costs as the first device), any schedule stays a schedule of the same cost
    when two of them swap roles, so the first device may be the one that computes node 0 in
    stage 0: ``R[0, 0, 0]`` is fixed at 1. It removes the mirror image of every schedule in
    which a twin computes node 0, never an optimum's cost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.solvers.model import MilpModel, ModelBuilder

log = logging.getLogger(__name__)
MODES = ("exact", "paper")
FREE_ROWS = ("hazard", "tight")


@dataclass
class Formulation:
    inst: Instance
    mode: str
    model: MilpModel
    Rix: np.ndarray  # (D, T, n) variable index or -1
    Six: np.ndarray
    Fix: np.ndarray  # (D, T, E), edges in the order of ``edges``
    Xix: np.ndarray  # (D, T, E) copy indicator (exact mode, copyable edges) or -1
    Uix: np.ndarray  # (D, T, n)
    Zix: np.ndarray | None  # paper mode only
    mem_scale: float
    time_scale: float
    build_time_s: float
    edges: tuple = ()  # value edges, then state edges: the E axis of Fix and Xix
    Aix: np.ndarray | None = None  # (D, T, n) state residency by forward node, or -1

    # ------------------------------------------------------------------ reading a solution
    def schedule_from(self, x: np.ndarray) -> Schedule:
        R = np.where(self.Rix >= 0, x[np.maximum(self.Rix, 0)] > 0.5, False)
        S = np.where(self.Six >= 0, x[np.maximum(self.Six, 0)] > 0.5, False)
        A = None
        if self.Aix is not None:
            A = np.where(self.Aix >= 0, x[np.maximum(self.Aix, 0)] > 0.5, False)
        if self.mode == "paper":
            # The paper model allows recomputing a node that is resident; the simulator
            # rejects it. The redundant computation is dropped, unless it makes a state that
            # is kept or read in its stage: then the resident value is dropped instead (the
            # computation makes it anew), which costs no time and no memory.
            both = R & S
            if A is not None:
                g = self.inst.graph
                makes = np.zeros_like(R)
                for v, b in enumerate(g.state_reader.tolist()):
                    if b >= 0:
                        kept = np.concatenate([A[:, 1:, v], np.zeros_like(A[:, :1, v])], axis=1)
                        makes[:, :, v] = ~A[:, :, v] & (kept | R[:, :, b])
                S = S & ~(both & makes)
                both = both & ~makes
            R = R & ~both
        return Schedule(self.inst.devices, R, S, A)

    def objective_s(self, x: np.ndarray) -> float:
        return self.model.objective(x) * self.time_scale

    def peak_bytes(self, x: np.ndarray) -> np.ndarray:
        """Per-device peak memory as the model sees it (U plus transient copies/workspace)."""
        g = self.inst.graph
        D, T, n = self.Rix.shape
        U = np.where(self.Uix >= 0, x[np.maximum(self.Uix, 0)], -np.inf) * self.mem_scale
        R = np.where(self.Rix >= 0, x[np.maximum(self.Rix, 0)], 0.0)
        extra = R * self.inst.workspace_bytes[:, None, :]
        if (self.Xix >= 0).any():
            X = np.where(self.Xix >= 0, x[np.maximum(self.Xix, 0)], 0.0)
            m_src = g.output_bytes[np.array([e.src for e in self.edges])]
            dst = np.array([e.dst for e in self.edges])
            for e in range(len(self.edges)):
                extra[:, :, dst[e]] += X[:, :, e] * m_src[e]
        tot = U + extra
        return np.max(tot.reshape(D, -1), axis=1)

    # ------------------------------------------------------------------ warm starts
    def assignment(self, sched: Schedule) -> np.ndarray:
        """A complete variable vector for a valid schedule (exact mode): R, S from the
        schedule, FREE, X, Y, U derived by the simulator's rules. Used as a MIP start."""
        if self.mode != "exact":
            raise ValueError("warm starts are built for mode=exact only")
        inst, g = self.inst, self.inst.graph
        D, T, n = self.Rix.shape
        R = sched.R.astype(float)
        S = sched.S.astype(float)
        A = sched.states_for(g).astype(float)
        x = np.zeros(self.model.n_vars)
        pairs = [(self.Rix, R), (self.Six, S)]
        if self.Aix is not None:
            pairs.append((self.Aix, A))
        for ix, val in pairs:
            mask = ix >= 0
            x[ix[mask]] = val[mask]
        tz = _tensors(g, self.edges)
        SX = np.concatenate([S, A[:, :, tz.state_nodes]], axis=2)  # (D, T, n_tensors)
        Z = R + S
        ZX = R[:, :, tz.prod] + SX
        Acomp = R.sum(axis=0)  # (T, n)
        src = np.array([e.src for e in self.edges], dtype=np.int64)
        dst = np.array([e.dst for e in self.edges], dtype=np.int64)
        E = len(src)
        # last reader of a tensor in stage t (by node index)
        later = np.zeros((T, E), dtype=bool)  # some j > dst[e] reads tau[e] in stage t
        for e in range(E):
            js = tz.later[e]
            if js:
                later[:, e] = Acomp[:, js].sum(axis=1) > 0
        Snext = np.concatenate([SX[:, 1:, :], np.zeros((D, 1, SX.shape[2]))], axis=1)
        F = np.zeros((D, T, E))
        for e in range(E):
            F[:, :, e] = (
                (ZX[:, :, tz.tau[e]] > 0.5)
                & (Acomp[None, :, dst[e]] > 0.5)
                & (Snext[:, :, tz.tau[e]] < 0.5)
                & ~later[None, :, e]
            )
        mask = self.Fix >= 0
        x[self.Fix[mask]] = F[mask]
        Xv = np.zeros((D, T, E))
        for e in range(E):
            if self.edges[e].copyable:
                Xv[:, :, e] = (R[:, :, dst[e]] > 0.5) & (Z[:, :, src[e]] < 0.5)
        mask = self.Xix >= 0
        x[self.Xix[mask]] = Xv[mask]
        if self._Yix is not None:
            CP = inst.copy_s
            for d in range(D):
                for t in range(T):
                    for e in np.flatnonzero(Xv[d, t] > 0.5):
                        holders = [a for a in range(D) if a != d and Z[a, t, src[e]] > 0.5]
                        a = min(holders, key=lambda h: (CP[h, d, src[e]], h))
                        x[self._Yix[a, d, t, e]] = 1.0
        # U recurrence: what node k leaves (value and state), minus what its predecessor freed
        made = g.output_bytes.astype(float) + g.state_bytes.astype(float)
        freed = np.zeros((D, T, n))
        for e in range(E):
            freed[:, :, dst[e]] += F[:, :, e] * tz.bytes[tz.tau[e]]
        for t in range(T):
            u = R[:, t, 0] * made[0] + SX[:, t, :] @ tz.bytes
            for k in range(n):
                if k > 0:
                    u = u + R[:, t, k] * made[k] - freed[:, t, k - 1]
                idx = self.Uix[:, t, k]
                ok = idx >= 0
                if not ok.any():
                    break  # the default model's U stops at the frontier (k <= t)
                x[idx[ok]] = u[ok] / self.mem_scale
        return x

    _Yix: np.ndarray | None = None
    blocked: tuple[str, int] | None = None
    """(node, bytes) when some node fits on no device: the model is infeasible as built."""


@dataclass(frozen=True)
class _Tensors:
    """What the rows about residency and freeing run over: the values (tensor i = node i's
    value) and then the states (tensor n + k = state of ``state_nodes[k]``)."""

    prod: np.ndarray  # (n_tensors,) the node that makes each tensor
    bytes: np.ndarray  # (n_tensors,) float
    state_nodes: np.ndarray  # (n_states,) forward nodes with a state, in state-edge order
    tau: np.ndarray  # (E,) the tensor each edge reads
    later: list  # per edge: readers j > dst of the same tensor


def _tensors(g, edges) -> _Tensors:
    n = g.size
    state_nodes = np.array([e.src for e in g.state_edges], dtype=np.int64)
    slot = {int(v): n + k for k, v in enumerate(state_nodes)}
    prod = np.concatenate([np.arange(n), state_nodes]).astype(np.int64)
    nbytes = np.concatenate(
        [g.output_bytes.astype(float), g.state_bytes[state_nodes].astype(float)]
    )
    tau = np.array([slot[e.src] if e.is_state else e.src for e in edges], dtype=np.int64)
    succ = g.successors
    later = [[] if e.is_state else [j for j in succ[e.src] if j > e.dst] for e in edges]
    return _Tensors(prod, nbytes, state_nodes, tau, later)


def twin_of_first(inst: Instance) -> bool:
    """Whether some other device is interchangeable with the first: the same compute costs
    and budget, and copy costs that do not change when the two swap roles."""
    C, CP, budgets = inst.compute_s, inst.copy_s, inst.budgets
    for d in range(1, inst.n_devices):
        perm = np.arange(inst.n_devices)
        perm[[0, d]] = perm[[d, 0]]
        if (
            np.array_equal(C[0], C[d])
            and budgets[0] == budgets[d]
            and np.array_equal(CP, CP[np.ix_(perm, perm)])
        ):
            return True
    return False


def _state_rows(b: ModelBuilder, Rix: np.ndarray, Aix: np.ndarray, D: int, T: int) -> None:
    """A state persists only where it was (SA[d,t+1,v] <= R[d,t,v] + SA[d,t,v]) and is never
    kept into a stage that makes it anew (R[d,t,v] + SA[d,t,v] <= 1)."""
    at, ai = np.nonzero(Aix[0] >= 0)  # t > v for a forward node v with a state
    k = at.size
    rows = np.arange(k)
    for d in range(D):
        b.add_rows(
            "state_persistence",
            k,
            np.concatenate([rows, rows, rows]),
            np.concatenate([Aix[d, at, ai], Rix[d, at - 1, ai], Aix[d, at - 1, ai]]),
            np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
            -np.inf,
            0.0,
        )
        b.add_rows(
            "state_presence",
            k,
            np.concatenate([rows, rows]),
            np.concatenate([Rix[d, at, ai], Aix[d, at, ai]]),
            1.0,
            -np.inf,
            1.0,
        )


def default_free_rows(solver: str) -> str:
    """The FREE rows to build for ``solver`` when the caller states none.

    ``tight`` for the MILP solvers: its relaxation is stronger, which is what limits proofs
    (CPU + H200 costs, two devices, 50 %: the LP bound is 18.54 against 17.73 ms on vgg16 and
    21.15 against 20.87 ms on resnet18, the best schedules being 18.87 and 21.29 ms; HiGHS
    proves vgg16 optimal in 40 s where the hazard rows take 145 s and the published form
    226 s, ``results/solver_benchmark/h200_vgg16_free_rows*``). It does not win
    everywhere. On one device it gains nothing measurable (vgg16 on the CPU: 33 against
    34 s). On resnet18 with two devices the published hazard form proves 0.1 % in 1525 s,
    where this form still has a 0.20 % gap at 1600 s (``h200_resnet18_*``).

    ``hazard`` for CP-SAT, which takes only integer or implied-integer columns, and the
    tight form's continuous F are neither.
    """
    return "hazard" if solver.lower() == "cpsat" else "tight"


def build(
    inst: Instance,
    mode: str = "exact",
    linearize: bool = True,
    reference: bool = False,
    free_rows: str = "hazard",
    break_symmetry: bool = False,
) -> Formulation:
    """Build the model for ``inst``. See the module docstring for the two modes and for
    ``reference`` (the published form, unreduced), ``free_rows`` (hazard | tight) and
    ``break_symmetry``."""
    if mode not in MODES:
        raise ValueError(f"formulation mode {mode!r} is not one of {MODES}")
    if free_rows not in FREE_ROWS:
        raise ValueError(f"free_rows {free_rows!r} is not one of {FREE_ROWS}")
    if reference and (free_rows != "hazard" or break_symmetry):
        raise ValueError(
            "reference=True is the published model: it uses free_rows='hazard' and no "
            "symmetry breaking"
        )
    t0 = time.perf_counter()
    g = inst.graph
    D, n = inst.n_devices, g.size
    T = n
    edges = g.value_edges + g.state_edges
    tz = _tensors(g, edges)
    m = g.output_bytes.astype(float)
    wsp = inst.workspace_bytes.astype(float)  # (D, n): measured per device
    mem_scale = float(max(tz.bytes.max(), 1.0))
    mb = m / mem_scale
    madeb = (m + g.state_bytes) / mem_scale  # what computing node k leaves: value + state
    mtb = tz.bytes / mem_scale  # per tensor
    wb = wsp / mem_scale
    budgets = np.minimum(inst.budgets.astype(float) / mem_scale, 1e12)
    C = inst.compute_s
    time_scale = float(max(C.max(), 1e-12))
    Cs = C / time_scale
    src = np.array([e.src for e in edges], dtype=np.int64)  # the node that makes the tensor
    dst = np.array([e.dst for e in edges], dtype=np.int64)
    tau = tz.tau  # the tensor read: a value (= src) or a state (n + k)
    copyable = np.array([e.copyable for e in edges], dtype=bool)
    E = len(src)
    multi = D >= 2

    tag = "-reference" if reference else ("-tight" if free_rows == "tight" else "")
    b = ModelBuilder(f"xengine-{mode}{tag}-{g.name}-D{D}")
    stage_le = np.tril(np.ones((T, n), dtype=bool))  # i <= t: R may be nonzero
    stage_lt = np.tril(np.ones((T, n), dtype=bool), k=-1)  # i < t: S may be nonzero
    if reference:
        # every (t, i) gets a variable and every row family runs over all of them; the stage
        # structure is imposed by the fixing rows below
        tri_le = np.ones((T, n), dtype=bool)
        tri_lt = np.ones((T, n), dtype=bool)
    else:
        tri_le, tri_lt = stage_le, stage_lt

    def alloc(mask2d: np.ndarray, lb: float, ub: float, integer: bool) -> np.ndarray:
        ix = np.full((D,) + mask2d.shape, -1, dtype=np.int64)
        cnt = int(mask2d.sum())
        for d in range(D):
            ix[d][mask2d] = b.add_vars(cnt, lb, ub, integer)
        return ix

    Rix = alloc(tri_le, 0, 1, True)
    Six = alloc(tri_lt, 0, 1, True)
    Aix = None
    SX = Six  # residency of every tensor: values, then states
    if g.has_states:
        has_state = np.zeros(n, dtype=bool)
        has_state[tz.state_nodes] = True
        Aix = alloc(stage_lt & has_state[None, :], 0, 1, True)
        SX = np.concatenate([Six, Aix[:, :, tz.state_nodes]], axis=2)
    # A node can only run on a device whose budget holds its inputs, output and workspace at
    # once (every input must be on the running device, resident or copied). Fixing the other
    # R entries to zero keeps every feasible schedule and spares the solver from proving it.
    footprint = np.stack([g.node_lower_bound_bytes(dv) for dv in inst.devices])  # (D, n)
    cannot_run = footprint > inst.budgets[:, None]  # (D, n)
    blocked_nodes = np.flatnonzero(cannot_run.all(axis=0))
    Zix = alloc(tri_le, 0, 1, True) if (mode == "paper" and multi) else None
    tt, ii = np.nonzero(tri_le)

    # stage validity per edge: (t, e) with dst[e] <= t (reference: every (t, e))
    if reference:
        te_t, te_e = np.nonzero(np.ones((T, E), dtype=bool))
    else:
        te_t, te_e = np.nonzero(dst[None, :] <= np.arange(T)[:, None])
    n_te = te_t.size

    if reference:
        # stage structure as rows (Checkmate eq. 8): R[t, i] = 0 for i > t, S[t, i] = 0 for
        # i >= t (S[0, :] = 0 included)
        for name, ix, allowed in (("stage_fix_r", Rix, stage_le), ("stage_fix_s", Six, stage_lt)):
            ft, fi = np.nonzero(~allowed)
            for d in range(D):
                b.add_rows(name, ft.size, np.arange(ft.size), ix[d, ft, fi], 1.0, 0.0, 0.0)

    # 1. frontier: sum_d R[d,t,t] == 1
    b.add_rows(
        "frontier",
        T,
        np.repeat(np.arange(T), D),
        Rix[:, np.arange(T), np.arange(T)].T.ravel(),
        1.0,
        1.0,
        1.0,
    )
    if not reference:
        if D == 1 and not blocked_nodes.size:
            b.fix(Rix[0, np.arange(T), np.arange(T)], 1.0)
        for d in range(D):
            cols = np.flatnonzero(cannot_run[d])
            if cols.size:
                b.fix(Rix[d][:, cols].ravel(), 0.0)
        if break_symmetry and twin_of_first(inst) and not cannot_run[0, 0]:
            b.fix(Rix[0, :1, 0], 1.0)

    lt_t, lt_i = np.nonzero(tri_lt)
    k_lt = lt_t.size
    if mode == "exact":
        # 2. at most one device computes a node in a stage
        if multi:
            b.add_rows(
                "one_device",
                k_lt,
                np.repeat(np.arange(k_lt), D),
                Rix[:, lt_t, lt_i].T.ravel(),
                1.0,
                -np.inf,
                1.0,
            )
        # 3. R + S <= 1 (presence Z = R + S is then binary)
        for d in range(D):
            rows = np.arange(k_lt)
            b.add_rows(
                "presence",
                k_lt,
                np.concatenate([rows, rows]),
                np.concatenate([Rix[d, lt_t, lt_i], Six[d, lt_t, lt_i]]),
                1.0,
                -np.inf,
                1.0,
            )
    else:
        if multi:
            # Z = R OR S (paper, constraint 6)
            for d in range(D):
                rows = np.arange(tt.size)
                zc = Zix[d, tt, ii]
                b.add_rows(
                    "z_ge_r",
                    tt.size,
                    np.concatenate([rows, rows]),
                    np.concatenate([zc, Rix[d, tt, ii]]),
                    np.array([1.0] * tt.size + [-1.0] * tt.size),
                    0.0,
                    np.inf,
                )
                b.add_rows(
                    "z_ge_s",
                    tt.size,
                    np.concatenate([rows, rows]),
                    np.concatenate([zc, Six[d, tt, ii]]),
                    np.array([1.0] * tt.size + [-1.0] * tt.size),
                    0.0,
                    np.inf,
                )
                b.add_rows(
                    "z_le_rs",
                    tt.size,
                    np.concatenate([rows, rows, rows]),
                    np.concatenate([zc, Rix[d, tt, ii], Six[d, tt, ii]]),
                    np.array([1.0] * tt.size + [-1.0] * (2 * tt.size)),
                    -np.inf,
                    0.0,
                )

    # 4. persistence: S[d,t+1,i] <= R[d,t,i] + S[d,t,i]
    p_t, p_i = np.nonzero(tri_le[:-1])
    kp = p_t.size
    for d in range(D):
        rows = np.arange(kp)
        b.add_rows(
            "persistence",
            kp,
            np.concatenate([rows, rows, rows]),
            np.concatenate([Six[d, p_t + 1, p_i], Rix[d, p_t, p_i], Six[d, p_t, p_i]]),
            np.concatenate([np.ones(kp), -np.ones(kp), -np.ones(kp)]),
            -np.inf,
            0.0,
        )
    if Aix is not None:
        _state_rows(b, Rix, Aix, D, T)

    # 5. dependencies
    cp_mask = copyable[te_e]
    if multi and mode == "exact":
        # copyable: sum_d R[d,t,v] <= sum_d (R[d,t,u] + S[d,t,u]); at most one d computes v
        sel_t, sel_e = te_t[cp_mask], te_e[cp_mask]
        k = sel_t.size
        rows = np.arange(k)
        r_parts, c_parts, v_parts = [], [], []
        for d in range(D):
            r_parts += [rows, rows, rows]
            c_parts += [
                Rix[d, sel_t, dst[sel_e]],
                Rix[d, sel_t, src[sel_e]],
                Six[d, sel_t, src[sel_e]],
            ]
            v_parts += [np.ones(k), -np.ones(k), -np.ones(k)]
        b.add_rows(
            "dependency",
            k,
            np.concatenate(r_parts),
            np.concatenate(c_parts),
            np.concatenate(v_parts),
            -np.inf,
            0.0,
        )
        local_t, local_e = te_t[~cp_mask], te_e[~cp_mask]
    elif multi:  # paper: per consumer device, any holder (Z summed over devices)
        sel_t, sel_e = te_t[cp_mask], te_e[cp_mask]
        k = sel_t.size
        for d in range(D):
            rows = np.arange(k)
            r_parts = [rows]
            c_parts = [Rix[d, sel_t, dst[sel_e]]]
            v_parts = [np.ones(k)]
            for a in range(D):
                r_parts.append(rows)
                c_parts.append(Zix[a, sel_t, src[sel_e]])
                v_parts.append(-np.ones(k))
            b.add_rows(
                "dependency",
                k,
                np.concatenate(r_parts),
                np.concatenate(c_parts),
                np.concatenate(v_parts),
                -np.inf,
                0.0,
            )
        local_t, local_e = te_t[~cp_mask], te_e[~cp_mask]
    else:
        local_t, local_e = te_t, te_e
    k = local_t.size
    for d in range(D):
        rows = np.arange(k)
        b.add_rows(
            "dependency_local",
            k,
            np.concatenate([rows, rows, rows]),
            np.concatenate(
                [
                    Rix[d, local_t, dst[local_e]],
                    Rix[d, local_t, src[local_e]],
                    SX[d, local_t, tau[local_e]],
                ]
            ),
            np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
            -np.inf,
            0.0,
        )

    # 6. copies
    Xix = np.full((D, T, E), -1, dtype=np.int64)
    Yix = None
    CP = inst.copy_s
    if multi and mode == "exact":
        sel_t, sel_e = te_t[cp_mask], te_e[cp_mask]
        k = sel_t.size
        for d in range(D):
            Xix[d, sel_t, sel_e] = b.add_vars(k, 0.0, 1.0, False)
            rows = np.arange(k)
            xv, rv = Xix[d, sel_t, sel_e], Rix[d, sel_t, dst[sel_e]]
            ru, su = Rix[d, sel_t, src[sel_e]], Six[d, sel_t, src[sel_e]]
            # X >= R_v - Z_u
            b.add_rows(
                "copy_lb",
                k,
                np.concatenate([rows] * 4),
                np.concatenate([rv, ru, su, xv]),
                np.concatenate([np.ones(k), -np.ones(k), -np.ones(k), -np.ones(k)]),
                -np.inf,
                0.0,
            )
            # X <= R_v
            b.add_rows(
                "copy_ub_r",
                k,
                np.concatenate([rows] * 2),
                np.concatenate([xv, rv]),
                np.concatenate([np.ones(k), -np.ones(k)]),
                -np.inf,
                0.0,
            )
            # X <= 1 - Z_u
            b.add_rows(
                "copy_ub_z",
                k,
                np.concatenate([rows] * 3),
                np.concatenate([xv, ru, su]),
                1.0,
                -np.inf,
                1.0,
            )
        if D == 2:
            for d in range(D):
                a = 1 - d
                b.add_objective(Xix[d, sel_t, sel_e], CP[a, d, src[sel_e]] / time_scale)
        else:
            Yix = np.full((D, D, T, E), -1, dtype=np.int64)
            for d in range(D):
                others = [a for a in range(D) if a != d]
                for a in others:
                    Yix[a, d, sel_t, sel_e] = b.add_vars(k, 0.0, 1.0, False)
                    b.add_objective(Yix[a, d, sel_t, sel_e], CP[a, d, src[sel_e]] / time_scale)
                    rows = np.arange(k)
                    b.add_rows(
                        "copy_source",
                        k,
                        np.concatenate([rows] * 3),
                        np.concatenate(
                            [
                                Yix[a, d, sel_t, sel_e],
                                Rix[a, sel_t, src[sel_e]],
                                Six[a, sel_t, src[sel_e]],
                            ]
                        ),
                        np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
                        -np.inf,
                        0.0,
                    )
                rows = np.arange(k)
                r_parts = [rows] + [rows] * len(others)
                c_parts = [Xix[d, sel_t, sel_e]] + [Yix[a, d, sel_t, sel_e] for a in others]
                v_parts = [-np.ones(k)] + [np.ones(k)] * len(others)
                b.add_rows(
                    "copy_cover",
                    k,
                    np.concatenate(r_parts),
                    np.concatenate(c_parts),
                    np.concatenate(v_parts),
                    0.0,
                    np.inf,
                )
    elif multi and mode == "paper":
        sel_t, sel_e = te_t[cp_mask], te_e[cp_mask]
        k = sel_t.size
        for dp in range(D):  # consumer device d'
            for d in range(D):  # holder device d
                if d == dp:
                    continue
                coef = CP[d, dp, src[sel_e]] / time_scale
                rv = Rix[dp, sel_t, dst[sel_e]]
                zu = Zix[d, sel_t, src[sel_e]]
                if linearize:
                    w = b.add_vars(k, 0.0, 1.0, False)
                    rows = np.arange(k)
                    b.add_rows(
                        "copy_and",
                        k,
                        np.concatenate([rows] * 3),
                        np.concatenate([w, rv, zu]),
                        np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
                        -1.0,
                        np.inf,
                    )
                    b.add_objective(w, coef)
                else:
                    b.add_products(rv, zu, coef)

    # 7. FREE[d,t,(u,v)] = AND of conditions, each a sum of R/S columns:
    #    "pos" conditions hold when the sum is 1 (v runs: A_v; exact multi-device: u is on d,
    #    Z_u = R + S), "neg" ones when it is 0 (u kept on d for t+1; each later reader j of u
    #    runs in stage t). Hazard count (Checkmate): h = sum(1 - pos) + sum(neg),
    #    1 - F <= h <= kappa (1 - F), F binary. Tight: F >= 1 - h, F <= each condition.
    tight = free_rows == "tight"
    Fix = np.full((D, T, E), -1, dtype=np.int64)
    later_lists = tz.later
    by_edge = [np.flatnonzero(te_e == e) for e in range(E)]
    for d in range(D):
        Fix[d, te_t, te_e] = b.add_vars(n_te, 0, 1, not tight)
    row = np.arange(n_te)
    devs_all = range(D) if mode == "exact" else None
    for d in range(D):
        fcol = Fix[d, te_t, te_e]
        devs_a = devs_all if devs_all is not None else [d]
        # conditions: (kind, local rows, [column arrays summed])
        conds: list[tuple[str, np.ndarray, list[np.ndarray]]] = [
            ("pos", row, [Rix[a, te_t, dst[te_e]] for a in devs_a])
        ]
        has_next = np.flatnonzero(te_t + 1 < T)
        conds.append(("neg", has_next, [SX[d, te_t[has_next] + 1, tau[te_e[has_next]]]]))
        # later readers j with dst < j <= t (reference: every later reader, as published;
        # R[t, j] = 0 for j > t by the stage rows)
        for e in range(E):
            for j in later_lists[e]:
                sel = by_edge[e] if reference else by_edge[e][te_t[by_edge[e]] >= j]
                if sel.size:
                    conds.append(("neg", sel, [Rix[a, te_t[sel], j] for a in devs_a]))
        if multi and mode == "exact":
            conds.append(("pos", row, [Rix[d, te_t, src[te_e]], SX[d, te_t, tau[te_e]]]))
        elif multi:
            # paper mode, per device: only a device that holds u can free it. Without this a
            # device running a reader of a remote u would be credited with freeing bytes it
            # never held (the published rows were summed over devices, which hid it). A state
            # is on d when it is made or kept there (R + SA <= 1).
            is_st = tau[te_e] >= n
            vr, sr = row[~is_st], row[is_st]
            conds.append(("pos", vr, [Zix[d, te_t[vr], src[te_e[vr]]]]))
            if sr.size:
                conds.append(
                    ("pos", sr, [Rix[d, te_t[sr], src[te_e[sr]]], SX[d, te_t[sr], tau[te_e[sr]]]])
                )
        hconst = np.zeros(n_te)  # h = hconst + lin
        kappa = np.zeros(n_te)
        lin_r, lin_c, lin_v = [], [], []
        for kind, rows_c, cols in conds:
            kappa[rows_c] += 1.0
            if kind == "pos":
                hconst[rows_c] += 1.0
            for c in cols:
                lin_r.append(rows_c)
                lin_c.append(c)
                lin_v.append(np.full(rows_c.size, -1.0 if kind == "pos" else 1.0))
        lr, lc, lv = np.concatenate(lin_r), np.concatenate(lin_c), np.concatenate(lin_v)
        # 1 - F <= h   <=>  -F - lin <= hconst - 1   (F >= sum of conditions - (k - 1))
        b.add_rows(
            "free_a",
            n_te,
            np.concatenate([row, lr]),
            np.concatenate([fcol, lc]),
            np.concatenate([-np.ones(n_te), -lv]),
            -np.inf,
            hconst - 1.0,
        )
        if not tight:
            # kappa (1 - F) >= h   <=>  -kappa F - lin >= hconst - kappa
            b.add_rows(
                "free_b",
                n_te,
                np.concatenate([row, lr]),
                np.concatenate([fcol, lc]),
                np.concatenate([-kappa, -lv]),
                hconst - kappa,
                np.inf,
            )
            continue
        for kind, rows_c, cols in conds:
            k = rows_c.size
            local = np.arange(k)
            sign = -1.0 if kind == "pos" else 1.0  # F - sum <= 0  |  F + sum <= 1
            b.add_rows(
                "free_le_" + kind,
                k,
                np.concatenate([local] * (1 + len(cols))),
                np.concatenate([fcol[rows_c]] + cols),
                np.concatenate([np.ones(k)] + [np.full(k, sign)] * len(cols)),
                -np.inf,
                0.0 if kind == "pos" else 1.0,
            )

    # 8. memory
    Uix = alloc(tri_le, 0.0, 0.0, False)
    ub = np.concatenate([np.full(int(tri_le.sum()), budgets[d]) for d in range(D)])
    lbv = np.zeros_like(ub)
    # set U bounds: [0, B_d]
    allU = np.concatenate([Uix[d][tri_le] for d in range(D)])
    model_lb_fix = (allU, lbv, ub)
    freed_by_node: list[list[int]] = [[] for _ in range(n)]
    for e in range(E):
        freed_by_node[dst[e]].append(e)
    for d in range(D):
        # k = 0 rows: U[d,t,0] - m0 R[d,t,0] - sum_{i<t} m_i S[d,t,i] - states kept = 0
        r0, c0, v0 = [np.arange(T)], [Uix[d, :, 0]], [np.ones(T)]
        r0.append(np.arange(T))
        c0.append(Rix[d, :, 0])
        v0.append(np.full(T, -madeb[0]))
        st, si = np.nonzero(tri_lt)
        r0.append(st)
        c0.append(Six[d, st, si])
        v0.append(-mb[si])
        if Aix is not None:
            at, ai = np.nonzero(Aix[d] >= 0)
            r0.append(at)
            c0.append(Aix[d, at, ai])
            v0.append(-(madeb - mb)[ai])
        b.add_rows(
            "mem_init", T, np.concatenate(r0), np.concatenate(c0), np.concatenate(v0), 0.0, 0.0
        )
        # k >= 1: U[d,t,k] - U[d,t,k-1] - m_k R[d,t,k] + sum_{e into k-1} m_src F[d,t,e] = 0
        kt, kk = np.nonzero(tri_le & (np.arange(n)[None, :] >= 1))
        nk = kt.size
        rows = np.arange(nk)
        rr = [rows, rows, rows]
        cc = [Uix[d, kt, kk], Uix[d, kt, kk - 1], Rix[d, kt, kk]]
        vv = [np.ones(nk), -np.ones(nk), -madeb[kk]]
        # frees of edges into node k-1 in stage t
        pos = {(int(a), int(c)): r for r, (a, c) in enumerate(zip(kt, kk, strict=True))}
        fr, fc, fv = [], [], []
        for t_, e_ in zip(te_t, te_e, strict=True):
            r = pos.get((int(t_), int(dst[e_]) + 1))
            if r is not None:
                fr.append(r)
                fc.append(Fix[d, t_, e_])
                fv.append(mtb[tau[e_]])
        rr.append(np.array(fr, dtype=np.int64))
        cc.append(np.array(fc, dtype=np.int64))
        vv.append(np.array(fv, dtype=float))
        b.add_rows(
            "mem_step", nk, np.concatenate(rr), np.concatenate(cc), np.concatenate(vv), 0.0, 0.0
        )
        # budget rows with transient copies and workspace where they exist
        kt, kk = np.nonzero(tri_le)
        trans = wb[d, kk] > 0
        if multi and mode == "exact":
            has_copy_in = np.zeros(n, dtype=bool)
            has_copy_in[dst[copyable]] = True
            trans |= has_copy_in[kk]
        sel = np.flatnonzero(trans)
        if sel.size:
            pos = {(int(kt[s]), int(kk[s])): r for r, s in enumerate(sel)}
            rr = [np.arange(sel.size), np.arange(sel.size)]
            cc = [Uix[d, kt[sel], kk[sel]], Rix[d, kt[sel], kk[sel]]]
            vv = [np.ones(sel.size), wb[d, kk[sel]]]
            if multi and mode == "exact":
                xr, xc, xv = [], [], []
                for t_, e_ in zip(te_t[cp_mask], te_e[cp_mask], strict=True):
                    r = pos.get((int(t_), int(dst[e_])))
                    if r is not None:
                        xr.append(r)
                        xc.append(Xix[d, t_, e_])
                        xv.append(mb[src[e_]])
                rr.append(np.array(xr, dtype=np.int64))
                cc.append(np.array(xc, dtype=np.int64))
                vv.append(np.array(xv, dtype=float))
            b.add_rows(
                "budget",
                sel.size,
                np.concatenate(rr),
                np.concatenate(cc),
                np.concatenate(vv),
                -np.inf,
                budgets[d],
            )

    # objective: compute cost
    for d in range(D):
        b.add_objective(Rix[d, tt, ii], Cs[d, ii])

    model = b.build()
    model.lb[model_lb_fix[0]] = model_lb_fix[1]
    model.ub[model_lb_fix[0]] = model_lb_fix[2]
    f = Formulation(
        inst=inst,
        mode=mode,
        model=model,
        Rix=Rix,
        Six=Six,
        Fix=Fix,
        Xix=Xix,
        Uix=Uix,
        Zix=Zix,
        mem_scale=mem_scale,
        time_scale=time_scale,
        build_time_s=time.perf_counter() - t0,
        edges=edges,
        Aix=Aix,
    )
    f._Yix = Yix
    if blocked_nodes.size:
        least = footprint.min(axis=0)
        v = int(blocked_nodes[np.argmax(least[blocked_nodes])])
        f.blocked = (g.nodes[v].name, int(least[v]))
    log.info(
        "built %s: %d vars (%d integer), %d rows, %d nonzeros in %.2f s",
        model.name,
        model.n_vars,
        model.n_integer,
        model.n_rows,
        model.A.nnz,
        f.build_time_s,
    )
    return f
