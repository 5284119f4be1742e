"""Checkmate with and without its bounds (issue 17, issue 30), side by side in one run.

For each net (captured and profiled on this machine's CPU as ``python run.py`` does, the
profile cached under ``results/cache/profiles``) and each budget, Checkmate is solved three
times under the same time limit: the MILP alone from the best heuristic (``frontier=False``,
how Checkmate publishes it), the frontier relaxation first and then the MILP from the better
start with the relaxation's bound as a floor (``stage_cut=False``, the default until the
stage cut), and the default: the stage-cut bound, then the relaxation, then the MILP. Each
row gives the schedule's simulated time, the proven bound, where it came from, the gap and the
wall time. Writes ``results/checkmate_frontier/checkmate_frontier_<limit>s.{csv,png}``
(``--out`` for another folder).

    python experiments/checkmate_frontier.py --nets resnet18 --budgets 0.5,0.7,0.9 --time-limit-s 10
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

from baselines.checkmate import solve_checkmate  # noqa: E402
from experiments.common import write_csv  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.profile.profiler import apply_profile, profile_model  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.simulate import keep_all_peak_bytes  # noqa: E402
from xengine.solvers import SolverOptions  # noqa: E402

log = logging.getLogger("checkmate_frontier")
OUT = ROOT / "results" / "checkmate_frontier"
FIELDS = [
    "net",
    "batch_size",
    "n_nodes",
    "budget_fraction",
    "budget_mib",
    "method",
    "time_limit_s",
    "status",
    "time_ms",
    "bound_ms",
    "gap_pct",
    "wall_s",
    "frontier_bound_ms",
    "frontier_s",
    "cut_bound_ms",
    "cut_s",
    "bound_from",
    "start",
]
METHODS = {
    "milp_alone": {"frontier": False},
    "frontier_then_milp": {"stage_cut": False},
    "cut_frontier_milp": {},
}
LABELS = {
    "milp_alone": "the MILP alone (Checkmate as published)",
    "frontier_then_milp": "frontier relaxation, then the MILP",
    "cut_frontier_milp": "stage cut, frontier relaxation, MILP (default)",
}


def net_instance_graph(net: str, batch: int):
    cap = capture_net(net, batch)
    prof = profile_model(cap, ("cpu",), cache_dir=ROOT / "results" / "cache" / "profiles")
    return apply_profile(cap.graph, prof)


def run(nets, batch, budgets, time_limit_s) -> list[dict]:
    rows = []
    for net in nets:
        g = net_instance_graph(net, batch)
        peak = keep_all_peak_bytes(g, "cpu")
        for frac in budgets:
            inst = Instance.single(g, "cpu", int(frac * peak))
            for method, switches in METHODS.items():
                t0 = time.perf_counter()
                res = solve_checkmate(
                    inst, options=SolverOptions(time_limit_s=time_limit_s), **switches
                )
                wall = time.perf_counter() - t0
                fr = res.frontier
                cut = res.extra.get("stage_cut") or {}
                row = {
                    "net": net,
                    "batch_size": batch,
                    "n_nodes": g.size,
                    "budget_fraction": frac,
                    "budget_mib": inst.budget_bytes[0] / 2**20,
                    "method": method,
                    "time_limit_s": time_limit_s,
                    "status": res.status,
                    "time_ms": res.sim.time_s * 1e3 if res.sim is not None else None,
                    "bound_ms": None if res.best_bound_s is None else res.best_bound_s * 1e3,
                    "gap_pct": None if res.gap is None else 100 * res.gap,
                    "wall_s": wall,
                    "frontier_bound_ms": None
                    if fr is None or fr.bound_s is None
                    else fr.bound_s * 1e3,
                    "frontier_s": None if fr is None else fr.solve_time_s,
                    "cut_bound_ms": cut["bound_s"] * 1e3 if cut else None,
                    "cut_s": cut.get("time_s"),
                    "bound_from": res.extra.get("bound_from"),
                    "start": res.warm_start,
                }
                log.info("%s", {k: v for k, v in row.items() if v is not None})
                rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    labels = sorted({(r["net"], r["budget_fraction"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(7, 2.0 * len(labels)), 3.8))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]  # older CSVs: two
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        gaps = []
        for net, frac in labels:
            r = next(
                x
                for x in rows
                if (x["net"], x["budget_fraction"], x["method"]) == (net, frac, method)
            )
            gaps.append(r["gap_pct"] if r["gap_pct"] is not None else float("nan"))
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, gaps, width, label=LABELS[method])
        for x, gap in zip(xs, gaps, strict=True):
            ax.annotate(f"{gap:.2f}", (x, gap), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), [f"{n}\n{100 * f:.0f} %" for n, f in labels])
    ax.set_ylabel("proven gap at the limit (%)")
    limit = rows[0]["time_limit_s"] if rows else ""
    ax.set_title(f"Checkmate on this CPU: the proven gap by how it is bounded ({limit} s)")
    ax.legend()
    save_figure(fig, path)


def read_rows(path: Path) -> list[dict]:
    """The rows of a CSV this script wrote, with the fields the plot reads typed."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["budget_fraction"] = float(r["budget_fraction"])
        r["gap_pct"] = float(r["gap_pct"]) if r["gap_pct"] else None
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--budgets", default="0.5,0.7,0.9")
    ap.add_argument("--time-limit-s", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the CSV and PNG files")
    ap.add_argument("--replot", action="store_true", help="draw the PNG again from the CSV")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stem = f"checkmate_frontier_{args.time_limit_s:g}s"
    if args.replot:
        plot(read_rows(args.out / f"{stem}.csv"), args.out / f"{stem}.png")
        return 0
    rows = run(
        args.nets.split(","),
        args.batch_size,
        [float(b) for b in args.budgets.split(",")],
        args.time_limit_s,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", rows, FIELDS)
    plot(rows, args.out / f"{stem}.png")
    print(
        f"{'net':13s} {'budget':>6s} {'method':20s} {'status':9s} "
        f"{'time ms':>9s} {'bound ms':>9s} {'gap %':>6s} {'wall s':>7s}"
    )
    for r in rows:
        print(
            f"{r['net']:13s} {100 * r['budget_fraction']:5.0f}% {r['method']:20s} {r['status']:9s} "
            f"{r['time_ms'] or float('nan'):9.2f} {r['bound_ms'] or float('nan'):9.2f} "
            f"{r['gap_pct'] if r['gap_pct'] is not None else float('nan'):6.2f} {r['wall_s']:7.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
