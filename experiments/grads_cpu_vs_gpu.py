"""Why GPU rows are checked against a plain GPU step (README, "On a GPU").

Plain PyTorch on the CPU and on the GPU, the executor on the GPU (keep-all) and a schedule
over both (half the forward pass on the GPU, every 3rd output kept), all from the same start,
with and without TF32 and deterministic cuDNN; prints the largest difference of each pair as
a fraction of a tensor's largest gradient. It ran as is on the H200 (output:
results/gpu_checks/grads_cpu_vs_gpu.txt; since then only reformatted). Needs a CUDA
device; uses the tests' small nets.

    python experiments/grads_cpu_vs_gpu.py
"""

import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
from _nets import buffers, costed, resnet18_small, set_buffers
from _schedules import checkpoint_schedule, forward_devices

from xengine.execute.executor import execute, reference_step
from xengine.problem import Instance
from xengine.profile.workspace import capture_net
from xengine.schedule import keep_all_schedule


def rel(a, b):
    worst = (0.0, "")
    for k in b:
        r = (
            (a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-30)
        ).item()
        worst = max(worst, (r, k))
    return f"{worst[0]:.3g} ({worst[1]})"


caps = {"small": resnet18_small(), "r18b4": capture_net("resnet18", 4)}
for name, cap in caps.items():
    start = buffers(cap)
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for det in (False, True):
            torch.backends.cudnn.deterministic = det
            res = {}
            for lab, dev in (("cpu", "cpu"), ("gpu", "cuda"), ("gpu2", "cuda")):
                set_buffers(cap, start)
                torch.manual_seed(0)
                res[lab] = reference_step(cap, 1, 0, device=dev, measure_memory=False)
            inst = Instance(costed(cap.graph, ("cuda",)), ("cuda",), (10**11,))
            set_buffers(cap, start)
            torch.manual_seed(0)
            res["exgpu"] = execute(
                cap, inst, keep_all_schedule(inst), n_steps=1, warmup=0, measure_memory=False
            )
            inst2 = Instance(costed(cap.graph, ("cpu", "cuda")), ("cpu", "cuda"), (10**11, 10**11))
            nf = cap.n_forward
            sched = checkpoint_schedule(
                inst2,
                keep=set(range(0, nf, 3)),
                device_of=forward_devices(
                    inst2, [1 if v < nf // 2 else 0 for v in range(nf)], loss_device=0
                ),
            )
            set_buffers(cap, start)
            torch.manual_seed(0)
            res["exmix"] = execute(cap, inst2, sched, n_steps=1, warmup=0, measure_memory=False)
            set_buffers(cap, start)
            g = {k: v.param_grads for k, v in res.items()}
            L = {k: v.loss for k, v in res.items()}
            print(
                f"{name} tf32={tf32} det={det} loss cpu {L['cpu']:.6f} gpu {L['gpu']:.6f} "
                f"exgpu {L['exgpu']:.6f} exmix {L['exmix']:.6f}"
            )
            print(
                "   plain gpu vs cpu",
                rel(g["gpu"], g["cpu"]),
                "| gpu run-to-run",
                rel(g["gpu2"], g["gpu"]),
            )
            print(
                "   exec gpu vs plain gpu",
                rel(g["exgpu"], g["gpu"]),
                "| exec gpu vs plain cpu",
                rel(g["exgpu"], g["cpu"]),
            )
            print(
                "   exec mix vs plain cpu",
                rel(g["exmix"], g["cpu"]),
                "| exec mix vs plain gpu",
                rel(g["exmix"], g["gpu"]),
                flush=True,
            )
