"""Executing schedules with torch (xengine/execute/executor.py): same numbers as plain PyTorch,
memory measured from the allocator as the simulator predicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _nets import buffers, costed, resnet18_small, run_beside_reference, set_buffers, tiny
from _schedules import checkpoint_schedule, forward_devices

from xengine.execute.executor import PlainStep, execute, reference_step
from xengine.graph.capture import trace
from xengine.problem import Instance
from xengine.profile.workspace import capture_net
from xengine.schedule import Schedule, keep_all_schedule
from xengine.simulate import simulate


def single(cap, device: str = "cpu", budget: int | None = None) -> Instance:
    return Instance.single(costed(cap.graph, [device]), device, budget)


# Measured against predicted on the CPU allocator: 1 % (the bound is max(1 %, 1 MiB),
# which at these sizes would accept anything) plus 8 KiB for the random-state snapshot the
# executor keeps per dropout op (5 KiB on the CPU generator), which the graph does not count.
SLACK_BYTES = 8 * 1024


def within(measured: int, predicted: int, frac: float = 0.01) -> bool:
    return abs(measured - predicted) <= frac * predicted + SLACK_BYTES


# ---------------------------------------------------------------------- numbers
def test_tiny_keep_all_matches_plain_pytorch():
    cap = tiny()
    inst = single(cap)
    res, ref = run_beside_reference(cap, inst, keep_all_schedule(inst))
    assert np.isfinite(res.loss) and res.step_time_s > 0 and len(res.step_times_s) == 1
    # the comparison can fail: another random state draws other dropout masks
    start = buffers(cap)
    torch.manual_seed(1)
    other = execute(cap, inst, keep_all_schedule(inst), n_steps=1, warmup=0, measure_memory=False)
    set_buffers(cap, start)
    assert other.loss != ref.loss
    assert not torch.equal(other.param_grads["fc.weight"], ref.param_grads["fc.weight"])


def test_tiny_recomputation_from_scratch_matches_plain_pytorch():
    """Every backward stage recomputes the forward values it needs from the batch: dropout
    must replay its mask and batch norm must update its running statistics only once."""
    cap = tiny()
    inst = single(cap)
    sched = checkpoint_schedule(inst, keep=set())
    sim = simulate(inst, sched)
    by = {v.name: i for i, v in enumerate(cap.graph.nodes)}
    assert sim.n_recomputes > 20
    assert sched.R[0, :, by["drop"]].sum() > 1 and sched.R[0, :, by["bn1"]].sum() > 1
    run_beside_reference(cap, inst, sched)


def test_budgeted_schedule_repeats_the_same_step():
    cap = tiny()
    inst = single(cap)
    sched = checkpoint_schedule(inst, keep={0, 3, 6})
    start = buffers(cap)
    torch.manual_seed(0)
    res = execute(cap, inst, sched, n_steps=3, warmup=1, measure_memory=False)
    after = buffers(cap)
    set_buffers(cap, start)
    torch.manual_seed(0)
    one = execute(cap, inst, sched, n_steps=1, warmup=0, measure_memory=False)
    set_buffers(cap, start)
    # four steps leave the state of one: each step starts from the same state
    assert len(res.step_times_s) == 3 and res.step_time_s == sorted(res.step_times_s)[1]
    assert res.loss == one.loss
    for n, g in one.param_grads.items():
        assert torch.equal(res.param_grads[n], g), n
    assert not torch.equal(after["bn1.running_mean"], start["bn1.running_mean"])


def test_resnet18_keep_all_and_checkpointing_match_plain_pytorch():
    cap = resnet18_small()
    inst = single(cap)
    run_beside_reference(cap, inst, keep_all_schedule(inst))
    sched = checkpoint_schedule(inst, keep=set(range(0, cap.n_forward, 4)))
    sim = simulate(inst, sched)
    assert sim.n_recomputes > 0
    # batch-norm values are dropped and made again while their states are kept
    by = {v.name: i for i, v in enumerate(cap.graph.nodes)}
    bn = by["layer1_0_bn1"]
    assert sched.R[0, :, bn].sum() > 1 and sched.states_for(inst.graph)[0, :, bn].any()
    res, _ = run_beside_reference(cap, inst, sched, measure_memory=True)
    assert within(res.peak_bytes["cpu"], res.predicted_peak_bytes["cpu"]), res.peak_bytes


def test_two_logical_cpu_devices_match_plain_pytorch():
    cap = tiny()
    devices = ("cpu1", "cpu2")
    inst = Instance(costed(cap.graph, devices), devices, (10**9, 10**9))
    nf = cap.n_forward
    fwd_dev = [0 if v < nf // 2 else 1 for v in range(nf)]
    sched = checkpoint_schedule(
        inst, keep={0, 5, 8}, device_of=forward_devices(inst, fwd_dev, loss_device=1)
    )
    sim = simulate(inst, sched)
    assert sim.n_copies > 0 and sched.R[0].any() and sched.R[1].any()
    # other thread counts sum in another order: close, not bit-identical
    res, _ = run_beside_reference(cap, inst, sched, rtol=1e-4, atol=1e-6, measure_memory=True)
    for d in devices:
        assert res.peak_bytes[d] > 0
        assert within(res.peak_bytes[d], res.predicted_peak_bytes[d]), (d, res)


# ---------------------------------------------------------------------- memory
def test_tiny_measured_peak_is_the_predicted_peak():
    cap = tiny(8)
    inst = single(cap)
    keep_all = keep_all_schedule(inst)
    ckpt = checkpoint_schedule(inst, keep=set())
    peaks = {}
    for name, sched in (("keep_all", keep_all), ("recompute", ckpt)):
        res = execute(cap, inst, sched, n_steps=1, warmup=0)
        predicted = int(simulate(inst, sched).peak_bytes[0])
        assert res.predicted_peak_bytes["cpu"] == predicted
        assert within(res.peak_bytes["cpu"], predicted), (name, res.peak_bytes, predicted)
        assert res.fixed_bytes["cpu"] >= cap.graph.fixed_bytes > 0
        peaks[name] = res.peak_bytes["cpu"]
    # recomputation really frees memory: the allocator sees a lower peak
    assert peaks["recompute"] < 0.9 * peaks["keep_all"]


def test_budget_excess_is_reported():
    cap = tiny(8)
    sched_inst = single(cap)
    sched = keep_all_schedule(sched_inst)
    predicted = int(simulate(sched_inst, sched).peak_bytes[0])
    ok = execute(cap, single(cap, budget=predicted), sched, n_steps=1, warmup=0)
    assert ok.within_budget and ok.budget_tolerance_bytes > 0
    tight = single(cap, budget=predicted // 2)
    bad = execute(cap, tight, sched, n_steps=1, warmup=0, tolerance_min_bytes=0)
    assert not bad.within_budget and "cpu" in bad.violations[0]


@pytest.mark.slow
def test_resnet18_224_measured_peak_is_the_predicted_peak():
    cap = capture_net("resnet18", 4, image_size=224)
    inst = single(cap)
    for sched in (keep_all_schedule(inst), checkpoint_schedule(inst, keep=set(range(0, 69, 3)))):
        res = execute(cap, inst, sched, n_steps=1, warmup=0)
        predicted = int(simulate(inst, sched).peak_bytes[0])
        assert within(res.peak_bytes["cpu"], predicted), (res.peak_bytes, predicted)


def test_reference_step_peak_is_the_keep_all_peak():
    """Keep-all keeps what autograd keeps: its predicted peak is plain PyTorch's measured one
    (the graph counts values until their last reader and states until their backward)."""
    cap = tiny(8)
    start = buffers(cap)
    ref = reference_step(cap, n_steps=1, warmup=0)
    set_buffers(cap, start)
    inst = single(cap)
    keep_all = int(simulate(inst, keep_all_schedule(inst)).peak_bytes[0])
    assert abs(ref.peak_bytes["cpu"] - keep_all) <= 0.01 * keep_all, (ref.peak_bytes, keep_all)


# ---------------------------------------------------------------------- bad input
def test_schedule_for_other_devices_or_graph_is_rejected():
    cap = tiny()
    inst = single(cap)
    sched = keep_all_schedule(inst)
    other_dev = Schedule(("cpu1",), sched.R, sched.S)
    with pytest.raises(ValueError, match="devices"):
        execute(cap, inst, other_dev, n_steps=1, warmup=0)
    other = capture_net("tiny", 2, image_size=16, measure_workspace=False)
    with pytest.raises(ValueError, match="another graph"):
        execute(other, inst, sched, n_steps=1, warmup=0)
    small = single(resnet18_small())
    with pytest.raises(ValueError, match="nodes"):
        execute(cap, small, keep_all_schedule(small), n_steps=1, warmup=0)
    bad = Instance(costed(cap.graph, ["tpu"]), ("tpu",), (10**9,))
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        execute(cap, bad, Schedule(("tpu",), sched.R, sched.S), n_steps=1, warmup=0)


# ---------------------------------------------------------------------- cuda
@pytest.fixture
def exact_cuda():
    """Deterministic cuDNN, no TF32: a GPU step that can be compared bit for bit."""
    b = torch.backends
    saved = (b.cudnn.deterministic, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32)
    b.cudnn.deterministic, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = True, False, False
    yield
    b.cudnn.deterministic, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = saved


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_schedules_match_plain_pytorch_on_the_gpu(exact_cuda):
    """On the GPU alone the executor's loss and gradients are plain PyTorch's on the GPU."""
    cap = resnet18_small()
    inst = Instance(costed(cap.graph, ("cuda",)), ("cuda",), (10**10,))
    keep_third = checkpoint_schedule(inst, keep=set(range(0, cap.n_forward, 3)))
    for sched in (keep_all_schedule(inst), keep_third):
        res, _ = run_beside_reference(cap, inst, sched, measure_memory=True, ref_device="cuda")
        assert res.peak_bytes["cuda"] > 0 and res.fixed_bytes["cuda"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_and_gpu_schedule_within_the_spread_of_plain_steps(exact_cuda):
    """Half the forward pass on the GPU, the rest and the loss on the CPU: its gradients are
    within the pipeline's spread check of the plain CPU and GPU steps (which differ: the GPU
    adds reductions up in another order), and both devices' peaks are measured."""
    from xengine.execute.executor import reference_step
    from xengine.execute.grads import grads_within_spread

    cap = resnet18_small()
    devices = ("cpu", "cuda")
    inst = Instance(costed(cap.graph, devices), devices, (10**10, 10**10))
    nf = cap.n_forward
    fwd_dev = [1 if v < nf // 2 else 0 for v in range(nf)]
    sched = checkpoint_schedule(
        inst, keep=set(range(0, nf, 3)), device_of=forward_devices(inst, fwd_dev, loss_device=0)
    )
    start = buffers(cap)
    try:
        plain = []
        for d in devices:
            set_buffers(cap, start)
            torch.manual_seed(0)
            plain.append(reference_step(cap, n_steps=1, warmup=0, device=d, measure_memory=False))
        set_buffers(cap, start)
        torch.manual_seed(0)
        res = execute(cap, inst, sched, n_steps=1, warmup=0, measure_memory=True)
    finally:
        set_buffers(cap, start)
    ok, nearest = grads_within_spread(res, plain)
    assert ok, nearest
    assert res.n_copies > 0
    assert res.peak_bytes["cuda"] > 0 and res.peak_bytes["cpu"] > 0
    assert res.fixed_bytes["cuda"] > 0


class _FunctionalParams(torch.nn.Module):
    """A parameter used by a function (an fx ``get_attr``), a view op and a three-way sum."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 5))
        self.lin = torch.nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(x @ self.w)
        s = h + h.sin() + h.cos()
        return self.lin(s.view(s.shape[0], -1))


def test_functional_parameters_and_folded_sizes_match_plain_pytorch():
    from xengine.profile.workspace import capture

    torch.manual_seed(0)
    cap = capture(_FunctionalParams(), torch.randn(4, 6), torch.tensor([0, 1, 2, 0]))
    by = {v.name: i for i, v in enumerate(cap.graph.nodes)}
    # the view (with x.shape[0] folded into a constant) is folded into lin, which reads add_1
    assert "matmul" in by and "view" not in by
    assert [s.inputs for s in cap.ops if s.name == "lin"] == [(by["add_1"],)]
    assert [s.param_names for s in cap.ops if s.name == "matmul"] == [("w",)]
    inst = single(cap)
    # h has three consumers: their gradients are summed in autograd's order, bit for bit
    res, _ = run_beside_reference(cap, inst, keep_all_schedule(inst), rtol=0, atol=0)
    assert res.param_grads["w"].abs().sum() > 0
    run_beside_reference(cap, inst, checkpoint_schedule(inst, keep=set()), rtol=0, atol=0)


def test_inference_graph_runs_forward_only():
    cap = capture_net("tiny", 4, mode="infer")
    inst = single(cap)
    sched = checkpoint_schedule(inst, keep=set())
    res = execute(cap, inst, sched, n_steps=1, warmup=0)
    ref = reference_step(cap, n_steps=1, warmup=0, measure_memory=False)
    assert res.param_grads == {} and ref.param_grads == {}
    assert np.isfinite(res.loss) and res.loss == ref.loss
    assert within(res.peak_bytes["cpu"], res.predicted_peak_bytes["cpu"])


class _SavedOutput(torch.nn.Module):
    """The last op (sigmoid) saves its output for its backward: the loss may not release it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)

    def forward(self, x):
        return torch.sigmoid(self.lin(x))


def test_the_loss_releases_the_logits_only_where_nothing_reads_them_later():
    """Keep-everything on ``tiny``: the logits' only reader is the loss, which lets go of them;
    a model whose last op saves its output keeps them for its backward (the graph has no
    release to model). Each measures as predicted; the loss computed twice is the next test."""
    from xengine.profile.workspace import capture

    cap = tiny()
    inst = single(cap)
    assert cap.graph.released_logits == cap.loss_index - 1
    assert simulate(inst, keep_all_schedule(inst)).loss_releases == [True]
    torch.manual_seed(0)
    saved = capture(_SavedOutput(), torch.randn(256, 64), torch.randint(0, 32, (256,)))
    inst = single(saved)
    assert saved.graph.released_logits is None
    assert simulate(inst, keep_all_schedule(inst)).loss_releases == []
    res, _ = run_beside_reference(
        saved, inst, keep_all_schedule(inst), rtol=0, atol=0, measure_memory=True
    )
    assert abs(res.peak_bytes["cpu"] - res.predicted_peak_bytes["cpu"]) <= 8192


def _loss_twice(inst: Instance) -> Schedule:
    """Keep-everything, except that the loss's value (the logits' gradient) is not kept for
    the last forward op's backward: the logits are kept one stage longer instead and the loss
    is computed again there. The first computation cannot let go of the logits, the second
    can (``Simulation.loss_releases``)."""
    base = keep_all_schedule(inst)
    R, S = base.R.copy(), base.S.copy()
    nf = inst.graph.released_logits + 1  # the loss node
    t = nf + 1  # the backward of the logits' op reads the loss's value
    S[0, t, nf] = False
    S[0, t, nf - 1] = True
    R[0, t, nf] = True
    return Schedule(inst.devices, R, S)


def test_a_loss_computed_twice_measures_its_prediction():
    """Issue 27, item 6: where the logits stay past the loss, the loss needs their bytes more
    while it makes their gradient; the simulator charges it, and the executor measures it.
    The decoder with a 4,000-word vocabulary: its logits (3.9 MiB) are the largest tensor,
    so that the loss's step is the peak and the tolerance cannot hide them."""
    cap = capture_net("gpt2_small", 4, image_size=64, num_classes=4000)
    inst = single(cap)
    sched = _loss_twice(inst)
    sim = simulate(inst, sched)
    assert sim.loss_releases == [False, True]
    logits = int(cap.graph.nodes[inst.graph.released_logits].output_bytes)
    keep_all = simulate(inst, keep_all_schedule(inst))
    assert sim.peak_bytes[0] >= keep_all.peak_bytes[0] + logits  # the extra is the peak's
    res, _ = run_beside_reference(cap, inst, sched, measure_memory=True)
    assert within(res.peak_bytes["cpu"], int(sim.peak_bytes[0])), (res.peak_bytes, sim.peak_bytes)


def test_a_plain_step_as_written_has_the_in_place_flags_that_capture_switched_off():
    """The user's module as written (in-place ReLUs) gives the same loss and gradients as the
    captured one; the captured module keeps its flags off, and a second capture of the same
    module still knows which flags were on."""
    cap = capture_net("tiny", 4, measure_workspace=False)
    assert cap.inplace_modules == ("relu1", "relu2")
    again = capture_net("tiny", 4, measure_workspace=False)
    assert trace(again.module, again.example_input, again.target).inplace_modules == (
        "relu1",
        "relu2",
    )
    with PlainStep(cap) as plain, PlainStep(cap, as_written=True) as written:
        assert written.module is not cap.module
        assert written.module.relu1.inplace and written.module.relu2.inplace
        assert not any(getattr(m, "inplace", False) for m in cap.module.modules())
        plain.run()
        grads = {n: p.grad.clone() for n, p in cap.module.named_parameters()}
        written.run()
        assert torch.equal(written.loss, plain.loss)
        for n, p in written.module.named_parameters():
            assert torch.equal(p.grad, grads[n]), n


def test_each_timed_step_follows_a_plain_step():
    """``beside``: a plain step before every step, warm-up included (the pair protocol of
    xengine.profile.paired: a step's time depends on the one before it), and only the timed
    pairs kept; without it, no plain step at all."""
    from xengine.execute.executor import _timed_steps

    calls = []

    class Plain:
        def step(self):
            calls.append("plain")
            return 2.0 + len(calls), -1

    def step():
        calls.append("mine")
        return 3.0 + len(calls), {"cpu": len(calls)}

    times, plain_s, others = _timed_steps(step, 2, 1, Plain())
    assert calls == ["plain", "mine"] * 3
    assert times == [7.0, 9.0] and plain_s == [5.0, 7.0] and others == [{"cpu": 4}, {"cpu": 6}]
    calls.clear()
    assert _timed_steps(step, 2, 1, None)[1] == [] and calls == ["mine"] * 3


def test_a_schedule_timed_beside_a_plain_step_keeps_its_answer():
    """The plain steps between the schedule's steps (tiny has dropout and batch norm) leave the
    schedule's loss, gradients and buffers those of one plain step, and its time in plain
    steps is the median of the pairs' ratios."""
    cap = tiny()
    inst = single(cap)
    sched = checkpoint_schedule(inst, keep={0, 3, 6})
    start = buffers(cap)
    try:
        torch.manual_seed(0)
        ref = reference_step(cap, n_steps=1, warmup=0, measure_memory=False)
        after_ref = buffers(cap)
        set_buffers(cap, start)
        torch.manual_seed(0)
        with PlainStep(cap) as plain:
            ex = execute(cap, inst, sched, n_steps=3, warmup=1, measure_memory=False, beside=plain)
        after = buffers(cap)
    finally:
        set_buffers(cap, start)
    assert len(ex.plain_beside_s) == len(ex.step_times_s) == 3
    ratios = sorted(t / p for t, p in zip(ex.step_times_s, ex.plain_beside_s, strict=True))
    assert ex.over_plain == ratios[1]
    assert ex.loss == pytest.approx(ref.loss, rel=1e-6)
    for name, g in ref.param_grads.items():
        torch.testing.assert_close(ex.param_grads[name], g, rtol=1e-6, atol=1e-7, msg=name)
    for name, b in after_ref.items():
        torch.testing.assert_close(after[name], b, rtol=1e-6, atol=1e-7, msg=name)
    assert execute(cap, inst, sched, n_steps=1, warmup=0, measure_memory=False).over_plain is None
