"""Stage 1-2 of a run: validate its config, load or capture the graph, read a profile a user
brought, and resolve the budgets (docs/design.md sections 2-4).

Bad input (unknown net, solver or strategy, a memory string that cannot be read, a budget below
the smallest feasible one, a malformed graph or profile file) is raised by :func:`prepare`
*before* anything expensive or recorded happens, as :class:`~xengine.config.ConfigError`,
:class:`~xengine.units.MemorySpecError`, :class:`~xengine.graph.types.GraphError` or
:class:`~xengine.solvers.SolverUnavailable`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from xengine.config import BudgetError, ConfigError, RunConfig
from xengine.graph.types import Edge, Graph, GraphError
from xengine.simulate import keep_all_peak_bytes
from xengine.units import MemorySpec, format_bytes

log = logging.getLogger(__name__)


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
    # per device of the mix: its keep-everything peak with its own workspaces, the "100 %" of a
    # percentage budget on it (re-resolved once the profile's workspaces are known)
    keep_all_by_device_bytes: tuple[int, ...] = ()

    def resolve_budgets(self, cfg: RunConfig) -> None:
        """Budgets from ``cfg``'s memory sizes on today's graph (in place): a percentage is of
        *that device's* keep-everything peak (docs/design.md section 9), which the graph's
        per-device workspaces decide, so this runs again after profiling."""
        devices = cfg.devices
        self.keep_all_by_device_bytes = tuple(keep_all_peak_bytes(self.graph, d) for d in devices)
        self.budget_bytes = tuple(
            s.resolve_bytes(k)
            for s, k in zip(cfg.memory_specs(), self.keep_all_by_device_bytes, strict=True)
        )


class StartState:
    """The random state and the module buffers (batch-norm running statistics) as they were
    before anything ran. Each measured run (the reference and every schedule) starts from
    them: a step leaves the state of "after one step" behind (dropout draws, updated
    statistics), and two runs compare equal only from the same start."""

    def __init__(self, module: Any) -> None:
        from xengine.torch_state import TorchState, every_rng_device

        self._state = TorchState(module.buffers(), rng=every_rng_device())

    def restore(self) -> None:
        self._state.restore()


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
        log.info(
            "capturing %s (batch %d, %dx%d, %s)",
            cfg.net,
            cfg.batch_size,
            cfg.image_size,
            cfg.image_size,
            cfg.mode,
        )
        captured = capture(cfg, cfg.batch_size)
        graph = captured.graph
        if profile is not None:
            graph = _apply_read_profile(profile, graph)

    view = _bytes_view(graph)
    keep_all = keep_all_peak_bytes(view)
    by_device = tuple(keep_all_peak_bytes(view, d) for d in cfg.devices)
    budgets = tuple(s.resolve_bytes(k) for s, k in zip(specs, by_device, strict=True))
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
    return Prepared(
        graph, budgets, keep_all, int(lower), known, captured, start, profile, by_device
    )


def capture(cfg: RunConfig, batch_size: int) -> Any:
    """The net ``cfg`` names, captured at ``batch_size`` with every option the run sets (a
    :class:`xengine.graph.capture.CapturedModel`); the largest-batch search captures again
    at each batch through this too."""
    from xengine.profile.workspace import capture_net

    return capture_net(
        cfg.net,
        batch_size,
        mode=cfg.mode,
        image_size=cfg.image_size,
        num_classes=cfg.num_classes,
        seed=cfg.seed,
        granularity=cfg.granularity,
        num_layers=cfg.num_layers,
        width=cfg.width,
    )


def _budget_text(specs: tuple[MemorySpec, ...], budgets: tuple[int, ...]) -> str:
    parts = []
    for s, b in zip(specs, budgets, strict=True):
        parts.append(format_bytes(b) if s.bytes is not None else f"{format_bytes(b)} ({s.text})")
    return ", ".join(dict.fromkeys(parts))


def _min_feasible_budget(graph: Graph) -> tuple[int, int | None]:
    from xengine.checkpoints import min_feasible_budget_bytes

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


def measure_profile(cfg: RunConfig, prep: Prepared) -> tuple[Any, str, Graph]:
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
