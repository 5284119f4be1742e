"""The training graph: operators as nodes, tensors as edges (docs/design.md section 3).

Nodes are numbered in a topological order (forward ops, then the loss, then backward ops), so
that stage ``t`` of a schedule is the stage in which node ``t`` is computed for the first time
(Checkmate's frontier-advancing stages, Jain et al. 2020, section 4.2).

The unit of memory is what autograd really keeps. Running a forward op ``F_v`` leaves two
things behind:

* its *value* (``output_bytes``): the output that later forward ops read, and that a backward
  op reads only where autograd saved it (ReLU's backward reads its output, a convolution's
  its input, BatchNorm's neither of its own). A value edge ``u -> w`` says ``w`` reads it; the
  value lives until its last reader;
* its *state* (``state_bytes``): what its ``grad_fn`` holds that is nobody's value (BatchNorm's
  mean and inverse std, max-pool indices, dropout masks). The one state edge ``F_v -> B_v``
  says that ``B_v`` runs on the device where ``F_v`` last ran; the state is made by every
  computation of ``F_v``, cannot be copied and is read by ``B_v`` only.

This is Rockmate's data / phantoms split (Zhao et al. 2023). Checkmate's convention, which
keeps every forward output until its backward op, overcounts resnet18's step by 49 %.
Graph files of version 1 (and Checkmate's exported graphs) have no states: their
``copyable=False`` value edges keep that convention and load unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

GRANULARITIES = ("module", "function")
"""What one node of a named net is: ``module``, a leaf module of torch.nn or one of our own
(the decoder's attention) or a tensor function; ``function``, the same except that our own
modules are traced through (the decoder's attention becomes its projections,
``scaled_dot_product_attention`` and a reshape). torchvision's nets have no modules of their
own that are leaves, so for them the two are the same graph."""

SIZED_NETS = ("hf_gpt2", "hf_llama")
"""Named nets that take ``net.num_layers`` and ``net.width`` (:mod:`xengine.graph.hf_nets`)."""


NODE_KINDS = ("fwd", "loss", "bwd")
EDGE_KINDS = ("value", "state")


class GraphError(ValueError):
    """A graph (made in code or read from a file) is malformed."""


class InternalError(RuntimeError):
    """xengine's own code failed on input that is fine (a bug of ours, not the user's
    mistake): reported as such, with its traceback in the run's log, never as bad input."""


@dataclass(frozen=True)
class Node:
    """One operator.

    ``output_bytes`` is the operator's value and ``state_bytes`` its autograd state (module
    docstring). ``workspace_bytes`` is memory the operator needs only while it runs (op
    temporaries, a parameter gradient before it is accumulated); it depends on the device and
    its thread count, so ``device_workspace_bytes`` holds the measured figure per device and
    ``workspace_bytes`` is the figure for any other device. ``cost_s`` maps a device name to
    the measured time of one run.
    """

    name: str
    kind: str
    output_bytes: int
    cost_s: Mapping[str, float] = field(default_factory=dict)
    workspace_bytes: int = 0
    fwd_index: int | None = None
    state_bytes: int = 0
    device_workspace_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise GraphError(f"node {self.name!r}: kind {self.kind!r} is not one of {NODE_KINDS}")
        if (
            self.output_bytes < 0
            or self.workspace_bytes < 0
            or self.state_bytes < 0
            or any(w < 0 for w in self.device_workspace_bytes.values())
        ):
            raise GraphError(f"node {self.name!r}: bytes must be non-negative")
        if self.state_bytes and self.kind != "fwd":
            raise GraphError(f"node {self.name!r}: only a forward op has an autograd state")

    def workspace_on(self, device: str) -> int:
        """The workspace measured on ``device``, else the node's default."""
        return int(self.device_workspace_bytes.get(device, self.workspace_bytes))


@dataclass(frozen=True)
class Edge:
    """``dst`` reads the value of ``src`` (``kind="value"``), or ``dst`` is ``B_src`` and reads
    ``F_src``'s autograd state (``kind="state"``, never copyable).

    ``copyable=False`` on a value edge is version 1's convention: a backward op reads its
    forward op's output as "autograd state" on the device that ran it.
    """

    src: int
    dst: int
    copyable: bool = True
    kind: str = "value"

    def __post_init__(self) -> None:
        if self.kind not in EDGE_KINDS:
            raise GraphError(
                f"edge {self.src}->{self.dst}: kind {self.kind!r} is not one of {EDGE_KINDS}"
            )
        if self.kind == "state" and self.copyable:
            object.__setattr__(self, "copyable", False)

    @property
    def is_state(self) -> bool:
        return self.kind == "state"


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
            if (e.src, e.dst, e.kind) in seen:
                raise GraphError(f"graph {self.name!r}: edge {e.src}->{e.dst} appears twice")
            seen.add((e.src, e.dst, e.kind))
        self._check_states()

    def _check_states(self) -> None:
        """``fwd_index`` names a forward node, whose only backward twin it is; a state edge
        joins ``F_v`` to its own ``B_v``, once; only such an ``F_v`` has state bytes."""
        twin: dict[int, str] = {}
        for v in self.nodes:
            f = v.fwd_index
            if f is not None and (
                v.kind != "bwd" or not (0 <= f < len(self.nodes)) or self.nodes[f].kind != "fwd"
            ):
                raise GraphError(
                    f"graph {self.name!r}: node {v.name!r}: fwd_index must name a forward node "
                    "and only a backward node has one"
                )
            if f is not None and twin.setdefault(f, v.name) != v.name:
                raise GraphError(
                    f"graph {self.name!r}: {self.nodes[f].name!r} has two backward twins, "
                    f"{twin[f]!r} and {v.name!r}"
                )
        has_edge: set[int] = set()
        reads: set[int] = set()
        for e in self.edges:
            if not e.is_state:
                continue
            a, b = self.nodes[e.src], self.nodes[e.dst]
            if a.kind != "fwd" or b.kind != "bwd" or b.fwd_index != e.src:
                raise GraphError(
                    f"graph {self.name!r}: state link {a.name}->{b.name} must join a forward op "
                    "to its own backward op (the backward node's fwd_index)"
                )
            if e.src in has_edge or e.dst in reads:
                raise GraphError(f"graph {self.name!r}: {a.name} has more than one state link")
            has_edge.add(e.src)
            reads.add(e.dst)
        for i, v in enumerate(self.nodes):
            if v.state_bytes and i not in has_edge:
                raise GraphError(
                    f"graph {self.name!r}: node {v.name!r} has state_bytes but no state link to "
                    "its backward op"
                )

    # ------------------------------------------------------------------ derived views
    @property
    def size(self) -> int:
        return len(self.nodes)

    @cached_property
    def output_bytes(self) -> np.ndarray:
        return np.array([v.output_bytes for v in self.nodes], dtype=np.int64)

    @cached_property
    def workspace_bytes(self) -> np.ndarray:
        """Each node's default workspace (:meth:`workspace_on` gives one device's)."""
        return np.array([v.workspace_bytes for v in self.nodes], dtype=np.int64)

    def workspace_on(self, device: str) -> np.ndarray:
        return np.array([v.workspace_on(device) for v in self.nodes], dtype=np.int64)

    @cached_property
    def state_bytes(self) -> np.ndarray:
        return np.array([v.state_bytes for v in self.nodes], dtype=np.int64)

    @cached_property
    def value_edges(self) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if not e.is_state)

    @cached_property
    def state_edges(self) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.is_state)

    @property
    def has_states(self) -> bool:
        return bool(self.state_edges)

    @cached_property
    def state_reader(self) -> np.ndarray:
        """Per node: the backward node that reads its state, or -1 (no state)."""
        out = np.full(self.size, -1, dtype=np.int64)
        for e in self.state_edges:
            out[e.src] = e.dst
        return out

    @cached_property
    def state_source(self) -> np.ndarray:
        """Per node: the forward node whose state it reads, or -1."""
        out = np.full(self.size, -1, dtype=np.int64)
        for e in self.state_edges:
            out[e.dst] = e.src
        return out

    @cached_property
    def released_logits(self) -> int | None:
        """The logits node when the executor's loss may let go of them before computing its
        gradient (docs/design.md section 8): a captured training graph (``meta``'s
        ``loss_releases_logits``) whose logits no node but the loss reads. A loss computation
        that cannot (the logits kept past it, or the loss computed on two devices at once)
        needs the logits' bytes more while it runs (:mod:`xengine.simulate`). None otherwise:
        graphs made in code or read from files keep the plain memory model."""
        if not (self.meta or {}).get("loss_releases_logits"):
            return None
        loss = [i for i, v in enumerate(self.nodes) if v.kind == "loss"]
        if len(loss) != 1 or loss[0] == 0:
            return None
        u = loss[0] - 1
        readers = {e.dst for e in self.value_edges if e.src == u}
        return u if readers == {loss[0]} else None

    @cached_property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        """Per node: the nodes whose *values* it reads (state links excluded)."""
        preds: list[list[int]] = [[] for _ in self.nodes]
        for e in self.value_edges:
            preds[e.dst].append(e.src)
        return tuple(tuple(sorted(p)) for p in preds)

    @cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        """Per node: the readers of its value (state links excluded)."""
        succ: list[list[int]] = [[] for _ in self.nodes]
        for e in self.value_edges:
            succ[e.src].append(e.dst)
        return tuple(tuple(sorted(s)) for s in succ)

    @cached_property
    def in_edges(self) -> tuple[tuple[Edge, ...], ...]:
        """Per node: the value edges into it."""
        ins: list[list[Edge]] = [[] for _ in self.nodes]
        for e in self.value_edges:
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
        workspace_bytes: Mapping[str, Mapping[str, int]] | None = None,
    ) -> Graph:
        """A copy of the graph with ``cost_s[device][node_name]`` (and, where given,
        ``workspace_bytes[device][node_name]``) merged into the nodes."""
        nodes = []
        for v in self.nodes:
            c = dict(v.cost_s)
            for dev, table in cost_s.items():
                if v.name not in table:
                    raise GraphError(f"profile for {dev!r} has no time for node {v.name!r}")
                c[dev] = float(table[v.name])
            w = dict(v.device_workspace_bytes)
            for dev, table in (workspace_bytes or {}).items():
                if v.name not in table:
                    raise GraphError(f"profile for {dev!r} has no workspace for node {v.name!r}")
                w[dev] = int(table[v.name])
            nodes.append(replace(v, cost_s=c, device_workspace_bytes=w))
        models = dict(self.copy_models)
        models.update(copy_models or {})
        return replace(self, nodes=tuple(nodes), copy_models=models)

    @cached_property
    def forward_indices(self) -> tuple[int, ...]:
        return tuple(i for i, v in enumerate(self.nodes) if v.kind == "fwd")

    def node_lower_bound_bytes(self, device: str | None = None) -> np.ndarray:
        """Per node: its value, its state, its workspace (on ``device``, else the default),
        every value it reads and the state it reads, which must be on one device at once. The
        largest entry is a lower bound on any feasible budget."""
        m = self.output_bytes
        s = self.state_bytes
        w = self.workspace_bytes if device is None else self.workspace_on(device)
        lb = m + s + w
        for v, preds in enumerate(self.predecessors):
            lb[v] += sum(int(m[u]) for u in preds)
        src = self.state_source
        has = src >= 0
        lb[has] += s[src[has]]
        return lb
