"""What a user reaches for before an optimiser: PyTorch's own checkpointing, run by PyTorch and
measured like every row (docs/design.md section 6, "PyTorch's own baselines").

* ``torch_checkpoint``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around the
  net's blocks (:func:`find_blocks`), checkpointing the fewest blocks whose measured peak fits
  the budget, the blocks that save the most activation bytes first;
* ``torch_sac``: selective activation checkpointing, torchtitan's ``op`` policy: every block
  checkpointed with a policy (``create_selective_checkpoint_contexts``) that saves the outputs
  of convolutions, matrix products and attention and recomputes everything else; when that
  does not fit, only every s-th of those outputs in each block (s = 2, 3, ...), down to none.

PyTorch runs both itself: each searches levels of its policy from the least recomputation
up, measuring each level's peak in one profiled step (the allocator's peak above the step's
start, as every row's), and times the first level that fits like a plain step (``n_steps``
after ``warmup``). The result carries a :class:`~xengine.result.PolicyRun` (the level chosen,
every level's measured peak, the execution); its loss and gradients are checked against a
plain step's like any executed schedule. A policy that fits nowhere is ``infeasible`` with the
smallest peak it reached. The chosen level is also translated into a schedule of ours
(:mod:`baselines.translate`): the simulator's replay is the row's prediction, and our
executor runs it beside PyTorch's.

A block's batch norm runs twice in training when recomputed, so its running statistics move
twice per step (as with ``torch.utils.checkpoint`` in any training loop); loss and gradients
are unaffected, and the policies run on a copy of the module.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from baselines.translate import (
    Untranslatable,
    checkpoint_schedule,
    node_ops,
    sac_schedule,
)
from xengine.execute.executor import (
    ExecutionResult,
    PlainStep,
    execute,
    parse_device,
    reference_step,
)
from xengine.graph.capture import CapturedModel, storage_ptr
from xengine.problem import Instance
from xengine.result import GradCheck, PolicyRun, StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import simulate
from xengine.torch_state import TorchState
from xengine.units import format_bytes

log = logging.getLogger(__name__)

Rewrite = Callable[[nn.Module], None]
BLOCK_CONTAINERS = (nn.Sequential, nn.ModuleList)
_SAVED_OPS = (
    "convolution.default",
    "mm.default",
    "addmm.default",
    "bmm.default",
    "baddbmm.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
)


def saved_ops() -> frozenset:
    """The ATen ops whose outputs selective checkpointing saves (torchtitan's ``op`` policy:
    the expensive ones), those that this torch build has."""
    out = set()
    for name in _SAVED_OPS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            out.add(op)
    return frozenset(out)


# ------------------------------------------------------------------------------ blocks
def find_blocks(module: nn.Module) -> list[str]:
    """The net's blocks, by module path: on each path down from the root, the first
    ``nn.Sequential`` or ``nn.ModuleList`` with at least two children that have children of
    their own; those children are blocks (a leaf layer between them is not). This is the block
    each family's authors wrote: ResNet's residual blocks (``layer1.0`` ...), MobileNet's and
    EfficientNet's ``features.i``, ViT's encoder layers, DenseNet's dense blocks and
    transitions, GPT's decoder blocks."""
    out: list[str] = []

    def walk(mod: nn.Module, prefix: str) -> None:
        kids = list(mod.named_children())
        inner = [name for name, kid in kids if next(kid.children(), None) is not None]
        if isinstance(mod, BLOCK_CONTAINERS) and len(inner) >= 2:
            out.extend(prefix + name for name in inner)
            return
        for name, kid in kids:
            walk(kid, f"{prefix}{name}.")

    walk(module, "")
    return out


def saved_bytes_by_block(captured: CapturedModel, blocks: Sequence[str]) -> dict[str, int]:
    """Bytes of activations each block keeps for the backward pass (autograd's saved
    tensors, parameters excluded, each storage counted once), from one forward pass on a
    copy of the module: the order in which ``torch_checkpoint`` checkpoints blocks."""
    module = copy.deepcopy(captured.module).train(captured.mode == "train")
    params = {storage_ptr(p) for p in module.parameters()}
    saved, seen, current = dict.fromkeys(blocks, 0), set(), [None]
    hooks = []
    for path in blocks:
        sub = module.get_submodule(path)
        hooks.append(sub.register_forward_pre_hook(lambda m, a, p=path: current.__setitem__(0, p)))
        hooks.append(sub.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = storage_ptr(t)
        if current[0] is not None and ptr and ptr not in params and ptr not in seen:
            seen.add(ptr)
            saved[current[0]] += t.untyped_storage().nbytes()
        return t

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            captured.loss(module(captured.example_input), captured.target)
    finally:
        for h in hooks:
            h.remove()
    return saved


def checkpointed(paths: Sequence[str], context_fn: Callable | None = None) -> Rewrite:
    """A rewrite that runs each block of ``paths`` under ``torch.utils.checkpoint`` (not
    re-entrant; with ``context_fn``: selective). The block's ``forward`` is wrapped in
    place, so parameter names stay those of a plain step."""

    def rewrite(module: nn.Module) -> None:
        kwargs = {"use_reentrant": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        for path in paths:
            block = module.get_submodule(path)
            block.forward = partial(checkpoint, block.forward, **kwargs)

    return rewrite


def sac_context(stride: int, counts: dict[str, int] | None = None) -> Callable:
    """Selective checkpointing's ``context_fn``: in each checkpointed call, the outputs of
    every ``stride``-th op of :func:`saved_ops` (the ``stride``-th, the ``2 * stride``-th,
    ...) are saved and everything else is recomputed; ``stride`` 1 saves them all, one above
    the most such ops in a block saves none. ``counts["most"]`` (if given) records the most
    such ops seen in one call."""
    ops = saved_ops()

    def context_fn():
        seen = {False: 0, True: 0}  # the forward's count, and a recomputation's if asked

        def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
            if op not in ops:
                return CheckpointPolicy.PREFER_RECOMPUTE
            i = seen[ctx.is_recompute] = seen[ctx.is_recompute] + 1
            if counts is not None:
                counts["most"] = max(counts.get("most", 0), i)
            return (
                CheckpointPolicy.MUST_SAVE if i % stride == 0 else CheckpointPolicy.PREFER_RECOMPUTE
            )

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def _most_saved_ops(captured: CapturedModel, blocks: Sequence[str]) -> int:
    """The most :func:`saved_ops` in one block's forward (one forward pass on a copy)."""
    counts: dict[str, int] = {}
    module = copy.deepcopy(captured.module).train(captured.mode == "train")
    checkpointed(blocks, sac_context(1, counts))(module)
    with torch.enable_grad():
        captured.loss(module(captured.example_input), captured.target)
    return counts.get("most", 0)


# ------------------------------------------------------------------------------ compiled
BUDGET_LEVELS = tuple(round(1.0 - k / 10, 1) for k in range(11))
"""``activation_memory_budget`` values that ``torch_budget`` tries, one after the other from
the partitioner's own choice (1.0) down to recomputing all it can (0.0). The measured peak is
not monotone in it (gpt2_small b2 128 tokens, aot_eager: 13.6 MiB at 1.0, 8.5 at 0.5, 13.6
at 0.0: the backward graph recomputes its whole forward before it starts), so no bisection."""

COMPILERS = {"torch_budget": "inductor", "torch_budget_aot": "aot_eager"}
"""``torch.compile`` back-end per strategy: inductor, as users run it (decompositions, fused
kernels), and ``aot_eager`` (aot_autograd with no-op compilers and the min-cut partitioner),
the same recomputation without kernel fusion or decompositions."""


def compiled(backend: str, budget: float) -> Rewrite:
    """A rewrite that compiles the module's ``forward`` with ``backend`` and partitions its
    joint graph under ``activation_memory_budget = budget`` (the knapsack of
    ``torch._functorch.partitioners``); the budget is in force at every call, so also when
    the first call compiles. Dynamo is reset first: one compiled module at a time, so no
    recompilation limit is reached and nothing falls back to eager unsaid."""

    def rewrite(module: nn.Module) -> None:
        torch._dynamo.reset()
        fn = torch.compile(module.forward, backend=backend, dynamic=False)

        def forward(*args, **kwargs):
            with torch._functorch.config.patch(activation_memory_budget=budget):
                return fn(*args, **kwargs)

        module.forward = forward

    return rewrite


def budget_levels(backend: str) -> Callable[[CapturedModel], list[tuple[str, Rewrite | None]]]:
    """``torch_budget``'s levels: the module compiled by ``backend`` at each of
    :data:`BUDGET_LEVELS`."""

    def make(captured: CapturedModel) -> list[tuple[str, Rewrite | None]]:
        return [
            (f"{backend}, activation_memory_budget {b:.1f}", compiled(backend, b))
            for b in BUDGET_LEVELS
        ]

    return make


def without_dropout(rewrite: Rewrite | None) -> Rewrite:
    """``rewrite`` after switching dropout off (``nn.Dropout``'s ``p`` and a float
    ``dropout`` attribute, as attention modules keep their ``dropout_p``): compiled code draws
    its own random numbers, so its gradients can be compared with a plain step's only where
    nothing is drawn."""

    def rewrite_off(module: nn.Module) -> None:
        for mod in module.modules():
            if isinstance(mod, nn.modules.dropout._DropoutNd):
                mod.p = 0.0
            elif isinstance(getattr(mod, "dropout", None), float):
                mod.dropout = 0.0
        if rewrite is not None:
            rewrite(module)

    return rewrite_off


def _own_check(
    captured: CapturedModel, device: str, rewrite: Rewrite, timed: ExecutionResult
) -> GradCheck:
    """The steps whose loss and gradients the row compares (per tensor: fused kernels add up
    in another order): the timed step and a plain one when the net draws no random numbers,
    else both with dropout off (:func:`without_dropout`)."""
    if not any(op.stochastic for op in captured.ops):
        plain = reference_step(captured, 1, 0, device=device, measure_memory=False)
        return GradCheck(timed, plain, "per tensor")
    off = without_dropout(rewrite)
    run = reference_step(captured, 1, 1, device=device, measure_memory=False, rewrite=off)
    plain = reference_step(
        captured, 1, 0, device=device, measure_memory=False, rewrite=without_dropout(None)
    )
    return GradCheck(run, plain, "per tensor, dropout off (compiled code draws its own numbers)")


def _run_translated(
    res: StrategyResult,
    captured: CapturedModel,
    inst: Instance,
    translate: Callable[[int], Schedule],
    start: TorchState,
    plain: PlainStep,
    n_steps: int,
    warmup: int,
) -> None:
    """The chosen level as a schedule of ours (``translate``): simulated, and run by our
    executor beside the same plain step; or why it has no translation."""
    what = res.pytorch.policy
    try:
        sched = translate(res.pytorch.level)
    except Untranslatable as exc:
        res.pytorch.untranslated = str(exc)
        log.info("%s: %s is not translated into a schedule of ours: %s", res.strategy, what, exc)
        return
    res.pytorch.sim, res.pytorch.schedule = simulate(inst, sched), sched
    start.restore()  # PyTorch's timed steps drew numbers: ours start where they did
    with start:
        res.pytorch.ours = execute(captured, inst, sched, n_steps, warmup, beside=plain)


# ------------------------------------------------------------------------------ measuring
_MEASURED: dict[tuple, tuple[int, float]] = {}
"""(strategy, net, input, device, level) -> (peak bytes, first step s), for the compiled
strategies, whose levels take seconds to minutes to compile: a sweep over budgets measures
each level once per process."""

_CHECKED: dict[tuple, GradCheck] = {}
"""The same key (the chosen level) -> its gradient check (:func:`_own_check`, which compiles
the level again with dropout off): once per process."""


def measured_peak_bytes(captured: CapturedModel, device: str, rewrite: Rewrite | None) -> int:
    """The activation peak of one step of the rewritten module (after one warm-up step), as
    the executor measures every row: the allocator's peak above the step's start."""
    return _measure(captured, device, rewrite)[0]


def _measure(captured: CapturedModel, device: str, rewrite: Rewrite | None) -> tuple[int, float]:
    """:func:`measured_peak_bytes` and the wall time of the first step (a compiled module
    compiles in it)."""
    with PlainStep(captured, device, rewrite=rewrite) as step:
        first_s = step.step()[0]
        if step.spec.is_cuda:
            return step.step()[1], first_s
        return step.cpu_peak()[0], first_s


def _first_fitting(
    levels: Sequence[tuple[str, Rewrite | None]],
    peak_of: Callable[[int], int],
    budget_bytes: int,
    bisect: bool,
) -> tuple[int | None, list[tuple[str, int]]]:
    """The first level (of least recomputation first) whose measured peak fits, and every
    level measured. ``bisect``: measure the first and the last, then halve, assuming that a
    later level never peaks higher (checkpointing one more block); else one level after the
    other (selective checkpointing's strides are not ordered by memory)."""
    tried: list[tuple[str, int]] = []
    peaks: dict[int, int] = {}

    def fits(i: int) -> bool:
        if i not in peaks:
            peaks[i] = peak_of(i)
            tried.append((levels[i][0], peaks[i]))
            log.info("%s: measured peak %s", levels[i][0], format_bytes(peaks[i]))
        return peaks[i] <= budget_bytes

    if not bisect:
        return next((i for i in range(len(levels)) if fits(i)), None), tried
    last = len(levels) - 1
    if fits(0):
        return 0, tried
    if not fits(last):
        return None, tried
    lo, hi = 0, last
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi, tried


def _run_policy(
    name: str,
    inst: Instance,
    captured: CapturedModel,
    make_levels: Callable[[CapturedModel], list[tuple[str, Rewrite | None]]],
    bisect: bool,
    n_steps: int,
    warmup: int,
    compiles: bool = False,
    translate: Callable[[int], Schedule] | None = None,
) -> StrategyResult:
    """Search the policy's levels for the first that fits ``inst``'s one budget, then time
    it. Every measured step starts from the state the strategy was called in (random
    generator and buffers), as a plain step does: a dropout draws the same numbers.
    ``compiles``: the levels are compiled modules; their measurements are kept for the
    process (:data:`_MEASURED`), the chosen level's first step is its compile time, and its
    gradients are checked here, once per level (:func:`_own_check`, :data:`_CHECKED`).
    ``translate``: the chosen level as a schedule of ours, which the simulator replays for
    the row's prediction (``PolicyRun.sim``) and our executor runs beside PyTorch's
    (``PolicyRun.ours``)."""
    if inst.n_devices != 1:
        raise ValueError(f"{name} runs on one device; this instance has {inst.n_devices}")
    device, budget = inst.devices[0], int(inst.budget_bytes[0])
    start = TorchState(captured.module.buffers(), rng=(parse_device(device).torch_device,))
    t0 = time.perf_counter()
    with start:
        levels = make_levels(captured)
    net_key = (name, captured.meta.get("graph_sha"), tuple(captured.example_input.shape), device)
    first_s: dict[int, float] = {}

    def peak_of(level: int) -> int:
        what, rewrite = levels[level]
        key = (*net_key, what)
        if compiles and key in _MEASURED:
            peak, first_s[level] = _MEASURED[key]
            return peak
        with start:
            peak, first_s[level] = _measure(captured, device, rewrite)
        if compiles:
            _MEASURED[key] = (peak, first_s[level])
        return peak

    chosen, tried = _first_fitting(levels, peak_of, budget, bisect)
    res = StrategyResult(
        name, inst.devices, inst.budget_bytes, "infeasible", solve_time_s=time.perf_counter() - t0
    )
    if chosen is None:
        what, peak = min(tried, key=lambda t: t[1])
        res.pytorch = PolicyRun("none fits", -1, tried)
        res.message = (
            f"no level fits the budget of {format_bytes(budget)}: the smallest measured peak "
            f"is {format_bytes(peak)} ({what})"
        )
        return res
    what, rewrite = levels[chosen]
    start.restore()
    # every timed step follows a plain one, as the pipeline times our schedules (its table's
    # "meas / plain"); each step starts from the start state, which the module is left in
    with start, PlainStep(captured, device) as plain:
        ex = reference_step(captured, n_steps, warmup, device=device, rewrite=rewrite, beside=plain)
        _check_budget(ex, device, budget)
        res.status = "feasible"
        res.pytorch = PolicyRun(what, chosen, tried, ex)
        res.message = what
        if translate is not None:
            _run_translated(res, captured, inst, translate, start, plain, n_steps, warmup)
    if compiles:
        res.pytorch.compile_time_s = first_s[chosen]
        key = (*net_key, what)
        if key not in _CHECKED:
            with start:
                _CHECKED[key] = _own_check(captured, device, rewrite, ex)
        res.pytorch.grad_check = _CHECKED[key]
    return res


def _check_budget(ex: ExecutionResult, device: str, budget_bytes: int) -> None:
    """The timed step's own measured peak against the budget (the search measured another
    step of the same level); over it is a violation, which makes the row wrong."""
    ex.budget_bytes = {device: budget_bytes}
    peak = ex.peak_bytes[device]
    if peak > budget_bytes:
        ex.violations.append(
            f"{device}: measured peak {peak} bytes is over the budget of {budget_bytes} bytes"
        )


# ------------------------------------------------------------------------------ strategies
def _blocks_or_raise(captured: CapturedModel, who: str) -> list[str]:
    blocks = find_blocks(captured.module)
    if not blocks:
        raise ValueError(
            f"{who}: {type(captured.module).__name__} has no blocks to checkpoint (no "
            "nn.Sequential or nn.ModuleList with two or more blocks in it)"
        )
    return blocks


def checkpoint_sets(captured: CapturedModel) -> list[list[str]]:
    """``torch_checkpoint``'s block sets, level k checkpointing the k blocks that save the
    most bytes (:func:`saved_bytes_by_block`), in the net's order; level 0 none."""
    blocks = _blocks_or_raise(captured, "torch_checkpoint")
    saved = saved_bytes_by_block(captured, blocks)
    order = sorted(blocks, key=lambda b: -saved[b])  # stable: ties keep the net's order
    return [sorted(order[:k], key=blocks.index) for k in range(len(order) + 1)]


def checkpoint_levels(captured: CapturedModel) -> list[tuple[str, Rewrite | None]]:
    """``torch_checkpoint``'s levels: no checkpoint, then ``torch.utils.checkpoint`` around
    each of :func:`checkpoint_sets`."""
    return _checkpoint_levels_of(checkpoint_sets(captured))


def _checkpoint_levels_of(sets: list[list[str]]) -> list[tuple[str, Rewrite | None]]:
    levels: list[tuple[str, Rewrite | None]] = [("no checkpoint", None)]
    for ck in sets[1:]:
        what = f"checkpoint {len(ck)} of {len(sets) - 1} blocks: {_names(ck)}"
        levels.append((what, checkpointed(ck)))
    return levels


def sac_levels(captured: CapturedModel) -> list[tuple[str, Rewrite | None]]:
    """``torch_sac``'s levels: no checkpoint, then selective checkpointing on every block
    (:func:`sac_context`) saving the outputs of every expensive op, one in 2, one in 3, ...,
    then none."""
    blocks = _blocks_or_raise(captured, "torch_sac")
    most = _most_saved_ops(captured, blocks)
    levels: list[tuple[str, Rewrite | None]] = [("no checkpoint", None)]
    for stride in range(1, most + 2):
        saving = (
            "every conv/matmul output"
            if stride == 1
            else f"one in {stride} conv/matmul outputs"
            if stride <= most
            else "no op output"
        )
        what = f"selective checkpoint of {len(blocks)} blocks, saving {saving}"
        levels.append((what, checkpointed(blocks, sac_context(stride))))
    return levels


def solve_torch_checkpoint(
    inst: Instance, captured: CapturedModel, n_steps: int = 5, warmup: int = 1
) -> StrategyResult:
    """``torch.utils.checkpoint`` around the fewest blocks whose measured peak fits, those
    saving the most bytes first (:func:`checkpoint_levels`); bisection over the number of
    blocks, from none (a plain step) to all of them."""

    sets: list[list[str]] = []  # the levels' block sets, for the translation

    def make_levels(cap: CapturedModel) -> list[tuple[str, Rewrite | None]]:
        sets.extend(checkpoint_sets(cap))
        return _checkpoint_levels_of(sets)

    def translate(level: int) -> Schedule:
        return checkpoint_schedule(captured, inst, sets[level])

    return _run_policy(
        "torch_checkpoint",
        inst,
        captured,
        make_levels,
        True,
        n_steps,
        warmup,
        translate=translate,
    )


def solve_torch_sac(
    inst: Instance, captured: CapturedModel, n_steps: int = 5, warmup: int = 1
) -> StrategyResult:
    """Selective checkpointing on every block (:func:`sac_levels`): the first level that
    fits, one level after the other from no checkpoint at all. Level k >= 1 saves every
    k-th saved op's output; translated into a schedule of ours where every node is on one
    side of the policy (:func:`baselines.translate.sac_schedule`)."""

    def translate(level: int) -> Schedule:
        if level == 0:
            return checkpoint_schedule(captured, inst, [])
        blocks = find_blocks(captured.module)
        return sac_schedule(captured, inst, blocks, node_ops(captured, saved_ops()), level)

    return _run_policy(
        "torch_sac", inst, captured, sac_levels, False, n_steps, warmup, translate=translate
    )


def solve_torch_budget(
    inst: Instance,
    captured: CapturedModel,
    n_steps: int = 5,
    warmup: int = 1,
    backend: str = "inductor",
) -> StrategyResult:
    """``torch.compile`` with ``activation_memory_budget`` (:func:`budget_levels`): the
    largest budget of :data:`BUDGET_LEVELS` whose measured peak fits, tried from 1.0 down."""
    name = next(n for n, b in COMPILERS.items() if b == backend)
    on_cpu = not parse_device(inst.devices[0]).is_cuda
    if backend == "inductor" and on_cpu and shutil.which("c++") is None:
        raise ValueError(
            f"{name}: inductor compiles C++ for the CPU and finds no C++ compiler (c++) on "
            "PATH; install one (Debian: g++), or run torch_budget_aot, which compiles nothing"
        )
    return _run_policy(
        name, inst, captured, budget_levels(backend), False, n_steps, warmup, compiles=True
    )


def solve_torch_budget_aot(
    inst: Instance, captured: CapturedModel, n_steps: int = 5, warmup: int = 1
) -> StrategyResult:
    """:func:`solve_torch_budget` compiled by ``aot_eager``: recomputation without fusion."""
    return solve_torch_budget(inst, captured, n_steps, warmup, "aot_eager")


def _names(paths: Sequence[str], most: int = 4) -> str:
    shown = ", ".join(paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")
