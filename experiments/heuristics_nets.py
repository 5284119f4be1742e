"""One-device heuristics on the shipped CPU + H200 nets, side by side in one run.

Checkmate's heuristics (checkpoint-all, Chen sqrt(n), Chen greedy) pick forward checkpoints
and recompute whole segments; ``recompute_greedy`` (:mod:`baselines.heuristics`) drops single
values by their cost per byte of peak. Each runs on each net's H200 (device ``b``) and CPU
(device ``a``) alone, at 90 / 70 / 50 % of keep-everything and the smallest budget known to
fit, and every schedule is replayed by the simulator. These schedules are also the warm
starts of the exact models, which is why their quality matters for issue 5. Writes
``results/heuristics_nets/heuristics_nets.{csv,png}``.

    python experiments/heuristics_nets.py --nets vgg16,resnet18,mobilenet_v2,resnet50
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from baselines.heuristics import HEURISTICS  # noqa: E402
from experiments.common import write_csv  # noqa: E402
from experiments.solver_benchmark import budgets_for, net_graph  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402

log = logging.getLogger("heuristics_nets")
FIELDS = [
    "graph",
    "batch_size",
    "n_nodes",
    "device",
    "budget",
    "budget_bytes",
    "strategy",
    "status",
    "time_ms",
    "keep_all_time_ms",
    "slowdown",
    "peak_mib",
    "n_recomputes",
    "solve_s",
]


def plot(rows: list[dict], path: Path, device: str) -> None:
    """Simulated time over keep-everything's, per net and budget, on ``device``; an
    over-budget schedule is drawn hatched."""
    rows = [r for r in rows if r["device"] == device and r["strategy"] != "checkpoint_all"]
    cases = list(dict.fromkeys((r["graph"], r["budget"]) for r in rows))
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.5, 0.6 * len(cases)), 4.2))
    width = 0.8 / max(len(names), 1)
    by = {(r["graph"], r["budget"], r["strategy"]): r for r in rows}
    for k, name in enumerate(names):
        for i, case in enumerate(cases):
            r = by.get((*case, name))
            if r is None:
                continue
            fits = r["status"] == "feasible"
            ax.bar(
                i + (k - (len(names) - 1) / 2) * width,
                r["slowdown"],
                width,
                color=f"C{k}",
                hatch=None if fits else "//",
                alpha=1.0 if fits else 0.4,
                label=name if i == 0 else None,
            )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(
        range(len(cases)),
        [f"{g} {b.replace('_known', '')}" for g, b in cases],
        fontsize=7,
        rotation=40,
        ha="right",
    )
    ax.set_ylabel("simulated time / keep-everything")
    ax.set_title(f"One-device heuristics on the H200 ({device}); hatched: over the budget")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="vgg16,resnet18,mobilenet_v2,resnet50")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--devices", default="b,a", help="devices to run alone: b = H200, a = CPU")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "heuristics_nets")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "heuristics_nets.csv"
    rows: list[dict] = []
    for net in [x for x in args.nets.split(",") if x]:
        g = net_graph(net, args.batch_size, "h200")
        for dev in [x for x in args.devices.split(",") if x]:
            for label, budget in budgets_for(g):
                inst = Instance(g, (dev,), (budget,))
                keep_all_ms = float(inst.compute_s.sum()) * 1e3
                for name, fn in HEURISTICS.items():
                    t0 = time.perf_counter()
                    res = fn(inst)
                    rows.append(
                        {
                            "graph": net,
                            "batch_size": args.batch_size,
                            "n_nodes": g.size,
                            "device": dev,
                            "budget": label,
                            "budget_bytes": budget,
                            "strategy": name,
                            "status": res.status,
                            "time_ms": round(res.sim.time_s * 1e3, 4),
                            "keep_all_time_ms": round(keep_all_ms, 4),
                            "slowdown": round(res.sim.time_s * 1e3 / keep_all_ms, 4),
                            "peak_mib": round(int(res.sim.peak_bytes.max()) / 2**20, 2),
                            "n_recomputes": res.sim.n_recomputes,
                            "solve_s": round(time.perf_counter() - t0, 3),
                        }
                    )
                log.info("%s on %s at %s: done", net, dev, label)
        # written after every net: a run stopped later keeps what it measured
        write_csv(csv_path, rows, FIELDS)
    devices = list(dict.fromkeys(r["device"] for r in rows))
    for dev in devices:
        plot(rows, args.out / f"heuristics_nets_{dev}.png", dev)
    print(f"{'graph':13} {'dev':3} {'budget':9} " + " ".join(f"{n:>17}" for n in HEURISTICS))
    by = {(r["graph"], r["device"], r["budget"], r["strategy"]): r for r in rows}
    for key in dict.fromkeys((r["graph"], r["device"], r["budget"]) for r in rows):
        cells = []
        for n in HEURISTICS:
            r = by[(*key, n)]
            mark = "" if r["status"] == "feasible" else " (over)"
            cells.append(f"{r['time_ms']:>10.2f}{mark:>7}")
        print(f"{key[0]:13} {key[1]:3} {key[2]:9} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
