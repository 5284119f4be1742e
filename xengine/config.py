"""What one run is asked to do, as plain values, and the cheap checks of those values.

:class:`RunConfig` is what :func:`xengine.prepare.prepare` and
:func:`xengine.pipeline.run_pipeline` take; the Hydra entry point builds it from the composed
config (:func:`xengine.commandline.run_config_from`). A value that cannot be used is a
:class:`ConfigError` (or :class:`~xengine.units.MemorySpecError`) whose message names the key
and what is allowed, raised before anything expensive or recorded happens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xengine.graph.types import GRANULARITIES, SIZED_NETS
from xengine.solvers import SOLVERS, SolverOptions, SolverUnavailable, describe_solvers
from xengine.strategies.registry import (
    DEFAULT_STRATEGIES,
    FORMULATIONS,
    LP_BOUND_MODES,
    STRATEGIES,
    SolveSettings,
    joining_mixes,
)
from xengine.units import MemorySpec, MemorySpecError, parse_memory

MODES = ("train", "infer")
TASKS = ("run", "max_batch")
"""What ``run.py`` does: solve and execute at ``net.batch_size`` (``run``), or find each
strategy's largest batch that fits the budget (``max_batch``, :mod:`xengine.max_batch`)."""
MALLOCS = ("steady", "system")
"""``malloc=``: glibc's thresholds fixed before the run times anything (``steady``, the
default, :func:`xengine.execute.allocator.steady_malloc`) or glibc as it is (``system``)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and what is allowed."""


class BudgetError(ConfigError):
    """A budget is below the smallest one any schedule can meet."""


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
    granularity: str = "module"  # module | function (xengine.graph.capture.GRANULARITIES)
    num_layers: int | None = None  # a transformer's layers (None: the net's own)
    width: int | None = None  # a transformer's width (None: the net's own)
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
    # profile-guided rounds: a schedule that fits is timed in its own steps and its strategy
    # run again on those costs (xengine.refine); 0 (default, issue 58) keeps the keep-everything
    # profile's costs: the solver optimises the ops, not the executor's overheads
    context_rounds: int = 0
    progress: bool = True
    malloc: str = "steady"  # steady | system (MALLOCS)
    seed: int = 0
    grad_rtol: float = 1e-4
    grad_atol: float = 1e-6
    task: str = "run"  # run | max_batch (TASKS)
    batch_limit: int = 1024  # task=max_batch: the largest batch tried

    def _check_sizes(self) -> None:
        """``net.num_layers`` / ``net.width``: whole numbers from 1, for a sized net only."""
        sizes = {"net.num_layers": self.num_layers, "net.width": self.width}
        given = {k: v for k, v in sizes.items() if v is not None}
        if given and self.net not in SIZED_NETS:
            raise ConfigError(
                f"{', '.join(given)} size only {', '.join(SIZED_NETS)}, not net={self.net}"
            )
        for key, value in given.items():
            if value < 1:
                raise ConfigError(f"{key}={value}: expected a whole number from 1")

    def _check_max_batch(self, specs: tuple[MemorySpec, ...], in_pytorch: list[str]) -> None:
        """``task=max_batch`` captures the net at each batch and compares schedules on one
        device under one absolute budget."""
        if self.solve_only:
            raise ConfigError(
                "task=max_batch captures the net at each batch: give net=, not graph="
            )
        if len(self.devices) != 1:
            raise ConfigError(
                f"task=max_batch runs on one device; devices={'+'.join(self.devices)} has "
                f"{len(self.devices)}: pick one (devices=cpu)"
            )
        if specs[0].bytes is None:
            raise ConfigError(
                f"task=max_batch needs an absolute budget (mem=2GB), not mem={specs[0].text}: "
                "a percentage is of one batch's keep-everything peak"
            )
        if in_pytorch:
            raise ConfigError(
                f"task=max_batch searches our schedules and plain PyTorch; "
                f"{', '.join(in_pytorch)} measure every level of their own and are not "
                "searched: leave them out of strategy="
            )

    @property
    def settings(self) -> SolveSettings:
        """How this run calls its strategies (:func:`xengine.strategies.registry.run_strategy`)."""
        return SolveSettings(
            solver=self.solver,
            options=self.solver_options,
            formulation=self.formulation,
            max_computes=self.max_computes,
            lp_bound=self.lp_bound,
            coarsen=self.coarsen,
            seed=self.seed,
            n_steps=self.n_steps,
            warmup=self.warmup,
        )

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
        """The strategies that run: ``strategies``, plus those that join every run over
        several devices (XEngine's model, :attr:`StrategySpec.heterogeneous`)."""
        if len(self.devices) < 2:
            return tuple(self.strategies)
        return (*self.strategies, *(s for s in joining_mixes() if s not in self.strategies))

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
        if self.task not in TASKS:
            raise ConfigError(f"task={self.task!r} is not one of {', '.join(TASKS)}")
        if self.granularity not in GRANULARITIES:
            raise ConfigError(
                f"net.granularity={self.granularity!r} is not one of {', '.join(GRANULARITIES)}"
            )
        self._check_sizes()
        if self.malloc not in MALLOCS:
            raise ConfigError(f"malloc={self.malloc!r} is not one of {', '.join(MALLOCS)}")
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
        in_pytorch = [s for s in self.strategies if STRATEGIES[s].runs_in_pytorch]
        if self.task == "max_batch":
            self._check_max_batch(specs, in_pytorch)
        if in_pytorch and not self.executes:
            why = "graph= has no net" if self.solve_only else f"execute={self.execute}"
            if self.mode != "train":
                why = f"mode={self.mode}"
            raise ConfigError(
                f"strategy {in_pytorch[0]} is run and measured by PyTorch itself: it needs a "
                f"net, execute=true and mode=train ({why})"
            )
        if any(STRATEGIES[s].uses_solver for s in self.run_strategies):
            if self.solver.lower() not in SOLVERS:  # known but not installed: its own message
                raise SolverUnavailable(
                    f"unknown solver {self.solver!r}: choose one of {describe_solvers()}"
                )
        if self.formulation not in FORMULATIONS:
            raise ConfigError(
                f"formulation={self.formulation!r} is not one of {', '.join(FORMULATIONS)}"
            )
        if self.max_computes < 1:
            raise ConfigError(f"formulation.max_computes={self.max_computes} must be at least 1")
        if self.lp_bound not in LP_BOUND_MODES:
            raise ConfigError(
                f"formulation.lp_bound={self.lp_bound!r} is not one of {', '.join(LP_BOUND_MODES)}"
            )
        if self.coarsen is not None and self.coarsen < 1:
            raise ConfigError(
                f"formulation.coarsen={self.coarsen} must be at least 1 (or null: off)"
            )
        if self.coarsen is not None and not any(
            STRATEGIES[s].heterogeneous for s in self.run_strategies
        ):
            raise ConfigError(
                f"formulation.coarsen={self.coarsen} applies to the xengine strategy, which this "
                "run does not have: give two or more devices, or add xengine to strategy=[...]"
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
            ("profile.context_rounds", self.context_rounds, 0),
            ("batch_limit", self.batch_limit, 1),
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
