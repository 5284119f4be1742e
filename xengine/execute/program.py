"""Compile a schedule's operation list once into the plan the executor replays (docs/design.md 8).

The simulator's ``ops`` say what happens, node by node. Interpreting them one by one costs a
``torch.autograd.grad`` call and its Python around every backward node; on a GPU, or a CPU at
small sizes, that is the step (issue 16: 2.85x a plain step on an H200). This module reads the
list once, statically, and finds where autograd's own engine can run many backward nodes in one
pass, as a plain ``loss.backward()`` does:

* a **group** is a run of consecutive backward computes on one device with only frees between
  them (no forward compute, no copy, no other device's compute), each the first computation of
  its node in the step and the only reader of the autograd state it uses. A group is one
  ``torch.autograd.backward`` call.
* a **refill** is a recomputation of a node whose first state the schedule freed before any
  backward node read it: that state is *retired* (its own saved tensors dropped, its
  ``grad_fn`` kept) and the recomputation refills it, as ``torch.utils.checkpoint`` does, so
  the backward node runs on the ``grad_fn`` the forward pass linked to its consumers' and joins
  their group (:func:`_walk_ops`).
* an **internal edge** ``(B_w, u)`` is a gradient that ``B_w`` hands to ``u`` and that only
  ``B_u`` of the same group reads, through the very forward instance of ``F_u`` that ``F_w`` read
  (same device, no copy). Such a gradient never becomes a register: autograd passes it from
  node to node and frees it when ``B_u`` has consumed it.
* the forward computes then **connect** exactly those inputs: ``F_w`` reads the register of
  ``u`` itself (so that its ``grad_fn`` links to ``F_u``'s) instead of a fresh leaf. Every other
  input is a leaf, so a backward call never runs past its group.

Groups end where the engine's order could differ from the schedule's: autograd runs the ready
node created last first, so the forward instances of a group's computes must have been made in
the reverse of the group's order. And a compute whose gradient comes from a register starts a
group, so that a pass has one root, whose gradient the executor hands over when autograd
reaches it (a pre-hook), not when the pass starts. Both keep the measured memory on the
simulator's timeline.

* a forward compute is **native** when its backward runs in a group and every value it saves
  is, when that backward runs, still the very register it saved (not freed and made again in
  between): then autograd may keep its saved tensors itself, as in a plain step, and releases
  them when the backward has run, just when the schedule frees them; no Python hook runs for
  them. Otherwise saved tensors are looked up in the registers at backward time.

Autograd lets go of things by itself: a gradient passed inside a pass once its reader has
run, a state it holds once its backward has run, a root gradient once the root has run (and a
backward such as add's hands that very tensor on). So each of these is left to autograd only
where the schedule frees it at that moment; a schedule that keeps it longer (a solver may: it
costs nothing below the budget) gets a register, a looked-up state or a compute of its own,
and the measured memory stays the simulator's.

The plan is a pure function of the op list and the graph: the executor compiles it once per
schedule and replays it every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from xengine.graph.types import Graph
from xengine.simulate import Op


@dataclass(frozen=True)
class Group:
    """Backward computes run as one autograd pass on one device.

    ``first``/``last``: the op indices it spans (frees between its computes included);
    ``computes``: the op indices of its backward computes, in schedule order; ``refills``:
    the forward recomputations between them (:attr:`Plan.refill`), which run inside the pass,
    in a pre-hook of the compute that follows them (:func:`_refills_in_pass`)."""

    device: int
    first: int
    last: int
    computes: tuple[int, ...]
    refills: tuple[int, ...] = ()


@dataclass
class Plan:
    """What the executor needs beyond the op list.

    ``first_compute``: op indices that are a node's first computation in the step (parameter
    gradients, random state saved); ``state_of``: per backward compute, the op index of the
    forward compute whose state it uses; ``connect``: (forward compute op index, input node)
    pairs fed the register itself; ``internal``: (backward compute op index, input node) pairs
    whose gradient stays inside autograd; ``groups`` by their first op index; ``native``:
    forward computes whose saved tensors autograd may keep itself (see :func:`_native`);
    ``refill``: forward recomputations that refill the saved tensors of an earlier
    computation's retired state (compute op index -> that computation's op index), and
    ``retire``: the ``free_state`` op indices that retire a state instead of dropping it
    (see :func:`_walk_ops`)."""

    first_compute: frozenset[int]
    state_of: dict[int, int]
    connect: frozenset[tuple[int, int]]
    internal: frozenset[tuple[int, int]]
    groups: dict[int, Group] = field(default_factory=dict)
    native: frozenset[int] = frozenset()
    refill: dict[int, int] = field(default_factory=dict)
    retire: frozenset[int] = frozenset()


def backward_node(nf: int, v: int) -> int:
    """Index of ``B_v`` for forward node ``v`` (forward 0..nf-1, loss nf, backward after)."""
    return 2 * nf - v


def compile_plan(
    ops: Sequence[Op],
    graph: Graph,
    grad_inputs: Sequence[Sequence[int]],
    requires_grad: Sequence[bool],
    train: bool = True,
    fuse: bool = True,
    mutates_buffers: Sequence[bool] = (),
    in_pass: bool = True,
) -> Plan:
    """The plan for ``ops`` (``simulate(...).ops``) on ``graph``.

    ``grad_inputs[v]``: forward node ``v``'s inputs that receive a gradient from ``B_v``;
    ``requires_grad[v]``: whether ``v``'s output needs one (else ``B_v`` does nothing);
    ``fuse=False``: no groups (every backward node its own autograd call, as interpreted);
    ``in_pass=False``: a recomputation ends a group (it runs between two passes) instead of
    running inside it (:func:`_refills_in_pass`);
    ``mutates_buffers[v]``: ``v`` updates module buffers (batch norm), which a recomputation
    restores in place: autograd would see them changed under what it saved.

    Three passes (see the module docstring): walk the ops once to learn which instance of
    each register and state every compute reads (:func:`_walk_ops`), cut the backward
    computes into groups (:func:`_find_groups`), then mark the native forward computes
    (:func:`_native_forwards`)."""
    facts = _graph_facts(graph, grad_inputs)
    walk = _walk_ops(ops, facts, grad_inputs, revive=fuse and train)
    groups, internal = _find_groups(
        ops, facts, walk, grad_inputs, requires_grad, train, fuse, in_pass
    )
    connect = {(walk.state_of[k], u) for k, u in internal}
    native = _native_forwards(ops, groups, walk, mutates_buffers)
    return Plan(
        first_compute=frozenset(walk.first_compute),
        state_of=walk.state_of,
        connect=frozenset(connect),
        internal=frozenset(internal),
        groups=groups,
        native=frozenset(native),
        refill=walk.refill,
        retire=frozenset(walk.retire),
    )


@dataclass
class _GraphFacts:
    """What the plan reads of the graph, per node: the number of forward nodes ``nf``, each
    node's kind and forward twin, per forward node its gradient consumers and its state's
    reader, and per node the forward values autograd saves for it (docs/design.md section 3:
    a forward node its saved inputs, a backward node its twin's saved inputs and, if saved,
    the twin's output)."""

    nf: int
    kinds: list[str]
    fwd_of: list[int | None]
    consumers: list[list[int]]
    state_reader: Any
    saved_values: list[list[int]]


def _graph_facts(graph: Graph, grad_inputs: Sequence[Sequence[int]]) -> _GraphFacts:
    nf = (graph.size - 1) // 2
    kinds = [v.kind for v in graph.nodes]
    fwd_of = [v.fwd_index for v in graph.nodes]
    consumers: list[list[int]] = [[] for _ in range(nf)]
    for w in range(nf):
        for u in grad_inputs[w]:
            consumers[u].append(w)
    saved_values: list[list[int]] = [[] for _ in range(graph.size)]
    for b in range(graph.size):
        if kinds[b] == "bwd":
            w = fwd_of[b]
            saved = [e.src for e in graph.in_edges[b] if kinds[e.src] == "fwd"]
            saved_values[b] = saved
            saved_values[w] = [u for u in saved if u != w]
    return _GraphFacts(nf, kinds, fwd_of, consumers, graph.state_reader, saved_values)


@dataclass
class _OpWalk:
    """What one pass over the ops finds. An *instance* is the op index of the compute that
    made a register or a state; ``None`` stands for a transient copy.

    ``first_compute``: computes that are their node's first in the step; ``in_inst``: per
    forward compute, the instance of each input that receives a gradient; ``saved_at``: per
    compute, the instance of each value autograd saves for it; ``state_of``: per backward
    compute, the forward compute whose state it uses, ``state_uses`` how many do; ``copied``:
    computes whose register was copied to another device; ``reads``: per (B_w compute, u),
    the B_u computes that read that gradient register; ``contrib_src``: per B_u compute,
    (w, instance of B_w's register) for each consumer w; ``uses_copy``: computes that read
    a transient copy; ``refill``, ``retire``: as in :class:`Plan`."""

    first_compute: set[int] = field(default_factory=set)
    in_inst: dict[int, dict[int, int | None]] = field(default_factory=dict)
    saved_at: dict[int, dict[int, int | None]] = field(default_factory=dict)
    state_of: dict[int, int] = field(default_factory=dict)
    state_uses: dict[int, int] = field(default_factory=dict)
    copied: set[int] = field(default_factory=set)
    reads: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    contrib_src: dict[int, list[tuple[int, int | None]]] = field(default_factory=dict)
    uses_copy: set[int] = field(default_factory=set)
    refill: dict[int, int] = field(default_factory=dict)
    retire: set[int] = field(default_factory=set)


def _walk_ops(
    ops: Sequence[Op],
    facts: _GraphFacts,
    grad_inputs: Sequence[Sequence[int]],
    revive: bool = False,
) -> _OpWalk:
    """Replay the registers, states and transient copies of every device along ``ops`` (as
    the simulator makes them, docs/design.md section 5) and record, per compute, which instances
    it reads: a group may only link computes through the very instances they use.

    ``revive``: a state freed before any backward node read it, whose node the schedule
    computes again on the same device, is *retired*, not dropped: its ``grad_fn`` stays (its
    saved tensors are dropped, so it holds no memory) and the recomputation refills them, as
    ``torch.utils.checkpoint`` does. The backward node then runs on the first computation's
    ``grad_fn``, which is linked to its consumers' since the forward pass, and joins their
    pass; before, it made a state of its own, linked to nothing, and started a pass of its own
    (issue 29: recomputing schedules cost 1.03-1.27x a plain step even at 90 %)."""
    nf, kinds, fwd_of = facts.nf, facts.kinds, facts.fwd_of
    D = 1 + max((op.device for op in ops), default=0)
    D = max(D, 1 + max((op.src_device for op in ops if op.src_device is not None), default=0))
    val: list[dict[int, int]] = [{} for _ in range(D)]  # register instance: compute op index
    st: list[dict[int, int]] = [{} for _ in range(D)]  # state instance
    transient: list[set[int]] = [set() for _ in range(D)]
    retired: list[dict[int, tuple[int, int]]] = [{} for _ in range(D)]  # v -> (state, free op)
    seen: set[int] = set()
    out = _OpWalk()
    for i, op in enumerate(ops):
        d = op.device
        if op.kind == "copy":
            src = val[op.src_device].get(op.node)
            if src is not None:
                out.copied.add(src)
            transient[d].add(op.node)
            continue
        if op.kind == "free":
            val[d].pop(op.node, None)
            continue
        if op.kind == "free_state":
            s = st[d].pop(op.node, None)
            if revive and s is not None and not out.state_uses.get(s):
                retired[d][op.node] = (s, i)
            continue
        v = op.node
        if v not in seen:
            out.first_compute.add(i)
            seen.add(v)
        if transient[d]:
            out.uses_copy.add(i)
        kind = kinds[v]
        out.saved_at[i] = {
            u: (None if u in transient[d] else val[d].get(u)) for u in facts.saved_values[v]
        }
        if kind == "fwd":
            out.in_inst[i] = {
                u: (None if u in transient[d] else val[d].get(u)) for u in grad_inputs[v]
            }
            if facts.state_reader[v] >= 0:
                back = retired[d].pop(v, None)
                if back is None:
                    st[d][v] = i
                else:
                    st[d][v] = out.refill[i] = back[0]
                    out.retire.add(back[1])
        elif kind == "bwd":
            u = fwd_of[v]
            s = st[d].get(u)
            if s is not None:
                out.state_of[i] = s
                out.state_uses[s] = out.state_uses.get(s, 0) + 1
            srcs = []
            for w in facts.consumers[u]:
                b = backward_node(nf, w)
                k = None if b in transient[d] else val[d].get(b)
                srcs.append((w, k))
                if k is not None:
                    out.reads.setdefault((k, u), []).append(i)
            out.contrib_src[i] = srcs
        val[d][v] = i
        transient[d].clear()
    return out


def _find_groups(
    ops: Sequence[Op],
    facts: _GraphFacts,
    walk: _OpWalk,
    grad_inputs: Sequence[Sequence[int]],
    requires_grad: Sequence[bool],
    train: bool,
    fuse: bool,
    in_pass: bool = True,
) -> tuple[dict[int, Group], set[tuple[int, int]]]:
    """The groups, by their first op index, and the internal edges of all of them.

    One scan over the ops grows the current group while the next backward compute may join
    it: same device, its state made before the last member's (autograd runs the ready node
    made last first), each gradient from a member an internal edge, none from a register
    (a pass has one root). Any other compute closes the group; frees extend it, except the
    free of a member's own gradient register that holds a gradient autograd hands out (not
    internal): the pass fills that register only when it ends, so the group ends there too,
    or the gradient would live on through the later members while the simulator has freed it
    (a schedule that frees ``B_add`` early, to recompute it later)."""
    nf, fwd_of = facts.nf, facts.fwd_of
    state_of, contrib_src = walk.state_of, walk.contrib_src
    last_read: dict[int, int] = {}  # B_w compute -> the last compute that reads its register
    for (k, _u), readers in walk.reads.items():
        last_read[k] = max(last_read.get(k, -1), *readers)

    groups: dict[int, Group] = {}
    internal: set[tuple[int, int]] = set()
    cur: list[int] = []
    cur_first = -1
    cur_internal: set[tuple[int, int]] = set()
    cur_refills: list[int] = []
    pending: list[int] = []  # refills since the last member: they join with the next one
    before_pending = -1  # where the group ends if no member follows them

    def close(last: int) -> None:
        nonlocal cur, cur_first, cur_internal, cur_refills, pending
        if pending:
            last = before_pending
        if cur:
            groups[cur_first] = Group(
                ops[cur[0]].device, cur_first, last, tuple(cur), tuple(cur_refills)
            )
            internal.update(cur_internal)
        cur, cur_first, cur_internal, cur_refills, pending = [], -1, set(), [], []

    def hands_out(k: int) -> bool:
        """Member ``k``'s register holds a gradient when the pass ends."""
        return any((k, u) not in cur_internal for u in grad_inputs[fwd_of[ops[k].node]])

    last_op = -1
    for i, op in enumerate(ops):
        if op.kind in ("free", "free_state"):
            if cur:
                last_op = i
                own = [k for k in cur if ops[k].node == op.node and ops[k].device == op.device]
                if op.kind == "free" and any(hands_out(k) for k in own):
                    close(i)
            continue
        if in_pass and cur and _refills_in_pass(ops, i, facts, walk, cur, cur_refills + pending):
            if not pending:
                before_pending = last_op
            pending.append(i)
            last_op = i
            continue
        if not _fusable(ops, i, facts, walk, requires_grad, train, fuse):
            close(last_op)
            continue
        j, u = i, fwd_of[op.node]
        joins = bool(cur) and ops[cur[0]].device == op.device
        # the engine runs the ready node made last first: instances must be made in reverse
        joins = joins and state_of[j] < state_of[cur[-1]]
        mine: set[tuple[int, int]] = set()
        if joins:
            members = set(cur)
            for _w, k in contrib_src[j]:
                if k in members:
                    if not _internal_ok(ops, walk, last_read, k, u, j):
                        joins = False
                        break
                    mine.add((k, u))
            # only the first compute of a group reads registers: the pass has one root
            n_ext = len(contrib_src[j]) - len(mine) + (1 if u == nf - 1 else 0)
            joins = joins and n_ext == 0
        if not joins:
            close(last_op)
            if not _root_freed(ops, i, facts, walk):
                continue  # run on its own: see _root_freed
            cur_first = i
            mine = set()
        cur.append(i)
        cur_internal |= mine
        cur_refills += pending
        pending = []
        last_op = i
    close(last_op)
    return groups, internal


def _refills_in_pass(
    ops: Sequence[Op],
    i: int,
    facts: _GraphFacts,
    walk: _OpWalk,
    members: Sequence[int],
    refills: Sequence[int],
) -> bool:
    """Can op ``i`` run inside the pass of the group ``members``, before its next backward
    compute, as ``torch.utils.checkpoint`` recomputes? A forward recomputation that refills a
    retired state (:func:`_walk_ops`), on the group's device, reading no transient copy: it
    adds no node to the pass, only saved tensors and a value. Not when a member so far saved
    that value (the group frees a looked-up value at its last unpack, counted over the whole
    pass, which must then all read one register), nor a second computation of a node already
    refilled in this pass."""
    v = ops[i].node
    return (
        i in walk.refill
        and ops[i].device == ops[members[0]].device
        and i not in walk.uses_copy
        and not any(v in facts.saved_values[ops[m].node] for m in members)
        and all(ops[r].node != v for r in refills)
    )


def _fusable(
    ops: Sequence[Op],
    i: int,
    facts: _GraphFacts,
    walk: _OpWalk,
    requires_grad: Sequence[bool],
    train: bool,
    fuse: bool,
) -> bool:
    """Can op ``i`` be in a group? A backward compute that does something (its forward
    output needs a gradient), the first of its node in the step (parameter gradients are
    accumulated then), reading no transient copy, and the only reader of its state."""
    op = ops[i]
    if not (fuse and train) or op.kind != "compute" or facts.kinds[op.node] != "bwd":
        return False
    u = facts.fwd_of[op.node]
    s = walk.state_of.get(i)
    return (
        requires_grad[u]
        and i in walk.first_compute
        and i not in walk.uses_copy
        and s is not None
        and walk.state_uses.get(s) == 1
    )


def _internal_ok(
    ops: Sequence[Op], walk: _OpWalk, last_read: dict[int, int], k: int, u: int, j: int
) -> bool:
    """Can B_w@k hand its gradient for u to B_u@j inside autograd?"""
    s_w, s_u = walk.state_of.get(k), walk.state_of.get(j)
    return (
        k not in walk.copied
        and walk.reads.get((k, u)) == [j]
        and s_w is not None
        and s_u is not None
        and walk.in_inst.get(s_w, {}).get(u) == s_u
        # autograd frees the gradient once its last reader has run: so must the schedule
        and _freed_next(ops, last_read[k], ops[k].node, "free")
    )


def _root_freed(ops: Sequence[Op], i: int, facts: _GraphFacts, walk: _OpWalk) -> bool:
    """Can compute ``i`` be a pass's root? A root gradient that is one register goes to
    autograd as it is, and a backward such as add's hands it on as its own output: the
    register must then be freed right after ``i``, or the two would share memory that
    the simulator counts twice. A sum of several is a fresh tensor."""
    nf = facts.nf
    u = facts.fwd_of[ops[i].node]
    srcs = [backward_node(nf, w) for w, _k in walk.contrib_src[i]]
    if u == nf - 1:
        srcs.append(nf)  # the loss
    return len(srcs) != 1 or _freed_next(ops, i, srcs[0], "free")


def _native_forwards(
    ops: Sequence[Op],
    groups: dict[int, Group],
    walk: _OpWalk,
    mutates_buffers: Sequence[bool],
) -> set[int]:
    """The forward computes whose saved tensors autograd may keep itself (module
    docstring): their backward runs in a group, the schedule frees their state right after
    it, and every value they saved is still that very register when it runs. A forward
    that updates buffers and runs more than once is never native: its recomputation puts
    the buffers back in place, under what autograd saved."""
    n_computes: dict[int, int] = {}
    for op in ops:
        if op.kind == "compute":
            n_computes[op.node] = n_computes.get(op.node, 0) + 1
    native = set()
    revived = set(walk.refill.values())  # their saved tensors are dropped and refilled
    for grp in groups.values():
        for k in grp.computes:
            i = walk.state_of[k]
            w = ops[i].node
            if i in revived:
                continue
            if mutates_buffers and mutates_buffers[w] and n_computes[w] > 1:
                continue
            if not _freed_next(ops, k, w, "free_state"):
                continue  # autograd would release the state before the schedule does
            made = {**walk.saved_at[i], w: i}  # what the forward saved: inputs, and its own output
            if all(
                made.get(u) is not None and made.get(u) == x for u, x in walk.saved_at[k].items()
            ):
                native.add(i)
    return native


def _freed_next(ops: Sequence[Op], k: int, node: int, kind: str) -> bool:
    """Whether the schedule frees ``node``'s value (``kind="free"``) or autograd state
    (``"free_state"``) on compute ``k``'s device right after ``k``, before any other compute:
    what autograd lets go of when a node has run must not outlive it in the simulator."""
    d = ops[k].device
    for op in ops[k + 1 :]:
        if op.kind == "compute":
            return False
        if op.kind == kind and op.node == node and op.device == d:
            return True
    return False
