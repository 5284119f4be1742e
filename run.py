#!/usr/bin/env python
"""Entry point: ``python run.py [net=resnet50] [mem=2GB] [solver=gurobi] ...``.

Composes the Hydra config (``conf/``), turns it into a plain :class:`RunConfig`, runs
:func:`xengine.pipeline.run_pipeline` inside one MLflow run and prints the comparison table on
stdout. Logs go to stderr and to the run's folder under ``results/runs/``.

Before Hydra reads the command line, :func:`rewrite_argv` turns the spellings Hydra cannot
take as they are into ones it can: ``mem.cuda=1GB`` -> ``++mem.cuda=1GB`` (a new key of the
``mem`` group of keys), ``mem=2GB`` -> ``mem.all=2GB`` when per-device budgets are also given
(or when it is a list), and a device mix that is not a file of ``conf/devices/``
(``devices=[cpu3,cpu1]``, ``devices=cpu3+cpu1``) -> ``devices.names=[cpu3,cpu1]``.

Bad input (unknown net or solver, an unreadable memory size, a budget below the smallest
feasible one, a malformed graph file, a device named twice, a budget for a device not in the
mix, a CUDA device on a machine without one, a profile file of another net or batch size)
ends with one line on stderr and exit code 2. In a sweep (``-m``) such a point is recorded as
skipped and the sweep goes on.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from xengine import interrupt
from xengine.execute.executor import available_devices
from xengine.graph.types import GraphError
from xengine.pipeline import (
    ConfigError,
    NullTracker,
    Prepared,
    RunConfig,
    Tracker,
    prepare,
    protocol_summary,
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


_HYDRA_FUNCTION = re.compile(r"^\w+\(")  # choice(...), range(...), glob(...), ...


def _split_top(value: str) -> list[str]:
    """``a,[b,c],d`` -> ``["a", "[b,c]", "d"]`` (commas outside brackets)."""
    parts, depth, cur = [], 0, ""
    for ch in value:
        depth += ch in "[({"
        depth -= ch in "])}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def _device_list(choice: str) -> str:
    """``cpu3+cpu1`` / ``[cpu3,cpu1]`` / ``cpu3`` -> ``[cpu3,cpu1]`` (Hydra list syntax)."""
    choice = choice.strip()
    names = choice[1:-1].split(",") if choice.startswith("[") else choice.split("+")
    return "[" + ",".join(n.strip() for n in names) + "]"


def rewrite_argv(argv: list[str], conf: Path = CONF) -> list[str]:
    """Command-line items as Hydra can take them (see the module docstring); others as is."""
    per_device_mem = any(
        a.lstrip("+").startswith("mem.") and not a.lstrip("+").startswith("mem.all=") for a in argv
    )
    options = {p.stem for p in (conf / "devices").glob("*.yaml")}
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+~")
        if not sep or key.startswith("~") or _HYDRA_FUNCTION.match(value):
            out.append(arg)
        elif bare == "mem" and (per_device_mem or "[" in value):
            out.append(f"mem.all={value}")
        elif bare.startswith("mem.") and bare.count(".") == 1 and bare != "mem.all":
            # a Hydra key cannot hold ':': mem.cuda:1 is kept as mem.cuda_1 (see _mem)
            out.append(f"++{bare.replace(':', '_')}={value}")
        elif bare == "devices":
            choices = _split_top(value)
            if all(c.strip() in options for c in choices):
                out.append(f"devices={value}")
            else:  # an ad-hoc mix (or a sweep with one): the list itself
                out.append("devices.names=" + ",".join(_device_list(c) for c in choices))
        else:
            out.append(arg)
    return out


def _as_tuple(value: Any) -> tuple[str, ...]:
    """``cpu`` / ``"cpu,cuda"`` / ``"cpu+cuda"`` / ``[cpu, cuda]`` -> ``("cpu", "cuda")``."""
    if isinstance(value, (list, tuple, ListConfig)):
        return tuple(str(v).strip() for v in value)
    return tuple(s.strip() for s in re.split(r"[,+]", str(value)))


def _devices(cfg: DictConfig) -> tuple[str, ...]:
    """The device mix: the ``devices`` group (``names: [cpu2, cpu1]``, or ``auto``: every
    device torch sees), or a plain list or ``+``-joined string where a config sets
    ``devices`` directly."""
    dev = cfg.devices
    if isinstance(dev, DictConfig):
        if "names" not in dev:
            raise ConfigError("devices has no 'names': choose devices=<mix> (conf/devices/)")
        dev = dev.names
    names = _as_tuple(dev)
    return available_devices() if names == ("auto",) else names


def _one_device_note(cfg: DictConfig, run_cfg: RunConfig) -> None:
    """``devices=auto`` found one device: say in one line that XEngine needs two, and how."""
    dev = cfg.devices
    auto = _as_tuple(dev.names if isinstance(dev, DictConfig) else dev) == ("auto",)
    if auto and len(run_cfg.devices) == 1:
        log.warning(
            "XEngine needs two devices and torch sees one (%s): only single-device strategies "
            "run; ask for two with devices=cpu2+cpu1, or plan for a GPU with devices=cpu+cuda "
            "profile.path=results/profiles/resnet18-b4-cpu+cuda.profile.json execute=false",
            run_cfg.devices[0],
        )


def _mem(cfg: DictConfig) -> tuple[str, ...] | dict[str, Any]:
    """``mem``: a string or list (every device / one per device) or the group of keys
    ``{all: ..., <device>: ...}``."""
    mem = cfg.mem
    if isinstance(mem, DictConfig):
        return {
            re.sub(r"^cuda_(\d+)$", r"cuda:\1", str(k)): (
                _as_list(v) if isinstance(v, ListConfig) else str(v)
            )
            for k, v in mem.items()
        }
    if isinstance(mem, ListConfig):
        return _as_list(mem)
    return (str(mem),)


def _as_list(value: ListConfig) -> tuple[str, ...]:
    return tuple(str(v).strip() for v in value)


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
            devices=_devices(cfg),
            mem=_mem(cfg),
            solver=str(s.name),
            solver_options=SolverOptions(
                time_limit_s=None if s.time_limit_s is None else float(s.time_limit_s),
                rel_gap=float(s.rel_gap),
                threads=None if s.threads is None else int(s.threads),
                seed=int(s.seed),
            ),
            formulation=str(cfg.formulation),
            max_computes=int(cfg.get("max_computes", 2)),
            lp_bound=str(cfg.get("lp_bound", "before")),
            coarsen=None if cfg.get("coarsen") is None else int(cfg.get("coarsen")),
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


def _mem_and_devices(cfg: DictConfig) -> tuple[str, str]:
    """The budgets and the device mix as short texts (``70%``, ``cpu2+cpu1``); a config that
    cannot be read (a skipped point of a sweep) gives its raw values."""
    try:
        devices = _devices(cfg)
        mem = RunConfig(devices=devices, mem=_mem(cfg)).mem_text
        return mem, "+".join(devices)
    except (ConfigError, MemorySpecError, TypeError, ValueError):
        return str(cfg.get("mem")), str(cfg.get("devices"))


def _run_name(cfg: DictConfig) -> str:
    what = Path(str(cfg.graph)).stem if cfg.graph is not None else str(cfg.net.name)
    mem, devices = _mem_and_devices(cfg)
    return f"{what}-{mem}-{devices}-{cfg.solver.name}"


def _fingerprint(cfg: DictConfig) -> str:
    """What identifies this point of a sweep (tag ``xe.fingerprint``): the resolved config
    less the keys that do not change the result (``xengine.sweep.VOLATILE_KEYS``)."""
    from xengine.sweep import config_fingerprint

    return config_fingerprint(OmegaConf.to_container(cfg, resolve=True))


def _already_done(cfg: DictConfig, fingerprint: str) -> str | None:
    """The id of a finished run with the same fingerprint (None with ``redo=true``)."""
    if cfg.get("redo", False) or not cfg.tracking.enabled:
        return None
    from mlflow import MlflowClient

    from xengine.sweep import find_finished_run
    from xengine.tracking import resolve_tracking_uri

    try:
        client = MlflowClient(tracking_uri=resolve_tracking_uri(cfg.tracking.uri, cfg.results_dir))
        return find_finished_run(client, str(cfg.tracking.experiment), fingerprint)
    except Exception as exc:  # a store that cannot be read: run the point
        log.warning("could not look for a finished run with this config: %s", exc)
        return None


def _sweep_parent(uri: str, experiment: str) -> str | None:
    """The parent run of this multirun (made by ``xengine.sweep.SweepCallback``, or here)."""
    from mlflow import MlflowClient

    from xengine.sweep import parent_run_for_sweep, sweep_id_of

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
    from xengine.tracking import MlflowTracker, resolve_tracking_uri

    if not cfg.tracking.enabled:
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
    from xengine.tracking import config_yaml, flatten_config

    params = flatten_config(cfg)
    mem, devices = _mem_and_devices(cfg)
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
    from xengine.report import format_table, summary_lines, table_csv

    multirun = HydraConfig.get().mode.name == "MULTIRUN"
    console = logging.WARNING
    fingerprint = _fingerprint(cfg)
    if multirun:  # a sweep resumes: a point that already finished is not run again
        done = _already_done(cfg, fingerprint)
        if done is not None:
            log.warning("skipped: run %s has this config and finished (redo=true runs it)", done)
            return
    try:
        console = _level(cfg.log_level)
        _set_console_level(console)
        run_cfg = run_config_from(cfg)
        prepared = prepare(run_cfg)
        if not multirun:  # after the input checks: bad input stays one line
            _one_device_note(cfg, run_cfg)
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
        footer = summary_lines(protocol_summary(rows), run_cfg.devices)
    print(format_table(rows, title=_title(run_cfg, prepared), footer=footer))


def _interrupted(exc: KeyboardInterrupt) -> None:
    """One line for Ctrl-C / SIGTERM, whatever was running, and exit 128 + the signal; the
    MLflow run (and a sweep's parent) are marked KILLED, so a resumed sweep runs the point
    again."""
    from xengine import progress
    from xengine.sweep import kill_open_sweep

    kill_open_sweep()
    name = str(exc) if isinstance(exc, interrupt.Interrupted) else "SIGINT"
    where = f" during {progress.interrupted_during}" if progress.interrupted_during else ""
    sys.stderr.write(f"interrupted: {name}{where}; nothing is recorded as finished\n")
    sys.exit(interrupt.exit_code(exc))


if __name__ == "__main__":
    interrupt.install()
    try:
        _check_group_choices(sys.argv[1:])
        sys.argv[1:] = rewrite_argv(sys.argv[1:])
        main()
    except KeyboardInterrupt as exc:
        _interrupted(exc)
