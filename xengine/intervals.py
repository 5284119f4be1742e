"""The retention-interval model on OR-Tools CP-SAT, for one device or several (issue 5).

Why a second model: the Checkmate / XEngine MILP (:mod:`xengine.formulation`) has D x n x n
binaries for R and S alone, and its LP relaxation is what open-source MILP solvers spend their
time on (shared/reference/solver-calibration.md: ResNet-50 gets no solution from HiGHS in
600 s). MOCCASIN (Bartan et al., ICML 2023) writes the same single-device problem with
O(n) interval variables on CP-SAT and solves the large graphs far faster. This module is our
own version of that idea, written for xengine's semantics (DESIGN.md section 5) and extended
to several devices with copies.

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

Reads. For every edge ``u -> w`` and every computation of ``w`` at event ``s`` on ``d``, exactly
one computation of ``u`` *covers* it: it started before ``s`` and ends at ``s`` or later. A
cover on another device is a copy (copyable edges only): its time is charged and ``m_u`` bytes
sit on ``d`` during step ``s``. A copy is allowed only when no computation of ``u`` on ``d``
covers ``s`` (the simulator copies only then), so the objective is the simulator's time at
every feasible point, not only at the optimum.

Memory. One cumulative constraint per device: outputs over their intervals, workspace and
transient copies during their step, capacity = the device's budget.

From intervals to a schedule. ``R`` comes from the starts. Residency ``S`` is derived from the
*last read* ``L`` of each computation (not from ``end``, which may be longer): the output is
kept into stage ``t`` when ``start < e(t, 0) <= L``. The simulator then frees the output after
its last reader, so its memory is never above the model's; with ``end = L`` they are equal
(tested via :func:`interval_peaks`).

Two restrictions make the simulator's rules expressible; both are reported with every result:

* at most ``C`` computations per (node, device);
* (two or more devices) a node's output is never alive on two devices in one stage. The
  simulator frees a tensor after its last reader *on any device*, which an interval on one
  device cannot see; with this rule every reader in a stage reads the one live copy.

A restricted model can miss the MILP's optimum. ``experiments/solver_benchmark.py`` compares
the two on every suite instance and flags any difference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from xengine.bounds import LpBoundAlongside, cpu_split, lp_bound_s, pinned, placement_bound_s
from xengine.problem import Instance
from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, simulate
from xengine.solve import check_with_simulator
from xengine.solvers.cpsat import run_cpsat
from xengine.solvers.model import SolverOptions, SolverUnavailable, relative_gap

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
    """One optional computation of node ``v`` on device ``d`` and the interval of its output."""

    v: int
    d: int
    k: int
    pres: object
    start: object
    end: object
    first: object | None = None  # k == 0: this is v's first computation (stage v)
    stage: object | None = None  # stage of start (two or more devices)
    end_stage: object | None = None
    uses: list = field(default_factory=list)  # cover literals reading this computation


@dataclass
class _Cover:
    """Computation ``src`` covers the read of edge ``u -> w`` by computation ``dst``."""

    lit: object
    src: _Iv
    dst: _Iv
    remote: bool


@dataclass
class IntervalSolution:
    """What the solver chose, in plain numbers: per computation its device, node, start event
    and last read event (``L``), and per read the covering computation."""

    computations: list[tuple[int, int, int, int]]  # (d, v, start_event, last_read_event)
    copies: list[tuple[int, int, int, int]]  # (src_device, dst_device, u, event)


def schedule_from(inst: Instance, sol: IntervalSolution) -> Schedule:
    """R from the starts; S from start to the last read (module docstring)."""
    n, D = inst.size, inst.n_devices
    R = np.zeros((D, n, n), dtype=bool)
    S = np.zeros((D, n, n), dtype=bool)
    for d, v, s, last in sol.computations:
        t0, t1 = s // n, last // n
        R[d, t0, v] = True
        if t1 > t0:
            S[d, t0 + 1 : t1 + 1, v] = True
    return Schedule(inst.devices, R, S)


def interval_peaks(inst: Instance, sol: IntervalSolution) -> np.ndarray:
    """Per-device peak of the model's memory with every interval ending at its last read.

    Computed on the event axis, independently of the simulator: the test that the two agree
    is the check that the interval semantics above are the simulator's.
    """
    g = inst.graph
    n, D = inst.size, inst.n_devices
    H = n * n
    m, w = g.output_bytes, g.workspace_bytes
    diff = np.zeros((D, H + 1), dtype=np.int64)
    point = np.zeros((D, H), dtype=np.int64)
    for d, v, s, last in sol.computations:
        diff[d, s] += m[v]
        diff[d, last + 1] -= m[v]
        point[d, s] += w[v]
    for _src, dst, u, s in sol.copies:
        point[dst, s] += m[u]
    mem = np.cumsum(diff[:, :H], axis=1) + point
    return mem.max(axis=1) if H else np.zeros(D, dtype=np.int64)


def _replay(inst: Instance, sched: Schedule):
    """A valid schedule as computations: per (d, v) the list of [stage, last read event], and
    per read (t, w, d, u) the (device, index) of the computation it reads."""
    sim = simulate(inst, sched, check_budget=False)
    comps: dict[tuple[int, int], list[list[int]]] = {}
    reads: dict[tuple[int, int, int, int], tuple[int, int]] = {}
    pending: dict[int, int] = {}  # u -> source device of a copy for the next compute
    for op in sim.ops:
        if op.kind == "copy":
            pending[op.node] = op.src_device
        elif op.kind == "compute":
            t, w, d = op.stage, op.node, op.device
            s = event(t, w, inst.size)
            for e in inst.graph.in_edges[w]:
                u = e.src
                src = pending.get(u, d)
                j = len(comps[(src, u)]) - 1
                comps[(src, u)][j][1] = max(comps[(src, u)][j][1], s)
                reads[(t, w, d, u)] = (src, j)
            pending = {}
            comps.setdefault((d, w), []).append([t, s])
    return comps, reads


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

    Same result type and the same simulator check as :func:`xengine.solve.solve_xengine`;
    ``objective_s`` is the model's time of the returned solution and ``model_peak_bytes`` the
    model's memory with tight intervals (:func:`interval_peaks`), which must equal the
    simulator's. ``extra["restriction"]`` states what the model cannot express.
    ``placement`` (a device index per node, -1 = free) computes and keeps each node on its
    device only, as in :func:`xengine.solve.solve_xengine`.

    ``lp_bound``: CP-SAT's own bound stays near zero on these models with two workers (its
    portfolio then has no bound-proving worker), so the LP relaxation of the exact MILP is
    solved first (HiGHS, at most half the time limit, counted in the time limit) and given to
    CP-SAT as a lower bound on the objective. It is valid here: the interval model's optimum is
    never below the MILP's. ``best_bound_s`` and ``gap`` are then with respect to the full
    problem; ``extra["lp_bound_s"]`` and ``extra["lp_bound_time_s"]`` say what it cost.
    ``lp_bound=False`` skips the LP (on resnet50 with two devices it does not solve in 600 s,
    ``experiments/lp_bound_speed.py``); the placement bound, a fraction of a second, is always
    computed (without a placement restriction) and given to CP-SAT the same way.
    ``lp_bound="alongside"`` computes the LP bound (:func:`lp_bound_s`, PDLP from resnet50's
    size on) in a process of its own on one CPU for the whole time limit, while CP-SAT
    searches on the other CPUs (:class:`xengine.bounds.LpBoundAlongside`). CP-SAT cannot use
    that bound during its search (it only stops at the time limit then), but it is reported
    as ``best_bound_s`` and ``gap`` like the other; ``solve_time_s`` includes waiting for it.
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
    g = inst.graph
    n, D = inst.size, inst.n_devices
    m = g.output_bytes
    w = g.workspace_bytes
    cost = inst.compute_s
    copy = inst.copy_s
    budgets = inst.budgets
    succ = g.successors

    restriction = f"at most {max_computes} computations per node and device"
    if D > 1:
        restriction += "; a node's output is on one device at a time within a stage"
    res = StrategyResult(
        strategy=strategy,
        devices=inst.devices,
        budget_bytes=inst.budget_bytes,
        status="error",
        solver="cpsat",
        extra={"mode": "intervals", "restriction": restriction, "max_computes": max_computes},
    )
    footprint = g.node_lower_bound_bytes()
    can_run = footprint[None, :] <= budgets[:, None]  # (D, n)
    blocked = np.flatnonzero(~can_run.any(axis=0))
    if blocked.size:
        v = int(blocked[np.argmax(footprint[blocked])])
        res.status = "infeasible"
        res.message = (
            f"infeasible: node {g.nodes[v].name} needs {int(footprint[v])} bytes (inputs + "
            "output + workspace) on one device, more than any device's budget; every budget "
            f"must be at least {int(footprint[v])} bytes"
        )
        res.extra["min_budget_lower_bound_bytes"] = int(footprint[v])
        return res

    # how many computations each (device, node) may have
    n_comp = np.full((D, n), max_computes, dtype=np.int64)
    hint = None
    if warm_start is not None:
        try:
            hint = _replay(inst, warm_start)
        except ScheduleError as exc:
            log.warning("warm start is not a valid schedule (%s); not used", exc)
        else:
            for (d, v), lst in hint[0].items():
                n_comp[d, v] = max(n_comp[d, v], len(lst))
    n_comp = np.minimum(n_comp, (n - np.arange(n))[None, :])  # one per stage t >= v
    for v in range(n):
        if not succ[v]:
            n_comp[:, v] = np.minimum(n_comp[:, v], 1)  # never read: computed once, at stage v
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

    H = n * n
    mdl = cp_model.CpModel()
    ivs: dict[tuple[int, int], list[_Iv]] = {}
    demands: list[list[tuple[object, int]]] = [[] for _ in range(D)]
    obj_terms: list[tuple[object, int]] = []
    cost_ns = np.rint(cost / TIME_UNIT_S).astype(np.int64)
    copy_ns = np.rint(copy / TIME_UNIT_S).astype(np.int64)

    for v in range(n):
        firsts = []
        for d in range(D):
            lst: list[_Iv] = []
            for k in range(int(n_comp[d, v])):
                lo_stage = v if k == 0 else v + 1
                name = f"{v}_{d}_{k}"
                pres = mdl.new_bool_var(f"p{name}")
                stage = mdl.new_int_var(lo_stage, n - 1, f"t{name}")
                start = stage * n + v
                end = mdl.new_int_var(lo_stage * n + v, H - 1, f"e{name}")
                mdl.add(end >= start)
                size = mdl.new_int_var(1, H, f"z{name}")
                itv = mdl.new_optional_interval_var(start, size, end + 1, pres, f"i{name}")
                demands[d].append((itv, int(m[v])))
                if w[v] > 0:
                    demands[d].append(
                        (
                            mdl.new_optional_fixed_size_interval_var(start, 1, pres, f"w{name}"),
                            int(w[v]),
                        )
                    )
                iv = _Iv(v, d, k, pres, start, end, stage=stage)
                # an absent computation sits at its earliest place (no symmetric copies)
                rest = lo_stage if (k or v + 1 == n) else v + 1
                mdl.add(stage == rest).only_enforce_if(pres.Not())
                mdl.add(end == start).only_enforce_if(pres.Not())
                if not succ[v]:
                    mdl.add(end == start)
                if k == 0:
                    iv.first = mdl.new_bool_var(f"f{name}")
                    mdl.add_implication(iv.first, pres)
                    mdl.add(stage == v).only_enforce_if(iv.first)
                    if v + 1 < n:
                        mdl.add(stage >= v + 1).only_enforce_if(iv.first.Not())
                    else:
                        mdl.add_implication(pres, iv.first)
                    firsts.append(iv.first)
                else:
                    prev = lst[-1]
                    mdl.add_implication(pres, prev.pres)
                    mdl.add(start >= prev.end + 1).only_enforce_if(pres)
                obj_terms.append((pres, int(cost_ns[d, v])))
                lst.append(iv)
            ivs[(d, v)] = lst
        mdl.add_exactly_one(firsts)
        # redundant, for the LP relaxation: every node is computed at least once
        mdl.add(sum(iv.pres for d in range(D) for iv in ivs[(d, v)]) >= 1)

    # two or more devices: a node's computations never share a stage (module docstring)
    if D > 1:
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
                    mdl.new_optional_interval_var(
                        iv.stage, span, iv.end_stage + 1, iv.pres, f"x{name}"
                    )
                )
            mdl.add_no_overlap(ext)

    # reads: exactly one computation of u covers each computation of w
    covers: list[_Cover] = []
    for e in g.edges:
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
                        cov = _Cover(b, src, dst, d2 != d)
                        covers.append(cov)
                        lits.append(b)
                        if d2 != d:
                            remote_lits.append(b)
                            obj_terms.append((b, int(copy_ns[d2, d, u])))
                            demands[d].append(
                                (
                                    mdl.new_optional_fixed_size_interval_var(
                                        dst.start, 1, b, f"t{u}>{wv}_{d}_{dst.k}_{d2}_{src.k}"
                                    ),
                                    int(m[u]),
                                )
                            )
                mdl.add(sum(lits) == dst.pres)
                local = ivs[(d, u)]
                if remote_lits and local:
                    # a copy only when no computation of u on d covers the read
                    c = mdl.new_bool_var(f"r{u}>{wv}_{d}_{dst.k}")
                    mdl.add(sum(remote_lits) == c)
                    for src in local:
                        a1 = mdl.new_bool_var("")
                        a2 = mdl.new_bool_var("")
                        mdl.add_bool_or([c.Not(), src.pres.Not(), a1, a2])
                        mdl.add(src.start >= dst.start + 1).only_enforce_if(a1)
                        mdl.add(src.end <= dst.start - 1).only_enforce_if(a2)

    # every computation but a node's first is read at least once (an unread output would stay
    # until the end of its stage in the simulator, longer than its interval says)
    for lst in ivs.values():
        for iv in lst:
            if not succ[iv.v]:
                continue
            escape = [iv.pres.Not()] + ([iv.first] if iv.first is not None else [])
            mdl.add_bool_or(iv.uses + escape)

    for d in range(D):
        if demands[d]:
            mdl.add_cumulative(
                [itv for itv, _ in demands[d]], [dem for _, dem in demands[d]], int(budgets[d])
            )
    objective_ns = sum(c * lit for lit, c in obj_terms if c)
    mdl.minimize(objective_ns)
    if hint is not None:
        _add_hint(mdl, inst, ivs, covers, hint)
    build_s = time.perf_counter() - t_build
    time_limit_s = options.time_limit_s
    alongside = None
    search_cpus: set[int] = set()
    if placement is None:
        t_lp = time.perf_counter()
        half = None if time_limit_s is None else time_limit_s / 2
        res.extra["placement_bound_s"] = placement_bound_s(
            inst, replace(options, time_limit_s=half)
        )
        res.extra["lp_bound_s"] = (
            lp_bound_s(inst, replace(options, time_limit_s=half)) if lp_bound is True else None
        )
        res.extra["lp_bound_time_s"] = time.perf_counter() - t_lp
        if time_limit_s is not None:
            time_limit_s = max(time_limit_s - res.extra["lp_bound_time_s"], 0.01)
        bound = max(
            (b for b in (res.extra["lp_bound_s"], res.extra["placement_bound_s"]) if b is not None),
            default=None,
        )
        if bound is not None:
            # integer costs are rounded to the nanosecond: leave one per term of slack
            mdl.add(objective_ns >= int(np.floor(bound / TIME_UNIT_S)) - len(obj_terms))
        log.info(
            "%s: LP bound %s, placement bound %s, in %.1f s",
            strategy,
            _s(res.extra["lp_bound_s"]),
            _s(res.extra["placement_bound_s"]),
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
        res.extra["lp_bound_s"] = alongside.result()
        res.extra["lp_bound_wait_s"] = time.perf_counter() - t_wait
        elapsed += res.extra["lp_bound_wait_s"]
        log.info("%s: LP bound (alongside) %s", strategy, _s(res.extra["lp_bound_s"]))
    res.solve_time_s = elapsed + res.extra.get("lp_bound_time_s", 0.0)
    name = solver.status_name(code)
    res.extra["time_to_first_s"] = first_s
    res.extra["n_branches"] = int(solver.num_branches)
    # the model is the whole problem only with one device and a computation per later stage
    # (a node nobody reads needs one computation; any other one per stage from its own on)
    most_useful = np.where([bool(x) for x in succ], n - np.arange(n), 1)
    exact = D == 1 and bool((n_comp[0] >= most_useful).all())
    res.extra["restricted"] = not exact
    if name not in ("OPTIMAL", "FEASIBLE"):
        if name == "INFEASIBLE" and exact:
            res.status = "infeasible"
            res.message = "no schedule fits the budget"
        elif name == "INFEASIBLE":
            res.status = "no_solution"
            res.message = (
                f"the interval model has no schedule within the budgets ({restriction}); "
                "formulation=exact decides whether one exists"
            )
        elif name == "UNKNOWN":
            res.status = "no_solution"
            res.message = f"no schedule found in {res.solve_time_s:.1f} s"
        else:
            res.status = "error"
            res.message = f"CP-SAT status {name}"
        log.info("%s: %s after %.1f s", strategy, res.status, res.solve_time_s)
        return res

    computations = []
    copies = []
    objective = 0.0
    for (d, v), lst in ivs.items():
        for iv in lst:
            if not solver.boolean_value(iv.pres):
                continue
            s = int(solver.value(iv.start))
            computations.append([d, v, s, s])  # last read: raised below from the covers
            objective += float(cost[d, v])
    index = {(c[0], c[1], c[2]): c for c in computations}
    for cov in covers:
        if not solver.boolean_value(cov.lit):
            continue
        s_read = int(solver.value(cov.dst.start))
        src = index[(cov.src.d, cov.src.v, int(solver.value(cov.src.start)))]
        src[3] = max(src[3], s_read)
        if cov.remote:
            copies.append((cov.src.d, cov.dst.d, cov.src.v, s_read))
            objective += float(copy[cov.src.d, cov.dst.d, cov.src.v])
    sol = IntervalSolution([tuple(c) for c in computations], copies)
    res.objective_s = objective
    # CP-SAT's own bound holds for the restricted model only; reported bounds hold for the
    # whole problem: the LP and placement bounds, and CP-SAT's when the model is unrestricted
    bounds = [res.extra.get("lp_bound_s"), res.extra.get("placement_bound_s")]
    if exact:
        bounds.append(float(solver.best_objective_bound) * TIME_UNIT_S)
    bounds = [b for b in bounds if b is not None]
    res.best_bound_s = min(max(bounds), objective) if bounds else None
    res.gap = relative_gap(objective, res.best_bound_s) if bounds else None
    # CP-SAT's OPTIMAL is about the restricted model; it is the problem's optimum only when
    # the model is unrestricted or a bound valid for the whole problem meets it
    res.status = "feasible"
    if name == "OPTIMAL":
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
    return res


def _add_hint(mdl, inst: Instance, ivs, covers: list[_Cover], hint) -> None:
    """Hint the solver with a valid schedule (every variable the model has a value for)."""
    comps, reads = hint
    n = inst.size
    value: dict[tuple[int, int, int], tuple[int, int]] = {}  # (d, v, k) -> (start, end)
    for (d, v), lst in comps.items():
        for k, (t, last) in enumerate(lst):
            value[(d, v, k)] = (event(t, v, n), max(last, event(t, v, n)))
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
    chosen = set()
    for (t, wv, d, u), (src_d, j) in reads.items():
        chosen.add((u, src_d, j, wv, d, event(t, wv, n)))
    for cov in covers:
        src, dst = cov.src, cov.dst
        got = value.get((dst.d, dst.v, dst.k))
        on = got is not None and (src.v, src.d, src.k, dst.v, dst.d, got[0]) in chosen
        mdl.add_hint(cov.lit, on)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g} s"
