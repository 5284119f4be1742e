"""From a set of checkpoints to a full one-device schedule, and the range of feasible budgets.

Checkmate (Jain et al., MLSys 2020) turns every strategy's checkpoint matrix ``S`` into a
schedule with one linear-time pass that adds the cheapest consistent ``R``; the heuristics
describe ``S`` through a set of forward checkpoints. Both live here, with the articulation
points of the forward graph that the DAG variants of the heuristics use as candidates.
The same two schedules bound the smallest feasible budget of a graph
(:func:`min_feasible_budget_bytes`), which every stage from the command line on checks.

It lives in the core, not in ``baselines``: the pipeline needs the budget range before any
strategy runs, and the baselines import it (never the other way round).

All schedules built here are for one device and are checked by :func:`xengine.simulate`.
On one device an edge with ``copyable=False`` needs nothing special: every value is on the
device that reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from xengine.graph.types import Graph
from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.simulate import _row_lists, simulate


def device_name(graph: Graph, device: int | str = 0) -> str:
    """A device name, given as is or as an index into ``graph.devices`` ("cpu" for a graph
    without costs, as :func:`xengine.simulate.keep_all_peak_bytes` does)."""
    if isinstance(device, str):
        return device
    devs = graph.devices or ("cpu",)
    if not 0 <= device < len(devs):
        raise ValueError(
            f"device index {device} is out of range: graph {graph.name!r} has costs for {devs}"
        )
    return devs[device]


def _as_stage_matrix(graph: Graph, S: np.ndarray) -> np.ndarray:
    S = np.asarray(S)
    if S.ndim == 3:
        if S.shape[0] != 1:
            raise ValueError(f"S has {S.shape[0]} devices; these baselines take one (T, n) matrix")
        S = S[0]
    n = graph.size
    if S.shape != (n, n):
        raise ValueError(f"S must be ({n}, {n}) for graph {graph.name!r}; got {S.shape}")
    S = S.astype(bool)  # a copy, which solve_r_opt may reduce in place
    bad = np.triu(S)  # the diagonal and above (one pass; the heuristics call this per move)
    if bad.any():
        t, i = np.argwhere(bad)[0]
        raise ValueError(
            f"S[{t}, {i}] is set but node {i} cannot be resident when stage {t} starts "
            "(S must be strictly lower-triangular: a node is first computed in its own stage)"
        )
    return S


def _stage_r(
    preds: tuple[tuple[int, ...], ...],
    first: set[int],
    s_now: np.ndarray,
    states: tuple[list[int], np.ndarray] | None = None,
) -> set[int]:
    """The nodes a stage must compute: ``first`` (its frontier node, and every node that
    becomes a checkpoint for the next stage without being resident now) and, transitively,
    every input of a computed node that is not resident (``s_now``, the stage's row).
    Checkmate walks the stage from its frontier down; a closure over a stack gives the same
    set in time proportional to what is computed.

    With ``states = (state_source, a_now)`` (a given state residency) the same holds for
    autograd states: a backward op whose forward op's state is not resident needs that
    forward op computed, even where its value is resident (only a computation makes a
    state)."""
    r = set(first)
    stack = list(r)
    while stack:
        v = stack.pop()
        for u in preds[v]:
            if u not in r and not s_now[u]:
                r.add(u)
                stack.append(u)
        w = states[0][v] if states is not None else -1
        if w >= 0 and not states[1][w] and w not in r:
            r.add(w)
            stack.append(w)
    return r


def solve_r_opt(
    graph: Graph,
    S: np.ndarray,
    device: int | str = 0,
    drop_unused: bool = False,
    S_state: np.ndarray | None = None,
) -> Schedule:
    """The cheapest ``R`` consistent with the checkpoint matrix ``S`` (one device).

    ``S`` is (T, n) or (1, T, n), strictly lower-triangular. Every stage computes exactly the
    nodes it cannot do without, so no computation can be removed and none is a recomputation
    of a resident value (which the simulator rejects). Any valid ``R`` for this ``S``
    contains this one, so its time is no larger.

    ``drop_unused=True`` first removes residents that their stage neither reads nor keeps for
    the next stage (walking stages backwards, so that a value kept only to be dropped later
    goes too). Such a resident only costs memory, and the value it was recomputed from may
    then linger unread, so without this step a smaller ``R`` could have a larger peak. With
    it the result is never worse, in time or in peak memory, than any valid schedule using
    this ``S``. The returned schedule's ``S`` is the reduced one.

    ``S_state`` (a solver's state residency, (T, n) or (1, T, n)) is honoured the same way:
    a state that is not resident where a backward op needs it is made by computing its
    forward op in that stage. Without it the state residency is left to the simulator's
    minimal rule (:func:`xengine.schedule.minimal_state_residency`).

    Why it reads where residencies begin and end, not whole rows: the heuristics call it
    hundreds of times on graphs of thousands of nodes whose rows hold hundreds of residents
    each, and a stage needs only what changes at its boundary (what the next stage keeps
    anew, what stops being resident) and the residency of the few nodes it computes.
    """
    name = device_name(graph, device)
    S = _as_stage_matrix(graph, S)
    n = graph.size
    preds = graph.predecessors
    src = graph.state_source.tolist()
    A = None if S_state is None else _as_stage_matrix(graph, S_state)
    walk_S = _Residency(S, drop_unused)
    walk_A = None if A is None else _Residency(A, drop_unused)
    R = np.zeros((n, n), dtype=bool)
    for t in range(n - 1, -1, -1):
        first = {t, *walk_S.kept_anew(t)}
        if walk_A is not None:
            first.update(walk_A.kept_anew(t))
        r = _stage_r(preds, first, S[t], None if A is None else (src, A[t]))
        R[t, list(r)] = True
        if drop_unused:
            # a resident that the stage neither reads nor keeps goes; R[t] is unchanged by it
            walk_S.drop_unread(t, set().union(*(preds[v] for v in r)))
            if walk_A is not None:
                walk_A.drop_unread(t, {src[v] for v in r if src[v] >= 0})
    S_out = walk_S.reduced()
    A_out = None if walk_A is None else walk_A.reduced()
    return Schedule((name,), R[None], S_out[None], None if A_out is None else A_out[None])


class _Residency:
    """A residency matrix walked from the last stage to the first by :func:`solve_r_opt`:
    where its intervals begin and end, and what ``drop_unused`` removed so far."""

    def __init__(self, M: np.ndarray, drop_unused: bool) -> None:
        self.M = M
        nxt = np.zeros_like(M)
        nxt[:-1] = M[1:]
        self.begins = _row_lists(nxt & ~M)  # [t]: resident at t + 1, not at t
        self.ends = _row_lists(M & ~nxt) if drop_unused else None  # [t]: at t, not at t + 1
        self.gone_next: set[int] = set()  # removed from row t + 1 of the reduced matrix
        self.gone: list[tuple[int, list[int]]] = []

    def kept_anew(self, t: int) -> list[int]:
        """Kept for stage ``t + 1`` (reduced) and not resident at ``t``: made in stage t."""
        return [u for u in self.begins[t] if u not in self.gone_next]

    def drop_unread(self, t: int, read: set[int]) -> None:
        """Reduce row ``t``: a resident not in ``read`` and not in the reduced row ``t + 1``."""
        row = self.M[t]
        cand = self.ends[t] + [u for u in self.gone_next if row[u]]
        gone = {u for u in cand if u not in read}
        if gone:
            self.gone.append((t, list(gone)))
        self.gone_next = gone

    def reduced(self) -> np.ndarray:
        """The matrix with what was dropped removed (in place: the walk is over)."""
        for t, cols in self.gone:
            self.M[t, cols] = False
        return self.M


def _forward_like(graph: Graph) -> np.ndarray:
    return np.array([v.kind == "fwd" for v in graph.nodes], dtype=bool)


def checkpoint_matrix(graph: Graph, keep: Iterable[int]) -> np.ndarray:
    """The (T, n) checkpoint matrix of a fixed set of forward checkpoints.

    A value is resident from the stage after its computation up to (and including) the stage
    of its last reader when:

    * it is a checkpoint in ``keep`` (any reader);
    * it is not a forward value (the loss, a gradient): backward ops run once, so the
      gradient flowing between them (and the loss) must survive from stage to stage;
    * the reader is a forward op or the loss: the forward pass runs each op once, holding its
      inputs only until their last forward reader.

    Only a non-checkpoint forward value read by a backward op is dropped after the forward
    pass; each backward stage recomputes it from the nearest resident values.
    """
    keep = {int(k) for k in keep}
    n = graph.size
    fwd = _forward_like(graph)
    bad = [k for k in keep if not (0 <= k < n and fwd[k])]
    if bad:
        raise ValueError(f"checkpoints must be forward nodes of {graph.name!r}; got {sorted(bad)}")
    S = np.zeros((n, n), dtype=bool)
    for u, succ in enumerate(graph.successors):
        readers = [v for v in succ if u in keep or not fwd[u] or graph.nodes[v].kind != "bwd"]
        if readers:
            S[u + 1 : max(readers) + 1, u] = True
    return S


def schedule_from_checkpoints(graph: Graph, keep: Iterable[int], device: int | str = 0) -> Schedule:
    """The schedule of a fixed set of forward checkpoints (see :func:`checkpoint_matrix`),
    with ``R`` from :func:`solve_r_opt`. ``keep`` = all forward nodes gives the
    keep-everything schedule; ``keep`` = {} the recompute-heavy one (each backward stage
    recomputes its forward inputs from the graph's inputs)."""
    return solve_r_opt(graph, checkpoint_matrix(graph, keep), device)


def block_checkpoint_matrix(
    graph: Graph, blocks: Sequence[Sequence[int]], kept: Iterable[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """The (T, n) value and state residency of ``torch.utils.checkpoint`` around ``blocks``
    (each a list of forward nodes, one block's ops): what PyTorch keeps. ``kept``: block
    nodes whose outputs selective checkpointing saves (``create_selective_checkpoint_contexts``
    with ``MUST_SAVE``).

    Values:

    * a node outside every block, and a block's input (a value that a block reads from
      outside it: the checkpoint saves it), is a checkpoint (:func:`checkpoint_matrix`); a
      block's input stays at least until the last backward op of the block that reads a
      saved tensor (the checkpoint holds it for the recomputation);
    * a block's node is resident from its computation up to its last reader outside the
      block (a later op that saved it, forward or backward), and up to its last forward
      reader, as in the forward pass;
    * when the backward pass first needs a saved tensor of the block (the first stage of
      one of its backward ops that reads a forward value or a state), the block runs again,
      and each of its nodes that a backward op of the block reads stays resident up to that
      reader's stage.

    States (what an op saves for its own backward: masks, statistics): an op outside the
    blocks keeps its state from its computation to its backward op; a block's op only from
    the block's first backward stage on, since the checkpoint saves nothing of the block in
    the forward pass and the recomputation makes every state again (a dropout's mask too,
    from the replayed random state). An op whose value is still resident when the block's
    backward begins (the block's output, kept as the next block's input) keeps its state
    from the forward pass: we never compute a resident value again. :func:`solve_r_opt` then
    recomputes, in that first stage, exactly the ops whose values or states the block's
    backward needs.

    A ``kept`` node is resident, with its state, from its computation on: selective
    checkpointing holds its outputs from the forward pass to the block's recomputation, which
    takes them instead of running the op again (:func:`_recomputed_before_stop`). It is
    therefore never made again.
    """
    n = graph.size
    inside = np.zeros(n, dtype=bool)
    for block in blocks:
        inside[list(block)] = True
    members = [{int(i) for i in block} for block in blocks]
    inputs = {u for m in members for v in m for u in graph.predecessors[v] if u not in m}
    keep = [i for i in range(n) if graph.nodes[i].kind == "fwd" and (not inside[i] or i in inputs)]
    S = checkpoint_matrix(graph, keep)
    A = np.zeros((n, n), dtype=bool)
    reader = graph.state_reader
    for i in np.flatnonzero((reader >= 0) & ~inside):
        A[i + 1 : reader[i] + 1, i] = True
    fwd_of = [graph.nodes[v].fwd_index for v in range(n)]
    kept = {int(k) for k in kept}
    stray = sorted(kept - set().union(*members))
    if stray:
        raise ValueError(f"kept nodes {stray} are in no block")
    for m in members:
        back = [v for v in range(n) if graph.nodes[v].kind == "bwd" and fwd_of[v] in m]
        if not back:
            continue
        # the block runs again when its backward first unpacks a saved tensor
        reads = [v for v in back if _reads_forward(graph, v)]
        first = min(reads) if reads else min(back)
        # the checkpoint holds the block's inputs until the block's backward is done with its
        # saved tensors, also those read only by ops that save nothing (DenseNet's concats)
        done = max(reads) if reads else max(back)
        for u in {u for v in m for u in graph.predecessors[v] if u not in m}:
            if graph.nodes[u].kind == "fwd":
                S[u + 1 : done + 1, u] = True
        popped = _recomputed_before_stop(graph, m, back)
        for i in m & kept:  # held by the policy up to the recomputation, or to its end
            S[i + 1 : (first if popped(i) else max(back)) + 1, i] = True
        for i in m:
            outside = [v for v in graph.successors[i] if v not in m and fwd_of[v] not in m]
            if outside:
                S[i + 1 : max(outside) + 1, i] = True
            again = [v for v in graph.successors[i] if graph.nodes[v].kind == "bwd" and v in back]
            if again:
                S[first + 1 : max(again) + 1, i] = True
            if reader[i] >= 0:  # a value kept through the block (its output) is not made again
                A[(i if S[first, i] else first) + 1 : reader[i] + 1, i] = True
    return S, A


def solve_block_r(graph: Graph, S: np.ndarray, S_state: np.ndarray, device: int | str = 0):
    """:func:`solve_r_opt` for a block checkpoint's residency
    (:func:`block_checkpoint_matrix`), without the recomputations that only make an empty
    state. A linear layer's backward reads its input and weight, nothing of its own; PyTorch's
    recomputation stops before such an op runs when nothing after it is needed, but an op of
    ours whose state is not resident is computed to make it. So every empty state is first
    kept from the forward pass; where the op is computed again anyway (its value is needed),
    its state is the one made by its last computation before its backward."""
    A = np.array(S_state, dtype=bool)
    reader = graph.state_reader
    empty = np.flatnonzero((graph.state_bytes == 0) & (reader >= 0))
    for i in empty:
        A[i + 1 : reader[i] + 1, i] = True
    R = solve_r_opt(graph, S, device, S_state=A).R[0]
    for i in empty:
        again = [t for t in np.flatnonzero(R[:, i]) if i < t <= reader[i]]
        if again:
            A[:, i] = False
            A[again[-1] + 1 : reader[i] + 1, i] = True
    return solve_r_opt(graph, S, device, S_state=A)


def _reads_forward(graph: Graph, v: int) -> bool:
    """Whether backward node ``v`` reads a forward value or a state (autograd unpacks a saved
    tensor for it)."""
    src = int(graph.state_source[v])
    if src >= 0 and graph.nodes[src].state_bytes > 0:
        return True
    return any(graph.nodes[u].kind == "fwd" for u in graph.predecessors[v])


def _recomputed_before_stop(graph: Graph, block: set[int], back: list[int]):
    """Whether the recomputation of ``block`` reaches node ``i``: a predicate. PyTorch's
    checkpoint stops recomputing once the block's backward has every tensor it saves
    (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default); an op saves its
    inputs before it runs and its output after. A node that selective checkpointing saved
    leaves the policy's cache when the recomputation reaches it; one that it never reaches
    stays cached until the block's backward ends (its last backward stage)."""
    twin = {graph.nodes[v].fwd_index: v for v in back}
    state = graph.state_bytes > 0

    def saves(j: int, own: bool) -> bool:
        if j not in twin:
            return False
        ins = graph.predecessors[twin[j]]
        if own:
            return j in ins or bool(state[j])
        return any(graph.nodes[u].kind == "fwd" for u in ins) or bool(state[j])

    last = max((j for j in block if saves(j, False)), default=-1)
    return lambda i: i < last or (i == last and saves(i, True))


def articulation_points(graph: Graph) -> list[int]:
    """Forward nodes whose removal cuts the forward graph, in topological order.

    The forward graph is taken undirected, with a sentinel source joined to every forward
    node without forward inputs and a sentinel sink joined to every forward node whose value
    leaves the forward graph (read by the loss, or by nothing forward). No path from the
    inputs to the outputs avoids a cut vertex, so keeping it splits the network into
    segments that can be recomputed independently; on a chain every forward node is one,
    which is why Checkmate's AP variants reduce to the plain ones on chains.

    networkx's biconnected-components search (Hopcroft-Tarjan) finds them in O(V + E);
    Checkmate deletes each node in turn and tests connectivity, O(V * E). networkx is already
    installed as a dependency of torch.
    """
    import networkx as nx

    fwd = _forward_like(graph)
    idx = np.flatnonzero(fwd).tolist()
    if not idx:
        return []
    G = nx.Graph()
    src, snk = -1, -2
    G.add_nodes_from([src, snk, *idx])
    for e in graph.edges:
        if fwd[e.src] and fwd[e.dst]:
            G.add_edge(e.src, e.dst)
    for v in idx:
        if not any(fwd[u] for u in graph.predecessors[v]):
            G.add_edge(src, v)
        succ = graph.successors[v]
        if (
            not succ
            or any(graph.nodes[w].kind == "loss" for w in succ)
            or not any(fwd[w] for w in succ)
        ):
            G.add_edge(v, snk)
    return sorted(v for v in nx.articulation_points(G) if v >= 0)


def is_forward_chain(graph: Graph) -> bool:
    """True when the forward ops form a path f0 -> f1 -> ... (each reads only its predecessor)."""
    idx = [i for i, v in enumerate(graph.nodes) if v.kind == "fwd"]
    fwd = set(idx)
    for a, b in zip(idx, idx[1:], strict=False):
        if [u for u in graph.predecessors[b] if u in fwd] != [a]:
            return False
    return not (idx and any(u in fwd for u in graph.predecessors[idx[0]]))


def min_feasible_budget_bytes(graph: Graph) -> tuple[int, int]:
    """``(lower_bound, known_feasible)`` for the smallest activation budget of ``graph``.

    The lower bound is the largest (inputs + output + workspace) of any node, which must be
    on the device at once. The known feasible budget is the peak of the most memory-frugal
    schedule at hand: no forward checkpoints, each backward stage recomputing its forward
    inputs (the gradients are kept), or keep-everything if that is smaller. When the two
    numbers are equal, that is the smallest feasible budget.
    """
    inst = Instance.single(graph, device_name(graph, 0), budget_bytes=None)
    lower = int(graph.node_lower_bound_bytes(inst.devices[0]).max())
    peaks = [
        int(
            simulate(inst, schedule_from_checkpoints(graph, keep, inst.devices[0])).peak_bytes.max()
        )
        for keep in ((), graph.forward_indices)
    ]
    return lower, max(lower, min(peaks))


def budget_range_message(graph: Graph, infeasible_at: int | None = None) -> str:
    """Names the smallest feasible budget, or the range it lies in. ``infeasible_at``: a
    budget proven infeasible (the smallest feasible one is then above it)."""
    lower, known = min_feasible_budget_bytes(graph)
    if infeasible_at is not None:
        lower = max(lower, int(infeasible_at) + 1)
    if lower >= known:
        return f"the smallest feasible budget is {known} bytes"
    why = "inputs + output of the largest op" if infeasible_at is None else "proven so"
    return (
        f"the smallest feasible budget is between {lower} bytes ({why}) and {known} bytes "
        "(a recompute-heavy schedule fits)"
    )
