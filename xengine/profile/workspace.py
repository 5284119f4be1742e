"""Op workspaces, measured on a device's allocator (the profile stage, docs/design.md section 4).

A node's *workspace* is the memory it needs only while it runs: op temporaries (convolution
scratch, reordered weights), a backward op's parameter gradients before they are accumulated,
the sum of its gradient contributions. It depends on the device, its thread count and the CPU
kind, so it is measured by running the nodes, with the executor's runtime: the graph stage
(:mod:`xengine.graph.capture`) only builds the graph, whose workspaces are then the bytes of
the parameter gradients a backward node produces, and never runs the executor.

Two figures come from :func:`measure_workspace_bytes`:

* per device, in a profile (:func:`xengine.profile.profiler.profile_model`), applied to the
  graph with the costs (``device_workspace_bytes``);
* the graph's default, for any device without a profile: measured on the CPU allocator by
  :func:`fill_workspaces`. :func:`capture` and :func:`capture_net` here are the graph stage's
  functions followed by that measurement (what capturing did before it was split off).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from xengine.execute.executor import LABEL_PREFIX, _Runtime
from xengine.graph import capture as graph_capture
from xengine.graph.capture import CapturedModel
from xengine.problem import Instance
from xengine.schedule import keep_all_schedule
from xengine.simulate import Op, simulate
from xengine.torch_state import TorchState

log = logging.getLogger(__name__)

CPU_MEASURED = "measured on the CPU allocator"


# ---------------------------------------------------------------------- capture, measured
def capture(
    module: nn.Module,
    example_input: torch.Tensor,
    target: torch.Tensor,
    mode: str = "train",
    name: str = "model",
    measure_workspace: bool = True,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    leaf_modules: Sequence[type[nn.Module]] = (),
) -> CapturedModel:
    """Capture ``module`` for scheduling: :func:`xengine.graph.capture.trace` (its
    ``loss_fn``, by default cross-entropy on class indices, and its ``leaf_modules``, module
    classes kept as one op), then (``measure_workspace``, the default) each node's workspace
    measured on the CPU allocator (:func:`fill_workspaces`); without, it is the bytes of the
    parameter gradients a backward node produces."""
    cap = graph_capture.trace(
        module, example_input, target, mode, name, loss_fn=loss_fn, leaf_modules=leaf_modules
    )
    return fill_workspaces(cap) if measure_workspace else cap


def capture_net(
    net: str,
    batch_size: int,
    mode: str = "train",
    image_size: int | None = None,
    num_classes: int | None = None,
    seed: int = 0,
    measure_workspace: bool = True,
    granularity: str = "module",
    num_layers: int | None = None,
    width: int | None = None,
) -> CapturedModel:
    """:func:`xengine.graph.capture.trace_net` (a named net with seeded random weights),
    then (``measure_workspace``, the default) each node's workspace measured on the CPU
    allocator (:func:`fill_workspaces`)."""
    cap = graph_capture.trace_net(
        net,
        batch_size,
        mode=mode,
        image_size=image_size,
        num_classes=num_classes,
        seed=seed,
        granularity=granularity,
        num_layers=num_layers,
        width=width,
    )
    return fill_workspaces(cap) if measure_workspace else cap


def fill_workspaces(captured: CapturedModel) -> CapturedModel:
    """Measure every node's workspace on the CPU allocator (:func:`measure_workspace_bytes`,
    a whole keep-everything step) and make it the graph's default workspace, never below the
    parameter gradients the capture put there. Changes ``captured`` in place (its graph and
    meta, ``"workspace"`` saying where the figures come from) and returns it."""
    graph = captured.graph
    ws = measure_workspace_bytes(captured)
    nodes = tuple(
        replace(v, workspace_bytes=max(int(v.workspace_bytes), int(w)))
        for v, w in zip(graph.nodes, ws, strict=True)
    )
    captured.graph = replace(graph, nodes=nodes, meta={**graph.meta, "workspace": CPU_MEASURED})
    captured.meta = dict(captured.graph.meta)
    return captured


# ---------------------------------------------------------------------- op workspaces
def measure_workspace_bytes(captured: CapturedModel, device: str = "cpu") -> list[int]:
    """Per node: the memory it needs only while it runs on ``device``, from its allocator.

    Runs the keep-everything schedule once on ``device`` (its thread count included: op
    temporaries depend on it and on the CPU kind) under the profiler and takes, per node, the
    allocator's peak during the node minus what was allocated before it and minus the value
    and state the node leaves: temporaries inside an op (convolution scratch and reordered
    weights, a backward op's parameter gradients before they are accumulated, the sum of its
    gradient contributions). CUDA devices are measured with the caching allocator's peak
    around each node instead. Leaves no trace: random state, buffers and gradient buffers are
    restored."""
    g = captured.graph
    n = g.size
    costless = g.with_costs({device: {v.name: 0.0 for v in g.nodes}})
    inst = Instance.single(costless, device, budget_bytes=None)
    sim = simulate(inst, keep_all_schedule(inst))
    ops = sim.ops
    start = TorchState(captured.gm.buffers(), grads_of=captured.module.parameters())
    threads0 = torch.get_num_threads()
    rt = _Runtime(captured, [device])
    rt.loss_releases = tuple(sim.loss_releases)  # as the executor runs the loss
    rt.zero_grads()
    try:
        if rt.specs[device].is_cuda:
            windows = _cuda_windows(rt, ops, device)
        else:
            windows = _cpu_windows(rt, ops, device)
    finally:
        rt.reset()
        torch.set_num_threads(threads0)
        start.restore()
    left = g.output_bytes + g.state_bytes
    return [max(0, int(windows.get(v, 0)) - int(left[v])) for v in range(n)]


def _run_op(rt: _Runtime, op: Op, device: str) -> None:
    if op.kind == "compute":
        rt.compute(op.node, device)
    elif op.kind == "free_state":
        rt.free_state(op.node, device)
    else:
        rt.free(op.node, device)


def _cpu_windows(rt: _Runtime, ops: list[Op], device: str) -> dict[int, int]:
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        for op in ops:
            with torch.profiler.record_function(f"{LABEL_PREFIX}{op.kind}|{device}|{op.node}"):
                _run_op(rt, op, device)
    try:
        return _label_windows(prof)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        log.warning("cannot read allocation events (%s); op workspaces not measured", exc)
        return {}


def _cuda_windows(rt: _Runtime, ops: list[Op], device: str) -> dict[int, int]:
    dev = rt.specs[device].torch_device
    out: dict[int, int] = {}
    for op in ops:
        if op.kind != "compute":
            _run_op(rt, op, device)
            continue
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        _run_op(rt, op, device)
        torch.cuda.synchronize(dev)
        out[op.node] = int(torch.cuda.max_memory_allocated(dev) - before)
    return out


def _label_windows(prof: torch.profiler.profile) -> dict[int, int]:
    """Per ``xe|compute|...|v`` label: the allocator's peak inside it, relative to its start."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int | None]] = []  # (time, size, node of the compute label)

    def walk(evs, node: int | None) -> None:
        for e in evs:
            if e.tag == _EventType.Allocation:
                if e.extra_fields.device.type == "cpu":
                    events.append((e.start_time_ns, int(e.extra_fields.alloc_size), node))
                continue
            nd = node
            if e.tag == _EventType.TorchOp and e.name.startswith(LABEL_PREFIX + "compute|"):
                nd = int(e.name.rsplit("|", 1)[1])
            walk(e.children, nd)

    walk(prof.profiler.kineto_results.experimental_event_tree(), None)
    events.sort(key=lambda a: a[0])
    running = 0
    start: dict[int, int] = {}
    peak: dict[int, int] = {}
    for _, size, node in events:
        if node is not None and node not in start:
            start[node] = running
            peak[node] = running
        running += size
        if node is not None:
            peak[node] = max(peak[node], running)
    return {v: peak[v] - start[v] for v in peak}
