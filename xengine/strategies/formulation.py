"""The XEngine mixed-integer model over D devices (Schuler et al., TACO 2022, section 4).

With one device it is exactly Checkmate's MILP (Jain et al., MLSys 2020, eq. 1-9):
frontier-advancing stages, binary R, S, FREE with the hazard-count linearisation, and the
memory recurrence U. The device index adds, per docs/design.md section 6:

``mode="exact"`` (default): linear and exact with respect to :mod:`xengine.simulate`.
    * ``R + S <= 1`` per device (the simulator rejects recomputing a value where it is
      resident), so the presence ``Z = R + S`` is linear without a helper variable;
    * a node may run on several devices in one stage, as the simulator allows (computing a
      cheap op with a large output on both devices can beat copying it to each reader); the
      helper ``P[t,i] = OR_d R[d,t,i]`` ("i runs somewhere in stage t") carries the rows that
      ask whether a node runs at all (frontier, dependencies, FREE), so that every schedule
      the simulator accepts is a point of the model at its simulated time and peak;
    * a copy indicator ``X[d,t,(u,v)] = R[d,t,v] AND NOT Z[d,t,u]``, charged once at the
      cheapest holder's copy cost (for D >= 3 a source ``Y`` that is exactly the holder the
      simulator picks) and counted as transient memory on the receiving device while ``v``
      runs;
    * FREE per device: ``u`` leaves device ``d`` after its last reader in the stage on *any*
      device, unless ``d`` keeps it for the next stage (the simulator's rule).
``mode="paper"``: the published MIQP, its copy term ``c * R[d',t,v] * Z[d,t,u]`` charged for
    every other device holding ``u`` and no memory for copies, with per-device hazard rows.
    It does *not* copy the released code's defects (shared/reference/xengine-paper-and-code.md
    section 1.6): initial memory and FREE rows are per device, the freed amount is the
    predecessor's size, and copy costs are read src -> dst. ``linearize=True`` replaces the
    product by an AND variable ``W >= R + Z - 1`` for solvers without products (HiGHS).

Autograd states (docs/design.md section 3) are tensors of their own: state ``k`` of forward node
``v`` has its residency ``SA[d,t,k]`` (``Aix``), is made by every ``R[d,t,v]``, is read only by
``B_v`` over a local (non-copyable) edge and is freed by the same FREE rows as a value, with
``R[d,t,v] + SA[d,t,k] <= 1`` (keeping a state into a stage that makes it anew never helps
and the simulator rejects it). The rows below run over *tensors* (values, then states) where
they are about residency and freeing, and over nodes where they are about computing. Value
edges with ``copyable=False`` (version-1 graphs) are local in both modes too.

The default model is the reduced form of the published one, never a different optimum: it
allocates only the triangle (R for i <= t, S for i < t, U up to the frontier), fixes the
frontier by bounds on one device and fixes R at zero on devices whose budget cannot hold a
node. The published form (full T x n matrices, the stage structure as rows) and the
symmetry-broken form are experiments' variants, built from the same row families by
``experiments/formulation_variants.py``.

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

How it is built: :func:`start` sets the scaled data and which cells get variables, one
``add_*`` function per row family adds its columns and rows in a fixed order (the order is
part of the model: warm starts and solver logs index by it), and :func:`finish` emits the
:class:`Formulation`. :func:`build` is that composition. Equation numbers: Checkmate's 1-9
as docs/design.md section 6 numbers them (1 objective, 2 dependencies, 3 persistence, 4 memory at
a stage's start, 5 memory recurrence, 6 FREE, 7 its hazard-count linearisation, 8 the
frontier-advancing stages, 9 the budget); XEngine's constraints 1-11 as
shared/reference/xengine-paper-and-code.md section 1.4 numbers them (the paper's section 4
model, read from its figure and its code).
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
    Pix: np.ndarray | None = None  # (T, n) "runs on some device" (exact mode, D >= 2), or -1
    Kix: np.ndarray | None = None  # (D, T) the loss lets go of the logits, or -1

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
        if self.Kix is not None:
            u = g.released_logits
            K = np.where(self.Kix >= 0, x[np.maximum(self.Kix, 0)], 0.0)
            extra[:, :, u + 1] += (R[:, :, u + 1] - K) * g.output_bytes[u]
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
        if self.Pix is not None:
            pairs.append((self.Pix, (R.sum(axis=0) > 0.5).astype(float)))
        if self.Kix is not None:
            u = g.released_logits
            kept = np.concatenate([S[:, 1:, u], np.zeros((D, 1))], axis=1)  # S[d,t+1,u]
            alone = R[:, :, u + 1].sum(axis=0, keepdims=True) == 1
            pairs.append((self.Kix, ((R[:, :, u + 1] > 0.5) & (kept < 0.5) & alone).astype(float)))
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


@dataclass
class Draft:
    """The model while its row families are added: :func:`start` makes it, each ``add_*``
    function adds its columns and rows, :func:`finish` turns it into a :class:`Formulation`.

    Memory is counted in units of ``mem_scale`` bytes (the largest tensor: ``*_mu`` arrays)
    and time in units of ``time_scale`` seconds (the slowest op: ``*_tu``), so coefficients
    stay near 1, where the solvers' tolerances are meant to work. Index arrays hold a
    variable's column, or -1 where the variable does not exist (the builder drops those
    entries from rows), and are ``None`` until their family has run.
    """

    inst: Instance
    mode: str
    linearize: bool
    tight: bool  # free_rows == "tight"
    b: ModelBuilder
    started_s: float  # time.perf_counter() when the build started
    edges: tuple  # value edges, then state edges: the E axis
    tz: _Tensors
    src: np.ndarray  # (E,) the node that makes the tensor an edge reads
    dst: np.ndarray  # (E,) the node that reads it
    copyable: np.ndarray  # (E,) bool
    r_cells: np.ndarray  # (T, n) bool: where R, Z and U have columns
    s_cells: np.ndarray  # (T, n) bool: where S has columns
    te_t: np.ndarray  # the (stage, edge) pairs that get FREE and dependency rows
    te_e: np.ndarray
    mem_scale: float
    time_scale: float
    value_mu: np.ndarray  # (n,) each node's value
    made_mu: np.ndarray  # (n,) what computing node k leaves: its value and its state
    tensor_mu: np.ndarray  # (n_tensors,) values, then states
    workspace_mu: np.ndarray  # (D, n)
    budget_mu: np.ndarray  # (D,)
    compute_tu: np.ndarray  # (D, n)
    copy_tu: np.ndarray  # (D, D, n) copying node i's value from device a to device b
    footprint_bytes: np.ndarray  # (D, n) what must be on a device at once to run a node
    cannot_run: np.ndarray  # (D, n) bool: the footprint exceeds the device's budget
    Rix: np.ndarray | None = None
    Six: np.ndarray | None = None
    Aix: np.ndarray | None = None  # states' residency (graphs with states)
    SXix: np.ndarray | None = None  # (D, T, n_tensors) residency of every tensor: S, then SA
    Zix: np.ndarray | None = None  # presence, paper mode with D >= 2
    Pix: np.ndarray | None = None  # (T, n) runs on some device: exact mode with D >= 2
    Kix: np.ndarray | None = None  # (D, T) the loss lets go of the logits (Graph.released_logits)
    Xix: np.ndarray | None = None
    Yix: np.ndarray | None = None  # (D, D, T, E) copy source, exact mode with D >= 3
    Fix: np.ndarray | None = None
    Uix: np.ndarray | None = None

    @property
    def D(self) -> int:
        return self.inst.n_devices

    @property
    def T(self) -> int:
        return self.r_cells.shape[0]

    @property
    def multi(self) -> bool:
        return self.inst.n_devices >= 2

    @property
    def blocked_nodes(self) -> np.ndarray:
        """Nodes that fit on no device: the model is infeasible as built."""
        return np.flatnonzero(self.cannot_run.all(axis=0))

    def alloc(self, cells: np.ndarray, lb: float, ub: float, integer: bool) -> np.ndarray:
        """One variable per device and cell, device by device: a (D, *cells.shape) index."""
        ix = np.full((self.D,) + cells.shape, -1, dtype=np.int64)
        count = int(cells.sum())
        for d in range(self.D):
            ix[d][cells] = self.b.add_vars(count, lb, ub, integer)
        return ix


def start(
    inst: Instance,
    mode: str = "exact",
    linearize: bool = True,
    free_rows: str = "hazard",
    full_matrices: bool = False,
    name: str | None = None,
) -> Draft:
    """An empty model for ``inst``: the data scaled to the model's units, and the cells that
    get variables.

    ``full_matrices`` gives every (t, i) and (t, e) its variables and rows, as Checkmate and
    XEngine publish the model; the stage structure (eq. 8) is then left to rows the caller
    adds. By default only the cells that eq. 8 leaves free get any: R for i <= t, S for
    i < t, FREE and dependency rows for edges whose reader is at or before the frontier.
    """
    if mode not in MODES:
        raise ValueError(f"formulation mode {mode!r} is not one of {MODES}")
    if free_rows not in FREE_ROWS:
        raise ValueError(f"free_rows {free_rows!r} is not one of {FREE_ROWS}")
    started_s = time.perf_counter()
    g = inst.graph
    D, n = inst.n_devices, g.size
    T = n
    edges = g.value_edges + g.state_edges
    tz = _tensors(g, edges)
    m = g.output_bytes.astype(float)
    mem_scale = float(max(tz.bytes.max(), 1.0))
    time_scale = float(max(inst.compute_s.max(), 1e-12))
    src = np.array([e.src for e in edges], dtype=np.int64)
    dst = np.array([e.dst for e in edges], dtype=np.int64)
    if full_matrices:
        r_cells = s_cells = np.ones((T, n), dtype=bool)
        te_t, te_e = np.nonzero(np.ones((T, len(edges)), dtype=bool))
    else:
        r_cells = np.tril(np.ones((T, n), dtype=bool))
        s_cells = np.tril(np.ones((T, n), dtype=bool), k=-1)
        te_t, te_e = np.nonzero(dst[None, :] <= np.arange(T)[:, None])
    footprint = np.stack([g.node_lower_bound_bytes(dv) for dv in inst.devices])
    tag = "-tight" if free_rows == "tight" else ""
    return Draft(
        inst=inst,
        mode=mode,
        linearize=linearize,
        tight=free_rows == "tight",
        b=ModelBuilder(name or f"xengine-{mode}{tag}-{g.name}-D{D}"),
        started_s=started_s,
        edges=edges,
        tz=tz,
        src=src,
        dst=dst,
        copyable=np.array([e.copyable for e in edges], dtype=bool),
        r_cells=r_cells,
        s_cells=s_cells,
        te_t=te_t,
        te_e=te_e,
        mem_scale=mem_scale,
        time_scale=time_scale,
        value_mu=m / mem_scale,
        made_mu=(m + g.state_bytes) / mem_scale,
        tensor_mu=tz.bytes / mem_scale,
        workspace_mu=inst.workspace_bytes.astype(float) / mem_scale,
        budget_mu=np.minimum(inst.budgets.astype(float) / mem_scale, 1e12),
        compute_tu=inst.compute_s / time_scale,
        copy_tu=inst.copy_s / time_scale,
        footprint_bytes=footprint,
        cannot_run=footprint > inst.budgets[:, None],
    )


def add_variables(dr: Draft) -> None:
    """R (compute) and S (keep) per device, stage and node, the states' residency SA, and in
    paper mode with several devices the presence Z (the variables of XEngine's section 4).

    SA runs over the triangle even in the published form: states are ours, not the papers',
    and a state can only be kept into a stage after the one that made it.
    """
    g, n = dr.inst.graph, dr.inst.graph.size
    dr.Rix = dr.alloc(dr.r_cells, 0, 1, True)
    dr.Six = dr.alloc(dr.s_cells, 0, 1, True)
    dr.SXix = dr.Six
    if g.has_states:
        has_state = np.zeros(n, dtype=bool)
        has_state[dr.tz.state_nodes] = True
        below = np.tril(np.ones((dr.T, n), dtype=bool), k=-1)
        dr.Aix = dr.alloc(below & has_state[None, :], 0, 1, True)
        dr.SXix = np.concatenate([dr.Six, dr.Aix[:, :, dr.tz.state_nodes]], axis=2)
    if dr.mode == "paper" and dr.multi:
        dr.Zix = dr.alloc(dr.r_cells, 0, 1, True)
    if dr.mode == "exact" and dr.multi:
        # continuous with the tight FREE rows (implied integer: it is an OR of binaries),
        # binary with the hazard rows, which CP-SAT takes only over integer columns
        dr.Pix = np.full(dr.r_cells.shape, -1, dtype=np.int64)
        dr.Pix[dr.r_cells] = dr.b.add_vars(int(dr.r_cells.sum()), 0, 1, not dr.tight)


def runs_somewhere(dr: Draft) -> list[np.ndarray]:
    """The columns whose sum says "node runs on some device in this stage", indexed like
    ``Rix[0]``: the helper P in exact mode with several devices, R itself with one device,
    R of each device in paper mode (where at most one device runs a node in a stage)."""
    if dr.Pix is not None:
        return [dr.Pix]
    return [dr.Rix[d] for d in range(dr.D)]


def add_frontier_rows(dr: Draft) -> None:
    """Node t runs in stage t: Checkmate's frontier-advancing stages (eq. 8, R[t,t] = 1) with
    XEngine's device index (constraint 2, ``sum_d R[d,t,t] = 1``).

    Stage t exists to compute node t, so every schedule runs each node at least once and in
    order, which is what makes one stage per node enough. The paper says one device; the
    exact model says at least one (``P[t,t] = 1`` by its bounds, with ``P <= sum_d R``), as
    the simulator does: a second computation of the frontier on another device can save a
    copy to each of its readers there.
    """
    T = dr.T
    if dr.Pix is not None:
        dr.b.fix(dr.Pix[np.arange(T), np.arange(T)], 1.0)
        return
    dr.b.add_rows(
        "frontier",
        T,
        np.repeat(np.arange(T), dr.D),
        dr.Rix[:, np.arange(T), np.arange(T)].T.ravel(),
        1.0,
        1.0,
        1.0,
    )


def fix_by_bounds(dr: Draft) -> None:
    """The default model's reductions, as bounds rather than rows, so that presolve drops the
    columns instead of the solver proving them.

    With one device the frontier row leaves R[t,t] = 1 only (unless some node fits nowhere:
    that model is infeasible as built, and the row says so). A node runs only on a device
    whose budget holds its inputs, output and workspace at once (every input must be on the
    running device, resident or copied), so R is zero elsewhere in every feasible schedule.
    """
    T = dr.T
    if dr.D == 1 and not dr.blocked_nodes.size:
        dr.b.fix(dr.Rix[0, np.arange(T), np.arange(T)], 1.0)
    for d in range(dr.D):
        cols = np.flatnonzero(dr.cannot_run[d])
        if cols.size:
            dr.b.fix(dr.Rix[d][:, cols].ravel(), 0.0)


def add_presence_rows(dr: Draft) -> None:
    """What "present on device d in stage t" means: ``R + S`` in exact mode
    (:func:`_exclusive_rows`), with "runs somewhere" as the OR helper P
    (:func:`_runs_somewhere_rows`); the helper Z in paper mode (:func:`_or_rows`). One device
    in paper mode needs neither: Checkmate reads R and S directly."""
    if dr.mode == "exact":
        _exclusive_rows(dr)
        _runs_somewhere_rows(dr)
    elif dr.multi:
        _or_rows(dr)


def _runs_somewhere_rows(dr: Draft) -> None:
    """``P[t,i] = OR_d R[d,t,i]`` as ``P >= R[d,t,i]`` for each d and ``P <= sum_d R[d,t,i]``
    (ours): at integer R, P is 0 or 1 exactly as the node runs nowhere or somewhere, however
    many devices run it."""
    if dr.Pix is None:
        return
    tt, ii = np.nonzero(dr.r_cells)
    k = tt.size
    rows = np.arange(k)
    for d in range(dr.D):
        dr.b.add_rows(
            "runs_ge",
            k,
            np.concatenate([rows, rows]),
            np.concatenate([dr.Pix[tt, ii], dr.Rix[d, tt, ii]]),
            np.concatenate([np.ones(k), -np.ones(k)]),
            0.0,
            np.inf,
        )
    dr.b.add_rows(
        "runs_le",
        k,
        np.concatenate([rows] * (1 + dr.D)),
        np.concatenate([dr.Pix[tt, ii]] + [dr.Rix[d, tt, ii] for d in range(dr.D)]),
        np.concatenate([np.ones(k)] + [-np.ones(k)] * dr.D),
        -np.inf,
        0.0,
    )


def _exclusive_rows(dr: Draft) -> None:
    """``R[d,t,i] + S[d,t,i] <= 1`` below the frontier, per device (ours, not in either paper).

    It is the simulator's rule (a value resident on a device is not computed there again),
    and it keeps the presence ``R + S`` binary, so the copy indicator and the FREE rows can
    use it without a helper variable or a product. Several devices may compute one node in
    one stage: no row forbids it (docs/design.md section 6 says why none may).
    """
    lt_t, lt_i = np.nonzero(dr.s_cells)
    k = lt_t.size
    rows = np.arange(k)
    for d in range(dr.D):
        dr.b.add_rows(
            "presence",
            k,
            np.concatenate([rows, rows]),
            np.concatenate([dr.Rix[d, lt_t, lt_i], dr.Six[d, lt_t, lt_i]]),
            1.0,
            -np.inf,
            1.0,
        )


def _or_rows(dr: Draft) -> None:
    """``Z = R OR S`` as three rows per cell (XEngine constraint 6): the published model lets R
    and S be 1 together, so their sum is not binary and the copy product needs Z."""
    tt, ii = np.nonzero(dr.r_cells)
    k = tt.size
    rows = np.arange(k)
    for d in range(dr.D):
        zc, rc, sc = dr.Zix[d, tt, ii], dr.Rix[d, tt, ii], dr.Six[d, tt, ii]
        for name, other in (("z_ge_r", rc), ("z_ge_s", sc)):  # Z >= R, Z >= S
            dr.b.add_rows(
                name,
                k,
                np.concatenate([rows, rows]),
                np.concatenate([zc, other]),
                np.array([1.0] * k + [-1.0] * k),
                0.0,
                np.inf,
            )
        dr.b.add_rows(
            "z_le_rs",
            k,
            np.concatenate([rows, rows, rows]),
            np.concatenate([zc, rc, sc]),
            np.array([1.0] * k + [-1.0] * (2 * k)),
            -np.inf,
            0.0,
        )


def add_persistence_rows(dr: Draft) -> None:
    """``S[d,t+1,i] <= R[d,t,i] + S[d,t,i]``: Checkmate eq. 3, per device as XEngine's
    constraint 4. A value can be kept into the next stage only where it was computed or kept,
    so nothing moves between devices by being kept: a move is a copy, charged as one."""
    p_t, p_i = np.nonzero(dr.r_cells[:-1])
    k = p_t.size
    rows = np.arange(k)
    for d in range(dr.D):
        dr.b.add_rows(
            "persistence",
            k,
            np.concatenate([rows, rows, rows]),
            np.concatenate([dr.Six[d, p_t + 1, p_i], dr.Rix[d, p_t, p_i], dr.Six[d, p_t, p_i]]),
            np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
            -np.inf,
            0.0,
        )


def add_state_rows(dr: Draft) -> None:
    """Eq. 3 for autograd states (ours: neither paper has states): a state persists only
    where it was (``SA[d,t+1,v] <= R[d,t,v] + SA[d,t,v]``) and is never kept into a stage
    that makes it anew (``R[d,t,v] + SA[d,t,v] <= 1``), which the simulator rejects because
    the computation would overwrite the kept state."""
    if dr.Aix is None:
        return
    Rix, Aix = dr.Rix, dr.Aix
    at, ai = np.nonzero(Aix[0] >= 0)  # t > v for a forward node v with a state
    k = at.size
    rows = np.arange(k)
    for d in range(dr.D):
        dr.b.add_rows(
            "state_persistence",
            k,
            np.concatenate([rows, rows, rows]),
            np.concatenate([Aix[d, at, ai], Rix[d, at - 1, ai], Aix[d, at - 1, ai]]),
            np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
            -np.inf,
            0.0,
        )
        dr.b.add_rows(
            "state_presence",
            k,
            np.concatenate([rows, rows]),
            np.concatenate([Rix[d, at, ai], Aix[d, at, ai]]),
            1.0,
            -np.inf,
            1.0,
        )


def add_dependency_rows(dr: Draft) -> None:
    """A node runs only where its inputs are: Checkmate eq. 2 (``R[t,v] <= R[t,u] + S[t,u]``).

    With several devices a copyable input may be on any device, since a copy fetches it
    (XEngine constraint 5): in exact mode one row per (t, e) summed over devices
    (:func:`_any_device_rows_exact`), in paper mode one per consumer device
    (:func:`_any_device_rows_paper`). A local input (an autograd state, or a version-1
    value edge) must be on the running device itself (:func:`_local_dependency_rows`).
    """
    cp_mask = dr.copyable[dr.te_e]
    if not dr.multi:
        cp_mask = np.zeros_like(cp_mask)
    elif dr.mode == "exact":
        _any_device_rows_exact(dr, dr.te_t[cp_mask], dr.te_e[cp_mask])
    else:
        _any_device_rows_paper(dr, dr.te_t[cp_mask], dr.te_e[cp_mask])
    _local_dependency_rows(dr, dr.te_t[~cp_mask], dr.te_e[~cp_mask])


def _any_device_rows_exact(dr: Draft, sel_t: np.ndarray, sel_e: np.ndarray) -> None:
    """``P[t,v] <= sum_d (R[d,t,u] + S[d,t,u])``: v runs somewhere only if u is somewhere.
    One row per read rather than XEngine's one per consumer device: ``R[d,t,v] <= P[t,v]``
    for every d, so it is the same set of schedules with D times fewer rows."""
    k = sel_t.size
    rows = np.arange(k)
    r_parts, c_parts, v_parts = [rows], [dr.Pix[sel_t, dr.dst[sel_e]]], [np.ones(k)]
    for d in range(dr.D):
        r_parts += [rows, rows]
        c_parts += [dr.Rix[d, sel_t, dr.src[sel_e]], dr.Six[d, sel_t, dr.src[sel_e]]]
        v_parts += [-np.ones(k), -np.ones(k)]
    dr.b.add_rows(
        "dependency",
        k,
        np.concatenate(r_parts),
        np.concatenate(c_parts),
        np.concatenate(v_parts),
        -np.inf,
        0.0,
    )


def _any_device_rows_paper(dr: Draft, sel_t: np.ndarray, sel_e: np.ndarray) -> None:
    """``R[d,t,v] <= sum_a Z[a,t,u]`` per consumer device d (XEngine constraint 5, with Z for
    R + S: the published model may have both at 1, and then their sum would count the
    holder twice)."""
    k = sel_t.size
    rows = np.arange(k)
    for d in range(dr.D):
        r_parts = [rows]
        c_parts = [dr.Rix[d, sel_t, dr.dst[sel_e]]]
        v_parts = [np.ones(k)]
        for a in range(dr.D):
            r_parts.append(rows)
            c_parts.append(dr.Zix[a, sel_t, dr.src[sel_e]])
            v_parts.append(-np.ones(k))
        dr.b.add_rows(
            "dependency",
            k,
            np.concatenate(r_parts),
            np.concatenate(c_parts),
            np.concatenate(v_parts),
            -np.inf,
            0.0,
        )


def _local_dependency_rows(dr: Draft, sel_t: np.ndarray, sel_e: np.ndarray) -> None:
    """Checkmate's eq. 2 per device, ``R[d,t,v] <= R[d,t,u] + SX[d,t,tau]``, for reads that no
    copy can serve (one device, autograd states, version-1 local edges); the read tensor
    ``tau`` is a value or a state, made by ``u`` either way."""
    k = sel_t.size
    rows = np.arange(k)
    for d in range(dr.D):
        dr.b.add_rows(
            "dependency_local",
            k,
            np.concatenate([rows, rows, rows]),
            np.concatenate(
                [
                    dr.Rix[d, sel_t, dr.dst[sel_e]],
                    dr.Rix[d, sel_t, dr.src[sel_e]],
                    dr.SXix[d, sel_t, dr.tz.tau[sel_e]],
                ]
            ),
            np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
            -np.inf,
            0.0,
        )


def add_copy_terms(dr: Draft) -> None:
    """The time of copies, XEngine's second objective term; nothing with one device. Exact
    mode charges each copy the simulator makes once (:func:`_copy_indicator_rows`), paper
    mode the published product for every other holder (:func:`_copy_products`)."""
    dr.Xix = np.full((dr.D, dr.T, len(dr.edges)), -1, dtype=np.int64)
    if not dr.multi:
        return
    cp_mask = dr.copyable[dr.te_e]
    sel_t, sel_e = dr.te_t[cp_mask], dr.te_e[cp_mask]
    if dr.mode == "exact":
        _copy_indicator_rows(dr, sel_t, sel_e)
        _charge_copies(dr, sel_t, sel_e)
    else:
        _copy_products(dr, sel_t, sel_e)


def _copy_indicator_rows(dr: Draft, sel_t: np.ndarray, sel_e: np.ndarray) -> None:
    """``X[d,t,(u,v)] = R[d,t,v] AND NOT Z[d,t,u]`` with ``Z = R + S`` (ours, in place of
    XEngine's product): ``X >= R_v - Z_u``, ``X <= R_v``, ``X <= 1 - Z_u``.

    It is 1 exactly when the simulator copies ``u`` to ``d`` for ``v``: a copy is made only
    when the reader's device lacks the value. The lower row is what the objective presses
    against; the upper rows make X the indicator at every feasible point, not only at an
    optimum, so that an incumbent returned at a time limit (or a copy that costs nothing)
    still reads as the simulator's copies, in time and in the receiving device's memory.
    """
    k = sel_t.size
    rows = np.arange(k)
    for d in range(dr.D):
        dr.Xix[d, sel_t, sel_e] = dr.b.add_vars(k, 0.0, 1.0, False)
        xv, rv = dr.Xix[d, sel_t, sel_e], dr.Rix[d, sel_t, dr.dst[sel_e]]
        ru, su = dr.Rix[d, sel_t, dr.src[sel_e]], dr.Six[d, sel_t, dr.src[sel_e]]
        dr.b.add_rows(
            "copy_lb",
            k,
            np.concatenate([rows] * 4),
            np.concatenate([rv, ru, su, xv]),
            np.concatenate([np.ones(k), -np.ones(k), -np.ones(k), -np.ones(k)]),
            -np.inf,
            0.0,
        )
        dr.b.add_rows(
            "copy_ub_r",
            k,
            np.concatenate([rows] * 2),
            np.concatenate([xv, rv]),
            np.concatenate([np.ones(k), -np.ones(k)]),
            -np.inf,
            0.0,
        )
        dr.b.add_rows(
            "copy_ub_z",
            k,
            np.concatenate([rows] * 3),
            np.concatenate([xv, ru, su]),
            1.0,
            -np.inf,
            1.0,
        )


def _charge_copies(dr: Draft, sel_t: np.ndarray, sel_e: np.ndarray) -> None:
    """The cost of each copy X, from the cheapest device that holds the value (the
    simulator's choice, XEngine's objective read src -> dst).

    With two devices the source is the other one, so X carries its cost directly. With more,
    a source variable ``Y[a,d,t,e] <= Z[a,t,u]`` per other device, ``sum_a Y = X`` (one source
    per copy, none without one) and ``Y[a] + Z[b] <= 1`` wherever b is the simulator's
    preferred source over a (cheaper, or as cheap and first in the mix): at every integer
    point, incumbents included, Y is the simulator's source, so the objective is the
    simulator's copy time (:func:`_cheapest_source_rows`).
    """
    k = sel_t.size
    rows = np.arange(k)
    src = dr.src[sel_e]
    if dr.D == 2:
        for d in range(2):
            dr.b.add_objective(dr.Xix[d, sel_t, sel_e], dr.copy_tu[1 - d, d, src])
        return
    dr.Yix = np.full((dr.D, dr.D, dr.T, len(dr.edges)), -1, dtype=np.int64)
    for d in range(dr.D):
        others = [a for a in range(dr.D) if a != d]
        for a in others:
            dr.Yix[a, d, sel_t, sel_e] = dr.b.add_vars(k, 0.0, 1.0, False)
            dr.b.add_objective(dr.Yix[a, d, sel_t, sel_e], dr.copy_tu[a, d, src])
            dr.b.add_rows(
                "copy_source",
                k,
                np.concatenate([rows] * 3),
                np.concatenate(
                    [dr.Yix[a, d, sel_t, sel_e], dr.Rix[a, sel_t, src], dr.Six[a, sel_t, src]]
                ),
                np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
                -np.inf,
                0.0,
            )
        dr.b.add_rows(
            "copy_cover",
            k,
            np.concatenate([rows] * (1 + len(others))),
            np.concatenate(
                [dr.Xix[d, sel_t, sel_e]] + [dr.Yix[a, d, sel_t, sel_e] for a in others]
            ),
            np.concatenate([-np.ones(k)] + [np.ones(k)] * len(others)),
            0.0,
            0.0,
        )
        _cheapest_source_rows(dr, d, others, sel_t, sel_e)


def _cheapest_source_rows(
    dr: Draft, d: int, others: list[int], sel_t: np.ndarray, sel_e: np.ndarray
) -> None:
    """``Y[a,d,t,e] + R[b,t,u] + S[b,t,u] <= 1`` for each source a and each device b that the
    simulator prefers to a for copying u into d (``min`` over ``(copy time, device)``): a
    copy never comes from a holder while a preferred one holds the value."""
    src = dr.src[sel_e]
    for a in others:
        for b in others:
            if a == b:
                continue
            cost_a, cost_b = dr.copy_tu[a, d, src], dr.copy_tu[b, d, src]
            sel = np.flatnonzero((cost_b < cost_a) | ((cost_b == cost_a) & (b < a)))
            k = sel.size
            if not k:
                continue
            rows = np.arange(k)
            t_, e_, u_ = sel_t[sel], sel_e[sel], src[sel]
            dr.b.add_rows(
                "copy_cheapest",
                k,
                np.concatenate([rows] * 3),
                np.concatenate([dr.Yix[a, d, t_, e_], dr.Rix[b, t_, u_], dr.Six[b, t_, u_]]),
                1.0,
                -np.inf,
                1.0,
            )


def _copy_products(dr: Draft, sel_t: np.ndarray, sel_e: np.ndarray) -> None:
    """XEngine's copy term ``c_{d->d'} R[d',t,v] Z[d,t,u]`` for every holder d other than the
    consumer d', as published (a copy is charged even when d' holds u too). With
    ``linearize`` the product becomes ``W >= R + Z - 1`` (only this row: W is charged, so the
    minimum keeps it at the product) for solvers that take no products."""
    k = sel_t.size
    rows = np.arange(k)
    for dp in range(dr.D):  # consumer device d'
        for d in range(dr.D):  # holder device d
            if d == dp:
                continue
            coef = dr.copy_tu[d, dp, dr.src[sel_e]]
            rv = dr.Rix[dp, sel_t, dr.dst[sel_e]]
            zu = dr.Zix[d, sel_t, dr.src[sel_e]]
            if not dr.linearize:
                dr.b.add_products(rv, zu, coef)
                continue
            w = dr.b.add_vars(k, 0.0, 1.0, False)
            dr.b.add_rows(
                "copy_and",
                k,
                np.concatenate([rows] * 3),
                np.concatenate([w, rv, zu]),
                np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
                -1.0,
                np.inf,
            )
            dr.b.add_objective(w, coef)


def add_free_rows(dr: Draft, every_later_reader: bool = False) -> None:
    """FREE[d,t,(u,v)]: the read tensor leaves device d once v has run in stage t (Checkmate
    eq. 6), so the memory recurrence can give its bytes back.

    FREE is the AND of conditions, each a sum of R/S columns (:func:`_free_conditions`):
    "pos" ones hold when their sum is 1, "neg" ones when it is 0. It is written either with
    Checkmate's hazard count (eq. 7, ``free_rows="hazard"``: :func:`_hazard_rows`) or as the
    tight AND (``free_rows="tight"``: :func:`_tight_rows`). Both share the row
    ``1 - F <= h``, which frees the tensor as soon as every condition holds: the solver
    would free it anyway where memory binds, but the row makes U the simulator's memory at
    every feasible point, so a schedule's model peak is its simulated peak.
    ``every_later_reader`` also counts readers after the frontier, as published (eq. 8 makes
    their R zero, so the rows are only longer).
    """
    D, T, E = dr.D, dr.T, len(dr.edges)
    te_t, te_e = dr.te_t, dr.te_e
    n_te = te_t.size
    dr.Fix = np.full((D, T, E), -1, dtype=np.int64)
    for d in range(D):
        dr.Fix[d, te_t, te_e] = dr.b.add_vars(n_te, 0, 1, not dr.tight)
    by_edge = [np.flatnonzero(te_e == e) for e in range(E)]
    for d in range(D):
        fcol = dr.Fix[d, te_t, te_e]
        conds = _free_conditions(dr, d, by_edge, every_later_reader)
        h_const, kappa, lin = _hazard_count(conds, n_te)
        lr, lc, lv = lin
        row = np.arange(n_te)
        # 1 - F <= h   <=>  -F - lin <= hconst - 1   (F >= sum of conditions - (k - 1))
        dr.b.add_rows(
            "free_a",
            n_te,
            np.concatenate([row, lr]),
            np.concatenate([fcol, lc]),
            np.concatenate([-np.ones(n_te), -lv]),
            -np.inf,
            h_const - 1.0,
        )
        if dr.tight:
            _tight_rows(dr, fcol, conds)
        else:
            _hazard_rows(dr, fcol, h_const, kappa, lin)


def _free_conditions(
    dr: Draft, d: int, by_edge: list[np.ndarray], every_later_reader: bool
) -> list[tuple[str, np.ndarray, list[np.ndarray]]]:
    """The conditions under which edge (u, v) frees its tensor on device d in stage t, as
    (kind, rows among the (t, e) pairs, columns summed). Checkmate's (eq. 6): v runs
    (``pos``), the tensor is not kept for t+1 and no later reader of it runs in t (``neg``).

    Exact mode follows the simulator: v and the later readers may run on any device, and the
    tensor must be on d (``R + SX``), because it leaves d after its last reader anywhere.
    Paper mode keeps XEngine's per-device conditions, adding that d holds the tensor (Z, or
    for a state R + SA): without it a device running a reader of a remote u would be credited
    with freeing bytes it never held (the released code summed the rows over devices, which
    hid that).
    """
    te_t, te_e, tau = dr.te_t, dr.te_e, dr.tz.tau
    Rix, SX = dr.Rix, dr.SXix
    row = np.arange(te_t.size)
    # "runs" in exact mode: on any device, through P (one column however many devices run
    # it, so the conditions stay 0/1); in paper mode: on d itself
    runs = runs_somewhere(dr) if dr.mode == "exact" else [Rix[d]]
    conds: list[tuple[str, np.ndarray, list[np.ndarray]]] = [
        ("pos", row, [r[te_t, dr.dst[te_e]] for r in runs])
    ]
    has_next = np.flatnonzero(te_t + 1 < dr.T)
    conds.append(("neg", has_next, [SX[d, te_t[has_next] + 1, tau[te_e[has_next]]]]))
    for e in range(len(dr.edges)):
        for j in dr.tz.later[e]:
            sel = by_edge[e] if every_later_reader else by_edge[e][te_t[by_edge[e]] >= j]
            if sel.size:
                conds.append(("neg", sel, [r[te_t[sel], j] for r in runs]))
    if dr.multi and dr.mode == "exact":
        conds.append(("pos", row, [Rix[d, te_t, dr.src[te_e]], SX[d, te_t, tau[te_e]]]))
    elif dr.multi:
        is_st = tau[te_e] >= dr.inst.graph.size
        vr, sr = row[~is_st], row[is_st]
        conds.append(("pos", vr, [dr.Zix[d, te_t[vr], dr.src[te_e[vr]]]]))
        if sr.size:
            conds.append(
                ("pos", sr, [Rix[d, te_t[sr], dr.src[te_e[sr]]], SX[d, te_t[sr], tau[te_e[sr]]]])
            )
    return conds


def _hazard_count(
    conds: list, n_rows: int
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Checkmate's hazard count (eq. 7) ``h = sum(1 - pos) + sum(neg)`` per (t, e) row, as
    ``h = h_const + lin`` (lin's entries: rows, columns, values), and ``kappa``, the number of
    conditions: h is 0 exactly when every condition holds, and at most kappa."""
    h_const = np.zeros(n_rows)
    kappa = np.zeros(n_rows)
    lin_r, lin_c, lin_v = [], [], []
    for kind, rows_c, cols in conds:
        kappa[rows_c] += 1.0
        if kind == "pos":
            h_const[rows_c] += 1.0
        for c in cols:
            lin_r.append(rows_c)
            lin_c.append(c)
            lin_v.append(np.full(rows_c.size, -1.0 if kind == "pos" else 1.0))
    return h_const, kappa, (np.concatenate(lin_r), np.concatenate(lin_c), np.concatenate(lin_v))


def _hazard_rows(
    dr: Draft,
    fcol: np.ndarray,
    h_const: np.ndarray,
    kappa: np.ndarray,
    lin: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """``kappa (1 - F) >= h`` (Checkmate eq. 7): any hazard forces F to 0, so a tensor is
    never freed while it is still needed. One row per (t, e), with F binary: it is the
    published form, and the one CP-SAT takes (every column integer)."""
    n_te = fcol.size
    lr, lc, lv = lin
    # kappa (1 - F) >= h   <=>  -kappa F - lin >= hconst - kappa
    dr.b.add_rows(
        "free_b",
        n_te,
        np.concatenate([np.arange(n_te), lr]),
        np.concatenate([fcol, lc]),
        np.concatenate([-kappa, -lv]),
        h_const - kappa,
        np.inf,
    )


def _tight_rows(dr: Draft, fcol: np.ndarray, conds: list) -> None:
    """``F <= c`` for each condition c (``F <= sum`` for pos, ``F + sum <= 1`` for neg) with F
    continuous: the AND written condition by condition. Their sum is the hazard row, so the
    LP relaxation is never weaker, and at integer R, S they give the same F."""
    for kind, rows_c, cols in conds:
        k = rows_c.size
        local = np.arange(k)
        sign = -1.0 if kind == "pos" else 1.0  # F - sum <= 0  |  F + sum <= 1
        dr.b.add_rows(
            "free_le_" + kind,
            k,
            np.concatenate([local] * (1 + len(cols))),
            np.concatenate([fcol[rows_c]] + cols),
            np.concatenate([np.ones(k)] + [np.full(k, sign)] * len(cols)),
            -np.inf,
            0.0 if kind == "pos" else 1.0,
        )


def add_loss_release_rows(dr: Draft) -> None:
    """K[d,t]: the loss computed on d in stage t lets go of the logits before its gradient,
    the simulator's rule (``_Replay.loss_extra``): K = R[d,t,loss] AND NOT S[d,t+1,logits]
    AND no other device runs the loss in t, as ``K <= R``, ``K <= 1 - S``,
    ``K <= 1 - R[d']`` and ``K >= R - S - sum_{d'} R[d']``. Where K is 0 the loss needs the
    logits' bytes more (:func:`_budget_rows`). Only graphs whose loss can release
    (:attr:`Graph.released_logits`); continuous with tight FREE rows, binary with hazard rows
    (CP-SAT)."""
    u = dr.inst.graph.released_logits
    if u is None:
        return
    loss, T = u + 1, dr.T
    ts = np.arange(loss, T)
    k = ts.size
    rows = np.arange(k)
    dr.Kix = np.full((dr.D, T), -1, dtype=np.int64)
    for d in range(dr.D):
        dr.Kix[d, ts] = dr.b.add_vars(k, 0.0, 1.0, not dr.tight)
    nxt = np.where(ts + 1 < T, ts + 1, 0)
    for d in range(dr.D):
        kv, rv = dr.Kix[d, ts], dr.Rix[d, ts, loss]
        sv = np.where(ts + 1 < T, dr.Six[d, nxt, u], -1)  # nothing is kept past the last stage
        others = [dr.Rix[a, ts, loss] for a in range(dr.D) if a != d]
        dr.b.add_rows(
            "release_le_r",
            k,
            np.r_[rows, rows],
            np.r_[kv, rv],
            np.r_[np.ones(k), -np.ones(k)],
            -np.inf,
            0.0,
        )
        dr.b.add_rows("release_le_s", k, np.r_[rows, rows], np.r_[kv, sv], 1.0, -np.inf, 1.0)
        for ov in others:
            dr.b.add_rows("release_le_o", k, np.r_[rows, rows], np.r_[kv, ov], 1.0, -np.inf, 1.0)
        dr.b.add_rows(
            "release_ge",
            k,
            np.concatenate([rows] * (3 + len(others))),
            np.concatenate([kv, rv, sv, *others]),
            np.concatenate([np.ones(k), -np.ones(k), np.ones(k), *[np.ones(k)] * len(others)]),
            0.0,
            np.inf,
        )


def add_memory_rows(dr: Draft) -> None:
    """U[d,t,k], the memory on device d after step (t, k), bounded by the budget (Checkmate
    eq. 9 as bounds, XEngine constraint 10 per device), and its recurrence per device:
    :func:`_memory_start_rows` (eq. 4, XEngine 8), :func:`_memory_step_rows` (eq. 5, XEngine
    9), then :func:`_budget_rows` where a step needs memory beyond U (eq. 9).

    U stops at the frontier (k <= t) in the default model: nothing runs after it in a stage.
    """
    D = dr.D
    dr.Uix = np.full((D,) + dr.r_cells.shape, -1, dtype=np.int64)
    count = int(dr.r_cells.sum())
    for d in range(D):
        dr.Uix[d][dr.r_cells] = dr.b.add_vars(count, 0.0, dr.budget_mu[d], False)
    for d in range(D):
        _memory_start_rows(dr, d)
        _memory_step_rows(dr, d)
        _budget_rows(dr, d)


def _memory_start_rows(dr: Draft, d: int) -> None:
    """``U[d,t,0] = (m_0 + s_0) R[d,t,0] + sum_{i<t} m_i S[d,t,i] + sum_v s_v SA[d,t,v]``:
    Checkmate eq. 4 per device. XEngine's constraint 8 sums it over devices, which lets a
    device's kept values be charged to another's U; per device, each budget holds."""
    T = dr.T
    r0, c0, v0 = [np.arange(T)], [dr.Uix[d, :, 0]], [np.ones(T)]
    r0.append(np.arange(T))
    c0.append(dr.Rix[d, :, 0])
    v0.append(np.full(T, -dr.made_mu[0]))
    st, si = np.nonzero(dr.s_cells)
    r0.append(st)
    c0.append(dr.Six[d, st, si])
    v0.append(-dr.value_mu[si])
    if dr.Aix is not None:
        at, ai = np.nonzero(dr.Aix[d] >= 0)
        r0.append(at)
        c0.append(dr.Aix[d, at, ai])
        v0.append(-(dr.made_mu - dr.value_mu)[ai])
    dr.b.add_rows(
        "mem_init", T, np.concatenate(r0), np.concatenate(c0), np.concatenate(v0), 0.0, 0.0
    )


def _memory_step_rows(dr: Draft, d: int) -> None:
    """``U[d,t,k] = U[d,t,k-1] + (m_k + s_k) R[d,t,k] - sum_{e into k-1} bytes(e) F[d,t,e]``:
    Checkmate eq. 5 per device (XEngine constraint 9), with the predecessor's size as the
    freed amount (the released code read a stale index there and freed nothing). A tensor
    read by k-1 is freed after k-1 has run, so its bytes leave at step k."""
    kt, kk = np.nonzero(dr.r_cells & (np.arange(dr.inst.graph.size)[None, :] >= 1))
    nk = kt.size
    rows = np.arange(nk)
    rr = [rows, rows, rows]
    cc = [dr.Uix[d, kt, kk], dr.Uix[d, kt, kk - 1], dr.Rix[d, kt, kk]]
    vv = [np.ones(nk), -np.ones(nk), -dr.made_mu[kk]]
    pos = {(int(a), int(c)): r for r, (a, c) in enumerate(zip(kt, kk, strict=True))}
    fr, fc, fv = [], [], []
    for t_, e_ in zip(dr.te_t, dr.te_e, strict=True):
        r = pos.get((int(t_), int(dr.dst[e_]) + 1))
        if r is not None:
            fr.append(r)
            fc.append(dr.Fix[d, t_, e_])
            fv.append(dr.tensor_mu[dr.tz.tau[e_]])
    rr.append(np.array(fr, dtype=np.int64))
    cc.append(np.array(fc, dtype=np.int64))
    vv.append(np.array(fv, dtype=float))
    dr.b.add_rows(
        "mem_step", nk, np.concatenate(rr), np.concatenate(cc), np.concatenate(vv), 0.0, 0.0
    )


def _budget_rows(dr: Draft, d: int) -> None:
    """``U[d,t,k] + w_k R[d,t,k] + sum m_u X[d,t,(u,k)] <= B_d`` at the steps that need memory
    only while they run: the op's workspace (eq. 9's second part) and, in exact mode, the
    copies it receives, which the simulator holds on the receiving device while k runs.
    Elsewhere U's upper bound is the budget, and a row would only repeat it.
    """
    kt, kk = np.nonzero(dr.r_cells)
    wb = dr.workspace_mu
    trans = wb[d, kk] > 0
    if dr.Kix is not None:
        trans |= kk == dr.inst.graph.released_logits + 1
    exact_copies = dr.multi and dr.mode == "exact"
    if exact_copies:
        has_copy_in = np.zeros(dr.inst.graph.size, dtype=bool)
        has_copy_in[dr.dst[dr.copyable]] = True
        trans |= has_copy_in[kk]
    sel = np.flatnonzero(trans)
    if not sel.size:
        return
    pos = {(int(kt[s]), int(kk[s])): r for r, s in enumerate(sel)}
    rr = [np.arange(sel.size), np.arange(sel.size)]
    cc = [dr.Uix[d, kt[sel], kk[sel]], dr.Rix[d, kt[sel], kk[sel]]]
    vv = [np.ones(sel.size), wb[d, kk[sel]]]
    if dr.Kix is not None:  # the logits' bytes unless the loss lets go of them: m (R - K)
        u = dr.inst.graph.released_logits
        at = np.flatnonzero(kk[sel] == u + 1)
        rr += [at, at]
        cc += [dr.Rix[d, kt[sel][at], u + 1], dr.Kix[d, kt[sel][at]]]
        vv += [np.full(at.size, dr.value_mu[u]), np.full(at.size, -dr.value_mu[u])]
    if exact_copies:
        cp_mask = dr.copyable[dr.te_e]
        xr, xc, xv = [], [], []
        for t_, e_ in zip(dr.te_t[cp_mask], dr.te_e[cp_mask], strict=True):
            r = pos.get((int(t_), int(dr.dst[e_])))
            if r is not None:
                xr.append(r)
                xc.append(dr.Xix[d, t_, e_])
                xv.append(dr.value_mu[dr.src[e_]])
        rr.append(np.array(xr, dtype=np.int64))
        cc.append(np.array(xc, dtype=np.int64))
        vv.append(np.array(xv, dtype=float))
    dr.b.add_rows(
        "budget",
        sel.size,
        np.concatenate(rr),
        np.concatenate(cc),
        np.concatenate(vv),
        -np.inf,
        dr.budget_mu[d],
    )


def add_compute_objective(dr: Draft) -> None:
    """``sum_d sum_t sum_i C[d,i] R[d,t,i]``: Checkmate's objective (eq. 1) with each device's
    own cost, XEngine's first objective term. The copy term is added with the copy rows."""
    tt, ii = np.nonzero(dr.r_cells)
    for d in range(dr.D):
        dr.b.add_objective(dr.Rix[d, tt, ii], dr.compute_tu[d, ii])


def finish(dr: Draft) -> Formulation:
    """The model and its index arrays, and, when some node fits on no device, which one and
    the footprint it needs (the model is then infeasible as built, and saying why is more use
    than a solver's verdict)."""
    model = dr.b.build()
    f = Formulation(
        inst=dr.inst,
        mode=dr.mode,
        model=model,
        Rix=dr.Rix,
        Six=dr.Six,
        Fix=dr.Fix,
        Xix=dr.Xix,
        Uix=dr.Uix,
        Zix=dr.Zix,
        mem_scale=dr.mem_scale,
        time_scale=dr.time_scale,
        build_time_s=time.perf_counter() - dr.started_s,
        edges=dr.edges,
        Aix=dr.Aix,
        Pix=dr.Pix,
        Kix=dr.Kix,
    )
    f._Yix = dr.Yix
    blocked = dr.blocked_nodes
    if blocked.size:
        least = dr.footprint_bytes.min(axis=0)
        v = int(blocked[np.argmax(least[blocked])])
        f.blocked = (dr.inst.graph.nodes[v].name, int(least[v]))
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


def build(
    inst: Instance, mode: str = "exact", linearize: bool = True, free_rows: str = "hazard"
) -> Formulation:
    """The model for ``inst``: see the module docstring for the two modes and for
    ``free_rows`` (hazard | tight). Each row family is one function below, in the order its
    rows appear."""
    dr = start(inst, mode, linearize, free_rows)
    add_variables(dr)
    add_frontier_rows(dr)
    fix_by_bounds(dr)
    add_presence_rows(dr)
    add_persistence_rows(dr)
    add_state_rows(dr)
    add_dependency_rows(dr)
    add_copy_terms(dr)
    add_free_rows(dr)
    add_loss_release_rows(dr)
    add_memory_rows(dr)
    add_compute_objective(dr)
    return finish(dr)
