"""Lower bounds on a schedule's time that hold for the whole problem.

A solver's own bound belongs to its model, and a restricted model (the interval model, a
model restricted to a placement) has none that holds for the problem. These two do, whatever
formulation found the schedule, so every schedule's gap can be read against them
(:func:`once_bound_s`, every op at least once, is the weakest and always there):

* :func:`lp_bound_s`: the LP relaxation of the exact MILP. It sees the memory limits, but it
  is an LP over D x T x T variables (705k on resnet50 with two devices, where the simplex
  does not finish in 300 s); by default it is solved by interior point and the bound taken
  from the multipliers, which is proven whatever their accuracy.
* :func:`placement_bound_s`: the problem without memory limits and without stages. Which
  devices compute each node, and which reads need a copy, as a small MILP (2 D n + D |E|
  variables, solved in well under a second at resnet50's size). It cannot see recomputation
  forced by memory, so it is weak where memory binds, and strong where the time goes into
  placement and copies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from xengine.problem import Instance
from xengine.solvers import ModelBuilder, SolverOptions, solve
from xengine.solvers.model import SOLUTION_STATUSES
from xengine.strategies.formulation import Formulation, build

log = logging.getLogger(__name__)

IPM_FROM_VARS = 30_000
"""Model size from which :func:`lp_bound_s` solves the relaxation by interior point."""
PDLP_FROM_VARS = 400_000
"""Model size from which it runs PDLP instead, whose bound holds at any stop."""
LP_METHODS = ("auto", "simplex", "ipm", "pdlp")


def lp_bound_s(
    inst: Instance,
    options: SolverOptions | None = None,
    build_options: dict | None = None,
    method: str = "auto",
    builder: Callable[..., Formulation] = build,
) -> float | None:
    """Lower bound on any schedule's time: the LP relaxation of the exact model (HiGHS).

    Valid for every formulation of the same instance, restricted ones included (their optima
    are never below the exact model's). ``build_options`` pick the written form of
    :func:`xengine.strategies.formulation.build` (or of ``builder``: the experiments' variants
    in ``experiments/formulation_variants.py``); the forms' relaxations differ. Unless they say
    otherwise, the simplex and the interior point relax the tight FREE rows, whose
    relaxation is the strongest we have (CPU + H200 costs, two devices, 50 %: 18.54 against
    the hazard rows' 17.73 ms on vgg16, 21.15 against 20.87 ms on resnet18), and PDLP
    relaxes the hazard rows, on which it converges faster (resnet50 after 570 s on one CPU:
    47.73 ms with the hazard rows, 42.73 ms with the tight ones). ``None`` when the LP is
    not solved within ``options.time_limit_s`` or a node cannot run on any device.

    ``method="ipm"`` solves the relaxation by interior point without crossover and takes the
    bound from the solver's row multipliers through
    :meth:`~xengine.solvers.model.MilpModel.dual_bound`, which holds for any multipliers, so
    the bound is proven although the interior point is only accurate to its tolerance (it
    lands within 1e-7 of the simplex optimum on resnet18). ``method="simplex"`` returns the
    simplex optimum (HiGHS's objective at its tolerances). ``method="pdlp"`` runs OR-Tools'
    first-order PDLP (:mod:`xengine.solvers.pdlp`) and bounds from its last dual iterate, so
    it returns a proven bound even when stopped by the time limit, weaker the earlier it
    stops. ``auto`` (default) takes the interior point from :data:`IPM_FROM_VARS` variables
    and PDLP from :data:`PDLP_FROM_VARS`. Measured side by side
    (``experiments/lp_bound_speed.py``, CPU + H200 costs, two devices, 50 %, one thread) on
    the tight rows: the interior point is 1.8x faster on vgg16 (36k variables: 6.4 against
    11.3 s), the simplex 1.4x faster on resnet18 (111k: 30 against 43 s), so neither wins
    everywhere; on resnet50 (705k) only PDLP gives a bound within 600 s.
    """
    options = options or SolverOptions()
    if method not in LP_METHODS:
        raise ValueError(f"method must be one of {', '.join(LP_METHODS)}, not {method!r}")
    build_options = dict(build_options or {})
    chosen = "free_rows" in build_options
    if not chosen:
        build_options["free_rows"] = "hazard" if method == "pdlp" else "tight"
    form = builder(inst, mode="exact", **build_options)
    if form.blocked is not None:
        return None
    if method == "auto":
        n = form.model.n_vars  # the same for both FREE-row forms
        method = "pdlp" if n >= PDLP_FROM_VARS else "ipm" if n >= IPM_FROM_VARS else "simplex"
        if method == "pdlp" and not chosen:
            form = builder(inst, mode="exact", **{**build_options, "free_rows": "hazard"})
    if method == "pdlp":
        from xengine.solvers.pdlp import pdlp_row_duals

        y, _, _ = pdlp_row_duals(form.model, options.time_limit_s, options.threads)
        bound = form.model.dual_bound(y)
        return float(bound) * form.time_scale if np.isfinite(bound) else None
    relax = SolverOptions(
        time_limit_s=options.time_limit_s,
        threads=options.threads,
        seed=options.seed,
        relax=True,
        lp_method=method,
    )
    sr = solve(form.model, "highs", relax)
    if method == "ipm":
        if sr.row_dual is None:
            return None
        bound = form.model.dual_bound(sr.row_dual)
        return float(bound) * form.time_scale if np.isfinite(bound) else None
    if sr.status != "optimal" or sr.objective is None:
        return None
    return float(sr.objective) * form.time_scale


def once_bound_s(inst: Instance) -> float | None:
    """Every op runs at least once, each at its fastest device's cost: a bound for every
    schedule of ``inst`` (copies only add), ready at once; None if some cost is negative
    (running such an op again would save time). It is keep-everything's time on one device
    and cannot see the recomputation that memory forces; it is what a solve reports when
    nothing stronger was proven in time (GPT-2 of 48 layers at 240 s, where the frontier
    relaxation's presolve outlasts its share)."""
    if (inst.compute_s < 0).any():
        return None
    return float(inst.compute_s.min(axis=0).sum())


def placement_bound_s(inst: Instance, options: SolverOptions | None = None) -> float | None:
    """Lower bound on any schedule's time from where nodes run and what must be copied.

    Every valid schedule (docs/design.md section 5, as :mod:`xengine.simulate` replays it) computes
    each node at least once, only on devices whose budget holds the node's inputs, output and
    workspace at once, and has the simulator's rule for reads: a node computed on device
    ``d`` reads each input from ``d`` if it is there, else (copyable edges only) copies it
    from another device, once per read. Let ``x[d, v] = 1`` when ``v`` is computed on ``d``
    at least once. A read of ``u`` on ``d`` where ``u`` is never computed on ``d`` needs a
    copy that costs at least the cheapest copy of ``u`` into ``d``; an autograd-state edge
    (not copyable) needs ``u`` computed on ``d``. So

        min  sum_{d,v} C[d, v] x[d, v] + sum_{(u,v) copyable, d} copy_min[d, u] y[e, d]
        s.t. sum_d x[d, v] >= 1;  y[e, d] >= x[d, v] - x[d, u];  x[d, u] >= x[d, v] (state)

    is at most any schedule's time: the schedule's own ``x`` and one ``y`` per read that
    copies are feasible here and cost no more. With one device it is the keep-all time.
    Returns the solver's proven bound on that MILP (not its incumbent), or ``None`` when a
    node fits no device or the MILP is not solved within ``options.time_limit_s``.
    """
    options = options or SolverOptions()
    g = inst.graph
    D, n = inst.n_devices, inst.size
    C = inst.compute_s
    footprint = np.stack([g.node_lower_bound_bytes(dv) for dv in inst.devices])
    can_run = footprint <= np.asarray(inst.budgets)[:, None]
    if not can_run.any(axis=0).all():
        return None
    if D == 1:
        return float(C[0].sum())
    CP = inst.copy_s  # (D, D, n), 0 on the diagonal
    off = ~np.eye(D, dtype=bool)
    copy_min = np.stack([CP[off[:, d], d].min(axis=0) for d in range(D)])  # (D, n)
    scale = float(np.mean(C[C > 0])) if (C > 0).any() else 1.0  # objective of order 1

    b = ModelBuilder(f"placement-bound-{g.name}")
    x = b.add_vars(D * n, 0.0, can_run.astype(float).ravel(), True).reshape(D, n)
    b.add_objective(x.ravel(), (C / scale).ravel())
    b.add_rows("once", n, np.tile(np.arange(n), D), x.ravel(), 1.0, 1.0, np.inf)
    src = np.array([e.src for e in g.edges], dtype=np.int64)
    dst = np.array([e.dst for e in g.edges], dtype=np.int64)
    copyable = np.array([e.copyable for e in g.edges], dtype=bool)
    for d in range(D):
        ok = copyable & np.isfinite(copy_min[d, src])
        k = int(ok.sum())
        if k:  # x[d, v] - x[d, u] - y <= 0, y >= 0 continuous (integral at the optimum)
            y = b.add_vars(k, 0.0, 1.0, False)
            b.add_objective(y, copy_min[d, src[ok]] / scale)
            r = np.arange(k)
            b.add_rows(
                f"copy_{d}",
                k,
                np.concatenate([r, r, r]),
                np.concatenate([x[d, dst[ok]], x[d, src[ok]], y]),
                np.concatenate([np.ones(k), -np.ones(k), -np.ones(k)]),
                -np.inf,
                0.0,
            )
        m = int((~ok).sum())
        if m:  # x[d, v] - x[d, u] <= 0
            r = np.arange(m)
            b.add_rows(
                f"local_{d}",
                m,
                np.concatenate([r, r]),
                np.concatenate([x[d, dst[~ok]], x[d, src[~ok]]]),
                np.concatenate([np.ones(m), -np.ones(m)]),
                -np.inf,
                0.0,
            )
    opts = SolverOptions(
        time_limit_s=options.time_limit_s, rel_gap=1e-9, threads=1, seed=options.seed
    )
    sr = solve(b.build(), "highs", opts)
    if sr.best_bound is None or sr.status not in SOLUTION_STATUSES:
        return None
    return max(float(sr.best_bound), 0.0) * scale


def cpu_split() -> tuple[set[int], set[int]]:
    """(CPUs for a bound computed alongside a search, CPUs for the search): the last CPU this
    process may use for the bound, the others for the search; both all of them when there is
    only one."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return set(cpus), set(cpus)
    return {cpus[-1]}, set(cpus[:-1])


@contextlib.contextmanager
def pinned(cpus: set[int]) -> Iterator[None]:
    """Run the calling thread, and the threads it starts, on ``cpus`` only (Linux; elsewhere a
    no-op). Solvers start their worker threads inside ``solve``, so those inherit it."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _pin_process(cpus: set[int]) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


class LpBoundAlongside:
    """:func:`lp_bound_s` in a process of its own, running while the caller searches.

    Why: on resnet50 with two devices the only memory-aware bound within minutes is PDLP's,
    and it needs the whole time limit; so does CP-SAT's search for the schedule. Run one after
    the other, each gets half. Here the bound runs on one CPU of its own (:func:`cpu_split`;
    the caller pins its search to the others with :func:`pinned`), and ``result()`` waits for
    it. The process is started with ``spawn``: forking a process that already runs solver
    threads is unsafe.
    """

    def __init__(
        self,
        inst: Instance,
        options: SolverOptions,
        build_options: dict | None = None,
        method: str = "auto",
        cpus: set[int] | None = None,
    ) -> None:
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_pin_process,
            initargs=(cpus if cpus is not None else cpu_split()[0],),
        )
        one_thread = SolverOptions(time_limit_s=options.time_limit_s, threads=1, seed=options.seed)
        self._future: Future = self._pool.submit(
            lp_bound_s, inst, one_thread, build_options, method
        )

    def result(self) -> float | None:
        """The bound (None as :func:`lp_bound_s` says); waits for the process to finish. A
        bound process that failed (killed for memory, say) gives None with a warning: the
        search's schedule stands without it."""
        try:
            return self._future.result()
        except Exception as exc:  # BrokenProcessPool, or an error inside lp_bound_s
            log.warning("the LP bound computed alongside failed: %s", exc)
            return None
        finally:
            self._pool.shutdown(wait=True)

    def cancel(self) -> None:
        """Stop the bound's process now (the caller's search failed or was interrupted)."""
        for proc in list(getattr(self._pool, "_processes", {}).values()):
            proc.terminate()
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = [
    "IPM_FROM_VARS",
    "LP_METHODS",
    "PDLP_FROM_VARS",
    "LpBoundAlongside",
    "cpu_split",
    "lp_bound_s",
    "pinned",
    "placement_bound_s",
]
