"""What a schedule costs on the machine against what its ops cost (issue 58, item 7).

Per net and budget, one run of the pipeline (``xengine.pipeline.run_pipeline``, the path
``run.py`` takes) with no rounds in context (``context_rounds=0``): every strategy is solved on
a plain step's op costs (the keep-everything profile, measured fresh in this process) and
executed, each timed step beside a plain PyTorch step. Per row:

* ``pred_over_keepall``: the prediction over keep-everything's prediction on the same costs,
  the step time the model expects in plain steps (keep-everything measures as one, 1.00-1.04);
* ``meas_over_plain``: the median of each executed step's time over the plain step just
  before it (``measured_over_plain``);
* ``err_pct``: ``meas_over_plain / pred_over_keepall - 1``, what the executor adds to a
  schedule beyond its ops (the issue's item 1 asks for 3 % at most, median 1.5 %);
* for PyTorch's own policies (``torch_checkpoint``, ``torch_sac``): ``ours_over_plain``, our
  executor's run of the policy translated into a schedule, and ``pytorch_over_ours``, PyTorch's
  own time over ours on the same plan, the two measured beside the same plain steps (item 2
  asks for 1.00 at the median, 1.03 at most);
* the measured and predicted activation peaks and their difference.

The VM's speed drifts by 10-35 % within minutes, so only ratios to a plain step timed beside
them are compared; each row's ratio is a median of ``--steps`` pairs.

    python experiments/executor_cost.py                                   # the three nets
    python experiments/executor_cost.py --nets gpt2_small:2:128 --budgets 90,60

Writes ``results/executor_cost/executor_cost.{csv,png}`` (``--out``); the CSV is rewritten after
every run, so a stopped sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.common import commit, write_csv  # noqa: E402
from xengine.config import RunConfig  # noqa: E402
from xengine.execute.allocator import steady_malloc  # noqa: E402
from xengine.pipeline import run_pipeline  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.result import MIB, RunRow  # noqa: E402
from xengine.solvers.model import SolverOptions  # noqa: E402

log = logging.getLogger("executor_cost")
OUT = ROOT / "results" / "executor_cost"
NETS = "gpt2_small:2:128,resnet18:4:224,mobilenet_v2:2:128"
STRATEGIES = (
    "checkpoint_all",
    "checkmate",
    "chen_sqrtn",
    "chen_greedy",
    "recompute_greedy",
    "torch_checkpoint",
    "torch_sac",
)
POLICIES = ("torch_checkpoint", "torch_sac")


def run_point(net: str, batch: int, size: int, budget_pct: int, args) -> list[dict]:
    """One pipeline run at ``budget_pct`` % of the keep-everything peak; its rows as dicts."""
    cfg = RunConfig(
        net=net,
        batch_size=batch,
        image_size=size,
        mem=(f"{budget_pct}%",),
        strategies=tuple(args.strategies),
        context_rounds=0,
        n_steps=args.steps,
        warmup=2,
        profile_cache_dir=args.profiles,  # a fresh profile per process: the machine drifts
        solver_options=SolverOptions(time_limit_s=args.time_limit_s),
        progress=False,
    )
    t0 = time.perf_counter()
    rows = run_pipeline(cfg)
    log.info(
        "%s b%d %d px at %d %%: %.0f s", net, batch, size, budget_pct, time.perf_counter() - t0
    )
    keep_all = next((r for r in rows if r.strategy == "checkpoint_all"), None)
    ka_pred = keep_all.predicted_time_s if keep_all is not None else None
    return [_row(r, net, batch, size, budget_pct, ka_pred) for r in rows]


def _row(r: RunRow, net: str, batch: int, size: int, pct: int, ka_pred: float | None) -> dict:
    pred = r.predicted_time_s
    pred_ka = pred / ka_pred if pred and ka_pred else None
    meas = r.measured_over_plain
    ours = r.ours_over_plain
    peak = r.measured_peak_bytes[0] if r.measured_peak_bytes else None
    ppeak = r.predicted_peak_bytes[0] if r.predicted_peak_bytes else None
    return {
        "net": net,
        "batch": batch,
        "size": size,
        "budget_pct": pct,
        "strategy": r.label,
        "status": r.status,
        "wrong": r.wrong,
        "n_recomputes": r.n_recomputes,
        "pred_ms": _ms(pred),
        "meas_ms": _ms(r.measured_time_s),
        "pred_over_keepall": _r(pred_ka),
        "meas_over_plain": _r(meas),
        "err_pct": _r(100 * (meas / pred_ka - 1)) if meas and pred_ka else None,
        "ours_over_plain": _r(ours),
        "pytorch_over_ours": _r(meas / ours) if meas and ours else None,
        "pred_peak_mib": _r(ppeak / MIB) if ppeak is not None else None,
        "meas_peak_mib": _r(peak / MIB) if peak is not None else None,
        "peak_err_mib": _r((peak - ppeak) / MIB) if peak is not None and ppeak else None,
        "commit": commit(),
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1e3 * s, 3)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def plot(rows: list[dict], path: Path) -> None:
    """Left: each executed schedule's error (measured over predicted, both in plain steps)
    against its predicted step, per strategy and net (the 3 % band drawn); right: PyTorch's own
    time over our executor's on PyTorch's plans, per net and budget."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    ours = [r for r in rows if r["err_pct"] is not None and r["strategy"] not in POLICIES]
    markers = dict(zip(dict.fromkeys(r["net"] for r in rows), "osD^v<>", strict=False))
    colors = dict(
        zip(dict.fromkeys(r["strategy"] for r in ours), plt.cm.tab10.colors, strict=False)
    )
    for r in ours:
        ax.scatter(
            r["pred_over_keepall"],
            r["err_pct"],
            marker=markers[r["net"]],
            color=colors[r["strategy"]],
        )
    ax.axhspan(-3, 3, color="0.88", zorder=0)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("predicted step on a plain step's op costs (over keep-everything's prediction)")
    ax.set_ylabel("measured over predicted - 1 (%)")
    ax.set_title("What the executor adds to a schedule (band: 3 %)")
    handles = [plt.Line2D([], [], ls="", marker="o", color=c, label=s) for s, c in colors.items()]
    handles += [
        plt.Line2D([], [], ls="", marker=m, color="0.4", label=n) for n, m in markers.items()
    ]
    ax.legend(handles=handles, fontsize=7)
    pol = [r for r in rows if r["pytorch_over_ours"] is not None]
    labels = [
        f"{r['net']} {int(r['budget_pct'])}% {r['strategy'].replace('torch_', '')}" for r in pol
    ]
    bx.barh(range(len(pol)), [r["pytorch_over_ours"] for r in pol], color="tab:orange")
    bx.axvline(1.0, color="k", lw=0.8)
    bx.set_yticks(range(len(pol)), labels, fontsize=7)
    bx.set_xlabel("PyTorch's own step time over our executor's, same plan")
    med = statistics.median(r["pytorch_over_ours"] for r in pol) if pol else float("nan")
    bx.set_title(f"PyTorch's plans (median {med:.3f}; below 1: ours slower)")
    made = ", ".join(sorted({str(r["commit"]) for r in rows}))
    fig.suptitle(f"executor cost, commit {made}, no rounds in context")
    save_figure(fig, path)
    plt.close(fig)


def _read(path: Path) -> list[dict]:
    """The CSV's rows with numbers as numbers (empty cells None)."""
    out = []
    for row in csv.DictReader(path.open()):
        out.append(
            {k: v if k in ("net", "strategy", "commit") else _num(v) for k, v in row.items()}
        )
    return out


def _num(text: str):
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", default=NETS, help="net:batch:size, comma-separated")
    ap.add_argument("--budgets", default="100,70,50", help="percent of the keep-everything peak")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=15, help="timed steps per row (median)")
    ap.add_argument("--time-limit-s", type=float, default=10.0, help="Checkmate's solve")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--plot-only", action="store_true", help="re-draw the PNG from the CSV")
    args = ap.parse_args()
    args.strategies = args.strategies.split(",")
    args.profiles = tempfile.mkdtemp(prefix="executor_cost_profiles_")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("xengine", "baselines"):
        logging.getLogger(name).setLevel(logging.WARNING)
    csv_path = args.out / "executor_cost.csv"
    if args.plot_only:
        plot(_read(csv_path), args.out / "executor_cost.png")
        return
    steady_malloc()
    rows: list[dict] = []
    for spec in args.nets.split(","):
        net, batch, size = spec.split(":")
        for pct in (int(b) for b in args.budgets.split(",")):
            try:
                rows += run_point(net, int(batch), int(size), pct, args)
            except Exception:  # a failed point is logged; the sweep keeps what it has
                log.exception("%s at %d %% failed", spec, pct)
            write_csv(csv_path, rows)
    plot(rows, args.out / "executor_cost.png")
    errs = [abs(r["err_pct"]) for r in rows if r["err_pct"] is not None]
    pt = [r["pytorch_over_ours"] for r in rows if r["pytorch_over_ours"] is not None]
    if errs:
        log.info(
            "|err| median %.1f %%, max %.1f %% over %d rows",
            statistics.median(errs),
            max(errs),
            len(errs),
        )
    if pt:
        log.info(
            "PyTorch over ours on its plans: median %.3f, min %.3f", statistics.median(pt), min(pt)
        )
    log.info("wrote %s", csv_path)


if __name__ == "__main__":
    main()
