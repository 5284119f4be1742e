"""The schedule: which node runs where in which stage, and what is kept between stages.

``R[d, t, i]``: node ``i`` is computed on device ``d`` in stage ``t``.
``S[d, t, i]``: node ``i``'s value is resident on device ``d`` when stage ``t`` starts.
``S_state[d, t, v]``: forward node ``v``'s autograd state is resident on ``d`` when stage ``t``
starts (graphs with state links only; docs/design.md section 3).
This is Checkmate's (R, S) pair (Jain et al. 2020, section 4) with XEngine's device index
(Schuler et al. 2022, section 4), plus the state's residency. docs/design.md section 5.

A schedule may leave ``S_state`` out (``None``): the state is then kept exactly as long as
``R`` needs it (:func:`minimal_state_residency`), which no other choice beats in memory and
which every heuristic and version-1 schedule file gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xengine.problem import Instance


@dataclass(frozen=True)
class Schedule:
    devices: tuple[str, ...]
    R: np.ndarray
    S: np.ndarray
    S_state: np.ndarray | None = None

    def __post_init__(self) -> None:
        R = np.asarray(self.R, dtype=bool)
        S = np.asarray(self.S, dtype=bool)
        if R.ndim != 3 or R.shape != S.shape or R.shape[0] != len(self.devices):
            raise ValueError(f"R and S must both be (D, T, n); got {R.shape} and {S.shape}")
        object.__setattr__(self, "R", R)
        object.__setattr__(self, "S", S)
        if self.S_state is not None:
            A = np.asarray(self.S_state, dtype=bool)
            if A.shape != R.shape:
                raise ValueError(f"S_state must be (D, T, n) like R; got {A.shape}")
            object.__setattr__(self, "S_state", A)

    def states_for(self, graph) -> np.ndarray:
        """``S_state``, or the minimal residency that ``R`` needs when the schedule has none."""
        if self.S_state is not None:
            return self.S_state
        return minimal_state_residency(graph, self.R)

    def with_states(self, graph) -> Schedule:
        return Schedule(self.devices, self.R, self.S, self.states_for(graph))

    @property
    def n_stages(self) -> int:
        return self.R.shape[1]

    def to_json(self) -> dict[str, Any]:
        """Sparse, human-readable form: lists of [device, stage, node] triples."""
        out = {
            "format": "xengine-schedule",
            "version": 2 if self.S_state is not None else 1,
            "devices": list(self.devices),
            "n_stages": int(self.R.shape[1]),
            "n_nodes": int(self.R.shape[2]),
            "R": np.argwhere(self.R).tolist(),
            "S": np.argwhere(self.S).tolist(),
        }
        if self.S_state is not None:
            out["S_state"] = np.argwhere(self.S_state).tolist()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "schedule") -> Schedule:
        try:
            devices = tuple(str(d) for d in data["devices"])
            shape = (len(devices), int(data["n_stages"]), int(data["n_nodes"]))
            R = np.zeros(shape, dtype=bool)
            S = np.zeros(shape, dtype=bool)
            A = np.zeros(shape, dtype=bool) if "S_state" in data else None
            arrays = [("R", R), ("S", S)] + ([("S_state", A)] if A is not None else [])
            for name, arr in arrays:
                for triple in data[name]:
                    d, t, i = (int(x) for x in triple)
                    if not (0 <= d < shape[0] and 0 <= t < shape[1] and 0 <= i < shape[2]):
                        raise ValueError(f"field {name!r}: entry {triple} is out of range")
                    arr[d, t, i] = True
        except KeyError as exc:
            raise ValueError(f"{source}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None
        return cls(devices, R, S, A)

    def on_devices(self, devices: tuple[str, ...]) -> Schedule:
        """The same schedule embedded in a larger device mix (unused devices get zeros)."""
        D, T, n = len(devices), self.R.shape[1], self.R.shape[2]
        R = np.zeros((D, T, n), dtype=bool)
        S = np.zeros((D, T, n), dtype=bool)
        A = None if self.S_state is None else np.zeros((D, T, n), dtype=bool)
        for k, name in enumerate(self.devices):
            j = devices.index(name)
            R[j] |= self.R[k]
            S[j] |= self.S[k]
            if A is not None:
                A[j] |= self.S_state[k]
        return Schedule(devices, R, S, A)


def minimal_state_residency(graph, R: np.ndarray) -> np.ndarray:
    """The least ``S_state`` that lets every ``B_v`` of ``R`` find ``F_v``'s state.

    On each device the state made by a computation of ``F_v`` is kept into stage ``t`` only
    when some ``B_v`` on that device in stage ``t`` or later needs it before ``F_v`` runs there
    again (a new computation makes a new state). Keeping a state costs memory and nothing
    else, so given ``R`` no other residency has a lower peak."""
    R = np.asarray(R, dtype=bool)
    D, T, n = R.shape
    A = np.zeros((D, T, n), dtype=bool)
    readers = graph.state_reader
    vs = np.flatnonzero(readers >= 0)
    if not vs.size:
        return A
    stage = np.arange(T)[:, None]

    def next_stage(mask: np.ndarray) -> np.ndarray:  # (T, k): first stage >= t with mask
        return np.minimum.accumulate(np.where(mask, stage, T)[::-1], axis=0)[::-1]

    for d in range(D):
        rv, rb = R[d][:, vs], R[d][:, readers[vs]]
        # needed when stage t starts: a B_v comes (at t or later) before F_v runs again
        # there (a computation in B_v's own stage runs first and makes a new state)
        need = next_stage(rb) < next_stage(rv)
        made = (np.cumsum(rv, axis=0) - rv) > 0  # F_v ran there before stage t
        A[d][:, vs] = need & made
    return A


def keep_all_schedule(inst: Instance, device: int = 0) -> Schedule:
    """Each node once, in its own stage, on one device; values kept until their last reader,
    states until their backward op: what a plain PyTorch step keeps.

    This is Checkmate's checkpoint-all baseline: no recomputation, the largest memory."""
    n = inst.size
    D = inst.n_devices
    R = np.zeros((D, n, n), dtype=bool)
    S = np.zeros((D, n, n), dtype=bool)
    R[device, np.arange(n), np.arange(n)] = True
    for i, succ in enumerate(inst.graph.successors):
        if succ:
            S[device, i + 1 : max(succ) + 1, i] = True
    A = minimal_state_residency(inst.graph, R) if inst.graph.has_states else None
    return Schedule(inst.devices, R, S, A)
