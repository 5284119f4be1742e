"""Torch's random state and a module's buffers, saved and put back: one idiom for every stage.

Ops draw random numbers (dropout) and update module buffers (batch-norm running statistics).
The capture run and the profiler must leave the model as they found it (docs/design.md sections 3
and 4); the executor replays a recomputation without side effects and starts every step from
the same state (docs/design.md section 8); a run measures the reference and every schedule from
the same start. :class:`TorchState` is that snapshot, taken once and restored any number of
times. This module imports only torch, so the graph stage may use it as well as the executor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def rng_state(device: torch.device | str) -> torch.Tensor:
    """The state of ``device``'s default generator (a CUDA device's own, else the CPU's)."""
    dev = torch.device(device)
    return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device | str, state: torch.Tensor) -> None:
    """Put ``state`` (from :func:`rng_state`) back into ``device``'s default generator."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_rng_state(state, dev)
    else:
        torch.set_rng_state(state)


def every_rng_device() -> tuple[torch.device, ...]:
    """The CPU and each CUDA device torch sees: every default generator there is (what
    ``torch.cuda.get_rng_state_all`` covers, plus the CPU's)."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (torch.device("cpu"), *(torch.device("cuda", i) for i in range(cuda)))


class TorchState:
    """A snapshot of the random state of the ``rng`` devices (default: the CPU generator),
    copies of ``buffers`` and the ``.grad`` tensors (references, not copies) of ``grads_of``.

    :meth:`restore` puts all of it back, as often as needed: the generators' states, the
    buffers' values (copied into the same tensors, without autograd) and each parameter's
    ``.grad``. As a context manager it restores on exit, also when the block raises.
    :meth:`rng_moved` tells whether a generator has drawn since the snapshot. A device named
    twice (``cpu`` for every logical CPU device) is saved once."""

    __slots__ = ("_rng", "_buffers", "_grads")

    def __init__(
        self,
        buffers: Iterable[torch.Tensor] = (),
        rng: Iterable[torch.device | str] = ("cpu",),
        grads_of: Iterable[torch.Tensor] = (),
    ) -> None:
        self._rng: dict[str, tuple[torch.device, torch.Tensor]] = {}
        for d in rng:
            dev = torch.device(d)
            if str(dev) not in self._rng:
                self._rng[str(dev)] = (dev, rng_state(dev))
        self._buffers = [(b, b.detach().clone()) for b in buffers]
        self._grads = [(p, p.grad) for p in grads_of]

    def restore(self) -> None:
        for dev, state in self._rng.values():
            set_rng_state(dev, state)
        if self._buffers:
            with torch.no_grad():
                for b, b0 in self._buffers:
                    b.copy_(b0)
        for p, g in self._grads:
            p.grad = g

    def rng_moved(self) -> bool:
        """Whether a saved generator's state differs from the snapshot (it drew numbers)."""
        return any(not torch.equal(s, rng_state(dev)) for dev, s in self._rng.values())

    def __enter__(self) -> TorchState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
