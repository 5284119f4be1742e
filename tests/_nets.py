"""Captured networks shared by the capture, executor and profiler tests (captured once per
session), and a helper that runs a schedule beside a plain PyTorch step."""

from __future__ import annotations

import functools

import torch

from xengine.execute.executor import ExecutionResult, execute, reference_step
from xengine.graph.capture import CapturedModel
from xengine.graph.types import CopyModel, Graph
from xengine.problem import Instance
from xengine.profile.workspace import capture_net
from xengine.schedule import Schedule


@functools.cache
def tiny(batch_size: int = 8) -> CapturedModel:
    return capture_net("tiny", batch_size)


@functools.cache
def resnet18_small() -> CapturedModel:
    return capture_net("resnet18", 2, image_size=64)


def costed(graph: Graph, devices) -> Graph:
    """The graph with unit compute costs and fast copies on ``devices`` (for the simulator)."""
    return graph.with_costs(
        {d: {v.name: 1.0 for v in graph.nodes} for d in devices},
        {(a, b): CopyModel(1e-3, 1e9) for a in devices for b in devices if a != b},
    )


def buffers(cap: CapturedModel) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in cap.module.named_buffers()}


def set_buffers(cap: CapturedModel, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, b in cap.module.named_buffers():
            b.copy_(values[n])


def run_beside_reference(
    cap: CapturedModel,
    inst: Instance,
    sched: Schedule,
    rtol: float = 1e-6,
    atol: float = 1e-7,
    seed: int = 0,
    measure_memory: bool = False,
    ref_device: str = "cpu",
) -> tuple[ExecutionResult, ExecutionResult]:
    """Run a plain step and the schedule from the same state (weights, buffers, random state);
    assert the same loss, parameter gradients and batch-norm buffers afterwards. The module's
    buffers are restored when done."""
    start = buffers(cap)
    try:
        torch.manual_seed(seed)
        ref = reference_step(cap, n_steps=1, warmup=0, measure_memory=False, device=ref_device)
        after_ref = buffers(cap)
        set_buffers(cap, start)
        torch.manual_seed(seed)
        res = execute(cap, inst, sched, n_steps=1, warmup=0, measure_memory=measure_memory)
        after_exec = buffers(cap)
    finally:
        set_buffers(cap, start)
    assert res.loss == ref.loss or abs(res.loss - ref.loss) <= atol + rtol * abs(ref.loss)
    assert set(res.param_grads) == set(ref.param_grads)
    for name, g in ref.param_grads.items():
        torch.testing.assert_close(res.param_grads[name], g, rtol=rtol, atol=atol, msg=name)
    for name, b in after_ref.items():
        torch.testing.assert_close(after_exec[name], b, rtol=rtol, atol=atol, msg=name)
    return res, ref
