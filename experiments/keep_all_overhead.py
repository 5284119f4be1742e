"""Keep-everything against a plain PyTorch step, on every net of the time-fidelity benchmark
(issue 28: "keep-everything <= 1.05x a plain step on every net").

Keep-everything recomputes nothing and keeps what a plain step keeps (its measured peak is a
plain step's), so what it costs above a plain step is the executor's own: the Python around
each instruction, the loss and its gradient computed apart from the backward pass, the
bookkeeping of registers. Nets of many small ops show it most.

Per net (``experiments/time_fidelity.py``'s table of sizes, one CPU device with all threads):
capture, compile the keep-everything schedule, then pairs of a plain step and a step of the
schedule, back to back (2 pairs of warm-up, then at least ``--pairs`` pairs and ``--seconds``
of them): the median of the per-pair ratios with its standard error, and both medians. Then,
for a net with in-place modules (capture switches their flags off), the same pairs against the
module as its author wrote it (``PlainStep(as_written=True)``), and both measured peaks.
glibc's allocator as ``run.py`` runs it. Writes ``results/keep_all_overhead/keep_all.csv``
and ``keep_all.png`` (ratio per net with twice its standard error, the 1.05 line).

    python experiments/keep_all_overhead.py                      # the 10 nets, ~5 min
    python experiments/keep_all_overhead.py --nets resnet18 shufflenet_v2_x0_5
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.common import commit as checkout_commit  # noqa: E402
from experiments.common import write_csv  # noqa: E402
from experiments.solver_benchmark import parse_cell  # noqa: E402
from experiments.time_fidelity import NETS  # noqa: E402
from experiments.time_fidelity import pairs as timed_pairs  # noqa: E402
from xengine.config import MALLOCS  # noqa: E402
from xengine.execute import allocator  # noqa: E402
from xengine.execute.executor import CompiledSchedule, PlainStep  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.profile.paired import median_se  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.schedule import keep_all_schedule  # noqa: E402
from xengine.simulate import keep_all_peak_bytes  # noqa: E402

log = logging.getLogger("keep_all_overhead")
OUT = ROOT / "results" / "keep_all_overhead"
TARGET = 1.05
MIB = 2**20


def measure(net: str, pairs: int, seconds: float, most: int) -> dict:
    """One net's row: keep-everything and a plain step in interleaved pairs; then, where the
    net has in-place modules, keep-everything and the module as written in pairs."""
    batch, image = NETS[net]
    cap = capture_net(net, batch, image_size=image)
    g = cap.graph
    inst = Instance(g, ("cpu",), (keep_all_peak_bytes(g, "cpu"),))
    with CompiledSchedule(cap, inst, keep_all_schedule(inst)) as exe:
        with PlainStep(cap) as plain:
            mine, plain_ts = timed_pairs(plain, exe, 2, pairs, seconds, most)
            plain_peak = plain.cpu_peak()[0]
        written = as_written(cap, exe, pairs, seconds, most)
    ratios = [a / b for a, b in zip(mine, plain_ts, strict=True)]
    return {
        "net": net,
        "batch_size": batch,
        "image_size": image,
        "nodes": g.size,
        "forward_ops": cap.n_forward,
        "keep_all_ms": round(1e3 * statistics.median(mine), 3),
        "plain_ms": round(1e3 * statistics.median(plain_ts), 3),
        "ratio": round(statistics.median(ratios), 4),
        "ratio_se_pct": round(100 * median_se(ratios), 2),
        "pairs": len(ratios),
        "threads": torch.get_num_threads(),
        "keep_all_peak_mib": round(inst.budgets[0] / MIB, 2),
        "plain_peak_mib": round(plain_peak / MIB, 2),
    } | written


def as_written(cap, exe, pairs: int, seconds: float, most: int) -> dict:
    """The module as its author wrote it (the in-place flags that capture switches off, on):
    keep-everything's step time over its step time, and its peak. A net without in-place
    modules has no such run (its plain step is the module as written): empty cells."""
    row = {"inplace_modules": len(cap.inplace_modules)}
    if not cap.inplace_modules:
        return row | {"as_written_ms": "", "as_written_ratio": "", "as_written_peak_mib": ""}
    with PlainStep(cap, as_written=True) as written:
        mine, theirs = timed_pairs(written, exe, 2, pairs, seconds, most)
        peak = written.cpu_peak()[0]
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    return row | {
        "as_written_ms": round(1e3 * statistics.median(theirs), 3),
        "as_written_ratio": round(statistics.median(ratios), 4),
        "as_written_peak_mib": round(peak / MIB, 2),
    }


def plot(rows: list[dict], path: Path, commit: str) -> None:
    """Ratio per net with twice its standard error, green where it is within the target."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(rows) + 2), 3.8))
    xs = range(len(rows))
    ratios = [r["ratio"] for r in rows]
    errs = [2 * r["ratio"] * r["ratio_se_pct"] / 100 for r in rows]
    colors = ["tab:green" if r <= TARGET else "tab:red" for r in ratios]
    ax.bar(xs, [r - 1 for r in ratios], bottom=1, color=colors, yerr=errs, capsize=3)
    ax.axhline(TARGET, color="k", ls="--", lw=1, label=f"{TARGET:.2f}x (issue 28)")
    ax.axhline(1.0, color="grey", lw=0.8)
    labels = [f"{r['net']}\n{r['forward_ops']} ops" for r in rows]
    ax.set_xticks(list(xs), labels, fontsize=7, rotation=25, ha="right")
    ax.set_ylabel("keep-everything / plain step")
    ax.set_ylim(min(0.95, min(ratios) - 0.02), max(1.2, max(ratios) + 0.05))
    ax.set_title(
        "Keep-everything over a plain PyTorch step (median of interleaved pairs, +-2 SE)\n"
        f"python experiments/keep_all_overhead.py  (commit {commit})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=list(NETS), choices=list(NETS))
    ap.add_argument("--pairs", type=int, default=30, help="pairs per net, at least")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds of pairs, at least")
    ap.add_argument("--most", type=int, default=150, help="pairs per net, at most")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--malloc",
        choices=MALLOCS,
        default="steady",
        help="glibc's thresholds fixed (as run.py runs by default) or glibc as it is",
    )
    ap.add_argument("--replot", action="store_true", help="only the figure, from the CSV in --out")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.out / "keep_all.csv", newline="") as f:
            rows = [{k: parse_cell(v) for k, v in r.items()} for r in csv.DictReader(f)]
        plot(rows, args.out / "keep_all.png", str(rows[0].get("commit", "unknown")))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("xengine").setLevel(logging.WARNING)
    if args.malloc == "steady":
        allocator.steady_malloc()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    commit = checkout_commit()
    t0 = time.perf_counter()
    for k, net in enumerate(args.nets):
        log.info("[%d/%d] %s (%.0f s so far)", k + 1, len(args.nets), net, time.perf_counter() - t0)
        row = measure(net, args.pairs, args.seconds, args.most)
        rows.append(row | {"commit": commit, "malloc": allocator.mode()})
        log.info("%s: keep-everything / plain = %.3f", net, rows[-1]["ratio"])
        write_csv(args.out / "keep_all.csv", rows)
    plot(rows, args.out / "keep_all.png", commit)
    print(
        f"{'net':<22} {'keep_all_ms':>11} {'plain_ms':>9} {'ratio':>7} {'se_pct':>7}"
        f" {'as_written_ratio':>16} {'peak_mib':>9} {'as_written_peak_mib':>19}"
    )
    for r in rows:
        print(
            f"{r['net']:<22} {r['keep_all_ms']:>11.2f} {r['plain_ms']:>9.2f} "
            f"{r['ratio']:>7.3f} {r['ratio_se_pct']:>7.2f} {r['as_written_ratio'] or '-':>16}"
            f" {r['keep_all_peak_mib']:>9.2f} {r['as_written_peak_mib'] or '-':>19}"
        )
    within = sum(r["ratio"] <= TARGET for r in rows)
    print(f"keep-everything <= {TARGET:.2f}x a plain step on {within} of {len(rows)} nets")


if __name__ == "__main__":
    main()
