"""Time to a 1 % gap against graph size (issue 30, item 4), per strategy, one device.

The graphs are GPT-2 small's decoder (``net=hf_gpt2``: width 768, 12 heads, vocabulary
50257, sequence 256, batch 2) with 6 to 77 layers, captured at module granularity: 13 + 32 L
nodes, so 205 to 2,477 (at 3 layers, 50 % is below the smallest budget: the logits and the
loss alone take more). Memory is the capture's (exact, see docs/measurements.md). Costs
are measured once, on a 2-layer model on this machine's CPU (``xengine.profile``, cached),
and each node of a deeper model takes the time and workspace of the node in the same place
of a profiled layer (the median over the profiled layers): the layers are the same shape,
and profiling 2,477 nodes would take longer than the solves. The names of the two nodes
must match (layer index and counters aside), or the run stops.

Each (graph, strategy) is solved in a process of its own, under a wall-clock limit and an
address-space limit (so an oversized model fails alone instead of taking the machine
down), and the row records the peak resident memory of that process and its children
together (HiGHS runs large MILPs in a child: the larger of the process's own peak and the
sum sampled every 0.25 s). Strategies:

* ``checkmate``: what ``strategy=checkmate`` runs (heuristics, the frontier relaxation for
  half the limit, then the MILP from the best start with the relaxation's bound as a
  floor; the MILP is refused before it is built when it would not fit in memory);
* ``checkmate_milp``: the MILP alone from the best heuristic, as Checkmate publishes it
  (``frontier=False``), only up to ``--milp-max-nodes``.

The time to a gap is the wall time from the strategy's start (heuristics included) until
the best schedule so far was within that gap of the best proven bound so far, read from the
strategy's progress reports. The figure marks two published or measured points of peers as
such: HiRemate's ~2.5 h plan of a 2,500-node transformer (a hierarchical heuristic: no
bound, so no gap), and MOCCASIN's code on Checkmate's ResNet-50 graph (353 nodes) at 70 %,
which stopped at a 1.6 % gap after 600 s on a 2-core machine of this kind (OR-Tools 9.6, 2
workers, the team's calibration notes): it never reached 1 %, so the marker is a lower bound.

    python experiments/solver_scaling.py --layers 6,12,24,48,77 --time-limit-s 240
    python experiments/solver_scaling.py --quick      # 2 sizes, 30 s each: a smoke run

Writes ``results/solver_scaling/solver_scaling.{csv,png}`` (``--out``) and a trace file of every
progress report (``solver_scaling_traces.csv``).
"""

from __future__ import annotations

import argparse
import csv
import logging
import multiprocessing as mp
import os
import re
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.common import write_csv  # noqa: E402
from experiments.solver_benchmark import time_to_gap_s  # noqa: E402
from xengine.graph.types import Graph  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.profile.profiler import profile_model  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.simulate import keep_all_peak_bytes  # noqa: E402
from xengine.solvers import SolverOptions  # noqa: E402
from xengine.strategies.model_size import milp_bytes  # noqa: E402

log = logging.getLogger("solver_scaling")
OUT = ROOT / "results" / "solver_scaling"
NET, WIDTH, SEQ, BATCH = "hf_gpt2", 768, 256, 2
PROFILED_LAYERS = 2
GAPS = {"5pct": 0.05, "1pct": 0.01, "0p1pct": 0.001}
STRATEGIES = ("checkmate", "checkmate_milp")
FIELDS = [
    "net",
    "num_layers",
    "n_nodes",
    "n_edges",
    "budget_fraction",
    "budget_mib",
    "strategy",
    "time_limit_s",
    "status",
    "time_ms",
    "bound_ms",
    "gap_pct",
    "wall_s",
    *[f"time_to_gap_{k}_s" for k in GAPS],
    "milp_estimate_gib",
    "milp_refused",
    "peak_rss_gib",
    "message",
]
PEERS = [
    # (label, nodes, seconds, marker)
    ("HiRemate, published: ~2.5 h plan, no bound", 2500, 2.5 * 3600, "*"),
    ("MOCCASIN's code, ResNet-50 (353 nodes) at 70 %: 1.6 % after 600 s", 353, 600, ">"),
]


# ----------------------------------------------------------------------------- graphs
def _shape(name: str) -> str:
    """A node's name without its layer index and op counter: what must match across models."""
    return re.sub(r"_\d+$", "", re.sub(r"blocks_\d+_", "blocks_#_", name))


def _slots(graph: Graph, num_layers: int) -> list[tuple[str, int]]:
    """Each node's place: (``pre``/``layer``/``post``, index), backward nodes mirroring their
    forward node (captured graphs are forward ops, the loss, then the backward ops reversed)."""
    n = graph.size
    n_fwd = (n - 1) // 2
    per_layer = (n_fwd - 6) // num_layers  # embed, wpe, add, drop | norm, head
    if 2 * n_fwd + 1 != n or 6 + per_layer * num_layers != n_fwd:
        raise ValueError(f"{graph.name}: {n} nodes is not the GPT-2 layout this script reads")
    fwd = []
    for p in range(n_fwd):
        if p < 4:
            fwd.append(("pre", p))
        elif p < 4 + per_layer * num_layers:
            fwd.append(("layer", (p - 4) % per_layer))
        else:
            fwd.append(("post", p - 4 - per_layer * num_layers))
    return [*fwd, ("loss", 0), *[(f"grad_{k}", i) for k, i in reversed(fwd)]]


def _per_slot(graph: Graph, layers: int, table: dict[str, float]) -> dict[tuple, float]:
    """The median of ``table`` (node name -> value) over the nodes of each place."""
    groups: dict[tuple, list[float]] = {}
    for v, slot in zip(graph.nodes, _slots(graph, layers), strict=True):
        groups.setdefault(slot, []).append(float(table.get(v.name, 0.0)))
    return {k: statistics.median(xs) for k, xs in groups.items()}


def scaled_graph(num_layers: int, reference: tuple[Graph, dict, dict]) -> Graph:
    """The ``num_layers``-layer capture with the profiled model's costs, place by place."""
    ref_graph, cost, work = reference
    g = capture_net(
        NET, BATCH, image_size=SEQ, width=WIDTH, num_layers=num_layers, measure_workspace=False
    ).graph
    slots = _slots(g, num_layers)
    names = dict(zip(_slots(ref_graph, PROFILED_LAYERS), ref_graph.nodes, strict=True))
    for v, slot in zip(g.nodes, slots, strict=True):
        if _shape(v.name) != _shape(names[slot].name):
            raise ValueError(f"{v.name} sits where the profiled model has {names[slot].name}")
    return g.with_costs(
        {"cpu": {v.name: cost[s] for v, s in zip(g.nodes, slots, strict=True)}},
        {},
        {"cpu": {v.name: int(work[s]) for v, s in zip(g.nodes, slots, strict=True)}},
    )


def profiled_reference() -> tuple[Graph, dict, dict]:
    """The 2-layer model and its measured costs and workspaces per place."""
    cap = capture_net(NET, BATCH, image_size=SEQ, width=WIDTH, num_layers=PROFILED_LAYERS)
    prof = profile_model(cap, ["cpu"], repeats=3)
    g = cap.graph
    return (
        g,
        _per_slot(g, PROFILED_LAYERS, prof.compute_s["cpu"]),
        _per_slot(g, PROFILED_LAYERS, prof.workspace_bytes.get("cpu", {})),
    )


# ----------------------------------------------------------------------------- solving
def _solve_in_child(inst: Instance, strategy: str, limit_s: float, as_bytes: int, conn) -> None:
    """Runs in a fresh process: solve, then send the row's solver fields and the trace."""
    resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
    from baselines.checkmate import solve_checkmate

    tree = _TreePeak()  # HiGHS's large MILPs run in a child process of this one

    t0 = time.perf_counter()
    trace: list[tuple[float, float | None, float | None]] = []

    def progress(_elapsed_s: float, incumbent_s: float | None, bound_s: float | None) -> None:
        trace.append((time.perf_counter() - t0, incumbent_s, bound_s))

    try:
        res = solve_checkmate(
            inst,
            options=SolverOptions(time_limit_s=limit_s),
            progress=progress,
            frontier=strategy == "checkmate",
        )
        wall_s = time.perf_counter() - t0
        time_s = res.sim.time_s if res.sim is not None and res.sim.within_budget else None
        trace.append((wall_s, time_s, res.best_bound_s))
        row = {
            "status": res.status,
            "time_ms": None if time_s is None else 1e3 * time_s,
            "bound_ms": None if res.best_bound_s is None else 1e3 * res.best_bound_s,
            "gap_pct": None if res.gap is None else 100 * res.gap,
            "wall_s": wall_s,
            "milp_refused": bool(res.extra.get("milp_refused")),
            "message": res.message[:300],
        }
    except MemoryError as exc:
        row = {"status": "error", "wall_s": time.perf_counter() - t0}
        row["message"] = f"out of the {as_bytes / 2**30:.0f} GiB address-space limit: {exc}"
    row["peak_rss_gib"] = max(_peak_rss_bytes(), tree.stop()) / 2**30
    conn.send((row, trace))
    conn.close()


def _peak_rss_bytes() -> int:
    """This process's peak resident memory since its exec (``VmHWM``; ``ru_maxrss`` would
    carry the parent's peak over the fork and exec that start a spawned process)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` now (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    try:
        kids = [
            int(c)
            for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()
        ]
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


class _TreePeak:
    """The largest resident memory of this process and its descendants together, sampled
    every :data:`TREE_SAMPLE_S` (HiGHS's process, :mod:`xengine.solvers.highs_process`, is
    not in this process's ``VmHWM``)."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        me = os.getpid()
        while not self._done.wait(TREE_SAMPLE_S):
            total = sum(_rss_bytes(p) for p in (me, *_descendants(me)))
            self.peak_bytes = max(self.peak_bytes, total)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak_bytes


TREE_SAMPLE_S = 0.25


def solve_one(inst: Instance, strategy: str, limit_s: float, as_gib: float) -> tuple[dict, list]:
    """One solve in a spawned process; a process that dies is a row that says how."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_solve_in_child, args=(inst, strategy, limit_s, int(as_gib * 2**30), child)
    )
    t0 = time.monotonic()
    proc.start()
    child.close()
    deadline = t0 + 3 * limit_s + 300  # builds and presolves that do not watch the limit
    got = parent.poll(max(0.0, deadline - time.monotonic()))
    if got:
        try:
            row, trace = parent.recv()
        except EOFError:
            got = False
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if not got:
        killed = time.monotonic() >= deadline
        why = f"killed at the deadline ({deadline - t0:.0f} s)" if killed else "died"
        why += f": exit code {proc.exitcode}, no answer"
        return {"status": "error", "wall_s": time.monotonic() - t0, "message": why}, []
    return row, trace


# ----------------------------------------------------------------------------- run
def run(
    layers: list[int],
    budget: float,
    limit_s: float,
    milp_max_nodes: int,
    as_gib: float,
    out: Path = OUT,
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    reference = profiled_reference()
    rows, traces = [], []
    for num_layers in layers:
        g = scaled_graph(num_layers, reference)
        budget_bytes = int(budget * keep_all_peak_bytes(g, "cpu"))
        inst = Instance.single(g, "cpu", budget_bytes)
        n_edges = len(g.value_edges) + len(g.state_edges)
        for strategy in STRATEGIES:
            if strategy == "checkmate_milp" and g.size > milp_max_nodes:
                continue
            log.info(
                "%d layers (%d nodes, %d edges): %s ...", num_layers, g.size, n_edges, strategy
            )
            result, trace = solve_one(inst, strategy, limit_s, as_gib)
            row = {
                "net": NET,
                "num_layers": num_layers,
                "n_nodes": g.size,
                "n_edges": n_edges,
                "budget_fraction": budget,
                "budget_mib": budget_bytes / 2**20,
                "strategy": strategy,
                "time_limit_s": limit_s,
                "milp_estimate_gib": milp_bytes(g) / 2**30,
                **result,
            }
            for k, level in GAPS.items():
                row[f"time_to_gap_{k}_s"] = time_to_gap_s(trace, level)
            log.info(
                "  %s, gap %s %%, %.0f s, 1 %% gap after %s s, peak RSS %.2f GiB",
                row["status"],
                _fmt(row.get("gap_pct")),
                row.get("wall_s") or 0,
                _fmt(row["time_to_gap_1pct_s"]),
                row.get("peak_rss_gib") or 0,
            )
            rows.append(row)
            traces += [(num_layers, g.size, strategy, *p) for p in trace]
            _write(rows, traces, out)
            plot(rows, out / "solver_scaling.png")
    return rows


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _write(rows: list[dict], traces: list[tuple], out: Path) -> None:
    write_csv(out / "solver_scaling.csv", rows, FIELDS, only=True)
    with open(out / "solver_scaling_traces.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["num_layers", "n_nodes", "strategy", "elapsed_s", "incumbent_s", "bound_s"])
        w.writerows(traces)


def read_rows(path: Path) -> list[dict]:
    """The CSV's rows with numbers as numbers and empty cells as None."""

    def value(x: str):
        if x == "":
            return None
        try:
            return int(x) if x.lstrip("-").isdigit() else float(x)
        except ValueError:
            return x

    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def plot(rows: list[dict], path: Path) -> None:
    """Time to a 1 % gap against nodes: filled where reached, hollow at the wall time where
    not (labelled with the gap it ended at), peers' points in grey."""
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = (("#1f77b4", (4, 4)), ("#d62728", (4, -11)))  # labels above / below the point
    for strategy, (color, offset) in zip(STRATEGIES, styles, strict=True):
        pts = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["n_nodes"])
        if not pts:
            continue
        xs = [r["n_nodes"] for r in pts]
        ys = [r["time_to_gap_1pct_s"] or r["wall_s"] for r in pts]
        ax.plot(xs, ys, "-", color=color, lw=1, label=strategy)
        for r, x, y in zip(pts, xs, ys, strict=True):
            reached = r["time_to_gap_1pct_s"] is not None
            ax.plot(x, y, "o", color=color, mfc=color if reached else "none", ms=6)
            if not reached:
                gap = r.get("gap_pct")
                text = f"{gap:.1f} %" if gap is not None else "no bound"
                text = "killed" if r["status"] == "error" else text
                ax.annotate(
                    text, (x, y), textcoords="offset points", xytext=offset, fontsize=7, color=color
                )
    for label, x, y, marker in PEERS:
        ax.plot(x, y, marker, color="0.4", ms=9, label=label, ls="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("graph size (nodes)")
    ax.set_ylabel("seconds to within 1 % of a proven bound\n(hollow: the wall time, not reached)")
    ax.set_title(
        f"{NET} (width {WIDTH}, seq {SEQ}, batch {BATCH}) at {rows[0]['budget_fraction']:.0%}, "
        f"one CPU device, HiGHS, limit {rows[0]['time_limit_s']:.0f} s\n"
        "filled: 1 % reached; hollow: not within the limit (final gap)",
        fontsize=9,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="6,12,24,48,77", help="decoder layers per graph")
    ap.add_argument("--budget", type=float, default=0.5, help="share of keep-everything's peak")
    ap.add_argument("--time-limit-s", type=float, default=240.0)
    ap.add_argument("--milp-max-nodes", type=int, default=400, help="checkmate_milp up to this")
    ap.add_argument("--address-space-gib", type=float, default=16.0, help="per solving process")
    ap.add_argument("--quick", action="store_true", help="layers 6 and 12, 30 s: a smoke run")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the CSV and PNG files")
    ap.add_argument("--replot", action="store_true", help="draw the PNG again from the CSV")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.replot:
        plot(read_rows(args.out / "solver_scaling.csv"), args.out / "solver_scaling.png")
        return 0
    layers = [6, 12] if args.quick else [int(x) for x in args.layers.split(",")]
    limit_s = 30.0 if args.quick else args.time_limit_s
    rows = run(layers, args.budget, limit_s, args.milp_max_nodes, args.address_space_gib, args.out)
    print(f"{'nodes':>6} {'strategy':<15} {'status':<12} {'gap %':>7} {'to 1 % (s)':>10}")
    for r in rows:
        print(
            f"{r['n_nodes']:>6} {r['strategy']:<15} {r['status']:<12} "
            f"{_fmt(r.get('gap_pct')):>7} {_fmt(r['time_to_gap_1pct_s']):>10}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
