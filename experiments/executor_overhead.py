"""Executor overhead: the checkpoint-all schedule against a plain PyTorch step.

Both run the same training step of the same captured model (same start state, same batch).
They are interleaved round by round (one executor step, one plain step, repeated), so that the
machine's noise hits both alike; the medians and their ratio are written to
``results/executor_overhead/``.

    python experiments/executor_overhead.py --net resnet18 --batch-size 4 --steps 10
    python experiments/executor_overhead.py --device cuda      # on a GPU: per-op Python cost shows
"""

from __future__ import annotations

import argparse
import csv
import logging
import platform
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xengine.execute.executor import execute, reference_step  # noqa: E402
from xengine.graph.capture import capture_net  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.schedule import keep_all_schedule  # noqa: E402

log = logging.getLogger("executor_overhead")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cpu<k> (k threads), cuda, cuda:<i>")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "executor_overhead")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    cap = capture_net(args.net, args.batch_size, image_size=args.image_size)
    inst = Instance.single(cap.graph, args.device, None)
    sched = keep_all_schedule(inst)
    for _ in range(args.warmup):
        execute(cap, inst, sched, n_steps=1, warmup=0, measure_memory=False)
        reference_step(cap, n_steps=1, warmup=0, measure_memory=False, device=args.device)
    exe_s, ref_s = [], []
    for k in range(args.steps):
        exe_s += execute(cap, inst, sched, n_steps=1, warmup=0, measure_memory=False).step_times_s
        ref_s += reference_step(
            cap, n_steps=1, warmup=0, measure_memory=False, device=args.device
        ).step_times_s
        log.info(
            "round %d/%d: executor %.1f ms, plain %.1f ms",
            k + 1,
            args.steps,
            1e3 * exe_s[-1],
            1e3 * ref_s[-1],
        )
    exe_med, ref_med = statistics.median(exe_s), statistics.median(ref_s)
    ratio = exe_med / ref_med

    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.net}_b{args.batch_size}_i{args.image_size}"
    if args.device != "cpu":
        tag += "_" + args.device.replace(":", "")
    with open(args.out / f"{tag}.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["round", "executor_step_ms", "plain_step_ms"])
        for k, (a, b) in enumerate(zip(exe_s, ref_s, strict=True)):
            w.writerow([k, f"{1e3 * a:.3f}", f"{1e3 * b:.3f}"])
    summary = {
        "net": args.net,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if "cuda" in args.device else "",
        "steps": args.steps,
        "executor_median_ms": round(1e3 * exe_med, 3),
        "plain_median_ms": round(1e3 * ref_med, 3),
        "ratio": round(ratio, 4),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }
    with open(args.out / f"{tag}_summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(summary))
        w.writeheader()
        w.writerow(summary)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(
        [1e3 * t for t in exe_s],
        "o-",
        label=f"executor, checkpoint-all (median {1e3 * exe_med:.1f} ms)",
    )
    ax.plot(
        [1e3 * t for t in ref_s], "s-", label=f"plain PyTorch step (median {1e3 * ref_med:.1f} ms)"
    )
    ax.set_xlabel("round (interleaved)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(
        f"{args.net} batch {args.batch_size} on {args.device}: executor / plain = {ratio:.3f}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / f"{tag}.png", dpi=120)
    print(
        f"{args.net} b{args.batch_size} on {args.device}: executor {1e3 * exe_med:.1f} ms, plain "
        f"{1e3 * ref_med:.1f} ms, ratio {ratio:.3f} ({args.steps} interleaved rounds)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
