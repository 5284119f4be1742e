"""One run end to end (DESIGN.md sections 2 and 9).

graph (captured from a net, or a graph JSON file) -> cost profile (cached) -> every strategy
on the instance -> simulator -> execution of each schedule that fits -> one row per strategy,
beside a plain PyTorch step as the reference.

With several devices the run follows the paper's protocol (as :func:`xengine.compare.compare`):
XEngine gets budget ``b_d`` on every device ``d``; each single-device strategy (Checkmate, LP
rounding, the heuristics) runs on each device alone with the *total* memory ``sum_d b_d``;
XEngine is warm-started from the fastest single-device schedule that also fits the per-device
budgets, and :func:`protocol_summary` gives its gain over the fastest single-device schedule.

This module takes plain dataclasses; the Hydra entry point (``run.py``) builds a
:class:`RunConfig` from the composed config. Bad input (unknown net, solver or strategy, a
memory string that cannot be read, a budget below the smallest feasible one, a malformed graph
file) is raised by :func:`prepare` *before* anything expensive or recorded happens, as
:class:`ConfigError`, :class:`~xengine.units.MemorySpecError`,
:class:`~xengine.graph.types.GraphError` or :class:`~xengine.solvers.SolverUnavailable`.
A strategy that fails later is recorded with status ``error`` and the run carries on.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from xengine.compare import warm_start
from xengine.graph.types import Edge, Graph, GraphError
from xengine.problem import Instance
from xengine.progress import StatusLine
from xengine.result import StrategyResult
from xengine.schedule import Schedule
from xengine.simulate import ScheduleError, keep_all_peak_bytes, simulate
from xengine.solvers import SolverOptions, SolverUnavailable, available_solvers
from xengine.units import MemorySpec, MemorySpecError, format_bytes, parse_memory

log = logging.getLogger(__name__)

MIB = 2**20
MODES = ("train", "infer")
FORMULATION_MODES = ("exact", "paper", "intervals")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and what is allowed."""


class BudgetError(ConfigError):
    """A budget is below the smallest one any schedule can meet."""


# ------------------------------------------------------------------------------ strategies
@dataclass(frozen=True)
class StrategySpec:
    """Where a strategy lives and how it is called.

    ``one_device``: it takes a single-device instance (Checkmate and its heuristics); with
    several devices it runs once per device, alone with the total memory of all devices, as
    in the paper's protocol. ``uses_solver``: it takes ``solver=`` and ``options=``.
    """

    target: str
    one_device: bool
    uses_solver: bool


STRATEGIES: dict[str, StrategySpec] = {
    "checkmate": StrategySpec("baselines.checkmate:solve_checkmate", True, True),
    "lp_rounding": StrategySpec("baselines.lp_rounding:solve_lp_rounding", True, False),
    "checkpoint_all": StrategySpec("baselines.heuristics:solve_checkpoint_all", True, False),
    "chen_sqrtn": StrategySpec("baselines.heuristics:solve_chen_sqrtn", True, False),
    "chen_greedy": StrategySpec("baselines.heuristics:solve_chen_greedy", True, False),
    "recompute_greedy": StrategySpec("baselines.heuristics:solve_recompute_greedy", True, False),
    "xengine": StrategySpec("xengine.strategies.solve:solve_xengine", False, True),
}
LP_BOUND_MODES: dict[str, bool | str] = {"before": True, "alongside": "alongside", "none": False}
"""``lp_bound=`` for formulation=intervals (:func:`xengine.strategies.intervals.solve_intervals`):
the LP
bound first, for at most half the time limit; in its own process on one CPU during the whole
search; or not at all (the placement bound only)."""

DEFAULT_STRATEGIES = (
    "checkmate",
    "lp_rounding",
    "checkpoint_all",
    "chen_sqrtn",
    "chen_greedy",
    "recompute_greedy",
)


def _load(target: str) -> Callable[..., Any]:
    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)


# ------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs, as plain values (see ``conf/config.yaml`` for the meaning).

    ``mem`` holds one memory string for all devices, one per device, or a mapping: ``"all"``
    (one string for every device, or one per device) and device names (that device's budget,
    which wins over ``"all"``), as ``conf/config.yaml``'s ``mem`` group of keys. A percentage
    is of the keep-everything peak. ``graph_path`` set means solve-only: the graph file brings
    its own costs and nothing is executed (there is no model to run). With two devices or more
    ``xengine`` joins the strategies (:attr:`run_strategies`).
    """

    net: str = "resnet18"
    batch_size: int = 4
    image_size: int = 224
    num_classes: int = 1000
    mode: str = "train"
    graph_path: str | None = None
    devices: tuple[str, ...] = ("cpu",)
    mem: tuple[str, ...] | Mapping[str, Any] = ("70%",)
    solver: str = "highs"
    solver_options: SolverOptions = field(default_factory=SolverOptions)
    formulation: str = "exact"
    max_computes: int = 2  # formulation=intervals: computations per node and device
    lp_bound: str = "before"  # formulation=intervals: before | alongside | none (LP bound)
    # xengine: fuse runs of up to this many ops (xengine.strategies.coarsen)
    coarsen: int | None = None
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    execute: bool = True
    n_steps: int = 5
    warmup: int = 1
    profile_path: str | None = None
    profile_repeats: int = 5
    profile_warmup: int = 2
    profile_cache_dir: str = "results/cache/profiles"
    progress: bool = True
    seed: int = 0
    grad_rtol: float = 1e-4
    grad_atol: float = 1e-6

    @property
    def solve_only(self) -> bool:
        return self.graph_path is not None

    @property
    def executes(self) -> bool:
        """Schedules are run for real: a model is at hand and the step is a training step
        (the executor runs training steps; ``mode=infer`` is solve-only)."""
        return self.execute and not self.solve_only and self.mode == "train"

    @property
    def run_strategies(self) -> tuple[str, ...]:
        """The strategies that run: ``strategies``, plus ``xengine`` with several devices."""
        if len(self.devices) > 1 and "xengine" not in self.strategies:
            return (*self.strategies, "xengine")
        return tuple(self.strategies)

    def memory_texts(self) -> tuple[str, ...]:
        """One memory string per device, in device order."""
        return tuple(text for _key, text in self._memory_items())

    def _memory_items(self) -> tuple[tuple[str, str], ...]:
        """Per device, in device order: the key its budget came from (``mem``, ``mem.cpu2``)
        and the text."""
        devices, mem = self.devices, self.mem
        if isinstance(mem, Mapping):
            extra = [k for k in mem if k != "all" and k not in devices]
            if extra:
                raise ConfigError(
                    f"mem.{extra[0]}={mem[extra[0]]}: {extra[0]!r} is not in the device mix "
                    f"({', '.join(devices)}); give budgets as mem=<size> (every device) or "
                    "mem.<device>=<size>"
                )
            base = mem.get("all")
            texts = None if base is None else _texts(base, devices, "mem")
            out = []
            for k, d in enumerate(devices):
                if d in mem:
                    out.append((f"mem.{d}", str(mem[d])))
                elif texts is None:
                    raise ConfigError(
                        f"no budget for device {d!r}: set mem=<size> (every device) or "
                        f"mem.{d}=<size>"
                    )
                else:
                    out.append(("mem", texts[k]))
            return tuple(out)
        return tuple(("mem", t) for t in _texts(mem, devices, "mem"))

    def memory_specs(self) -> tuple[MemorySpec, ...]:
        """One parsed budget per device (a single value applies to every device); an error
        names the key the budget came from."""
        specs = []
        for key, text in self._memory_items():
            try:
                specs.append(parse_memory(text))
            except MemorySpecError as exc:
                raise MemorySpecError(f"{key}={text}: {exc}") from None
        return tuple(specs)

    @property
    def mem_text(self) -> str:
        """The budgets as one short text: ``70%`` when every device has the same, else
        ``cpu2=1GB,cpu1=2GB`` (the ``mem`` param of a run and part of its name)."""
        texts = self.memory_texts()
        if len(set(texts)) == 1:
            return texts[0]
        return ",".join(f"{d}={t}" for d, t in zip(self.devices, texts, strict=True))

    def validate(self) -> tuple[MemorySpec, ...]:
        """Cheap checks of every value; returns the parsed budgets."""
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        if not self.devices or any(not d for d in self.devices):
            raise ConfigError("devices is empty: name at least one device, e.g. devices=cpu")
        same = [_canonical_device(d) for d in self.devices]
        if len(set(same)) != len(same):
            dup = next(d for k, d in enumerate(self.devices) if same[k] in same[:k])
            raise ConfigError(
                f"devices={'+'.join(self.devices)} names device {dup!r} twice: each device of "
                "the mix must be different (CPU sub-devices: cpu2+cpu1)"
            )
        specs = self.memory_specs()
        if not self.strategies:
            raise ConfigError("strategy is empty: name at least one strategy")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ConfigError(
                f"unknown strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)}"
            )
        if len(set(self.strategies)) != len(self.strategies):
            raise ConfigError(f"strategy={','.join(self.strategies)} names a strategy twice")
        if any(STRATEGIES[s].uses_solver for s in self.run_strategies):
            if self.solver.lower() not in available_solvers():
                raise SolverUnavailable(
                    f"unknown solver {self.solver!r}: this build has "
                    f"{', '.join(available_solvers())}"
                )
        if self.formulation not in FORMULATION_MODES:
            raise ConfigError(
                f"formulation={self.formulation!r} is not one of {', '.join(FORMULATION_MODES)}"
            )
        if self.max_computes < 1:
            raise ConfigError(f"max_computes={self.max_computes} must be at least 1")
        if self.lp_bound not in LP_BOUND_MODES:
            raise ConfigError(
                f"lp_bound={self.lp_bound!r} is not one of {', '.join(LP_BOUND_MODES)}"
            )
        if self.coarsen is not None and self.coarsen < 1:
            raise ConfigError(f"coarsen={self.coarsen} must be at least 1 (or null: off)")
        if self.coarsen is not None and "xengine" not in self.run_strategies:
            raise ConfigError(
                f"coarsen={self.coarsen} applies to the xengine strategy, which this run does "
                "not have: give two or more devices, or add xengine to strategy=[...]"
            )
        opts = self.solver_options
        if opts.time_limit_s is not None and opts.time_limit_s <= 0:
            raise ConfigError(f"solver.time_limit_s={opts.time_limit_s} must be positive (or null)")
        if not 0 <= opts.rel_gap < 1:
            raise ConfigError(f"solver.rel_gap={opts.rel_gap} must be in [0, 1)")
        if opts.threads is not None and opts.threads < 1:
            raise ConfigError(f"solver.threads={opts.threads} must be at least 1 (or null)")
        for name, value, least in (
            ("net.batch_size", self.batch_size, 1),
            ("net.image_size", self.image_size, 1),
            ("n_steps", self.n_steps, 1),
            ("warmup", self.warmup, 0),
            ("profile.repeats", self.profile_repeats, 1),
            ("profile.warmup", self.profile_warmup, 0),
        ):
            if value < least:
                raise ConfigError(f"{name}={value} must be at least {least}")
        if self.graph_path is not None and self.profile_path is not None:
            raise ConfigError(
                "graph= and profile.path= are both set: a graph file carries its own costs"
            )
        return specs


def _texts(value: Any, devices: tuple[str, ...], key: str) -> tuple[str, ...]:
    """``"2GB"`` or ``("2GB",)`` -> one text per device; ``("1GB", "2GB")`` -> as is (one
    per device)."""
    texts = (str(value),) if isinstance(value, str) else tuple(str(v) for v in value)
    if len(texts) == 1:
        return texts * len(devices)
    if len(texts) != len(devices):
        raise ConfigError(
            f"{key} has {len(texts)} values ({', '.join(texts)}) for {len(devices)} devices "
            f"({', '.join(devices)}): give one budget for all devices or one per device"
        )
    return texts


def _canonical_device(name: str) -> str:
    """``cuda`` and ``cuda:0`` are the same device."""
    return "cuda:0" if name == "cuda" else name


# ------------------------------------------------------------------------------ results
@dataclass
class RunRow:
    """One line of the comparison table (and of ``table.csv``).

    ``alone``: a single-device strategy in a run over several devices, on one device with the
    total memory of all of them (the paper's baseline)."""

    label: str
    strategy: str
    devices: tuple[str, ...]
    status: str
    budget_bytes: tuple[int, ...] | None = None
    predicted_time_s: float | None = None
    predicted_peak_bytes: tuple[int, ...] | None = None
    measured_time_s: float | None = None
    measured_peak_bytes: tuple[int, ...] | None = None
    fixed_bytes: int | None = None
    solve_time_s: float | None = None
    build_time_s: float | None = None
    gap: float | None = None
    n_recomputes: int | None = None
    grads_match: bool | None = None
    grads_max_rel_diff: float | None = None
    note: str = ""
    alone: bool = False
    result: StrategyResult | None = field(default=None, repr=False)
    execution: Any = field(default=None, repr=False)

    def metrics(self) -> dict[str, float]:
        """MLflow metrics under ``<label>/``, units in the names."""
        out: dict[str, float | None] = {
            "predicted_time_ms": _ms(self.predicted_time_s),
            "measured_time_ms": _ms(self.measured_time_s),
            "predicted_peak_mib": _mib_max(self.predicted_peak_bytes),
            "measured_peak_mib": _mib_max(self.measured_peak_bytes),
            "budget_mib": _mib_max(self.budget_bytes),
            "fixed_mib": None if self.fixed_bytes is None else self.fixed_bytes / MIB,
            "solve_time_s": self.solve_time_s,
            "build_time_s": self.build_time_s,
            "gap": self.gap,
            "n_recomputes": self.n_recomputes,
            "grads_match": None if self.grads_match is None else float(self.grads_match),
            "grads_max_rel_diff": self.grads_max_rel_diff,
        }
        if len(self.devices) > 1:
            for name, vals in (
                ("predicted_peak_mib", self.predicted_peak_bytes),
                ("measured_peak_mib", self.measured_peak_bytes),
                ("budget_mib", self.budget_bytes),
            ):
                for dev, v in zip(self.devices, vals or (), strict=False):
                    out[f"{name}.{dev}"] = v / MIB
        return {f"{self.label}/{k}": float(v) for k, v in out.items() if v is not None}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _mib_max(values: tuple[int, ...] | None) -> float | None:
    return None if not values else max(values) / MIB


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


# ------------------------------------------------------------------------------ preparing
@dataclass
class Prepared:
    """The graph and budgets of a run, validated; the model to execute, when there is one."""

    graph: Graph
    budget_bytes: tuple[int, ...]
    keep_all_peak_bytes: int
    min_budget_bytes: int
    known_feasible_bytes: int | None
    captured: Any = None  # xengine.graph.capture.CapturedModel
    start_state: StartState | None = None
    profile: Any = None  # xengine.profile.profiler.Profile loaded from profile.path


class StartState:
    """The random state and the module buffers (batch-norm running statistics) as they were
    before anything ran. Each measured run (the reference and every schedule) starts from
    them: a step leaves the state of "after one step" behind (dropout draws, updated
    statistics), and two runs compare equal only from the same start."""

    def __init__(self, module: Any) -> None:
        import torch

        self._module = module
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self._buffers = [b.detach().clone() for b in module.buffers()]

    def restore(self) -> None:
        import torch

        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
        with torch.no_grad():
            for b, b0 in zip(self._module.buffers(), self._buffers, strict=True):
                b.copy_(b0)


def _bytes_view(graph: Graph) -> Graph:
    """``graph`` itself when it has costs, else a zero-cost copy. Memory figures (the
    keep-everything peak, the smallest feasible budget) depend on bytes only, but they are
    computed by simulating, which reads costs; a captured graph has none before profiling."""
    if graph.devices:
        return graph
    return graph.with_costs({"cpu": {v.name: 0.0 for v in graph.nodes}})


def prepare(cfg: RunConfig) -> Prepared:
    """Validate ``cfg``, load or capture the graph and resolve the budgets.

    Raises the project's bad-input errors (see the module docstring); a budget below the
    smallest feasible one on every device is a :class:`BudgetError` naming that budget.
    """
    specs = cfg.validate()
    captured = profile = None
    if cfg.graph_path is not None:
        from xengine.graph.io import load_graph

        graph = load_graph(cfg.graph_path)
        if cfg.mode == "infer":
            graph = _forward_only(graph)
        missing = [d for d in cfg.devices if d not in graph.devices]
        if missing:
            have = ", ".join(graph.devices) or "none"
            raise GraphError(
                f"{cfg.graph_path}: nodes have no cost for device {missing[0]!r} "
                f"(devices with costs for every node: {have}); set devices= accordingly"
            )
        if cfg.execute:
            log.info("graph file given: solve only, nothing is executed")
    else:
        if cfg.execute and cfg.mode == "infer":
            log.info("mode=infer: schedules are solved, not executed")
        _check_devices_exist(cfg)
        if cfg.profile_path is not None:
            profile = _read_profile(cfg.profile_path, cfg.devices, cfg)
        from xengine.graph.capture import capture_net

        log.info(
            "capturing %s (batch %d, %dx%d, %s)",
            cfg.net,
            cfg.batch_size,
            cfg.image_size,
            cfg.image_size,
            cfg.mode,
        )
        captured = capture_net(
            cfg.net,
            cfg.batch_size,
            mode=cfg.mode,
            image_size=cfg.image_size,
            num_classes=cfg.num_classes,
            seed=cfg.seed,
        )
        graph = captured.graph
        if profile is not None:
            graph = _apply_read_profile(profile, graph)

    view = _bytes_view(graph)
    keep_all = keep_all_peak_bytes(view)
    budgets = tuple(s.resolve_bytes(keep_all) for s in specs)
    lower, known = _min_feasible_budget(view)
    # several devices: the single-device baselines get the total, so the run makes sense as
    # long as the total fits (XEngine itself is then reported infeasible if no device fits)
    if sum(budgets) < lower:
        smallest = f"{format_bytes(lower)} ({lower} bytes)"
        if known is not None and known > lower:
            smallest += f"; a schedule is known to fit {format_bytes(known)} ({known} bytes)"
        what = _budget_text(specs, budgets)
        if len(budgets) > 1:
            what += f" (total {format_bytes(sum(budgets))})"
        raise BudgetError(
            f"budget {what} is below the smallest feasible budget "
            f"of {graph.name}, {smallest}; the keep-everything peak is {format_bytes(keep_all)}"
        )
    log.info(
        "graph %s: %d nodes, %d edges, keep-all peak %s, smallest feasible budget >= %s, budget %s",
        graph.name,
        graph.size,
        len(graph.edges),
        format_bytes(keep_all),
        format_bytes(lower),
        _budget_text(specs, budgets),
    )
    start = StartState(captured.module) if captured is not None else None
    return Prepared(graph, budgets, keep_all, int(lower), known, captured, start, profile)


def _budget_text(specs: tuple[MemorySpec, ...], budgets: tuple[int, ...]) -> str:
    parts = []
    for s, b in zip(specs, budgets, strict=True):
        parts.append(format_bytes(b) if s.bytes is not None else f"{format_bytes(b)} ({s.text})")
    return ", ".join(dict.fromkeys(parts))


def _min_feasible_budget(graph: Graph) -> tuple[int, int | None]:
    from baselines.checkmate import min_feasible_budget_bytes

    lower, known = min_feasible_budget_bytes(graph)
    return int(lower), (None if known is None else int(known))


def _forward_only(graph: Graph) -> Graph:
    """The forward part of a training graph read from a file (``mode=infer``)."""
    keep = [i for i, v in enumerate(graph.nodes) if v.kind == "fwd"]
    if len(keep) == graph.size:
        return graph
    if not keep:
        raise GraphError(f"graph {graph.name!r} has no forward nodes to run in mode=infer")
    new = {old: k for k, old in enumerate(keep)}
    return replace(
        graph,
        nodes=tuple(replace(graph.nodes[i], fwd_index=None, state_bytes=0) for i in keep),
        edges=tuple(
            Edge(new[e.src], new[e.dst], e.copyable, e.kind)
            for e in graph.edges
            if e.src in new and e.dst in new
        ),
    )


_CPU_NAME = re.compile(r"^cpu(\d+)?$")
_CUDA_NAME = re.compile(r"^cuda(?::(\d+))?$")


def _check_devices_exist(cfg: RunConfig) -> None:
    """Device names are ones the executor knows; a device that must be profiled or executed
    here has to exist here (a CUDA device named in a solve-only run with a profile file
    measured elsewhere need not)."""
    for d in cfg.devices:
        m = _CPU_NAME.match(d)
        if m and m.group(1) is not None and int(m.group(1)) < 1:
            raise ConfigError(f"device {d!r}: a CPU device needs at least one thread (cpu1)")
        if not m and not _CUDA_NAME.match(d):
            raise ConfigError(
                f"device {d!r} is not a device name: cpu, cpu<k> (k threads), cuda, cuda:<i>"
            )
    if not (cfg.executes or cfg.profile_path is None):
        return
    for d in cfg.devices:
        m = _CUDA_NAME.match(d)
        if m is None:
            continue
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {d!r} is not available on this machine (torch sees no CUDA device): "
                "solve only, with a profile measured on a GPU machine: "
                "profile.path=<file> execute=false"
            )
        if int(m.group(1) or 0) >= torch.cuda.device_count():
            raise ConfigError(
                f"device {d!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )


# ------------------------------------------------------------------------------ running
def run_pipeline(
    cfg: RunConfig, tracker: Tracker | None = None, prepared: Prepared | None = None
) -> list[RunRow]:
    """Run every strategy of ``cfg``; rows come back in table order (reference first).

    Each row is handed to ``tracker`` as soon as it is complete (metrics, schedule, figures),
    so a crash later in the run loses nothing already measured. With several devices the
    single-device strategies get the total memory on each device alone, ``xengine`` joins,
    and the gain over the fastest single-device schedule is recorded (:func:`protocol_summary`).
    """
    tracker = tracker or NullTracker()
    prep = prepared or prepare(cfg)
    graph = prep.graph
    several = len(cfg.devices) > 1
    total = int(sum(prep.budget_bytes))
    tracker.metrics(
        {
            "graph/num_nodes": graph.size,
            "graph/num_edges": len(graph.edges),
            "graph/keep_all_peak_mib": prep.keep_all_peak_bytes / MIB,
            "graph/min_budget_mib": prep.min_budget_bytes / MIB,
            "graph/fixed_mib": graph.fixed_bytes / MIB,
            "protocol/total_budget_mib": total / MIB,
        }
    )
    if prep.captured is not None:
        profile, profile_file = prep.profile, cfg.profile_path
        if profile is None:
            profile, profile_file, graph = _measure_profile(cfg, prep)
        _record_profile(profile, str(profile_file), tracker)
    inst = Instance(graph, cfg.devices, prep.budget_bytes)
    _record_graph(tracker, inst)

    rows: list[RunRow] = []
    references: dict[str, Any] = {}
    if cfg.executes:
        for device in reference_devices(cfg.devices):
            reference, ref_row = _reference(cfg, prep, device)
            if reference is not None:
                references[device] = reference
            rows.append(ref_row)
            _record(tracker, ref_row)

    # one-device strategies first: their best schedule warm-starts the heterogeneous model
    order = sorted(cfg.run_strategies, key=lambda s: not STRATEGIES[s].one_device)
    executed: dict[str, tuple[str, Any]] = {}  # schedule key -> (label, its execution)
    alone: list[StrategyResult] = []
    for name in order:
        spec = STRATEGIES[name]
        if spec.one_device:  # the paper's baseline: one device alone with the total memory
            targets = [(d, inst.only_device(d, total)) for d in range(len(cfg.devices))]
        else:
            targets = [(None, inst)]
        for d, sub in targets:
            label = name if (d is None or not several) else f"{name}.{cfg.devices[d]}"
            warm = None
            if name == "xengine":
                warm = _warm_start(inst, alone, cfg, tracker, prep.min_budget_bytes)
            res = _solve(name, spec, sub, cfg, warm, prep.min_budget_bytes, label)
            row = _row(label, res)
            row.alone = spec.one_device and several
            if cfg.executes and prep.captured is not None:
                _execute_into(row, res, sub, cfg, prep, references, executed)
            rows.append(row)
            _record(tracker, row)
            _record_figures(tracker, row, sub)
            if spec.one_device:
                alone.append(res)
    if several:
        _record_summary(tracker, protocol_summary(rows))
    return rows


def _fits(res: StrategyResult | None) -> bool:
    """A schedule that the simulator finds within its budget (as in ``xengine.compare``)."""
    return (
        res is not None
        and res.has_schedule
        and res.sim.within_budget
        and res.status in ("optimal", "feasible")
    )


def _warm_start(
    inst: Instance, alone: list[StrategyResult], cfg: RunConfig, tracker: Tracker, min_budget: int
) -> Schedule | None:
    """XEngine's start by the rule of :func:`xengine.compare.warm_start`, timed and tagged
    (``xengine/warm_start_time_s``, ``xe.warm_start``)."""
    t0 = time.perf_counter()
    start = warm_start(
        inst, alone, cfg.solver, cfg.solver_options, cfg.formulation, min_budget_bytes=min_budget
    )
    tracker.metrics({"xengine/warm_start_time_s": time.perf_counter() - t0})
    if start is None:
        log.info("xengine: no schedule found that fits the per-device budgets; cold start")
        tracker.tags({"xe.warm_start": "none"})
        return None
    what, sched, t = start
    log.info("xengine: warm start from %s, predicted %.4g s", what, t)
    tracker.tags({"xe.warm_start": what})
    return sched


@dataclass
class ProtocolSummary:
    """The headline of a run over several devices: XEngine against the fastest single-device
    schedule that fits the total memory (predicted by the simulator, and measured when both
    were executed). ``gain`` = (best single time - XEngine time) / best single time."""

    total_budget_bytes: int | None
    xengine: RunRow | None
    best_single: RunRow | None
    infeasible_single: list[str]

    @property
    def gain(self) -> float | None:
        x, b = self.xengine, self.best_single
        if x is None or b is None or not _fits(x.result) or not b.predicted_time_s:
            return None
        return (b.predicted_time_s - x.predicted_time_s) / b.predicted_time_s

    @property
    def measured_gain(self) -> float | None:
        x, b = self.xengine, self.best_single
        if self.gain is None or x.measured_time_s is None or not b.measured_time_s:
            return None
        return (b.measured_time_s - x.measured_time_s) / b.measured_time_s


def protocol_summary(rows: list[RunRow]) -> ProtocolSummary:
    """Best single-device row, XEngine's row, and the single-device rows with no schedule
    that fits the total memory, from the rows of a run over several devices."""
    singles = [r for r in rows if r.alone]
    xe = next((r for r in rows if r.strategy == "xengine" and len(r.devices) > 1), None)
    fitting = [r for r in singles if _fits(r.result)]
    best = min(fitting, key=lambda r: r.predicted_time_s) if fitting else None
    total = xe.budget_bytes if xe is not None else None
    return ProtocolSummary(
        total_budget_bytes=None if not total else int(sum(total)),
        xengine=xe,
        best_single=best,
        infeasible_single=[r.label for r in singles if not _fits(r.result)],
    )


def _record_summary(tracker: Tracker, summary: ProtocolSummary) -> None:
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


def _record_figures(tracker: Tracker, row: RunRow, inst: Instance) -> None:
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


def _read_profile(path: str, devices: tuple[str, ...], cfg: RunConfig | None = None) -> Any:
    """The profile file a user brought (``profile.path``); a malformed file, one measured for
    another net, batch size, image size or mode, or one without times for a configured device
    or copy models between them, is a :class:`ConfigError` naming the file and the field."""
    if cfg is not None:
        _check_profile_key(path, cfg)
    from xengine.profile.profiler import Profile, ProfileError

    try:
        profile = Profile.load(Path(path))
    except ProfileError as exc:
        raise ConfigError(str(exc)) from None
    missing = [d for d in devices if d not in profile.compute_s]
    if missing:
        raise ConfigError(
            f"{path}: field 'compute_s' has no times for device {missing[0]!r} "
            f"(it has {', '.join(profile.compute_s)}); set devices= accordingly"
        )
    pairs = [(a, b) for a in devices for b in devices if a != b and (a, b) not in profile.copy]
    if pairs:
        a, b = pairs[0]
        raise ConfigError(
            f"{path}: field 'copy' has no copy model from {a!r} to {b!r}; profile the "
            "devices together (devices=...) to measure it"
        )
    return profile


def _check_profile_key(path: str, cfg: RunConfig) -> None:
    """A profile measured for another net, batch size, image size or mode is an error; read
    from the file's ``key`` as plain JSON, before anything heavy is imported (a malformed file
    is left to :meth:`Profile.load`, which names the field)."""
    import json

    try:
        key = json.loads(Path(path).read_text(encoding="utf-8")).get("key")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return
    if not isinstance(key, dict):
        return
    for fld, ours, what in (
        ("net", cfg.net, "net.name"),
        ("batch_size", cfg.batch_size, "net.batch_size"),
        ("image_size", cfg.image_size, "net.image_size"),
        ("mode", cfg.mode, "mode"),
    ):
        theirs = key.get(fld)
        if theirs is not None and theirs != ours:
            raise ConfigError(
                f"{path}: field 'key.{fld}' is {theirs!r} but this run has {what}={ours}: "
                f"the profile was measured for another {fld.replace('_', ' ')}"
            )


def _apply_read_profile(profile: Any, graph: Graph) -> Graph:
    """Costs from a user's profile; one measured for another graph is a :class:`ConfigError`."""
    from xengine.profile.profiler import ProfileError, apply_profile

    try:
        return apply_profile(graph, profile)
    except ProfileError as exc:
        raise ConfigError(str(exc)) from None


def _measure_profile(cfg: RunConfig, prep: Prepared) -> tuple[Any, str, Graph]:
    """Profile the captured model on the configured devices (or take it from the cache)."""
    from xengine.profile.profiler import apply_profile, cache_path, profile_key, profile_model

    cache_dir = Path(cfg.profile_cache_dir)
    log.info("profiling %s on %s (cache %s)", cfg.net, ",".join(cfg.devices), cache_dir)
    profile = profile_model(
        prep.captured,
        cfg.devices,
        repeats=cfg.profile_repeats,
        warmup=cfg.profile_warmup,
        cache_dir=cache_dir,
        progress=cfg.progress,
    )
    path = cache_path(cache_dir, profile_key(prep.captured, cfg.devices))
    return profile, str(path), apply_profile(prep.graph, profile)


def _record_profile(profile: Any, profile_file: str, tracker: Tracker) -> None:
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


def _solve(
    name: str,
    spec: StrategySpec,
    inst: Instance,
    cfg: RunConfig,
    warm: Schedule | None,
    min_budget: int,
    label: str,
) -> StrategyResult:
    """Run one strategy; any failure becomes a result with status ``error`` and a message."""
    if max(inst.budget_bytes) < min_budget:
        return StrategyResult(
            name,
            inst.devices,
            inst.budget_bytes,
            "infeasible",
            message=f"budget {format_bytes(max(inst.budget_bytes))} is below the smallest "
            f"feasible budget {format_bytes(min_budget)}",
        )
    kwargs: dict[str, Any] = {}
    if spec.uses_solver:
        kwargs.update(solver=cfg.solver, options=cfg.solver_options)
    if name == "xengine":
        kwargs.update(mode=cfg.formulation, warm_start=warm)
        if cfg.formulation == "intervals":  # a CP-SAT model; solver= is for the MILPs
            kwargs["solver"] = "cpsat"
            kwargs["build_options"] = {
                "max_computes": cfg.max_computes,
                "lp_bound": LP_BOUND_MODES[cfg.lp_bound],
            }
    target = _load(spec.target)
    if name == "xengine" and cfg.coarsen is not None:
        # the coarse model is solved and its schedule expanded to this graph; a start for the
        # fine graph does not fit the coarse one, so the coarse model starts without one
        from xengine.strategies.coarsen import solve_coarse

        kwargs.pop("warm_start", None)
        kwargs.update(max_group=cfg.coarsen, strategy=name)
        target = solve_coarse
    if name == "lp_rounding":  # the LP runs under the same options (time limit, threads)
        kwargs.update(seed=cfg.seed, options=cfg.solver_options)
    if name == "checkmate":
        kwargs.update(progress=_progress(label))
    log.info("%s: solving on %s, budget %s", label, ",".join(inst.devices), _budget_list(inst))
    t0 = time.perf_counter()
    detail = kwargs.get("solver", "") if spec.uses_solver else ""
    try:
        with StatusLine(label, str(detail), enabled=cfg.progress):
            res = target(inst, **kwargs)
    except Exception as exc:  # a failing strategy is recorded, the run goes on
        log.warning("%s failed: %s: %s", label, type(exc).__name__, exc)
        log.info("%s traceback", label, exc_info=True)
        return StrategyResult(
            name,
            inst.devices,
            inst.budget_bytes,
            "error",
            solve_time_s=time.perf_counter() - t0,
            message=f"{type(exc).__name__}: {exc}",
        )
    if res.schedule is not None and res.sim is None:
        try:
            res.sim = simulate(inst, res.schedule, check_budget=False)
        except ScheduleError as exc:
            res.status, res.message = "error", f"schedule rejected by the simulator: {exc}"
            res.schedule = None
    _overrule_by_simulator(res)
    log.info(
        "%s: %s%s",
        label,
        res.status,
        f", predicted {res.sim.time_s * 1e3:.2f} ms" if res.sim is not None else "",
    )
    return res


def _overrule_by_simulator(res: StrategyResult) -> None:
    """A schedule the simulator finds over budget is not ``optimal`` or ``feasible``, whatever
    its solver said (the published model does not count every byte): its status becomes
    ``over_budget``, the solver's verdict stays in the message and in ``extra``."""
    if res.sim is None or res.sim.within_budget or res.status not in ("optimal", "feasible"):
        return
    res.extra["solver_status"] = res.status
    why = f"over budget in the simulator: {res.sim.violations[0]}"
    said = f"{res.solver} said {res.status}" if res.solver else f"reported {res.status}"
    res.message = "; ".join(
        x for x in (why if why not in res.message else "", said, res.message) if x
    )
    res.status = "over_budget"


def _progress(
    label: str, every_s: float = 10.0
) -> Callable[[float, float | None, float | None], None]:
    """Log the incumbent's gap during a long solve, at most once every ``every_s`` seconds."""
    last = [-every_s]

    def report(elapsed_s: float, incumbent: float | None, bound: float | None) -> None:
        if elapsed_s - last[0] < every_s:
            return
        last[0] = elapsed_s
        gap = ""
        if incumbent and bound is not None:
            gap = f", gap {100 * abs(incumbent - bound) / abs(incumbent):.2f}%"
        log.info("%s: %.1f s, new incumbent%s", label, elapsed_s, gap)

    return report


def _budget_list(inst: Instance) -> str:
    return ", ".join(format_bytes(b) for b in inst.budget_bytes)


def _row(label: str, res: StrategyResult) -> RunRow:
    sim = res.sim
    row = RunRow(
        label=label,
        strategy=res.strategy,
        devices=tuple(res.devices),
        status=res.status,
        budget_bytes=tuple(int(b) for b in res.budget_bytes),
        solve_time_s=res.solve_time_s,
        build_time_s=res.build_time_s or None,
        gap=res.gap,
        note="" if res.message.strip().lower() in ("optimal", res.status) else res.message,
        result=res,
    )
    if sim is not None:
        row.predicted_time_s = float(sim.time_s)
        row.predicted_peak_bytes = tuple(int(p) for p in sim.peak_bytes)
        row.n_recomputes = int(sim.n_recomputes)
        if sim.violations and not row.note:
            row.note = f"over budget in the simulator: {sim.violations[0]}"
    return row


def _torch_device(device: str) -> str:
    """The torch device behind a device name (``cpu2`` and ``cpu`` are both ``cpu``)."""
    return _numerics(device)[0]


def reference_devices(devices: tuple[str, ...]) -> list[str]:
    """Where a plain PyTorch step runs: the first device, and the first device of every
    other kind (a GPU's arithmetic differs from the CPU's: its gradients are checked against
    a plain step on the GPU; CPU sub-devices share one reference)."""
    out: list[str] = []
    for d in devices:
        if all(_torch_device(d) != _torch_device(r) for r in out):
            out.append(d)
    return out


def _reference(cfg: RunConfig, prep: Prepared, device: str) -> tuple[Any, RunRow]:
    from xengine.execute.executor import reference_step

    log.info(
        "reference: plain PyTorch step on %s, %d steps after %d warm-up",
        device,
        cfg.n_steps,
        cfg.warmup,
    )
    label = "pytorch" if device == cfg.devices[0] else f"pytorch.{device}"
    row = RunRow(label=label, strategy="pytorch", devices=(device,), status="reference")
    try:
        prep.start_state.restore()
        with StatusLine(f"plain PyTorch step on {device}", enabled=cfg.progress):
            ref = reference_step(
                prep.captured, n_steps=cfg.n_steps, warmup=cfg.warmup, device=device
            )
    except Exception as exc:
        log.warning("reference step failed: %s: %s", type(exc).__name__, exc)
        log.info("reference traceback", exc_info=True)
        row.status, row.note = "error", f"{type(exc).__name__}: {exc}"
        return None, row
    _fill_measurement(row, ref)
    row.execution = ref
    return ref, row


def _fill_measurement(row: RunRow, ex: Any) -> None:
    row.measured_time_s = float(ex.step_time_s)
    row.measured_peak_bytes = tuple(int(ex.peak_bytes.get(d, 0)) for d in row.devices)
    fixed = ex.fixed_bytes
    row.fixed_bytes = int(sum(fixed.values()) if isinstance(fixed, Mapping) else fixed)


def _execute_into(
    row: RunRow,
    res: StrategyResult,
    inst: Instance,
    cfg: RunConfig,
    prep: Prepared,
    references: Mapping[str, Any],
    executed: dict[str, tuple[str, Any]] | None = None,
) -> None:
    """Run ``res``'s schedule for real when it has one that fits, and compare with PyTorch.

    A schedule already executed in this run on the same devices and budgets (keep-everything
    is often the answer of four strategies) is not run again: the row takes that measurement
    and says so in its note, so that one schedule has one measured time."""
    if not res.has_schedule:
        return
    if not res.sim.within_budget:
        row.note = row.note or "not executed: over budget in the simulator"
        return
    from xengine.execute.executor import execute

    key = _schedule_key(res.schedule, inst)
    if executed is not None and key in executed:
        first, ex = executed[key]
        row.note = "; ".join(
            x for x in (row.note, f"measured once with {first}: the same schedule") if x
        )
    else:
        log.info("%s: executing %d steps after %d warm-up", row.label, cfg.n_steps, cfg.warmup)
        try:
            prep.start_state.restore()
            with StatusLine(f"executing {row.label}", enabled=cfg.progress):
                ex = execute(
                    prep.captured, inst, res.schedule, n_steps=cfg.n_steps, warmup=cfg.warmup
                )
        except Exception as exc:
            log.warning("%s: execution failed: %s: %s", row.label, type(exc).__name__, exc)
            log.info("%s execution traceback", row.label, exc_info=True)
            row.note = f"execution failed: {type(exc).__name__}: {exc}"
            return
        if executed is not None:
            executed[key] = (row.label, ex)
    row.execution = ex
    _fill_measurement(row, ex)
    if ex.violations:  # measured peak above budget + the executor's stated tolerance
        row.note = "; ".join([row.note, *ex.violations]) if row.note else "; ".join(ex.violations)
    checked = check_grads(ex, row.devices, references, cfg.grad_rtol, cfg.grad_atol)
    if checked is None:
        return  # a reference step failed: nothing to compare with
    row.grads_match, row.grads_max_rel_diff = checked
    if not row.grads_match:
        log.warning(
            "%s: loss or gradients differ from plain PyTorch (largest difference %s of "
            "the tensor's largest magnitude)",
            row.label,
            "unknown" if row.grads_max_rel_diff is None else f"{row.grads_max_rel_diff:.3g}",
        )


def _schedule_key(sched: Schedule, inst: Instance) -> str:
    """What makes two executions the same: devices, budgets, and the schedule's R, S and
    state residency (an implicit minimal residency equals the same made explicit)."""
    h = hashlib.sha256()
    h.update(repr((tuple(inst.devices), tuple(int(b) for b in inst.budget_bytes))).encode())
    for a in (sched.R, sched.S, sched.states_for(inst.graph)):
        a = np.ascontiguousarray(a, dtype=bool)
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def check_grads(
    run: Any,
    devices: tuple[str, ...],
    references: Mapping[str, Any],
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> tuple[bool, float | None] | None:
    """Compare a step that ran on ``devices`` with the plain steps in ``references`` (device
    name -> plain step, one per kind of device as :func:`reference_devices` picks them): on
    one kind of device against that kind's plain step (element by element where the
    arithmetic is the same, per tensor where it is not, e.g. another CPU thread count or a
    GPU), over several kinds with :func:`grads_within_spread`. Returns (match, largest
    difference as a fraction of a tensor's largest magnitude), or None without a plain step
    of each kind to compare with."""
    by_kind = {_torch_device(d): d for d in reversed(list(references))}
    kinds = sorted({_torch_device(d) for d in devices})
    if not all(k in by_kind for k in kinds):
        return None
    if len(kinds) > 1:
        return grads_within_spread(run, [references[by_kind[k]] for k in kinds], rtol)
    ref_device = by_kind[kinds[0]]
    reference = references[ref_device]
    on_cuda = kinds[0].startswith("cuda")
    match = grads_match(
        run,
        reference,
        max(rtol, CUDA_GRAD_RTOL) if on_cuda else rtol,
        atol,
        per_tensor=on_cuda or not _same_numerics(devices, ref_device),
    )
    return match, grads_max_rel_diff(run, reference)


CUDA_GRAD_RTOL = 1e-3
"""Per-tensor tolerance against a plain step on the same GPU: cuDNN picks reduction orders
that are not deterministic (two plain resnet18 steps on an H200 differed by up to 4.3e-5 of a
tensor's largest gradient; results/gpu_checks/grads_cpu_vs_gpu.txt)."""

SPREAD_FACTOR = 2.0
"""A schedule over a CPU and a GPU may differ from each plain step by this many times the
difference between the two plain steps (see :func:`grads_within_spread`)."""


def grads_within_spread(
    run: Any, references: list[Any], rtol: float = 1e-4
) -> tuple[bool, float | None]:
    """Check a step that ran on devices of different kinds (CPU and GPU). No plain step has
    its arithmetic, so the check is relative: its loss and gradients must be no further from
    the nearest plain step than :data:`SPREAD_FACTOR` times the largest difference between the
    plain steps themselves, plus ``rtol`` (all as fractions of each tensor's largest
    magnitude, :func:`grads_max_rel_diff`). On resnet18 batch 4 the plain CPU and H200 steps
    differ by up to 27 % of a tensor's largest gradient with cuDNN's default TF32 and 5.7 %
    without (results/gpu_checks/grads_cpu_vs_gpu.txt), so this finds a wrong gradient, not
    a last-bit difference. Returns (match, distance to the nearest plain step)."""
    dists = [grads_max_rel_diff(run, r) for r in references]
    spreads = [
        grads_max_rel_diff(a, b) for i, a in enumerate(references) for b in references[i + 1 :]
    ]
    if any(x is None for x in dists + spreads):
        return False, None
    nearest = min(dists)
    return nearest <= SPREAD_FACTOR * max(spreads, default=0.0) + rtol, nearest


def _numerics(device: str) -> tuple[str, int | None]:
    """What decides a device's floating-point results: its kind and, on the CPU, its number
    of intra-op threads (the order in which reductions add up)."""
    from xengine.execute.executor import parse_device

    spec = parse_device(device)
    return (str(spec.torch_device), spec.threads)


def _same_numerics(devices: tuple[str, ...], reference_device: str) -> bool:
    return {_numerics(d) for d in devices} == {_numerics(reference_device)}


def grads_match(
    run: Any,
    reference: Any,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    per_tensor: bool = False,
) -> bool:
    """Same loss and the same parameter gradients (names and values) as the reference step.

    Element by element (``|a - b| <= atol + rtol * |b|``), or with ``per_tensor`` against
    each tensor's largest magnitude (``max |a - b| <= atol + rtol * max |b|``): for a run on
    devices whose arithmetic differs from the reference's (another CPU thread count, another
    kind of device), reductions add up in another order, and an element that is a small sum
    of large terms differs by more than its own size allows (resnet18 on 2 against 1 thread:
    4.8e-6 on an element of conv1.weight.grad, whose largest element is 0.54)."""
    import torch

    def as_tensor(x: Any) -> torch.Tensor:
        return x.detach().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(x)

    def close(x: Any, y: Any) -> bool:
        x, y = as_tensor(x).double(), as_tensor(y).double()
        if x.shape != y.shape:
            return False
        if not per_tensor or y.numel() == 0:
            return bool(torch.allclose(x, y, rtol=rtol, atol=atol))
        return bool((x - y).abs().max() <= atol + rtol * y.abs().max())

    if (run.loss is None) != (reference.loss is None):
        return False
    if run.loss is not None and not close(run.loss, reference.loss):
        return False
    a, b = dict(run.param_grads or {}), dict(reference.param_grads or {})
    if a.keys() != b.keys():
        return False
    for k, ref in b.items():
        got = a[k]
        if (got is None) != (ref is None):
            return False
        if got is not None and not close(got, ref):
            return False
    return True


def grads_max_rel_diff(run: Any, reference: Any) -> float | None:
    """max over the loss and the gradients of ``max |a - b| / max |b|`` (None when the two
    steps do not have the same gradients to compare)."""
    import torch

    pairs = [(run.loss, reference.loss)]
    a, b = dict(run.param_grads or {}), dict(reference.param_grads or {})
    if a.keys() != b.keys():
        return None
    pairs += [(a[k], b[k]) for k in b]
    worst = 0.0
    for x, y in pairs:
        if x is None or y is None:
            continue
        x, y = (
            torch.as_tensor(x).detach().cpu().double(),
            torch.as_tensor(y).detach().cpu().double(),
        )
        if x.shape != y.shape:
            return None
        if y.numel():
            scale = float(y.abs().max()) or 1.0
            worst = max(worst, float((x - y).abs().max()) / scale)
    return worst


def _record(tracker: Tracker, row: RunRow) -> None:
    tracker.metrics(row.metrics())
    tags = {f"xe.status.{row.label}": row.status}
    if row.note:
        tags[f"xe.note.{row.label}"] = row.note[:4000]
    tracker.tags(tags)
    if row.result is not None and row.result.schedule is not None:
        tracker.json_artifact(row.result.schedule.to_json(), f"schedules/{row.label}.json")
    if row.result is not None and row.result.sim is not None:
        tracker.text_artifact(memory_csv(row.result.sim, row.devices), f"memory/{row.label}.csv")


def memory_csv(sim: Any, devices: tuple[str, ...]) -> str:
    """The simulator's memory of every device at every step (``memory/<label>.csv``):
    ``step,stage,node,<device>_bytes,...``; what ``experiments/figures.py`` plots."""
    lines = ["step,stage,node," + ",".join(f"{d}_bytes" for d in devices)]
    for k, (t, i) in enumerate(sim.steps):
        mem = ",".join(str(int(sim.mem_bytes[d, k])) for d in range(len(devices)))
        lines.append(f"{k},{t},{i},{mem}")
    return "\n".join(lines) + "\n"


def _record_graph(tracker: Tracker, inst: Instance) -> None:
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


def run_status(rows: list[RunRow]) -> str:
    """``ok`` when every strategy produced its answer, ``partial`` when one failed."""
    bad = [r for r in rows if r.status == "error" or r.note.startswith("execution failed")]
    return "partial" if bad else "ok"


__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "BudgetError",
    "ConfigError",
    "NullTracker",
    "Prepared",
    "ProtocolSummary",
    "RunConfig",
    "RunRow",
    "StrategySpec",
    "Tracker",
    "grads_match",
    "prepare",
    "protocol_summary",
    "run_pipeline",
    "run_status",
]
