"""Executor overhead: a compiled schedule against a plain PyTorch step, side by side.

Per configuration (net, batch, image size, device, schedule) the schedule is compiled once
(``CompiledSchedule``) and three steps run interleaved round by round, so that the machine's
noise hits them alike: the compiled schedule, the same schedule interpreted (every backward
node its own autograd call, ``fuse=False``: the executor before issue 16) and a plain PyTorch
step. With ``--predict`` the net is also profiled on the device, in the same run just before
the rounds (no cache: machine state changes from one hour to the next), and the simulator's
predicted step time is set beside the measured one. Medians and ratios go to
``results/executor_overhead/`` (one CSV of rounds per configuration, ``summary.csv``,
``summary.png``); each configuration ends with a line
``ratio <compiled / plain>`` (with ``--predict`` also ``ratio_predicted <measured / predicted>``,
the measured time being that of compiled steps run one after another, as training runs them).

    python experiments/executor_overhead.py                       # the three CPU checks
    python experiments/executor_overhead.py --config r18-224      # one of them
    python experiments/executor_overhead.py --net resnet50 --batch-size 8 --device cuda --predict

glibc's malloc moves its mmap threshold with the allocation history, so the same plain step
took 34 ms or 63 ms here depending on what ran before it (page faults on fresh memory). The
overhead checks therefore run in a child process with fixed thresholds
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), the same for all three sides. The
prediction check (``r18-224-chen``) runs on glibc's allocator, as ``run.py`` does, since it
asks what a user's run measures against what it predicts (``--system-malloc``: a custom
configuration on glibc's allocator too).

Named configurations (issue 16): ``r18-224`` resnet18 b4 224 px on all threads, keep
everything; ``r18-32-cpu1`` resnet18 b2 32 px on one thread (launch-bound, as on a GPU);
``r18-224-chen`` resnet18 b4 224 px with Chen's sqrt(n) checkpoints, against its prediction.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baselines.heuristics import solve_chen_sqrtn  # noqa: E402
from experiments.common import write_csv  # noqa: E402
from xengine.execute.executor import CompiledSchedule, PlainStep  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.profile.profiler import apply_profile, profile_model  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.schedule import keep_all_schedule  # noqa: E402
from xengine.simulate import simulate  # noqa: E402

log = logging.getLogger("executor_overhead")
SCHEDULES = ("checkpoint_all", "chen_sqrtn")
SIDES = ("compiled", "interpreted", "plain")
# large enough that no activation is mmapped and freed memory stays in the heap
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


@dataclass(frozen=True)
class Config:
    name: str
    net: str
    batch_size: int
    image_size: int
    device: str
    schedule: str = "checkpoint_all"
    predict: bool = False
    malloc: str = "fixed"  # fixed thresholds (the overhead ratios) | system (glibc as it is)


NAMED = {
    "r18-224": Config("r18-224", "resnet18", 4, 224, "cpu"),
    "r18-32-cpu1": Config("r18-32-cpu1", "resnet18", 2, 32, "cpu1"),
    "r18-224-chen": Config(
        "r18-224-chen", "resnet18", 4, 224, "cpu", "chen_sqrtn", True, malloc="system"
    ),
}


def schedule_for(inst: Instance, kind: str):
    if kind == "checkpoint_all":
        return keep_all_schedule(inst)
    res = solve_chen_sqrtn(inst)
    if res.schedule is None:
        raise SystemExit(f"{kind} gave no schedule: {res.status} {res.note}")
    return res.schedule


def run_config(cfg: Config, rounds: int, warmup: int, out: Path) -> dict:
    cap = capture_net(cfg.net, cfg.batch_size, image_size=cfg.image_size)
    graph = cap.graph
    if cfg.predict:
        # measured now, not from the cache: profile and steps side by side in one run
        prof = profile_model(cap, [cfg.device], cache_dir=None, progress=False)
        graph = apply_profile(graph, prof)
    inst = Instance.single(graph, cfg.device, None)
    sched = schedule_for(inst, cfg.schedule)
    predicted_s = simulate(inst, sched).time_s if cfg.predict else float("nan")
    times: dict[str, list[float]] = {"compiled": [], "interpreted": [], "plain": []}
    with (
        CompiledSchedule(cap, inst, sched) as compiled,
        CompiledSchedule(cap, inst, sched, fuse=False) as interpreted,
        PlainStep(cap, cfg.device) as plain,
    ):
        sides = {"compiled": compiled, "interpreted": interpreted, "plain": plain}
        for k in range(warmup + rounds):
            for name, side in sides.items():
                dt = side.step()[0]
                if k >= warmup:
                    times[name].append(dt)
            if k >= warmup:
                log.info(
                    "%s round %d/%d: compiled %.1f ms, interpreted %.1f ms, plain %.1f ms",
                    cfg.name,
                    k + 1 - warmup,
                    rounds,
                    *(1e3 * times[n][-1] for n in ("compiled", "interpreted", "plain")),
                )
        # a schedule against its own prediction: its steps one after another, as training
        # runs them (interleaving the three sides leaves each step's caches to another)
        if cfg.predict:
            times["consecutive"] = [compiled.step()[0] for _ in range(rounds)]
    med = {n: statistics.median(t) for n, t in times.items()}
    with open(out / f"{cfg.name}.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["round", "compiled_step_ms", "interpreted_step_ms", "plain_step_ms"])
        for k, row in enumerate(zip(*(times[n] for n in SIDES), strict=True)):
            w.writerow([k, *(f"{1e3 * t:.3f}" for t in row)])
    if cfg.predict:
        with open(out / f"{cfg.name}_consecutive.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["step", "compiled_step_ms", "predicted_ms"])
            for k, t in enumerate(times["consecutive"]):
                w.writerow([k, f"{1e3 * t:.3f}", f"{1e3 * predicted_s:.3f}"])
    return {
        "config": cfg.name,
        "net": cfg.net,
        "batch_size": cfg.batch_size,
        "image_size": cfg.image_size,
        "device": cfg.device,
        "device_name": torch.cuda.get_device_name(cfg.device) if "cuda" in cfg.device else "",
        "schedule": cfg.schedule,
        "rounds": rounds,
        "compiled_median_ms": round(1e3 * med["compiled"], 3),
        "interpreted_median_ms": round(1e3 * med["interpreted"], 3),
        "plain_median_ms": round(1e3 * med["plain"], 3),
        "ratio": round(med["compiled"] / med["plain"], 4),
        "interpreted_ratio": round(med["interpreted"] / med["plain"], 4),
        "predicted_ms": round(1e3 * predicted_s, 3) if cfg.predict else "",
        "consecutive_median_ms": round(1e3 * med["consecutive"], 3) if cfg.predict else "",
        "ratio_predicted": round(med["consecutive"] / predicted_s, 4) if cfg.predict else "",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "malloc": "fixed thresholds" if "MALLOC_MMAP_THRESHOLD_" in os.environ else "glibc",
        "_times": times,
    }


def merged(summary: Path, rows: list[dict], out: Path) -> list[dict]:
    """The rows of ``summary`` for configurations not run now (their rounds read back from
    their CSVs), then the new rows: running one named check keeps the others' results."""
    if not summary.exists():
        return rows
    new = {r["config"] for r in rows}
    with open(summary, newline="") as fh:
        old = [r for r in csv.DictReader(fh) if r["config"] not in new]
    kept = []
    for r in old:
        try:
            with open(out / f"{r['config']}.csv", newline="") as fh:
                rounds = list(csv.DictReader(fh))
        except OSError:
            continue
        r["_times"] = {n: [float(x[f"{n}_step_ms"]) / 1e3 for x in rounds] for n in SIDES}
        cons = out / f"{r['config']}_consecutive.csv"
        if cons.exists():
            with open(cons, newline="") as fh:
                r["_times"]["consecutive"] = [
                    float(x["compiled_step_ms"]) / 1e3 for x in csv.DictReader(fh)
                ]
        for k in ("batch_size", "image_size"):
            r[k] = int(r[k])
        for k in ("ratio", "predicted_ms"):
            r[k] = float(r[k]) if r[k] != "" else ""
        kept.append(r)
    order = list(NAMED)
    return sorted(
        kept + rows, key=lambda r: order.index(r["config"]) if r["config"] in order else 99
    )


def plot(rows: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=True):
        for name, marker in (("compiled", "o-"), ("interpreted", "^-"), ("plain", "s-")):
            t = [1e3 * x for x in r["_times"][name]]
            ax.plot(t, marker, ms=3, label=f"{name} (median {statistics.median(t):.1f} ms)")
        if r["predicted_ms"] != "":
            ax.axhline(r["predicted_ms"], color="k", ls=":", label="predicted (profile)")
            if "consecutive" in r["_times"]:
                t = [1e3 * x for x in r["_times"]["consecutive"]]
                ax.plot(
                    t,
                    "d--",
                    ms=3,
                    label=f"compiled, consecutive (median {statistics.median(t):.1f} ms)",
                )
        ax.set_title(
            f"{r['config']}: {r['net']} b{r['batch_size']} {r['image_size']}px {r['device']}\n"
            f"{r['schedule']}, compiled / plain = {r['ratio']:.3f}",
            fontsize=9,
        )
        ax.set_xlabel("round (interleaved)")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _configs(args: argparse.Namespace) -> list[Config]:
    if not args.net:
        return [NAMED[c] for c in (args.config or list(NAMED))]
    name = f"{args.net}-b{args.batch_size}-{args.image_size}-{args.device.replace(':', '')}"
    if args.schedule != "checkpoint_all":
        name += f"-{args.schedule}"
    return [
        Config(
            name,
            args.net,
            args.batch_size,
            args.image_size,
            args.device,
            args.schedule,
            args.predict,
            malloc="system" if args.system_malloc else "fixed",
        )
    ]


def _without_configs(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--config":
            skip = True
        elif not a.startswith("--config="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", choices=sorted(NAMED), help="named check")
    ap.add_argument("--net", help="a custom configuration instead of the named ones")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--device", default="cpu", help="cpu, cpu<k> (k threads), cuda, cuda:<i>")
    ap.add_argument("--schedule", default="checkpoint_all", choices=SCHEDULES)
    ap.add_argument("--predict", action="store_true", help="profile and compare with prediction")
    ap.add_argument("--rounds", "--steps", type=int, default=12, help="timed rounds (>= 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "executor_overhead")
    ap.add_argument(
        "--system-malloc", action="store_true", help="a custom configuration on glibc's malloc"
    )
    args = ap.parse_args(argv)
    configs = _configs(args)
    if argv is None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # the allocator is set when a process starts: the fixed-threshold checks run in a
        # child process, the others (the prediction check, as run.py runs) in this one
        fixed = [c for c in configs if c.malloc == "fixed"]
        if fixed:
            child = [sys.executable, __file__, *_without_configs(sys.argv[1:])]
            if not args.net:
                child += [x for c in fixed for x in ("--config", c.name)]
            subprocess.run(child, env=dict(os.environ, **FIXED_MALLOC), check=True)
        configs = [c for c in configs if c.malloc != "fixed"]
        if not configs:
            return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cfg in configs:
        r = run_config(cfg, args.rounds, args.warmup, args.out)
        rows.append(r)
        print(
            f"{cfg.name}: {cfg.net} b{cfg.batch_size} {cfg.image_size}px on {cfg.device}, "
            f"{cfg.schedule}: compiled {r['compiled_median_ms']:.1f} ms, interpreted "
            f"{r['interpreted_median_ms']:.1f} ms, plain {r['plain_median_ms']:.1f} ms "
            f"({args.rounds} interleaved rounds)"
            + (
                f"; predicted {r['predicted_ms']:.1f} ms, {args.rounds} consecutive compiled "
                f"steps {r['consecutive_median_ms']:.1f} ms"
                if cfg.predict
                else ""
            )
        )
        if cfg.predict:
            print(f"ratio_predicted {r['ratio_predicted']:.3f}")
        print(f"ratio {r['ratio']:.3f}", flush=True)
    summary = args.out / ("summary.csv" if not args.net else f"{configs[0].name}_summary.csv")
    rows = merged(summary, rows, args.out)
    fields = [k for k in rows[-1] if not k.startswith("_")]
    write_csv(summary, rows, fields, only=True)
    plot(rows, summary.with_suffix(".png"))
    log.info("wrote %s and %s", summary, summary.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
