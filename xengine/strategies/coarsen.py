"""Graph coarsening: fuse short single-path runs of operators (conv -> bn -> relu) into one node.

A coarse node stands for a contiguous range of fine node indices. Contiguous ranges of a
topological order are convex, so the quotient graph is a DAG whose nodes are again in
topological order, and a coarse schedule has the usual (D, N, N) frontier-advancing shape.

The coarse problem is a *restriction* of the fine one, never a relaxation: every valid coarse
schedule expands (:meth:`Coarsening.expand`) to a valid fine schedule that computes no more, and
whose simulated memory at each step is at most the coarse schedule's at the corresponding
step. The number reported for a coarse solve is therefore the fine simulated time of the
expansion, an upper bound on the fine optimum (the coarse MILP's bound is not a fine bound).

Memory model of a coarse node (conservative, so a coarse schedule within budget expands to a
fine one within budget). A member is *external* when some fine successor lies outside its
group (or it has none: a sink's output lives to the end of its stage, like a coarse output);
only external members can be read after the group has run, so

* ``output_bytes`` = the sum of the external members' outputs (kept or dropped as a whole),
  plus the members' autograd states;
* ``output_bytes + workspace_bytes`` = the largest memory the members need while the group
  runs: at member ``k``, every external member computed so far, every internal member computed
  so far that a member ``>= k`` still reads, the states made so far, ``k``'s own output and
  ``k``'s workspace.

A member's autograd state (docs/design.md section 3) becomes part of its group's value, read over a
non-copyable edge by the group that holds the member's backward op: the coarse graph has no
states of its own (version-1 semantics), the coarse value outlives each fine state it stands
for, and expansion recomputes a member whose backward op needs its state.

Expansion keeps a fine tensor only where the coarse schedule keeps its group *and* a later node
reads it, and recomputes only the members of a recomputed group that something reads. Without
this the simulator would hold an unread member to the end of its stage (it frees a tensor after
its last reader in the stage, one without a reader only at the stage's end) while the coarse
model frees the whole group after the group's last reader, and the fine peak could exceed the
coarse one. Hence fine compute time <= coarse compute time (equal unless the coarse schedule
recomputes in vain); copy time may differ either way, since the fine schedule copies single
members, once per reading member.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from xengine.graph.types import Edge, Graph, Node
from xengine.problem import Instance
from xengine.result import CoarseSolve, StrategyResult
from xengine.schedule import Schedule

log = logging.getLogger(__name__)


def group_ranges(graph: Graph, max_group: int = 3) -> tuple[tuple[int, ...], ...]:
    """Contiguous fine-index ranges to fuse.

    Node ``v`` joins the group of ``v - 1`` when both have the same kind (not the loss), the
    only predecessor of ``v``'s kind is ``v - 1``, ``v`` is the only successor of ``v - 1``
    of that kind, and the group has fewer than ``max_group`` members. Edges to the other kind
    (backward ops reading forward outputs) do not block fusing: they make members external.
    """
    if max_group < 1:
        raise ValueError(f"max_group must be at least 1, got {max_group}")
    kinds = [v.kind for v in graph.nodes]
    preds, succs = graph.predecessors, graph.successors
    groups: list[list[int]] = [[0]]
    for v in range(1, graph.size):
        u = v - 1
        kind = kinds[v]
        fuse = (
            kind == kinds[u]
            and kind != "loss"
            and [p for p in preds[v] if kinds[p] == kind] == [u]
            and [s for s in succs[u] if kinds[s] == kind] == [v]
            and len(groups[-1]) < max_group
        )
        if fuse:
            groups[-1].append(v)
        else:
            groups.append([v])
    return tuple(tuple(g) for g in groups)


@dataclass(frozen=True, eq=False)
class Coarsening:
    """A fine graph, its coarse quotient, and the map between them.

    ``groups[c]`` are the fine indices (a contiguous range) of coarse node ``c``;
    ``group_of[i]`` is the coarse node of fine node ``i``.
    """

    fine: Graph
    graph: Graph
    groups: tuple[tuple[int, ...], ...]
    group_of: np.ndarray = field(repr=False)

    @cached_property
    def external(self) -> np.ndarray:
        """(n,) whether a fine node's output is part of its coarse node's output."""
        return _external(self.fine, self.group_of)

    def instance(self, inst: Instance) -> Instance:
        """The same devices and budgets on the coarse graph."""
        if inst.graph is not self.fine and inst.graph.nodes != self.fine.nodes:
            raise ValueError(
                f"instance is on graph {inst.graph.name!r}, this coarsening is of "
                f"{self.fine.name!r}"
            )
        return Instance(self.graph, inst.devices, inst.budget_bytes)

    def expand(self, sched: Schedule) -> Schedule:
        """The fine (D, n, n) schedule of a valid coarse (D, N, N) one.

        Coarse stage ``k`` (fine range ``a..b``) becomes fine stages ``a..b``: stage ``a``
        recomputes the read members of every group recomputed in coarse stage ``k`` and
        computes ``a``; stages ``a+1..b`` compute one member each on the devices that ran
        ``k``. A fine tensor is kept into a stage where it was alive at the end of the previous
        one and a later member of the group reads it, or it is kept into the next coarse stage;
        into stage ``a`` only external members of groups the coarse schedule keeps, and only if
        they are read in ``a..b`` or kept further. Stages are filled from the last backwards,
        because what stage ``k`` keeps depends on what stage ``k + 1`` needs.
        """
        N, n = self.graph.size, self.fine.size
        D = len(sched.devices)
        if sched.R.shape != (D, N, N):
            raise ValueError(
                f"coarse schedule has shape {sched.R.shape}, expected {(D, N, N)} for "
                f"{D} device(s) and the {N}-node coarse graph of {self.fine.name!r}"
            )
        Rc, Sc = sched.R, sched.S
        R = np.zeros((D, n, n), dtype=bool)
        S = np.zeros((D, n, n), dtype=bool)
        succs, preds = self.fine.successors, self.fine.predecessors
        sreader = self.fine.state_reader
        ext = self.external
        no_keep = np.zeros((D, n), dtype=bool)
        for k in range(N - 1, -1, -1):
            members = self.groups[k]
            a, b = members[0], members[-1]
            keep_next = S[:, b + 1, :] if k + 1 < N else no_keep
            computed = np.zeros(n, dtype=bool)  # computed on some device in fine stages a..b
            runs = Rc[:, k, k]
            for s in members:
                R[runs, s, s] = True
            computed[list(members)] = runs.any()
            # recomputed groups, read members only (readers have larger indices: go down)
            for g in range(k - 1, -1, -1):
                devs = Rc[:, k, g]
                if not devs.any():
                    continue
                for x in reversed(self.groups[g]):
                    read = any(computed[v] for v in succs[x]) or (
                        sreader[x] >= 0 and computed[sreader[x]]
                    )
                    on = devs & (read | keep_next[:, x])
                    R[on, a, x] = True
                    computed[x] = on.any()
            # residents of stage a: external members of kept groups that are still needed
            for g in range(k):
                kept = Sc[:, k, g]
                if not kept.any():
                    continue
                for u in self.groups[g]:
                    if ext[u]:
                        read = any(computed[v] for v in succs[u])
                        S[kept & (read | keep_next[:, u]), a, u] = True
            # inside the group: keep what a later member reads or the next coarse stage keeps
            # (read_later[s]: read by a member s..b; stage s needs stage s - 1 filled first)
            read_later = np.zeros((b + 2 - a, n), dtype=bool)
            for s in range(b, a, -1):
                read_later[s - a] = read_later[s - a + 1]
                read_later[s - a, list(preds[s])] = True
            for s in range(a + 1, b + 1):
                alive = S[:, s - 1, :] | R[:, s - 1, :]
                S[:, s, :] = alive & (read_later[s - a][None, :] | keep_next)
        return Schedule(sched.devices, R, S)


def _external(graph: Graph, group_of: np.ndarray) -> np.ndarray:
    """(n,) members read outside their group, or by no node at all (a sink's output lives to
    the end of its stage, as a coarse output does; counting it keeps a one-node group equal
    to its fine node)."""
    sreader = graph.state_reader
    return np.array(
        [
            not succ
            or any(group_of[s] != group_of[i] for s in succ)
            or (sreader[i] >= 0 and group_of[sreader[i]] != group_of[i])
            for i, succ in enumerate(graph.successors)
        ],
        dtype=bool,
    )


def coarsen(graph: Graph, max_group: int = 3) -> Coarsening:
    """Fuse runs of at most ``max_group`` nodes (see :func:`group_ranges`) into one node each.

    Costs add up per device (the devices every member has a cost for); copy models, fixed
    bytes and meta carry over. One coarse edge stands for all fine edges between two groups
    and is copyable only if all of them are. Memory: see the module docstring.
    """
    groups = group_ranges(graph, max_group)
    n = graph.size
    group_of = np.empty(n, dtype=np.int64)
    for c, members in enumerate(groups):
        group_of[list(members)] = c
    m, w, st = graph.output_bytes, graph.workspace_bytes, graph.state_bytes
    succs = graph.successors
    ext = _external(graph, group_of)

    nodes = []
    twins: set[int | None] = set()
    for members in groups:
        fine_nodes = [graph.nodes[i] for i in members]
        first = fine_nodes[0]
        out_bytes = int(sum(int(m[i]) for i in members if ext[i]))
        out_bytes += int(sum(int(st[i]) for i in members))
        live = {
            k: sum(
                int(m[j]) + int(st[j])
                for j in members
                if j <= k and (j == k or ext[j] or max(succs[j], default=-1) >= k)
            )
            for k in members
        }
        peak_bytes = max(live[k] + int(w[k]) for k in members)
        ws_devices = sorted({d for v in fine_nodes for d in v.device_workspace_bytes})
        dev_ws = {
            d: max(0, max(live[k] + graph.nodes[k].workspace_on(d) for k in members) - out_bytes)
            for d in ws_devices
        }
        devices = set(first.cost_s)
        for v in fine_nodes[1:]:
            devices &= set(v.cost_s)
        fwd_index = None
        if first.kind == "bwd" and first.fwd_index is not None:
            fwd_index = int(group_of[first.fwd_index])
            if fwd_index in twins:  # groupings differ: a forward group has one backward twin
                fwd_index = None
            twins.add(fwd_index)
        nodes.append(
            Node(
                "+".join(v.name for v in fine_nodes),
                first.kind,
                out_bytes,
                {d: float(sum(v.cost_s[d] for v in fine_nodes)) for d in sorted(devices)},
                workspace_bytes=max(0, peak_bytes - out_bytes),
                fwd_index=fwd_index,
                device_workspace_bytes=dev_ws,
            )
        )
    copyable: dict[tuple[int, int], bool] = {}
    for e in graph.edges:  # a state edge becomes a non-copyable read of the group's value
        key = (int(group_of[e.src]), int(group_of[e.dst]))
        if key[0] != key[1]:
            copyable[key] = copyable.get(key, True) and e.copyable
    coarse = replace(
        graph,
        name=f"{graph.name}-coarse{max_group}",
        nodes=tuple(nodes),
        edges=tuple(Edge(u, v, c) for (u, v), c in sorted(copyable.items())),
        copy_models=dict(graph.copy_models),
        meta={**graph.meta, "coarsened_from": graph.name, "coarsen_max_group": max_group},
    )
    log.info(
        "coarsened %s: %d -> %d nodes, %d -> %d edges (max_group=%d)",
        graph.name,
        n,
        coarse.size,
        len(graph.edges),
        len(coarse.edges),
        max_group,
    )
    return Coarsening(graph, coarse, groups, group_of)


def solve_coarse(
    inst: Instance,
    coarsening: Coarsening | None = None,
    max_group: int = 3,
    **solve_kwargs,
) -> StrategyResult:
    """Solve the coarse instance with :func:`xengine.strategies.solve.solve_xengine`, expand,
    replay.

    ``solve_kwargs`` go to ``solve_xengine`` as they are: a ``warm_start`` or ``placement``
    must be for the coarse graph.

    The result's schedule and simulation are the *fine* ones; the coarse model's objective,
    bounds, trace and simulated time go to ``res.coarse`` (a coarse bound is no bound on the
    fine optimum, so ``best_bound_s`` and ``gap`` are cleared and an optimal coarse solve is
    ``feasible``).
    """
    from xengine.simulate import ScheduleError, simulate
    from xengine.strategies.solve import solve_xengine

    t0 = time.perf_counter()
    c = coarsening or coarsen(inst.graph, max_group)
    solve_kwargs.setdefault("strategy", "xengine-coarse")
    res = solve_xengine(c.instance(inst), **solve_kwargs)
    res.coarse = CoarseSolve(
        nodes=c.graph.size,
        status=res.status,
        objective_s=res.objective_s,
        best_bound_s=res.best_bound_s,
        sim_time_s=None if res.sim is None else res.sim.time_s,
        peak_bytes=None if res.sim is None else res.sim.peak_bytes.tolist(),
        placement_bound_s=res.placement_bound_s,
        lp_bound_s=res.lp_bound_s,
        trace=res.trace,
    )
    # of the coarse problem only: nothing of it bounds the fine one
    res.objective_s = res.best_bound_s = res.gap = res.model_peak_bytes = None
    res.placement_bound_s = res.lp_bound_s = None
    res.trace = []
    if res.schedule is None:
        res.sim = None
        if res.status == "infeasible":
            # the coarse model needs more memory than the fine one: this proves nothing
            # about the fine problem, which may well have schedules
            res.status = "no_solution"
            res.message = (
                f"the coarse model ({c.graph.size} nodes, max_group "
                f"{c.graph.meta.get('coarsen_max_group', max_group)}) is infeasible "
                "at these budgets; the fine problem may still have schedules"
                + (f" ({res.message})" if res.message else "")
            )
        return res
    fine = c.expand(res.schedule)
    try:
        sim = simulate(inst, fine, check_budget=False)
    except ScheduleError as exc:  # a bug in expand: say so rather than report a number
        res.status, res.schedule, res.sim = "error", None, None
        res.message = f"expanded coarse schedule rejected by the simulator: {exc}"
        log.error("%s: %s", res.strategy, res.message)
        return res
    res.schedule, res.sim = fine, sim
    res.message = (
        f"solved on the coarsened graph ({c.graph.size} of {inst.size} nodes, runs of up to "
        f"{c.graph.meta.get('coarsen_max_group', max_group)} ops fused): coarse model "
        f"{res.coarse.status}, no bound for this graph"
    )
    if res.status == "optimal":
        res.status = "feasible"
    if sim.violations:
        res.status = "error"
        res.message = f"expanded coarse schedule over budget: {sim.violations[0]}"
    log.info(
        "%s: coarse objective %.6g s (%d nodes), fine simulated %.6g s (%d nodes), %.1f s total",
        res.strategy,
        res.coarse.objective_s,
        c.graph.size,
        sim.time_s,
        inst.size,
        time.perf_counter() - t0,
    )
    return res
