"""Regenerate the figures from the MLflow records (docs/design.md section 9); nothing is re-solved.

Each figure is written as ``<out>/<name>.png`` with its data beside it as ``<out>/<name>.csv``:

* ``runtime_bars``: step time per configuration of the paper's protocol: each device alone
  (Checkmate with the total memory) against XEngine over the device mix; one group of bars per
  multi-device run (solid: measured, hatched: predicted). Skipped when no run has XEngine.
* ``memory_<run>``: memory of every device at every step of a schedule, with the budgets.
  Read from the run's ``memory/<label>.csv`` artifact when it has one; else replayed by the
  simulator from the logged schedule and the graph (the run's ``graph.json`` artifact, the
  ``graph`` file it read, or the net captured again and costed with the logged
  ``profile.json``: ``--no-recapture`` turns that last fallback off).
* ``overhead_vs_budget``: Checkmate's figure: predicted time / keep-everything time against
  the activation budget (MiB), per strategy, as a prefix-minimum step curve (a larger budget
  can always reuse a smaller budget's schedule); one panel per graph and device mix.
* ``solver_scaling``: solve time against graph size (nodes), per solver and strategy.
* ``predicted_vs_measured``: predicted against measured step time and peak memory, one point
  per executed schedule (per device for several devices), with the y = x line.
* ``max_batch``: Checkmate's figure from ``task=max_batch`` runs: the largest batch per
  strategy per net and budget, with its ratio to plain PyTorch's (hatched: a solver stopped
  without an answer above it, so it is the largest *shown* to fit).
* ``frontier``: measured peak against measured step time (as a multiple of the plain step
  measured in the same run), one panel per net (one device): Checkmate's schedules at every
  budget as a line, the heuristics, PyTorch's own checkpointing and the plain step; beside it
  ``frontier_ratios.csv``: each non-Checkmate point's time over the fastest Checkmate
  schedule measured at no more memory (the ratio at equal measured memory).

Runs tagged ``xe.experiment=<name>`` by an experiment config (``conf/experiment/``) feed the
figure of that experiment when there are any; otherwise every finished run that has the
metrics does. Missing metrics or artifacts skip a run or a figure with a logged note.

Usage:
  .venv/bin/python experiments/figures.py [--tracking-uri URI] [--experiment xengine]
      [--out results/figures] [--filter "params.`net.name` = 'resnet18'"]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# artifact downloads would draw progress bars; a net captured again would let kineto talk
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from xengine.records.tracking import resolve_tracking_uri  # noqa: E402
from xengine.solvers.model import SOLUTION_STATUSES  # noqa: E402
from xengine.strategies.registry import (  # noqa: E402
    PYTORCH_POLICIES,
    SINGLE_DEVICE,
    STRATEGIES,
)

log = logging.getLogger("figures")

MIB = 2**20
SOLVER_STRATEGIES = tuple(  # their solve time is a solver's
    name for name, spec in STRATEGIES.items() if spec.uses_solver or spec.takes_options
)
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
STRATEGY_ORDER = ("xengine", *SINGLE_DEVICE, *PYTORCH_POLICIES, "pytorch")


# ------------------------------------------------------------------------------ records
@dataclass
class RunRecord:
    """What a figure needs of one MLflow run."""

    run_id: str
    name: str
    status: str
    start_time: int
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str]

    @property
    def short(self) -> str:
        return self.run_id[:8]

    @property
    def labels(self) -> list[str]:
        """Row labels with metrics (``checkmate``, ``checkmate.cpu2``, ``xengine``, ...)."""
        found = {k.split("/", 1)[0] for k in self.metrics if "/" in k}
        found -= {"graph", "protocol"}
        return sorted(found, key=_label_order)

    def metric(self, label: str, quantity: str) -> float | None:
        v = self.metrics.get(f"{label}/{quantity}")
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    def status_of(self, label: str) -> str:
        return self.tags.get(f"xe.status.{label}", "")

    def fits(self, label: str) -> bool:
        """The label's schedule is within its budget (its status, else its peak)."""
        status = self.status_of(label)
        if status:
            return status in SOLUTION_STATUSES
        peak, budget = self.metric(label, "predicted_peak_mib"), self.metric(label, "budget_mib")
        return peak is not None and budget is not None and peak <= budget

    @property
    def devices(self) -> list[str]:
        """The device mix in order: ``devices.names``, else ``devices``, else from labels."""
        for key in ("devices.names", "devices"):
            value = self.params.get(key)
            if value and value != "null":
                names = [d.strip() for d in re.split(r"[,+]", value.strip("[]")) if d.strip()]
                if names:
                    return names
        suffixed = {lab.split(".", 1)[1] for lab in self.labels if "." in lab}
        return sorted(suffixed) or ["cpu"]

    @property
    def graph_key(self) -> str:
        """What was scheduled: ``resnet18 b4 224px train`` or a graph file's stem."""
        g = self.params.get("graph", "null")
        if g not in ("null", "", "None"):
            return Path(g).stem
        net = self.params.get("net.name", "?")
        b = self.params.get("net.batch_size", "?")
        from xengine.graph.capture import TOKEN_NETS  # torch loads once, when a run is named

        size = self.params.get("net.image_size", "?")
        size = f"{size} tokens" if net in TOKEN_NETS else f"{size}px"  # a text model's length
        return f"{net} b{b} {size} {self.params.get('mode', 'train')}"

    @property
    def experiment_choice(self) -> str:
        return self.tags.get("xe.experiment", "")


def _label_order(label: str) -> tuple[int, str]:
    base = label.split(".", 1)[0]
    rank = STRATEGY_ORDER.index(base) if base in STRATEGY_ORDER else len(STRATEGY_ORDER)
    return rank, label


def load_runs(client: Any, experiment: str, filter_string: str = "") -> list[RunRecord]:
    """Finished ``run.py`` runs of ``experiment`` (sweep parents and skipped points left out).

    :raises LookupError: no experiment of that name.
    """
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no experiment {experiment!r} in {client.tracking_uri}")
    out: list[RunRecord] = []
    token = None
    n_seen = 0
    while True:
        page = client.search_runs(
            [exp.experiment_id],
            filter_string=filter_string,
            max_results=1000,
            order_by=["attributes.start_time ASC"],
            page_token=token,
        )
        for r in page:
            n_seen += 1
            tags = dict(r.data.tags)
            if r.info.status != "FINISHED" or tags.get("xe.task", "run") != "run":
                continue
            if tags.get("xe.status") == "skipped":
                continue
            out.append(
                RunRecord(
                    run_id=r.info.run_id,
                    name=r.info.run_name or r.info.run_id,
                    status=r.info.status,
                    start_time=int(r.info.start_time or 0),
                    params=dict(r.data.params),
                    metrics=dict(r.data.metrics),
                    tags=tags,
                )
            )
        token = page.token
        if not token:
            break
    log.info("%d finished runs of %d in experiment %r", len(out), n_seen, experiment)
    return out


def runs_for(runs: list[RunRecord], experiment_choice: str) -> list[RunRecord]:
    """The runs of ``conf/experiment/<experiment_choice>.yaml`` if any are tagged so, else all."""
    tagged = [r for r in runs if r.experiment_choice == experiment_choice]
    return tagged or runs


# ------------------------------------------------------------------------------ output
@dataclass
class Outcome:
    """What one figure function did: the files it wrote, or why it wrote nothing."""

    name: str
    paths: list[Path] = field(default_factory=list)
    skipped: str = ""
    notes: list[str] = field(default_factory=list)


def _save(fig: plt.Figure, data: pd.DataFrame, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    png, csv = out / f"{name}.png", out / f"{name}.csv"
    fig.savefig(png, dpi=130, bbox_inches="tight")
    plt.close(fig)
    data.to_csv(csv, index=False)
    log.info("wrote %s and %s", png, csv.name)
    return [png, csv]


def _skip(name: str, why: str) -> Outcome:
    log.warning("%s: skipped: %s", name, why)
    return Outcome(name, skipped=why)


def _note(outcome: Outcome, text: str) -> None:
    log.info("%s: %s", outcome.name, text)
    outcome.notes.append(text)


def _color(key: str, keys: Sequence[str]) -> str:
    return COLORS[list(keys).index(key) % len(COLORS)]


LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v")


def _style(label: str, devices: Sequence[str]) -> dict[str, Any]:
    """Colour by strategy (the same in every figure), line style and marker by device."""
    base, _, dev = label.partition(".")
    rank = STRATEGY_ORDER.index(base) if base in STRATEGY_ORDER else len(STRATEGY_ORDER)
    k = list(devices).index(dev) if dev in devices else 0
    return {
        "color": COLORS[rank % len(COLORS)],
        "ls": LINESTYLES[k % len(LINESTYLES)],
        "marker": MARKERS[k % len(MARKERS)],
    }


# ------------------------------------------------------------------------------ runtime bars
def _best_alone(run: RunRecord, device: str) -> str | None:
    """``checkmate.<device>`` when it fits, else the fastest fitting strategy on ``device``."""
    if run.fits(f"checkmate.{device}") and run.metric(f"checkmate.{device}", "predicted_time_ms"):
        return f"checkmate.{device}"
    cands = [
        lab
        for lab in run.labels
        if lab.endswith(f".{device}") and run.fits(lab) and run.metric(lab, "predicted_time_ms")
    ]
    return min(cands, key=lambda lab: run.metric(lab, "predicted_time_ms")) if cands else None


def runtime_bars(runs: list[RunRecord], out: Path) -> Outcome:
    """Step time of each device alone against XEngine, per multi-device configuration."""
    name = "runtime_bars"
    multi = [
        r for r in runs_for(runs, "main_table") if "xengine" in r.labels and len(r.devices) > 1
    ]
    if not multi:
        return _skip(name, "no multi-device run with XEngine (run experiment=main_table)")
    outcome = Outcome(name)
    rows = []
    for r in multi:
        config = f"{r.graph_key}\n{'+'.join(r.devices)} mem {r.params.get('mem', '?')}"
        slots: list[tuple[int, str, str | None]] = [
            (k, f"{d} alone", _best_alone(r, d)) for k, d in enumerate(r.devices)
        ]
        slots.append((len(r.devices), "XEngine", "xengine" if r.fits("xengine") else None))
        for k, what, label in slots:
            rows.append(
                {
                    "config": config.replace("\n", " | "),
                    "run_id": r.run_id,
                    "slot": k,
                    "bar": what,
                    "label": label or "",
                    "status": r.status_of(label) if label else "does not fit",
                    "predicted_time_ms": r.metric(label, "predicted_time_ms") if label else None,
                    "measured_time_ms": r.metric(label, "measured_time_ms") if label else None,
                    "_config": config,
                }
            )
    data = pd.DataFrame(rows)
    configs = list(dict.fromkeys(data["_config"]))
    n_slots = int(data["slot"].max()) + 1
    slot_names = ["first device alone", "second device alone", "third device alone"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(configs) + 2), 4.8))
    group_w = 0.8
    bar_w = group_w / n_slots
    values = []
    for _, row in data.iterrows():
        x0 = configs.index(row["_config"]) - group_w / 2 + (row["slot"] + 0.5) * bar_w
        is_x = row["bar"] == "XEngine"
        color = COLORS[3] if is_x else COLORS[row["slot"] % 3]
        pred, meas = row["predicted_time_ms"], row["measured_time_ms"]
        if pd.isna(pred) and pd.isna(meas):
            ax.text(
                x0,
                0.02,
                f"{row['bar']}: does not fit",
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
                transform=ax.get_xaxis_transform(),
            )
            continue
        if not pd.isna(pred):
            ax.bar(x0 - bar_w / 4, pred, bar_w / 2, color=color, alpha=0.45, hatch="//")
            values.append(pred)
        if not pd.isna(meas):
            ax.bar(x0 + bar_w / 4, meas, bar_w / 2, color=color)
            values.append(meas)
        ax.text(
            x0,
            max(v for v in (pred, meas) if not pd.isna(v)),
            row["bar"],
            rotation=90,
            ha="center",
            va="bottom",
            fontsize=7,
        )
    if values and max(values) / max(min(values), 1e-9) > 50:
        ax.set_yscale("log")
    ax.margins(y=0.18)
    ax.set_xticks(range(len(configs)), configs, fontsize=8)
    ax.set_ylabel("step time (ms)")
    ax.set_title("Step time: each device alone (Checkmate, total memory) vs XEngine")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLORS[k % 3], label=slot_names[k])
        for k in range(max(n_slots - 1, 1))
    ]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=COLORS[3], label="XEngine (all devices)"))
    handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", ec="0.3", hatch="//", label="predicted"))
    handles.append(plt.Rectangle((0, 0), 1, 1, fc="0.3", label="measured"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    outcome.paths = _save(fig, data.drop(columns="_config"), out, name)
    return outcome


# ------------------------------------------------------------------------------ memory
@dataclass
class MemoryTrace:
    """Memory of each device (MiB) at each step of one schedule, with the budgets (MiB)."""

    label: str
    devices: list[str]
    mem_mib: list[list[float]]  # [device][step]
    budget_mib: list[float | None]
    source: str


class ArtifactReader:
    """Lists and downloads a run's artifacts once (into a temporary folder)."""

    def __init__(self, client: Any, tmp: Path) -> None:
        self.client = client
        self.tmp = tmp

    def list(self, run_id: str, path: str = "") -> list[str]:
        try:
            return [f.path for f in self.client.list_artifacts(run_id, path or None)]
        except Exception as exc:
            log.info("run %s: cannot list artifacts %r: %s", run_id[:8], path, exc)
            return []

    def get(self, run_id: str, path: str) -> Path | None:
        try:
            dst = self.tmp / run_id
            dst.mkdir(parents=True, exist_ok=True)
            return Path(self.client.download_artifacts(run_id, path, str(dst)))
        except Exception as exc:
            log.info("run %s: cannot download %r: %s", run_id[:8], path, exc)
            return None


def _budgets(run: RunRecord, label: str, devices: list[str]) -> list[float | None]:
    if len(devices) == 1:
        return [run.metric(label, "budget_mib")]
    return [run.metric(label, f"budget_mib.{d}") for d in devices]


def read_memory_csv(path: Path) -> tuple[list[str], list[list[float]]]:
    """``memory/<label>.csv``: a ``step`` column and one ``<device>_bytes`` column per device
    (``stage`` / ``node`` columns are allowed and ignored). Returns devices and MiB per step."""
    df = pd.read_csv(path)
    cols = [c for c in df.columns if str(c).endswith("_bytes")]
    if not cols:
        raise ValueError(f"{path.name}: no <device>_bytes column")
    if "step" in df.columns:
        df = df.sort_values("step")
    return [c[: -len("_bytes")] for c in cols], [(df[c] / MIB).tolist() for c in cols]


class GraphSource:
    """The graph of a run, with costs, to replay schedules with the simulator."""

    def __init__(self, reader: ArtifactReader, recapture: bool) -> None:
        self.reader = reader
        self.recapture = recapture
        self._cache: dict[str, Any] = {}

    def graph(self, run: RunRecord) -> tuple[Any, str] | None:
        from xengine.graph.io import load_graph

        arts = self.reader.list(run.run_id)
        if "graph.json" in arts:
            path = self.reader.get(run.run_id, "graph.json")
            if path is not None:
                return load_graph(path), "graph.json artifact"
        g = run.params.get("graph", "null")
        if g not in ("null", "", "None") and Path(g).is_file():
            return load_graph(g), f"graph file {g}"
        if not self.recapture or "profile.json" not in arts:
            return None
        key = json.dumps([run.params.get(k) for k in _CAPTURE_KEYS]) + run.tags.get(
            "xe.profile_key", run.run_id
        )
        if key not in self._cache:
            self._cache[key] = self._recaptured(run)
        return self._cache[key]

    def _recaptured(self, run: RunRecord) -> tuple[Any, str] | None:
        from xengine.profile.profiler import Profile, apply_profile
        from xengine.profile.workspace import capture_net

        p = run.params
        try:
            cap = capture_net(
                p["net.name"],
                int(p["net.batch_size"]),
                mode=p.get("mode", "train"),
                image_size=int(p["net.image_size"]),
                num_classes=int(p.get("net.num_classes", 1000)),
                seed=int(p.get("seed", 0)),
            )
            prof_path = self.reader.get(run.run_id, "profile.json")
            if prof_path is None:
                return None
            graph = apply_profile(cap.graph, Profile.load(prof_path))
        except Exception as exc:
            log.info(
                "run %s: cannot capture the net again: %s: %s", run.short, type(exc).__name__, exc
            )
            return None
        return graph, "net captured again + logged profile.json"


_CAPTURE_KEYS = ("net.name", "net.batch_size", "net.image_size", "net.num_classes", "mode", "seed")


def memory_traces(
    run: RunRecord, reader: ArtifactReader, graphs: GraphSource, labels: Sequence[str]
) -> tuple[list[MemoryTrace], list[str]]:
    """A trace per label (from ``memory/<label>.csv``, else replayed); notes for the rest."""
    from xengine.problem import Instance
    from xengine.schedule import Schedule
    from xengine.simulate import simulate

    traces, notes = [], []
    mem_files = set(reader.list(run.run_id, "memory"))
    sched_files = set(reader.list(run.run_id, "schedules"))
    for label in labels:
        csv_name = f"memory/{label}.csv"
        if csv_name in mem_files:
            path = reader.get(run.run_id, csv_name)
            if path is not None:
                try:
                    devices, mem = read_memory_csv(path)
                    budgets = _budgets(run, label, devices)
                    traces.append(MemoryTrace(label, devices, mem, budgets, "memory CSV"))
                    continue
                except (ValueError, KeyError, pd.errors.ParserError) as exc:
                    notes.append(f"{run.short} {label}: unreadable {csv_name}: {exc}")
        sched_name = f"schedules/{label}.json"
        if sched_name not in sched_files:
            notes.append(f"{run.short} {label}: no memory CSV and no schedule")
            continue
        got = graphs.graph(run)
        if got is None:
            notes.append(
                f"{run.short} {label}: no memory/{label}.csv, no graph.json, no graph file "
                "and the net could not be captured again"
            )
            continue
        graph, how = got
        path = reader.get(run.run_id, sched_name)
        try:
            sched = Schedule.from_json(json.loads(path.read_text()), source=sched_name)
            budgets = _budgets(run, label, list(sched.devices))
            inst = Instance(
                graph,
                tuple(sched.devices),
                tuple(int((b or 0) * MIB) or 2**60 for b in budgets),
            )
            sim = simulate(inst, sched, check_budget=False)
        except Exception as exc:
            notes.append(f"{run.short} {label}: cannot replay the schedule: {exc}")
            continue
        mem = [(sim.mem_bytes[d] / MIB).tolist() for d in range(len(sched.devices))]
        logged = run.metric(label, "predicted_peak_mib")
        replayed = max(max(m) for m in mem)
        if logged is not None and abs(replayed - logged) > 0.005 * max(logged, 1e-9):
            notes.append(
                f"{run.short} {label}: replayed peak {replayed:.3f} MiB is not the logged "
                f"{logged:.3f} MiB (the graph is not the run's: {how}); left out"
            )
            continue
        traces.append(MemoryTrace(label, list(sched.devices), mem, budgets, f"replayed ({how})"))
    return traces, notes


def _memory_labels(run: RunRecord, most: int = 4) -> list[str]:
    """XEngine and Checkmate (the teaser's comparison), else the schedules that fit."""
    labels = [lab for lab in run.labels if lab.split(".", 1)[0] != "pytorch"]
    fitting = [lab for lab in labels if run.fits(lab)] or labels
    first = [lab for lab in fitting if lab.split(".", 1)[0] in ("xengine", "checkmate")]
    return (first or fitting)[:most]


def _memory_candidates(runs: list[RunRecord]) -> list[RunRecord]:
    """Runs of ``experiment=memory_teaser`` if any are tagged so; else multi-device XEngine
    runs first, then the others; newest first."""
    newest = list(reversed(runs))
    tagged = [r for r in newest if r.experiment_choice == "memory_teaser"]
    if tagged:
        return tagged
    multi = [r for r in newest if "xengine" in r.labels and len(r.devices) > 1]
    return multi + [r for r in newest if r not in multi]


def memory_figures(
    runs: list[RunRecord],
    out: Path,
    client: Any,
    max_runs: int = 4,
    recapture: bool = True,
) -> Outcome:
    """One figure per run (at most ``max_runs``): memory per device over the steps, a panel
    per schedule."""
    name = "memory_per_device"
    candidates = _memory_candidates(runs)
    if not candidates:
        return _skip(name, "no finished runs")
    outcome = Outcome(name)
    made = 0
    with tempfile.TemporaryDirectory() as tmp:
        reader = ArtifactReader(client, Path(tmp))
        graphs = GraphSource(reader, recapture)
        for run in candidates:
            if made >= max_runs:
                break
            labels = _memory_labels(run)
            traces, notes = memory_traces(run, reader, graphs, labels)
            for n in notes:
                _note(outcome, n)
            if not traces:
                _note(outcome, f"{run.short}: no memory trace for any schedule")
                continue
            outcome.paths += _memory_figure(run, traces, out)
            made += 1
    if not outcome.paths:
        outcome.skipped = "no run had a memory CSV, a graph or a net to replay its schedules"
        log.warning("%s: skipped: %s", name, outcome.skipped)
    return outcome


def _memory_figure(run: RunRecord, traces: list[MemoryTrace], out: Path) -> list[Path]:
    all_devices = list(dict.fromkeys(d for t in traces for d in t.devices))
    fig, axes = plt.subplots(
        len(traces), 1, figsize=(9, 2.6 * len(traces) + 0.6), sharex=True, squeeze=False
    )
    rows = []
    for ax, tr in zip(axes[:, 0], traces, strict=True):
        for d, dev in enumerate(tr.devices):
            c = _color(dev, all_devices)
            ax.plot(tr.mem_mib[d], color=c, lw=1.4, label=dev)
            b = tr.budget_mib[d] if d < len(tr.budget_mib) else None
            if b is not None:
                ax.axhline(b, color=c, ls="--", lw=1, label=f"{dev} budget")
            rows += [
                {
                    "run_id": run.run_id,
                    "label": tr.label,
                    "device": dev,
                    "step": s,
                    "mem_mib": v,
                    "budget_mib": b,
                    "source": tr.source,
                }
                for s, v in enumerate(tr.mem_mib[d])
            ]
        ax.set_ylim(bottom=0)
        ax.set_title(f"{tr.label} ({tr.source})", fontsize=9)
        ax.set_ylabel("memory (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("schedule step (one computed node per step)")
    fig.suptitle(
        f"Activation memory per device: {run.graph_key}, {'+'.join(run.devices)}, "
        f"mem {run.params.get('mem', '?')} (run {run.short})",
        fontsize=10,
    )
    fig.tight_layout()
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"memory_{run.graph_key}_{run.short}")
    return _save(fig, pd.DataFrame(rows), out, stem)


# ------------------------------------------------------------------------------ overhead
def _keep_all_ms(run: RunRecord, label: str) -> float | None:
    """The keep-everything step time on the label's device(s) (the overhead's denominator)."""
    devices = run.devices
    if "." in label:
        devs = [label.split(".", 1)[1]]
    elif len(devices) > 1:
        devs = devices
    else:
        devs = [None]
    vals = []
    for d in devs:
        suffix = "" if d is None else f".{d}"
        v = run.metrics.get(f"graph/keep_all_time_ms{suffix}")
        if v is None:
            v = run.metric(f"checkpoint_all{suffix}", "predicted_time_ms")
        if v is not None:
            vals.append(float(v))
    return min(vals) if vals else None


def _budget_x(run: RunRecord, label: str) -> float | None:
    """The label's budget in MiB: the total over devices for a multi-device schedule."""
    per_dev = [run.metric(label, f"budget_mib.{d}") for d in run.devices]
    if len(run.devices) > 1 and all(v is not None for v in per_dev):
        return float(sum(per_dev))
    return run.metric(label, "budget_mib")


def overhead_vs_budget(runs: list[RunRecord], out: Path) -> Outcome:
    """Checkmate's figure: overhead against budget per strategy, prefix-minimum steps."""
    name = "overhead_vs_budget"
    outcome = Outcome(name)
    rows = []
    for r in runs_for(runs, "budget_sweep"):
        for label in r.labels:
            if label.split(".", 1)[0] == "pytorch":
                continue
            t = r.metric(label, "predicted_time_ms")
            x = _budget_x(r, label)
            base = _keep_all_ms(r, label)
            if t is None or x is None:
                continue
            if base is None or base <= 0:
                _note(outcome, f"{r.short} {label}: no keep-everything time, left out")
                continue
            rows.append(
                {
                    "graph": r.graph_key,
                    "devices": "+".join(r.devices),
                    "strategy": label,
                    "budget_mib": x,
                    "predicted_time_ms": t,
                    "keep_all_time_ms": base,
                    "overhead": t / base,
                    "fits": r.fits(label),
                    "run_id": r.run_id,
                }
            )
    if not rows:
        return _skip(name, "no run has predicted times with budgets")
    data = pd.DataFrame(rows)
    if not any(r.experiment_choice == "budget_sweep" for r in runs):
        # untagged records: a panel is a sweep only where it has several budgets
        n_budgets = data.groupby(["graph", "devices"])["budget_mib"].transform("nunique")
        for g, d in sorted(
            set(
                zip(
                    data.loc[n_budgets < 2, "graph"],
                    data.loc[n_budgets < 2, "devices"],
                    strict=True,
                )
            )
        ):
            _note(outcome, f"{g} on {d}: one budget only, no panel")
        data = data[n_budgets >= 2]
        if data.empty:
            return _skip(name, "no graph was run at two budgets or more")
    # the keep-everything time of a graph does not depend on the budget: one per graph+device
    data = data.sort_values(["graph", "devices", "strategy", "budget_mib"]).reset_index(drop=True)
    data["overhead_prefix_min"] = float("nan")
    fit = data["fits"]
    data.loc[fit, "overhead_prefix_min"] = (
        data[fit].groupby(["graph", "devices", "strategy"])["overhead"].cummin()
    )
    panels = list(dict.fromkeys(zip(data["graph"], data["devices"], strict=True)))
    strategies = sorted(data["strategy"].unique(), key=_label_order)
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 3.8 * nrow), squeeze=False)
    for ax, (g, devs) in zip(axes.flat, panels, strict=False):
        sub = data[(data["graph"] == g) & (data["devices"] == devs) & data["fits"]]
        devices = devs.split("+")
        xmax = float(sub["budget_mib"].max()) if not sub.empty else 0.0
        for s in strategies:
            pts = sub[sub["strategy"] == s]
            if pts.empty:
                continue
            st = _style(s, devices)
            xs = list(pts["budget_mib"])
            ys = list(pts["overhead_prefix_min"])
            # extend the last step to the panel's largest budget: more memory cannot hurt
            ax.step(
                xs + [xmax],
                ys + [ys[-1]],
                where="post",
                color=st["color"],
                ls=st["ls"],
                lw=1.6,
                label=s,
            )
            ax.plot(xs, pts["overhead"], st["marker"], color=st["color"], ms=4, alpha=0.7)
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        ax.set_title(f"{g} on {devs}", fontsize=9)
        ax.set_xlabel("activation budget (MiB)")
        ax.set_ylabel("overhead (× keep-everything time)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    n_out = int((~data["fits"]).sum())
    if n_out:
        _note(outcome, f"{n_out} points over budget left out of the curves (kept in the CSV)")
    fig.suptitle("Time overhead against memory budget (predicted; steps: best so far)")
    fig.tight_layout()
    outcome.paths = _save(fig, data, out, name)
    return outcome


# ------------------------------------------------------------------------------ solver scaling
def solver_scaling(runs: list[RunRecord], out: Path) -> Outcome:
    """Solve time against graph size (nodes), per solver and strategy."""
    name = "solver_scaling"
    outcome = Outcome(name)
    rows = []
    for r in runs_for(runs, "solver_scaling"):
        n = r.metrics.get("graph/num_nodes")
        if n is None:
            _note(outcome, f"{r.short}: no graph/num_nodes, left out")
            continue
        for label in r.labels:
            base = label.split(".", 1)[0]
            t = r.metric(label, "solve_time_s")
            if base not in SOLVER_STRATEGIES or t is None:
                continue
            rows.append(
                {
                    "graph": r.graph_key,
                    "devices": "+".join(r.devices),
                    "num_nodes": int(n),
                    "solver": r.params.get("solver.name", "?"),
                    "strategy": base,
                    "label": label,
                    "solve_time_s": t,
                    "status": r.status_of(label),
                    "gap": r.metric(label, "gap"),
                    "time_limit_s": r.params.get("solver.time_limit_s"),
                    "run_id": r.run_id,
                }
            )
    if not rows:
        return _skip(name, "no run has solve times")
    data = pd.DataFrame(rows).sort_values(["solver", "strategy", "num_nodes"])
    series = list(dict.fromkeys(zip(data["solver"], data["strategy"], strict=True)))
    keys = [f"{s} / {t}" for s, t in series]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for (solver, strat), key in zip(series, keys, strict=True):
        pts = data[(data["solver"] == solver) & (data["strategy"] == strat)]
        c = _color(key, keys)
        med = pts.groupby("num_nodes")["solve_time_s"].median()
        ax.plot(med.index, med.values, "-", color=c, lw=1.2, label=key)
        opt = pts["status"] == "optimal"
        ax.plot(pts.loc[opt, "num_nodes"], pts.loc[opt, "solve_time_s"], "o", color=c, ms=4)
        ax.plot(
            pts.loc[~opt, "num_nodes"],
            pts.loc[~opt, "solve_time_s"],
            "o",
            mfc="none",
            color=c,
            ms=5,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("graph size (nodes)")
    ax.set_ylabel("solve time (s)")
    ax.set_title("Solver time against graph size (filled: optimal, hollow: not proven)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, title="solver / strategy", title_fontsize=8)
    outcome.paths = _save(fig, data, out, name)
    return outcome


# ------------------------------------------------------------------------------ pred vs meas
def _pairs(r: RunRecord, label: str, pred: str, meas: str) -> Iterable[tuple[str, float, float]]:
    """(device, predicted, measured): per device when the run logged per-device values."""
    per = [(d, r.metric(label, f"{pred}.{d}"), r.metric(label, f"{meas}.{d}")) for d in r.devices]
    per = [(d, p, m) for d, p, m in per if p is not None and m is not None]
    if per:
        yield from per
        return
    p, m = r.metric(label, pred), r.metric(label, meas)
    if p is not None and m is not None:
        yield ("+".join(r.devices) if "." not in label else label.split(".", 1)[1], p, m)


def predicted_vs_measured(runs: list[RunRecord], out: Path) -> Outcome:
    """Predicted against measured step time and peak memory, y = x line."""
    name = "predicted_vs_measured"
    outcome = Outcome(name)
    rows = []
    for r in runs_for(runs, "predicted_vs_measured"):
        for label in r.labels:
            if label.split(".", 1)[0] == "pytorch":
                continue
            base = label.split(".", 1)[0]
            t_pred, t_meas = (
                r.metric(label, "predicted_time_ms"),
                r.metric(label, "measured_time_ms"),
            )
            pairs = [("time_ms", label, t_pred, t_meas)] if None not in (t_pred, t_meas) else []
            pairs += [
                ("peak_mib", dev, p, m)
                for dev, p, m in _pairs(r, label, "predicted_peak_mib", "measured_peak_mib")
            ]
            for qty, dev, p, m in pairs:
                rows.append(
                    {
                        "quantity": qty,
                        "graph": r.graph_key,
                        "strategy": base,
                        "label": label,
                        "device": dev,
                        "predicted": p,
                        "measured": m,
                        "rel_error": (m - p) / p if p else float("nan"),
                        "run_id": r.run_id,
                    }
                )
    if not rows:
        return _skip(name, "no executed schedule (measured metrics) in the records")
    data = pd.DataFrame(rows)
    strategies = sorted(data["strategy"].unique(), key=_label_order)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, (qty, unit, title) in zip(
        axes,
        (("time_ms", "ms", "step time"), ("peak_mib", "MiB", "peak activation memory")),
        strict=True,
    ):
        sub = data[data["quantity"] == qty]
        if sub.empty:
            ax.text(0.5, 0.5, f"no {title} pairs", ha="center", transform=ax.transAxes)
            _note(outcome, f"no {title} pairs")
            continue
        for s in strategies:
            pts = sub[sub["strategy"] == s]
            if not pts.empty:
                st = _style(s, ())
                ax.plot(
                    pts["predicted"],
                    pts["measured"],
                    "o",
                    color=st["color"],
                    ms=5,
                    alpha=0.8,
                    label=s,
                )
        lo = float(min(sub["predicted"].min(), sub["measured"].min()))
        hi = float(max(sub["predicted"].max(), sub["measured"].max()))
        pad = (hi - lo) * 0.05 or max(hi, 1e-9) * 0.05
        if lo > 0 and hi / lo > 30:  # values over decades: log axes
            ax.set_xscale("log")
            ax.set_yscale("log")
            lo, hi, pad = lo / 1.3, hi * 1.3, 0.0
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k--", lw=0.8, label="y = x")
        med = float(sub["rel_error"].abs().median()) * 100
        ax.set_title(f"{title}: median |error| {med:.1f} % ({len(sub)} points)", fontsize=10)
        ax.set_xlabel(f"predicted ({unit})")
        ax.set_ylabel(f"measured ({unit})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Predicted (simulator, profile) against measured (PyTorch execution)")
    fig.tight_layout()
    outcome.paths = _save(fig, data, out, name)
    return outcome


# ------------------------------------------------------------------------------ frontier
def frontier_points(runs: list[RunRecord]) -> pd.DataFrame:
    """Every executed single-device row that fits, and each run's plain step: measured peak
    (MiB) and measured time, also as a multiple of the plain step of the same run (the
    machine's speed drifts between runs; a ratio in one run does not); ``wrong``: the row's
    loss or gradients differ from the plain step's (drawn hollow, never a ratio's winner)."""
    rows = []
    for r in runs_for(runs, "frontier"):
        plain_ms = r.metric("pytorch", "measured_time_ms")
        if len(r.devices) != 1 or not plain_ms:
            continue
        for label in r.labels:
            fits = label == "pytorch" or r.fits(label)
            t, peak = r.metric(label, "measured_time_ms"), r.metric(label, "measured_peak_mib")
            if "." in label or not fits or t is None or peak is None:
                continue
            rows.append(
                {
                    "graph": r.graph_key,
                    "strategy": label,
                    "budget_mib": r.metric(label, "budget_mib"),
                    "measured_peak_mib": peak,
                    "measured_time_ms": t,
                    "plain_time_ms": plain_ms,
                    "time_over_plain": t / plain_ms,
                    "wrong": bool(r.tags.get(f"xe.wrong.{label}")),
                    "run_id": r.run_id,
                }
            )
    return pd.DataFrame(rows)


def frontier_ratios(points: pd.DataFrame, tolerance_mib: float = 1.0) -> pd.DataFrame:
    """Each non-Checkmate point against the fastest Checkmate schedule whose measured peak is
    at most its own (plus ``tolerance_mib``): ``ratio`` = its time / Checkmate's, both as
    multiples of their own run's plain step; above 1, Checkmate is faster at that memory."""
    out = []
    for graph, sub in points.groupby("graph"):
        ck = sub[(sub["strategy"] == "checkmate") & ~sub["wrong"]]
        for _, p in sub[sub["strategy"] != "checkmate"].iterrows():
            at = ck[ck["measured_peak_mib"] <= p["measured_peak_mib"] + tolerance_mib]
            if at.empty:
                continue
            best = at.loc[at["time_over_plain"].idxmin()]
            out.append(
                {
                    "graph": graph,
                    "strategy": p["strategy"],
                    "measured_peak_mib": p["measured_peak_mib"],
                    "time_over_plain": p["time_over_plain"],
                    "checkmate_peak_mib": best["measured_peak_mib"],
                    "checkmate_time_over_plain": best["time_over_plain"],
                    "ratio": p["time_over_plain"] / best["time_over_plain"],
                    "wrong_gradients": p["wrong"],
                }
            )
    return pd.DataFrame(out)


def frontier(runs: list[RunRecord], out: Path) -> Outcome:
    """Measured peak against measured time per net: Checkmate's line, every other point."""
    name = "frontier"
    points = frontier_points(runs)
    if points.empty:
        return _skip(name, "no executed single-device run with a plain step in the records")
    graphs = sorted(points["graph"].unique())
    cols = min(3, len(graphs))
    rows_n = math.ceil(len(graphs) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 4.2 * rows_n), squeeze=False)
    for ax, graph in zip(axes.flat, graphs, strict=False):
        sub = points[points["graph"] == graph]
        for strategy in sorted(sub["strategy"].unique(), key=_label_order):
            pts = sub[sub["strategy"] == strategy].sort_values("measured_peak_mib")
            st = _style(strategy, ())
            if strategy == "pytorch":
                kw = {"marker": "*", "ms": 12, "color": "black", "ls": "none"}
            elif strategy == "checkmate":
                kw = {"marker": "o", "ms": 5, "color": st["color"], "ls": "-", "lw": 1.2}
            else:
                marker = "X" if strategy in PYTORCH_POLICIES else "s"
                kw = {"marker": marker, "ms": 7, "color": st["color"], "ls": "none"}
            right, wrong = pts[~pts["wrong"]], pts[pts["wrong"]]
            if not right.empty:
                ax.plot(right["measured_peak_mib"], right["time_over_plain"], label=strategy, **kw)
            if not wrong.empty:
                kw = {**kw, "mfc": "none", "ls": "none"}
                label = f"{strategy} (wrong gradients)"
                ax.plot(wrong["measured_peak_mib"], wrong["time_over_plain"], label=label, **kw)
        ax.set_title(graph, fontsize=10)
        ax.set_xlabel("measured peak (MiB)")
        ax.set_ylabel("step time / plain step (same run)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(graphs) :]:
        ax.axis("off")
    fig.suptitle(
        "Memory against time, measured: Checkmate, heuristics, PyTorch's own, torch.compile"
    )
    fig.tight_layout()
    outcome = Outcome(name, _save(fig, points, out, name))
    ratios = frontier_ratios(points)
    if not ratios.empty:
        path = out / "frontier_ratios.csv"
        ratios.to_csv(path, index=False)
        outcome.paths.append(path)
    return outcome


# ------------------------------------------------------------------------------ max batch
def max_batch_points(runs: list[RunRecord]) -> pd.DataFrame:
    """Per ``task=max_batch`` run (``<strategy>/largest_batch`` metrics) and strategy: the
    largest batch, its ratio to plain PyTorch's, whether it is proven, the peaks at it."""
    rows = []
    for r in runs:
        plain = r.metric("pytorch", "largest_batch")
        if plain is None:
            continue
        budget = r.metrics.get("graph/budget_mib")
        for label in r.labels:
            largest = r.metric(label, "largest_batch")
            if largest is None:
                continue
            net = r.params.get("net.name", "?")
            size = r.params.get("net.image_size", "?")
            rows.append(
                {
                    "net": f"{net} {size}px, {budget:.0f} MiB" if budget else net,
                    "strategy": label,
                    "largest_batch": int(largest),
                    "over_plain": largest / plain if plain else None,
                    "proven": r.tags.get(f"xe.proven.{label}", "true") == "true",
                    "measured_peak_mib": r.metric(label, "measured_peak_mib"),
                    "predicted_peak_mib": r.metric(label, "predicted_peak_mib"),
                    "budget_mib": budget,
                    "wrong": bool(r.tags.get(f"xe.wrong.{label}")),
                    "run_id": r.run_id,
                }
            )
    return pd.DataFrame(rows)


def max_batch(runs: list[RunRecord], out: Path) -> Outcome:
    """Checkmate's figure: the largest batch per strategy per net (bars), labelled with its
    ratio to plain PyTorch's; an unproven answer (a solver stopped) is hatched, a wrong one
    (gradients) outlined only. The newest run per net and budget."""
    name = "max_batch"
    points = max_batch_points(runs_for(runs, "max_batch"))
    if points.empty:
        return _skip(name, "no task=max_batch run in the records")
    points = points.groupby(["net", "strategy"], sort=False).tail(1)  # newest per net
    nets = list(dict.fromkeys(points["net"]))
    strategies = sorted(points["strategy"].unique(), key=_label_order)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(nets) * len(strategies) / 3), 4.2))
    width = 0.8 / len(strategies)
    for k, strategy in enumerate(strategies):
        for j, net in enumerate(nets):
            p = points[(points["net"] == net) & (points["strategy"] == strategy)]
            if p.empty:
                continue
            p = p.iloc[0]
            x = j + (k - (len(strategies) - 1) / 2) * width
            color = "black" if strategy == "pytorch" else _style(strategy, ())["color"]
            kw = {"color": color, "edgecolor": color}
            if not p["proven"]:
                kw.update(hatch="//", alpha=0.6)
            if p["wrong"]:
                kw.update(fill=False)
            ax.bar(x, p["largest_batch"], width, label=strategy if j == 0 else None, **kw)
            ax.annotate(
                f"{p['over_plain']:.2g}x",
                (x, p["largest_batch"]),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(nets)), nets, fontsize=8)
    ax.set_ylabel("largest batch that fits")
    ax.set_title("Largest batch within the budget, per strategy (x: over plain PyTorch's)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return Outcome(name, _save(fig, points, out, name))


# ------------------------------------------------------------------------------ main
FIGURES: dict[str, Callable[..., Outcome]] = {
    "runtime_bars": runtime_bars,
    "memory": memory_figures,
    "overhead": overhead_vs_budget,
    "solver_scaling": solver_scaling,
    "predicted_vs_measured": predicted_vs_measured,
    "frontier": frontier,
    "max_batch": max_batch,
}


def make_figures(
    uri: str,
    experiment: str = "xengine",
    out: Path = ROOT / "results" / "figures",
    only: Sequence[str] | None = None,
    filter_string: str = "",
    max_memory_runs: int = 4,
    recapture: bool = True,
) -> list[Outcome]:
    """Write every figure (or those in ``only``) of ``experiment`` in the store ``uri``."""
    from mlflow import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    client = MlflowClient(tracking_uri=uri)
    loaded = load_runs(client, experiment, filter_string)
    # task=max_batch runs answer another question: only their own figure reads them
    batch_runs = [r for r in loaded if r.tags.get("xe.kind") == "max_batch"]
    runs = [r for r in loaded if r.tags.get("xe.kind") != "max_batch"]
    outcomes = []
    for key, fn in FIGURES.items():
        if only and key not in only:
            continue
        try:
            if key == "memory":
                outcomes.append(fn(runs, out, client, max_memory_runs, recapture))
            elif key == "max_batch":
                outcomes.append(fn(batch_runs, out))
            else:
                outcomes.append(fn(runs, out))
        except Exception as exc:  # one broken figure must not cost the others
            log.exception("%s failed", key)
            outcomes.append(Outcome(key, skipped=f"failed: {type(exc).__name__}: {exc}"))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tracking-uri",
        default=None,
        help="default: $MLFLOW_TRACKING_URI, else sqlite:///<repo>/results/mlflow.db",
    )
    ap.add_argument("--experiment", default="xengine", help="MLflow experiment name")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "figures")
    ap.add_argument("--only", nargs="*", choices=list(FIGURES), help="figures to make")
    ap.add_argument("--filter", default="", help="MLflow search filter for the runs")
    ap.add_argument("--max-memory-runs", type=int, default=4)
    ap.add_argument(
        "--no-recapture",
        dest="recapture",
        action="store_false",
        help="do not capture a net again to replay schedules without a memory CSV",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="[%(name)s][%(levelname)s] %(message)s", stream=sys.stderr
    )
    uri = resolve_tracking_uri(args.tracking_uri, ROOT / "results")
    try:
        outcomes = make_figures(
            uri,
            args.experiment,
            args.out,
            args.only,
            args.filter,
            args.max_memory_runs,
            args.recapture,
        )
    except LookupError as exc:
        log.error("%s", exc)
        return 2
    for o in outcomes:
        if o.skipped:
            print(f"{o.name}: skipped: {o.skipped}")
        for p in o.paths:
            print(f"{o.name}: {p}")
        for n in o.notes:
            print(f"{o.name}: note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
