"""One scheduling problem: a graph, the devices it may use, and each device's budget.

Every strategy (exact or heuristic) takes an :class:`Instance` and every schedule is checked
against the same instance by the simulator, so costs and budgets are read in one place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from xengine.graph.types import Graph, GraphError
from xengine.limits import schedule_size_problem
from xengine.units import format_bytes

UNLIMITED_BYTES = np.iinfo(np.int64).max // 4


@dataclass(frozen=True)
class Instance:
    """``devices[d]`` has ``budget_bytes[d]`` bytes for activations (0 = the device is unused)."""

    graph: Graph
    devices: tuple[str, ...]
    budget_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.devices) == 0:
            raise GraphError("an instance needs at least one device")
        if len(set(self.devices)) != len(self.devices):
            dup = [d for d in self.devices if self.devices.count(d) > 1][0]
            raise GraphError(f"device {dup!r} is named twice in the device mix")
        if len(self.budget_bytes) != len(self.devices):
            raise GraphError("one budget per device is needed")
        if any(b < 0 for b in self.budget_bytes):
            raise GraphError("budgets must be non-negative")
        too_large = schedule_size_problem(self.graph.size, len(self.devices))
        if too_large:  # before any (devices, stages, nodes) array is allocated
            raise GraphError(f"graph {self.graph.name!r} is too large to schedule: {too_large}")

    @classmethod
    def single(cls, graph: Graph, device: str, budget_bytes: int | None) -> Instance:
        return cls(graph, (device,), (UNLIMITED_BYTES if budget_bytes is None else budget_bytes,))

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def size(self) -> int:
        return self.graph.size

    @cached_property
    def compute_s(self) -> np.ndarray:
        """(D, n) seconds to run node i on device d."""
        return np.stack([self.graph.cost_array_s(d) for d in self.devices])

    @property
    def fastest_device(self) -> int:
        """The index of the device that runs every node once in the least time (where the
        multi-device starts put their recomputations, :mod:`xengine.strategies.distribute`)."""
        return int(np.argmin(self.compute_s.sum(axis=1)))

    @cached_property
    def copy_s(self) -> np.ndarray:
        """(D, D, n) seconds to copy node i's output from device a to device b (0 on a == b)."""
        D, n = self.n_devices, self.size
        out = np.zeros((D, D, n))
        m = self.graph.output_bytes
        for a in range(D):
            for b in range(D):
                if a != b:
                    out[a, b] = [
                        self.graph.copy_time_s(self.devices[a], self.devices[b], m[i])
                        for i in range(n)
                    ]
        return out

    @cached_property
    def workspace_bytes(self) -> np.ndarray:
        """(D, n) bytes node i needs only while it runs on device d (measured per device)."""
        return np.stack([self.graph.workspace_on(d) for d in self.devices])

    @cached_property
    def budgets(self) -> np.ndarray:
        return np.asarray(self.budget_bytes, dtype=np.int64)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of everything a schedule's simulation reads: the graph's structure and bytes,
        every cost, the devices and their budgets. Two instances with one fingerprint give
        every schedule the same simulation, so a schedule found on one is the same answer on
        the other (the heuristics are computed once per run and costs,
        :mod:`baselines.heuristics`). Context rounds and profiles make new graph objects with
        the same structure; their costs tell them apart."""
        g = self.graph
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((g.name, self.devices, self.budget_bytes, g.released_logits)).encode())
        h.update(repr([(v.name, v.kind) for v in g.nodes]).encode())
        h.update(repr([(e.src, e.dst, e.copyable, e.kind) for e in g.edges]).encode())
        for a in (g.output_bytes, g.state_bytes, self.compute_s, self.workspace_bytes):
            h.update(np.ascontiguousarray(a).tobytes())
        if self.n_devices > 1:
            h.update(np.ascontiguousarray(self.copy_s).tobytes())
        return h.hexdigest()

    def with_budgets(self, budget_bytes: tuple[int, ...]) -> Instance:
        return Instance(self.graph, self.devices, tuple(int(b) for b in budget_bytes))

    def smallest_budgets_bytes(self) -> np.ndarray:
        """Per device, the largest footprint of any op there (its inputs, output, state and
        workspace on that device, which must be on it at once): no schedule on that device
        alone fits a smaller budget (docs/design.md section 10)."""
        return np.array(
            [int(self.graph.node_lower_bound_bytes(d).max()) for d in self.devices],
            dtype=np.int64,
        )

    def unfit_message(self) -> str | None:
        """Why no schedule of this instance can exist, known without a solve, or None.

        Infeasible only when some op's footprint, measured on each device, exceeds every
        device's budget: with several devices an op that fits one device can run there (a
        device that can run nothing still holds copies nobody needs). The message names, per
        device, the smallest budget that device alone would need."""
        foot = np.stack([self.graph.node_lower_bound_bytes(d) for d in self.devices])
        nowhere = np.flatnonzero((foot > self.budgets[:, None]).all(axis=0))
        if not nowhere.size:
            return None
        v = int(nowhere[np.argmax(foot[:, nowhere].min(axis=0))])
        need = ", ".join(
            f"{d} {format_bytes(int(foot[k, v]))} ({int(foot[k, v])} bytes)"
            for k, d in enumerate(self.devices)
        )
        smallest = ", ".join(
            f"{d} {format_bytes(int(b))}"
            for d, b in zip(self.devices, self.smallest_budgets_bytes(), strict=True)
        )
        budgets = ", ".join(format_bytes(int(b)) for b in self.budget_bytes)
        return (
            f"budget {budgets} fits op {self.graph.nodes[v].name} on no device (it needs {need}); "
            f"the smallest budget on each device alone: {smallest}"
        )

    def only_device(self, d: int, budget_bytes: int) -> Instance:
        """The same graph on device ``d`` alone (the paper's single-device baseline)."""
        return Instance(self.graph, (self.devices[d],), (int(budget_bytes),))
