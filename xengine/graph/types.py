"""The training graph: operators as nodes, tensors as edges (DESIGN.md section 3).

Nodes are numbered in a topological order (forward ops, then the loss, then backward ops), so
that stage ``t`` of a schedule is the stage in which node ``t`` is computed for the first time
(Checkmate's frontier-advancing stages, Jain et al. 2020, section 4.2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

NODE_KINDS = ("fwd", "loss", "bwd")


class GraphError(ValueError):
    """A graph (made in code or read from a file) is malformed."""


@dataclass(frozen=True)
class Node:
    """One operator.

    ``output_bytes`` is everything the operator leaves alive (its output plus buffers that
    autograd saves for the backward pass, such as pooling indices). ``workspace_bytes`` is
    memory the operator needs only while it runs (e.g. a parameter gradient before it is
    accumulated). ``cost_s`` maps a device name to the measured time of one run.
    """

    name: str
    kind: str
    output_bytes: int
    cost_s: Mapping[str, float] = field(default_factory=dict)
    workspace_bytes: int = 0
    fwd_index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise GraphError(f"node {self.name!r}: kind {self.kind!r} is not one of {NODE_KINDS}")
        if self.output_bytes < 0 or self.workspace_bytes < 0:
            raise GraphError(f"node {self.name!r}: bytes must be non-negative")


@dataclass(frozen=True)
class Edge:
    """``dst`` reads the output of ``src``.

    ``copyable=False`` marks an edge whose value cannot be moved between devices: a backward
    op reads the autograd state of its own forward op, which lives on the device that ran it.
    """

    src: int
    dst: int
    copyable: bool = True


@dataclass(frozen=True)
class CopyModel:
    """Measured time to move ``n`` bytes from one device to another: latency + n / bandwidth."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def time_s(self, n_bytes: float) -> float:
        return self.latency_s + float(n_bytes) / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Graph:
    """A training (or inference) graph with per-node bytes and per-device costs.

    ``fixed_bytes`` is memory outside the activation budget (parameters, gradient buffers, the
    input batch), reported beside the activation peak as Checkmate does.
    """

    name: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    fixed_bytes: int = 0
    copy_models: Mapping[tuple[str, str], CopyModel] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if n == 0:
            raise GraphError(f"graph {self.name!r} has no nodes")
        seen = set()
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n):
                raise GraphError(f"graph {self.name!r}: edge {e.src}->{e.dst} names a missing node")
            if e.src >= e.dst:
                raise GraphError(
                    f"graph {self.name!r}: edge {self.nodes[e.src].name}->{self.nodes[e.dst].name}"
                    " goes against the node order (nodes must be in topological order)"
                )
            if (e.src, e.dst) in seen:
                raise GraphError(f"graph {self.name!r}: edge {e.src}->{e.dst} appears twice")
            seen.add((e.src, e.dst))

    # ------------------------------------------------------------------ derived views
    @property
    def size(self) -> int:
        return len(self.nodes)

    @cached_property
    def output_bytes(self) -> np.ndarray:
        return np.array([v.output_bytes for v in self.nodes], dtype=np.int64)

    @cached_property
    def workspace_bytes(self) -> np.ndarray:
        return np.array([v.workspace_bytes for v in self.nodes], dtype=np.int64)

    @cached_property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        preds: list[list[int]] = [[] for _ in self.nodes]
        for e in self.edges:
            preds[e.dst].append(e.src)
        return tuple(tuple(sorted(p)) for p in preds)

    @cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        succ: list[list[int]] = [[] for _ in self.nodes]
        for e in self.edges:
            succ[e.src].append(e.dst)
        return tuple(tuple(sorted(s)) for s in succ)

    @cached_property
    def in_edges(self) -> tuple[tuple[Edge, ...], ...]:
        ins: list[list[Edge]] = [[] for _ in self.nodes]
        for e in self.edges:
            ins[e.dst].append(e)
        return tuple(tuple(sorted(x, key=lambda e: e.src)) for x in ins)

    @property
    def devices(self) -> tuple[str, ...]:
        """Devices for which every node has a cost."""
        common = None
        for v in self.nodes:
            keys = set(v.cost_s)
            common = keys if common is None else common & keys
        return tuple(sorted(common or ()))

    def cost_array_s(self, device: str) -> np.ndarray:
        missing = [v.name for v in self.nodes if device not in v.cost_s]
        if missing:
            raise GraphError(
                f"graph {self.name!r} has no cost for device {device!r} on {len(missing)} nodes "
                f"(first: {missing[0]!r}); profile the graph on that device or load a profile"
            )
        return np.array([v.cost_s[device] for v in self.nodes], dtype=float)

    def copy_time_s(self, src: str, dst: str, n_bytes: float) -> float:
        if src == dst:
            return 0.0
        model = self.copy_models.get((src, dst))
        if model is None:
            raise GraphError(
                f"graph {self.name!r} has no copy cost {src}->{dst}; measure it or give it in "
                "the graph file's 'copy' list"
            )
        return model.time_s(n_bytes)

    def with_costs(
        self,
        cost_s: Mapping[str, Mapping[str, float]],
        copy_models: Mapping[tuple[str, str], CopyModel] | None = None,
    ) -> Graph:
        """A copy of the graph with ``cost_s[device][node_name]`` merged into the nodes."""
        nodes = []
        for v in self.nodes:
            c = dict(v.cost_s)
            for dev, table in cost_s.items():
                if v.name not in table:
                    raise GraphError(f"profile for {dev!r} has no time for node {v.name!r}")
                c[dev] = float(table[v.name])
            nodes.append(replace(v, cost_s=c))
        models = dict(self.copy_models)
        models.update(copy_models or {})
        return replace(self, nodes=tuple(nodes), copy_models=models)

    @cached_property
    def forward_indices(self) -> tuple[int, ...]:
        return tuple(i for i, v in enumerate(self.nodes) if v.kind == "fwd")

    def keep_all_peak_bytes(self) -> int:
        """Peak activation memory when every node runs once and its output stays until its
        last reader: the "100 %" reference for percentage budgets."""
        from xengine.problem import Instance
        from xengine.schedule import keep_all_schedule
        from xengine.simulate import simulate

        # memory does not depend on costs: a graph without costs is simulated at zero cost
        g = self if self.devices else self.with_costs({"_": {v.name: 0.0 for v in self.nodes}})
        inst = Instance.single(g, g.devices[0], budget_bytes=None)
        return int(simulate(inst, keep_all_schedule(inst)).peak_bytes.max())

    def node_lower_bound_bytes(self) -> np.ndarray:
        """Per node: its output, its workspace and all its inputs, which must be on one device
        at once. The largest entry is a lower bound on any feasible budget."""
        m = self.output_bytes
        lb = m + self.workspace_bytes
        for v, preds in enumerate(self.predecessors):
            lb[v] += sum(int(m[u]) for u in preds)
        return lb
