"""The Hydra job behind ``run.py``: one point of the command line (or of a sweep) as one MLflow
run, from the composed config to the printed table.

With :mod:`xengine.commandline` (the argv checks and the config reading) and
:mod:`xengine.records` (tracking and sweeps) this is the only code that knows Hydra; the library
below it takes plain dataclasses. The rules it keeps (docs/design.md section 9):

* bad input (unknown net or solver, an unreadable memory size, a budget below the smallest
  feasible one, a malformed graph file, a device named twice, a CUDA device on a machine
  without one, a profile of another net) ends with one ``error:`` line on stderr and exit 2;
  in a sweep (``-m``) the point is recorded as skipped and the sweep goes on;
* a failure of ours on fine input (:class:`~xengine.graph.types.InternalError`) is one
  ``internal error`` line naming the log file with the traceback, exit 3, the run FAILED;
* a run that executed a schedule with a wrong answer is ``xe.status=wrong``, exit 4;
* a sweep resumes: a point whose config already has a finished run is not run again;
* stdout carries the result table only; logs go to stderr and the run's folder;
* an interrupt is one line, exit 128 + the signal, the MLflow run marked KILLED.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from xengine import interrupt
from xengine.commandline import (
    check_resolves,
    flag,
    mem_and_devices,
    one_device_note,
    run_config_from,
    strategies_of,
)
from xengine.config import ConfigError, RunConfig
from xengine.execute.allocator import steady_malloc
from xengine.graph.types import GraphError, InternalError
from xengine.pipeline import run_pipeline
from xengine.prepare import Prepared, prepare
from xengine.protocol import summarize
from xengine.records.record import NullTracker, Tracker
from xengine.result import run_status, wrong_lines
from xengine.solvers import SolverUnavailable
from xengine.units import MemorySpecError, format_bytes

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3  # xengine's own code failed on fine input (xengine.graph.types.InternalError)
EXIT_WRONG = 4  # a single run that executed a schedule with a wrong answer (xe.status=wrong)
BAD_INPUT = (ConfigError, GraphError, MemorySpecError, SolverUnavailable)
_REPO = Path(__file__).resolve().parents[1]  # the checkout, for the git commit tag

log = logging.getLogger("run")
T = TypeVar("T")


def run_job(cfg: DictConfig) -> None:
    """One point: read and check the config, skip a finished point, prepare, run every
    strategy inside one MLflow run, print the table.

    A point that runs as its own job (submitit: ``hydra/launcher=slurm`` or
    ``local_parallel``) and is sent SIGTERM (``scancel``, a SLURM time limit) is recorded
    KILLED and then *returns*: submitit writes its result, so the sweep's own process learns
    at once that the point ended and goes on with the others (it would otherwise wait for
    ``sacct``, which a cluster without accounting does not have), and resuming the sweep runs
    the point again."""
    # submitit calls this without run.py's __main__ and lets SIGTERM pass (it waits for the
    # SIGKILL of a preemption): our handler makes it an Interrupted the tracker records
    interrupt.install()
    try:
        _run_point(cfg)
    except interrupt.Interrupted as exc:
        if exc.signum != signal.SIGTERM or not os.environ.get("SUBMITIT_FOLDER"):
            raise
        job = os.environ.get("SLURM_JOB_ID", "(local)")
        log.error("cancelled by SIGTERM (job %s): recorded KILLED; the sweep goes on", job)


def _run_point(cfg: DictConfig) -> None:
    multirun = HydraConfig.get().mode.name == "MULTIRUN"
    fingerprint = _fingerprint_or_skip(cfg, multirun)
    if fingerprint is None:
        return
    console = logging.WARNING
    try:
        console = _level(cfg.log_level)
        _set_console_level(console)
        run_cfg = run_config_from(cfg)
        # task=max_batch captures again at every batch; it is prepared and profiled at 1
        first = replace(run_cfg, batch_size=1) if run_cfg.task == "max_batch" else run_cfg
        prepared = prepare(first)  # checks the config; captures, does not time
        if run_cfg.malloc == "steady":  # before anything is profiled or timed
            steady_malloc()
        note = one_device_note(cfg, run_cfg)
        if note and not multirun:  # after the input checks: bad input stays one line
            log.warning("%s", note)
    except BAD_INPUT as exc:
        if not multirun:
            fail(str(exc))
        log.error("skipped: %s", exc)  # a sweep records the point and goes on
        with _tracker(cfg, console, fingerprint) as tracker:
            _start(tracker, cfg)
            tracker.tags({"xe.status": "skipped", "xe.error": str(exc)})
        return
    except InternalError as exc:  # ours: recorded FAILED, the traceback in the log file
        log.info("internal error traceback", exc_info=True)  # the log file, not the console
        _record_failure(cfg, console, fingerprint, exc)
        if not multirun:
            internal_failure(exc)
        log.error("failed: internal error: %s", exc)
        return
    except Exception as exc:  # unexpected: a sweep records the point as FAILED and goes on
        if not multirun:
            raise
        log.error("failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        _record_failure(cfg, console, fingerprint, exc)
        return
    if run_cfg.task == "max_batch":
        _run_max_batch(cfg, console, fingerprint, run_cfg, prepared, multirun)
        return
    rows = _run_tracked(cfg, console, fingerprint, run_cfg, prepared, multirun)
    if rows is not None:
        _print_table(rows, run_cfg, prepared)
        if run_status(rows) == "wrong" and not multirun:
            sys.stderr.write(
                "error: a schedule was executed with a wrong answer (see WRONG under the "
                "table); the run is recorded with xe.status=wrong\n"
            )
            sys.exit(EXIT_WRONG)


def _fingerprint_or_skip(cfg: DictConfig, multirun: bool) -> str | None:
    """The point's fingerprint, or None when it is not to run: a config that cannot be read
    (one line; in a sweep, logged as skipped) or a sweep point that already finished."""
    try:  # a config that cannot be read cannot be recorded either
        check_resolves(cfg)
        for key in ("tracking.enabled", "redo"):  # strict booleans, read before use
            flag(cfg, key)
        fingerprint = _fingerprint(cfg)
        # a sweep resumes: a point that already finished is not run again
        done = _already_done(cfg, fingerprint) if multirun else None
    except ConfigError as exc:
        if not multirun:
            fail(str(exc))
        log.error("skipped: %s", exc)
        return None
    if done is not None:
        log.warning("skipped: run %s has this config and finished (redo=true runs it)", done)
        return None
    return fingerprint


def _tracked(
    cfg: DictConfig, console: int, fingerprint: str, multirun: bool, work: Callable[[Any], T]
) -> T | None:
    """``work(tracker)`` inside the point's one MLflow run, the job's files attached whatever
    happens; None when it failed in a sweep (the tracker marked the run FAILED with
    ``xe.status=error`` and ``xe.error``, and the sweep goes on)."""
    _highs_banner_to_stderr()
    try:
        with _tracker(cfg, console, fingerprint) as tracker:
            _start(tracker, cfg)
            try:
                return work(tracker)
            finally:
                _job_files(tracker)
    except Exception as exc:
        if not multirun:
            raise
        log.error("failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        return None


def _run_tracked(
    cfg: DictConfig,
    console: int,
    fingerprint: str,
    run_cfg: RunConfig,
    prepared: Prepared,
    multirun: bool,
) -> list | None:
    """The pipeline inside one MLflow run; None when it failed in a sweep (recorded FAILED)."""
    from xengine.records.report import table_csv

    def work(tracker: Any) -> list:
        rows = run_pipeline(run_cfg, tracker, prepared)
        status = run_status(rows)
        tracker.tags({"xe.status": status})
        if status == "wrong":
            tracker.tags({"xe.wrong": ",".join(r.label for r in rows if r.wrong)})
        tracker.text_artifact(table_csv(rows), "table.csv")
        return rows

    return _tracked(cfg, console, fingerprint, multirun, work)


def _run_max_batch(
    cfg: DictConfig,
    console: int,
    fingerprint: str,
    run_cfg: RunConfig,
    prepared: Prepared,
    multirun: bool,
) -> None:
    """``task=max_batch`` inside one MLflow run (:mod:`xengine.max_batch`): profiled at batch
    1, every strategy's largest batch searched and executed, the table printed."""
    from xengine.max_batch import budget_of, run_max_batch
    from xengine.prepare import measure_profile
    from xengine.records.record import record_batches, record_profile
    from xengine.records.report import batch_csv, batch_table

    budget = budget_of(run_cfg)

    def work(tracker: Any) -> list:
        tracker.tags({"xe.kind": "max_batch"})
        profile, profile_file, graph = measure_profile(replace(run_cfg, batch_size=1), prepared)
        record_profile(profile, profile_file, tracker)
        answers = run_max_batch(run_cfg, graph)
        record_batches(tracker, answers, budget)
        wrong = [a.strategy for a in answers if a.grads_match is False]
        tracker.tags({"xe.status": "wrong" if wrong else "ok"})
        tracker.text_artifact(batch_csv(answers), "largest_batch.csv")
        return answers

    answers = _tracked(cfg, console, fingerprint, multirun, work)
    if answers is None:
        return
    wrong = [a.strategy for a in answers if a.grads_match is False]
    title = (
        f"{run_cfg.net} {_input_size(run_cfg)} {run_cfg.mode}: the largest batch within "
        f"{format_bytes(budget)} on {run_cfg.devices[0]} (search up to {run_cfg.batch_limit})"
    )
    print(batch_table(answers, title=title))
    if wrong and not multirun:
        sys.stderr.write(
            f"error: {', '.join(wrong)} executed with a wrong answer at its largest batch; the "
            "run is recorded with xe.status=wrong\n"
        )
        sys.exit(EXIT_WRONG)


def _print_table(rows: list, run_cfg: RunConfig, prepared: Prepared) -> None:
    """The final table on stdout (the one ``print`` of the program), with the protocol's
    headline under it for a run over several devices."""
    from xengine.records.report import format_table, summary_lines

    footer = []
    if len(run_cfg.devices) > 1:
        footer = summary_lines(summarize(rows), run_cfg.devices)
    footer += wrong_lines(rows)
    print(format_table(rows, title=_title(run_cfg, prepared), footer=footer))


def fail(message: str) -> None:
    """Bad input: one ``error:`` line on stderr, exit 2."""
    sys.stderr.write(f"error: {message}\n")
    sys.exit(EXIT_BAD_INPUT)


def internal_failure(exc: InternalError) -> None:
    """A failure of xengine's own code on fine input: one ``internal error:`` line that says
    so and where the traceback is, exit 3 (not 2: the user's input is not at fault)."""
    logs = [
        h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
    ]
    where = f"; the traceback is in {logs[0]}" if logs else ""
    sys.stderr.write(
        f"internal error (a bug in xengine, not in your input): {exc}{where}; please report it\n"
    )
    sys.exit(EXIT_INTERNAL)


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
    from xengine.records.sweep import find_finished_run
    from xengine.records.tracking import open_client, resolve_tracking_uri

    try:
        client = open_client(resolve_tracking_uri(cfg.tracking.uri, cfg.results_dir))
        return find_finished_run(client, str(cfg.tracking.experiment), fingerprint)
    except Exception as exc:  # a store that cannot be read: run the point
        log.warning("could not look for a finished run with this config: %s", exc)
        return None


def _sweep_parent(uri: str, experiment: str) -> str | None:
    """The parent run of this multirun (made by ``xengine.records.sweep.SweepCallback``, or
    here)."""
    from xengine.records.sweep import parent_run_for_sweep, sweep_id_of, with_retries
    from xengine.records.tracking import open_client

    sweep_id = sweep_id_of(HydraConfig.get())
    try:
        client = open_client(uri)
        return with_retries(
            "finding the sweep's parent run",
            lambda: parent_run_for_sweep(client, experiment, sweep_id),
        )
    except Exception as exc:  # the point still runs; the sweep's end adopts it by its id
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
    if os.environ.get("SLURM_JOB_ID"):  # a point of hydra/launcher=slurm: its job, as
        # squeue and scancel name it (an array's task by <array>_<task>, not its own id)
        array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        tags["xe.slurm_job_id"] = (
            f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]
        )
    if fingerprint is not None:
        tags["xe.fingerprint"] = fingerprint
    if hc.runtime.choices.get("experiment"):
        tags["xe.experiment"] = str(hc.runtime.choices.experiment)
    if hc.mode.name == "MULTIRUN":
        from xengine.records.sweep import SWEEP_ID_TAG, sweep_id_of

        tags["xe.job_num"] = str(hc.job.num)
        tags[SWEEP_ID_TAG] = sweep_id_of(hc)  # the sweep's end finds a point without a parent
        parent = _sweep_parent(uri, str(cfg.tracking.experiment))
        if parent is not None:
            tags["mlflow.parentRunId"] = parent  # MLflow's own tag: the UI nests the run
    return MlflowTracker(
        uri,
        str(cfg.tracking.experiment),
        _run_name(cfg),
        tags=tags,
        repo=_REPO,
        console_level=console_level,
    )


def _start(tracker: Tracker, cfg: DictConfig) -> None:
    from xengine.records.tracking import config_yaml, flatten_config

    params = flatten_config(cfg)
    mem, devices = mem_and_devices(cfg)
    params.setdefault("mem", mem)  # one key whatever the shape of mem / devices in the config
    params.setdefault("devices", devices)
    params["strategy"] = ",".join(strategies_of(cfg))  # the group's keys: checkmate,chen_sqrtn
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
    keep_all = prepared.keep_all_by_device_bytes or (None,) * len(run_cfg.devices)
    budgets = ", ".join(
        f"{d} {m.text}"
        + (f" of {format_bytes(k)}" if m.bytes is None and k is not None else "")
        + f" = {format_bytes(b)}"
        for d, m, k, b in zip(
            run_cfg.devices, run_cfg.memory_specs(), keep_all, prepared.budget_bytes, strict=True
        )
    )
    if len(run_cfg.devices) > 1:
        budgets += f"; total {format_bytes(sum(prepared.budget_bytes))}"
    what = (
        run_cfg.graph_path
        if run_cfg.solve_only
        else f"{run_cfg.net} batch {run_cfg.batch_size} {_input_size(run_cfg)} {run_cfg.mode}"
    )
    return f"{what} ({prepared.graph.size} nodes), budget {budgets}"


def _input_size(run_cfg: RunConfig) -> str:
    """``224px`` for an image net, ``64 tokens`` for a token net (``image_size`` is its
    sequence length)."""
    from xengine.graph.capture import TOKEN_NETS

    unit = " tokens" if run_cfg.net in TOKEN_NETS else "px"
    return f"{run_cfg.image_size}{unit}"


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


def interrupted(exc: KeyboardInterrupt) -> None:
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
