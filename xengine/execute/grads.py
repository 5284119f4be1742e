"""Is a schedule's step the same training step as plain PyTorch's? Loss and gradients compared
with a plain step on the same kind of device (docs/design.md section 8).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def _torch_device(device: str) -> str:
    """The torch device behind a device name (``cpu2`` and ``cpu`` are both ``cpu``)."""
    return _numerics(device)[0]


def reference_devices(devices: tuple[str, ...]) -> list[str]:
    """Where a plain PyTorch step runs: the first device, and the first device of every
    other kind (a GPU's arithmetic differs from the CPU's: its gradients are checked against
    a plain step on the GPU; CPU sub-devices share one reference)."""
    out: list[str] = []
    for d in devices:
        if all(_torch_device(d) != _torch_device(r) for r in out):
            out.append(d)
    return out


def reference_of(device: str, references: Iterable[str]) -> str | None:
    """The reference device (:func:`reference_devices`) whose plain step a row on ``device``
    is compared with: the first of the same kind; None if there is none."""
    kind = _torch_device(device)
    return next((r for r in references if _torch_device(r) == kind), None)


def check_grads(
    run: Any,
    devices: tuple[str, ...],
    references: Mapping[str, Any],
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> tuple[bool, float | None] | None:
    """Compare a step that ran on ``devices`` with the plain steps in ``references`` (device
    name -> plain step, one per kind of device as :func:`reference_devices` picks them): on
    one kind of device against that kind's plain step (element by element where the
    arithmetic is the same, per tensor where it is not, e.g. another CPU thread count or a
    GPU), over several kinds with :func:`grads_within_spread`. Returns (match, largest
    difference as a fraction of a tensor's largest magnitude), or None without a plain step
    of each kind to compare with."""
    by_kind = {_torch_device(d): d for d in reversed(list(references))}
    kinds = sorted({_torch_device(d) for d in devices})
    if not all(k in by_kind for k in kinds):
        return None
    if len(kinds) > 1:
        return grads_within_spread(run, [references[by_kind[k]] for k in kinds], rtol)
    ref_device = by_kind[kinds[0]]
    reference = references[ref_device]
    on_cuda = kinds[0].startswith("cuda")
    match = grads_match(
        run,
        reference,
        max(rtol, CUDA_GRAD_RTOL) if on_cuda else rtol,
        atol,
        per_tensor=on_cuda or not _same_numerics(devices, ref_device),
    )
    return match, grads_max_rel_diff(run, reference)


CUDA_GRAD_RTOL = 1e-3
"""Per-tensor tolerance against a plain step on the same GPU: cuDNN picks reduction orders
that are not deterministic (two plain resnet18 steps on an H200 differed by up to 4.3e-5 of a
tensor's largest gradient; results/gpu_checks/grads_cpu_vs_gpu.txt)."""


SPREAD_FACTOR = 2.0
"""A schedule over a CPU and a GPU may differ from each plain step by this many times the
difference between the two plain steps (see :func:`grads_within_spread`)."""


def grads_within_spread(
    run: Any, references: list[Any], rtol: float = 1e-4
) -> tuple[bool, float | None]:
    """Check a step that ran on devices of different kinds (CPU and GPU). No plain step has
    its arithmetic, so the check is relative: its loss and gradients must be no further from
    the nearest plain step than :data:`SPREAD_FACTOR` times the largest difference between the
    plain steps themselves, plus ``rtol`` (all as fractions of each tensor's largest
    magnitude, :func:`grads_max_rel_diff`). On resnet18 batch 4 the plain CPU and H200 steps
    differ by up to 27 % of a tensor's largest gradient with cuDNN's default TF32 and 5.7 %
    without (results/gpu_checks/grads_cpu_vs_gpu.txt), so this finds a wrong gradient, not
    a last-bit difference. Returns (match, distance to the nearest plain step)."""
    dists = [grads_max_rel_diff(run, r) for r in references]
    spreads = [
        grads_max_rel_diff(a, b) for i, a in enumerate(references) for b in references[i + 1 :]
    ]
    if any(x is None for x in dists + spreads):
        return False, None
    nearest = min(dists)
    return nearest <= SPREAD_FACTOR * max(spreads, default=0.0) + rtol, nearest


def _numerics(device: str) -> tuple[str, int | None]:
    """What decides a device's floating-point results: its kind and, on the CPU, its number
    of intra-op threads (the order in which reductions add up)."""
    from xengine.execute.executor import parse_device

    spec = parse_device(device)
    return (str(spec.torch_device), spec.threads)


def _same_numerics(devices: tuple[str, ...], reference_device: str) -> bool:
    return {_numerics(d) for d in devices} == {_numerics(reference_device)}


def grads_match(
    run: Any,
    reference: Any,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    per_tensor: bool = False,
) -> bool:
    """Same loss and the same parameter gradients (names and values) as the reference step.

    Element by element (``|a - b| <= atol + rtol * |b|``), or with ``per_tensor`` against
    each tensor's largest magnitude (``max |a - b| <= atol + rtol * max |b|``): for a run on
    devices whose arithmetic differs from the reference's (another CPU thread count, another
    kind of device), reductions add up in another order, and an element that is a small sum
    of large terms differs by more than its own size allows (resnet18 on 2 against 1 thread:
    4.8e-6 on an element of conv1.weight.grad, whose largest element is 0.54)."""
    import torch

    def as_tensor(x: Any) -> torch.Tensor:
        return x.detach().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(x)

    def close(x: Any, y: Any) -> bool:
        x, y = as_tensor(x).double(), as_tensor(y).double()
        if x.shape != y.shape:
            return False
        if not per_tensor or y.numel() == 0:
            return bool(torch.allclose(x, y, rtol=rtol, atol=atol))
        return bool((x - y).abs().max() <= atol + rtol * y.abs().max())

    if (run.loss is None) != (reference.loss is None):
        return False
    if run.loss is not None and not close(run.loss, reference.loss):
        return False
    a, b = dict(run.param_grads or {}), dict(reference.param_grads or {})
    if a.keys() != b.keys():
        return False
    for k, ref in b.items():
        got = a[k]
        if (got is None) != (ref is None):
            return False
        if got is not None and not close(got, ref):
            return False
    return True


def grads_max_rel_diff(run: Any, reference: Any) -> float | None:
    """max over the loss and the gradients of ``max |a - b| / max |b|`` (None when the two
    steps do not have the same gradients to compare)."""
    import torch

    pairs = [(run.loss, reference.loss)]
    a, b = dict(run.param_grads or {}), dict(reference.param_grads or {})
    if a.keys() != b.keys():
        return None
    pairs += [(a[k], b[k]) for k in b]
    worst = 0.0
    for x, y in pairs:
        if x is None or y is None:
            continue
        x, y = (
            torch.as_tensor(x).detach().cpu().double(),
            torch.as_tensor(y).detach().cpu().double(),
        )
        if x.shape != y.shape:
            return None
        if y.numel():
            scale = float(y.abs().max()) or 1.0
            worst = max(worst, float((x - y).abs().max()) / scale)
    return worst
