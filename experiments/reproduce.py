"""Make every figure that the README and docs/measurements.md show, one command after the
other, with a progress line per step and an estimate of the time left.

Each figure is stamped when its step ends: a strip under the picture names the command and
the commit that made it, the same two go into the PNG's text chunks (``xengine.command``,
``xengine.commit``), and ``<out>/reproduce_manifest.csv`` lists every figure with its command,
commit, time and how long the step took. A step that fails is reported and the others go on
(the exit status is then 1); a step that needs a GPU is skipped without one.

``--quick`` runs the same steps on small nets with short limits into ``results/quick/`` (its
own MLflow store there), so the shipped figures are left alone: 6.9 minutes on this 2-core
machine on 2026-12-05 (each step's ``quick_s`` is its time then). Without it the figures are
made where the documents show them, which takes hours (the frontier sweep alone is 71
minutes; the solver benchmarks on the H200 cost most of the rest); ``full_s`` is a step's
last full time where one was taken, a guess from its sweep's size otherwise.

Usage:
  .venv/bin/python experiments/reproduce.py [--quick] [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import csv
import logging
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.common import commit  # noqa: E402

PY = "python"  # as the figures name it; run with this interpreter (sys.executable)
log = logging.getLogger("reproduce")


@dataclass(frozen=True)
class Step:
    """One command and the figures it makes (paths relative to its output folder); ``full_s``
    and ``quick_s``: the expected seconds on this 2-core machine, for the estimate."""

    name: str
    full: tuple[str, ...]
    quick: tuple[str, ...] | None  # None: not part of --quick
    figures: tuple[str, ...]
    full_s: float
    quick_s: float = 0.0
    needs_gpu: bool = False


def _sweep(*args: str) -> str:
    """A sweep run again in full (``redo=true``: a figure is remade from new runs only)."""
    return " ".join((f"{PY} run.py -m redo=true", *args))


GAP_DIR = "results/solver_benchmark/h200_resnet18_gap_over_time"


def _gap_run(form: str) -> str:
    """One form's 30-minute solve of resnet18 on two devices at 50 %, its gap traced."""
    return (
        f"{PY} experiments/solver_benchmark.py --suite full --costs h200 --graphs resnet18 "
        f"--devices 2 --budgets 50% --formulations {form} --warm-start heuristic --no-lp-bound "
        f"--rel-gap 1e-3 --time-limit-s 1800 --out {GAP_DIR}/{form}"
    )


def steps(out: Path, quick: bool) -> list[Step]:
    """The steps, writing under ``out`` (``results`` or ``results/quick``)."""
    q = f"results_dir={out}" if quick else ""
    figs = f"{PY} experiments/figures.py --tracking-uri sqlite:///{out}/mlflow.db --out"
    # runs of this step only (a store keeps earlier sweeps): {since_ms} is the step's start
    since = "--filter 'tags.`xe.experiment` = \"{}\" and attributes.start_time > {{since_ms}}'"
    return [
        Step(
            "memory_fidelity",
            (f"{PY} experiments/memory_fidelity.py --time-limit-s 60",),
            (
                f"{PY} experiments/memory_fidelity.py --nets resnet18,mobilenet_v2 "
                f"--batch-size 2 --image-size 128 --time-limit-s 5 --out {out}/memory_fidelity",
            ),
            ("memory_fidelity/memory_fidelity.png",),
            full_s=1500,
            quick_s=55,
        ),
        Step(
            "time_fidelity",
            (f"{PY} experiments/time_fidelity.py --time-limit 6",),
            (
                f"{PY} experiments/time_fidelity.py --nets resnet18 --two-device-nets "
                "resnet18 --strategies checkmate chen_sqrtn --budgets 70 --rounds 1 "
                "--measure-rounds 5 --measure-s 0.5 --measure-most 10 --time-limit 3 "
                f"--out {out}/time_fidelity",
            ),
            ("time_fidelity/time_fidelity.png",),
            full_s=2400,
            quick_s=105,
        ),
        Step(
            "frontier",
            (
                _sweep("experiment=frontier net.batch_size=2 net.image_size=128", q),
                f"{figs} {out}/figures --only frontier {since.format('frontier')}",
            ),
            (
                _sweep(
                    "experiment=frontier net.batch_size=2 net.image_size=64",
                    "net=resnet18 mem.all=90%,60%",
                    "'strategy=[checkmate,chen_sqrtn,torch_checkpoint,torch_sac]'",
                    "n_steps=2 profile.context_rounds=0 solver.time_limit_s=5",
                    q,
                ),
                f"{figs} {out}/figures --only frontier {since.format('frontier')}",
            ),
            ("figures/frontier.png",),
            full_s=4300,
            quick_s=25,
        ),
        Step(
            "transformers",
            (
                _sweep("experiment=transformers", q),
                f"{figs} {out}/transformers --only overhead {since.format('transformers')}",
            ),
            (
                _sweep(
                    "experiment=transformers net=gpt2_small",
                    "mem.all=70%,50% net.batch_size=2 net.image_size=32",
                    "n_steps=2 profile.context_rounds=0 solver.time_limit_s=5",
                    q,
                ),
                f"{figs} {out}/transformers --only overhead {since.format('transformers')}",
            ),
            ("transformers/overhead_vs_budget.png",),
            full_s=660,
            quick_s=25,
        ),
        Step(
            "resnet18_figures",
            (
                _sweep(
                    "experiment=budget_sweep net=resnet18 solver.time_limit_s=30",
                    "'strategy=[checkmate,checkpoint_all,chen_sqrtn,chen_greedy]'",
                    q,
                ),
                _sweep("experiment=predicted_vs_measured net=resnet18 devices=cpu", q),
                _sweep("experiment=main_table net=resnet18 net.batch_size=4 mode=train", q),
                f"{figs} {out}/figures --only runtime_bars overhead predicted_vs_measured",
            ),
            (
                _sweep(
                    "experiment=budget_sweep net=tiny solver.time_limit_s=5",
                    "'strategy=[checkmate,checkpoint_all,chen_sqrtn,chen_greedy]'",
                    "n_steps=2 profile.context_rounds=0",
                    q,
                ),
                _sweep(
                    "experiment=main_table net=tiny solver.time_limit_s=5",
                    "n_steps=2 profile.context_rounds=0",
                    q,
                ),
                f"{figs} {out}/figures --only runtime_bars overhead predicted_vs_measured",
            ),
            (
                "figures/runtime_bars.png",
                "figures/overhead_vs_budget.png",
                "figures/predicted_vs_measured.png",
            ),
            full_s=1800,
            quick_s=30,
        ),
        Step(
            "max_batch",
            (
                _sweep("experiment=max_batch", q),
                f"{figs} {out}/figures --only max_batch {since.format('max_batch')}",
            ),
            (
                _sweep(
                    "experiment=max_batch net=tiny mem=4MB",
                    "'strategy=[checkmate,chen_sqrtn]' solver.time_limit_s=5",
                    q,
                ),
                f"{figs} {out}/figures --only max_batch {since.format('max_batch')}",
            ),
            ("figures/max_batch.png",),
            full_s=1800,
            quick_s=15,
        ),
        Step(
            "heuristics_nets",
            (f"{PY} experiments/heuristics_nets.py",),
            (f"{PY} experiments/heuristics_nets.py --nets resnet18 --out {out}/heuristics_nets",),
            ("heuristics_nets/heuristics_nets_b.png",),
            full_s=90,
            quick_s=15,
        ),
        Step(
            "solver_scaling",
            (f"{PY} experiments/solver_scaling.py",),
            (f"{PY} experiments/solver_scaling.py --quick --out {out}/solver_scaling",),
            ("solver_scaling/solver_scaling.png",),
            full_s=3000,
            quick_s=155,
        ),
        Step(
            "checkmate_bounds",
            (
                f"{PY} experiments/checkmate_frontier.py --nets resnet18,mobilenet_v2,gpt2_small "
                "--budgets 0.5,0.7 --time-limit-s 30 --out results/checkmate_frontier/stage_cut",
            ),
            (
                f"{PY} experiments/checkmate_frontier.py --nets resnet18 --batch-size 2 "
                f"--budgets 0.7 --time-limit-s 30 --out {out}/checkmate_frontier/stage_cut",
            ),
            ("checkmate_frontier/stage_cut/checkmate_frontier_30s.png",),
            full_s=470,
            quick_s=70,
        ),
        Step(
            "heuristic_speed",
            (f"{PY} experiments/heuristic_speed.py --layers 12,24 --repeats 2",),
            (
                f"{PY} experiments/heuristic_speed.py --layers 6 --repeats 1 "
                f"--out {out}/heuristic_speed",
            ),
            ("heuristic_speed/heuristic_speed.png",),
            full_s=240,
            quick_s=60,
        ),
        Step(
            "second_device",
            (f"{PY} experiments/second_device.py",),
            (
                f"{PY} experiments/second_device.py --nets gpt2_small --rounds 3 "
                f"--out {out}/second_device",
            ),
            ("second_device/second_device.png",),
            full_s=480,
            quick_s=40,
        ),
        Step(
            "coarsening_h200",
            (
                f"{PY} experiments/solver_benchmark.py --suite full --costs h200 --graphs "
                "vgg16,resnet18 --devices 1,2 --budgets 90%,70%,50% --formulations "
                "default,coarse2,coarse3 --warm-start spread --time-limit-s 60 --no-lp-bound "
                "--out results/solver_benchmark/coarse_h200",
            ),
            None,
            ("solver_benchmark/coarse_h200/coarsening.png",),
            full_s=1080,
        ),
        Step(
            "gap_over_time_h200",
            (
                # the two forms side by side, one core each, as measured (30 min); either failing
                # fails the step
                f"taskset -c 0 {_gap_run('default')} & a=$!; "
                f"taskset -c 1 {_gap_run('reference')} & b=$!; wait $a && wait $b",
                f"{PY} experiments/solver_benchmark.py --merge {GAP_DIR}/default "
                f"{GAP_DIR}/reference --rel-gap 1e-3 --out {GAP_DIR}",
            ),
            None,
            ("solver_benchmark/h200_resnet18_gap_over_time/gap_over_time.png",),
            full_s=1830,
        ),
        Step(
            "profiles_h200",
            (
                f"{PY} experiments/device_profiles.py --devices cpu cuda --nets resnet18:4 "
                "resnet18:8 vgg16:8 mobilenet_v2:8 resnet50:8",
            ),
            None,
            ("profiles/profiles.png",),
            full_s=50,
            needs_gpu=True,
        ),
    ]


def with_interpreter(command: str) -> str:
    """``command`` with each ``python`` that starts a program replaced by this interpreter
    (the commands name ``python``, as a reader types them)."""
    exe = shlex.quote(sys.executable)
    return re.sub(rf"(^|[;&|]\s*|taskset -c \d+ ){PY} ", lambda m: f"{m.group(1)}{exe} ", command)


# ------------------------------------------------------------------------------ stamping
def stamp(png: Path, command: str, sha: str) -> None:
    """A strip under the picture naming ``command`` and ``sha``, and both as PNG text."""
    from PIL import Image, ImageDraw
    from PIL.PngImagePlugin import PngInfo

    img = Image.open(png).convert("RGB")
    text = f"{command}   (commit {sha})"
    width = img.width
    chars = max(40, width // 7)  # the default bitmap font is about 6 pixels a character
    lines = [text[k : k + chars] for k in range(0, len(text), chars)]
    strip = 14 * len(lines) + 6
    out = Image.new("RGB", (width, img.height + strip), "white")
    out.paste(img, (0, 0))
    draw = ImageDraw.Draw(out)
    for k, line in enumerate(lines):
        draw.text((4, img.height + 3 + 14 * k), line, fill=(90, 90, 90))
    info = PngInfo()
    info.add_text("xengine.command", command)
    info.add_text("xengine.commit", sha)
    out.save(png, pnginfo=info)


# ------------------------------------------------------------------------------ running
def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


MANIFEST_HEADER = ("figure", "command", "commit", "finished_utc", "step_s")


class Manifest:
    """``reproduce_manifest.csv``: one row per figure, the latest run of it (a rerun of some
    steps with ``--only`` replaces their rows and keeps the others), written whole after each
    figure so that a stopped run leaves a valid file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, list[str]] = {}
        if path.exists():
            with path.open(newline="") as fh:
                for row in csv.DictReader(fh):
                    self.rows[row["figure"]] = [row.get(k, "") for k in MANIFEST_HEADER]

    def add(self, figure: str, command: str, sha: str, took_s: float) -> None:
        stamped = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
        self.rows[figure] = [figure, command, sha, stamped, str(round(took_s))]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(MANIFEST_HEADER)
            writer.writerows(self.rows.values())
        tmp.replace(self.path)


def run(todo: list[Step], out: Path, quick: bool) -> int:
    """Run ``todo`` in order; progress and the estimate on stderr, the manifest in ``out``."""
    sha = commit()
    total = sum(s.quick_s if quick else s.full_s for s in todo)
    done_est, t_start, failed = 0.0, time.perf_counter(), []
    manifest = Manifest(ROOT / out / "reproduce_manifest.csv")
    for k, step in enumerate(todo, 1):
        commands = step.quick if quick else step.full
        elapsed = time.perf_counter() - t_start
        # the estimate: what is left, at the pace measured so far against the plan
        pace = elapsed / done_est if done_est > 0 else 1.0
        left_s = (total - done_est) * pace
        log.warning(
            "[%d/%d] %s: started at %.0f min; about %.0f min left", k, len(todo),
            step.name, elapsed / 60, left_s / 60,
        )  # fmt: skip
        done_est += step.quick_s if quick else step.full_s
        if step.needs_gpu and not _has_gpu():
            log.warning("[%d/%d] %s: skipped: needs a GPU", k, len(todo), step.name)
            continue
        t0 = time.perf_counter()
        ok = True
        since_ms = int(time.time() * 1000)
        commands = tuple(c.replace("{since_ms}", str(since_ms)) for c in commands or ())
        for command in commands:
            log.info("$ %s", command)
            proc = subprocess.run(with_interpreter(command), shell=True, cwd=ROOT)
            if proc.returncode != 0:
                log.error("%s: exit %d: %s", step.name, proc.returncode, command)
                ok = False
                break
        took = time.perf_counter() - t0
        if not ok:
            failed.append(step.name)
            continue
        for fig in step.figures:
            png = ROOT / out / fig
            if not png.exists():
                log.error("%s: %s was not made", step.name, png)
                failed.append(step.name)
                continue
            stamp(png, " && ".join(commands), sha)
            manifest.add(str(png.relative_to(ROOT)), " && ".join(commands), sha, took)
        log.warning("[%d/%d] %s: done in %.1f min", k, len(todo), step.name, took / 60)
    log.warning(
        "all %d steps in %.1f min; %s", len(todo), (time.perf_counter() - t_start) / 60,
        f"failed: {', '.join(failed)}" if failed else "none failed",
    )  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small nets, short limits, results/quick")
    ap.add_argument("--only", nargs="+", help="steps to run (see --list)")
    ap.add_argument("--list", action="store_true", help="the steps and their commands")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="reproduce: %(message)s")
    out = Path("results/quick") if args.quick else Path("results")  # from the checkout
    todo = [s for s in steps(out, args.quick) if not args.quick or s.quick is not None]
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in todo})
        if unknown:
            ap.error(f"unknown step {unknown[0]!r}: choose from {', '.join(s.name for s in todo)}")
        todo = [s for s in todo if s.name in args.only]
    if args.list:
        for s in todo:
            cmds = s.quick if args.quick else s.full
            print(f"{s.name}: " + " && ".join(cmds or ()))
        return 0
    return run(todo, out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
