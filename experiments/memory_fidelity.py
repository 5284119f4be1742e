"""Memory fidelity: what the model predicts against what the allocator measures, beside a plain
PyTorch step (issue 15).

Per net, on the CPU: plain PyTorch's measured activation peak; the keep-everything schedule's
predicted and measured peaks (they must equal plain PyTorch's: keep-all keeps what autograd
keeps); and Checkmate's schedule at 70 % and 50 % of that peak (HiGHS, warm-started from the
heuristics, within a time limit: the best schedule found is executed whatever the gap),
predicted and measured. Writes ``results/memory_fidelity/memory_fidelity.csv`` and ``.png``.

    python experiments/memory_fidelity.py                       # six nets, 224 px, batch 4
    python experiments/memory_fidelity.py --nets resnet18 --image-size 64 --batch-size 2
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baselines.checkmate import solve_checkmate  # noqa: E402
from experiments.common import write_csv  # noqa: E402
from xengine.execute.executor import execute, reference_step  # noqa: E402
from xengine.graph.types import GRANULARITIES  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.profile.profiler import apply_profile, profile_model  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.schedule import keep_all_schedule  # noqa: E402
from xengine.solvers import SolverOptions  # noqa: E402
from xengine.torch_state import TorchState  # noqa: E402

log = logging.getLogger("memory_fidelity")
NETS = ("resnet18", "resnet34", "resnet50", "vgg16", "googlenet", "mobilenet_v2")
FRACTIONS = (0.7, 0.5)
MIB = 2**20


def _measure(cap, inst, sched) -> tuple[int, int]:
    """(predicted, measured) activation peak of ``sched``, from one step under the profiler,
    the module and the random state left as they were."""
    with TorchState(cap.module.buffers()):
        res = execute(cap, inst, sched, n_steps=1, warmup=0)
    return res.predicted_peak_bytes["cpu"], res.peak_bytes["cpu"]


def measure_net(
    net: str, batch: int, image: int, time_limit_s: float, shape: dict | None = None
) -> dict:
    """``shape``: more keywords of ``capture_net`` (granularity; a transformer's layers,
    width and vocabulary)."""
    t0 = time.perf_counter()
    shape = {k: v for k, v in (shape or {}).items() if v is not None}
    cap = capture_net(net, batch, image_size=image, **shape)
    prof = profile_model(cap, ("cpu",), repeats=3, warmup=1, progress=False)
    graph = apply_profile(cap.graph, prof)
    with TorchState():
        plain = reference_step(cap, n_steps=1, warmup=0).peak_bytes["cpu"]
    inst = Instance.single(graph, "cpu", None)
    ka_pred, ka_meas = _measure(cap, inst, keep_all_schedule(inst))
    row = {
        "net": net,
        "batch_size": batch,
        "image_size": image,
        **shape,
        "nodes": graph.size,
        "state_mib": round(float(graph.state_bytes.sum()) / MIB, 3),
        "plain_peak_mib": round(plain / MIB, 3),
        "keep_all_pred_mib": round(ka_pred / MIB, 3),
        "keep_all_meas_mib": round(ka_meas / MIB, 3),
        "keep_all_pred_over_plain": round(ka_pred / plain, 4),
        "keep_all_meas_over_plain": round(ka_meas / plain, 4),
    }
    for frac in FRACTIONS:
        tag = f"checkmate{round(100 * frac)}"
        budget = int(round(frac * ka_pred))
        res = solve_checkmate(
            inst.with_budgets((budget,)), options=SolverOptions(time_limit_s=time_limit_s)
        )
        row[f"{tag}_budget_mib"] = round(budget / MIB, 3)
        row[f"{tag}_status"] = res.status
        row[f"{tag}_gap_pct"] = "" if res.gap is None else round(100 * res.gap, 3)
        if res.schedule is None:
            log.warning("%s at %d %%: %s (%s)", net, round(100 * frac), res.status, res.message)
            continue
        pred, meas = _measure(cap, inst.with_budgets((budget,)), res.schedule)
        row[f"{tag}_pred_mib"] = round(pred / MIB, 3)
        row[f"{tag}_meas_mib"] = round(meas / MIB, 3)
        row[f"{tag}_meas_over_plain"] = round(meas / plain, 4)
        row[f"{tag}_time_over_keep_all"] = round(res.sim.time_s / float(inst.compute_s.sum()), 4)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    log.info("%s: %s", net, row)
    return row


def plot(rows: list[dict], path: Path) -> None:
    """Each peak divided by plain PyTorch's: keep-all predicted and measured at 1.0, Checkmate's
    at or below its budget (dashed ticks)."""
    fig, ax = plt.subplots(figsize=(9, 4))
    series = [("keep_all_pred", "keep-all predicted"), ("keep_all_meas", "keep-all measured")]
    for frac in FRACTIONS:
        tag = f"checkmate{round(100 * frac)}"
        series += [(f"{tag}_pred", f"Checkmate {tag[9:]} % predicted")]
        series += [(f"{tag}_meas", f"Checkmate {tag[9:]} % measured")]
    x = np.arange(len(rows))
    w = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        vals = [
            float(r[f"{key}_mib"]) / float(r["plain_peak_mib"]) if r.get(f"{key}_mib") else np.nan
            for r in rows
        ]
        pos = x + (k - len(series) / 2 + 0.5) * w
        ax.bar(pos, vals, w, label=label)
        for p, v in zip(pos, vals, strict=True):
            if np.isnan(v):  # no schedule fits that budget
                ax.text(p, 0.02, "no schedule fits", rotation=90, fontsize=7, ha="center")
    for frac in FRACTIONS:
        ax.axhline(frac, color="grey", ls="--", lw=0.8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [f"{r['net']}\n(plain {float(r['plain_peak_mib']):.0f} MiB)" for r in rows])
    ax.set_ylabel("activation peak / plain PyTorch's")
    b, i = rows[0]["batch_size"], rows[0]["image_size"]
    ax.set_title(f"Predicted and measured peaks against a plain PyTorch step (CPU, b{b}, {i} px)")
    ax.legend(fontsize=7, ncol=3, loc="upper right")
    ax.set_ylim(0, 1.25)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--time-limit-s", type=float, default=120.0, help="per Checkmate solve")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "memory_fidelity")
    ap.add_argument("--replot", action="store_true", help="redraw the figure from the CSV")
    ap.add_argument("--granularity", choices=GRANULARITIES, default="module")
    ap.add_argument("--num-layers", type=int, help="hf_gpt2 / hf_llama: layers")
    ap.add_argument("--width", type=int, help="hf_gpt2 / hf_llama: width")
    ap.add_argument("--num-classes", type=int, help="classes, or a token net's vocabulary")
    args = ap.parse_args(argv)
    shape = {
        "granularity": args.granularity,
        "num_layers": args.num_layers,
        "width": args.width,
        "num_classes": args.num_classes,
    }
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.replot:
        rows = list(csv.DictReader((args.out / "memory_fidelity.csv").open()))
        plot(rows, args.out / "memory_fidelity.png")
        return 0
    rows = []
    for net in args.nets.split(","):
        rows.append(measure_net(net, args.batch_size, args.image_size, args.time_limit_s, shape))
        _write(rows, args.out)  # a long run keeps what it has measured
    for r in rows:
        print(
            f"{r['net']}: plain {r['plain_peak_mib']} MiB, keep-all predicted "
            f"{r['keep_all_pred_mib']} / measured {r['keep_all_meas_mib']} MiB"
            + "".join(
                f", Checkmate {p} %: {r.get(f'checkmate{p}_pred_mib', '-')} / "
                f"{r.get(f'checkmate{p}_meas_mib', '-')} MiB"
                for p in (70, 50)
            )
        )
    return 0


def _write(rows: list[dict], out: Path) -> None:
    write_csv(out / "memory_fidelity.csv", rows)
    plot(rows, out / "memory_fidelity.png")


if __name__ == "__main__":
    raise SystemExit(main())
