"""LP-relaxation bound: simplex against interior point (issue 5), side by side in one run.

For each net (shipped CPU + H200 costs, two devices, a budget fraction of keep-everything on
each) the exact model is built once and its relaxation solved by HiGHS's dual simplex, by its
interior point without crossover, and by OR-Tools' PDLP
(:func:`xengine.strategies.bounds.lp_bound_s`).
The interior-point and PDLP bounds are computed from their multipliers by weak duality, so
every column is a proven bound; PDLP's holds when it is stopped by the limit too. Each
relaxation is that of one written form of the FREE rows (``--free-rows``: the tight AND rows
that :func:`~xengine.strategies.bounds.lp_bound_s` uses by default, and/or Checkmate's hazard
count), so the forms' bounds and times are compared side by side too. Writes
``results/lp_bound_speed/lp_bound_speed.{csv,png}``.

    python experiments/lp_bound_speed.py --nets vgg16,resnet18,resnet50 --time-limit-s 600
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

from experiments.common import write_csv  # noqa: E402
from experiments.solver_benchmark import net_graph  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.simulate import keep_all_peak_bytes  # noqa: E402
from xengine.solvers import SolverOptions  # noqa: E402
from xengine.strategies.bounds import lp_bound_s  # noqa: E402
from xengine.strategies.formulation import FREE_ROWS, build  # noqa: E402

log = logging.getLogger("lp_bound_speed")
METHODS = ("simplex", "ipm", "pdlp")
FIELDS = [
    "graph",
    "batch_size",
    "n_nodes",
    "budget_fraction",
    "n_vars",
    "n_rows",
    "free_rows",
    "method",
    "threads",
    "time_limit_s",
    "solve_s",
    "lp_bound_ms",
    "note",
]


def plot(rows: list[dict], path: Path, time_limit_s: float) -> None:
    """One group of bars per (graph, FREE-row form), one bar per method that ran; each bar is
    labelled with the bound it proved (methods differ in time, rarely in bound)."""
    groups = list(dict.fromkeys((r["graph"], r["free_rows"]) for r in rows))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.8 * len(groups)), 3.8))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        xs, hs, labels = [], [], []
        for i, group in enumerate(groups):
            found = [r for r in rows if (r["graph"], r["free_rows"]) == group]
            r = next((r for r in found if r["method"] == method), None)
            if r is None:
                continue
            xs.append(i + (k - (len(methods) - 1) / 2) * width)
            hs.append(float(r["solve_s"]))
            b = r["lp_bound_ms"]
            labels.append("no bound" if b in ("", None) else f"{float(b):.3f}")
        bars = ax.bar(xs, hs, width, label=method)
        ax.bar_label(bars, labels, fontsize=6.5, padding=2, rotation=90)
    longest = max((float(r["solve_s"]) for r in rows), default=0.0)
    if longest > 0.5 * time_limit_s:  # only where the limit is near enough to matter
        ax.axhline(time_limit_s, color="grey", ls=":", lw=1, label=f"limit {time_limit_s:.0f} s")
    ax.set_ylim(0, 1.35 * max(longest, 1e-3) if longest <= 0.5 * time_limit_s else None)
    ax.set_xticks(range(len(groups)), [f"{g}\n{fr} FREE rows" for g, fr in groups], fontsize=8)
    ax.set_ylabel("time to the LP bound (s)")
    ax.set_title(
        "LP relaxation, two devices (CPU + H200 costs): time to a proven bound "
        "(bar labels: the bound, ms)"
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="vgg16,resnet18,resnet50")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--budget",
        type=float,
        default=0.6,
        help="fraction of keep-everything (since memory model version 2, 50 %% is below "
        "what one op of vgg16 and resnet18 b8 needs)",
    )
    ap.add_argument("--time-limit-s", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--free-rows",
        default="tight",
        help=f"comma-separated FREE-row forms to relax, from {', '.join(FREE_ROWS)}",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "lp_bound_speed")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    methods = [m for m in args.methods.split(",") if m]
    forms = [f for f in args.free_rows.split(",") if f]
    bad = [f for f in forms if f not in FREE_ROWS]
    if bad:
        ap.error(f"unknown --free-rows {bad}: choose from {list(FREE_ROWS)}")
    options = SolverOptions(time_limit_s=args.time_limit_s, threads=args.threads)
    rows: list[dict] = []
    csv_path = args.out / "lp_bound_speed.csv"
    args.out.mkdir(parents=True, exist_ok=True)
    for net in [x for x in args.nets.split(",") if x]:
        g = net_graph(net, args.batch_size, "h200")
        budget = int(args.budget * keep_all_peak_bytes(g))
        inst = Instance(g, ("a", "b"), (budget, budget))
        for form, method in [(f, m) for f in forms for m in methods]:
            built = build(inst, free_rows=form)
            model, note = built.model, ""
            if built.blocked is not None:  # no LP to time: say why instead of an empty cell
                node, need = built.blocked
                note = f"{node} needs {need} bytes, over the budget of {budget} on both devices"
                log.warning("%s at %g of keep-everything: %s", net, args.budget, note)
            t0 = time.perf_counter()
            bound = None if note else lp_bound_s(inst, options, {"free_rows": form}, method=method)
            el = time.perf_counter() - t0
            log.info("%s %s rows, %s: %s in %.1f s", net, form, method, bound, el)
            rows.append(
                {
                    "graph": net,
                    "batch_size": args.batch_size,
                    "n_nodes": g.size,
                    "budget_fraction": args.budget,
                    "n_vars": model.n_vars,
                    "n_rows": model.n_rows,
                    "free_rows": form,
                    "method": method,
                    "threads": args.threads,
                    "time_limit_s": args.time_limit_s,
                    "solve_s": round(el, 2),
                    "lp_bound_ms": "" if bound is None else round(bound * 1e3, 6),
                    "note": note,
                }
            )
            # written after every solve: a run stopped later keeps what it measured
            write_csv(csv_path, rows, FIELDS)
    plot(rows, args.out / "lp_bound_speed.png", args.time_limit_s)
    print(f"{'graph':10} {'FREE':7} {'method':8} {'n_vars':>8} {'solve s':>8} {'LP bound ms':>12}")
    for r in rows:
        print(
            f"{r['graph']:10} {r['free_rows']:7} {r['method']:8} {r['n_vars']:>8} "
            f"{r['solve_s']:>8} {r['lp_bound_ms'] or '-':>12}  {r['note']}".rstrip()
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
