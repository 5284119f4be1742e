"""Time fidelity: every executed schedule's predicted step time against its measured median,
beside plain PyTorch steps in the same process (issue 28).

Per net (torchvision models by name, ``gpt2_small``), on one CPU device (and on ``cpu2+cpu1``
for the nets of ``--two-device-nets``): capture, profile (keep-everything steps, as
``run.py``), then per budget (a percentage of each device's keep-everything peak) every
strategy of ``--strategies`` through the paper's protocol (:func:`xengine.protocol.plan`: with
two devices each single-device strategy runs on each device alone with the total memory, and
XEngine joins), each solved in context (:func:`xengine.refine.solve_in_context`: its schedule
timed in its own steps, solved again on those costs until stable, ``--rounds`` at most).

Each budget is solved and then measured at once (the prediction as close in time to its
measurement as in ``run.py``, which executes a schedule right after solving it): every
distinct schedule that fits, keep-everything included, is compiled once and run in pairs of a
plain PyTorch step and one step of the schedule (2 pairs of warm-up, then at least
``--measure-rounds`` pairs and at least ``--measure-s`` seconds of them, ``--measure-most``
pairs at most). Per schedule: the median step time, its noise (half the interquartile range
over the median), the median ratio to the plain step beside it with its standard error
(``ratio_se_pct``), and the error of two predictions against the median: the simulator's on
the keep-everything profile alone (``profile_err_pct``) and in context (``err_pct``, what
``run.py`` reports), with the standard error of each of the two medians (``pred_se_pct``, of
the timing in context; ``ratio_se_pct``, of the measurement).

This VM's speed drifts by 10-30 % within minutes, and a step's time correlates with the next
one's, so absolute times taken minutes apart differ by more than any model error. The
acceptance figure is therefore ``norm_err_pct``: the prediction in units of the plain step
timed beside the schedule's own context timing (``xengine.profile.context``), against the
measured median ratio to the plain step beside each measured step. Both sides are what a user
reads as "overhead over plain PyTorch", and neither depends on the machine's speed that
minute. Both are medians of the same schedule's ratio to plain, taken minutes apart; where
their standard errors are large, a prediction that is right still misses by chance:
``summary.csv`` counts the schedules within 5 % and those within 5 % or twice the standard
error of the difference (``within_5pct_or_noise``), which is what this machine can resolve.

Writes ``results/time_fidelity/time_fidelity.csv`` (one row per strategy, net, devices and
budget), ``summary.csv`` (per net and devices: keep-everything over plain, the worst and
median errors, whether the schedule predicted fastest at each budget is measured fastest
within twice the standard error of the two medians) and ``time_fidelity.png`` (left:
predicted against measured milliseconds, both predictions; right: in plain-step units; the
+-5 % band). The last lines printed are the acceptance figures.

    python experiments/time_fidelity.py                        # 10 nets + 3 on two devices
    python experiments/time_fidelity.py --nets resnet18 --budgets 50 --two-device-nets none
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.common import write_csv  # noqa: E402
from experiments.solver_benchmark import parse_cell  # noqa: E402
from xengine.config import MALLOCS  # noqa: E402
from xengine.execute import allocator  # noqa: E402
from xengine.execute.executor import CompiledSchedule, PlainStep  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.profile import paired  # noqa: E402
from xengine.profile.profiler import apply_profile, profile_model  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.protocol import solve_jobs  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.refine import solve_in_context  # noqa: E402
from xengine.schedule import keep_all_schedule  # noqa: E402
from xengine.simulate import keep_all_peak_bytes, simulate  # noqa: E402
from xengine.solvers import SolverOptions  # noqa: E402
from xengine.strategies.registry import SolveSettings, joining_mixes  # noqa: E402

log = logging.getLogger("time_fidelity")
OUT = ROOT / "results" / "time_fidelity"
# net -> (batch, image size or sequence length): small enough for 2 cores, large enough that
# 50 % of keep-everything is above every op's own footprint (the parameter gradients of the
# widest layer bound it from below at small inputs); many small ops (shufflenet, mnasnet,
# efficientnet) are where the executor's own cost per instruction shows most
NETS = {
    "resnet18": (4, 128),
    "mobilenet_v2": (2, 64),
    "gpt2_small": (2, 64),
    "shufflenet_v2_x0_5": (2, 128),
    "vit_b_16": (4, 96),
    "squeezenet1_1": (2, 96),
    "mnasnet0_5": (2, 96),
    "regnet_x_400mf": (2, 64),
    "efficientnet_b0": (2, 64),
    "mobilenet_v3_small": (2, 96),
}
TWO_DEVICE_NETS = ("resnet18", "mobilenet_v2", "gpt2_small")
STRATEGY_NAMES = ("checkmate", "chen_sqrtn", "chen_greedy", "recompute_greedy")
BUDGETS_PCT = (50, 70, 90)


@dataclass
class Entry:
    """One strategy's row before measurement."""

    net: str
    devices: str
    budget_pct: int
    label: str
    status: str
    inst: Instance | None = None
    sched: object = None
    profile_pred_s: float | None = None
    pred_s: float | None = None
    context_plain_s: float | None = None
    context_se: float | None = None
    rounds: int | None = None
    stable: bool | None = None
    key: str = ""


_noise, _median_se = paired.noise, paired.median_se


def solve_all(cap, graph, devices, budgets_pct, strategies, settings, rounds) -> list[Entry]:
    """Every strategy at every budget, solved in context; keep-everything as its own row."""
    entries: list[Entry] = []
    joining = [n for n in joining_mixes() if n not in strategies] if len(devices) > 1 else []
    names = [*strategies, *joining]
    tag = "+".join(devices)
    for pct in budgets_pct:
        budgets = tuple(int(keep_all_peak_bytes(graph, d) * pct / 100) for d in devices)
        inst = Instance(graph, devices, budgets)

        def solve(job, start):
            t0 = time.perf_counter()
            res, costed, ctx = solve_in_context(
                job.name,
                job.inst,
                job.settings(settings),
                cap,
                rounds=rounds,
                warm_start=start,
                label=job.label,
            )
            return res, costed, ctx, time.perf_counter() - t0

        solved = solve_jobs(inst, names, settings, solve, result_of=itemgetter(0))
        for job, (res, costed, ctx, seconds) in solved:
            e = Entry(cap.net, tag, pct, job.label, res.status)
            if res.has_schedule and res.sim.within_budget:
                e.inst, e.sched = costed, res.schedule
                e.pred_s = float(res.sim.time_s)
                if ctx is not None:
                    e.profile_pred_s = ctx.profile_time_s
                    e.context_plain_s = ctx.context_plain_step_s
                    e.context_se = ctx.context_se
                    e.rounds, e.stable = ctx.rounds, ctx.stable
            log.info(
                "%s %s %d%% %s: %s, predicted %s ms (%.0f s)",
                cap.net,
                tag,
                pct,
                job.label,
                res.status,
                "-" if e.pred_s is None else f"{e.pred_s * 1e3:.2f}",
                seconds,
            )
            entries.append(e)
    return entries


def measure(cap, entries: list[Entry], rounds: int, warmup: int, min_s: float, most: int) -> dict:
    """Per distinct schedule, ``warmup`` pairs and then at least ``rounds`` pairs of a plain
    PyTorch step and one step of the schedule, back to back as a training loop runs it (a
    schedule's own caches warm, as in ``run.py``'s execution and the timing in context), more
    until the pairs took ``min_s`` seconds (``most`` pairs at most: short steps get more
    samples, as their median is as noisy per step): its step times, and the plain steps
    beside them, under the schedule's key and ``"<key>|pytorch"``."""
    exes: dict[str, tuple[CompiledSchedule, str]] = {}
    for e in entries:
        if e.sched is None:
            continue
        what = (e.sched.R.tobytes(), e.sched.S.tobytes(), e.inst.budget_bytes, e.inst.devices)
        e.key = f"{e.devices}|{hash(what)}"
        if e.key not in exes:
            # the plain step beside it runs on the schedule's first device, as the one beside
            # its timing in context did (a single-device job of a mix runs on that device)
            exes[e.key] = (CompiledSchedule(cap, e.inst, e.sched), e.inst.devices[0])
    times: dict[str, list[float]] = {}
    plains = {dev: PlainStep(cap, dev) for dev in dict.fromkeys(d for _, d in exes.values())}
    try:
        for key, (exe, dev) in exes.items():
            plain = plains[dev]
            with exe:
                times[key], times[f"{key}|pytorch"] = pairs(plain, exe, warmup, rounds, min_s, most)
    finally:
        for plain in plains.values():
            plain.close()
    return times


def pairs(plain, exe, warmup: int, rounds: int, min_s: float, most: int):
    """Steps of ``exe`` and of ``plain`` (objects with ``step()``) in the pairs of
    :func:`xengine.profile.paired.pairs`: the schedule's step times and the plain steps'."""
    return paired.pairs(lambda: plain.step()[0], lambda: exe.step()[0], warmup, rounds, min_s, most)


def one_net(net: str, devices: tuple[str, ...], args, settings: SolveSettings) -> list[dict]:
    batch, image = NETS.get(net, (args.batch_size, args.image_size))
    t0 = time.perf_counter()
    cap = capture_net(net, batch, image_size=image)
    prof = profile_model(cap, devices, cache_dir=None, progress=False)
    graph = apply_profile(cap.graph, prof)
    cap.graph = graph
    keep = Instance(graph, devices[:1], (keep_all_peak_bytes(graph, devices[0]),))
    ka = Entry(net, "+".join(devices), 100, "keep_all", "feasible", keep, keep_all_schedule(keep))
    ka.pred_s = ka.profile_pred_s = float(simulate(keep, ka.sched).time_s)
    rows = []
    for k, pct in enumerate(args.budgets):
        # solved and then measured at once, one budget at a time: the machine drifts, and the
        # prediction (timed in context) should be as close in time to its measurement as it is
        # in run.py, where each schedule is executed right after it is solved
        entries = solve_all(cap, graph, devices, [pct], args.strategies, settings, args.rounds)
        at = ([ka] if k == 0 else []) + entries
        rows += _measured_rows(cap, graph, at, devices, args, (batch, image))
    log.info("%s on %s done in %.0f s", net, "+".join(devices), time.perf_counter() - t0)
    return rows


def _measured_rows(cap, graph, entries: list[Entry], devices, args, size) -> list[dict]:
    batch, image = size
    times = measure(cap, entries, args.measure_rounds, 2, args.measure_s, args.measure_most)
    rows = []
    for e in entries:
        row = {
            "net": e.net,
            "batch_size": batch,
            "image_size": image,
            "nodes": graph.size,
            "devices": e.devices,
            "budget_pct": e.budget_pct,
            "strategy": e.label,
            "status": e.status,
            "malloc": allocator.mode(),
        }
        if e.key:
            ts, plain_ts = times[e.key], times[f"{e.key}|pytorch"]
            row["plain_device"] = e.inst.devices[0]
            row["plain_ms"] = round(statistics.median(plain_ts) * 1e3, 3)
            row["plain_noise_pct"] = round(_noise(plain_ts) * 100, 2)
            meas = statistics.median(ts)
            ratio = statistics.median(t / p for t, p in zip(ts, plain_ts, strict=True))
            row.update(
                profile_pred_ms=round(e.profile_pred_s * 1e3, 3) if e.profile_pred_s else None,
                pred_ms=round(e.pred_s * 1e3, 3),
                meas_ms=round(meas * 1e3, 3),
                noise_pct=round(_noise(ts) * 100, 2),
                err_pct=round((e.pred_s / meas - 1) * 100, 2),
                profile_err_pct=(
                    round((e.profile_pred_s / meas - 1) * 100, 2) if e.profile_pred_s else None
                ),
                meas_over_plain=round(ratio, 4),
                ratio_noise_pct=round(
                    _noise([t / p for t, p in zip(ts, plain_ts, strict=True)]) * 100, 2
                ),
                pairs=len(ts),
                ratio_se_pct=round(
                    _median_se([t / p for t, p in zip(ts, plain_ts, strict=True)]) * 100, 2
                ),
                time_se_pct=round(_median_se(ts) * 100, 2),
                norm_err_pct=(
                    round(((e.pred_s / e.context_plain_s) / ratio - 1) * 100, 2)
                    if e.context_plain_s
                    else None
                ),
                pred_se_pct=(
                    round(e.context_se * 100, 2)
                    if e.context_se is not None and math.isfinite(e.context_se)
                    else None
                ),
                rounds=e.rounds,
                stable=e.stable,
            )
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per net and devices: keep-everything over plain, errors, and per budget whether the
    schedule predicted fastest is measured fastest within the noise."""
    out = []
    for net, dev in dict.fromkeys((r["net"], r["devices"]) for r in rows):
        mine = [r for r in rows if r["net"] == net and r["devices"] == dev and "meas_ms" in r]
        ka = next(r for r in mine if r["strategy"] == "keep_all")
        rec = [r for r in mine if r["strategy"] != "keep_all"]
        errs = [abs(r["err_pct"]) for r in mine]
        norm = [abs(r["norm_err_pct"]) for r in rec if r.get("norm_err_pct") is not None]
        picks = []
        for pct in sorted({r["budget_pct"] for r in rec}):
            at = [r for r in rec if r["budget_pct"] == pct]
            picks.append(f"{pct}%:{'ok' if _fastest_ok(at) else 'MISSED'}")
        out.append(
            {
                "net": net,
                "devices": dev,
                "keep_all_over_plain": ka["meas_over_plain"],
                "max_abs_err_pct": round(max(errs), 2),
                "median_abs_err_pct": round(statistics.median(errs), 2),
                "median_abs_profile_err_pct": round(
                    statistics.median(abs(r["profile_err_pct"]) for r in rec), 2
                )
                if rec
                else None,
                "max_abs_norm_err_pct": round(max(norm), 2) if norm else None,
                "median_abs_norm_err_pct": round(statistics.median(norm), 2) if norm else None,
                "within_5pct": _count(rec, lambda r: abs(r["norm_err_pct"]) <= TARGET_PCT),
                "within_5pct_or_noise": _count(rec, _within_noise),
                "median_ratio_se_pct": round(statistics.median(r["ratio_se_pct"] for r in mine), 2),
                "fastest_predicted_is_fastest": " ".join(picks),
            }
        )
    return out


TARGET_PCT = 5.0  # issue 28: every schedule's prediction within 5 % of its measured median


def _noise_pct(r: dict) -> float | None:
    """Twice the standard error of the normalised error: the timing in context and the
    measurement are two medians of the same schedule's ratio to plain, each with its own
    standard error, so a perfect prediction still misses by about this much by chance."""
    if r.get("pred_se_pct") is None or r.get("ratio_se_pct") is None:
        return None
    return 2 * math.hypot(r["pred_se_pct"], r["ratio_se_pct"])


def _within_noise(r: dict) -> bool:
    """Within 5 %, or within twice the standard error of the two medians it compares."""
    noise = _noise_pct(r)
    return abs(r["norm_err_pct"]) <= max(TARGET_PCT, noise if noise is not None else 0.0)


def _count(rows: list[dict], ok) -> str:
    rated = [r for r in rows if r.get("norm_err_pct") is not None]
    return f"{sum(bool(ok(r)) for r in rated)}/{len(rated)}"


def _fastest_ok(at: list[dict]) -> bool:
    """Whether the schedule predicted fastest is measured fastest within twice the standard
    error of the two medians. Both sides drift-free: the schedules of a budget are timed in
    context one after another, minutes apart, and the machine's speed moves between them (by
    a third within a minute here), so predictions are ranked in plain-step units
    (:func:`_pred_over_plain`), as the measurements are where every schedule had its plain
    step on one device; where the jobs of a mix had theirs on different devices, both sides
    are in milliseconds at the measurement's speed (the predicted ratio times the plain
    step measured beside the schedule)."""
    same = len({r["plain_device"] for r in at}) == 1
    key, se_key = ("meas_over_plain", "ratio_se_pct") if same else ("meas_ms", "time_se_pct")

    def predicted(r: dict) -> float:
        ratio = _pred_over_plain(r)
        if ratio is None:
            return r["pred_ms"]
        return ratio if same else ratio * r["plain_ms"]

    best_pred = min(at, key=predicted)
    best_meas = min(at, key=lambda r: r[key])
    se = math.hypot(best_pred[se_key], best_meas[se_key]) / 100
    return best_pred[key] <= best_meas[key] * (1 + 2 * se)


def _pred_over_plain(r: dict) -> float | None:
    """The prediction in units of the plain step timed beside its context timing: by the
    definition of ``norm_err_pct``, the measured ratio times (1 + that error); None for a row
    predicted without a timing in context."""
    if r.get("norm_err_pct") is None:
        return None
    return r["meas_over_plain"] * (1 + r["norm_err_pct"] / 100)


def plot(rows: list[dict], path: Path) -> None:
    done = [r for r in rows if "meas_ms" in r]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 6.2))
    strategies = sorted({r["strategy"].split(".")[0] for r in done})
    colours = dict(zip(strategies, plt.cm.tab10.colors, strict=False))
    for s in strategies:
        mine = [r for r in done if r["strategy"].split(".")[0] == s]
        meas = np.array([r["meas_ms"] for r in mine])
        ax.scatter(meas, [r["pred_ms"] for r in mine], s=22, color=colours[s], label=s)
        prof = [
            (m, r["profile_pred_ms"])
            for m, r in zip(meas, mine, strict=True)
            if r.get("profile_pred_ms")
        ]
        if prof:
            m, p = zip(*prof, strict=True)
            ax.scatter(m, p, s=22, facecolors="none", edgecolors=colours[s], alpha=0.6)
        norm = [r for r in mine if r.get("norm_err_pct") is not None]
        if norm:
            x = np.array([r["meas_over_plain"] for r in norm])
            bx.scatter(
                x,
                x * (1 + np.array([r["norm_err_pct"] for r in norm]) / 100),
                s=22,
                color=colours[s],
                label=s,
            )
    errs = [abs(r["err_pct"]) for r in done]
    _diagonal(ax, [v for r in done for v in (r["meas_ms"], r["pred_ms"])])
    ax.set_xlabel("measured step time, median (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(
        f"{len(done)} schedules, {len({r['net'] for r in done})} nets: |error| median "
        f"{statistics.median(errs):.1f} %, max {max(errs):.1f} %\n"
        "filled: in context (what run.py reports); hollow: keep-everything profile alone",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    norm = [r for r in done if r.get("norm_err_pct") is not None]
    if norm:
        ratios = [r["meas_over_plain"] for r in norm]
        _diagonal(
            bx,
            ratios + [x * (1 + r["norm_err_pct"] / 100) for x, r in zip(ratios, norm, strict=True)],
        )
        ne = [abs(r["norm_err_pct"]) for r in norm]
        bx.set_title(
            f"in plain-step units (drift-free): |error| median {statistics.median(ne):.1f} %, "
            f"max {max(ne):.1f} %\nwithin 5 %: {sum(e <= TARGET_PCT for e in ne)}/{len(ne)}; "
            f"within 5 % or 2 SE of the two medians: {_count(norm, _within_noise)}",
            fontsize=9,
        )
    bx.set_xlabel("measured step / plain step beside it, median")
    bx.set_ylabel("predicted step / plain step in the context timing")
    save_figure(fig, path)


def _minor_label(x: float, _pos) -> str:
    """A minor tick's label on a log axis: only where its leading digit is 2, 3 or 5, so that
    the labels of a decade do not run into each other."""
    lead = f"{x:e}"[0]
    return f"{x:g}" if lead in "235" else ""


def _diagonal(ax, values: list[float]) -> None:
    lo, hi = min(values) * 0.8, max(values) * 1.25
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, color="k", lw=0.8)
    ax.fill_between(xs, xs * 0.95, xs * 1.05, color="k", alpha=0.08, label="+-5 %")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers, not powers of ten; minor ticks 2, 3, 5
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(matplotlib.ticker.FuncFormatter(_minor_label))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=list(NETS))
    ap.add_argument("--two-device-nets", nargs="+", default=list(TWO_DEVICE_NETS))
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGY_NAMES))
    ap.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS_PCT))
    ap.add_argument("--rounds", type=int, default=2, help="rounds in context per strategy")
    ap.add_argument("--measure-rounds", type=int, default=15, help="pairs per schedule, at least")
    ap.add_argument("--measure-s", type=float, default=3.0, help="seconds of pairs, at least")
    ap.add_argument("--measure-most", type=int, default=60, help="pairs per schedule, at most")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per MILP solve")
    ap.add_argument("--batch-size", type=int, default=2, help="for nets not in the table")
    ap.add_argument("--image-size", type=int, default=64, help="for nets not in the table")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--malloc",
        choices=MALLOCS,
        default="steady",
        help="glibc's thresholds fixed (as run.py runs by default) or glibc as it is",
    )
    ap.add_argument(
        "--replot", action="store_true", help="only the summary and figure from the CSV in --out"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.replot:
        rows = _load(args.out / "time_fidelity.csv")
        _write(rows, args.out, final=True)
        return
    for noisy in ("xengine", "baselines"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.malloc == "steady":
        allocator.steady_malloc()
    settings = SolveSettings(options=SolverOptions(time_limit_s=args.time_limit))
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    # each net on one device and then, if named, on two: a run stopped early has both kinds
    two = [n for n in args.two_device_nets if n != "none"]
    runs = [(n, devs) for n in args.nets for devs in [("cpu",), ("cpu2", "cpu1")][: 1 + (n in two)]]
    runs += [(n, ("cpu2", "cpu1")) for n in two if n not in args.nets]
    t0 = time.perf_counter()
    for k, (net, devices) in enumerate(runs):
        log.info(
            "[%d/%d] %s on %s (%.0f min so far)",
            k + 1,
            len(runs),
            net,
            "+".join(devices),
            (time.perf_counter() - t0) / 60,
        )
        try:
            rows += one_net(net, devices, args, settings)
        except Exception as exc:  # one net that fails is recorded, the others go on
            log.exception("%s on %s failed", net, "+".join(devices))
            rows.append({"net": net, "devices": "+".join(devices), "status": f"error: {exc}"})
        _write(rows, args.out)
    _write(rows, args.out, final=True)


def _load(path: Path) -> list[dict]:
    """The rows of a ``time_fidelity.csv`` (``--replot``), typed as written. A row measured
    before the plain step beside a schedule ran on the schedule's own device (2026-12-03,
    first run: a single-device job of ``cpu2+cpu1`` on ``cpu1`` had its plain step on
    ``cpu2``) has no valid normalised error: it is blanked, the absolute error stays."""
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            row = {k: parse_cell(v) for k, v in raw.items() if v not in ("", None)}
            if "meas_ms" in row and "plain_device" not in row:
                job = row["strategy"].rpartition(".")[2] if "." in row["strategy"] else ""
                first = row["devices"].split("+")[0]
                row["plain_device"] = first
                if job and job != first:
                    row.pop("norm_err_pct", None)
            if "meas_ms" in row and "time_se_pct" not in row:  # the same formula as _median_se
                se = 1.253 * 2 * row["noise_pct"] / 1.349 / math.sqrt(row["pairs"])
                row["time_se_pct"] = round(se, 2)
            rows.append(row)
    return rows


def _write(rows: list[dict], out: Path, final: bool = False) -> None:
    write_csv(out / "time_fidelity.csv", rows)
    good = [r for r in rows if "meas_ms" in r]
    if not good:
        return
    summary = summarize([r for r in rows if "strategy" in r])
    write_csv(out / "summary.csv", summary)
    plot(good, out / "time_fidelity.png")
    if final:
        errs = [abs(r["err_pct"]) for r in good]
        norm = [abs(r["norm_err_pct"]) for r in good if r.get("norm_err_pct") is not None]
        prof = [abs(r["profile_err_pct"]) for r in good if r.get("profile_err_pct") is not None]
        for s in summary:
            print(" ".join(f"{k}={v}" for k, v in s.items()))
        print(
            f"schedules {len(good)}: |error| max {max(errs):.2f} % median "
            f"{statistics.median(errs):.2f} %; within 5 %: "
            f"{sum(e <= 5 for e in errs)}/{len(errs)}"
        )
        if norm:
            med = statistics.median(norm)
            rated = [r for r in good if r.get("norm_err_pct") is not None]
            noise = [n for r in rated if (n := _noise_pct(r)) is not None]
            print(
                f"plain-normalised |error| max {max(norm):.2f} % median {med:.2f} %; within "
                f"5 %: {_count(rated, lambda r: abs(r['norm_err_pct']) <= TARGET_PCT)}; within "
                f"5 % or twice the standard error of the two medians: "
                f"{_count(rated, _within_noise)}"
                + (f" (that noise: median {statistics.median(noise):.2f} %)" if noise else "")
            )
        if prof:
            print(f"keep-everything profile alone: |error| median {statistics.median(prof):.2f} %")
        print(f"keep-everything / plain: max {max(s['keep_all_over_plain'] for s in summary):.3f}")


if __name__ == "__main__":
    main()
