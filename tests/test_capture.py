"""Capture of torch models as training graphs (xengine/graph/capture.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from _nets import resnet18_small, tiny
from torch import nn

from xengine.graph.capture import TORCHVISION_NETS
from xengine.graph.types import GraphError
from xengine.profile.workspace import capture, capture_net


def names(g):
    return [v.name for v in g.nodes]


def readers(g, name: str) -> set[str]:
    """Names of the nodes that node ``name`` reads."""
    i = names(g).index(name)
    return {g.nodes[u].name for u in g.predecessors[i]}


def edge(g, src: str, dst: str, kind: str = "value"):
    n = names(g)
    es = [e for e in g.edges if e.src == n.index(src) and e.dst == n.index(dst) and e.kind == kind]
    assert len(es) <= 1
    return es[0] if es else None


def test_unknown_net_names_the_choices():
    with pytest.raises(GraphError, match=r"unknown net 'x': choose one of .*resnet18"):
        capture_net("x", 2)
    for net in ("tiny", "resnet18", "resnet34", "resnet50", "vgg16", "vgg19", "googlenet"):
        assert net in TORCHVISION_NETS
    assert "mobilenet_v2" in TORCHVISION_NETS


def test_tiny_graph_shape_and_order():
    cap = tiny()
    g = cap.graph
    nf = cap.n_forward
    assert nf == 10  # conv bn relu conv bn add relu pool dropout fc (flatten: a view, folded)
    assert g.size == 2 * nf + 1
    assert [v.kind for v in g.nodes] == ["fwd"] * nf + ["loss"] + ["bwd"] * nf
    assert all(e.src < e.dst for e in g.edges)
    # backward nodes mirror the forward ones, in reverse order
    for j in range(nf):
        b = g.nodes[nf + 1 + j]
        assert b.fwd_index == nf - 1 - j
        assert b.name == "grad_" + g.nodes[b.fwd_index].name
    # the loss reads the logits; the last backward node gets the loss's gradient
    assert readers(g, "loss") == {"fc"}
    assert "loss" in readers(g, "grad_fc")
    # every backward node reads its forward node's autograd state, which cannot be copied;
    # its value only where autograd saved it (relu: yes, batch norm and add: no)
    for j in range(nf):
        v = g.nodes[j].name
        assert edge(g, v, "grad_" + v, "state").copyable is False
    assert edge(g, "relu1", "grad_relu1").copyable is True
    assert edge(g, "bn1", "grad_bn1") is None and edge(g, "add", "grad_add") is None
    assert len(g.state_edges) == nf
    # costs are empty; bytes are measured
    assert all(not v.cost_s for v in g.nodes)
    assert all(v.output_bytes > 0 for v in g.nodes if v.kind != "bwd")


def test_tiny_backward_edges_follow_what_autograd_saves():
    g = tiny().graph
    # a convolution's backward needs its input (for the weight gradient), not its output
    assert readers(g, "grad_conv2") == {"relu1", "grad_bn2"}
    # batch norm's backward reads its input (the conv output), not its own output
    assert readers(g, "grad_bn2") == {"conv2", "grad_add"}
    # relu saves its output only: its backward does not read bn1
    assert readers(g, "grad_relu1") == {"relu1", "grad_add", "grad_conv2"}
    assert "bn1" not in readers(g, "grad_relu1")
    # add saves nothing: its backward reads only the gradient (and its state, by a state link)
    assert readers(g, "grad_add") == {"grad_relu2"}
    # max-pool reads its input in backward; linear its input
    assert "relu2" in readers(g, "grad_pool")
    assert readers(g, "grad_fc") == {"drop", "loss"}


def test_tiny_bytes():
    cap = tiny()
    g = cap.graph
    b, w = cap.batch_size, 8
    f4 = 4
    by = {v.name: v for v in g.nodes}
    act = b * w * 32 * 32 * f4
    assert by["conv1"].output_bytes == act
    # batch norm's state is its saved mean and inverse std (2 x channels floats)
    assert by["bn1"].output_bytes == act and by["bn1"].state_bytes == 2 * w * f4
    # max pool's state is its int64 indices
    pooled = b * w * 16 * 16
    assert by["pool"].output_bytes == pooled * f4 and by["pool"].state_bytes == pooled * 8
    # dropout's state is its mask, a float tensor on the CPU
    assert by["drop"].output_bytes == pooled * f4 and by["drop"].state_bytes == pooled * f4
    assert by["conv1"].state_bytes == 0 and by["relu1"].state_bytes == 0
    assert by["loss"].output_bytes == b * 10 * f4
    # a backward node outputs the gradients of its inputs that come from other nodes
    # ... once for a gradient that autograd hands to two inputs (add's backward)
    assert by["grad_add"].output_bytes == act
    assert {s.name: s for s in cap.ops}["add"].grad_alias == (-1, 0)
    assert by["grad_conv1"].output_bytes == 0  # its input is the batch: no gradient
    # ... and needs at least its parameter gradients while it runs
    assert by["grad_conv2"].workspace_bytes >= w * w * 9 * f4
    assert by["grad_fc"].workspace_bytes >= (w * 16 * 16 * 10 + 10) * f4
    params = sum(p.numel() * 4 for p in cap.module.parameters())
    bufs = sum(t.numel() * t.element_size() for t in cap.module.buffers())
    batch = cap.example_input.numel() * 4 + cap.target.numel() * 8
    assert g.fixed_bytes == 2 * params + bufs + batch


def test_tiny_op_flags():
    cap = tiny()
    by = {s.name: s for s in cap.ops}
    assert by["drop"].stochastic and not by["conv1"].stochastic
    assert by["bn1"].mutates_buffers and not by["conv1"].mutates_buffers
    # flatten is a view of the pool's output: folded into its reader, which reads the pool
    assert "flatten" not in by and by["drop"].inputs == (by["pool"].index,)
    assert not any(s.clone_output for s in cap.ops)
    assert by["relu1"].saves_output and by["relu1"].saved_inputs == ()
    assert not any(getattr(m, "inplace", False) for m in cap.module.modules())


def test_capture_leaves_no_trace():
    torch.manual_seed(3)
    net = capture_net("tiny", 2, measure_workspace=False).module
    before = {n: b.clone() for n, b in net.named_buffers()}
    x = torch.randn(2, 3, 32, 32)
    state = torch.get_rng_state()
    cap = capture(net, x, torch.tensor([1, 2]))  # measures workspaces: runs a whole step
    assert any(s.stochastic for s in cap.ops)  # the dropout drew random numbers

    assert torch.equal(torch.get_rng_state(), state)
    for n, b in net.named_buffers():
        assert torch.equal(b, before[n]), n
    assert all(p.grad is None for p in net.parameters())


class _InplaceFunctional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        y = F.relu(self.lin(x), inplace=True)
        return y * 2 + y


def test_inplace_kwargs_are_dropped_and_numbers_agree():
    torch.manual_seed(0)
    m = _InplaceFunctional()
    x = torch.randn(3, 6)
    expected = m(x)
    cap = capture(m, x, torch.tensor([0, 1, 2]), measure_workspace=False)
    relu = [s for s in cap.ops if s.name == "relu"][0]
    assert "inplace" not in relu.kwargs
    torch.testing.assert_close(cap.gm(x), expected, rtol=0, atol=0)
    # y * 2 reads y; (y*2) + y reads both
    g = cap.graph
    assert readers(g, "add") == {"mul", "relu"}


class _Chunky(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        return a + b


def test_a_tuple_of_views_is_folded_into_its_reader():
    """``chunk`` returns views of the batch: the add reads the batch itself (a tuple of new
    tensors of which two are used is refused: tests/test_transformers.py)."""
    x = torch.randn(2, 4)
    cap = capture(_Chunky(), x, torch.tensor([0, 1]), measure_workspace=False)
    assert [s.name for s in cap.ops] == ["add"] and cap.ops[0].reads_x
    run = cap.ops[0].bind(cap.gm)
    torch.testing.assert_close(run([], x), x[:, :2] + x[:, 2:], rtol=0, atol=0)


def test_infer_mode_has_only_forward_nodes():
    cap = capture_net("tiny", 2, mode="infer", measure_workspace=False)
    assert {v.kind for v in cap.graph.nodes} == {"fwd"}
    # 9: dropout in eval mode returns its input, a view folded into fc like flatten
    assert cap.graph.size == 9 and cap.loss_index is None
    assert not cap.module.training
    with pytest.raises(GraphError, match="mode"):
        capture_net("tiny", 2, mode="eval")


def test_resnet18_graph():
    cap = resnet18_small()
    g = cap.graph
    nf = cap.n_forward
    # 60 modules (20 conv, 20 bn, 17 relu calls, maxpool, avgpool, fc), 8 adds; flatten is
    # a view of avgpool's output, folded into fc
    assert nf == 68 and g.size == 137
    assert all(e.src < e.dst for e in g.edges)
    kinds = [v.kind for v in g.nodes]
    assert kinds == ["fwd"] * nf + ["loss"] + ["bwd"] * nf
    adds = [s for s in cap.ops if s.target is __import__("operator").add]
    assert len(adds) == 8 and all(len(s.inputs) == 2 for s in adds)
    # conv backward reads its input; relu backward reads only its own output
    assert readers(g, "grad_layer1_0_conv1") == {"maxpool", "grad_layer1_0_bn1"}
    # batch norm backward reads the conv output; nobody keeps a bn or add output for backward
    assert readers(g, "grad_layer1_0_bn1") == {"layer1_0_conv1", "grad_layer1_0_relu"}
    bwd = [v for v in g.nodes if v.kind == "bwd"]
    kept = {g.nodes[u].name for v in bwd for u in g.predecessors[g.nodes.index(v)]}
    kept_fwd = {k for k in kept if not k.startswith("grad_") and k != "loss"}
    assert kept_fwd and not any("bn" in k or k.startswith("add") for k in kept_fwd)
    assert readers(g, "grad_layer1_0_relu") == {"layer1_0_relu", "grad_layer1_0_conv2"}
    # the block input feeds conv1 and the residual add: its backward sums two contributions
    assert {"grad_layer1_0_conv1", "grad_add"} <= readers(g, "grad_maxpool")
    assert all(v.output_bytes > 0 for v in g.nodes if v.kind != "bwd")
    assert sum(v.output_bytes for v in g.nodes if v.kind == "bwd") > 0
    params = sum(p.numel() * 4 for p in cap.module.parameters())
    assert g.fixed_bytes > 2 * params
    meta = json.loads(json.dumps(dict(g.meta)))  # plain data, no tensors
    assert meta["net"] == "resnet18" and meta["batch_size"] == 2 and meta["image_size"] == 64
