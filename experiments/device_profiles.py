"""Measured profiles of real networks on a device mix (the paper's CPU + GPU), for shipping.

For each ``net:batch`` this captures the training graph, times every op on every device and
fits each copy link (:mod:`xengine.profile`), and times a plain PyTorch step on each device
alone, so the sum of the op times can be read against a whole step. It writes, under
``--out`` (default ``results/profiles/``):

* ``<net>-b<B>-<mix>.profile.json``: for ``profile.path=`` (checked against the graph that
  this machine's torch captures; the run refuses a profile of another graph);
* ``<net>-b<B>-<mix>.graph.json``: the same costs inside the graph, for ``graph=`` (solve only,
  on any machine and torch version);
* ``profiles.csv`` (a row per net and device, a row per copy link) and ``profiles.png`` (each
  op's time on the second device against the first, log-log).

    python experiments/device_profiles.py --nets resnet18:4 vgg16:8 resnet50:8 --devices cpu cuda
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.common import write_csv  # noqa: E402
from xengine.execute.executor import reference_step  # noqa: E402
from xengine.graph.io import save_graph  # noqa: E402
from xengine.profile.profiler import apply_profile, profile_model  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402

log = logging.getLogger("device_profiles")

FIELDS = [
    "net",
    "batch_size",
    "nodes",
    "device",
    "device_name",
    "sum_op_ms",
    "plain_step_ms",
    "sum_op_over_plain",
    "copy_to",
    "copy_latency_us",
    "copy_bandwidth_gb_per_s",
    "torch",
]


def parse_net(text: str) -> tuple[str, int]:
    net, _, batch = text.partition(":")
    if not net or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"expected NET:BATCH (e.g. resnet18:4), got {text!r}")
    return net, int(batch)


def device_name(d: str) -> str:
    if d.startswith("cuda"):
        return torch.cuda.get_device_name(d)
    return f"cpu ({torch.get_num_threads()} threads)" if d == "cpu" else d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", type=parse_net, default=[("resnet18", 4)])
    ap.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per op (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed plain steps per device")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "profiles")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if any(d.startswith("cuda") for d in args.devices) and not torch.cuda.is_available():
        ap.error("a cuda device was asked for but torch sees no CUDA device here")
    if any(d.startswith("cuda") for d in args.devices):
        torch.backends.cudnn.benchmark = False  # the executor's op-by-op kernels, no autotuning
    mix = "+".join(args.devices)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    points: dict[str, tuple[list[float], list[float]]] = {}
    for net, batch in args.nets:
        cap = capture_net(net, batch_size=batch)
        prof = profile_model(
            cap, args.devices, args.repeats, args.warmup, cache_dir=None, progress=False
        )
        stem = f"{net}-b{batch}-{mix}"
        prof.save(args.out / f"{stem}.profile.json")
        graph = apply_profile(cap.graph, prof)
        save_graph(graph, args.out / f"{stem}.graph.json")
        for d in args.devices:
            plain = reference_step(
                cap, n_steps=args.steps, warmup=1, device=d, measure_memory=False
            )
            sum_ms = 1e3 * sum(prof.compute_s[d].values())
            plain_ms = 1e3 * statistics.median(plain.step_times_s)
            rows.append(
                {
                    "net": net,
                    "batch_size": batch,
                    "nodes": graph.size,
                    "device": d,
                    "device_name": device_name(d),
                    "sum_op_ms": round(sum_ms, 4),
                    "plain_step_ms": round(plain_ms, 4),
                    "sum_op_over_plain": round(sum_ms / plain_ms, 4),
                    "torch": torch.__version__,
                }
            )
            log.info(
                "%s b%d on %s: ops sum to %.2f ms, plain step %.2f ms",
                net,
                batch,
                d,
                sum_ms,
                plain_ms,
            )
        for (a, b), cm in sorted(prof.copy.items()):
            rows.append(
                {
                    "net": net,
                    "batch_size": batch,
                    "nodes": graph.size,
                    "device": a,
                    "device_name": device_name(a),
                    "copy_to": b,
                    "copy_latency_us": round(1e6 * cm.latency_s, 3),
                    "copy_bandwidth_gb_per_s": round(cm.bandwidth_bytes_per_s / 1e9, 3),
                    "torch": torch.__version__,
                }
            )
        if len(args.devices) >= 2:
            a, b = args.devices[:2]
            names = [v.name for v in graph.nodes]
            points[f"{net} b{batch}"] = (
                [1e3 * prof.compute_s[a][x] for x in names],
                [1e3 * prof.compute_s[b][x] for x in names],
            )
        # written after every net: a crash later keeps what was measured
        write_csv(args.out / "profiles.csv", rows, FIELDS)
    if points:
        a, b = args.devices[:2]
        fig, ax = plt.subplots(figsize=(6, 5))
        lo, hi = math.inf, 0.0
        for label, (xs, ys) in points.items():
            ax.scatter(xs, ys, s=8, alpha=0.6, label=label)
            lo = min(lo, *xs, *ys)
            hi = max(hi, *xs, *ys)
        lo = max(lo, 1e-4)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="equal time")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"op time on {a}: {device_name(a)} (ms)")
        ax.set_ylabel(f"op time on {b}: {device_name(b)} (ms)")
        ax.set_title("measured op times, one point per graph node")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out / "profiles.png", dpi=120)
    for r in rows:
        if r.get("plain_step_ms") is not None:
            print(
                f"{r['net']} b{r['batch_size']} {r['device']} ({r['device_name']}): ops "
                f"{r['sum_op_ms']:.2f} ms, plain step {r['plain_step_ms']:.2f} ms"
            )
        else:
            print(
                f"{r['net']} b{r['batch_size']} copy {r['device']} -> {r['copy_to']}: "
                f"{r['copy_latency_us']:.1f} us + bytes / {r['copy_bandwidth_gb_per_s']:.2f} GB/s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
