"""Run any valid schedule for one training step with torch, and measure it (docs/design.md,
section 8).

The executor performs exactly ``simulate(inst, sched).ops``, in order:

* ``compute v on d``: run node ``v`` with the tensors the executor provides on ``d`` (its
  *registers*, plus the transient copies made for this compute), store the result in ``d``'s
  register for ``v`` and drop the transient copies;
* ``copy u to d``: make a transient copy of ``u``'s register on ``d`` (a real clone between
  logical CPU devices, a transfer to or from CUDA);
* ``free u on d``: drop the value register;
* ``free_state v on d``: drop ``F_v``'s autograd state on ``d``.

Nothing else keeps tensors alive. A forward op runs on fresh leaves that alias its inputs'
storage (emptied once the op has run, so they keep nothing alive). Its result is split in two
registers, as the graph splits it (docs/design.md section 3): the *value* (the output, detached) and
the *state* (the gradient edge of the output, ``torch.autograd.graph.get_gradient_edge``, which
holds ``grad_fn`` but not the output's storage, plus the gradient edges of its inputs). What
autograd saves for an input or for the output is not a reference but a lookup, at backward
time, into the value registers of the device the backward runs on (``saved_tensors_hooks``).
Only tensors that belong to the op alone (pooling indices, batch-norm statistics, dropout
masks) are held by ``grad_fn`` and are freed with the state.

A backward node ``B_v`` calls ``torch.autograd.grad`` on ``F_v``'s output edge with the sum of
the gradient contributions of ``v``'s consumers, keeping ``F_v``'s graph (a backward node may
be recomputed). Parameter gradients are accumulated into preallocated ``.grad`` buffers on the
first computation of ``B_v`` in the step only. Recomputation is free of side effects: a
stochastic op replays the random state of its first run, and an op that updates module buffers
(batch-norm running statistics) has them restored after a recomputation.

Devices: ``cpu`` (all threads), ``cpu<k>`` (a logical CPU device running with ``k`` threads:
the paper's CPU sub-devices; they share the parameters), ``cuda`` / ``cuda:<i>`` (a copy of the
model per CUDA device). Memory peaks come from the allocator: the CUDA caching allocator's
statistics, and for CPU devices the allocation events of ``torch.profiler`` (one extra step),
attributed to the device whose instruction was running, frees to the device that allocated
the address.
"""

from __future__ import annotations

import copy
import linecache
import logging
import re
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._autograd import _pop_saved_tensors_default_hooks as _pop_saved_hooks
from torch._C._autograd import _push_saved_tensors_default_hooks as _push_saved_hooks
from torch.autograd.graph import GradientEdge

from xengine import progress
from xengine.execute.program import Group, Plan, backward_node, compile_plan
from xengine.graph.capture import (
    CapturedModel,
    OpSource,
    alias_leaf,
    fixed_storage_ptrs,
    gradient_key,
    storage_ptr,
)
from xengine.graph.types import CopyModel
from xengine.problem import Instance
from xengine.profile import paired
from xengine.schedule import Schedule
from xengine.simulate import Op, simulate
from xengine.torch_state import TorchState, rng_state, set_rng_state

log = logging.getLogger(__name__)

LABEL_PREFIX = "xe|"
# What the allocator may show above the simulator's model. Values, states and op workspaces
# (measured per device, with its thread count, in the profile) are in the graph, so what is
# left is noise of the measurement: the caching allocator's rounding on CUDA, the random-state
# snapshots the executor keeps for dropout (5 KiB each on the CPU), buffer snapshots around
# recomputations. Stated per device as
# max(TOLERANCE_MIN_BYTES, TOLERANCE_FRACTION * min(budget, predicted peak)).
TOLERANCE_FRACTION = 0.01
TOLERANCE_MIN_BYTES = 2**20


# ---------------------------------------------------------------------- devices
@dataclass(frozen=True)
class DeviceSpec:
    name: str
    torch_device: torch.device
    threads: int | None  # CPU devices: intra-op threads while this device runs

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"


_CPU_RE = re.compile(r"^cpu(\d+)?$")
_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


def parse_device(name: str, default_threads: int | None = None) -> DeviceSpec:
    """``cpu``, ``cpu<k>`` (k threads), ``cuda`` or ``cuda:<i>``; anything else is an error."""
    m = _CPU_RE.match(name)
    if m:
        k = int(m.group(1)) if m.group(1) else (default_threads or torch.get_num_threads())
        if k < 1:
            raise ValueError(f"device {name!r}: a CPU device needs at least one thread")
        return DeviceSpec(name, torch.device("cpu"), k)
    m = _CUDA_RE.match(name)
    if m:
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} is named but torch sees no CUDA device on this machine; "
                "use a machine with a GPU or a device mix without CUDA"
            )
        idx = int(m.group(1) or 0)
        if idx >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) present"
            )
        return DeviceSpec(name, torch.device("cuda", idx), None)
    raise ValueError(f"unknown device {name!r}: use 'cpu', 'cpu<threads>', 'cuda' or 'cuda:<i>'")


def available_devices() -> tuple[str, ...]:
    """Every device torch sees: ``cpu``, and ``cuda`` when a CUDA device is present (what
    ``devices=auto`` runs on)."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _sync(devs: Sequence[DeviceSpec]) -> None:
    for d in devs:
        if d.is_cuda:
            torch.cuda.synchronize(d.torch_device)


# ---------------------------------------------------------------------- saved tensors
class _Saved:
    """What autograd keeps for one saved tensor: the tensor itself (a parameter, or an extra
    that belongs to the op and is dropped with its state) or, for an input or the output,
    where to find it at backward time (``node``'s register on ``device``).

    While a fused backward group runs, each unpack is reported to the runtime: the last
    unpack of a value the schedule frees inside the group frees its register, and an extra
    whose state is freed there is dropped once read (:meth:`_Runtime.run_group`)."""

    __slots__ = ("tensor", "rt", "device", "node", "size", "stride", "delta", "owner", "whole")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = t
        self.rt = None
        self.node = -1
        self.owner = -1

    def to_lookup(self, rt: _Runtime, device: str, node: int, base: torch.Tensor) -> None:
        t = self.tensor
        assert t is not None
        self.size, self.stride = tuple(t.size()), tuple(t.stride())
        self.delta = t.storage_offset() - base.storage_offset()
        # the register itself (most saved inputs and outputs): read back without a view
        self.whole = self.delta == 0 and t.size() == base.size() and t.stride() == base.stride()
        self.rt, self.device, self.node = weakref.ref(rt), device, node
        self.tensor = None

    def to_extra(self, rt: _Runtime, owner: int) -> None:
        self.rt, self.owner = weakref.ref(rt), owner

    def get(self) -> torch.Tensor:
        rt = self.rt() if self.rt is not None else None
        t = self.tensor
        if self.node < 0:  # the tensor itself
            if t is None:
                raise RuntimeError("executor: an autograd state was read after it was freed")
            if rt is not None and rt.watch is not None:
                rt.watch.extra_read(self)
            return t
        if rt is None:
            raise RuntimeError("the executor that ran this op is gone")
        base = rt.fwd_tensor(self.device, self.node)
        out = base.detach()
        if not self.whole:
            out = out.as_strided(self.size, self.stride, base.storage_offset() + self.delta)
        if rt.watch is not None:
            rt.watch.value_read(self.node)
        return out


def _pack_into(handles: list[_Saved]):
    def pack(t: torch.Tensor) -> _Saved:
        h = _Saved(t)
        handles.append(h)
        return h

    return pack


def _unpack(h: _Saved) -> torch.Tensor:
    return h.get()


# a saved tensor of an op's autograd graph: the path to its node from the output's grad_fn
# (indices into ``next_functions``) and the attribute that holds it
Slot = tuple[tuple[int, ...], str]


def _saved_slots(root: Any, stop: list[Any], fixed: set[int]) -> list[Slot] | None:
    """The saved tensors of the autograd nodes an op made (those reachable from its output's
    ``grad_fn`` before ``stop``, its inputs' nodes) that are not parameters or buffers
    (``fixed``): where a later run of the op may hook them one by one (:func:`_hook_slots`)
    instead of running under default saved-tensor hooks, which call Python for every saved
    tensor, parameters included (2-3 us each: most of what a looked-up forward paid over a
    plain one). ``None`` where a node keeps what this cannot see (a saved list)."""
    slots: list[Slot] = []
    todo: list[tuple[Any, tuple[int, ...]]] = [(root, ())]
    # the nodes themselves stay referenced here while ids are compared
    kept = {id(n): n for n in stop}
    stopped = set(kept)
    while todo:
        node, path = todo.pop()
        if node is None or id(node) in stopped:
            continue
        kept[id(node)] = node
        stopped.add(id(node))
        for name in _saved_names(node):
            value = getattr(node, "_saved_" + name)
            if isinstance(value, (list, tuple)):
                return None
            if isinstance(value, torch.Tensor) and storage_ptr(value) not in fixed:
                if storage_ptr(value) != 0:
                    slots.append((path, "_raw_saved_" + name))
        for k, (nxt, _) in enumerate(node.next_functions):
            todo.append((nxt, (*path, k)))
    return slots


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node: Any) -> tuple[str, ...]:
    """The names of a node type's saved tensors (``_raw_saved_<name>``), read once per type."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        prefix = "_raw_saved_"
        names = tuple(a[len(prefix) :] for a in dir(node) if a.startswith(prefix))
        _SAVED_NAMES[type(node)] = names
    return names


def _hook_slots(root: Any, slots: list[Slot], pack: Callable[[torch.Tensor], _Saved]) -> None:
    """Hook the saved tensors at ``slots`` (:func:`_saved_slots`) after the op has run: each
    is packed at once, and autograd lets go of the tensor (``SavedTensor.register_hooks``)."""
    for path, attr in slots:
        node = root
        for k in path:
            node = node.next_functions[k][0]
        getattr(node, attr).register_hooks(pack, _unpack)


class _Tap(torch.autograd.Function):
    """Where a forward op reads an input whose gradient becomes a register: a fresh tensor on
    the input's storage (emptied after the op, so it keeps nothing alive) whose backward puts
    the gradient in ``box`` and passes nothing on. A backward node run alone captures the
    gradient at the tap's edge instead (``torch.autograd.grad`` does not run the tap). The
    ``anchor`` (a scalar that requires grad) makes the tap part of the graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.size(), x.stride())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.box.append(g)
        return None, None, None


_NO_ENTRIES: Any = MappingProxyType({})


def _graft(state: _State, fresh: _State, name: str) -> None:
    """Move the saved tensors of its own that a recomputation made (``fresh``) into the
    retired ``state`` of the same op, in the order autograd saved them (the same op on the
    same inputs saves the same tensors in the same order, as ``torch.utils.checkpoint``
    relies on)."""
    if len(fresh.extras) != len(state.extras):
        raise RuntimeError(
            f"executor: recomputing {name} saved {len(fresh.extras)} tensors of its own, "
            f"its first computation {len(state.extras)}"
        )
    for old, new in zip(state.extras, fresh.extras, strict=True):
        old.tensor, new.tensor = new.tensor, None


class _State:
    """A forward op's autograd state: the gradient edge of its output (``None`` when the output
    needs no gradient), those of its tapped inputs (the taps are emptied), and the saved
    tensors its ``grad_fn`` reads: lookups into registers and extras it alone holds."""

    __slots__ = ("out_edge", "edges", "boxes", "lookups", "extras")

    def __init__(self, out_edge: Any) -> None:
        self.out_edge = out_edge
        self.edges: dict[int, Any] = {}  # input -> the edge of its tap
        self.boxes: dict[int, list] = {}  # input -> where its tap puts the gradient
        self.lookups: list[_Saved] = []
        self.extras: list[_Saved] = []

    @classmethod
    def native(cls, out_edge: Any) -> _State:
        """The state of a native forward compute (``program.Plan.native``): autograd keeps its
        saved tensors and it has no taps, so its containers stay empty and are shared (making
        four per node was a measurable part of a small op's step, issue 28)."""
        state = cls.__new__(cls)
        state.out_edge = out_edge
        state.edges = state.boxes = _NO_ENTRIES
        state.lookups = state.extras = ()
        return state

    def drop(self) -> None:
        """Free what only this state holds (its ``grad_fn`` may outlive it: a consumer's
        ``grad_fn`` links to it when the two are fused)."""
        for h in self.extras:
            h.tensor = None


# ---------------------------------------------------------------------- the runtime
class _Runtime:
    """Registers, per-device models and the per-node runners. The executor drives it with a
    simulator op list; the profiler times its ``compute`` and ``copy_tensor`` directly."""

    def __init__(self, cap: CapturedModel, devices: Sequence[str]) -> None:
        self.cap = cap
        self.train = cap.mode == "train"
        self.all_threads = torch.get_num_threads()
        self.specs = {d: parse_device(d, self.all_threads) for d in devices}
        cuda_devs = [s.torch_device for s in self.specs.values() if s.is_cuda]
        if len(set(cuda_devs)) != len(cuda_devs):
            raise ValueError(f"devices {list(devices)} name the same CUDA device twice")
        self.devices = tuple(devices)
        self.g = cap.graph
        self.nf = cap.n_forward
        self.ops = cap.ops
        # models: CPU devices share the captured module; one copy per CUDA device
        self.roots: dict[str, nn.Module] = {}
        self.x: dict[str, torch.Tensor] = {}
        self.target: dict[str, torch.Tensor] = {}
        copies: dict[torch.device, nn.Module] = {}
        for name, s in self.specs.items():
            if s.is_cuda:
                if s.torch_device not in copies:
                    copies[s.torch_device] = copy.deepcopy(cap.gm).to(s.torch_device)
                self.roots[name] = copies[s.torch_device]
                self.x[name] = cap.example_input.to(s.torch_device)
                self.target[name] = cap.target.to(s.torch_device)
            else:
                self.roots[name] = cap.gm
                self.x[name] = cap.example_input
                self.target[name] = cap.target
        self.params = {d: dict(r.named_parameters()) for d, r in self.roots.items()}
        self.fixed_ptrs = {
            d: fixed_storage_ptrs(r, self.x[d], self.target[d]) for d, r in self.roots.items()
        }
        self.run_fns = {d: [spec.bind(self.roots[d]) for spec in self.ops] for d in self.devices}
        consumers: dict[int, list[int]] = {i: [] for i in range(self.nf)}
        for s in self.ops:
            for u in s.grad_inputs:
                consumers[u].append(s.index)
        self.grad_consumers = consumers
        self.grad_consumers_desc = {v: sorted(ws, reverse=True) for v, ws in consumers.items()}
        self.grad_sets = [frozenset(s.grad_inputs) for s in self.ops]
        self._single_runs: dict[tuple[int, str], NativeRun] = {}  # compute_native's runs
        # forward ops whose saved tensors are hooked one by one after they run (_note_hooked)
        self.saved_slots: dict[int, list[Slot]] = {}
        self.slot_counts: dict[int, int] = {}  # lookups of a hooked run, to check the slots
        self.slots_noted: set[int] = set()
        # what makes every tap part of the graph (one per device; it never gets a gradient)
        self.anchors = {
            d: torch.zeros((), device=s.torch_device, requires_grad=True)
            for d, s in self.specs.items()
        }
        self._roots_unique = list({id(r): r for r in self.roots.values()}.values())
        if self.train:
            for r in [cap.module, *self._roots_unique]:
                for p in r.parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
        unique = {id(p): p for r in [cap.module, *self._roots_unique] for p in r.parameters()}
        self.grad_buffers = [p.grad for p in unique.values() if p.grad is not None]
        # the nodes a schedule computes again (None: any may be): only a stochastic one of
        # them keeps its first run's random state, the 5 KiB a replay needs (a plain step
        # keeps none, and keep-everything measures as one)
        self.replayed: set[int] | None = None
        # per computation of the loss in a step, in op order: whether it lets go of the logits
        # before its gradient, as a plain step does once log-softmax has run; the simulator
        # decides (``Simulation.loss_releases``) and charges what it decides
        self.loss_releases: tuple[bool, ...] = ()
        self.reset()

    # ---------------------------------------------------------------- step state
    def reset(self) -> None:
        n = self.g.size
        self.reg: dict[str, list[Any]] = {d: [None] * n for d in self.devices}
        self.state: dict[str, list[_State | None]] = {d: [None] * n for d in self.devices}
        # retired states (program._walk_ops): their grad_fn without saved tensors, until a
        # recomputation refills them
        self.retained: dict[str, dict[int, _State]] = {d: {} for d in self.devices}
        self.transient: dict[str, dict[int, Any]] = {d: {} for d in self.devices}
        self.first_done: set[int] = set()
        self.rng_states: dict[int, torch.Tensor] = {}
        self.first_fwd_device: dict[int, str] = {}
        self.loss_value: torch.Tensor | None = None
        self.released: set[tuple[int, str]] = set()  # (logits, device) the loss let go of
        self.loss_calls = 0  # computations of the loss so far in this step
        self.watch: _Watch | None = None
        # the profiler's clock: called with a backward node when autograd starts running it
        # inside a fused group (the group's first node: when the pass starts)
        self.clock: Any = None

    def zero_grads(self) -> None:
        for g in self.grad_buffers:
            g.zero_()

    def live_count(self) -> int:
        regs = [*self.reg.values(), *self.state.values()]
        retained = sum(len(r) for r in self.retained.values())
        return retained + sum(1 for r in regs for x in r if x is not None)

    # ---------------------------------------------------------------- lookups
    def provided(self, d: str, u: int) -> Any:
        val = self.reg[d][u]
        if val is None:
            val = self.transient[d].get(u)
        if val is None:
            raise RuntimeError(
                f"executor: node {u} ({self.g.nodes[u].name}) is not on {d} when it is needed"
            )
        return val

    def fwd_tensor(self, d: str, u: int) -> torch.Tensor:
        return self.provided(d, u)

    def _set_threads(self, d: str) -> None:
        k = self.specs[d].threads
        if k is not None and torch.get_num_threads() != k:
            torch.set_num_threads(k)

    # ---------------------------------------------------------------- instructions
    def copy_tensor(self, t: torch.Tensor, d: str) -> torch.Tensor:
        """A copy of ``t`` on device ``d`` (a real clone between logical CPU devices)."""
        dev = self.specs[d].torch_device
        t = t.detach()
        if t.device == dev:
            return t.clone()
        return t.to(dev)

    def copy(self, u: int, src: str, dst: str) -> None:
        self._set_threads(dst)
        val = self.reg[src][u]
        if val is None:
            raise RuntimeError(f"executor: copy of node {u} from {src}, which does not hold it")
        if isinstance(val, dict):  # a tensor held under two keys is copied once
            memo: dict[int, torch.Tensor] = {}
            out = {}
            for k, t in val.items():
                if id(t) not in memo:
                    memo[id(t)] = self.copy_tensor(t, dst)
                out[k] = memo[id(t)]
        else:
            out: Any = self.copy_tensor(val, dst)
        self.transient[dst][u] = out

    def free(self, u: int, d: str) -> None:
        reg = self.reg[d]
        if reg[u] is None and (u, d) in self.released:
            self.released.discard((u, d))  # the loss let go of the logits already
            return
        if reg[u] is None:
            raise RuntimeError(f"executor: free of node {u} on {d}, which does not hold it")
        reg[u] = None

    def free_state(self, v: int, d: str) -> _State:
        """Drop ``v``'s state on ``d`` and free what only it holds; returns it."""
        st = self.state[d]
        state = st[v]
        if state is None:
            raise RuntimeError(f"executor: free of the state of node {v} on {d}, which has none")
        state.drop()
        st[v] = None
        return state

    def retire_state(self, v: int, d: str) -> None:
        """Free what ``v``'s state on ``d`` holds but keep its ``grad_fn`` for a later
        :meth:`refill` (``program._walk_ops``): the simulator's ``free_state``, memory-wise."""
        self.retained[d][v] = self.free_state(v, d)

    def refill(self, v: int, d: str) -> None:
        """Compute ``v`` again on ``d`` into its register and refill the saved tensors of its
        retired state, which becomes its state again, as ``torch.utils.checkpoint``
        recomputes: the backward node runs on the first computation's ``grad_fn``, linked to
        its consumers' since the forward pass, and joins their pass. An op that
        saves nothing of its own (only inputs or its output, looked up in the registers) is
        run for its value alone, under ``no_grad``, as a plain forward runs it."""
        self._set_threads(d)
        state = self.retained[d].pop(v, None)
        if state is None:
            raise RuntimeError(f"executor: refill of node {v} on {d}, which has no retired state")
        if state.extras:
            with torch.enable_grad():  # inside a backward pass autograd turned it off
                y, fresh = self._forward(v, d, False, refill=True)
            assert fresh is not None
            _graft(state, fresh, self.ops[v].name)
            y = y.detach()
        else:
            y = self._value(v, d)
        self.state[d][v] = state
        self.reg[d][v] = y
        self.first_done.add(v)
        if self.transient[d]:
            self.transient[d].clear()

    def _value(self, v: int, d: str) -> torch.Tensor:
        """``v``'s output, recomputed with no autograd graph: the random state of its first
        run replayed and the buffers it updates put back, like any recomputation."""
        spec = self.ops[v]
        dev = self.specs[d].torch_device
        ins = [self.fwd_tensor(d, u) for u in spec.inputs]
        kept = None
        if spec.stochastic or spec.mutates_buffers:
            buffers = self.roots[d].get_submodule(spec.module_path).buffers()
            kept = TorchState(
                buffers if spec.mutates_buffers else (), rng=(dev,) if spec.stochastic else ()
            )
        if spec.stochastic:
            set_rng_state(dev, self.rng_states[v])
        try:
            with torch.no_grad():
                y = self.run_fns[d][v](ins, self.x[d])
        finally:
            if kept is not None:
                kept.restore()
        p = storage_ptr(y)
        if p in self.fixed_ptrs[d] or any(p == storage_ptr(t) for t in ins):
            y = y.clone()
        return y

    def compute(
        self,
        v: int,
        d: str,
        first: bool | None = None,
        connect: frozenset[int] = frozenset(),
        native: bool = False,
    ) -> None:
        """Run node ``v`` on device ``d`` and keep its result in ``d``'s register.

        ``first`` (default: whether ``v`` already ran in this step) selects the first-run path
        (parameter gradients, random state saved) or the side-effect-free recomputation.
        ``connect``: inputs of a forward node read as the registers themselves, so that its
        ``grad_fn`` links to theirs (their backward runs fused with this one's); ``native``:
        autograd keeps what it saves itself (``program.Plan.native``)."""
        if first is None:
            first = v not in self.first_done
        self._set_threads(d)
        kind = self.g.nodes[v].kind
        if kind == "fwd":
            val, state = self._forward(v, d, first, connect, native)
            if state is not None and self.g.state_reader[v] >= 0:
                self.state[d][v] = state
        elif kind == "loss":
            val = self._loss(d, first)
        else:
            val = self._backward(v, d, first)
        self.reg[d][v] = val
        self.first_done.add(v)
        if self.transient[d]:
            self.transient[d].clear()

    def plain_forward(self, v: int, first: bool, connect: frozenset[int], native: bool) -> bool:
        """Whether a forward compute can take :meth:`compute_native`: native (autograd keeps
        what it saves), every input that gets a gradient read as the register itself, and no
        random state to save or replay (a first run the schedule never repeats)."""
        if not (self.train and native and first) or self.g.nodes[v].kind != "fwd":
            return False
        spec = self.ops[v]
        if not set(spec.grad_inputs) <= connect:
            return False
        return not spec.stochastic or (self.replayed is not None and v not in self.replayed)

    def compute_native(self, v: int, d: str) -> None:
        """A forward compute as a plain step runs it (:meth:`plain_forward` says when): the op
        on the registers themselves, no hooks, no taps, no leaves. Same result, state and
        registers as :meth:`compute`; the keep-everything step is all of these, and their
        Python was a third of a small op's time (issue 28). It is a :class:`NativeRun` of one
        op (made at its first call), so that one loop says what a native compute does."""
        run = self._single_runs.get((v, d))
        if run is None:
            run = self._single_runs[(v, d)] = NativeRun(d, [native_step(self, v)], self)
        self.run_native(run)

    def run_native(self, run: NativeRun) -> None:
        """A run of native forward computes and frees on one device, as :meth:`compute_native`
        and :meth:`free` do them one by one. Its first call runs :meth:`_native_loop`, which
        decides per op whether its output shares its inputs' storage (the replayed step gives
        every op the same layouts); later calls run the straight-line function
        :func:`compile_native` makes from it: the Python around each small op, not the op, was
        most of what keep-everything paid above a plain step (issue 28)."""
        d = run.device
        self._set_threads(d)
        if run.compiled is None:
            self._native_loop(run)
            run.compiled = compile_native(self, run)
        else:
            run.compiled(self.reg[d], self.state[d], self.x[d], self.transient[d])
        self.first_done.update(run.computed)
        for v in run.marked:
            self.first_fwd_device[v] = d

    def _native_loop(self, run: NativeRun) -> None:
        d = run.device
        reg, states, fns, x = self.reg[d], self.state[d], self.run_fns[d], self.x[d]
        transient, fixed, clones = self.transient[d], self.fixed_ptrs[d], run.clones
        for k, (v, what, inputs) in enumerate(run.steps):
            if what is _FREE:
                if reg[v] is None:
                    self.free(v, d)  # the general path: its errors, the released logits
                else:
                    reg[v] = None
                continue
            ins = [reg[u] if reg[u] is not None else self.provided(d, u) for u in inputs]
            y = fns[v](ins, x)
            clone = clones[k]
            if clone is None:
                clone = clones[k] = _shares_storage(y, ins, fixed)
            if clone:
                y = y.clone()
            if what is _KEEPS_STATE:
                edge = GradientEdge(y.grad_fn, y.output_nr) if y.requires_grad else None
                states[v] = _State.native(edge)
            reg[v] = y
            ins = y = None  # a free that follows must free, as after compute_native
            if transient:
                transient.clear()

    # ---------------------------------------------------------------- node runners
    def _forward(
        self,
        v: int,
        d: str,
        first: bool,
        connect: frozenset[int] = frozenset(),
        native: bool = False,
        refill: bool = False,
    ) -> tuple[torch.Tensor, _State | None]:
        """Run forward node ``v`` and make its autograd state. ``refill``: for the saved
        tensors of its own alone (:meth:`refill` moves them into the retired state and drops
        the rest), so an input that gets a gradient is a plain leaf, not a tap (a Python
        autograd function, 60-70 us a call)."""
        spec = self.ops[v]
        dev = self.specs[d].torch_device
        ins = [self.fwd_tensor(d, u) for u in spec.inputs]
        run = self.run_fns[d][v]
        if not self.train:
            with torch.no_grad():
                y = run(ins, self.x[d])
                if any(storage_ptr(y) == storage_ptr(t) for t in ins) or (
                    storage_ptr(y) in self.fixed_ptrs[d]
                ):
                    y = y.clone()
            if v == self.nf - 1 and first:
                self.loss_value = _infer_loss(y, self.target[d])
            return y, None
        grad_set = self.grad_sets[v]
        anchor = self.anchors[d]
        boxes: dict[int, list] = {}
        leaves = []
        for t, u in zip(ins, spec.inputs, strict=True):
            if u in connect:
                leaves.append(t)
            elif refill:
                leaves.append(alias_leaf(t, u in grad_set))
            elif u in grad_set:
                boxes[u] = []
                leaves.append(_Tap.apply(t.detach(), anchor, boxes[u]))
            else:
                leaves.append(alias_leaf(t, False))
        handles: list[_Saved] = []
        # a recomputation leaves no trace: the random state it replays and the buffers it
        # updates are put back after it
        kept = None
        if not first and (spec.stochastic or spec.mutates_buffers):
            kept = TorchState(
                self.roots[d].get_submodule(spec.module_path).buffers()
                if spec.mutates_buffers
                else (),
                rng=(dev,) if spec.stochastic else (),
            )
        if spec.stochastic:
            if first:
                if self.replayed is None or v in self.replayed:
                    self.rng_states[v] = rng_state(dev)
                self.first_fwd_device[v] = d
            else:
                set_rng_state(dev, self.rng_states[v])
        if first and spec.mutates_buffers:
            self.first_fwd_device[v] = d
        grad_mode = nullcontext() if torch.is_grad_enabled() else torch.enable_grad()
        in_ptrs = [t.untyped_storage().data_ptr() for t in ins]
        fixed = self.fixed_ptrs[d]
        slots = None if native else self.saved_slots.get(v)
        probe = not native and slots is None and v in self.slot_counts
        try:
            with grad_mode:
                if native or slots is not None or probe:
                    y = run(leaves, self.x[d])
                else:
                    # what torch.autograd.graph.saved_tensors_hooks does, without its Python
                    _push_saved_hooks(_pack_into(handles), _unpack)
                    try:
                        y = run(leaves, self.x[d])
                    finally:
                        _pop_saved_hooks()
                out_ptr = y.untyped_storage().data_ptr()
                if out_ptr in in_ptrs or out_ptr in fixed:
                    y = y.clone()
                    out_ptr = y.untyped_storage().data_ptr()
        finally:
            if kept is not None:
                kept.restore()
        if probe:
            stop = [t.grad_fn for t in leaves if t.grad_fn is not None]
            slots = _saved_slots(y.grad_fn, stop, fixed)
            if slots is None or len(slots) != self.slot_counts.pop(v):
                self.slots_noted.add(v)  # the hooks saw tensors the slots do not show
                return self._forward(v, d, first, connect, native)
            self.saved_slots[v] = slots
        if slots is not None:
            _hook_slots(y.grad_fn, slots, _pack_into(handles))
        # saved tensors that alias an input or the output become lookups
        state = _State(GradientEdge(y.grad_fn, y.output_nr) if y.requires_grad else None)
        for h in handles:
            t = h.tensor
            p = t.untyped_storage().data_ptr()
            if p == 0 or p in fixed:
                continue
            if p in in_ptrs:
                k = in_ptrs.index(p)
                h.to_lookup(self, d, spec.inputs[k], ins[k])
                state.lookups.append(h)
            elif p == out_ptr:
                h.to_lookup(self, d, v, y)
                state.lookups.append(h)
            else:  # an extra that belongs to this op; freed with its state
                h.to_extra(self, v)
                state.extras.append(h)
        # a native op's saved inputs are its taps themselves: they live with its grad_fn
        empty = (
            []
            if native
            else [t for t, u in zip(leaves, spec.inputs, strict=True) if u not in connect]
        )
        for leaf, u in zip(leaves, spec.inputs, strict=True):
            if u in boxes:
                state.edges[u] = GradientEdge(leaf.grad_fn, 0)
        state.boxes = boxes
        if not native and slots is None and v not in self.slots_noted:
            self._note_hooked(v, spec, state)
        if empty:
            with torch.no_grad():
                for leaf in empty:
                    leaf.set_()
        # the register keeps ``y`` with its grad_fn: a fused consumer links to it; what
        # grad_fn holds beyond links is in ``state`` (lookups and extras)
        return y, state

    def _note_hooked(self, v: int, spec: Any, state: _State) -> None:
        """After ``v``'s first hooked forward: whether its next may hook its saved tensors one
        by one instead (:func:`_saved_slots`). Only for an op that saves nothing of its own
        (every saved tensor a parameter, an input or its output: a recomputation of it is its
        value alone, :meth:`refill`) and has no random state or buffers to put back; the next
        run checks that the slots it finds are as many as the lookups the hooks made here."""
        self.slots_noted.add(v)
        if not (state.extras or spec.stochastic or spec.mutates_buffers):
            self.slot_counts[v] = len(state.lookups)

    def _loss(self, d: str, first: bool) -> torch.Tensor:
        """The loss and its gradient with respect to the logits (the loss node's value).

        Where :attr:`loss_releases` says so for this computation, the logits are let go of
        between the loss and its backward: what the loss function saved (log-softmax's result;
        the logits themselves for a mean-squared error) stays with its ``grad_fn``, the rest is
        freed, as in a plain step. The workspace measured on this path is what the simulator
        charges, plus the logits where they stay."""
        u = self.nf - 1
        logits = self.fwd_tensor(d, u)
        k, self.loss_calls = self.loss_calls, self.loss_calls + 1
        release = k < len(self.loss_releases) and self.loss_releases[k]
        with torch.enable_grad():
            if not release:
                leaf = logits.detach().requires_grad_(True)
                loss = self.cap.loss(leaf, self.target[d])
                (g,) = torch.autograd.grad(loss, leaf)
            else:
                tap = _Tap.apply(logits.detach(), self.anchors[d], [])
                loss = self.cap.loss(tap, self.target[d])
                edge = GradientEdge(tap.grad_fn, 0)
                del tap, logits
                if self.reg[d][u] is not None:
                    self.reg[d][u] = None
                    self.released.add((u, d))
                self.transient[d].pop(u, None)
                (g,) = torch.autograd.grad(loss, edge)
        if first:
            self.loss_value = loss.detach()
        return g

    def _state_for(self, b: int, d: str) -> tuple[int, _State]:
        v = self.g.nodes[b].fwd_index
        assert v is not None
        state = self.state[d][v]
        if state is None:
            raise RuntimeError(
                f"executor: {self.g.nodes[b].name} on {d} needs the autograd state of "
                f"{self.ops[v].name}, which is not resident on {d}"
            )
        return v, state

    def _contributions(self, v: int, d: str, skip: frozenset[int] = frozenset()) -> list:
        """The gradient contributions to ``v``'s output held in registers (``skip``: consumers
        whose contribution flows inside autograd), in reverse forward order: the order in which
        autograd's engine receives and sums them in a plain backward pass, so that sums of 3+
        terms agree bit for bit."""
        contrib: list[torch.Tensor] = []
        for w in self.grad_consumers_desc[v]:
            if w not in skip:
                contrib.append(self.provided(d, backward_node(self.nf, w))[v])
        if v == self.nf - 1:
            contrib.append(self.provided(d, self.nf))
        return contrib

    @staticmethod
    def _summed(contrib: list[torch.Tensor]) -> torch.Tensor:
        grad_out = contrib[0]
        if len(contrib) > 1:
            grad_out = contrib[0] + contrib[1]
            for c in contrib[2:]:
                grad_out.add_(c)
        return grad_out

    def _backward(self, b: int, d: str, first: bool) -> dict[int, torch.Tensor]:
        v, state = self._state_for(b, d)
        spec = self.ops[v]
        if not spec.requires_grad or state.out_edge is None:
            return {}
        contrib = self._contributions(v, d)
        if not contrib:
            raise RuntimeError(f"executor: no gradient reaches {spec.name}")
        grad_out = self._summed(contrib)
        inputs = [state.edges[u] for u in spec.grad_inputs]
        params = [self.params[d][n] for n in spec.param_names] if first else []
        if not inputs and not params:
            return {}
        grads = torch.autograd.grad(
            [state.out_edge], inputs + params, [grad_out], retain_graph=True, allow_unused=True
        )
        k = len(inputs)
        with torch.no_grad():
            for p, gp in zip(params, grads[k:], strict=True):
                if gp is not None:
                    p.grad.add_(gp)
        out: dict[int, torch.Tensor] = {}
        seen = {storage_ptr(c) for c in contrib}
        self._store_gradients(spec, spec.grad_inputs, grads[:k], d, seen, out)
        return out

    def _store_gradients(self, spec, us, grads, d: str, seen: set[int], out: dict) -> None:
        """Put the gradients ``B_v`` hands to ``us`` into ``out``: a missing one as zeros, one
        gradient handed to several inputs once (as autograd stores it, as the graph counts
        it), and a copy where it would share storage with another node's (every node owns
        its output)."""
        same: dict[tuple, torch.Tensor] = {}
        for u, gu in zip(us, grads, strict=True):
            if gu is None:
                spec_u = self.ops[u]
                gu = torch.zeros(
                    spec_u.output_shape,
                    dtype=getattr(torch, spec_u.output_dtype),
                    device=self.specs[d].torch_device,
                )
            else:
                key = gradient_key(gu)
                if key in same:
                    out[u] = same[key]
                    continue
                if storage_ptr(gu) in seen:
                    gu = gu.clone()
                same[key] = gu
            seen.add(storage_ptr(gu))
            out[u] = gu

    # ---------------------------------------------------------------- fused backward
    def run_group(self, grp: GroupProgram) -> None:
        """Run a group of backward computes (``program.Group``) as one ``backward()`` pass.

        The first compute is the root, with the gradient its registers hold; gradients along
        internal edges pass inside autograd, parameter gradients accumulate into ``.grad`` as
        in a plain step, and the others reach taps and become the registers the schedule
        expects. The frees the schedule places after a compute happen when autograd has run
        it (a hook on its ``grad_fn``): a value read inside the pass at its last unpack, an
        extra of a state freed in the group when it is read; what autograd did not reach is
        freed after the pass."""
        d = grp.device
        self._set_threads(d)
        held, retained = self.state[d], self.retained[d]
        # a state refilled inside the pass is retired when it starts: its grad_fn is there
        states = [
            held[c.fwd] or retained.get(c.fwd) or self._state_for(c.node, d)[1]
            for c in grp.computes
        ]
        # only the root reads registers (the others' gradients all flow inside the pass:
        # checked once, by _group_program)
        head = grp.computes[0]
        contrib = self._contributions(head.fwd, d, head.internal)
        if not contrib:
            raise RuntimeError(f"executor: no gradient reaches {self.ops[head.fwd].name}")
        root_grad = self._summed(contrib)
        seen = {storage_ptr(t) for t in contrib}
        del contrib  # the registers are freed before the pass (autograd holds the root's)
        self.first_done.update(c.node for c in grp.computes)
        root = states[0].out_edge
        # autograd's root node would hold the root gradient for the whole pass: it gets a
        # stand-in, and a pre-hook hands the real one over when the first node runs
        feed = [root_grad]

        def hand_over(grad_outputs):
            out = list(grad_outputs)
            out[root.output_nr] = feed.pop()
            return tuple(out)

        stand_in = root_grad.new_zeros(()).expand(root_grad.shape)
        del root_grad
        _do(self, grp.start)
        watch = _Watch(self, grp, states)
        hooks = [root.node.register_prehook(hand_over)]
        # what the schedule does after member k-1 (frees) and before member k (refills, frees)
        # runs when autograd reaches member k: by then it has run every node of k-1 (made
        # later, so run first), also where k-1 is several autograd nodes (a module) and a hook
        # on its first node would run in the middle of its backward
        hooks += [
            states[k].out_edge.node.register_prehook(watch.between(k))
            for k in range(1, len(grp.computes))
            if grp.computes[k - 1].after or grp.computes[k].before
        ]
        if self.clock is not None:
            self.clock(grp.computes[0].node)
            hooks += [
                states[k].out_edge.node.register_prehook(_ticking(self.clock, c.node))
                for k, c in enumerate(grp.computes)
                if k
            ]
        self.watch = watch
        try:
            torch.autograd.backward([root], [stand_in])
        finally:
            self.watch = None
            for h in hooks:
                h.remove()
            feed.clear()
        reg = self.reg[d]
        for c, state in zip(grp.computes, states, strict=True):
            out: dict[int, torch.Tensor] = {}
            if c.materialize:
                gs = [state.boxes[u].pop() if state.boxes[u] else None for u in c.materialize]
                self._store_gradients(self.ops[c.fwd], c.materialize, gs, d, seen, out)
            reg[c.node] = out
        watch.finish()


Action = tuple[str, int, str]  # (free | free_state | retire_state | refill, node, device)

_FREE, _KEEPS_STATE, _NO_STATE = "free", "keeps state", "no state"


class NativeRun:
    """Consecutive native forward computes (``program.Plan.native``) and frees on one device,
    run by :meth:`_Runtime.run_native` in one loop. ``steps``: ``(node, what, inputs)`` with
    ``what`` one of ``_FREE``, ``_KEEPS_STATE`` (its state is read by a backward node) and
    ``_NO_STATE``; ``clones``: per step, whether its output must be cloned (``None`` until its
    first run); ``computed``, ``marked``: the nodes it computes, and those of them whose device
    is remembered (stochastic, or updating buffers)."""

    __slots__ = ("device", "steps", "clones", "computed", "marked", "compiled", "source")

    def __init__(self, device: str, steps: list[tuple[int, str, tuple[int, ...]]], rt) -> None:
        self.device, self.steps = device, tuple(steps)
        self.clones: list[bool | None] = [None] * len(steps)
        self.compiled: Callable[..., None] | None = None  # compile_native's, after a first run
        self.source = ""
        self.computed = tuple(v for v, what, _ in steps if what is not _FREE)
        self.marked = tuple(
            v for v in self.computed if rt.ops[v].stochastic or rt.ops[v].mutates_buffers
        )


def compile_native(rt: _Runtime, run: NativeRun) -> Callable[..., None]:
    """``run`` as one generated Python function ``(reg, states, x, transient)`` that does what
    :meth:`_Runtime._native_loop` does, step by step, with each op's call written out
    (:class:`capture.OpSource`), as ``torch.fx`` writes a module's forward. Made after a first
    run, which decided the clones. Within the run, the readers of one multi-output view
    (``chunk``) share it; the local that holds it is deleted before its base is freed, so it
    never keeps memory past a free. The source is kept in ``run.source`` and in ``linecache``
    (tracebacks show it)."""
    d = run.device
    env: dict[str, Any] = {
        "_S": _State.native,
        "_E": GradientEdge,
        "_free": partial(_free_on, rt, d),
        "_provided": partial(rt.provided, d),
    }
    lines: list[str] = []
    shared: dict[tuple[str, tuple[int, ...]], str] = {}
    made = [0]

    def share(key: tuple[str, tuple[int, ...]], expr: str) -> str:
        name = shared.get(key)
        if name is None:
            name = shared[key] = f"c{made[0]}"
            made[0] += 1
            lines.append(f"    {name} = {expr}")
        return name

    src = OpSource(rt.roots[d], env, share)
    here: set[int] = set()  # computed in this run: in its register until its free

    def value(u: int) -> str:
        return (
            f"reg[{u}]" if u in here else f"(reg[{u}] if reg[{u}] is not None else _provided({u}))"
        )

    for k, (v, what, _) in enumerate(run.steps):
        if what is _FREE:
            for key in [key for key in shared if v in key[1]]:
                lines.append(f"    del {shared.pop(key)}")
            lines += [f"    if reg[{v}] is None:", f"        _free({v})", f"    reg[{v}] = None"]
            here.discard(v)
            continue
        lines.append(f"    y = {src.call(rt.ops[v], value)}  # {rt.ops[v].name}")
        if run.clones[k]:
            lines.append("    y = y.clone()")
        lines.append(f"    reg[{v}] = y")
        if what is _KEEPS_STATE:
            lines.append(
                f"    states[{v}] = _S(_E(y.grad_fn, y.output_nr) if y.requires_grad else None)"
            )
        lines.append("    del y")
        if not here:  # a copy may have left a value for the first compute (none after it)
            lines += ["    if transient:", "        transient.clear()"]
        here.add(v)
    first = run.steps[0][0] if run.steps else 0
    filename = f"<xengine native run {d} {first} {id(run):x}>"
    run.source = (
        "def native_run(reg, states, x, transient):\n" + "\n".join(lines or ["    pass"]) + "\n"
    )
    linecache.cache[filename] = (len(run.source), None, run.source.splitlines(True), filename)
    exec(compile(run.source, filename, "exec"), env)  # noqa: S102 - our own generated source
    return env["native_run"]


def _free_on(rt: _Runtime, d: str, u: int) -> None:
    rt.free(u, d)


def native_step(rt: _Runtime, v: int) -> tuple[int, str, tuple[int, ...]]:
    """A native compute of ``v`` as a step of a :class:`NativeRun`."""
    what = _KEEPS_STATE if rt.g.state_reader[v] >= 0 else _NO_STATE
    return (v, what, tuple(rt.ops[v].inputs))


def _shares_storage(y: torch.Tensor, ins: Sequence[Any], fixed: set[int] | frozenset) -> bool:
    """Whether an op's output shares storage with one of its inputs or with a parameter, buffer
    or batch tensor: then it is cloned, as every node owns its output (a free must free it)."""
    out_ptr = y.untyped_storage().data_ptr()
    return out_ptr in fixed or any(out_ptr == t.untyped_storage().data_ptr() for t in ins)


@dataclass(frozen=True)
class ComputeInGroup:
    node: int  # B_v
    fwd: int  # v
    internal: frozenset[int]  # consumers w whose gradient to v flows inside autograd
    materialize: tuple[int, ...]  # inputs u of v whose gradient becomes a register
    after: tuple[Action, ...]  # frees done once autograd has run it (the next one's pre-hook)
    before: tuple[Action, ...] = ()  # refills and frees done by a pre-hook before it runs


@dataclass(frozen=True)
class GroupProgram:
    """A ``program.Group`` resolved for the runtime: every free the schedule places inside
    the group, sorted by when it can happen without changing what the allocator sees.

    ``start``: before the pass, because autograd itself then holds what they free for as long
    as the schedule does (a value a native state saved: autograd releases it when that state's
    backward has run; the register a root gradient is); ``unpacked``: values read through
    lookups, freed at their last unpack; ``after`` (per compute): once autograd has run the
    compute, in the next compute's pre-hook (a hook on the compute's own first node would run
    before the rest of a module's backward), the last one's after the pass; ``end``: after the
    pass (the group's own gradient registers and states)."""

    device: str
    computes: tuple[ComputeInGroup, ...]
    start: tuple[Action, ...]
    unpacked: frozenset[int]
    end: tuple[Action, ...]


class _Watch:
    """The frees a fused group does while autograd runs it (one per group call)."""

    def __init__(self, rt: _Runtime, grp: GroupProgram, states: list[_State]) -> None:
        self.rt, self.grp = rt, grp
        self.left: dict[int, int] = {}  # value -> unpacks by the group's states still to come
        for s in states:
            for h in s.lookups:
                if h.node in grp.unpacked:
                    self.left[h.node] = self.left.get(h.node, 0) + 1
        self.drop_extras = frozenset(node for kind, node, _ in grp.end if kind == "free_state")
        self.done = [False] * len(grp.computes)

    def value_read(self, u: int) -> None:
        n = self.left.get(u)
        if n is None:
            return
        self.left[u] = n - 1
        if n == 1:
            self.rt.free(u, self.grp.device)

    def extra_read(self, h: _Saved) -> None:
        if h.owner in self.drop_extras:
            h.tensor = None

    def between(self, k: int):
        """The pre-hook of member ``k``: member ``k-1``'s frees, then ``k``'s refills."""
        before = self.grp.computes[k].before

        def prehook(grad_outputs) -> None:
            self.run_after(k - 1)
            if before:
                _do(self.rt, before)

        return prehook

    def run_after(self, k: int) -> None:
        if not self.done[k]:
            self.done[k] = True
            _do(self.rt, self.grp.computes[k].after)

    def finish(self) -> None:
        """After the pass: the hooked frees autograd did not reach, values not unpacked as
        often as expected, and the end frees."""
        for k in range(len(self.done)):
            self.run_after(k)
        for u, n in self.left.items():
            if n > 0:
                self.rt.free(u, self.grp.device)
        _do(self.rt, self.grp.end)


def _ticking(clock, node: int):
    def prehook(grad_outputs):
        clock(node)

    return prehook


def _recomputed(ops: Sequence[Op]) -> set[int]:
    """The nodes ``ops`` compute more than once (on any device)."""
    seen: set[int] = set()
    again: set[int] = set()
    for op in ops:
        if op.kind == "compute":
            (again if op.node in seen else seen).add(op.node)
    return again


def _do(rt: _Runtime, actions: Sequence[Action]) -> None:
    """Frees in order; a held value register is dropped here, the rest (a state, the released
    logits, an error) take the runtime's own path (a group's end frees every node it ran)."""
    regs = rt.reg
    for kind, node, dev in actions:
        if kind == "free":
            reg = regs[dev]
            if reg[node] is not None:
                reg[node] = None
            else:
                rt.free(node, dev)
        elif kind == "free_state":
            rt.free_state(node, dev)
        elif kind == "retire_state":
            rt.retire_state(node, dev)
        else:
            if rt.clock is not None:
                rt.clock(node)
            rt.refill(node, dev)


def _action_kind(plan: Plan, i: int, op: Op) -> str:
    """What op ``i`` (a free) does: a ``free_state`` the plan keeps for a refill retires."""
    return "retire_state" if i in plan.retire else op.kind


def _infer_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if y.dim() == 2 and y.shape[0] == target.shape[0] and not target.is_floating_point():
        return F.cross_entropy(y, target).detach()
    return torch.tensor(float("nan"))


# ---------------------------------------------------------------------- results
@dataclass
class ExecutionResult:
    loss: float
    param_grads: dict[str, torch.Tensor]  # on CPU
    step_times_s: list[float]
    step_time_s: float  # median
    peak_bytes: dict[str, int]  # per device: measured activation peak (allocator)
    fixed_bytes: dict[str, int]  # per device: what was allocated when the step began
    budget_tolerance_bytes: int  # the tolerance stated and checked against (per device max)
    tolerance_bytes: dict[str, int] = field(default_factory=dict)  # per device
    predicted_peak_bytes: dict[str, int] = field(default_factory=dict)
    predicted_time_s: float | None = None
    budget_bytes: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    memory_source: str = ""
    n_computes: int = 0
    n_copies: int = 0
    # the plain steps timed just before each timed step (``beside``); empty when none was
    plain_beside_s: list[float] = field(default_factory=list)

    @property
    def within_budget(self) -> bool:
        return not self.violations

    @property
    def over_plain(self) -> float | None:
        """The median of each step's time over the plain step's just before it: the step's
        cost in plain steps, which the machine's drift between rows does not move; None when no
        plain step was timed beside it."""
        if not self.plain_beside_s:
            return None
        return float(statistics.median(paired.ratios(self.step_times_s, self.plain_beside_s)))


# ---------------------------------------------------------------------- validation
def _check_inputs(cap: CapturedModel, inst: Instance, sched: Schedule) -> None:
    if tuple(sched.devices) != tuple(inst.devices):
        raise ValueError(
            f"the schedule is for devices {list(sched.devices)} but the instance has "
            f"{list(inst.devices)}"
        )
    g, h = inst.graph, cap.graph
    if g.size != h.size:
        raise ValueError(
            f"the instance's graph {g.name!r} has {g.size} nodes but the captured model "
            f"{h.name!r} has {h.size}: the schedule is for another graph"
        )
    for i, (a, b) in enumerate(zip(g.nodes, h.nodes, strict=True)):
        if a.name != b.name or a.kind != b.kind:
            raise ValueError(
                f"node {i} is {a.name!r} ({a.kind}) in the instance's graph but {b.name!r} "
                f"({b.kind}) in the captured model: the schedule is for another graph"
            )
    for i, (a, b) in enumerate(zip(g.nodes, h.nodes, strict=True)):
        if a.output_bytes != b.output_bytes or a.state_bytes != b.state_bytes:
            raise ValueError(
                f"node {i} ({a.name!r}) has {a.output_bytes} bytes in the instance's graph but "
                f"{b.output_bytes} in the captured model: the schedule is for another graph "
                "(other batch or input size?)"
            )
    if {(e.src, e.dst, e.kind) for e in g.edges} != {(e.src, e.dst, e.kind) for e in h.edges}:
        raise ValueError(
            f"the instance's graph {g.name!r} has other edges than the captured model's"
        )
    n = h.size
    if sched.R.shape != (len(inst.devices), n, n):
        raise ValueError(
            f"the schedule has shape {sched.R.shape}; the graph needs {(len(inst.devices), n, n)}"
        )
    specs = {d: parse_device(d) for d in inst.devices}
    # a stochastic op must replay its random state on the same generator
    for spec in cap.ops:
        if not spec.stochastic:
            continue
        used = {inst.devices[d] for d in np.flatnonzero(sched.R[:, :, spec.index].any(axis=1))}
        gens = {str(specs[d].torch_device) if specs[d].is_cuda else "cpu" for d in used}
        if len(gens) > 1:
            raise ValueError(
                f"the schedule runs the random op {spec.name!r} on {sorted(used)}, which draw "
                "from different random generators: a recomputation could not reproduce the "
                "first run; keep it on one kind of device"
            )


# ---------------------------------------------------------------------- memory measurement
_LABEL_RE = re.compile(r"^xe\|(\w+)\|([^|]+)\|")


def _cpu_peaks_from_profile(
    prof: torch.profiler.profile, cpu_devices: Sequence[str]
) -> tuple[dict[str, int], str]:
    """Activation peak per logical CPU device from the profiler's allocation events.

    Each allocation is charged to the device of the innermost ``xe|kind|device|node`` label
    around it (or, for an allocation made outside the labelled call stack, e.g. by a worker
    thread, the label whose time window contains it); each free is charged to the device that
    allocated the address. The running sum starts at zero when the step starts, so its maximum
    is the peak minus what was allocated when the step began."""
    default = cpu_devices[0]
    try:
        from torch._C._profiler import _EventType

        tree = prof.profiler.kineto_results.experimental_event_tree()
    except Exception as exc:  # pragma: no cover - depends on the torch build
        log.warning("profiler event tree unavailable (%s); using flat memory events", exc)
        return _cpu_peaks_flat(prof, cpu_devices), "torch.profiler [memory] events (flat)"

    allocs: list[tuple[int, int, int, str | None]] = []  # (time, ptr, size, label device)
    windows: list[tuple[int, int, str]] = []

    def walk(events, label: str | None) -> None:
        for e in events:
            if e.tag == _EventType.Allocation:
                ef = e.extra_fields
                if ef.device.type == "cpu":
                    allocs.append((e.start_time_ns, int(ef.ptr), int(ef.alloc_size), label))
                continue
            lab = label
            if e.tag == _EventType.TorchOp:
                m = _LABEL_RE.match(e.name)
                if m:
                    lab = m.group(2)
                    windows.append((e.start_time_ns, e.end_time_ns, lab))
            walk(e.children, lab)

    walk(tree, None)
    windows.sort()
    starts = [w[0] for w in windows]

    def by_time(t: int) -> str:
        import bisect

        k = bisect.bisect_right(starts, t) - 1
        if k >= 0 and windows[k][0] <= t <= windows[k][1]:
            return windows[k][2]
        return default

    owner: dict[int, str] = {}
    running = dict.fromkeys(cpu_devices, 0)
    peak = dict.fromkeys(cpu_devices, 0)
    for t, ptr, size, lab in sorted(allocs, key=lambda a: a[0]):
        dev = lab if lab in running else None
        if size > 0:
            dev = dev or by_time(t)
            owner[ptr] = dev
        else:
            dev = owner.pop(ptr, None) or dev or by_time(t)
        if dev not in running:
            dev = default
        running[dev] += size
        peak[dev] = max(peak[dev], running[dev])
    return peak, "torch.profiler allocation events (by address)"


def _cpu_peaks_flat(prof: torch.profiler.profile, cpu_devices: Sequence[str]) -> dict[str, int]:
    evs = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    running = peak = 0
    for e in sorted(evs, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    out = dict.fromkeys(cpu_devices, 0)
    out[cpu_devices[0]] = peak  # without addresses, frees cannot be attributed
    return out


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        p = storage_ptr(t)
        if p:
            seen[p] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------- execute
def _label(op: Op, devices: Sequence[str]) -> str:
    return f"{LABEL_PREFIX}{op.kind}|{devices[op.device]}|{op.node}"


def compile_program(
    rt: _Runtime, ops: Sequence[Op], fuse: bool = True, in_pass: bool = True
) -> list[tuple[Any, str]]:
    """The schedule as the flat program one step replays: one closure per instruction, with
    its arguments resolved, and one per fused backward group (``program.compile_plan``), each
    with the profiler label that attributes its allocations to its device."""
    g, devices = rt.g, rt.devices
    plan = compile_plan(
        ops,
        g,
        [s.grad_inputs for s in rt.ops],
        [s.requires_grad for s in rt.ops],
        train=rt.train,
        fuse=fuse,
        mutates_buffers=[s.mutates_buffers for s in rt.ops],
        in_pass=in_pass,
    )
    connect: dict[int, set[int]] = {}
    for i, u in plan.connect:
        connect.setdefault(i, set()).add(u)
    program: list[tuple[Any, str]] = []
    i = 0
    while i < len(ops):
        grp = plan.groups.get(i)
        if grp is not None:
            gp = _group_program(rt, ops, plan, grp)
            label = f"{LABEL_PREFIX}group|{gp.device}|{ops[grp.computes[0]].node}"
            program.append((partial(rt.run_group, gp), label))
            i = grp.last + 1
            continue
        op = ops[i]
        d = devices[op.device]
        if op.kind == "compute" and i in plan.refill:
            fn = partial(rt.refill, op.node, d)
        elif op.kind == "compute":
            first = i in plan.first_compute
            linked = frozenset(connect.get(i, ()))
            if rt.plain_forward(op.node, first, linked, i in plan.native):
                fn = partial(rt.compute_native, op.node, d)
            else:
                fn = partial(rt.compute, op.node, d, first, linked, i in plan.native)
        elif op.kind == "copy":
            fn = partial(rt.copy, op.node, devices[op.src_device], d)
        elif op.kind == "free_state":
            retire = i in plan.retire
            fn = partial(rt.retire_state if retire else rt.free_state, op.node, d)
        else:
            fn = partial(rt.free, op.node, d)
        program.append((fn, _label(op, devices)))
        i += 1
    return program


def fast_program(rt: _Runtime, program: list[tuple[Any, str]]) -> list[Any]:
    """The program a timed step replays: ``program`` (:func:`compile_program`) with each run of
    native forward computes, and the frees on their device between and after them, as one
    :class:`NativeRun`. Same instructions in the same order, so the same memory timeline; the
    per-instruction program stays for what labels or marks every instruction (the memory
    profile, the timing in context)."""
    out: list[Any] = []
    steps: list[tuple[int, str, tuple[int, ...]]] = []
    device = ""

    def flush() -> None:
        if steps:
            out.append(partial(rt.run_native, NativeRun(device, steps, rt)))
            steps.clear()

    for fn, _ in program:
        func = getattr(fn, "func", None)
        if func == rt.compute_native:
            v, d = fn.args
            if d != device:
                flush()
                device = d
            steps.append(native_step(rt, v))
        elif func == rt.free and steps and fn.args[1] == device:
            steps.append((fn.args[0], _FREE, ()))
        else:
            flush()
            out.append(fn)
    flush()
    return out


def _group_program(rt: _Runtime, ops: Sequence[Op], plan: Plan, grp: Group) -> GroupProgram:
    """Resolve a group: per compute its internal and materialised gradients, and every free
    in its span sorted into ``start``, ``unpacked``, ``after`` and ``end`` (GroupProgram)."""
    g, devices, nf = rt.g, rt.devices, rt.nf
    d = devices[grp.device]
    fwd_of = {ops[j].node: g.nodes[ops[j].node].fwd_index for j in grp.computes}
    own_b, own_f = set(fwd_of), set(fwd_of.values())
    natively_held: set[int] = set()  # values a native state of the group saved
    looked_up: set[int] = set()  # values a non-native state of the group reads by lookup
    last_reader: dict[int, int] = {}  # value or own forward node -> its last compute here
    for j in grp.computes:
        saved = {e.src for e in g.in_edges[ops[j].node] if g.nodes[e.src].kind == "fwd"}
        (natively_held if plan.state_of[j] in plan.native else looked_up).update(saved)
        last_reader.update(dict.fromkeys(saved, j))
    first = ops[grp.computes[0]].node
    # the registers the root gradient comes from: B_w for each consumer w of the first
    # compute's forward node, and the loss for the last forward node
    root_regs = {backward_node(nf, w) for w in rt.grad_consumers[fwd_of[first]]}
    if fwd_of[first] == nf - 1:
        root_regs.add(nf)
    state_user = {ops[plan.state_of[j]].node: j for j in grp.computes}  # own state -> its reader
    refills = frozenset(grp.refills)
    # a value a refill reads keeps its register until the schedule frees it (never at start)
    refill_reads = {u for i in refills for u in rt.ops[ops[i].node].inputs}
    after: dict[int, list[Action]] = {j: [] for j in grp.computes}
    before: dict[int, list[Action]] = {j: [] for j in grp.computes}
    start: list[Action] = []
    end: list[Action] = []
    unpacked: set[int] = set()
    # a refill and the frees after it run in the next compute's pre-hook, in schedule order:
    # by then autograd has run every node of the compute before (they were made later)
    gap: list[Action] = []
    j = grp.first
    for i in range(grp.first, grp.last + 1):
        op = ops[i]
        if op.kind == "compute":
            if i in refills:
                gap.append(("refill", op.node, d))
            else:
                j, before[i], gap = i, gap, []
            continue
        act = (_action_kind(plan, i, op), op.node, devices[op.device])
        u, kind = op.node, g.nodes[op.node].kind
        # autograd lets go of what a compute read when it has run: only a free placed right
        # after that compute may be left to autograd; one the schedule places later (a value
        # kept longer than its last reader, or freed after a recomputation) waits for its own
        # hook, or the measured memory would drop before the simulator's
        prompt = last_reader.get(u) == j and not gap
        if act[2] != d:
            (gap or after[j]).append(act)
        elif op.kind == "free_state":
            (end if u in own_f and state_user.get(u) == j else gap or after[j]).append(act)
        elif u in own_b:
            end.append(act)
        elif kind == "fwd" and u in looked_up and prompt:
            unpacked.add(u)
        elif kind == "fwd" and u in natively_held and prompt and u not in refill_reads:
            start.append(act)
        elif u in root_regs and len(root_regs) == 1 and j == grp.computes[0] and not gap:
            start.append(act)  # the root gradient itself: autograd holds it until it is used
        else:
            (gap or after[j]).append(act)
    if gap:
        raise RuntimeError("executor: a group ends with a recomputation")
    computes = []
    for j in grp.computes:
        b = ops[j].node
        v = fwd_of[b]
        internal = frozenset(fwd_of[ops[k].node] for k in grp.computes if (k, v) in plan.internal)
        materialize = tuple(u for u in rt.ops[v].grad_inputs if (j, u) not in plan.internal)
        reads_register = v == nf - 1 or any(w not in internal for w in rt.grad_consumers[v])
        if computes and reads_register:  # program.py starts a group at such a compute
            raise RuntimeError(f"executor: {rt.ops[v].name} is fused but reads a register")
        computes.append(
            ComputeInGroup(b, v, internal, materialize, tuple(after[j]), tuple(before[j]))
        )
    return GroupProgram(d, tuple(computes), tuple(start), frozenset(unpacked), tuple(end))


class CompiledSchedule:
    """A schedule compiled once for a captured model; :meth:`step` replays one training step.

    Compiling checks the schedule against the model, simulates it for its operations, binds
    every op to the device models and resolves the program (:func:`compile_program`). A step
    starts from the state the model had at compile time (random state, batch-norm buffers,
    zeroed gradient buffers), so any number of steps leaves the state after one. Use it as a
    context manager, or call :meth:`close`, to get the thread count back."""

    def __init__(
        self,
        captured: CapturedModel,
        inst: Instance,
        sched: Schedule,
        *,
        fuse: bool = True,
        in_pass: bool = True,
    ) -> None:
        _check_inputs(captured, inst, sched)
        sim_inst, self.has_costs = _costed(inst)
        self.sim = simulate(sim_inst, sched, check_budget=False)
        self.captured, self.inst = captured, inst
        self.devices = tuple(inst.devices)
        self.rt = rt = _Runtime(captured, self.devices)
        rt.replayed = _recomputed(self.sim.ops)
        rt.loss_releases = tuple(self.sim.loss_releases)
        self.dspecs = [rt.specs[d] for d in self.devices]
        self.cpu_devices = [d for d in self.devices if not rt.specs[d].is_cuda]
        self.cuda_devices = [d for d in self.devices if rt.specs[d].is_cuda]
        # every step starts here: the module's buffers, the random state of each device used
        # and of the CPU; the device copies of the model take the module's buffers
        self._start = TorchState(
            captured.gm.buffers(), rng=[*(s.torch_device for s in self.dspecs), "cpu"]
        )
        self._copies = [
            (list(r.buffers()), list(captured.gm.buffers()))
            for r in rt._roots_unique
            if r is not captured.gm
        ]
        self._threads0 = torch.get_num_threads()
        self.program = compile_program(rt, self.sim.ops, fuse=fuse, in_pass=in_pass)
        self.fast = fast_program(rt, self.program)

    def __enter__(self) -> CompiledSchedule:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.rt.reset()
        torch.set_num_threads(self._threads0)

    def _restore(self) -> None:
        self._start.restore()
        with torch.no_grad():
            for dst, src in self._copies:
                for b, b0 in zip(dst, src, strict=True):
                    b.copy_(b0)

    def run(self, labelled: bool = False) -> None:
        """One step, not synchronised (``labelled``: inside profiler labels, for memory)."""
        rt = self.rt
        self._restore()
        rt.reset()
        rt.zero_grads()
        if labelled:
            for fn, label in self.program:
                with torch.profiler.record_function(label):
                    fn()
        else:
            for fn in self.fast:
                fn()
        if rt.live_count():
            raise RuntimeError(f"executor: {rt.live_count()} registers alive after the step")

    def step(self) -> tuple[float, dict[str, int]]:
        """One timed step: its seconds (devices synchronised) and, per CUDA device, the
        allocator's peak above what was allocated when it began."""
        fixed = {}
        for d in self.cuda_devices:
            dev = self.rt.specs[d].torch_device
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            fixed[d] = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        self.run()
        _sync(self.dspecs)
        dt = time.perf_counter() - t0
        peaks = {
            d: int(torch.cuda.max_memory_allocated(self.rt.specs[d].torch_device) - fixed[d])
            for d in self.cuda_devices
        }
        self.cuda_fixed_bytes = fixed
        return dt, peaks

    def cpu_peaks(self) -> tuple[dict[str, int], str]:
        """One step under the profiler: the activation peak of each CPU device."""
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            self.run(labelled=True)
        _sync(self.dspecs)
        return _cpu_peaks_from_profile(prof, self.cpu_devices)


def execute(
    captured: CapturedModel,
    inst: Instance,
    sched: Schedule,
    n_steps: int = 5,
    warmup: int = 1,
    *,
    measure_memory: bool = True,
    tolerance_fraction: float = TOLERANCE_FRACTION,
    tolerance_min_bytes: int = TOLERANCE_MIN_BYTES,
    fuse: bool = True,
    beside: PlainStep | None = None,
) -> ExecutionResult:
    """Run ``sched`` for one training step (for a graph captured with ``mode="infer"``: one
    forward pass, whose loss is reported but not differentiated), ``warmup + n_steps`` times
    (plus one step under the profiler when a CPU device is used, for its memory).

    The schedule is compiled once (:class:`CompiledSchedule`). Every step starts from the same
    state, so the module's state afterwards is the state after one step, and the loss and
    gradients reported are those of one step. ``fuse=False`` runs every backward node as its
    own autograd call (the interpreted executor, for comparison). ``beside``: a plain step run
    before every step (:func:`_timed_steps`), so the result also has the schedule's time in
    plain steps (:attr:`ExecutionResult.over_plain`). Raises ``ValueError`` for a schedule of
    another graph or device mix (and ``ScheduleError``, a ``ValueError``, for an invalid one).
    """
    if n_steps < 1 or warmup < 0:
        raise ValueError("n_steps must be >= 1 and warmup >= 0")
    exe = CompiledSchedule(captured, inst, sched, fuse=fuse)
    rt, sim, devices = exe.rt, exe.sim, exe.devices
    cuda_peak = dict.fromkeys(exe.cuda_devices, 0)
    with exe:
        times, plain_s, step_peaks = _timed_steps(exe.step, n_steps, warmup, beside)
        for peaks in step_peaks:
            for d, p in peaks.items():
                cuda_peak[d] = max(cuda_peak[d], p)
        cpu_peak: dict[str, int] = {}
        memory_source = "cuda caching allocator statistics" if exe.cuda_devices else ""
        if exe.cpu_devices and measure_memory:
            cpu_peak, src = exe.cpu_peaks()
            memory_source = "; ".join(x for x in (memory_source, src) if x)
        # gather the step's results onto the captured (CPU) module, as a plain step leaves them
        _sync_back(captured, rt)
        loss = float(rt.loss_value.item()) if rt.loss_value is not None else float("nan")
        param_grads = {
            name: p.grad.detach().to("cpu").clone()
            for name, p in captured.module.named_parameters()
            if p.requires_grad and p.grad is not None
        }
        cuda_fixed = getattr(exe, "cuda_fixed_bytes", {})
    fixed_cpu = _storage_bytes(
        [*captured.gm.parameters(), *captured.gm.buffers()]
        + [p.grad for p in captured.gm.parameters()]
        + [captured.example_input, captured.target]
    )
    fixed = {d: (cuda_fixed[d] if d in cuda_fixed else fixed_cpu) for d in devices}
    peaks = {d: int(cuda_peak[d] if d in cuda_peak else cpu_peak.get(d, -1)) for d in devices}
    predicted = {d: int(sim.peak_bytes[k]) for k, d in enumerate(devices)}
    budgets = {d: int(inst.budgets[k]) for k, d in enumerate(devices)}
    tol = {
        d: int(max(tolerance_min_bytes, tolerance_fraction * min(budgets[d], predicted[d])))
        for d in devices
    }
    violations = []
    for d in devices:
        if peaks[d] >= 0 and peaks[d] > budgets[d] + tol[d]:
            violations.append(
                f"{d}: measured activation peak {peaks[d]} bytes exceeds the budget "
                f"{budgets[d]} by more than the tolerance {tol[d]}"
            )
            log.warning("budget exceeded on %s", violations[-1])
    for d in devices:
        log.info(
            "%s: measured peak %.2f MiB, predicted %.2f MiB, fixed %.2f MiB",
            d,
            peaks[d] / 2**20,
            predicted[d] / 2**20,
            fixed[d] / 2**20,
        )
    return ExecutionResult(
        loss=loss,
        param_grads=param_grads,
        step_times_s=times,
        step_time_s=float(statistics.median(times)),
        peak_bytes=peaks,
        fixed_bytes=fixed,
        budget_tolerance_bytes=max(tol.values()),
        tolerance_bytes=tol,
        predicted_peak_bytes=predicted,
        predicted_time_s=float(sim.time_s) if exe.has_costs else None,
        budget_bytes=budgets,
        violations=violations,
        memory_source=memory_source,
        n_computes=sim.n_computes,
        n_copies=sim.n_copies,
        plain_beside_s=plain_s,
    )


def _timed_steps(
    step: Callable[[], tuple[float, Any]], n_steps: int, warmup: int, beside: PlainStep | None
) -> tuple[list[float], list[float], list[Any]]:
    """``warmup`` then ``n_steps`` timed calls of ``step`` (seconds, and what else it returns):
    the timed seconds, the seconds of the plain steps beside them, and the other returns.

    With ``beside``, each call follows one plain step, as :func:`xengine.profile.paired.pairs`
    takes its pairs: this VM's speed drifts by 10-35 % within minutes, so a time in
    milliseconds measured minutes after the plain row's is not the overhead a user pays; the
    ratio to the plain step just before it is (:attr:`ExecutionResult.over_plain`)."""
    times: list[float] = []
    plain_s: list[float] = []
    others: list[Any] = []
    for k in range(warmup + n_steps):
        progress.report(step=(k + 1, warmup + n_steps))
        before_s = beside.step()[0] if beside is not None else None
        dt, other = step()
        if k >= warmup:
            times.append(dt)
            others.append(other)
            if before_s is not None:
                plain_s.append(before_s)
    return times, plain_s, others


def _costed(inst: Instance) -> tuple[Instance, bool]:
    """The instance, with zero costs filled in where the graph has none (the executor needs
    the simulator's operations, not its times). Second value: whether all costs were there."""
    g = inst.graph
    missing = [d for d in inst.devices if any(d not in v.cost_s for v in g.nodes)]
    pairs = [
        (a, b) for a in inst.devices for b in inst.devices if a != b and (a, b) not in g.copy_models
    ]
    if not missing and not pairs:
        return inst, True
    g2 = g.with_costs(
        {d: {v.name: float(v.cost_s.get(d, 0.0)) for v in g.nodes} for d in missing},
        {p: CopyModel(0.0, float("inf")) for p in pairs},
    )
    return Instance(g2, inst.devices, inst.budget_bytes), False


def _sync_back(cap: CapturedModel, rt: _Runtime) -> None:
    """Bring the step's gradients and buffer updates made on CUDA copies back to the module."""
    gm = cap.gm
    with torch.no_grad():
        for r in rt._roots_unique:
            if r is gm:
                continue
            for (_, p), (_, q) in zip(gm.named_parameters(), r.named_parameters(), strict=True):
                if q.grad is not None and p.grad is not None:
                    p.grad.add_(q.grad.to(p.device))
        for spec in cap.ops:
            d = rt.first_fwd_device.get(spec.index)
            if spec.mutates_buffers and d is not None and rt.roots[d] is not gm:
                src = rt.roots[d].get_submodule(spec.module_path)
                dst = gm.get_submodule(spec.module_path)
                for b, c in zip(dst.buffers(), src.buffers(), strict=True):
                    b.copy_(c.to(b.device))


# ---------------------------------------------------------------------- plain pytorch
class PlainStep:
    """A plain PyTorch step: ``model(x)``, cross-entropy, ``backward()``, from the same starting
    state each time (what a user compares a schedule with). :meth:`step` times one; on a CUDA
    device the model is a copy. Use it as a context manager, or call :meth:`close`, to get the
    thread count back and the buffers of a CUDA copy onto the captured module.

    By default it runs the captured module, whose ``inplace`` flags capture switched off (the
    schedules' numbers and memory are those of that module). ``as_written=True`` runs a copy
    with those flags on again, the module as its author wrote it: an in-place ReLU does not
    keep its input, so that step's peak is lower, and it is what a user who never heard of
    xengine runs.

    ``rewrite`` changes a copy of the module before it runs (PyTorch's own checkpointing,
    ``baselines.pytorch``); that copy's buffers are not copied back at :meth:`close`: a
    recomputed batch norm updates its running statistics twice, and the captured module keeps
    a plain step's.

    ``set_to_none``: each step starts without gradients (``optimizer.zero_grad()``'s default)
    instead of accumulating into zeroed ones, and its peaks are reported less the bytes of the
    gradients it makes, which every row counts as fixed memory: the same total, counted the
    same way (``experiments/compiled_gradients.py`` measures what this changes)."""

    def __init__(
        self,
        captured: CapturedModel,
        device: str = "cpu",
        as_written: bool = False,
        rewrite: Callable[[nn.Module], None] | None = None,
        set_to_none: bool = False,
    ):
        self.captured, self.device = captured, device
        self.spec = spec = parse_device(device)
        self.dev = dev = spec.torch_device
        copied = spec.is_cuda or (as_written and bool(captured.inplace_modules))
        copied = copied or rewrite is not None
        self.module = copy.deepcopy(captured.module) if copied else captured.module
        self._copy_back = copied and rewrite is None
        if as_written:
            for path in captured.inplace_modules:
                self.module.get_submodule(path).inplace = True
        if rewrite is not None:
            rewrite(self.module)
        self.module.to(dev)
        self.train = captured.mode == "train"
        self.module.train(self.train)
        self.x = captured.example_input.to(dev)
        self.target = captured.target.to(dev)
        self.params = [p for p in self.module.parameters() if p.requires_grad] if self.train else []
        self.set_to_none = set_to_none
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._start = TorchState(self.module.buffers(), rng=(dev,))
        self._threads0 = torch.get_num_threads()
        self.loss: torch.Tensor | None = None

    def __enter__(self) -> PlainStep:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        torch.set_num_threads(self._threads0)
        if self._copy_back:
            with torch.no_grad():
                for b, c in zip(self.captured.module.buffers(), self.module.buffers(), strict=True):
                    b.copy_(c.cpu())

    def run(self, labelled: bool = False) -> None:
        if self.spec.threads is not None and torch.get_num_threads() != self.spec.threads:
            torch.set_num_threads(self.spec.threads)
        self._start.restore()
        with torch.no_grad():
            for p in self.params:
                if self.set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        ctx = (
            torch.profiler.record_function(f"{LABEL_PREFIX}ref|{self.device}|0")
            if labelled
            else nullcontext()
        )
        if self.train:
            with ctx, torch.enable_grad():
                loss = self.captured.loss(self.module(self.x), self.target)
                loss.backward()
        else:
            with ctx, torch.no_grad():
                loss = _infer_loss(self.module(self.x), self.target)
        self.loss = loss.detach()

    def step(self) -> tuple[float, int]:
        """One timed step: seconds, and on CUDA the allocator's peak above the start (else -1)."""
        fixed = 0
        if self.spec.is_cuda:
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
            fixed = torch.cuda.memory_allocated(self.dev)
        t0 = time.perf_counter()
        self.run()
        _sync([self.spec])
        dt = time.perf_counter() - t0
        self.fixed_bytes = fixed
        if self.spec.is_cuda:
            return dt, int(torch.cuda.max_memory_allocated(self.dev) - fixed) - self._made_bytes
        return dt, -1

    @property
    def _made_bytes(self) -> int:
        """Bytes of fixed memory that a step makes itself: its gradients, with
        ``set_to_none``."""
        if not self.set_to_none:
            return 0
        return sum(p.numel() * p.element_size() for p in self.params)

    def cpu_peak(self) -> tuple[int, str]:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            self.run(labelled=True)
        peaks, source = _cpu_peaks_from_profile(prof, [self.device])
        return peaks[self.device] - self._made_bytes, source


def reference_step(
    captured: CapturedModel,
    n_steps: int = 5,
    warmup: int = 1,
    *,
    device: str = "cpu",
    measure_memory: bool = True,
    rewrite: Callable[[nn.Module], None] | None = None,
    beside: PlainStep | None = None,
) -> ExecutionResult:
    """A plain PyTorch step (:class:`PlainStep`), timed and measured the same way as
    :func:`execute`, from the same starting state each step; with ``rewrite``, the step of a
    module that PyTorch's own checkpointing changed (``baselines.pytorch``), and with
    ``beside`` an unchanged plain step before each of its steps (:func:`_timed_steps`)."""
    plain = PlainStep(captured, device, rewrite=rewrite)
    source = "cuda caching allocator statistics"
    with plain:
        times, plain_s, step_peaks = _timed_steps(plain.step, n_steps, warmup, beside)
        if plain.spec.is_cuda:
            peak = max([0, *step_peaks])
        elif measure_memory:
            peak, source = plain.cpu_peak()
        else:
            peak = -1
    module = plain.module
    if plain.spec.is_cuda:
        fixed = plain.fixed_bytes
    else:
        fixed = _storage_bytes(
            [*module.parameters(), *module.buffers()]
            + [p.grad for p in module.parameters()]
            + [plain.x, plain.target]
        )
    grads = {
        n: p.grad.detach().to("cpu").clone()
        for n, p in module.named_parameters()
        if plain.train and p.requires_grad and p.grad is not None
    }
    return ExecutionResult(
        loss=float(plain.loss.item()),
        param_grads=grads,
        step_times_s=times,
        step_time_s=float(statistics.median(times)),
        peak_bytes={device: int(peak)},
        fixed_bytes={device: int(fixed)},
        budget_tolerance_bytes=0,
        memory_source=source,
        plain_beside_s=plain_s,
    )
