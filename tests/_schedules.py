"""Schedules made by hand for executor tests: keep-all, checkpointing with recomputation, and
spreading nodes over several devices. Every schedule is checked by the simulator."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.simulate import simulate


def checkpoint_schedule(
    inst: Instance,
    keep: set[int] | None = None,
    device_of: Sequence[int] | None = None,
) -> Schedule:
    """Stage ``t`` computes node ``t`` on ``device_of[t]`` and recomputes, on their own
    devices, the forward nodes it needs that are nowhere to be found.

    Forward nodes in ``keep`` (all when ``None``) stay until their last reader; the others are
    dropped once no later forward op or the loss reads them, and are recomputed from the
    nearest resident values when a backward node needs them. Loss and backward outputs stay
    until their last reader. A backward node must share its forward node's device."""
    g = inst.graph
    n, D = g.size, inst.n_devices
    dev = list(device_of) if device_of is not None else [0] * n
    for b, node in enumerate(g.nodes):
        if node.kind == "bwd" and dev[b] != dev[node.fwd_index]:
            raise ValueError(f"{node.name} must run on its forward node's device")
    R = np.zeros((D, n, n), dtype=bool)
    S = np.zeros((D, n, n), dtype=bool)
    resident: list[set[int]] = [set() for _ in range(D)]
    fwd_like = {i for i, v in enumerate(g.nodes) if v.kind in ("fwd", "loss")}
    for t in range(n):
        here: list[set[int]] = [set(r) for r in resident]

        def ensure(v: int, d: int, t: int = t, here: list[set[int]] = here) -> None:
            for e in g.in_edges[v]:
                u = e.src
                present = u in here[d] if not e.copyable else any(u in h for h in here)
                if present:
                    continue
                if g.nodes[u].kind != "fwd":
                    raise ValueError(f"stage {t}: {g.nodes[u].name} is gone")
                ensure(u, dev[u])
                R[dev[u], t, u] = True
                here[dev[u]].add(u)

        ensure(t, dev[t])
        R[dev[t], t, t] = True
        here[dev[t]].add(t)
        if t + 1 == n:
            break
        for d in range(D):
            nxt = set()
            for u in here[d]:
                later = [s for s in g.successors[u] if s > t]
                if not later:
                    continue
                if g.nodes[u].kind == "fwd" and keep is not None and u not in keep:
                    if not any(s in fwd_like for s in later):
                        continue
                nxt.add(u)
            resident[d] = nxt
            S[d, t + 1, sorted(nxt)] = True
    sched = Schedule(inst.devices, R, S)
    simulate(inst, sched, check_budget=False)  # raises if the schedule breaks a rule
    return sched


def forward_devices(inst: Instance, fwd_device: Sequence[int], loss_device: int = 0) -> list[int]:
    """A device per node from a device per forward node: each backward node goes with its
    forward node (whose autograd state it needs)."""
    g = inst.graph
    out = []
    for i, v in enumerate(g.nodes):
        if v.kind == "fwd":
            out.append(fwd_device[i])
        elif v.kind == "loss":
            out.append(loss_device)
        else:
            out.append(fwd_device[v.fwd_index])
    return out
