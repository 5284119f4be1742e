"""The retention-interval model on OR-Tools CP-SAT, for one device or several (issue 5).

Why a second model: the Checkmate / XEngine MILP (:mod:`xengine.strategies.formulation`) has D x n x
n binaries for R and S alone, and its LP relaxation is what open-source MILP solvers spend their
time on (shared/reference/solver-calibration.md: ResNet-50 gets no solution from HiGHS in 600 s).
MOCCASIN (Bartan et al., ICML 2023) writes the same single-device problem with O(n) interval
variables on CP-SAT and solves the large graphs far faster. This module is our own version of that
idea, written for xengine's semantics (docs/design.md section 5) and extended to several devices
with copies.

Events. Stage ``t`` runs nodes ``v <= t`` in order; step ``(t, v)`` is the event
``e(t, v) = t n + v``, so events are ordered as the simulator replays them (events with
``v > t`` are never steps). The grid is n x n rather than the n (n + 1) / 2 real steps so
that a computation's event is linear in its stage: no element constraints, no sparse domains
(the triangular numbering made CP-SAT's presolve take 17 s on vgg16).

Variables. Node ``v`` may be computed up to ``C`` times on each device ``d`` (``max_computes``;
more if the warm start needs it). Computation ``k`` is an optional interval ``[start, end]`` of
events: it is computed at ``start`` (an event ``e(t, v)``, ``t >= v``) and its output occupies
``m_v`` bytes of ``d`` until ``end``. Exactly one computation of ``v`` is at ``e(v, v)`` (the
frontier); computations on one device are ordered and disjoint.

Reads. For every value edge ``u -> w`` and every computation of ``w`` at event ``s`` on ``d``,
exactly one computation of ``u`` *covers* it: it started before ``s`` and ends at ``s`` or later.
A cover on another device is a copy (copyable edges only): its time is charged and ``m_u`` bytes
sit on ``d`` during step ``s``. A copy is allowed only when no computation of ``u`` on ``d``
covers ``s`` (the simulator copies only then), so the objective is the simulator's time at
every feasible point, not only at the optimum.

States (docs/design.md section 3). A forward node ``v`` with a state link ``v -> B_v`` gives each of
its computations a second interval, the *state interval* ``[start, se]`` on the same device
(``state_bytes[v]`` bytes; none for a zero-byte state, which still ties ``B_v`` to a device).
Every computation of ``B_v`` on ``d`` is covered by the state of a computation of ``v`` on
``d`` itself (a state is never copied), and a state interval ends before the stage of the
next computation of ``v`` on its device (a state is not kept into a stage that makes it anew).

Unread tensors. The simulator drops what nobody reads at the end of its stage (event
``e(t, t)``), a state already after ``B_v``'s step when ``B_v`` runs on another device in that
stage. An unread interval lasts that long; for nodes without a state an unread computation
other than the first is never useful and is not allowed (the first, at ``e(v, v)``, is the
last step of its stage).

Memory. One cumulative constraint per device: values and states over their intervals,
workspace (measured on the device) and transient copies during their step, capacity = the
device's budget.

From intervals to a schedule. ``R`` comes from the starts. Residency ``S`` is derived from the
*last read* ``L`` of each computation (not from ``end``, which may be longer): the output is
kept into stage ``t`` when ``start < e(t, 0) <= L``; ``S_state`` likewise from each state's
last read by ``B_v``. The simulator then frees both after their last reader, so its memory is
never above the model's; with every interval ending there they are equal (tested via
:func:`interval_peaks`).

Two restrictions make the simulator's rules expressible; both are reported with every result:

* at most ``C`` computations per (node, device);
* (two or more devices) a node's output is never alive on two devices in one stage. The
  simulator frees a tensor after its last reader *on any device*, which an interval on one
  device cannot see; with this rule every reader in a stage reads the one live copy.

A restricted model can miss the MILP's optimum. ``experiments/solver_benchmark.py`` compares
the two on every suite instance and flags any difference.

The code follows these paragraphs: :func:`_build` makes the model from :func:`_computations`
(Variables; states by :func:`_add_state`), :func:`_one_stage_per_node` (the second
restriction), :func:`_value_covers` and :func:`_state_covers` (Reads, States), :func:`_unread`
(Unread tensors) and one cumulative per device (Memory); :func:`solve_intervals` then adds the
bounds valid for the whole problem (:func:`_whole_problem_bounds`), searches (:func:`_search`)
and reports (:func:`_no_schedule` or :func:`_report`, through :func:`schedule_from`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from xengine.problem import Instance
from xengine.result import StrategyResult, check_with_simulator
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, simulate
from xengine.solvers.cpsat import BACKEND as CPSAT
from xengine.solvers.cpsat import run_cpsat
from xengine.solvers.model import (
    SOLUTION_STATUSES,
    SolverOptions,
    SolverUnavailable,
    relative_gap,
)
from xengine.strategies.bounds import (
    LpBoundAlongside,
    cpu_split,
    lp_bound_s,
    pinned,
    placement_bound_s,
)

log = logging.getLogger(__name__)

TIME_UNIT_S = 1e-9
"""Costs enter CP-SAT as integers in nanoseconds; the reported objective is recomputed in
floating point from the solution, so rounding only affects the search, never a figure."""

DEFAULT_MAX_COMPUTES = 2

ProgressFn = Callable[[float, float | None, float | None], None]


def event(t: int, v: int, n: int) -> int:
    """Position of step ``(t, v)`` in the simulator's order (``n`` nodes)."""
    return t * n + v


@dataclass
class _Iv:
    """One optional computation of node ``v`` on device ``d``, the interval of its output and,
    for a node with a state link, the end ``se`` of its state's interval."""

    v: int
    d: int
    k: int
    pres: object
    start: object
    end: object
    first: object | None = None  # k == 0: this is v's first computation (stage v)
    stage: object | None = None  # stage of start
    end_stage: object | None = None  # stage of end (two or more devices)
    se: object | None = None  # last event of the state (nodes with a state link)
    uses: list = field(default_factory=list)  # cover literals reading this computation's value
    state_uses: list = field(default_factory=list)  # cover literals reading its state


@dataclass
class _Cover:
    """Computation ``src`` covers the read of edge ``u -> w`` by computation ``dst`` (of the
    value, or with ``state`` of the autograd state, which is always local)."""

    lit: object
    src: _Iv
    dst: _Iv
    remote: bool
    state: bool = False


@dataclass
class IntervalSolution:
    """What the solver chose, in plain numbers: per computation its device, node, start event
    and the last event its value is alive (``L``: its last read, else the end of its stage),
    per copy its devices, node and event, and per computation of a node with a state link the
    last event its state is alive (its last read by ``B_v``, else where the simulator drops
    it)."""

    computations: list[tuple[int, int, int, int]]  # (d, v, start_event, last_read_event)
    copies: list[tuple[int, int, int, int]]  # (src_device, dst_device, u, event)
    states: list[tuple[int, int, int, int]] = field(default_factory=list)  # (d, v, start, end)


def schedule_from(inst: Instance, sol: IntervalSolution) -> Schedule:
    """R from the starts; S and S_state from start to the last read (module docstring)."""
    n, D = inst.size, inst.n_devices
    R = np.zeros((D, n, n), dtype=bool)
    S = np.zeros((D, n, n), dtype=bool)
    for d, v, s, last in sol.computations:
        R[d, s // n, v] = True
        S[d, s // n + 1 : last // n + 1, v] = True
    A = None
    if inst.graph.has_states:
        A = np.zeros((D, n, n), dtype=bool)
        for d, v, s, last in sol.states:
            A[d, s // n + 1 : last // n + 1, v] = True
    return Schedule(inst.devices, R, S, A)


def interval_peaks(inst: Instance, sol: IntervalSolution) -> np.ndarray:
    """Per-device peak of the model's memory with every interval ending at its last read.

    Computed on the event axis, independently of the simulator: the test that the two agree
    is the check that the interval semantics above are the simulator's.
    """
    g = inst.graph
    n, D = inst.size, inst.n_devices
    H = n * n
    m, sb, w = g.output_bytes, g.state_bytes, inst.workspace_bytes
    diff = np.zeros((D, H + 1), dtype=np.int64)
    point = np.zeros((D, H), dtype=np.int64)
    for d, v, s, last in sol.computations:
        diff[d, s] += m[v]
        diff[d, last + 1] -= m[v]
        point[d, s] += w[d, v]
    for d, v, s, last in sol.states:
        diff[d, s] += sb[v]
        diff[d, last + 1] -= sb[v]
    for _src, dst, u, s in sol.copies:
        point[dst, s] += m[u]
    mem = np.cumsum(diff[:, :H], axis=1) + point
    return mem.max(axis=1) if H else np.zeros(D, dtype=np.int64)


@dataclass
class _Replay:
    """A valid schedule as the model's computations.

    ``comps[(d, v)]``: per computation ``[start, last value read, state end]`` (events, -1
    where there is none); ``reads[(t, w, d, u)]``: the (device, index) of the computation of
    ``u`` that the computation of ``w`` reads; ``state_reads[(d, b, s)]``: the index of the
    computation of ``F_v`` on ``d`` whose state ``B_v = b`` reads at event ``s``."""

    comps: dict[tuple[int, int], list[list[int]]]
    reads: dict[tuple[int, int, int, int], tuple[int, int]]
    state_reads: dict[tuple[int, int, int], int]
    copies: list[tuple[int, int, int, int]]

    def solution(self, n: int) -> IntervalSolution:
        """The computations as an :class:`IntervalSolution` (an unread value lasts until the
        end of its stage, as in the simulator)."""
        comps, states = [], []
        for (d, v), lst in self.comps.items():
            for s, last, st_end in lst:
                comps.append((d, v, s, last if last >= 0 else (s // n) * (n + 1)))
                if st_end >= 0:
                    states.append((d, v, s, st_end))
        return IntervalSolution(comps, list(self.copies), states)


def _replay(inst: Instance, sched: Schedule) -> _Replay:
    """Replay a valid schedule in the simulator and read the computations off its operations.

    Values end at their last read. States end where the simulator frees them, after the step
    of ``B_v`` or at the end of the stage, so that the state residency is the schedule's own
    (``sched.states_for``, which the simulator replays)."""
    sim = simulate(inst, sched, check_budget=False)
    n = inst.size
    state_src = inst.graph.state_source.tolist()
    rep = _Replay({}, {}, {}, [])
    pending: dict[int, int] = {}  # u -> source device of a copy for the next compute
    now = -1  # the event of the last step replayed
    for op in sim.ops:
        if op.kind == "copy":
            pending[op.node] = op.src_device
        elif op.kind == "compute":
            t, w, d = op.stage, op.node, op.device
            now = event(t, w, n)
            for e in inst.graph.in_edges[w]:
                u = e.src
                src = pending.get(u, d)
                j = len(rep.comps[(src, u)]) - 1
                rep.comps[(src, u)][j][1] = max(rep.comps[(src, u)][j][1], now)
                rep.reads[(t, w, d, u)] = (src, j)
                if src != d:
                    rep.copies.append((src, d, u, now))
            if state_src[w] >= 0:
                rep.state_reads[(d, w, now)] = len(rep.comps[(d, state_src[w])]) - 1
            pending = {}
            rep.comps.setdefault((d, w), []).append([now, -1, -1])
        elif op.kind == "free_state":
            rep.comps[(op.device, op.node)][-1][2] = now
    return rep


def solution_of(inst: Instance, sched: Schedule) -> IntervalSolution:
    """A valid schedule as the interval model's solution (the inverse of
    :func:`schedule_from` for a schedule that keeps values no longer than their last read)."""
    return _replay(inst, sched).solution(inst.size)


def solve_intervals(
    inst: Instance,
    options: SolverOptions | None = None,
    warm_start: Schedule | None = None,
    max_computes: int = DEFAULT_MAX_COMPUTES,
    strategy: str = "xengine",
    progress: ProgressFn | None = None,
    placement: np.ndarray | None = None,
    lp_bound: bool | str = True,
) -> StrategyResult:
    """Solve ``inst`` with the retention-interval model on CP-SAT (module docstring).

    Same result type and the same simulator check as :func:`xengine.strategies.solve.solve_xengine`;
    ``objective_s`` is the model's time of the returned solution and ``model_peak_bytes`` the
    model's memory with tight intervals (:func:`interval_peaks`), which must equal the
    simulator's. ``extra["restriction"]`` states what the model cannot express.
    ``placement`` (a device index per node, -1 = free) computes and keeps each node on its
    device only, as in :func:`xengine.strategies.solve.solve_xengine`.

    ``lp_bound``: CP-SAT's own bound stays near zero on these models with two workers (its
    portfolio then has no bound-proving worker), so the LP relaxation of the exact MILP is
    solved first (HiGHS, at most half the time limit, counted in the time limit) and given to
    CP-SAT as a lower bound on the objective. It is valid here: the interval model's optimum is
    never below the MILP's. ``best_bound_s`` and ``gap`` are then with respect to the full
    problem; ``lp_bound_s`` and ``extra["lp_bound_time_s"]`` say what it cost.
    ``lp_bound=False`` skips the LP (on resnet50 with two devices it does not solve in 600 s,
    ``experiments/lp_bound_speed.py``); the placement bound, a fraction of a second, is always
    computed (without a placement restriction) and given to CP-SAT the same way.
    ``lp_bound="alongside"`` computes the LP bound (:func:`lp_bound_s`, PDLP from resnet50's
    size on) in a process of its own on one CPU for the whole time limit, while CP-SAT
    searches on the other CPUs (:class:`xengine.strategies.bounds.LpBoundAlongside`). CP-SAT
    cannot use that bound during its search (it only stops at the time limit then), but it is
    reported as ``best_bound_s`` and ``gap`` like the other; ``solve_time_s`` includes waiting
    for it.
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:
        raise SolverUnavailable(
            "formulation=intervals needs the 'ortools' package: pip install ortools"
        ) from exc
    if max_computes < 1:
        raise ValueError(f"max_computes must be at least 1, not {max_computes}")
    if lp_bound not in (True, False, "alongside"):
        raise ValueError(f"lp_bound must be True, False or 'alongside', not {lp_bound!r}")
    options = options or SolverOptions()
    t_build = time.perf_counter()
    restriction = f"at most {max_computes} computations per node and device"
    if inst.n_devices > 1:
        restriction += "; a node's output is on one device at a time within a stage"
    res = StrategyResult(
        strategy=strategy,
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="error",
        solver="cpsat",
        extra={"mode": "intervals", "restriction": restriction, "max_computes": max_computes},
    )
    can_run = _runnable(inst, res)
    if can_run is None:
        return res
    hint = None
    if warm_start is not None:
        try:
            hint = _replay(inst, warm_start)
        except ScheduleError as exc:
            log.warning("warm start is not a valid schedule (%s); not used", exc)
    n_comp = _allowance(inst, max_computes, can_run, hint, placement)
    mdl = cp_model.CpModel()
    built = _build(mdl, inst, n_comp)
    if hint is not None:
        _add_hint(mdl, inst, built.ivs, built.covers, hint)
    build_s = time.perf_counter() - t_build
    time_limit_s = options.time_limit_s
    alongside = None
    search_cpus: set[int] = set()
    if placement is None:
        time_limit_s, alongside, search_cpus = _whole_problem_bounds(
            mdl, inst, options, lp_bound, built, res, strategy
        )
    proto = mdl.proto
    res.build_time_s = build_s
    res.n_vars = len(proto.variables)
    res.n_rows = len(proto.constraints)
    res.n_integer = res.n_vars
    log.info(
        "%s: interval model, %d variables, %d constraints, built in %.2f s",
        strategy,
        res.n_vars,
        res.n_rows,
        build_s,
    )
    solver, code = _search(
        cp_model, mdl, options, progress, time_limit_s, alongside, search_cpus, res, strategy
    )
    exact = _unrestricted(inst, n_comp)
    res.extra["restricted"] = not exact
    name = solver.status_name(code)
    status = CPSAT.status(name)
    if status not in SOLUTION_STATUSES:
        _no_schedule(res, status, name, exact, restriction)
        log.info("%s: %s after %.1f s", strategy, res.status, res.solve_time_s)
        return res
    _report(res, solver, status, inst, built, exact, restriction, options)
    return res


def _runnable(inst: Instance, res: StrategyResult) -> np.ndarray | None:
    """Which device can run each node at all (its inputs, output, state and workspace fit the
    budget), as a (D, n) mask; None, with ``res`` made ``infeasible`` naming the node and the
    least budget, when some node fits on no device (no model is built then)."""
    g = inst.graph
    footprint = np.stack([g.node_lower_bound_bytes(dv) for dv in inst.devices])  # (D, n)
    can_run = footprint <= inst.budgets[:, None]  # (D, n)
    blocked = np.flatnonzero(~can_run.any(axis=0))
    if not blocked.size:
        return can_run
    least = footprint.min(axis=0)
    v = int(blocked[np.argmax(least[blocked])])
    res.status = "infeasible"
    res.message = (
        f"infeasible: node {g.nodes[v].name} needs {int(least[v])} bytes (inputs + "
        "output + state + workspace) on one device, more than any device's budget; every "
        f"budget must be at least {int(least[v])} bytes"
    )
    res.extra["min_budget_lower_bound_bytes"] = int(least[v])
    return None


@dataclass
class _Built:
    """The interval model's parts that the hint, the bounds and the solution need: the
    computations per (device, node), the cover literals, the objective's terms (literal,
    nanoseconds) and the objective itself."""

    ivs: dict[tuple[int, int], list[_Iv]]
    covers: list[_Cover]
    obj_terms: list[tuple[object, int]]
    objective_ns: object


def _build(mdl, inst: Instance, n_comp: np.ndarray) -> _Built:
    """The whole interval model (module docstring) in ``mdl``, in this order: computations and
    their states, one stage per node on two or more devices, value reads, state reads, unread
    tensors, memory per device, and the objective (compute and copy time, in nanoseconds)."""
    D = inst.n_devices
    demands: list[list[tuple[object, int]]] = [[] for _ in range(D)]
    obj_terms: list[tuple[object, int]] = []
    ivs = _computations(mdl, inst, n_comp, demands, obj_terms)
    if D > 1:
        _one_stage_per_node(mdl, ivs, inst.size, D)
    covers = _value_covers(mdl, inst, ivs, demands, obj_terms)
    covers += _state_covers(mdl, inst.graph, ivs, D)
    _unread(mdl, inst.graph, ivs, inst.size, D)
    for d in range(D):
        if demands[d]:
            mdl.add_cumulative(
                [itv for itv, _ in demands[d]],
                [dem for _, dem in demands[d]],
                int(inst.budgets[d]),
            )
    objective_ns = sum(c * lit for lit, c in obj_terms if c)
    mdl.minimize(objective_ns)
    return _Built(ivs, covers, obj_terms, objective_ns)


def _computations(mdl, inst: Instance, n_comp: np.ndarray, demands, obj_terms):
    """The optional computations of every (device, node), ``n_comp`` of them: exactly one
    first computation of each node (at its own stage, on some device) and, redundant but
    useful to the LP relaxation, at least one computation of each node."""
    n, D = inst.size, inst.n_devices
    cost_ns = np.rint(inst.compute_s / TIME_UNIT_S).astype(np.int64)
    ivs: dict[tuple[int, int], list[_Iv]] = {}
    for v in range(n):
        firsts = []
        for d in range(D):
            lst: list[_Iv] = []
            for k in range(int(n_comp[d, v])):
                iv = _computation(mdl, inst, v, d, k, lst[-1] if k else None, demands[d])
                if k == 0:
                    firsts.append(iv.first)
                obj_terms.append((iv.pres, int(cost_ns[d, v])))
                lst.append(iv)
            ivs[(d, v)] = lst
        mdl.add_exactly_one(firsts)
        # redundant, for the LP relaxation: every node is computed at least once
        mdl.add(sum(iv.pres for d in range(D) for iv in ivs[(d, v)]) >= 1)
    return ivs


def _computation(mdl, inst: Instance, v: int, d: int, k: int, prev: _Iv | None, demand) -> _Iv:
    """Computation ``k`` of node ``v`` on device ``d``: its output interval (and workspace
    during its step) in ``demand``, after the previous computation ``prev`` on the device;
    the first one (``k == 0``) may be the node's first computation, at stage ``v``."""
    g, n = inst.graph, inst.size
    H = n * n
    lo_stage = v if k == 0 else v + 1
    name = f"{v}_{d}_{k}"
    pres = mdl.new_bool_var(f"p{name}")
    stage = mdl.new_int_var(lo_stage, n - 1, f"t{name}")
    start = stage * n + v
    end = mdl.new_int_var(lo_stage * n + v, H - 1, f"e{name}")
    mdl.add(end >= start)
    size = mdl.new_int_var(1, H, f"z{name}")
    itv = mdl.new_optional_interval_var(start, size, end + 1, pres, f"i{name}")
    demand.append((itv, int(g.output_bytes[v])))
    w = inst.workspace_bytes
    if w[d, v] > 0:
        demand.append(
            (mdl.new_optional_fixed_size_interval_var(start, 1, pres, f"w{name}"), int(w[d, v]))
        )
    iv = _Iv(v, d, k, pres, start, end, stage=stage)
    # an absent computation sits at its earliest place (no symmetric copies)
    rest = lo_stage if (k or v + 1 == n) else v + 1
    mdl.add(stage == rest).only_enforce_if(pres.Not())
    mdl.add(end == start).only_enforce_if(pres.Not())
    if not g.successors[v]:
        mdl.add(end <= stage * (n + 1))  # never read: gone at the end of its stage
    if k == 0:
        iv.first = mdl.new_bool_var(f"f{name}")
        mdl.add_implication(iv.first, pres)
        mdl.add(stage == v).only_enforce_if(iv.first)
        if v + 1 < n:
            mdl.add(stage >= v + 1).only_enforce_if(iv.first.Not())
        else:
            mdl.add_implication(pres, iv.first)
    else:
        mdl.add_implication(pres, prev.pres)
        mdl.add(start >= prev.end + 1).only_enforce_if(pres)
    if g.state_reader[v] >= 0:
        _add_state(mdl, iv, prev, n, lo_stage, int(g.state_bytes[v]), demand)
    return iv


def _one_stage_per_node(mdl, ivs, n: int, D: int) -> None:
    """Two or more devices: a node's computations never share a stage (module docstring), as
    no-overlap of their stage spans [stage, end_stage]."""
    for v in range(n):
        all_v = [iv for d in range(D) for iv in ivs[(d, v)]]
        if len({iv.d for iv in all_v}) < 2:
            continue
        ext = []
        for iv in all_v:
            name = f"{v}_{iv.d}_{iv.k}"
            iv.end_stage = mdl.new_int_var(v, n - 1, f"se{name}")
            mdl.add(iv.end >= iv.end_stage * n)
            mdl.add(iv.end <= iv.end_stage * n + n - 1)
            span = mdl.new_int_var(1, n, f"sp{name}")
            ext.append(
                mdl.new_optional_interval_var(iv.stage, span, iv.end_stage + 1, iv.pres, f"x{name}")
            )
        mdl.add_no_overlap(ext)


def _value_covers(mdl, inst: Instance, ivs, demands, obj_terms) -> list[_Cover]:
    """Reads (module docstring): exactly one computation of ``u`` covers each computation of
    ``w`` for every value edge ``u -> w``. A cover on another device is a copy: its time in
    the objective, ``m_u`` bytes on the reading device during the step, and allowed only when
    no computation of ``u`` on that device covers the read (the simulator copies only then)."""
    g, D = inst.graph, inst.n_devices
    m = g.output_bytes
    copy_ns = np.rint(inst.copy_s / TIME_UNIT_S).astype(np.int64)
    covers: list[_Cover] = []
    for e in g.value_edges:
        u, wv = e.src, e.dst
        for d in range(D):
            for dst in ivs[(d, wv)]:
                lits = []
                remote_lits = []
                for d2 in range(D):
                    if d2 != d and not e.copyable:
                        continue
                    for src in ivs[(d2, u)]:
                        b = mdl.new_bool_var(f"c{u}_{d2}_{src.k}>{wv}_{d}_{dst.k}")
                        mdl.add_implication(b, src.pres)
                        mdl.add(src.start + 1 <= dst.start).only_enforce_if(b)
                        mdl.add(src.end >= dst.start).only_enforce_if(b)
                        src.uses.append(b)
                        covers.append(_Cover(b, src, dst, d2 != d))
                        lits.append(b)
                        if d2 != d:
                            remote_lits.append(b)
                            obj_terms.append((b, int(copy_ns[d2, d, u])))
                            itv = mdl.new_optional_fixed_size_interval_var(
                                dst.start, 1, b, f"t{u}>{wv}_{d}_{dst.k}_{d2}_{src.k}"
                            )
                            demands[d].append((itv, int(m[u])))
                mdl.add(sum(lits) == dst.pres)
                local = ivs[(d, u)]
                if remote_lits and local:
                    _copy_only_without_local(mdl, remote_lits, local, dst, f"r{u}>{wv}_{d}_{dst.k}")
    return covers


def _copy_only_without_local(mdl, remote_lits: list, local: list[_Iv], dst: _Iv, name: str):
    """A copy (one of ``remote_lits``) only when no computation of ``u`` on the reading device
    (``local``) covers the read: each one starts after it or ends before it."""
    c = mdl.new_bool_var(name)
    mdl.add(sum(remote_lits) == c)
    for src in local:
        a1 = mdl.new_bool_var("")
        a2 = mdl.new_bool_var("")
        mdl.add_bool_or([c.Not(), src.pres.Not(), a1, a2])
        mdl.add(src.start >= dst.start + 1).only_enforce_if(a1)
        mdl.add(src.end <= dst.start - 1).only_enforce_if(a2)


def _whole_problem_bounds(mdl, inst, options, lp_bound, built: _Built, res, strategy: str):
    """Bounds valid for the whole problem, computed before the search (``solve_intervals``'s
    docstring says why): the placement bound always, the LP bound unless ``lp_bound`` is off
    or alongside, each in at most half the time limit; their best is given to CP-SAT as a
    lower bound on the objective. Returns the time left for the search, the alongside LP
    bound (or None) and the CPUs the search is pinned to."""
    time_limit_s = options.time_limit_s
    alongside = None
    search_cpus: set[int] = set()
    t_lp = time.perf_counter()
    half = None if time_limit_s is None else time_limit_s / 2
    res.placement_bound_s = placement_bound_s(inst, replace(options, time_limit_s=half))
    res.lp_bound_s = (
        lp_bound_s(inst, replace(options, time_limit_s=half)) if lp_bound is True else None
    )
    res.extra["lp_bound_time_s"] = time.perf_counter() - t_lp
    if time_limit_s is not None:
        time_limit_s = max(time_limit_s - res.extra["lp_bound_time_s"], 0.01)
    bound = max(
        (b for b in (res.lp_bound_s, res.placement_bound_s) if b is not None),
        default=None,
    )
    if bound is not None:
        # integer costs are rounded to the nanosecond: leave one per term of slack
        mdl.add(built.objective_ns >= int(np.floor(bound / TIME_UNIT_S)) - len(built.obj_terms))
    log.info(
        "%s: LP bound %s, placement bound %s, in %.1f s",
        strategy,
        _s(res.lp_bound_s),
        _s(res.placement_bound_s),
        res.extra["lp_bound_time_s"],
    )
    if lp_bound == "alongside":
        bound_cpus, search_cpus = cpu_split()
        log.info(
            "%s: LP bound alongside the search, on CPU %s (search on %s)",
            strategy,
            sorted(bound_cpus),
            sorted(search_cpus),
        )
        alongside = LpBoundAlongside(
            inst, replace(options, time_limit_s=time_limit_s), cpus=bound_cpus
        )
    return time_limit_s, alongside, search_cpus


def _search(cp_model, mdl, options, progress, time_limit_s, alongside, search_cpus, res, strategy):
    """CP-SAT on ``mdl`` (pinned to ``search_cpus``), then the alongside LP bound waited for
    (cancelled if the search raises, e.g. on an interrupt). Sets ``res.solve_time_s``,
    ``time_to_first_s`` and ``n_branches``; returns the solver and its status code."""
    try:
        with pinned(search_cpus):
            solver, code, elapsed, first_s = run_cpsat(
                cp_model, mdl, options, progress, scale=TIME_UNIT_S, time_limit_s=time_limit_s
            )
    except BaseException:
        if alongside is not None:
            alongside.cancel()
        raise
    if alongside is not None:
        t_wait = time.perf_counter()
        res.lp_bound_s = alongside.result()
        res.extra["lp_bound_wait_s"] = time.perf_counter() - t_wait
        elapsed += res.extra["lp_bound_wait_s"]
        log.info("%s: LP bound (alongside) %s", strategy, _s(res.lp_bound_s))
    res.solve_time_s = elapsed + res.extra.get("lp_bound_time_s", 0.0)
    res.time_to_first_s = first_s
    res.extra["n_branches"] = int(solver.num_branches)
    return solver, code


def _unrestricted(inst: Instance, n_comp: np.ndarray) -> bool:
    """Whether the model is the whole problem: one device and a computation per later stage
    (a node nobody reads, value or state, needs one computation; any other one per stage from
    its own on). Only then are CP-SAT's optimum, bound and infeasibility the problem's."""
    g, n = inst.graph, inst.size
    read = np.array([bool(x) for x in g.successors]) | (g.state_reader >= 0)
    most_useful = np.where(read, n - np.arange(n), 1)
    return inst.n_devices == 1 and bool((n_comp[0] >= most_useful).all())


def _no_schedule(res: StrategyResult, status: str, name: str, exact: bool, restriction: str):
    """A search without a schedule: infeasible only when the model is the whole problem,
    else ``no_solution`` naming the restriction (formulation=exact decides)."""
    if status == "infeasible" and exact:
        res.status = "infeasible"
        res.message = "no schedule fits the budget"
    elif status == "infeasible":
        res.status = "no_solution"
        res.message = (
            f"the interval model has no schedule within the budgets ({restriction}); "
            "formulation=exact decides whether one exists"
        )
    elif status == "no_solution":
        res.status = "no_solution"
        res.message = f"no schedule found in {res.solve_time_s:.1f} s"
    else:
        res.status = "error"
        res.message = f"CP-SAT status {name}"


def _report(res, solver, status, inst, built: _Built, exact, restriction, options) -> None:
    """The search's schedule into ``res``: objective, bounds valid for the whole problem, the
    status (CP-SAT's optimum is the problem's only when the model is unrestricted or such a
    bound meets it), the model's memory and the simulator's check."""
    sol, objective = _solution(solver, inst, built.ivs, built.covers)
    res.objective_s = objective
    # CP-SAT's own bound holds for the restricted model only; reported bounds hold for the
    # whole problem: the LP and placement bounds, and CP-SAT's when the model is unrestricted
    bounds = [res.lp_bound_s, res.placement_bound_s]
    if exact:
        bounds.append(float(solver.best_objective_bound) * TIME_UNIT_S)
    bounds = [b for b in bounds if b is not None]
    res.best_bound_s = min(max(bounds), objective) if bounds else None
    res.gap = relative_gap(objective, res.best_bound_s) if bounds else None
    # CP-SAT's OPTIMAL is about the restricted model; it is the problem's optimum only when
    # the model is unrestricted or a bound valid for the whole problem meets it
    res.status = "feasible"
    if status == "optimal":
        res.extra["restricted_optimal"] = True
        if not exact and (res.gap is None or res.gap > options.rel_gap):
            res.message = f"optimal within the interval model ({restriction})" + (
                "" if res.gap is None else f"; {100 * res.gap:.2f} % above the best bound"
            )
        else:
            res.status = "optimal"
    res.model_peak_bytes = interval_peaks(inst, sol)
    check_with_simulator(
        res, inst, schedule_from(inst, sol), "interval-model", True, res.solve_time_s
    )


def _allowance(
    inst: Instance,
    max_computes: int,
    can_run: np.ndarray,
    hint: _Replay | None,
    placement: np.ndarray | None,
) -> np.ndarray:
    """How many computations each (device, node) may have: ``max_computes``, more where the
    warm start has more, at most one per stage from the node's own, one for a node nobody
    reads (neither its value nor its state), none where the budget or the placement forbids."""
    g = inst.graph
    n, D = inst.size, inst.n_devices
    n_comp = np.full((D, n), max_computes, dtype=np.int64)
    if hint is not None:
        for (d, v), lst in hint.comps.items():
            n_comp[d, v] = max(n_comp[d, v], len(lst))
    n_comp = np.minimum(n_comp, (n - np.arange(n))[None, :])  # one per stage t >= v
    unread = np.array([not s for s in g.successors]) & (g.state_reader < 0)
    n_comp[:, unread] = np.minimum(n_comp[:, unread], 1)  # computed once, at stage v
    n_comp[~can_run] = 0
    if placement is not None:
        placement = np.asarray(placement, dtype=np.int64)
        if placement.shape != (n,) or placement.min() < -1 or placement.max() >= D:
            raise ValueError(
                f"placement needs one device index in 0..{D - 1} (or -1: free) for each of "
                f"{n} nodes"
            )
        other = (np.arange(D)[:, None] != placement[None, :]) & (placement[None, :] >= 0)
        n_comp[other] = 0
        if not (n_comp > 0).any(axis=0).all():
            v = int(np.flatnonzero(~(n_comp > 0).any(axis=0))[0])
            raise ValueError(f"placement puts node {v} on a device whose budget cannot run it")
    return n_comp


def _add_state(mdl, iv: _Iv, prev: _Iv | None, n: int, lo_stage: int, nbytes: int, demand):
    """The state interval ``[start, se]`` of a computation (``nbytes`` on its device). The
    previous computation's state on the device ends before this one's stage: the simulator
    rejects a state kept into a stage that makes it anew."""
    name = f"{iv.v}_{iv.d}_{iv.k}"
    iv.se = mdl.new_int_var(lo_stage * n + iv.v, n * n - 1, f"a{name}")
    mdl.add(iv.se >= iv.start)
    mdl.add(iv.se == iv.start).only_enforce_if(iv.pres.Not())
    if nbytes:
        size = mdl.new_int_var(1, n * n, f"za{name}")
        itv = mdl.new_optional_interval_var(iv.start, size, iv.se + 1, iv.pres, f"ia{name}")
        demand.append((itv, nbytes))
    if prev is not None:
        mdl.add(prev.se <= iv.stage * n - 1).only_enforce_if(iv.pres)


def _state_covers(mdl, g, ivs, D: int) -> list[_Cover]:
    """Each computation of ``B_v`` on ``d`` reads the state of exactly one computation of
    ``F_v`` on ``d`` itself (never copied) that started before it and whose state lasts until
    it."""
    covers: list[_Cover] = []
    for e in g.state_edges:
        v, b = e.src, e.dst
        for d in range(D):
            for dst in ivs[(d, b)]:
                lits = []
                for src in ivs[(d, v)]:
                    lit = mdl.new_bool_var(f"c{v}_{d}_{src.k}>>{b}_{dst.k}")
                    mdl.add_implication(lit, src.pres)
                    mdl.add(src.start + 1 <= dst.start).only_enforce_if(lit)
                    mdl.add(src.se >= dst.start).only_enforce_if(lit)
                    src.state_uses.append(lit)
                    covers.append(_Cover(lit, src, dst, False, state=True))
                    lits.append(lit)
                if lits:
                    mdl.add(sum(lits) == dst.pres)
                else:
                    mdl.add(dst.pres == 0)
    return covers


def _unread(mdl, g, ivs, n: int, D: int) -> None:
    """What nobody reads lasts as long as the simulator keeps it (module docstring).

    A value nobody reads stays until the end of its stage, event ``e(t, t)``; a node without a
    state has no use for such a computation except its first, where that end is its start. An
    unread state stays as long, or until ``B_v``'s step when ``B_v`` runs in that stage on
    another device (the simulator frees the state on every device after ``B_v``)."""
    for (d, v), lst in ivs.items():
        b = int(g.state_reader[v])
        for iv in lst:
            tail = iv.stage * (n + 1)
            if b < 0:
                if g.successors[v]:
                    escape = [iv.pres.Not()] + ([iv.first] if iv.first is not None else [])
                    mdl.add_bool_or(iv.uses + escape)
                elif iv.first is not None:
                    mdl.add_implication(iv.pres, iv.first)
                continue
            whole = mdl.new_bool_var("")
            mdl.add(iv.end >= tail).only_enforce_if(whole)
            mdl.add_bool_or(iv.uses + [iv.pres.Not(), whole])
            if g.state_bytes[v]:
                _unread_state(
                    mdl, iv, [j for d2 in range(D) if d2 != d for j in ivs[(d2, b)]], n, b
                )


def _unread_state(mdl, iv: _Iv, others: list[_Iv], n: int, b: int) -> None:
    """An unread state lasts until the end of its stage, or until event ``e(t, b)`` when some
    computation of ``B_v = b`` (in ``others``, on other devices) is in the same stage."""
    whole = mdl.new_bool_var("")
    mdl.add(iv.se >= iv.stage * (n + 1)).only_enforce_if(whole)
    lits = iv.state_uses + [iv.pres.Not(), whole]
    if others:
        cut = mdl.new_bool_var("")
        mdl.add(iv.se >= iv.stage * n + b).only_enforce_if(cut)
        same = []
        for jb in others:
            eq = mdl.new_bool_var("")
            mdl.add_implication(eq, jb.pres)
            mdl.add(jb.stage == iv.stage).only_enforce_if(eq)
            same.append(eq)
        mdl.add_bool_or(same + [cut.Not()])
        lits.append(cut)
    mdl.add_bool_or(lits)


def _solution(solver, inst: Instance, ivs, covers: list[_Cover]):
    """The solver's choice in plain numbers (an :class:`IntervalSolution` with every interval
    ending where the simulator frees it) and its time, recomputed in floating point."""
    g, n = inst.graph, inst.size
    comps: dict[tuple[int, int, int], list[int]] = {}  # (d, v, start) -> last reads
    objective = 0.0
    for (d, v), lst in ivs.items():
        for iv in lst:
            if solver.boolean_value(iv.pres):
                comps[(d, v, int(solver.value(iv.start)))] = [-1, -1]  # value, state
                objective += float(inst.compute_s[d, v])
    copies = []
    for cov in covers:
        if not solver.boolean_value(cov.lit):
            continue
        s_read = int(solver.value(cov.dst.start))
        last = comps[(cov.src.d, cov.src.v, int(solver.value(cov.src.start)))]
        last[cov.state] = max(last[cov.state], s_read)
        if cov.remote:
            copies.append((cov.src.d, cov.dst.d, cov.src.v, s_read))
            objective += float(inst.copy_s[cov.src.d, cov.dst.d, cov.src.v])
    runs = {(v, s // n) for (_d, v, s) in comps}  # (node, stage) computed on some device
    computations, states = [], []
    for (d, v, s), (last, st_last) in comps.items():
        t, b = s // n, int(g.state_reader[v])
        tail = event(t, t, n)
        computations.append((d, v, s, last if last >= 0 else tail))
        if b >= 0:
            dropped = event(t, b, n) if (b, t) in runs else tail
            states.append((d, v, s, st_last if st_last >= 0 else dropped))
    return IntervalSolution(computations, copies, states), objective


def _add_hint(mdl, inst: Instance, ivs, covers: list[_Cover], hint: _Replay) -> None:
    """Hint the solver with a valid schedule (every variable the model has a value for)."""
    n = inst.size
    value: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # (d, v, k) -> events
    for (d, v), lst in hint.comps.items():
        for k, (s, last, st_end) in enumerate(lst):
            value[(d, v, k)] = (s, last if last >= 0 else event(s // n, s // n, n), st_end)
    for (d, v), lst in ivs.items():
        for iv in lst:
            got = value.get((d, v, iv.k))
            mdl.add_hint(iv.pres, got is not None)
            if got is None:
                continue
            mdl.add_hint(iv.stage, got[0] // n)
            mdl.add_hint(iv.end, got[1])
            if iv.first is not None:
                mdl.add_hint(iv.first, got[0] // n == v)
            if iv.end_stage is not None:
                mdl.add_hint(iv.end_stage, got[1] // n)
            if iv.se is not None:
                mdl.add_hint(iv.se, got[2])
    chosen = set()
    for (t, wv, d, u), (src_d, j) in hint.reads.items():
        chosen.add((u, src_d, j, wv, d, event(t, wv, n), False))
    for (d, b, s), j in hint.state_reads.items():
        chosen.add((int(inst.graph.state_source[b]), d, j, b, d, s, True))
    for cov in covers:
        src, dst = cov.src, cov.dst
        got = value.get((dst.d, dst.v, dst.k))
        key = (src.v, src.d, src.k, dst.v, dst.d, None if got is None else got[0], cov.state)
        mdl.add_hint(cov.lit, key in chosen)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g} s"
