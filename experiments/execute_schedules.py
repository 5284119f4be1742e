"""Run saved schedules for real, side by side, against plain PyTorch steps.

A schedule solved on one machine (``run.py ... execute=false`` with a profile measured on
another, say) is run here on its devices. Every round runs each schedule once and a plain step
on each kind of device once, in turn, so a shared machine's noise hits all alike. The first
round also measures memory and checks the loss and gradients against the plain steps (as
``run.py`` does: :func:`xengine.execute.grads.check_grads`). Writes ``<tag>.csv`` (every step),
``<tag>_summary.csv`` (medians, predictions, peaks, gradient check) and ``<tag>.png`` under
``--out``.

    python experiments/execute_schedules.py --net resnet18 --batch-size 4 \\
        --profile results/profiles/resnet18-b4-cpu+cuda.profile.json \\
        --schedule xengine=results/gpu_plan/xengine.json \\
        --schedule checkmate.cuda=results/gpu_plan/checkmate.cuda.json --rounds 10
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
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
from xengine.execute.executor import execute, reference_step  # noqa: E402
from xengine.execute.grads import check_grads, reference_devices  # noqa: E402
from xengine.prepare import StartState  # noqa: E402
from xengine.problem import UNLIMITED_BYTES, Instance  # noqa: E402
from xengine.profile.profiler import Profile, apply_profile  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.schedule import Schedule  # noqa: E402
from xengine.simulate import simulate  # noqa: E402

log = logging.getLogger("execute_schedules")
MIB = 2**20


def parse_schedule(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {text!r}")
    return label, Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--profile", type=Path, required=True, help="costs for the predictions")
    ap.add_argument("--schedule", type=parse_schedule, action="append", required=True)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "execute_schedules")
    ap.add_argument("--tag", default=None, help="file name stem (default: net and batch)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    cap = capture_net(args.net, args.batch_size, image_size=args.image_size)
    graph = apply_profile(cap.graph, Profile.load(args.profile))
    runs: dict[str, tuple[Instance, Schedule]] = {}
    for label, path in args.schedule:
        try:  # a file is data: a malformed or invalid schedule is one line naming it
            sched = Schedule.from_json(json.loads(path.read_text()), source=str(path))
            devs = tuple(sched.devices)
            inst = Instance(graph, devs, (UNLIMITED_BYTES,) * len(devs))
            simulate(inst, sched, check_budget=False)
        except (OSError, ValueError) as exc:
            print(f"error: schedule {path}: {exc}", file=sys.stderr)
            return 2
        runs[label] = (inst, sched)
    devices = tuple(dict.fromkeys(d for inst, _ in runs.values() for d in inst.devices))
    plain_devices = reference_devices(devices)
    start = StartState(cap.module)

    times: dict[str, list[float]] = {
        k: [] for k in [*runs, *(f"pytorch.{d}" for d in plain_devices)]
    }
    first: dict[str, object] = {}
    for r in range(args.rounds + 1):  # round 0: warm-up, memory and the gradient check
        for d in plain_devices:
            start.restore()
            res = reference_step(cap, n_steps=1, warmup=0, device=d, measure_memory=r == 0)
            if r == 0:
                first[f"pytorch.{d}"] = res
            else:
                times[f"pytorch.{d}"] += res.step_times_s
        for label, (inst, sched) in runs.items():
            start.restore()
            res = execute(cap, inst, sched, n_steps=1, warmup=0, measure_memory=r == 0)
            if r == 0:
                first[label] = res
            else:
                times[label] += res.step_times_s
        if r:
            log.info(
                "round %d/%d: %s",
                r,
                args.rounds,
                ", ".join(f"{k} {1e3 * v[-1]:.1f} ms" for k, v in times.items()),
            )
    start.restore()

    plain = {d: first[f"pytorch.{d}"] for d in plain_devices}
    rows = []
    for label in times:
        res = first[label]
        is_plain = label.startswith("pytorch.")
        devs = (label.split(".", 1)[1],) if is_plain else runs[label][0].devices
        match, diff = (None, None) if is_plain else (check_grads(res, devs, plain) or (None, None))
        rows.append(
            {
                "label": label,
                "devices": "+".join(devs),
                "predicted_ms": None
                if res.predicted_time_s is None
                else round(1e3 * res.predicted_time_s, 3),
                "median_ms": round(1e3 * statistics.median(times[label]), 3),
                "predicted_peak_mib": "/".join(
                    f"{res.predicted_peak_bytes[d] / MIB:.4f}" for d in devs
                )
                if res.predicted_peak_bytes
                else "",
                "measured_peak_mib": "/".join(
                    f"{res.peak_bytes.get(d, 0) / MIB:.4f}" for d in devs
                ),
                "grads_match": match,
                "grads_max_rel_diff": diff,
                "rounds": args.rounds,
                "device_names": "/".join(
                    torch.cuda.get_device_name(d) if d.startswith("cuda") else d for d in devs
                ),
                "torch": torch.__version__,
            }
        )

    args.out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{args.net}_b{args.batch_size}"
    with open(args.out / f"{tag}.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["round", "label", "step_ms"])
        for label, ts in times.items():
            for k, t in enumerate(ts, start=1):
                w.writerow([k, label, f"{1e3 * t:.3f}"])
    write_csv(args.out / f"{tag}_summary.csv", rows)

    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.5))
    ys = range(len(rows))
    ax.barh(ys, [r["median_ms"] for r in rows], color="tab:blue", label="measured (median)")
    for y, r in zip(ys, rows, strict=True):
        if r["predicted_ms"] is not None:
            ax.plot(r["predicted_ms"], y, "kD", label="predicted" if y == 0 else None)
    ax.set_yticks(list(ys), [f"{r['label']} ({r['devices']})" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms)")
    ax.set_title(f"{args.net} batch {args.batch_size}: {args.rounds} interleaved rounds")
    ax.grid(alpha=0.3, axis="x")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(dict(zip(labels, handles, strict=True)).values(), dict.fromkeys(labels), fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / f"{tag}.png", dpi=120)

    for r in rows:
        print(
            f"{r['label']:>16} on {r['devices']:<9} predicted {r['predicted_ms'] or '-':>8} ms, "
            f"measured {r['median_ms']:8.2f} ms, peaks {r['measured_peak_mib']} MiB "
            f"(predicted {r['predicted_peak_mib'] or '-'}), grads match {r['grads_match']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
