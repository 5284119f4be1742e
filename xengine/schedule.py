"""The schedule: which node runs where in which stage, and what is kept between stages.

``R[d, t, i]``: node ``i`` is computed on device ``d`` in stage ``t``.
``S[d, t, i]``: node ``i``'s output is resident on device ``d`` when stage ``t`` starts.
This is Checkmate's (R, S) pair (Jain et al. 2020, section 4) with XEngine's device index
(Schuler et al. 2022, section 4). DESIGN.md section 5.
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

    def __post_init__(self) -> None:
        R = np.asarray(self.R, dtype=bool)
        S = np.asarray(self.S, dtype=bool)
        if R.ndim != 3 or R.shape != S.shape or R.shape[0] != len(self.devices):
            raise ValueError(f"R and S must both be (D, T, n); got {R.shape} and {S.shape}")
        object.__setattr__(self, "R", R)
        object.__setattr__(self, "S", S)

    @property
    def n_stages(self) -> int:
        return self.R.shape[1]

    def to_json(self) -> dict[str, Any]:
        """Sparse, human-readable form: lists of [device, stage, node] triples."""
        return {
            "format": "xengine-schedule",
            "version": 1,
            "devices": list(self.devices),
            "n_stages": int(self.R.shape[1]),
            "n_nodes": int(self.R.shape[2]),
            "R": np.argwhere(self.R).tolist(),
            "S": np.argwhere(self.S).tolist(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "schedule") -> Schedule:
        try:
            devices = tuple(str(d) for d in data["devices"])
            shape = (len(devices), int(data["n_stages"]), int(data["n_nodes"]))
            R = np.zeros(shape, dtype=bool)
            S = np.zeros(shape, dtype=bool)
            for name, arr in (("R", R), ("S", S)):
                for triple in data[name]:
                    d, t, i = (int(x) for x in triple)
                    if not (0 <= d < shape[0] and 0 <= t < shape[1] and 0 <= i < shape[2]):
                        raise ValueError(f"field {name!r}: entry {triple} is out of range")
                    arr[d, t, i] = True
        except KeyError as exc:
            raise ValueError(f"{source}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None
        return cls(devices, R, S)

    def on_devices(self, devices: tuple[str, ...]) -> Schedule:
        """The same schedule embedded in a larger device mix (unused devices get zeros)."""
        D, T, n = len(devices), self.R.shape[1], self.R.shape[2]
        R = np.zeros((D, T, n), dtype=bool)
        S = np.zeros((D, T, n), dtype=bool)
        for k, name in enumerate(self.devices):
            j = devices.index(name)
            R[j] |= self.R[k]
            S[j] |= self.S[k]
        return Schedule(devices, R, S)


def keep_all_schedule(inst: Instance, device: int = 0) -> Schedule:
    """Each node once, in its own stage, on one device; outputs kept until their last reader.

    This is Checkmate's checkpoint-all baseline: no recomputation, the largest memory."""
    n = inst.size
    D = inst.n_devices
    R = np.zeros((D, n, n), dtype=bool)
    S = np.zeros((D, n, n), dtype=bool)
    R[device, np.arange(n), np.arange(n)] = True
    for i, succ in enumerate(inst.graph.successors):
        if succ:
            S[device, i + 1 : max(succ) + 1, i] = True
    return Schedule(inst.devices, R, S)
