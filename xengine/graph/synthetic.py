"""Small graphs made in code: chains and hand-made DAGs for tests and solver benchmarks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from xengine.graph.types import CopyModel, Edge, Graph, Node


def training_graph(
    name: str,
    fwd_edges: Sequence[tuple[int, int]],
    n_fwd: int,
    fwd_bytes: Sequence[int],
    fwd_cost_s: Mapping[str, Sequence[float]],
    bwd_cost_s: Mapping[str, Sequence[float]] | None = None,
    loss_cost_s: Mapping[str, float] | None = None,
    saves_input: bool = True,
    copy_models: Mapping[tuple[str, str], CopyModel] | None = None,
    state_bytes: Sequence[int] | None = None,
    saves_output: Sequence[bool] | None = None,
) -> Graph:
    """Build forward ops, a loss and mirrored backward ops, the way captured graphs look.

    Forward node ``i`` (0..n_fwd-1) reads its predecessors in ``fwd_edges``; the last forward
    node feeds the loss. Backward node of ``i`` reads the gradients from the backward nodes of
    its consumers (or the loss) and, when ``saves_input``, its forward inputs (as convolutions
    do). Without ``state_bytes`` it also reads its own forward node's output over a
    non-copyable edge (version 1's convention). With ``state_bytes`` it reads forward node
    ``i``'s autograd state of ``state_bytes[i]`` bytes over a state edge and its value only
    where ``saves_output[i]`` (default: every other node), as captured graphs do.
    """
    devices = list(fwd_cost_s)
    bwd_cost_s = bwd_cost_s or {d: [2 * c for c in fwd_cost_s[d]] for d in devices}
    loss_cost_s = loss_cost_s or {d: 0.0 for d in devices}
    n = 2 * n_fwd + 1
    loss = n_fwd

    def bwd(i: int) -> int:
        return n - 1 - i

    states = state_bytes is not None
    if states and saves_output is None:
        saves_output = [i % 2 == 0 for i in range(n_fwd)]
    nodes: list[Node] = []
    for i in range(n_fwd):
        nodes.append(
            Node(
                f"f{i}",
                "fwd",
                int(fwd_bytes[i]),
                {d: float(fwd_cost_s[d][i]) for d in devices},
                state_bytes=int(state_bytes[i]) if states else 0,
            )
        )
    nodes.append(Node("loss", "loss", int(fwd_bytes[n_fwd - 1]), dict(loss_cost_s)))
    for j in range(n_fwd):
        i = n_fwd - 1 - j
        nodes.append(
            Node(
                f"b{i}",
                "bwd",
                int(fwd_bytes[i]),
                {d: float(bwd_cost_s[d][i]) for d in devices},
                fwd_index=i,
            )
        )
    edges: set[tuple[int, int, bool]] = set()
    consumers: dict[int, list[int]] = {i: [] for i in range(n_fwd)}
    for u, v in fwd_edges:
        edges.add((u, v, True))
        consumers[u].append(v)
    edges.add((n_fwd - 1, loss, True))
    consumers[n_fwd - 1].append(loss)
    for i in range(n_fwd):
        for c in consumers[i]:
            edges.add((loss if c == loss else bwd(c), bwd(i), True))
        if not states:
            edges.add((i, bwd(i), False))
        elif saves_output[i]:
            edges.add((i, bwd(i), True))
        if saves_input:
            for u, v in fwd_edges:
                if v == i:
                    edges.add((u, bwd(i), True))
    # a backward op reading its own forward output through two edges collapses to one
    uniq: dict[tuple[int, int], bool] = {}
    for u, v, c in edges:
        uniq[(u, v)] = uniq.get((u, v), True) and c
    state_edges = tuple(Edge(i, bwd(i), False, "state") for i in range(n_fwd)) if states else ()
    return Graph(
        name,
        tuple(nodes),
        tuple(Edge(u, v, c) for (u, v), c in sorted(uniq.items())) + state_edges,
        copy_models=dict(copy_models or {}),
    )


def chain(
    n_layers: int,
    bytes_per_layer: int = 1000,
    cost_s: float = 1.0,
    devices: Sequence[str] = ("cpu",),
) -> Graph:
    """A chain of ``n_layers`` forward ops with a loss and backward ops (2n+1 nodes)."""
    return training_graph(
        f"chain{n_layers}",
        [(i, i + 1) for i in range(n_layers - 1)],
        n_layers,
        [bytes_per_layer] * n_layers,
        {d: [cost_s] * n_layers for d in devices},
    )


def linear_graph(n: int, devices: Sequence[str] = ("cpu",)) -> Graph:
    """Checkmate's canonical test chain: 2n+1 unit-cost, unit-size nodes, edges i -> i+1 and
    forward i -> its backward twin (2n - i). No autograd-state edges: a pure dependency graph."""
    size = 2 * n + 1
    nodes = []
    for i in range(size):
        kind = "fwd" if i < n else ("loss" if i == n else "bwd")
        nodes.append(
            Node(
                f"n{i}",
                kind,
                1,
                {d: 1.0 for d in devices},
                fwd_index=(size - 1 - i) if i > n else None,
            )
        )
    edges = {(i, i + 1) for i in range(size - 1)}
    edges |= {(i, size - 1 - i) for i in range(n)}
    return Graph(f"linear{n}", tuple(nodes), tuple(Edge(u, v) for u, v in sorted(edges)))
