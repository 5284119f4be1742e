"""transformers' GPT-2 and Llama as nets (issue 30, item 1): ``net=hf_gpt2``, ``net=hf_llama``.

Our forward composes the models' own modules (xengine/graph/hf_nets.py): its logits and its
next-token loss are transformers' own, bit for bit, at both granularities. Keep-everything
against a plain PyTorch step: equal at the default shapes (GPT-2 small as it is) and on a
small Llama at tensor-function granularity. Two gaps of the memory model are pinned here as
strict xfails (they turn red when fixed): GPT-2's tied head and embedding (autograd holds
the head's weight gradient until the embedding's arrives, which the model does not charge:
under-predicted) and ops kept whole or handing their gradient on unchanged
(over-predicted), both visible where they coincide with the peak (small widths)."""

from __future__ import annotations

import pytest
import torch

from baselines.checkmate import solve_checkmate
from xengine.config import ConfigError, RunConfig
from xengine.execute.executor import execute, reference_step
from xengine.execute.grads import check_grads
from xengine.graph.hf_nets import HF_NETS, build_hf, hf_model, shape_of
from xengine.graph.nets import next_token_batch, token_cross_entropy
from xengine.graph.types import GRANULARITIES, GraphError
from xengine.prepare import StartState
from xengine.problem import Instance
from xengine.profile.workspace import capture_net
from xengine.schedule import keep_all_schedule
from xengine.simulate import keep_all_peak_bytes
from xengine.solvers.model import SolverOptions

SMALL = {"num_classes": 512, "image_size": 32, "num_layers": 2, "width": 128}


def _costed(graph):
    return graph.with_costs({"cpu": {v.name: 1.0 for v in graph.nodes}})


def _keep_all_over_plain(cap) -> tuple[float, float]:
    """(predicted / plain, measured / plain) of keep-everything, from one start state."""
    inst = Instance.single(_costed(cap.graph), "cpu", None)
    start = StartState(cap.module)
    plain = reference_step(cap, n_steps=1, warmup=0)
    start.restore()
    run = execute(cap, inst, keep_all_schedule(inst), n_steps=1, warmup=0)
    start.restore()
    p = plain.peak_bytes["cpu"]
    return run.predicted_peak_bytes["cpu"] / p, run.peak_bytes["cpu"] / p


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("net", HF_NETS)
def test_the_composition_is_the_models_own_forward_and_loss(net, granularity):
    s = shape_of(net, 512, 32, 2, 128)
    torch.manual_seed(0)
    ours, _ = build_hf(net, 512, 32, 2, 128, granularity)
    torch.manual_seed(0)
    theirs = hf_model(net, s)
    ours.eval()
    theirs.eval()
    ids, _ = next_token_batch(512, 2, 32, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(ids)
        out = theirs(ids, labels=ids)  # transformers shifts the labels by one itself
    assert torch.equal(logits, out.logits)
    loss = token_cross_entropy(logits[:, :-1], ids[:, 1:])
    # the same loss up to the order of the mean's sum: transformers averages over every
    # position with the last one ignored, we over the shifted ones; on an AMD EPYC the two
    # differ in the last bit for hf_llama (7.6e-8 relative), on the Intel machines not at all
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=0.0)


def test_the_shapes_are_the_named_models():
    gpt2 = shape_of("hf_gpt2", None, 256, None, None)
    assert (gpt2.num_layers, gpt2.width, gpt2.heads, gpt2.vocab) == (12, 768, 12, 50257)
    llama = shape_of("hf_llama", None, 256, None, None)
    assert llama.kv_heads < llama.heads and llama.heads % llama.kv_heads == 0  # grouped
    assert llama.ffn % 32 == 0 and llama.ffn > 2 * llama.width  # SwiGLU's 8/3 x width
    with pytest.raises(GraphError, match="multiple of the head size 64"):
        shape_of("hf_gpt2", None, 256, 2, 100)
    with pytest.raises(GraphError, match="at least 1"):
        shape_of("hf_llama", None, 256, 0, None)


def test_sizes_are_refused_for_nets_they_do_not_size():
    with pytest.raises(ConfigError, match="size only hf_gpt2, hf_llama"):
        RunConfig(net="resnet18", num_layers=4).validate()
    with pytest.raises(ConfigError, match="net.width=0"):
        RunConfig(net="hf_llama", width=0).validate()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("net", HF_NETS)
def test_keep_all_at_the_default_shape_is_a_plain_step(net, granularity):
    """GPT-2 small as it is (12 layers, 768 wide, 50257 tokens) and the Llama-style default,
    256 tokens, batch 2: keep-everything measures a plain step's peak and the simulator
    predicts it (within 300 bytes of 1.06 GB and exactly; the peak is at the loss over the
    vocabulary, where neither gap below reaches)."""
    cap = capture_net(net, 2, image_size=256, granularity=granularity)
    assert cap.graph.size > (300 if net == "hf_gpt2" else 150)
    predicted, measured = _keep_all_over_plain(cap)
    assert measured == pytest.approx(1.0, abs=1e-6)
    assert predicted == pytest.approx(1.0, abs=1e-6)


def test_llama_keep_all_at_function_granularity_is_a_plain_step():
    cap = capture_net("hf_llama", 2, granularity="function", **{**SMALL, "image_size": 64})
    predicted, measured = _keep_all_over_plain(cap)
    assert measured == pytest.approx(1.0, abs=1e-6)
    assert predicted == pytest.approx(1.0, abs=1e-6)


@pytest.mark.xfail(strict=True, reason="the tied head's gradient, held by autograd, uncharged")
def test_gpt2_tied_head_gradient_is_charged():
    cap = capture_net("hf_gpt2", 2, granularity="function", **SMALL)
    predicted, measured = _keep_all_over_plain(cap)
    assert measured == pytest.approx(1.0, abs=1e-6)
    assert predicted == pytest.approx(1.0, abs=0.01)  # 0.94 today


@pytest.mark.xfail(strict=True, reason="RMSNorm kept whole: its saved tensors overcounted")
def test_llama_keep_all_at_module_granularity_is_exact_at_a_small_width():
    cap = capture_net("hf_llama", 2, **{**SMALL, "num_classes": 64, "image_size": 64})
    predicted, _ = _keep_all_over_plain(cap)
    assert predicted == pytest.approx(1.0, abs=0.01)  # 1.033 today


@pytest.mark.parametrize("net", HF_NETS)
def test_checkmate_at_half_the_memory_has_a_plain_steps_gradients(net):
    """Checkmate's schedule at 50 % of keep-everything, executed: plain PyTorch's loss and
    gradients. Its measured peak is the predicted one on Llama; on GPT-2 the two gaps above
    move it (the tied head's gradient: 1.2 % over the prediction at vocabulary 512)."""
    cap = capture_net(net, 2, **{**SMALL, "num_classes": 64})
    graph = _costed(cap.graph)
    budget = int(0.5 * keep_all_peak_bytes(graph, "cpu"))
    inst = Instance.single(graph, "cpu", budget)
    res = solve_checkmate(inst, options=SolverOptions(time_limit_s=15))  # GPT-2: 2 min to prove
    assert res.status in ("optimal", "feasible") and res.sim.n_recomputes > 0
    start = StartState(cap.module)
    plain = reference_step(cap, n_steps=1, warmup=0)
    start.restore()
    run = execute(cap, inst, res.schedule, n_steps=1, warmup=0)
    start.restore()
    assert check_grads(run, ("cpu",), {"cpu": plain})[0]
    if net == "hf_llama":
        measured, predicted = run.peak_bytes["cpu"], run.predicted_peak_bytes["cpu"]
        assert abs(measured - predicted) <= 0.01 * predicted
