"""Keep-everything is a plain PyTorch step (issue 15): on every net the design card names, the
keep-all schedule's predicted peak and its measured peak equal plain PyTorch's measured
activation peak on the CPU.

The bound the issue states is max(1 %, 1 MiB); at these small sizes 1 MiB would be 5-15 % of
the peak, so the test holds them to 1 % (measured here: within 0.1 %). The benchmark
``experiments/memory_fidelity.py`` does the same at 224 px, batch 4.
"""

from __future__ import annotations

import pytest
import torch

from xengine.execute.executor import execute, reference_step
from xengine.problem import Instance
from xengine.profile.workspace import capture_net
from xengine.schedule import keep_all_schedule
from xengine.simulate import keep_all_peak_bytes

NETS = ("resnet18", "resnet34", "resnet50", "vgg16", "googlenet", "mobilenet_v2")
RTOL = 0.01


@pytest.mark.parametrize("net", NETS)
def test_keep_all_is_plain_pytorch(net):
    cap = capture_net(net, 2, image_size=32, num_classes=10)
    g = cap.graph
    inst = Instance.single(g.with_costs({"cpu": {v.name: 0.0 for v in g.nodes}}), "cpu", None)
    buffers0 = [b.detach().clone() for b in cap.module.buffers()]
    torch.manual_seed(0)
    plain = reference_step(cap, n_steps=1, warmup=0).peak_bytes["cpu"]
    with torch.no_grad():
        for b, b0 in zip(cap.module.buffers(), buffers0, strict=True):
            b.copy_(b0)
    torch.manual_seed(0)
    res = execute(cap, inst, keep_all_schedule(inst), n_steps=1, warmup=0)
    predicted = res.predicted_peak_bytes["cpu"]
    measured = res.peak_bytes["cpu"]
    assert predicted == keep_all_peak_bytes(g, "cpu")
    assert abs(predicted - plain) <= RTOL * plain, (net, predicted, plain)
    assert abs(measured - plain) <= RTOL * plain, (net, measured, plain)
