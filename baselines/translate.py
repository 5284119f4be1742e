"""PyTorch's checkpointing policies as schedules of ours (docs/design.md section 6), so that
the simulator predicts what PyTorch measures and our executor runs the same checkpoints
beside PyTorch's run.

* ``torch.utils.checkpoint`` around blocks (:func:`checkpoint_schedule`): a block's inputs
  are kept, its other nodes are dropped after the forward pass and made again when the
  backward pass reaches the block (:func:`xengine.checkpoints.block_checkpoint_matrix`);
* selective checkpointing (:func:`sac_schedule`): the same, except that the nodes whose
  outputs the policy saves (:func:`sac_kept_nodes`) stay from the forward pass on and are not
  made again.

A node of our graph is a module or a tensor function; selective checkpointing decides per
ATen op. A node translates when it is all one side of the policy: none of its ATen ops is
saved, or its output and every tensor its backward keeps come from saved ops (a convolution,
a linear layer, attention run as one fused op). A node that mixes both (attention computed by
its ATen parts, where the products are saved and the softmax is not) keeps part of its
state, which one node cannot; such a level is not translated (:class:`Untranslatable`),
and the row says why.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from xengine.checkpoints import block_checkpoint_matrix, solve_block_r
from xengine.graph.capture import CapturedModel, fixed_storage_ptrs, storage_ptr
from xengine.problem import Instance
from xengine.schedule import Schedule
from xengine.torch_state import TorchState


class Untranslatable(ValueError):
    """A policy level that no schedule of ours describes (the message says which node and
    why)."""


def block_nodes(captured: CapturedModel, paths: Sequence[str]) -> list[list[int]]:
    """The forward nodes of each block of ``paths``: from the first op whose module is the
    block or inside it to the last, and the function calls right after it. A block's ops run
    one after the other, so a function between them or after its last module (a residual
    addition, the decoder's second one) is the block's too."""
    out = []
    for path in paths:
        idx = [
            op.index
            for op in captured.ops
            if op.module_path is not None
            and (op.module_path == path or op.module_path.startswith(path + "."))
        ]
        if not idx:
            raise ValueError(f"block {path!r} has no op in the captured graph")
        last = max(idx)
        while last + 1 < len(captured.ops) and captured.ops[last + 1].module_path is None:
            last += 1  # the function calls after its last module: a residual addition
        out.append(list(range(min(idx), last + 1)))
    return out


def checkpoint_schedule(
    captured: CapturedModel, inst: Instance, paths: Sequence[str], kept: Collection[int] = ()
) -> Schedule:
    """``torch.utils.checkpoint`` around ``paths`` as a schedule of ours
    (:func:`xengine.checkpoints.block_checkpoint_matrix`, ``R`` from
    :func:`xengine.checkpoints.solve_block_r`), so that the simulator predicts what PyTorch
    measures; ``kept``: block nodes whose outputs a selective policy saves."""
    S, S_state = block_checkpoint_matrix(inst.graph, block_nodes(captured, paths), kept)
    return solve_block_r(inst.graph, S, S_state, inst.devices[0])


# ------------------------------------------------------------------------------ selective
@dataclass(frozen=True)
class NodeOps:
    """What one forward node runs at the ATen level, for selective checkpointing: the
    storages each op of ``saved_ops`` makes, in call order (one tuple per call), the node's
    output storage, and the storages its backward keeps that are neither an input's, nor its
    output's, nor fixed memory (its autograd state)."""

    name: str
    saved_calls: tuple[tuple[int, ...], ...]
    output_ptr: int
    state_ptrs: frozenset[int]


class _Calls(TorchDispatchMode):
    """Records the output storages of every call of ``ops`` (below autograd, where
    selective checkpointing's policy sees them)."""

    def __init__(self, ops: Collection) -> None:
        super().__init__()
        self.ops, self.calls = ops, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            ptrs = (storage_ptr(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.calls.append(tuple(p for p in ptrs if p))
        return out


def node_ops(captured: CapturedModel, ops: Collection) -> list[NodeOps]:
    """:class:`NodeOps` of every forward node: one forward pass on a copy of the module, op by
    op as the captured program runs them (the module's own order), the random state and
    buffers left as they were."""
    module = copy.deepcopy(captured.module).train(captured.mode == "train")
    x = captured.example_input
    fixed = fixed_storage_ptrs(module, x, captured.target)
    values: list[torch.Tensor] = []
    out: list[NodeOps] = []
    with TorchState(module.buffers()), torch.enable_grad():
        for spec in captured.ops:
            ins = [values[u] for u in spec.inputs]
            kept: list[int] = []

            def pack(t: torch.Tensor, kept=kept) -> torch.Tensor:
                kept.append(storage_ptr(t))
                return t

            mode = _Calls(ops)
            with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = spec.bind(module)(ins, x)
            values.append(y)
            own = storage_ptr(y)
            taken = fixed | {storage_ptr(t) for t in ins} | {own, 0}
            out.append(NodeOps(spec.name, tuple(mode.calls), own, frozenset(kept) - taken))
    return out


def sac_kept_nodes(
    nodes: Sequence[NodeOps], blocks: Sequence[Sequence[int]], stride: int
) -> list[int]:
    """The block nodes whose outputs selective checkpointing at ``stride`` saves
    (:func:`baselines.pytorch.sac_context`: the ``stride``-th, ``2 * stride``-th, ... call of
    a saved op in each block), those that stay from the forward pass on. Raises
    :class:`Untranslatable` where a node mixes saved and recomputed tensors."""
    kept = []
    for block in blocks:
        count = 0
        for v in block:
            node = nodes[v]
            saved: set[int] = set()
            for ptrs in node.saved_calls:
                count += 1
                if count % stride == 0:
                    saved.update(ptrs)
            if not saved:
                continue
            if node.output_ptr not in saved or not node.state_ptrs <= saved:
                raise Untranslatable(
                    f"node {node.name} keeps tensors that selective checkpointing saves and "
                    "tensors it recomputes (its ATen ops fall on both sides of the policy), "
                    "which one node of our graph cannot"
                )
            kept.append(v)
    return kept


def sac_schedule(
    captured: CapturedModel,
    inst: Instance,
    paths: Sequence[str],
    nodes: Sequence[NodeOps],
    stride: int,
) -> Schedule:
    """Selective checkpointing of ``paths`` at ``stride`` as a schedule of ours: the
    blocks' checkpoints (:func:`checkpoint_schedule`) with :func:`sac_kept_nodes` kept."""
    kept = sac_kept_nodes(nodes, block_nodes(captured, paths), stride)
    return checkpoint_schedule(captured, inst, paths, kept)
