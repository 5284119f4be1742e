"""Wall time of Checkmate's seed on GPT-2 graphs of growing depth: ``recompute_greedy``, then
holding its recomputations, each without a time limit (issue 30: at 24 layers and a 240 s
limit the heuristics' 60 s share did not fit them on a slower machine, and the seed, the
gap and the answer got worse).

The graphs and costs are those of ``experiments/solver_scaling.py`` (GPT-2 small's decoder,
sequence 256, batch 2, costs from a 2-layer profile on this machine), at 50 % of
keep-everything on one CPU device. Each row records the commit of the code it ran, so that
two versions can be compared on one machine, one after the other (never side by side on 2
cores): check out or clone the older commit, copy this script into it and run it there with
the same ``--out``.

    python experiments/heuristic_speed.py --layers 12,24 --repeats 3
    python experiments/heuristic_speed.py --plot-only

Writes ``results/heuristic_speed/heuristic_speed.{csv,png}`` (``--out``); rows are appended.
The schedule's predicted time and the number of simulations are recorded with the wall time:
two versions that differ in speed only give the same schedule.
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from baselines.heuristics import hold_recomputations, solve_recompute_greedy  # noqa: E402
from experiments.common import commit as checkout_commit  # noqa: E402
from experiments.solver_scaling import profiled_reference, scaled_graph  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.simulate import keep_all_peak_bytes  # noqa: E402

log = logging.getLogger("heuristic_speed")
OUT = ROOT / "results" / "heuristic_speed"
FIELDS = [
    "commit",
    "num_layers",
    "n_nodes",
    "budget_fraction",
    "repeat",
    "greedy_s",
    "greedy_sims",
    "greedy_time_ms",
    "hold_s",
    "hold_sims",
    "n_held",
    "held_time_ms",
]


def measure(inst: Instance) -> dict | None:
    """One run of the seed's two phases, each timed on its own; None when the greedy finds
    no schedule that fits (few layers at a tight budget: the loss over the vocabulary
    alone is most of it)."""
    t0 = time.perf_counter()
    res = solve_recompute_greedy(inst)
    greedy_s = time.perf_counter() - t0
    if not res.sim.within_budget:
        g = inst.graph
        log.warning("%s (%d nodes): no greedy schedule fits: %s", g.name, g.size, res.message)
        return None
    t0 = time.perf_counter()
    _, sim, n_held, n_sims = hold_recomputations(inst, res.schedule, res.sim)
    return {
        "greedy_s": greedy_s,
        "greedy_sims": res.extra.get("n_simulations"),
        "greedy_time_ms": 1e3 * res.sim.time_s,
        "hold_s": time.perf_counter() - t0,
        "hold_sims": n_sims,
        "n_held": n_held,
        "held_time_ms": 1e3 * sim.time_s,
    }


def plot(rows: list[dict], out: Path) -> None:
    """Median wall time per (commit, layers), greedy and holding stacked."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["commit"], int(r["num_layers"])), []).append(r)
    commits = list(dict.fromkeys(r["commit"] for r in rows))
    layers = sorted({k[1] for k in groups})
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / max(len(commits), 1)
    for j, c in enumerate(commits):
        for i, L in enumerate(layers):
            rs = groups.get((c, L))
            if not rs:
                continue
            g_s = statistics.median(float(r["greedy_s"]) for r in rs)
            h_s = statistics.median(float(r["hold_s"]) for r in rs)
            x = i + (j - (len(commits) - 1) / 2) * width
            ax.bar(x, g_s, width, color=f"C{j}", label=f"{c}: recompute_greedy" if i == 0 else None)
            ax.bar(x, h_s, width, bottom=g_s, color=f"C{j}", alpha=0.45, hatch="//",
                   label=f"{c}: holding" if i == 0 else None)  # fmt: skip
            ax.text(x, g_s + h_s, f"{g_s + h_s:.0f} s", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(layers)), [f"{L} layers" for L in layers])
    ax.set_ylabel("wall time, s (median)")
    ax.set_title("Checkmate's seed on GPT-2 at 50 %, one CPU device")
    ax.legend(fontsize=8)
    save_figure(fig, out / "heuristic_speed.png")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="12,24", help="comma-separated decoder depths")
    ap.add_argument("--budget-fraction", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the CSV")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    path = args.out / "heuristic_speed.csv"
    if not args.plot_only:
        args.out.mkdir(parents=True, exist_ok=True)
        commit = checkout_commit()
        ref = profiled_reference()
        new_file = not path.exists()
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new_file:
                w.writeheader()
            for L in (int(x) for x in args.layers.split(",")):
                g = scaled_graph(L, ref)
                budget = int(args.budget_fraction * keep_all_peak_bytes(g, "cpu"))
                inst = Instance.single(g, "cpu", budget)
                for k in range(args.repeats):
                    row = measure(inst)
                    if row is None:
                        break  # the next depth may fit
                    row.update(
                        commit=commit,
                        num_layers=L,
                        n_nodes=g.size,
                        budget_fraction=args.budget_fraction,
                        repeat=k,
                    )
                    log.info(
                        "%s, %d layers: greedy %.1f s (%d simulations, %.2f ms), "
                        "holding %.1f s (%d held, %.2f ms)",
                        commit, L, row["greedy_s"], row["greedy_sims"], row["greedy_time_ms"],
                        row["hold_s"], row["n_held"], row["held_time_ms"],
                    )  # fmt: skip
                    w.writerow(row)
                    f.flush()
    with path.open() as f:
        rows = list(csv.DictReader(f))
    plot(rows, args.out)
    log.info("%d rows -> %s", len(rows), path)


if __name__ == "__main__":
    main()
