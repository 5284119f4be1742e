"""What a run records while it runs: the tracker interface, and each row, figure, profile and
graph as MLflow metrics, tags and artifacts (docs/design.md section 9).

:class:`Tracker` is all the pipeline knows of MLflow
(:class:`xengine.records.tracking.MlflowTracker`
implements it; :class:`NullTracker` records nothing). Each row is recorded as soon as it is
complete, so a crash later in a run loses nothing already measured.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from xengine.max_batch import BatchAnswer
from xengine.problem import Instance
from xengine.protocol import Summary
from xengine.result import MIB, RunRow

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """Where results go as soon as they exist (``xengine.records.tracking.MlflowTracker``)."""

    def __enter__(self) -> Tracker: ...

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool: ...

    def params(self, values: Mapping[str, str]) -> None: ...

    def metrics(self, values: Mapping[str, float]) -> None: ...

    def tags(self, values: Mapping[str, str]) -> None: ...

    def json_artifact(self, data: Any, artifact_file: str) -> None: ...

    def text_artifact(self, text: str, artifact_file: str) -> None: ...

    def file_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def dir_artifacts(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def figure(self, fig: Any, artifact_file: str) -> None: ...


class NullTracker:
    """Records nothing (``tracking.enabled=false`` and library use)."""

    def __enter__(self) -> NullTracker:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        return False

    def params(self, values: Mapping[str, str]) -> None:
        pass

    def metrics(self, values: Mapping[str, float]) -> None:
        pass

    def tags(self, values: Mapping[str, str]) -> None:
        pass

    def json_artifact(self, data: Any, artifact_file: str) -> None:
        pass

    def text_artifact(self, text: str, artifact_file: str) -> None:
        pass

    def file_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def dir_artifacts(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def figure(self, fig: Any, artifact_file: str) -> None:
        pass


def record_row(tracker: Tracker, row: RunRow) -> None:
    tracker.metrics(row.metrics())
    tags = {f"xe.status.{row.label}": row.status}
    if row.note:
        tags[f"xe.note.{row.label}"] = row.note[:4000]
    if row.wrong:
        tags[f"xe.wrong.{row.label}"] = row.wrong[:4000]
    tracker.tags(tags)
    if row.result is not None and row.result.schedule is not None:
        tracker.json_artifact(row.result.schedule.to_json(), f"schedules/{row.label}.json")
    if row.result is not None and row.result.sim is not None:
        tracker.text_artifact(memory_csv(row.result.sim, row.devices), f"memory/{row.label}.csv")
    if row.context_cost_s:  # what the row's prediction used: graph.json's costs, re-measured
        tracker.json_artifact(row.context_cost_s, f"costs/{row.label}.json")
    run = row.result.pytorch if row.result is not None else None
    if run is not None:  # PyTorch's own policy: the level chosen and every level's peak
        tracker.json_artifact(
            {
                "policy": run.policy,
                "level": run.level,
                "tried": [{"level": what, "peak_bytes": peak} for what, peak in run.tried],
            },
            f"policies/{row.label}.json",
        )


def memory_csv(sim: Any, devices: tuple[str, ...]) -> str:
    """The simulator's memory of every device at every step (``memory/<label>.csv``):
    ``step,stage,node,<device>_bytes,...``; what ``experiments/figures.py`` plots."""
    lines = ["step,stage,node," + ",".join(f"{d}_bytes" for d in devices)]
    for k, (t, i) in enumerate(sim.steps):
        mem = ",".join(str(int(sim.mem_bytes[d, k])) for d in range(len(devices)))
        lines.append(f"{k},{t},{i},{mem}")
    return "\n".join(lines) + "\n"


def record_graph(tracker: Tracker, inst: Instance) -> None:
    """The graph with its costs (``graph.json``: a figure can replay any logged schedule)
    and the keep-everything step time per device (the overhead figure's denominator):
    ``graph/keep_all_time_ms``, with several devices ``graph/keep_all_time_ms.<device>``."""
    from xengine.graph.io import graph_to_dict

    tracker.json_artifact(graph_to_dict(inst.graph), "graph.json")
    times = inst.compute_s.sum(axis=1)  # keep everything: each node once, no copies
    if inst.n_devices == 1:
        tracker.metrics({"graph/keep_all_time_ms": float(times[0]) * 1e3})
    else:
        tracker.metrics(
            {
                f"graph/keep_all_time_ms.{d}": float(t) * 1e3
                for d, t in zip(inst.devices, times, strict=True)
            }
        )


def record_figures(tracker: Tracker, row: RunRow, inst: Instance) -> None:
    """``figures/<label>_memory.png`` (memory per device over the steps) and
    ``figures/<label>_R.png`` (R coloured by device) for a row with a schedule."""
    log_figure = getattr(tracker, "figure", None)
    res = row.result
    if isinstance(tracker, NullTracker) or log_figure is None or res is None:
        return
    if not res.has_schedule:
        return
    try:
        import matplotlib.pyplot as plt

        from xengine.records.plots import memory_over_steps, r_matrix

        title = f"{inst.graph.name}: {row.label} ({row.status})"
        for suffix, make in (
            ("memory", lambda: memory_over_steps(inst, res.sim, title=f"{title}, memory")),
            ("R", lambda: r_matrix(inst, res.schedule.R, title=f"{title}, R by device")),
        ):
            fig = make()
            try:
                log_figure(fig, f"figures/{_file_label(row.label)}_{suffix}.png")
            finally:
                plt.close(fig)
    except Exception as exc:  # a missing picture never ends the run
        log.warning("%s: figures not logged: %s: %s", row.label, type(exc).__name__, exc)


def _file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", label)


def record_profile(profile: Any, profile_file: str, tracker: Tracker) -> None:
    """Say which profile drove the run, and keep a copy of it."""
    import tempfile

    tracker.tags(
        {
            "xe.profile_source": str(profile.source),
            "xe.profile_file": profile_file,
            "xe.profile_key": str(profile.key_hash),
            "xe.profile_measured": str(profile.measured),
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        profile.save(path)
        tracker.file_artifact(path)


def record_summary(tracker: Tracker, summary: Summary) -> None:
    metrics = {}
    if summary.gain is not None:
        metrics["xengine/gain_vs_best_single"] = summary.gain
    if summary.measured_gain is not None:
        metrics["xengine/measured_gain_vs_best_single"] = summary.measured_gain
    if summary.best_single is not None:
        metrics["protocol/best_single_predicted_time_ms"] = (
            summary.best_single.predicted_time_s * 1e3
        )
    tracker.metrics(metrics)
    tracker.tags(
        {
            "xe.best_single": summary.best_single.label if summary.best_single else "none",
            "xe.infeasible_single": ",".join(summary.infeasible_single) or "none",
        }
    )
    log.info(
        "gain of xengine over the fastest single-device schedule: %s",
        "-" if summary.gain is None else f"{100 * summary.gain:+.2f} %",
    )


def record_batches(tracker: Tracker, answers: Sequence[BatchAnswer], budget_bytes: int) -> None:
    """``task=max_batch``'s answers as metrics (``<strategy>/largest_batch``, its ratio to
    plain PyTorch's, the peaks and time at that batch), the search as tags."""
    plain = answers[0]
    tracker.metrics({"graph/budget_mib": budget_bytes / MIB})
    for a in answers:
        values = {
            "largest_batch": a.largest,
            "first_unfit_batch": a.first_unfit,
            "largest_batch_over_plain": a.over(plain),
            "predicted_peak_mib": _scaled(a.predicted_peak_bytes, 1 / MIB),
            "measured_peak_mib": _scaled(a.measured_peak_bytes, 1 / MIB),
            "measured_time_ms": _scaled(a.measured_time_s, 1e3),
            "samples_per_s": a.samples_per_s,
        }
        tracker.metrics({f"{a.strategy}/{k}": float(v) for k, v in values.items() if v is not None})
        tags = {
            f"xe.batches.{a.strategy}": " ".join(f"{b}:{st}" for b, st in a.tried)[:4000],
            f"xe.proven.{a.strategy}": str(a.proven).lower(),
        }
        if a.grads_match is False:
            tags[f"xe.wrong.{a.strategy}"] = "loss or gradients differ from a plain step"
        if a.note:
            tags[f"xe.note.{a.strategy}"] = a.note[:4000]
        tracker.tags(tags)


def _scaled(x: float | None, factor: float) -> float | None:
    return None if x is None else x * factor
