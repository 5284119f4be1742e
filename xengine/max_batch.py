"""The largest batch whose schedule fits a memory budget, per strategy: Checkmate's headline
figure (Jain et al., MLSys 2020, section 6.3: up to 5.1x the batch of a plain step), asked by
every user who types ``mem=2GB`` (``task=max_batch``, ``experiment=max_batch``).

For each batch size the net is captured again (values, states and workspaces are measured,
not scaled), the strategy is run on that graph with the run's budget, and the simulator says
whether its schedule fits (:attr:`~xengine.result.StrategyResult.fits`); plain PyTorch fits
where keep-everything does (its peak is a plain step's, docs/measurements.md "Memory
fidelity"). The search doubles the batch from 1 until a batch does not fit, then bisects
between the last that fits and the first that does not: it assumes that a strategy that fits
a batch fits every smaller one. The answer is exact under that assumption and the statuses:
a heuristic that does not fit, or a solver that proves the budget infeasible, settles a batch;
a solver stopped by its time limit without a schedule leaves it open, and the answer is then
the largest batch *shown* to fit (``proven=False``). The largest batch is then executed:
measured peak and step time, and the gradients against a plain step at that batch.

Costs: the profile is measured once at batch 1 and scaled linearly with the batch (they
decide which schedule a solver prefers, not whether one fits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xengine.config import RunConfig
from xengine.graph.types import Graph
from xengine.problem import Instance
from xengine.result import StrategyResult
from xengine.simulate import keep_all_peak_bytes
from xengine.strategies.model_size import available_host_bytes
from xengine.units import format_bytes

log = logging.getLogger(__name__)

PLAIN = "pytorch"
SETTLED = ("feasible", "optimal", "infeasible", "over_budget")
"""Statuses that decide whether a batch fits; any other (``no_solution``: a time limit
without a schedule, ``error``) leaves the batch open."""


@dataclass
class BatchAnswer:
    """One strategy's largest batch. ``largest``: the largest batch shown to fit (0: not
    even 1); ``first_unfit``: the smallest batch found not to fit, or None when the search
    reached ``limit``; ``proven``: every batch between them was settled (False: a solver
    stopped without an answer there); ``tried``: (batch, status) in search order; the rest
    describe the execution at ``largest``."""

    strategy: str
    largest: int = 0
    first_unfit: int | None = None
    proven: bool = True
    tried: list[tuple[int, str]] = field(default_factory=list)
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    measured_time_s: float | None = None
    grads_match: bool | None = None
    note: str = ""

    @property
    def samples_per_s(self) -> float | None:
        """Throughput at the largest batch: what a larger batch costs in step time."""
        return self.largest / self.measured_time_s if self.measured_time_s else None

    def over(self, plain: BatchAnswer) -> float | None:
        """This largest batch as a multiple of plain PyTorch's."""
        return self.largest / plain.largest if plain.largest else None


def search_largest(fits: Callable[[int], bool], limit: int) -> tuple[int, int | None]:
    """``(largest b with fits(b), smallest b without)`` over 1..``limit`` (None: ``limit``
    fits): doubling, then bisection; ``fits`` is assumed monotone (true up to some batch,
    false above it)."""
    lo, b = 0, 1
    while fits(b):
        lo = b
        if b >= limit:
            return lo, None
        b = min(2 * b, limit)
    hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


class TooLarge(RuntimeError):
    """A batch whose capture would not fit in the host's memory (it runs a plain step)."""


class Batches:
    """The net captured at each batch size asked for, costed from a batch-1 profile. A
    capture runs the forward pass and a keep-everything step (workspaces) on the host, so a
    batch whose keep-everything peak, extrapolated from batch 1, would take more than half
    the host's free memory is not captured (:class:`TooLarge`).

    Every strategy's search asks for the same batches, so each batch's costed graph is kept
    (small), but only the latest capture itself (the module and its input batch: hundreds of
    MiB on resnet50); executing an answer at another batch captures it again, which gives the
    same graph (the capture is deterministic: same net, seed and batch)."""

    def __init__(self, cfg: RunConfig, graph_b1: Graph) -> None:
        self.cfg = cfg
        self.cost_s = {d: {v.name: v.cost_s[d] for v in graph_b1.nodes} for d in graph_b1.devices}
        self.sample_bytes = keep_all_peak_bytes(graph_b1, cfg.devices[0])
        self._graphs: dict[int, Graph] = {}
        self._latest: tuple[int, Any] | None = None

    def captured(self, batch: int) -> Any:
        if self._latest is not None and self._latest[0] == batch:
            return self._latest[1]
        from xengine.prepare import capture

        need, free = 2 * self.sample_bytes * batch, available_host_bytes()
        if need > free // 2:
            raise TooLarge(
                f"batch {batch} not captured: a keep-everything step there needs about "
                f"{format_bytes(need)} of host memory, {format_bytes(free)} is free"
            )
        cfg = self.cfg
        self._latest = None  # the previous capture's memory is free before the next one
        log.info("capturing %s at batch %d", cfg.net, batch)
        cap = capture(cfg, batch)
        self._latest = (batch, cap)
        return cap

    def graph(self, batch: int) -> Graph:
        if batch not in self._graphs:
            scaled = {
                d: {n: c * batch for n, c in costs.items()} for d, costs in self.cost_s.items()
            }
            self._graphs[batch] = self.captured(batch).graph.with_costs(scaled)
        return self._graphs[batch]


def budget_of(cfg: RunConfig) -> int:
    """The run's one absolute budget (:meth:`RunConfig.validate` refuses anything else for
    ``task=max_batch``)."""
    return int(cfg.memory_specs()[0].bytes)


def largest_batches(
    cfg: RunConfig,
    batches: Batches,
    strategies: tuple[str, ...],
    run_strategy: Callable[[str, Instance], StrategyResult],
) -> list[BatchAnswer]:
    """Plain PyTorch's largest batch, then each strategy's (``run_strategy(name, inst)``),
    each executed at its largest batch when ``cfg.executes``."""
    device, budget = cfg.devices[0], budget_of(cfg)
    answers = []
    for name in (PLAIN, *strategies):
        results: dict[int, StrategyResult] = {}
        ans = BatchAnswer(name)

        def fits(b: int, name=name, ans=ans, results=results) -> bool:
            try:
                graph = batches.graph(b)
            except TooLarge as exc:
                ans.tried.append((b, "not captured"))
                ans.note = str(exc)
                return False
            if name == PLAIN:
                peak = keep_all_peak_bytes(graph, device)
                ok = peak <= budget
                ans.tried.append((b, "fits" if ok else "over budget"))
            else:
                res = run_strategy(name, Instance(graph, (device,), (budget,)))
                ok = bool(res.fits)
                results[b] = res
                ans.tried.append((b, res.status))
            log.info("%s at batch %d: %s", name, b, ans.tried[-1][1])
            return ok

        def shown(b: int, fits=fits, name=name) -> bool:
            from xengine.progress import StatusLine

            with StatusLine(f"{name} at batch {b}", enabled=cfg.progress):
                return fits(b)

        ans.largest, ans.first_unfit = search_largest(shown, cfg.batch_limit)
        # proven when the first batch that does not fit was settled (above it, by the
        # assumption, nothing fits either); a solver's time limit there leaves it open
        status = dict(ans.tried).get(ans.first_unfit)
        ans.proven = ans.proven and (ans.first_unfit is None or status in (*SETTLED, "over budget"))
        if ans.largest and cfg.executes:
            _execute_largest(cfg, batches, ans, results.get(ans.largest), device)
        log.info(
            "%s: largest batch %d within %s%s",
            name,
            ans.largest,
            format_bytes(budget),
            "" if ans.proven else " (a solver stopped without an answer above it)",
        )
        answers.append(ans)
    return answers


def _execute_largest(
    cfg: RunConfig, batches: Batches, ans: BatchAnswer, res: StrategyResult | None, device: str
) -> None:
    """Run ``ans``'s largest batch: the plain step, or the strategy's schedule and a plain
    step from the same random state (dropout), their gradients compared; a plain step that
    cannot run at that batch (a GPU's memory) leaves them unchecked, with a note."""
    from xengine.execute.executor import execute, reference_step
    from xengine.execute.grads import check_grads
    from xengine.torch_state import TorchState, every_rng_device

    cap, b = batches.captured(ans.largest), ans.largest
    graph = batches.graph(b)
    start = TorchState(cap.module.buffers(), rng=every_rng_device())
    if res is None:  # plain PyTorch
        ans.predicted_peak_bytes = keep_all_peak_bytes(graph, device)
        with start:
            ex = reference_step(cap, n_steps=cfg.n_steps, warmup=cfg.warmup, device=device)
    else:
        ans.predicted_peak_bytes = int(res.sim.peak_bytes[0]) if res.sim is not None else None
        inst = Instance(graph, (device,), (budget_of(cfg),))
        with start:
            ex = execute(cap, inst, res.schedule, cfg.n_steps, cfg.warmup)
        try:
            with start:
                ref = reference_step(cap, cfg.n_steps, cfg.warmup, device=device)
        except RuntimeError as exc:  # a plain step may not fit the device at this batch
            ans.note = f"gradients not checked: a plain step at batch {b} failed: {exc}"
        else:
            checked = check_grads(ex, (device,), {device: ref}, cfg.grad_rtol, cfg.grad_atol)
            ans.grads_match = None if checked is None else bool(checked[0])
    ans.measured_peak_bytes = int(ex.peak_bytes[device])
    ans.measured_time_s = float(ex.step_time_s)
    if res is not None and ex.violations:
        ans.note = "; ".join(filter(None, (ans.note, *ex.violations)))


def run_max_batch(cfg: RunConfig, graph_b1: Graph) -> list[BatchAnswer]:
    """:func:`largest_batches` for ``cfg``'s strategies, costed from ``graph_b1`` (the net
    profiled at batch 1), with the run's solver settings."""
    from xengine.strategies.registry import run_strategy

    batches = Batches(cfg, graph_b1)

    def solve(name: str, inst: Instance) -> StrategyResult:
        return run_strategy(name, inst, cfg.settings)

    return largest_batches(cfg, batches, tuple(cfg.strategies), solve)
