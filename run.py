#!/usr/bin/env python
"""Entry point: ``python run.py [net=resnet50] [mem=2GB] [solver=gurobi] ...``.

Composes the Hydra config (``conf/``), turns it into a plain :class:`RunConfig`, runs
:func:`xengine.pipeline.run_pipeline` inside one MLflow run and prints the comparison table on
stdout. Logs go to stderr and to the run's folder under ``results/runs/``.

Before Hydra reads the command line, :mod:`xengine.commandline` checks every override (one
line for a mistake, naming the key as typed) and rewrites the spellings Hydra cannot take as
they are (``mem.cuda=1GB``, ``devices=cpu3+cpu1``) into ones it can.

Bad input (unknown net or solver, an unreadable memory size, a budget below the smallest
feasible one, a malformed graph file, a device named twice, a budget for a device not in the
mix, a CUDA device on a machine without one, a profile file of another net or batch size)
ends with one line on stderr and exit code 2. In a sweep (``-m``) such a point is recorded as
skipped and the sweep goes on.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any


def _interrupted_while_starting(signum: int, _frame) -> None:  # noqa: ANN001
    """Ctrl-C / SIGTERM while the imports below load (seconds): one line, not a traceback.
    ``__main__`` installs the run's own handlers once they are loaded."""
    name = signal.Signals(signum).name
    sys.stderr.write(f"interrupted: {name} while starting; nothing is recorded\n")
    os._exit(128 + signum)


if __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _interrupted_while_starting)

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from xengine import interrupt
from xengine.commandline import (
    check_resolves,
    flag,
    mem_and_devices,
    one_device_note,
    prepare_argv,
    run_config_from,
)
from xengine.config import ConfigError, RunConfig
from xengine.graph.types import GraphError
from xengine.pipeline import run_pipeline, run_status
from xengine.prepare import Prepared, prepare
from xengine.protocol import summarize
from xengine.records.record import NullTracker, Tracker
from xengine.solvers import SolverUnavailable
from xengine.units import MemorySpecError, format_bytes

# torch.profiler (used to capture graphs and to measure CPU memory) prints kineto's own
# status lines on stderr from C++; they would bury our messages. Set before torch loads.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

REPO = Path(__file__).resolve().parent
CONF = REPO / "conf"
EXIT_BAD_INPUT = 2
BAD_INPUT = (ConfigError, GraphError, MemorySpecError, SolverUnavailable)

log = logging.getLogger("run")

OmegaConf.register_new_resolver("xe_repo", lambda: str(REPO), replace=True)


def _fail(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(EXIT_BAD_INPUT)


def _highs_banner_to_stderr() -> None:
    """HiGHS prints a banner on stdout (from C++, once per process) when the first ``Highs``
    object is made, whatever its options. Make that first object here with stdout pointed at
    stderr, so that stdout carries only the result table."""
    try:
        import highspy
    except ImportError:
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _level(name: Any) -> int:
    lvl = logging.getLevelName(str(name).upper())
    if not isinstance(lvl, int):
        raise ConfigError(f"log_level={name!r} is not one of DEBUG, INFO, WARNING, ERROR")
    return lvl


def _set_console_level(lvl: int) -> None:
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(lvl)


def _run_name(cfg: DictConfig) -> str:
    what = Path(str(cfg.graph)).stem if cfg.graph is not None else str(cfg.net.name)
    mem, devices = mem_and_devices(cfg)
    return f"{what}-{mem}-{devices}-{cfg.solver.name}"


def _fingerprint(cfg: DictConfig) -> str:
    """What identifies this point of a sweep (tag ``xe.fingerprint``): the resolved config
    less the keys that do not change the result (``xengine.records.sweep.VOLATILE_KEYS``)."""
    from xengine.records.sweep import config_fingerprint

    return config_fingerprint(OmegaConf.to_container(cfg, resolve=True))


def _already_done(cfg: DictConfig, fingerprint: str) -> str | None:
    """The id of a finished run with the same fingerprint (None with ``redo=true``)."""
    if flag(cfg, "redo") or not flag(cfg, "tracking.enabled", True):
        return None
    from mlflow import MlflowClient

    from xengine.records.sweep import find_finished_run
    from xengine.records.tracking import resolve_tracking_uri

    try:
        client = MlflowClient(tracking_uri=resolve_tracking_uri(cfg.tracking.uri, cfg.results_dir))
        return find_finished_run(client, str(cfg.tracking.experiment), fingerprint)
    except Exception as exc:  # a store that cannot be read: run the point
        log.warning("could not look for a finished run with this config: %s", exc)
        return None


def _sweep_parent(uri: str, experiment: str) -> str | None:
    """The parent run of this multirun (made by ``xengine.records.sweep.SweepCallback``, or
    here)."""
    from mlflow import MlflowClient

    from xengine.records.sweep import parent_run_for_sweep, sweep_id_of

    try:
        return parent_run_for_sweep(
            MlflowClient(tracking_uri=uri), experiment, sweep_id_of(HydraConfig.get())
        )
    except Exception as exc:  # the point still runs, without a parent
        log.warning("could not find or make the sweep's parent run: %s", exc)
        return None


def _tracker(
    cfg: DictConfig, console_level: int = logging.WARNING, fingerprint: str | None = None
) -> Tracker:
    from xengine.records.tracking import MlflowTracker, resolve_tracking_uri

    if not flag(cfg, "tracking.enabled", True):
        return NullTracker()
    uri = resolve_tracking_uri(cfg.tracking.uri, cfg.results_dir)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    hc = HydraConfig.get()
    tags = {"xe.task": "run", "xe.output_dir": hc.runtime.output_dir}
    if fingerprint is not None:
        tags["xe.fingerprint"] = fingerprint
    if hc.runtime.choices.get("experiment"):
        tags["xe.experiment"] = str(hc.runtime.choices.experiment)
    if hc.mode.name == "MULTIRUN":
        tags["xe.job_num"] = str(hc.job.num)
        parent = _sweep_parent(uri, str(cfg.tracking.experiment))
        if parent is not None:
            tags["mlflow.parentRunId"] = parent  # MLflow's own tag: the UI nests the run
    return MlflowTracker(
        uri,
        str(cfg.tracking.experiment),
        _run_name(cfg),
        tags=tags,
        repo=REPO,
        console_level=console_level,
    )


def _start(tracker: Tracker, cfg: DictConfig) -> None:
    from xengine.records.tracking import config_yaml, flatten_config

    params = flatten_config(cfg)
    mem, devices = mem_and_devices(cfg)
    params.setdefault("mem", mem)  # one key whatever the shape of mem / devices in the config
    params.setdefault("devices", devices)
    tracker.params(params)
    tracker.text_artifact(config_yaml(cfg), "config.yaml")


def _job_files(tracker: Tracker) -> None:
    """Hydra's record of the job and the log file as written so far."""
    out = Path(HydraConfig.get().runtime.output_dir)
    if (out / ".hydra").is_dir():
        tracker.dir_artifacts(out / ".hydra", "hydra")
    for h in logging.getLogger().handlers:
        h.flush()
    for f in out.glob("*.log"):
        tracker.file_artifact(f)


def _title(run_cfg: RunConfig, prepared: Prepared) -> str:
    budgets = ", ".join(
        f"{d} {m.text} = {format_bytes(b)}"
        for d, m, b in zip(
            run_cfg.devices, run_cfg.memory_specs(), prepared.budget_bytes, strict=True
        )
    )
    if len(run_cfg.devices) > 1:
        budgets += f"; total {format_bytes(sum(prepared.budget_bytes))}"
    what = (
        run_cfg.graph_path
        if run_cfg.solve_only
        else f"{run_cfg.net} batch {run_cfg.batch_size} {run_cfg.image_size}px {run_cfg.mode}"
    )
    return f"{what} ({prepared.graph.size} nodes), budget {budgets}"


def _record_failure(cfg: DictConfig, console: int, fingerprint: str, exc: Exception) -> None:
    """A point of a sweep that failed before its run was opened: a FAILED run carrying the
    error (the tracker's exit records the status, ``xe.status=error`` and ``xe.error``)."""
    try:
        with _tracker(cfg, console, fingerprint) as tracker:
            _start(tracker, cfg)
            raise exc
    except Exception as err:
        if err is not exc:
            log.warning("could not record the failure: %s", err)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from xengine.records.report import format_table, summary_lines, table_csv

    multirun = HydraConfig.get().mode.name == "MULTIRUN"
    console = logging.WARNING
    try:  # a config that cannot be read cannot be recorded either
        check_resolves(cfg)
        for key in ("tracking.enabled", "redo"):  # strict booleans, read before use
            flag(cfg, key)
        fingerprint = _fingerprint(cfg)
        # a sweep resumes: a point that already finished is not run again
        done = _already_done(cfg, fingerprint) if multirun else None
    except ConfigError as exc:
        if not multirun:
            _fail(str(exc))
        log.error("skipped: %s", exc)
        return
    if done is not None:
        log.warning("skipped: run %s has this config and finished (redo=true runs it)", done)
        return
    try:
        console = _level(cfg.log_level)
        _set_console_level(console)
        run_cfg = run_config_from(cfg)
        prepared = prepare(run_cfg)
        note = one_device_note(cfg, run_cfg)
        if note and not multirun:  # after the input checks: bad input stays one line
            log.warning("%s", note)
    except BAD_INPUT as exc:
        if not multirun:
            _fail(str(exc))
        log.error("skipped: %s", exc)  # a sweep records the point and goes on
        with _tracker(cfg, console, fingerprint) as tracker:
            _start(tracker, cfg)
            tracker.tags({"xe.status": "skipped", "xe.error": str(exc)})
        return
    except Exception as exc:  # unexpected: a sweep records the point as FAILED and goes on
        if not multirun:
            raise
        log.error("failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        _record_failure(cfg, console, fingerprint, exc)
        return

    _highs_banner_to_stderr()
    try:
        with _tracker(cfg, console, fingerprint) as tracker:
            _start(tracker, cfg)
            try:
                rows = run_pipeline(run_cfg, tracker, prepared)
                tracker.tags({"xe.status": run_status(rows)})
                tracker.text_artifact(table_csv(rows), "table.csv")
            finally:
                _job_files(tracker)
    except Exception as exc:
        if not multirun:
            raise
        # the tracker marked the run FAILED with xe.status=error and xe.error
        log.error("failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        return
    footer = []
    if len(run_cfg.devices) > 1:
        footer = summary_lines(summarize(rows), run_cfg.devices)
    print(format_table(rows, title=_title(run_cfg, prepared), footer=footer))


def _interrupted(exc: KeyboardInterrupt) -> None:
    """One line for Ctrl-C / SIGTERM, whatever was running, and exit 128 + the signal; the
    MLflow run (and a sweep's parent) are marked KILLED, so a resumed sweep runs the point
    again."""
    from xengine import progress
    from xengine.records.sweep import kill_open_sweep

    kill_open_sweep()
    name = str(exc) if isinstance(exc, interrupt.Interrupted) else "SIGINT"
    where = f" during {progress.interrupted_during}" if progress.interrupted_during else ""
    sys.stderr.write(f"interrupted: {name}{where}; nothing is recorded as finished\n")
    # no interpreter shutdown: a solver left running in a thread (cvxpy has no cancel) would
    # be torn down under it and abort the process; the MLflow run is already closed
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(interrupt.exit_code(exc))


if __name__ == "__main__":
    interrupt.install()
    try:
        try:
            sys.argv[1:] = prepare_argv(sys.argv[1:], CONF)
        except ConfigError as exc:
            _fail(str(exc))
        main()
    except KeyboardInterrupt as exc:
        _interrupted(exc)
