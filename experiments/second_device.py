"""Is the second device worth it, measured: two-device schedules against one device at the
same per-device budget, executed side by side in one run.

XEngine's claim is that a second device with its own memory makes a step faster than one
device with one budget: values kept on the other device need not be recomputed. On
``cpu2+cpu1`` (two CPU sub-devices, 2 and 1 threads) the model predicts small gains; this
script measures them, so the "worth it" figure in docs/measurements.md comes from a command.

Per net (``NETS``: run.py's shape for resnet18, smaller shapes for the others), on
``--devices`` at ``--budget`` % of each device's keep-everything peak: capture, profile
(afresh, in the same minutes as the measurement), then the candidates, all from the
protocol's own heuristics:

- ``one device``: ``recompute_greedy`` (held) on the fastest device alone at its own budget,
  placed there: what a user with that one device gets;
- ``one device, both budgets``: the same at the sum of the budgets (one device with all the
  memory; it exceeds the fastest device's own budget, a reference, not a contender);
- ``offloaded +f``: XEngine's offloaded starts (:func:`offload_starts`: the greedy at the
  fastest device's budget plus f of the others', then what does not fit moved over).

Every candidate is compiled once; then ``--rounds`` rounds (after 2 of warm-up), each a plain
PyTorch step and one step of every candidate in turn, each candidate's step right after a
plain step on the fastest device (:mod:`xengine.profile.paired`'s order). The machine drifts
by 10-30 % within minutes, so what compares is each step's ratio to the plain step beside it:
per candidate the median ratio with its standard error, and its speed-up over ``one device``
(the median over rounds of the one-device ratio over the candidate's, same round). Each
candidate's per-device peaks are measured once under the profiler after its rounds, beside
the simulator's; where they differ by more than 1 MiB, the graph and schedule are kept to
replay it.

Writes ``results/second_device/second_device.csv`` (one row per net and candidate) and
``second_device.png`` (measured ratio to plain with twice its standard error, the predicted
ratio on profile costs as a mark; ``--replot`` draws it again from the CSV).

    python experiments/second_device.py             # resnet18, mobilenet_v2, gpt2_small, ~7 min
    python experiments/second_device.py --nets resnet18 --budget 70 --rounds 15
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.common import commit as checkout_commit  # noqa: E402
from experiments.common import write_csv  # noqa: E402
from experiments.solver_benchmark import parse_cell  # noqa: E402
from xengine.execute import allocator  # noqa: E402
from xengine.execute.executor import CompiledSchedule, PlainStep  # noqa: E402
from xengine.graph.io import save_graph  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.profile import paired  # noqa: E402
from xengine.profile.profiler import apply_profile, profile_model  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.protocol import OFFLOAD_DEFAULT_S  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.schedule import Schedule, keep_all_schedule  # noqa: E402
from xengine.simulate import keep_all_peak_bytes, simulate  # noqa: E402
from xengine.strategies.distribute import offload_starts, place  # noqa: E402
from xengine.strategies.registry import load  # noqa: E402

log = logging.getLogger("second_device")
OUT = ROOT / "results" / "second_device"
MIB = 2**20
# net -> (batch, image size or sequence length): resnet18 as run.py runs it by default
NETS = {"resnet18": (4, 224), "mobilenet_v2": (4, 128), "gpt2_small": (2, 256)}
# what the offloaded starts may take per net: the protocol's own when a run has no limit
OFFLOAD_LIMIT_S = OFFLOAD_DEFAULT_S


def candidates(inst: Instance) -> list[tuple[str, Schedule]]:
    """The one-device schedules and XEngine's offloaded starts for ``inst``, each that fits
    (the one with both budgets is allowed past the fastest device's own)."""
    greedy = load("recompute_greedy")
    fast = inst.fastest_device
    n = inst.graph.size
    out = []
    for label, budget in (
        ("one device", int(inst.budget_bytes[fast])),
        ("one device, both budgets", int(inst.budgets.sum())),
    ):
        res = greedy(inst.only_device(fast, budget), hold=True)
        if res.has_schedule and res.sim.within_budget:
            out.append((label, place(res.schedule, inst.devices, [fast] * n)))
        else:
            log.warning("%s: recompute_greedy found nothing within %.2f MiB", label, budget / MIB)
    for label, sched in offload_starts(inst, OFFLOAD_LIMIT_S):
        frac = label.split("+ ")[1].split(" of")[0]
        out.append((f"offloaded +{frac}", sched))
    return out


def measure(
    cap, inst: Instance, cands, rounds: int
) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """Per candidate, its step times over the plain step's before it, round by round, and
    then each CPU device's activation peak in one step under the profiler (by the same
    compiled schedule: each candidate is compiled once)."""
    fast_dev = inst.devices[inst.fastest_device]
    exes = {label: CompiledSchedule(cap, inst, s) for label, s in cands}
    plain = PlainStep(cap, fast_dev)
    ratios: dict[str, list[float]] = {label: [] for label in exes}
    try:
        for r in range(rounds + 2):
            for label, exe in exes.items():
                dt_plain = plain.step()[0]
                dt = exe.step()[0]
                if r >= 2:  # the first two rounds warm the caches
                    ratios[label].append(dt / dt_plain)
            if r >= 2:
                log.info(
                    "round %d/%d: %s",
                    r - 1,
                    rounds,
                    ", ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items()),
                )
        peaks = {label: exe.cpu_peaks()[0] for label, exe in exes.items()}
    finally:
        plain.close()
        for exe in exes.values():
            exe.close()
    return ratios, peaks


def one_net(net: str, devices: tuple[str, ...], args) -> list[dict]:
    batch, size = NETS.get(net, (args.batch_size, args.image_size))
    budget_pct = args.budget
    t0 = time.perf_counter()
    cap = capture_net(net, batch, image_size=size)
    graph = apply_profile(cap.graph, profile_model(cap, devices, cache_dir=None, progress=False))
    cap.graph = graph
    budgets = tuple(int(keep_all_peak_bytes(graph, d) * budget_pct / 100) for d in devices)
    inst = Instance(graph, devices, budgets)
    fast = inst.fastest_device
    keep = Instance(graph, (devices[fast],), (keep_all_peak_bytes(graph, devices[fast]),))
    keep_s = float(simulate(keep, keep_all_schedule(keep)).time_s)  # a plain step, predicted
    cands = candidates(inst)
    log.info("%s: %d candidates in %.0f s", net, len(cands), time.perf_counter() - t0)
    ratios, measured_peaks = measure(cap, inst, cands, args.rounds)
    one = ratios.get("one device")
    rows = []
    for label, sched in cands:
        sim = simulate(inst, sched, check_budget=False)
        peaks = measured_peaks[label]
        mine = ratios[label]
        row = {
            "net": net,
            "batch_size": batch,
            "image_size": size,
            "nodes": graph.size,
            "devices": "+".join(devices),
            "budget_pct": budget_pct,
            "candidate": label,
            "fastest_device": devices[fast],
            "computes_off_fastest": int(np.delete(sched.R, fast, axis=0).sum()),
            "pred_ms": round(float(sim.time_s) * 1e3, 3),
            "pred_over_keep_all": round(float(sim.time_s) / keep_s, 4),
            "meas_over_plain": round(statistics.median(mine), 4),
            "ratio_se_pct": round(paired.median_se(mine) * 100, 2),
            "rounds": len(mine),
            "malloc": allocator.mode(),
            "commit": args.commit,
        }
        if one is not None:
            speedup = [a / b for a, b in zip(one, mine, strict=True)]
            row["speedup_over_one_device"] = round(statistics.median(speedup), 4)
            row["speedup_se_pct"] = round(paired.median_se(speedup) * 100, 2)
        _keep_if_off(row, args.out, graph, budgets, sched, sim, peaks)
        for k, dev in enumerate(devices):
            row[f"pred_peak_{dev}_mib"] = round(int(sim.peak_bytes[k]) / MIB, 2)
            row[f"meas_peak_{dev}_mib"] = round(peaks.get(dev, 0) / MIB, 2)
            row[f"budget_{dev}_mib"] = round(budgets[k] / MIB, 2)
        rows.append(row)
    log.info("%s done in %.0f s", net, time.perf_counter() - t0)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Per net, each candidate's measured ratio to a plain step (bar, twice its standard
    error) and the predicted ratio on profile costs (mark)."""
    nets = list(dict.fromkeys(r["net"] for r in rows))
    fig, axes = plt.subplots(1, len(nets), figsize=(4.2 * len(nets), 4.2), squeeze=False)
    for ax, net in zip(axes[0], nets, strict=True):
        mine = [r for r in rows if r["net"] == net]
        x = np.arange(len(mine))
        meas = [r["meas_over_plain"] for r in mine]
        err = [2 * r["meas_over_plain"] * r["ratio_se_pct"] / 100 for r in mine]
        ax.bar(x, meas, yerr=err, color="tab:blue", alpha=0.7, capsize=3, label="measured")
        ax.plot(x, [r["pred_over_keep_all"] for r in mine], "kD", label="predicted (profile)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x, [r["candidate"] for r in mine], rotation=30, ha="right", fontsize=8)
        ax.set_ylim(min(0.9, *meas), max(meas + [r["pred_over_keep_all"] for r in mine]) * 1.08)
        first = mine[0]
        ax.set_title(
            f"{net}, {first['devices']} at {first['budget_pct']} % "
            f"(one device: {first['fastest_device']})",
            fontsize=9,
        )
        ax.set_ylabel("step time / plain PyTorch step")
    axes[0][0].legend(fontsize=8, loc="upper left")
    save_figure(fig, path)


def _keep_if_off(row: dict, out: Path, graph, budgets, sched: Schedule, sim, peaks) -> None:
    """Where a measured peak is more than 1 MiB from the simulator's, a warning, and the
    graph (with its costs), budgets and schedule under ``out/peak_off/`` to replay it: such a
    schedule depends on the profile of that run and cannot be made again."""
    off = {
        d: (int(sim.peak_bytes[k]) - peaks.get(d, 0)) / MIB
        for k, d in enumerate(sched.devices)
        if abs(int(sim.peak_bytes[k]) - peaks.get(d, 0)) > MIB
    }
    if not off:
        return
    name = f"{row['net']}_{row['candidate'].replace(' ', '_').replace('%', 'pct')}"
    where = out / "peak_off" / name
    save_graph(graph, where / "graph.json")
    data = {"budgets_bytes": list(budgets), "schedule": sched.to_json()}
    (where / "schedule.json").write_text(json.dumps(data) + "\n", encoding="utf-8")
    log.warning(
        "%s %s: predicted minus measured peak %s MiB; graph and schedule in %s",
        row["net"],
        row["candidate"],
        {d: round(v, 2) for d, v in off.items()},
        where,
    )
    row["peak_off_dir"] = str(where.relative_to(out))


def _load(path: Path) -> list[dict]:
    """The measured rows of a ``second_device.csv``, numbers as numbers."""
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            if raw.get("meas_over_plain"):
                rows.append({k: parse_cell(v) for k, v in raw.items() if v not in ("", None)})
    return rows


def write(rows: list[dict], out: Path) -> None:
    write_csv(out / "second_device.csv", rows)
    good = [r for r in rows if "meas_over_plain" in r]
    if good:
        plot(good, out / "second_device.png")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=list(NETS))
    ap.add_argument("--devices", default="cpu2+cpu1", help="two or more devices, '+'-joined")
    ap.add_argument("--budget", type=int, default=50, help="%% of each device's keep-all peak")
    ap.add_argument("--rounds", type=int, default=30, help="measured rounds after 2 of warm-up")
    ap.add_argument("--batch-size", type=int, default=2, help="for nets not in the table")
    ap.add_argument("--image-size", type=int, default=64, help="for nets not in the table")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--replot", action="store_true", help="only the figure, from the CSV in --out")
    args = ap.parse_args(argv)
    if args.replot:
        plot(_load(args.out / "second_device.csv"), args.out / "second_device.png")
        return
    args.commit = checkout_commit()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("xengine", "baselines"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    allocator.steady_malloc()  # glibc's thresholds fixed, as run.py runs by default
    devices = tuple(args.devices.split("+"))
    rows: list[dict] = []
    for k, net in enumerate(args.nets):
        log.info("[%d/%d] %s on %s", k + 1, len(args.nets), net, args.devices)
        try:
            rows += one_net(net, devices, args)
        except Exception as exc:  # one net that fails is recorded, the others go on
            log.exception("%s failed", net)
            rows.append({"net": net, "devices": args.devices, "status": f"error: {exc}"})
        write(rows, args.out)
    cols = ("net", "candidate", "pred_over_keep_all", "meas_over_plain", "speedup_over_one_device")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "-")) for c in cols))


if __name__ == "__main__":
    main()
