"""Capture a torch model as a training graph plus the program that runs it (docs/design.md,
section 3).

``trace`` traces a module with :func:`torch.fx.symbolic_trace` and makes one forward node per
``call_module`` / ``call_function`` / ``call_method`` node (trace order, which is topological),
then, in ``mode="train"``, a loss node and one backward node per forward node in reverse order.

The forward ops are run once on the example batch, on the CPU, to measure what the graph needs:

* each op's value bytes, and the tensors autograd *saves* for its backward (found with
  :func:`torch.autograd.graph.saved_tensors_hooks`): a saved tensor that shares storage with an
  input ``u`` becomes a value edge ``F_u -> B_v``, one that shares the op's output a value edge
  ``F_v -> B_v``; one that shares a parameter or buffer is fixed memory; anything else
  (max-pool indices, batch-norm's saved mean and inverse std, dropout masks) is the op's
  autograd *state* (``state_bytes``), read by ``B_v`` over the state edge ``F_v -> B_v``. So a
  value is kept for the backward pass only where autograd really keeps it: a batch-norm or
  residual-add output is not;
* whether the op draws random numbers (dropout: the CPU generator moves) or mutates module
  buffers (batch-norm running statistics), which the executor needs to make recomputation free
  of side effects;
* whether its result shares storage with an input or fixed memory (``flatten``, ``view``,
  ``transpose``, ``split``): such a view op is no node but is folded into the ops that read it
  (:class:`_View`), so its storage is counted once, as its base's, as in a plain PyTorch step;
  the model's output, when it is a view, is cloned (the loss reads it).

In-place ops are disabled (``inplace=False`` on modules, ``inplace`` kwargs dropped on
functions): the numbers are identical and no op overwrites a tensor a schedule still holds.

The capture run leaves no trace: the random state and the module buffers are restored.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from xengine.graph.types import (
    GRANULARITIES,
    SIZED_NETS,
    Edge,
    Graph,
    GraphError,
    InternalError,
    Node,
)
from xengine.torch_state import TorchState

log = logging.getLogger(__name__)

TORCHVISION_NETS: tuple[str, ...] = (
    "tiny",
    "alexnet",
    "vgg11",
    "vgg16",
    "vgg19",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "googlenet",
    "mobilenet_v2",
    "squeezenet1_0",
    "densenet121",
    "vit_b_16",
    "gpt2_small",
    "hf_gpt2",
    "hf_llama",
)
OWN_NETS = ("tiny", "gpt2_small", "hf_gpt2", "hf_llama")
"""Nets named here (:mod:`xengine.graph.nets`, :class:`TinyNet`, the transformers models of
:mod:`xengine.graph.hf_nets`); every other name is a torchvision classification model
(:func:`known_nets`)."""
TOKEN_NETS = ("gpt2_small", "hf_gpt2", "hf_llama")
"""Nets that read token ids: ``image_size`` is their sequence length, ``num_classes`` their
vocabulary."""

MODES = ("train", "infer")
LOSS_NAME = "loss"
BWD_PREFIX = "grad_"


# ---------------------------------------------------------------------- the tiny test net
class TinyNet(nn.Module):
    """A small conv net for fast tests: conv-bn-relu, a residual ``+``, max-pool, dropout and
    a linear classifier. Made for 32x32 inputs (any even size works)."""

    def __init__(self, num_classes: int = 10, image_size: int = 32, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(width * (image_size // 2) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(x))
        y = self.relu2(y + x)
        y = self.pool(y)
        y = torch.flatten(y, 1)
        y = self.drop(y)
        return self.fc(y)


# ---------------------------------------------------------------------- the op program
@dataclass(frozen=True)
class _Slot:
    """Marks where an op's argument comes from: ``kind`` "in" (the op's k-th input node),
    "x" (the input batch) or "attr" (an attribute of the module, e.g. a parameter used by a
    function: resolved on the model copy of the device that runs the op)."""

    kind: str
    index: int = 0
    path: str = ""


@dataclass(frozen=True)
class _View:
    """A view op folded into the op that reads it (docs/design.md section 3): the reader
    evaluates ``op``/``target`` on its filled ``args`` itself, so the view's result is the
    storage of its base, counted once as the base's value, as in a plain PyTorch step.
    ``args`` and ``kwargs`` are templates in the reader's slots (a chain of views nests)."""

    op: str
    target: Any
    args: tuple
    kwargs: dict


def _callable(root: nn.Module, op: str, target: Any) -> Callable[..., Any]:
    """The function an fx node of kind ``op`` calls, resolved on ``root``."""
    if op == "call_module":
        return root.get_submodule(target)
    if op == "call_function":
        return target

    def method(obj, *a, **k):
        return getattr(obj, target)(*a, **k)

    return method


def _get_attr(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class OpSpec:
    """One forward op, as the executor runs it.

    ``inputs`` are the forward-node indices the op reads (distinct, in argument order);
    ``grad_inputs`` those whose outputs require grad (they receive a gradient from ``B_v``);
    ``saved_inputs`` those autograd saves for the backward; ``param_names`` the parameters
    (qualified names in the traced module) whose gradients ``B_v`` produces.
    """

    index: int
    name: str
    op: str  # call_module | call_function | call_method
    target: Any
    args: tuple
    kwargs: dict
    inputs: tuple[int, ...]
    reads_x: bool
    module_path: str | None
    param_names: tuple[str, ...] = ()
    requires_grad: bool = False
    grad_inputs: tuple[int, ...] = ()
    saved_inputs: tuple[int, ...] = ()
    saves_output: bool = False
    # per entry of grad_inputs: the earlier entry whose gradient is the very same tensor (the
    # add backward hands one gradient to both inputs), else -1; such a gradient is stored once
    grad_alias: tuple[int, ...] = ()
    extra_bytes: int = 0
    output_bytes: int = 0
    output_shape: tuple[int, ...] = ()
    output_dtype: str = "float32"
    clone_output: bool = False
    stochastic: bool = False
    mutates_buffers: bool = False
    # the op returns a tuple of which one element is used (nn.MultiheadAttention's output,
    # not its weights): that element, the fx ``getitem`` nodes reading it folded into the op
    select: int | None = None

    def bind(self, root: nn.Module) -> Callable[[Sequence[torch.Tensor], torch.Tensor], Any]:
        """A function ``run(inputs, x)`` that runs this op with the modules of ``root``.

        The argument templates are compiled once into getters (:func:`_filler`): the executor
        calls ``run`` for every computation of every step, and walking the templates each
        time cost as much as a small op (issue 28: keep-everything against a plain step)."""
        fn = _callable(root, self.op, self.target)
        select = self.select
        args = _filler(self.args, root)
        kwargs = _filler(self.kwargs, root)
        if args is None and kwargs is None:  # no tensor argument at all
            a0, k0 = self.args, self.kwargs

            def run(ins: Sequence[torch.Tensor], x: torch.Tensor) -> Any:
                out = fn(*a0, **k0)
                return out if select is None else out[select]

            return run
        get_args = args or (lambda ins, x, _a=self.args: _a)
        get_kwargs = kwargs or (lambda ins, x, _k=self.kwargs: _k)

        def run(ins: Sequence[torch.Tensor], x: torch.Tensor) -> Any:
            out = fn(*get_args(ins, x), **get_kwargs(ins, x))
            return out if select is None else out[select]

        return run


def _filler(a: Any, root: nn.Module) -> Callable[[Sequence[Any], Any], Any] | None:
    """A getter ``(ins, x) -> value`` for the template ``a`` (slots, folded views, nested
    tuples, lists and dicts), or None where ``a`` holds no slot (a constant, used as it is).
    An attribute is looked up on ``root`` at its first use and kept."""
    if isinstance(a, _Slot):
        if a.kind == "in":
            k = a.index
            return lambda ins, x: ins[k]
        if a.kind == "x":
            return lambda ins, x: x
        cell: list[Any] = []
        path = a.path

        def attr(ins, x):
            if not cell:
                cell.append(_get_attr(root, path))
            return cell[0]

        return attr
    if isinstance(a, _View):
        view_fn: list[Any] = []
        op, target = a.op, a.target
        va = _filler(a.args, root) or (lambda ins, x, _a=a.args: _a)
        vk = _filler(a.kwargs, root) or (lambda ins, x, _k=a.kwargs: _k)

        def view(ins, x):
            if not view_fn:
                view_fn.append(_callable(root, op, target))
            return view_fn[0](*va(ins, x), **vk(ins, x))

        return view
    if isinstance(a, (tuple, list)):
        parts = [_filler(b, root) for b in a]
        if all(f is None for f in parts):
            return None
        getters = [f or (lambda ins, x, _b=b: _b) for f, b in zip(parts, a, strict=True)]
        kind = type(a)
        if kind is tuple and len(getters) == 1:
            (g0,) = getters
            return lambda ins, x: (g0(ins, x),)
        if kind is tuple and len(getters) == 2:
            g0, g1 = getters
            return lambda ins, x: (g0(ins, x), g1(ins, x))
        return lambda ins, x: kind(g(ins, x) for g in getters)
    if isinstance(a, dict):
        parts = {k: _filler(b, root) for k, b in a.items()}
        if all(f is None for f in parts.values()):
            return None
        getters = {k: f or (lambda ins, x, _b=a[k]: _b) for k, f in parts.items()}
        return lambda ins, x: {k: g(ins, x) for k, g in getters.items()}
    return None


class OpSource:
    """Python source for ops' calls, for a generated function that runs several ops in a row
    (the executor's native runs): the calls as ``fx`` writes them, with no getter per argument.
    Around a small op, the getters of :meth:`OpSpec.bind` and the loop that calls them cost
    more than a plain step's Python (issue 28: keep-everything over a plain step, 1.08x on
    ShuffleNet before).

    ``env`` collects the objects the source names (modules, functions, constants, attributes
    resolved on ``root``); the function is executed with it as its globals. ``share``: a view
    that a ``getitem`` selects from (``chunk``, ``split``) is handed to it with a key that two
    readers of the same view of the same nodes share, and it returns the name of a local that
    holds the view, so that the readers share one autograd node, as in a plain step (one
    ``SplitBackward`` that concatenates, not one per reader that pads with zeros, then an
    add)."""

    def __init__(
        self,
        root: nn.Module,
        env: dict[str, Any],
        share: Callable[[tuple[str, tuple[int, ...]], str], str] | None = None,
    ) -> None:
        self.root, self.env, self.share = root, env, share

    def name(self, value: Any, hint: str = "k") -> str:
        """A global name for ``value`` in ``env``."""
        key = f"{hint}{len(self.env)}"
        self.env[key] = value
        return key

    def call(self, spec: OpSpec, input_expr: Callable[[int], str]) -> str:
        """The expression that runs ``spec`` (what ``spec.bind(root)(ins, x)`` returns), with
        ``input_expr(u)`` for the value of input node ``u`` and ``x`` for the batch."""
        ins = [input_expr(u) for u in spec.inputs]
        out = self._view(_View(spec.op, spec.target, spec.args, spec.kwargs), ins, spec.inputs)
        return out if spec.select is None else f"{out}[{spec.select}]"

    def _args(self, args: tuple, kwargs: dict, ins: list[str], inputs: Sequence[int]) -> str:
        parts = [self._expr(a, ins, inputs) for a in args]
        parts += [f"{k}={self._expr(v, ins, inputs)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def _expr(self, a: Any, ins: list[str], inputs: Sequence[int]) -> str:
        if isinstance(a, _Slot):
            if a.kind == "in":
                return ins[a.index]
            if a.kind == "x":
                return "x"
            return self.name(_get_attr(self.root, a.path), "a")
        if isinstance(a, _View):
            if a.target is operator.getitem and isinstance(a.args[0], _View):
                base = self._view(a.args[0], ins, inputs)
                if self.share is not None:
                    base = self.share(_canonical(a.args[0], inputs), base)
                rest = [self._expr(b, ins, inputs) for b in a.args[1:]]
                return f"{base}[{', '.join(rest)}]"
            return self._view(a, ins, inputs)
        if a is None or type(a) in (bool, int, str) or (type(a) is float and math.isfinite(a)):
            return repr(a)  # a literal: the source reads as the call
        if _filler(a, self.root) is None:  # no slot: a constant, used as it is
            return self.name(a)
        if isinstance(a, (tuple, list)):
            items = ", ".join(self._expr(b, ins, inputs) for b in a)
            if type(a) is list:
                return f"[{items}]"
            tup = f"({items},)"
            return tup if type(a) is tuple else f"{self.name(type(a), 't')}({tup})"
        if isinstance(a, dict):
            items = ", ".join(f"{self.name(k)}: {self._expr(b, ins, inputs)}" for k, b in a.items())
            return f"{{{items}}}"
        return self.name(a)

    def _view(self, a: _View, ins: list[str], inputs: Sequence[int]) -> str:
        """The call ``a`` describes (a folded view, or an op itself)."""
        if a.op == "call_method":
            obj = self._expr(a.args[0], ins, inputs)
            rest = self._args(a.args[1:], a.kwargs, ins, inputs)
            return f"{obj}.{a.target}({rest})"
        fn = self.name(_callable(self.root, a.op, a.target), "f")
        return f"{fn}({self._args(a.args, a.kwargs, ins, inputs)})"


def _canonical(a: Any, inputs: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """A key for the view template ``a`` that two readers share when they evaluate the same
    view of the same nodes (their slots name input positions of their own: these become node
    indices), with the nodes it reads."""
    nodes: set[int] = set()

    def walk(b: Any) -> str:
        if isinstance(b, _Slot):
            if b.kind == "in":
                nodes.add(inputs[b.index])
                return f"node{inputs[b.index]}"
            return f"{b.kind}:{b.path}"
        if isinstance(b, _View):
            return f"{b.op}:{b.target!r}({walk(b.args)};{walk(b.kwargs)})"
        if isinstance(b, (tuple, list)):
            return "[" + ",".join(walk(c) for c in b) + "]"
        if isinstance(b, dict):
            return "{" + ",".join(f"{k}={walk(c)}" for k, c in sorted(b.items())) + "}"
        return repr(b)

    return walk(a), tuple(sorted(nodes))


@dataclass
class CapturedModel:
    """A training (or inference) graph and everything needed to run its nodes."""

    graph: Graph  # costs empty, bytes measured from real tensors
    module: nn.Module
    example_input: torch.Tensor
    target: torch.Tensor
    mode: str  # "train" | "infer"
    gm: fx.GraphModule
    ops: tuple[OpSpec, ...]  # forward ops; ops[i] is graph node i
    net: str = "model"
    meta: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # modules whose ``inplace`` flag capture switched off
    inplace_modules: tuple[str, ...] = ()

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The training loss of the model's output: the user's ``loss_fn``, else cross-entropy
        on class indices (every torchvision classifier)."""
        if self.loss_fn is None:
            return torch.nn.functional.cross_entropy(output, target)
        return self.loss_fn(output, target)

    @property
    def n_forward(self) -> int:
        return len(self.ops)

    @property
    def output_index(self) -> int:
        """The forward node whose output is the model's output (the logits)."""
        return len(self.ops) - 1

    @property
    def loss_index(self) -> int | None:
        return len(self.ops) if self.mode == "train" else None

    def bwd_index(self, fwd: int) -> int:
        """Graph index of the backward node of forward node ``fwd``."""
        return 2 * len(self.ops) - fwd

    @property
    def batch_size(self) -> int:
        return int(self.example_input.shape[0])

    @property
    def dtype(self) -> str:
        return str(self.example_input.dtype).removeprefix("torch.")


# ---------------------------------------------------------------------- helpers
def storage_ptr(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (0 for an empty storage)."""
    return t.untyped_storage().data_ptr()


def alias_leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new tensor on ``t``'s storage with its own autograd identity (and version counter).

    The executor empties it after the forward op so that it does not keep the storage alive."""
    leaf = torch.empty(0, dtype=t.dtype, device=t.device)
    leaf.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    if requires_grad:
        leaf.requires_grad_(True)
    return leaf


def tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def fixed_storage_ptrs(root: nn.Module, *tensors: torch.Tensor) -> set[int]:
    ptrs = {storage_ptr(p) for p in root.parameters()}
    ptrs |= {storage_ptr(b) for b in root.buffers()}
    ptrs |= {storage_ptr(t) for t in tensors}
    ptrs.discard(0)
    return ptrs


def _disable_inplace(module: nn.Module) -> tuple[str, ...]:
    """Switch off every module's ``inplace`` flag; the paths of those that were on, so that a
    plain step of the module as its author wrote it can switch them on again
    (:class:`xengine.execute.executor.PlainStep`, ``as_written``). The paths are kept on the
    module too, so a second capture of it knows them."""
    paths = list(getattr(module, _INPLACE_ATTR, ()))
    for path, m in module.named_modules():
        if isinstance(getattr(m, "inplace", None), bool) and m.inplace:
            m.inplace = False
            paths.append(path)
    setattr(module, _INPLACE_ATTR, tuple(paths))
    return tuple(paths)


_INPLACE_ATTR = "_xengine_inplace_modules"


def _target_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_module" or node.op == "call_method":
        return str(t)
    return getattr(t, "__name__", None) or getattr(t, "__qualname__", None) or str(t)


def _unique_name(name: str, taken: set[str]) -> str:
    out, k = name, 1
    while out in taken:
        out = f"{name}_{k}"
        k += 1
    taken.add(out)
    return out


# ---------------------------------------------------------------------- capture
def trace(
    module: nn.Module,
    example_input: torch.Tensor,
    target: torch.Tensor,
    mode: str = "train",
    name: str = "model",
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    leaf_modules: Sequence[type[nn.Module]] = (),
) -> CapturedModel:
    """Trace ``module`` and build its training (``mode="train"``) or inference graph.

    The module is put in train or eval mode and its in-place flags are switched off (same
    numbers). The training loss is ``loss_fn(output, target)`` (a scalar tensor), by default
    cross-entropy with ``target`` holding class indices.

    Granularity: every ``torch.nn`` module (Linear, LayerNorm, MultiheadAttention, ...) and
    every tensor function between them is one op; a module of a class in ``leaf_modules`` is
    one op as well, its inside not traced (a user's attention block, say).

    ``workspace_bytes`` of a node is the memory it needs only while it runs; here it is the
    bytes of the parameter gradients a backward node produces. Measuring it on an allocator
    runs the nodes with the executor, so it belongs to the profile stage (the graph stage
    never runs the executor): ``xengine.profile.workspace.fill_workspaces``, or
    ``xengine.profile.workspace.capture``, which is this function followed by it.
    """
    if mode not in MODES:
        raise GraphError(f"mode {mode!r} is not one of {MODES}")
    if not isinstance(example_input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise GraphError("example_input and target must be tensors")
    module.train(mode == "train")
    inplace_paths = _disable_inplace(module)
    gm = _symbolic_trace(module, tuple(leaf_modules), name)
    gm.train(mode == "train")

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise GraphError(
            f"{name}: the model's forward takes {len(placeholders)} inputs; capture needs one"
        )
    x_node = placeholders[0]
    out_nodes = [n for n in gm.graph.nodes if n.op == "output"]
    out_arg = out_nodes[0].args[0]
    if not isinstance(out_arg, fx.Node):
        raise GraphError(
            f"{name}: the model returns {type(out_arg).__name__}; capture needs one tensor"
        )

    # the capture run must leave the module and the random state as they were
    with TorchState(gm.buffers()):
        specs, out_spec = _trace_ops(
            gm, x_node, out_arg, example_input, target, mode, name, loss_fn
        )

    graph = _build_graph(gm, specs, example_input, target, mode, name)
    cap = CapturedModel(
        graph=graph,
        module=module,
        example_input=example_input,
        target=target,
        mode=mode,
        gm=gm,
        ops=tuple(specs),
        net=name,
        meta=dict(graph.meta),
        loss_fn=loss_fn,
        inplace_modules=inplace_paths,
    )
    cap.graph = replace(graph, meta={**graph.meta, "workspace": "parameter gradients"})
    cap.meta = dict(cap.graph.meta)
    return cap


class _LeafTracer(fx.Tracer):
    """fx's tracer with the user's module classes kept whole (one op each)."""

    def __init__(self, leaf_modules: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self.leaf_modules = leaf_modules

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaf_modules) or super().is_leaf_module(m, module_qualified_name)


def _symbolic_trace(
    module: nn.Module, leaf_modules: tuple[type[nn.Module], ...], name: str
) -> fx.GraphModule:
    """The fx graph of ``module``; one line naming why when fx cannot trace it (control flow
    that depends on a tensor's value, most often)."""
    tracer = _LeafTracer(leaf_modules)
    try:
        graph = tracer.trace(module)
    except Exception as exc:  # fx raises many kinds of errors for untraceable code
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GraphError(f"{name}: torch.fx cannot trace the model: {why}") from exc
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _trace_ops(
    gm: fx.GraphModule,
    x_node: fx.Node,
    out_arg: fx.Node,
    x: torch.Tensor,
    target: torch.Tensor,
    mode: str,
    name: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[OpSpec], OpSpec]:
    """Run the forward ops one by one on the example batch and describe each (docs/design.md
    section 3): the ops and their measurements, in trace order, and the output op.

    Per fx node: its argument template (:func:`_op_template`), one run on fresh leaves that
    alias its inputs, under saved-tensor hooks (:func:`_run_once`), and what that run shows
    (:func:`_describe_output`). A node whose result is not a tensor (a size, a shape) is
    folded into its readers as a constant. Then only the ops the output depends on are kept
    (:func:`_live_ops`) and, for training, the output and target are checked against the
    loss (:func:`_check_loss_shapes`)."""
    train = mode == "train"
    values: dict[fx.Node, Any] = {x_node: x}
    spec_of: dict[fx.Node, OpSpec] = {}
    order: list[fx.Node] = []
    param_name_of = {id(p): n for n, p in gm.named_parameters()}
    fixed = fixed_storage_ptrs(gm, x, target)
    folded: dict[fx.Node, fx.Node] = {}  # getitem node -> the tuple op it selects from
    views: set[fx.Node] = set()  # view ops folded into their readers

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node in folded:
            continue
        if node.op == "get_attr":
            values[node] = _Slot("attr", path=str(node.target))
            continue
        spec, inputs = _op_template(
            gm, node, x_node, values, spec_of, param_name_of, name, folded, views
        )
        in_vals = [values[u] for u in inputs]
        in_specs = [spec_of[u] for u in inputs]
        leaves = [
            alias_leaf(t, train and s.requires_grad) for t, s in zip(in_vals, in_specs, strict=True)
        ]
        y, saved, stochastic, mutates = _run_once(gm, node, spec, leaves, x, train, name)
        if node is not out_arg and _is_view(y, in_vals, fixed, spec, stochastic or mutates):
            views.add(node)  # its readers evaluate it on its base (:class:`_View`)
            del saved[:]
            continue
        if not isinstance(y, torch.Tensor) and _contains_tensor(y):
            spec.select = _selected_element(node, y, name)
            folded.update((u, node) for u in node.users)
            y = y[spec.select]
        if not isinstance(y, torch.Tensor):
            values[node] = y  # a non-tensor value (a size, a shape): folded as a constant
            continue
        y = _describe_output(spec, y, saved, inputs, in_vals, in_specs, leaves, fixed, train)
        spec.stochastic = stochastic
        spec.mutates_buffers = mutates
        values[node] = y.detach()
        spec_of[node] = spec
        order.append(node)
        del saved[:]

    out_arg = folded.get(out_arg, out_arg)
    if views:
        log.debug("%s: %d view ops folded into their readers", name, len(views))
    specs = _live_ops(spec_of, order, out_arg, name)
    out = specs[-1]
    if train:
        _check_loss(out, values[out_arg], x, target, name, loss_fn)
    return specs, out


def _is_view(
    y: Any, in_vals: list[torch.Tensor], fixed: set[int], spec: OpSpec, side_effects: bool
) -> bool:
    """Whether the op only looks at existing storage another way (``view``, ``reshape`` of a
    contiguous tensor, ``transpose``, ``flatten``, slicing, ``split``, ``expand``, dropout with
    p = 0): its result, a tensor or a tuple of tensors, holds no storage but an op input's or
    fixed memory's (the batch, a parameter, a buffer). Such an op is folded into its readers
    (:class:`_View`), so the storage is counted once, as its base's value or as fixed memory,
    and kept as long as any reader needs it, as in a plain PyTorch step. The model's output is
    never folded (the loss reads it): when it is a view it is copied."""
    if side_effects or (spec.module_path is not None and spec.param_names):
        return False
    tensors = list(y) if isinstance(y, (tuple, list)) else [y]
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    bases = {storage_ptr(t) for t in in_vals} | fixed
    bases.discard(0)
    return all(t.numel() > 0 and storage_ptr(t) in bases for t in tensors)


def _selected_element(node: fx.Node, y: Any, name: str) -> int:
    """The one element of a tuple result that the model uses: every reader of ``node`` must
    be ``result[k]`` with the same constant ``k`` (nn.MultiheadAttention: the output, not the
    weights). A graph node holds one tensor, so a tuple of which several elements are read is
    refused, naming the op and the way around it."""
    what = f"op {node.name!r} ({_target_name(node)})"
    if not node.users:
        return 0  # read by nobody: not a node of the graph anyway (_live_ops)
    used = set()
    for u in node.users:
        k = u.args[1] if u.op == "call_function" and u.target is operator.getitem else None
        if not isinstance(k, int) or len(u.args) != 2:
            raise GraphError(
                f"{name}: {what} returns a {type(y).__name__} of tensors that {u.name!r} reads "
                "whole; capture needs one tensor per op"
            )
        if u.users:  # ``x, _ = attention(...)`` makes a getitem for ``_`` that nobody reads
            used.add(k)
    kind = "tuple" if isinstance(y, tuple) else type(y).__name__
    if len(used) != 1 or not isinstance(y[next(iter(used))], torch.Tensor):
        ks = ", ".join(str(k) for k in sorted(used)) or "none"
        raise GraphError(
            f"{name}: {what} returns a {kind} of which elements {ks} are used; "
            "capture makes one node per op and needs exactly one tensor of it: make the "
            "module that calls it a leaf (capture(..., leaf_modules=(TheModule,)))"
        )
    return next(iter(used))


def _op_template(
    gm: fx.GraphModule,
    node: fx.Node,
    x_node: fx.Node,
    values: dict[fx.Node, Any],
    spec_of: dict[fx.Node, OpSpec],
    param_name_of: dict[int, str],
    name: str,
    folded: dict[fx.Node, fx.Node] | None = None,
    views: set[fx.Node] | None = None,
) -> tuple[OpSpec, list[fx.Node]]:
    """The op of ``node`` as an :class:`OpSpec` not yet measured, and the op nodes it reads
    (distinct, in argument order; ``folded`` maps a ``getitem`` folded into a tuple op to it;
    a view in ``views`` becomes a :class:`_View` on the nodes it reads in turn).

    Its arguments become a template: tensors of earlier ops are input slots, the batch is
    ``x``, everything else a constant, so the executor can bind the op to any device's model
    copy. In-place functions are refused or switched off (module docstring); the parameters
    it uses (its module's, or ones passed to a function) are the gradients ``B_v`` makes."""
    inputs: list[fx.Node] = []
    reads_x = False

    def to_slot(a: fx.Node) -> Any:
        nonlocal reads_x
        a = (folded or {}).get(a, a)
        if views and a in views:
            return _View(
                a.op,
                a.target,
                fx.node.map_arg(a.args, to_slot),
                dict(fx.node.map_arg(a.kwargs, to_slot)),
            )
        if a is x_node:
            reads_x = True
            return _Slot("x")
        if a in spec_of:
            if a not in inputs:
                inputs.append(a)
            return _Slot("in", inputs.index(a))
        return values[a]  # a constant: folded non-tensor value or an attribute

    args = fx.node.map_arg(node.args, to_slot)
    kwargs = dict(fx.node.map_arg(node.kwargs, to_slot))
    if node.op == "call_function" and kwargs.get("inplace") is True:
        kwargs.pop("inplace")
    if node.op == "call_function" and node.target in (operator.iadd, operator.imul):
        raise GraphError(f"{name}: op {node.name!r} is an in-place {_target_name(node)}")
    what = _target_name(node)
    if node.op != "call_module" and what.endswith("_") and not what.startswith("_"):
        raise GraphError(
            f"{name}: op {node.name!r} ({what}) changes its input in place; capture needs "
            f"ops that leave their inputs as they are (write {what[:-1]} instead)"
        )
    module_path = str(node.target) if node.op == "call_module" else None
    pnames: list[str] = []
    if module_path is not None:
        sub = gm.get_submodule(module_path)
        # by the root's name of each parameter: a weight two modules share (a language
        # model's head tied to its token embedding) is one parameter under one name
        pnames = [param_name_of[id(p)] for p in sub.parameters() if p.requires_grad]

    def find_params(a: Any) -> None:
        if isinstance(a, _View):  # a parameter the view reads: its gradient is this op's
            find_params(a.args)
            find_params(a.kwargs)
            return
        if isinstance(a, _Slot) and a.kind == "attr":
            a = _get_attr(gm, a.path)
        if isinstance(a, nn.Parameter) and a.requires_grad and id(a) in param_name_of:
            if param_name_of[id(a)] not in pnames:
                pnames.append(param_name_of[id(a)])
        elif isinstance(a, (tuple, list)):
            for b in a:
                find_params(b)
        elif isinstance(a, dict):
            for b in a.values():
                find_params(b)

    find_params(args)
    find_params(kwargs)
    spec = OpSpec(
        index=-1,
        name=node.name,
        op=node.op,
        target=node.target,
        args=args,
        kwargs=kwargs,
        inputs=(),  # filled by _describe_output, once we know the result is a tensor
        reads_x=reads_x,
        module_path=module_path,
        param_names=tuple(pnames),
    )
    return spec, inputs


def _run_once(
    gm: fx.GraphModule,
    node: fx.Node,
    spec: OpSpec,
    leaves: list[torch.Tensor],
    x: torch.Tensor,
    train: bool,
    name: str,
) -> tuple[Any, list[torch.Tensor], bool, bool]:
    """Run the op once on ``leaves``: its result, the tensors autograd saved for its
    backward (caught with :func:`torch.autograd.graph.saved_tensors_hooks`; the list stays
    the one the hooks read, so empty it once the op is described), and whether the op drew
    random numbers (the CPU generator moved) or changed its module's buffers (their version
    counters moved): the executor replays the one and restores the other on a recomputation
    (docs/design.md section 8). A failing op is a :class:`GraphError` that names it."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> int:
        saved.append(t)
        return len(saved) - 1

    def unpack(i: int) -> torch.Tensor:
        return saved[i]

    module_path = spec.module_path
    run = spec.bind(gm)
    rng0 = TorchState()  # compared with afterwards: did the op draw random numbers?
    versions0 = [b._version for b in gm.get_submodule(module_path).buffers()] if module_path else []
    try:
        with (
            torch.set_grad_enabled(train),
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
        ):
            y = run(leaves, x)
    except Exception as exc:
        raise _op_failure(gm, node, x, name, exc) from exc
    stochastic = rng0.rng_moved()
    mutates = bool(
        module_path and [b._version for b in gm.get_submodule(module_path).buffers()] != versions0
    )
    return y, saved, stochastic, mutates


def _op_failure(
    gm: fx.GraphModule, node: fx.Node, x: torch.Tensor, name: str, exc: Exception
) -> Exception:
    """Whose failure an op's is: the user's when the model itself fails on the example batch
    (a :class:`GraphError`, one line), ours when the model runs and only our replay of the op
    fails (an :class:`InternalError`)."""
    what = f"op {node.name!r} ({_target_name(node)})"
    try:
        with torch.no_grad():
            gm(x)
    except Exception as model_exc:
        return GraphError(f"{name}: the model fails on the example batch at {what}: {model_exc}")
    return InternalError(
        f"{name}: capturing {what} failed although the model runs on the example batch: "
        f"{type(exc).__name__}: {exc}"
    )


def _describe_output(
    spec: OpSpec,
    y: torch.Tensor,
    saved: list[torch.Tensor],
    inputs: list[fx.Node],
    in_vals: list[torch.Tensor],
    in_specs: list[OpSpec],
    leaves: list[torch.Tensor],
    fixed: set[int],
    train: bool,
) -> torch.Tensor:
    """Fill in ``spec`` from one run of the op and return its output, cloned where it
    shares storage with an input, a parameter or a buffer (every node owns its value).

    The saved tensors are sorted by storage, as docs/design.md section 3 says: an input's is a
    saved input (value edge ``F_u -> B_v``), the output's makes ``saves_output`` (``F_v ->
    B_v``), a parameter's or buffer's is fixed memory, anything else is the op's autograd
    state (``extra_bytes``). ``inputs`` are fx nodes here; :func:`_live_ops` renumbers."""
    in_ptrs = {storage_ptr(t): u for t, u in zip(in_vals, inputs, strict=True)}
    clone = storage_ptr(y) in in_ptrs or storage_ptr(y) in fixed or storage_ptr(y) == 0
    if clone and y.numel() > 0:
        with torch.set_grad_enabled(train):
            y = y.clone()
    out_ptr = storage_ptr(y)
    saved_inputs: list[fx.Node] = []
    saves_output = False
    extras: dict[int, int] = {}
    for t in saved:
        p = storage_ptr(t)
        if p == 0:
            continue
        if p in in_ptrs:
            if in_ptrs[p] not in saved_inputs:
                saved_inputs.append(in_ptrs[p])
        elif p == out_ptr:
            saves_output = True
        elif p not in fixed:
            extras[p] = int(t.untyped_storage().nbytes())

    spec.inputs = tuple(inputs)  # type: ignore[assignment]  # fx nodes, renumbered later
    spec.requires_grad = bool(train and y.requires_grad)
    spec.grad_inputs = tuple(u for u, s in zip(inputs, in_specs, strict=True) if s.requires_grad)
    spec.saved_inputs = tuple(saved_inputs)
    spec.saves_output = saves_output
    spec.extra_bytes = sum(extras.values())
    spec.output_bytes = int(y.untyped_storage().nbytes())
    spec.output_shape = tuple(y.shape)
    spec.output_dtype = str(y.dtype).removeprefix("torch.")
    spec.clone_output = bool(clone)
    if not spec.requires_grad:
        spec.param_names = ()
    spec.grad_alias = _gradient_aliases(y, leaves, in_specs) if spec.requires_grad else ()
    return y


def _live_ops(
    spec_of: dict[fx.Node, OpSpec], order: list[fx.Node], out_arg: fx.Node, name: str
) -> list[OpSpec]:
    """The ops the model's output depends on, in trace order, numbered 0.. (graph node
    ``i`` is ``ops[i]``) with their inputs renumbered: an op nobody reads is no node."""
    if out_arg not in spec_of:
        raise GraphError(f"{name}: the model's output is not computed by an op of the trace")
    live: set[fx.Node] = set()
    stack = [out_arg]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        stack.extend(spec_of[n].inputs)  # type: ignore[arg-type]
    order = [n for n in order if n in live]
    index = {n: i for i, n in enumerate(order)}
    specs = []
    for i, n in enumerate(order):
        s = spec_of[n]
        s.index = i
        s.inputs = tuple(index[u] for u in s.inputs)  # type: ignore[index]
        s.grad_inputs = tuple(index[u] for u in s.grad_inputs)  # type: ignore[index]
        s.saved_inputs = tuple(index[u] for u in s.saved_inputs)  # type: ignore[index]
        specs.append(s)
    return specs


def _check_loss(
    out: OpSpec,
    y: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    name: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> None:
    """The loss takes the model's output: a user's ``loss_fn`` must return one number for it
    (tried once on the example output), the default cross-entropy needs logits ``[batch,
    classes]`` and ``batch`` class indices as the target."""
    if loss_fn is not None:
        try:
            loss = loss_fn(y, target)
        except Exception as exc:
            raise GraphError(f"{name}: loss_fn failed on the model's output: {exc}") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise GraphError(
                f"{name}: loss_fn must return a tensor with one element, got "
                f"{type(loss).__name__}{list(getattr(loss, 'shape', []))}"
            )
        return
    if len(out.output_shape) != 2 or out.output_shape[0] != x.shape[0]:
        raise GraphError(
            f"{name}: the model's output has shape {list(out.output_shape)}; the loss "
            "(cross-entropy) needs logits of shape [batch, classes]"
        )
    if tuple(target.shape) != (x.shape[0],):
        raise GraphError(
            f"{name}: target has shape {list(target.shape)}; expected [{x.shape[0]}] class indices"
        )


def gradient_key(t: torch.Tensor) -> tuple:
    """What makes two gradients the very same tensor: storage, offset, shape and strides."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def _gradient_aliases(y: torch.Tensor, leaves: list, in_specs: list) -> tuple[int, ...]:
    """Run the op's backward once (gradient of ones) and, per input that receives a gradient,
    the earlier such input whose gradient is the same tensor, or -1."""
    grad_leaves = [t for t, s in zip(leaves, in_specs, strict=True) if s.requires_grad]
    if len(grad_leaves) < 2:
        return (-1,) * len(grad_leaves)
    grads = torch.autograd.grad(y, grad_leaves, torch.ones_like(y), allow_unused=True)
    first: dict[tuple, int] = {}
    out = []
    for k, gk in enumerate(grads):
        if gk is None:
            out.append(-1)
            continue
        key = gradient_key(gk)
        out.append(first.get(key, -1))
        first.setdefault(key, k)
    return tuple(out)


def _contains_tensor(y: Any) -> bool:
    if isinstance(y, torch.Tensor):
        return True
    if isinstance(y, (tuple, list)):
        return any(_contains_tensor(a) for a in y)
    if isinstance(y, dict):
        return any(_contains_tensor(a) for a in y.values())
    return False


def _build_graph(
    gm: fx.GraphModule,
    specs: list[OpSpec],
    x: torch.Tensor,
    target: torch.Tensor,
    mode: str,
    name: str,
) -> Graph:
    nf = len(specs)
    taken: set[str] = set()
    nodes: list[Node] = []
    for s in specs:
        s.name = _unique_name(s.name, taken)
        state = s.extra_bytes if mode == "train" else 0
        nodes.append(Node(s.name, "fwd", s.output_bytes, state_bytes=state))
    edges: dict[tuple[int, int], bool] = {}
    state_edges: list[tuple[int, int]] = []
    for s in specs:
        for u in s.inputs:
            edges[(u, s.index)] = True
    train = mode == "train"
    params = dict(gm.named_parameters())
    fixed = sum(tensor_bytes(p) for p in params.values())
    fixed += sum(tensor_bytes(b) for b in gm.buffers())
    fixed += tensor_bytes(x) + tensor_bytes(target)
    if train:
        fixed += sum(tensor_bytes(p) for p in params.values() if p.requires_grad)
        loss = nf
        out = specs[-1]
        logits_bytes = int(torch.Size(out.output_shape).numel()) * _itemsize(out.output_dtype)
        nodes.append(Node(_unique_name(LOSS_NAME, taken), "loss", logits_bytes))
        edges[(out.index, loss)] = True
        consumers: dict[int, list[int]] = {i: [] for i in range(nf)}
        for s in specs:
            for u in s.grad_inputs:
                consumers[u].append(s.index)

        def bwd(i: int) -> int:
            return 2 * nf - i

        for j in range(nf):
            s = specs[nf - 1 - j]
            alias = s.grad_alias or (-1,) * len(s.grad_inputs)
            grad_bytes = sum(
                int(torch.Size(specs[u].output_shape).numel()) * _itemsize(specs[u].output_dtype)
                for u, a in zip(s.grad_inputs, alias, strict=True)
                if a < 0  # a gradient handed to two inputs is one tensor
            )
            ws = sum(tensor_bytes(params[p]) for p in s.param_names)
            nodes.append(
                Node(
                    _unique_name(BWD_PREFIX + s.name, taken),
                    "bwd",
                    grad_bytes,
                    workspace_bytes=ws,
                    fwd_index=s.index,
                )
            )
        for s in specs:
            v = s.index
            if v == out.index:
                edges[(loss, bwd(v))] = True
            for w in consumers[v]:
                edges[(bwd(w), bwd(v))] = True
            state_edges.append((v, bwd(v)))  # the grad_fn: stays where F_v ran
            if s.saves_output:
                edges[(v, bwd(v))] = True
            for u in s.saved_inputs:
                edges.setdefault((u, bwd(v)), True)
    structure = json.dumps(
        [[n.name, n.kind, n.state_bytes] for n in nodes]
        + sorted([list(k) for k in edges])
        + sorted([[*k, "state"] for k in state_edges]),
        sort_keys=True,
    )
    meta = {
        "net": name,
        "mode": mode,
        "batch_size": int(x.shape[0]),
        "input_shape": [int(d) for d in x.shape],
        "image_size": int(x.shape[-1]) if x.dim() == 4 else None,
        "dtype": str(x.dtype).removeprefix("torch."),
        "num_classes": int(specs[-1].output_shape[-1]) if specs[-1].output_shape else None,
        "n_forward": nf,
        "param_bytes": int(sum(tensor_bytes(p) for p in params.values())),
        "capture": "torch.fx",
        # the executor's loss lets go of the logits before its gradient where it can
        # (Graph.released_logits, docs/design.md section 8)
        "loss_releases_logits": mode == "train",
        "graph_sha": hashlib.sha256(structure.encode()).hexdigest()[:16],
    }
    return Graph(
        name=name,
        nodes=tuple(nodes),
        edges=tuple(Edge(u, v, c) for (u, v), c in sorted(edges.items()))
        + tuple(Edge(u, v, False, "state") for u, v in sorted(state_edges)),
        fixed_bytes=int(fixed),
        meta=meta,
    )


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


# ---------------------------------------------------------------------- named nets
def known_nets() -> tuple[str, ...]:
    """Every name ``net=`` takes: the nets written here and every classification model of
    ``torchvision.models.list_models(module=torchvision.models)`` (weights never downloaded)."""
    import torchvision

    listed = torchvision.models.list_models(module=torchvision.models)
    return tuple(dict.fromkeys([*TORCHVISION_NETS, *sorted(listed)]))


def check_net_name(net: str) -> None:
    """An unknown name is one line naming the closest known ones."""
    names = known_nets()
    if net in names:
        return
    close = difflib.get_close_matches(net, names, n=4, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(names)}"
    raise GraphError(
        f"unknown net {net!r}: {hint} (any torchvision classification model, tiny, "
        "gpt2_small, hf_gpt2, hf_llama)"
    )


def _build_net(
    net: str,
    num_classes: int,
    image_size: int,
    num_layers: int | None = None,
    width: int | None = None,
    granularity: str = "module",
) -> tuple[nn.Module, tuple[type[nn.Module], ...]]:
    """The module and the classes that are one op each (beyond torch.nn's)."""
    if net in ("hf_gpt2", "hf_llama"):
        from xengine.graph.hf_nets import build_hf

        return build_hf(net, num_classes, image_size, num_layers, width, granularity)
    if net == "gpt2_small":
        from xengine.graph.nets import CausalSelfAttention, GPTConfig, GPTDecoder

        module = GPTDecoder(GPTConfig(vocab_size=num_classes, seq_len=image_size))
        return module, (CausalSelfAttention,) if granularity == "module" else ()
    return _build_torchvision(net, num_classes, image_size), ()


def _build_torchvision(net: str, num_classes: int, image_size: int) -> nn.Module:
    if net == "tiny":
        return TinyNet(num_classes=num_classes, image_size=image_size)
    import torchvision

    build = torchvision.models.get_model_builder(net)
    if net.startswith("vit_"):  # a ViT is built for one image size, a multiple of its patch
        patch = int(net.rsplit("_", 1)[1])
        if image_size % patch:
            raise GraphError(f"{net}: image size {image_size} is not a multiple of {patch}")
        return build(weights=None, image_size=image_size, num_classes=num_classes)
    if net in ("googlenet", "inception_v3"):  # no auxiliary heads: one output, one loss
        return build(weights=None, aux_logits=False, init_weights=True, num_classes=num_classes)
    return build(weights=None, num_classes=num_classes)


def trace_net(
    net: str,
    batch_size: int,
    mode: str = "train",
    image_size: int | None = None,
    num_classes: int | None = None,
    seed: int = 0,
    granularity: str = "module",
    num_layers: int | None = None,
    width: int | None = None,
) -> CapturedModel:
    """Capture a named network with seeded random weights (nothing is downloaded).

    ``image_size`` defaults to 224 (32 for ``tiny``), ``num_classes`` to 1000 (10 for
    ``tiny``, the model's own vocabulary for ``hf_gpt2`` and ``hf_llama``). The input batch
    is standard normal and the targets uniform class indices, both drawn from a generator
    seeded with ``seed``; the global random state is left untouched.
    A token net (:data:`TOKEN_NETS`, ``gpt2_small``: :class:`xengine.graph.nets.GPTDecoder`)
    reads ``batch_size`` sequences of ``image_size`` token ids (default 64) from a vocabulary
    of ``num_classes`` (default 512), learns the next token at every position, and has its
    attention blocks as single ops unless ``granularity="function"`` (:data:`GRANULARITIES`);
    ``num_layers`` and ``width`` size a token net (:data:`SIZED_NETS`; None: its default).
    A token net's targets are the next token at every position (one random sequence, shifted).
    Workspaces are the parameter gradients, as in :func:`capture`;
    ``xengine.profile.workspace.capture_net`` measures them too.
    """
    check_net_name(net)
    if granularity not in GRANULARITIES:
        raise GraphError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if batch_size < 1:
        raise GraphError(f"batch size must be at least 1, got {batch_size}")
    if (num_layers is not None or width is not None) and net not in SIZED_NETS:
        raise GraphError(f"{net}: net.num_layers and net.width size only {', '.join(SIZED_NETS)}")
    token = net in TOKEN_NETS
    if image_size is None:
        image_size = 32 if net == "tiny" else 64 if token else 224
    if num_classes is None and net in SIZED_NETS:
        from xengine.graph.hf_nets import DEFAULTS

        num_classes = DEFAULTS[net]["vocab"]
    if num_classes is None:
        num_classes = 10 if net == "tiny" else 512 if token else 1000
    # torch warns while building a net of absurd sizes (zero-element weights at 1 px); the
    # capture then fails with our one line, so the warnings wait for its outcome
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the CPU generator is put back (manual_seed seeds CUDA's too, left seeded)
        with TorchState():
            torch.manual_seed(seed)
            module, leaves = _build_net(
                net, num_classes, image_size, num_layers, width, granularity
            )
        gen = torch.Generator().manual_seed(seed)
        if token:
            from xengine.graph.nets import next_token_batch

            x, target = next_token_batch(num_classes, batch_size, image_size, gen)
        else:
            x = torch.randn(batch_size, 3, image_size, image_size, generator=gen)
            target = torch.randint(0, num_classes, (batch_size,), generator=gen)
    kwargs: dict[str, Any] = {}
    if token:
        from xengine.graph.nets import token_cross_entropy

        kwargs = {"loss_fn": token_cross_entropy, "leaf_modules": leaves}
    cap = trace(module, x, target, mode=mode, name=net, **kwargs)
    for w in caught:
        log.warning("%s (building %s): %s", w.category.__name__, net, w.message)
    sizes = {"num_layers": num_layers, "width": width} if net in SIZED_NETS else {}
    cap.graph = replace(
        cap.graph, meta={**cap.graph.meta, "seed": seed, "granularity": granularity, **sizes}
    )
    cap.meta = dict(cap.graph.meta)
    return cap
