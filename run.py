#!/usr/bin/env python
"""Entry point: ``python run.py [net=resnet50] [mem=2GB] [solver=gurobi] ...``.

Composes the Hydra config (``conf/``), turns it into a plain :class:`RunConfig`, runs
:func:`xengine.pipeline.run_pipeline` inside one MLflow run and prints the comparison table on
stdout. Logs go to stderr and to the run's folder under ``results/runs/``.

Bad input (unknown net or solver, an unreadable memory size, a budget below the smallest
feasible one, a malformed graph file) ends with one line on stderr and exit code 2. In a sweep
(``-m``) such a point is recorded as skipped and the sweep goes on.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from xengine.graph.types import GraphError
from xengine.pipeline import (
    ConfigError,
    NullTracker,
    Prepared,
    RunConfig,
    Tracker,
    prepare,
    run_pipeline,
    run_status,
)
from xengine.solvers import SolverOptions, SolverUnavailable
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


def _check_group_choices(argv: list[str]) -> None:
    """``net=foo`` / ``solver=foo`` with no ``conf/<group>/foo.yaml``: one line, exit 2
    (Hydra itself would print a multi-line listing and exit 1)."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in ("net", "solver") or "(" in value:
            continue
        options = sorted(p.stem for p in (CONF / key).glob("*.yaml"))
        for choice in value.split(","):
            if choice not in options:
                hint = (
                    "; for another torchvision model keep a listed net and set net.name=<model>"
                    if key == "net"
                    else ""
                )
                _fail(f"unknown {key} {choice!r}: choose one of {', '.join(options)}{hint}")


def _as_tuple(value: Any) -> tuple[str, ...]:
    """``cpu`` / ``"cpu,cuda"`` / ``[cpu, cuda]`` -> ``("cpu", "cuda")``."""
    if isinstance(value, (list, tuple, ListConfig)):
        return tuple(str(v).strip() for v in value)
    return tuple(s.strip() for s in str(value).split(","))


def run_config_from(cfg: DictConfig) -> RunConfig:
    """The plain configuration the library takes; type errors become :class:`ConfigError`."""
    try:
        s = cfg.solver
        return RunConfig(
            net=str(cfg.net.name),
            batch_size=int(cfg.net.batch_size),
            image_size=int(cfg.net.image_size),
            num_classes=int(cfg.net.get("num_classes", 1000)),
            mode=str(cfg.mode),
            graph_path=None if cfg.graph is None else str(cfg.graph),
            devices=_as_tuple(cfg.devices),
            mem=_as_tuple(cfg.mem),
            solver=str(s.name),
            solver_options=SolverOptions(
                time_limit_s=None if s.time_limit_s is None else float(s.time_limit_s),
                rel_gap=float(s.rel_gap),
                threads=None if s.threads is None else int(s.threads),
                seed=int(s.seed),
            ),
            formulation=str(cfg.formulation),
            strategies=_as_tuple(cfg.strategy),
            execute=bool(cfg.execute),
            n_steps=int(cfg.n_steps),
            warmup=int(cfg.warmup),
            profile_path=None if cfg.profile.path is None else str(cfg.profile.path),
            profile_repeats=int(cfg.profile.repeats),
            profile_warmup=int(cfg.profile.warmup),
            profile_cache_dir=str(cfg.profile.cache_dir),
            progress=bool(cfg.profile.progress),
            seed=int(cfg.seed),
            grad_rtol=float(cfg.grad_rtol),
            grad_atol=float(cfg.grad_atol),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid config value: {exc}") from None


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
    mem = "+".join(_as_tuple(cfg.mem))
    return f"{what}-{mem}-{'+'.join(_as_tuple(cfg.devices))}-{cfg.solver.name}"


def _tracker(cfg: DictConfig, console_level: int = logging.WARNING) -> Tracker:
    from xengine.tracking import MlflowTracker, resolve_tracking_uri

    if not cfg.tracking.enabled:
        return NullTracker()
    uri = resolve_tracking_uri(cfg.tracking.uri, cfg.results_dir)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    hc = HydraConfig.get()
    tags = {"xe.task": "run", "xe.output_dir": hc.runtime.output_dir}
    if hc.mode.name == "MULTIRUN":
        tags["xe.job_num"] = str(hc.job.num)
    return MlflowTracker(
        uri,
        str(cfg.tracking.experiment),
        _run_name(cfg),
        tags=tags,
        repo=REPO,
        console_level=console_level,
    )


def _start(tracker: Tracker, cfg: DictConfig) -> None:
    from xengine.tracking import config_yaml, flatten_config

    tracker.params(flatten_config(cfg))
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
    what = (
        run_cfg.graph_path
        if run_cfg.solve_only
        else f"{run_cfg.net} batch {run_cfg.batch_size} {run_cfg.image_size}px {run_cfg.mode}"
    )
    return f"{what} ({prepared.graph.size} nodes), budget {budgets}"


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from xengine.report import format_table, table_csv

    multirun = HydraConfig.get().mode.name == "MULTIRUN"
    console = logging.WARNING
    try:
        console = _level(cfg.log_level)
        _set_console_level(console)
        run_cfg = run_config_from(cfg)
        prepared = prepare(run_cfg)
    except BAD_INPUT as exc:
        if not multirun:
            _fail(str(exc))
        log.error("skipped: %s", exc)  # a sweep records the point and goes on
        with _tracker(cfg, console) as tracker:
            _start(tracker, cfg)
            tracker.tags({"xe.status": "skipped", "xe.error": str(exc)})
        return

    _highs_banner_to_stderr()
    with _tracker(cfg, console) as tracker:
        _start(tracker, cfg)
        try:
            rows = run_pipeline(run_cfg, tracker, prepared)
            tracker.tags({"xe.status": run_status(rows)})
            tracker.text_artifact(table_csv(rows), "table.csv")
        finally:
            _job_files(tracker)
    print(format_table(rows, title=_title(run_cfg, prepared)))


if __name__ == "__main__":
    _check_group_choices(sys.argv[1:])
    main()
