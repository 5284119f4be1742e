"""Solver benchmark (issue 5): formulations and back-ends side by side on a fixed suite.

Every (instance, solver, formulation) is solved through
:func:`xengine.strategies.solve.solve_xengine`
with the same options in the same run, so the published form (``reference``: full T x n
matrices, stage fixings as rows, hazard-count FREE rows over every (t, e), no reductions) and
the faster forms are compared as measured ratios. Each row records the model size, build time,
time to the first incumbent, solve time, status, gap and bound, the model's objective and the
simulator's time for the returned schedule (they must agree:
:func:`xengine.strategies.solve.agree`), and
the LP-relaxation bound of the same model. When two formulations of one instance disagree on
the optimum (or a schedule disagrees with its objective) a ``bug`` row says so.

Suites:
  quick  synthetic chains (16, 32 layers) and a residual DAG (16 layers) at one and two
         devices, budgets 90/70/50 % of keep-everything and the smallest feasible one.
  full   quick plus captured torchvision training graphs (vgg16, resnet18, mobilenet_v2,
         resnet50) through xengine.graph.capture / xengine.profile (see ``--costs``).

Usage:
  .venv/bin/python experiments/solver_benchmark.py --suite quick --time-limit-s 60 \\
      --solvers highs --formulations default,reference
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from baselines.heuristics import best_fitting, run_heuristics  # noqa: E402
from baselines.lp_rounding import solve_lp_rounding  # noqa: E402
from experiments import common  # noqa: E402
from experiments.formulation_variants import (  # noqa: E402
    build_published,
    build_symmetry_broken,
)
from xengine.checkpoints import min_feasible_budget_bytes  # noqa: E402
from xengine.graph.synthetic import training_graph  # noqa: E402
from xengine.graph.types import CopyModel, Graph  # noqa: E402
from xengine.problem import Instance  # noqa: E402
from xengine.protocol import warm_start  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402
from xengine.schedule import Schedule  # noqa: E402
from xengine.simulate import keep_all_peak_bytes  # noqa: E402
from xengine.solvers import SolverOptions, SolverUnavailable  # noqa: E402
from xengine.strategies.bounds import lp_bound_s, placement_bound_s  # noqa: E402
from xengine.strategies.coarsen import coarsen, solve_coarse  # noqa: E402
from xengine.strategies.formulation import build  # noqa: E402
from xengine.strategies.solve import agree, solve_xengine  # noqa: E402

log = logging.getLogger("solver_benchmark")

FORMULATIONS: dict[str, dict] = {
    "default": {},
    "milp_only": {},
    "reference": {"free_rows": "hazard"},
    "hazard": {"free_rows": "hazard"},
    "symmetry": {},
    "intervals": {},
    "coarse2": {},
    "coarse3": {},
}
"""Name -> keyword arguments of the formulation's builder (:data:`VARIANTS`, else
:func:`xengine.strategies.formulation.build`). ``default`` is what
:func:`xengine.strategies.solve.solve_xengine` builds for the solver (the tight FREE rows on the
MILP solvers), with the frontier relaxation first over several devices; ``milp_only`` the
same MILP without it (``frontier=False``, as before the relaxation; every other MILP form also
runs without it); ``hazard`` is the same reduced model with Checkmate's hazard-count FREE rows, the
default before they were measured here; ``reference`` the published form. ``intervals`` is the
retention-interval model of :mod:`xengine.strategies.intervals`; it always runs on CP-SAT (its rows
say
``solver=cpsat``) and is compared with the MILP rows of the same instance. ``coarse<k>`` is
the default MILP on the coarsened graph (:mod:`xengine.strategies.coarsen`, runs of up to ``k`` ops
fused), its schedule expanded to the fine graph: its row's objective is the fine simulated
time (an upper bound on the fine optimum, never a bound below it) and its model figures are
the coarse model's."""
VARIANTS = {"reference": build_published, "symmetry": build_symmetry_broken}
"""Formulations built by the experiments' own builders (``experiments/formulation_variants.py``)
instead of ``build``: ``reference`` is the published form, ``symmetry`` the default model in
which the first of two twin devices starts."""
COARSE = {"coarse2": 2, "coarse3": 3}

BUDGETS = (("90%", 0.9), ("70%", 0.7), ("50%", 0.5), ("min", None))
NETS = ("vgg16", "resnet18", "mobilenet_v2", "resnet50")
DEVICES_2 = ("a", "b")
REL_TOL = 1e-6

FIELDS = [
    "suite",
    "graph",
    "n_nodes",
    "n_edges",
    "n_devices",
    "budget",
    "budget_bytes",
    "solver",
    "formulation",
    "repeat",
    "n_vars",
    "n_integer",
    "n_rows",
    "nnz",
    "build_s",
    "status",
    "time_to_first_s",
    "solve_s",
    "total_s",
    "objective_s",
    "sim_time_s",
    "agree",
    "best_bound_s",
    "gap",
    "time_to_gap_5pct_s",
    "time_to_gap_1pct_s",
    "time_to_gap_0p5pct_s",
    "time_to_gap_0p1pct_s",
    "lp_bound_s",
    "placement_bound_s",
    "warm_start",
    "warm_start_s",
    "warm_start_time_s",
    "rounding_s",
    "rounding_time_s",
    "rounding_excess",
    "time_limit_s",
    "note",
]

GAP_LEVELS = {"5pct": 0.05, "1pct": 0.01, "0p5pct": 0.005, "0p1pct": 0.001}
"""``time_to_gap_<name>_s``: seconds of solving until the solver's own bound proved its
incumbent within this relative gap (empty: never within the time limit)."""
TRACE_FIELDS = ["graph", "n_devices", "budget", "solver", "formulation", "repeat"]
TRACE_FIELDS += ["elapsed_s", "incumbent_s", "bound_s", "gap"]


@dataclass(frozen=True)
class Case:
    suite: str
    graph: Graph
    devices: tuple[str, ...]


# ----------------------------------------------------------------------------- graphs
def synthetic(kind: str, n_layers: int, seed: int = 0) -> Graph:
    """A training graph with two heterogeneous devices ``a`` and ``b``.

    ``kind`` chain: layer i feeds i+1; residual: plus a skip i -> i+2 for every even i (the
    shape of ResNet blocks). Bytes are 1-4 kB, device ``a`` costs 0.5-2 s per layer and
    device ``b`` 0.25-3x that (each device is the faster one on some layers); a copy costs
    50 ms + bytes / 1 MB/s, so splitting the graph pays off only on some layers.
    """
    r = np.random.default_rng(seed)
    edges = [(i, i + 1) for i in range(n_layers - 1)]
    if kind == "residual":
        edges += [(i, i + 2) for i in range(0, n_layers - 2, 2)]
    elif kind != "chain":
        raise ValueError(f"unknown synthetic graph kind {kind!r}")
    cost_a = np.round(r.uniform(0.5, 2.0, n_layers), 3)
    cost_b = np.round(cost_a * r.uniform(0.25, 3.0, n_layers), 3)
    cm = CopyModel(0.05, 1e6)
    return training_graph(
        f"{kind}{n_layers}",
        edges,
        n_layers,
        list(r.integers(1, 5, n_layers) * 1000),
        {"a": list(cost_a), "b": list(cost_b)},
        saves_input=True,
        copy_models={("a", "b"): cm, ("b", "a"): cm},
    )


def net_graph(net: str, batch_size: int, costs: str, graph_dir: Path | None = None) -> Graph:
    """A captured torchvision training graph with costs for devices ``a`` and ``b``.

    ``costs=h200``: the shipped measurement of a real CPU + GPU pair
    (``results/profiles/**/<net>-b<batch>-cpu+cuda.graph.json``, made by
    ``experiments/device_profiles.py``): ``a`` is that machine's 16-thread CPU, ``b`` its
    NVIDIA H200, with the measured copy links; nothing is measured here, so every machine
    solves the same instances (``graph_dir`` picks another folder of such files: the
    version-1 graphs of the measurements before issue 15 are in
    ``results/solver_benchmark/instances_v1``). ``costs=profile``: measured CPU times
    (``xengine.profile``, cached under results/cache) for ``a``; ``b`` is a synthetic device
    4x faster with a 10 GB/s, 20 us link. ``costs=bytes``: time proportional to each node's
    output bytes (1 GB/s on ``a``), no measurement at all.
    """
    if costs == "h200":
        from xengine.graph.io import load_graph

        name = f"{net}-b{batch_size}-cpu+cuda.graph.json"
        found = sorted(Path(graph_dir or ROOT / "results" / "profiles").rglob(name))
        if not found:
            raise FileNotFoundError(
                f"results/profiles/**/{name} is not shipped: experiments/device_profiles.py "
                f"--nets {net}:{batch_size} on a CUDA machine makes it"
            )
        g = load_graph(found[0])
        return g.with_costs(
            {
                "a": {v.name: float(v.cost_s["cpu"]) for v in g.nodes},
                "b": {v.name: float(v.cost_s["cuda"]) for v in g.nodes},
            },
            {
                ("a", "b"): g.copy_models[("cpu", "cuda")],
                ("b", "a"): g.copy_models[("cuda", "cpu")],
            },
        )
    from xengine.profile.workspace import capture_net

    cap = capture_net(net, batch_size=batch_size)
    g = cap.graph
    if costs == "profile":
        from xengine.profile.profiler import apply_profile, profile_model

        g = apply_profile(g, profile_model(cap, ("cpu",), progress=False))
        base = {v.name: float(v.cost_s["cpu"]) for v in g.nodes}
    elif costs == "bytes":
        base = {v.name: max(float(v.output_bytes), 1.0) / 1e9 for v in g.nodes}
    else:
        raise ValueError(f"unknown --costs {costs!r}")
    cm = CopyModel(20e-6, 10e9)
    return g.with_costs(
        {"a": base, "b": {k: c / 4 for k, c in base.items()}},
        {("a", "b"): cm, ("b", "a"): cm},
    )


def twin_graph(g: Graph) -> Graph:
    """``g`` with device ``a2``: a copy of ``a`` (same costs, the same link both ways), for
    the symmetry-breaking rows (``--twins``)."""
    cm = g.copy_models[("a", "b")]
    return g.with_costs(
        {"a2": {v.name: float(v.cost_s["a"]) for v in g.nodes}}, {("a", "a2"): cm, ("a2", "a"): cm}
    )


QUICK_BUDGETS = {"residual16": ("90%", "70%", "50%"), "chain32": ("90%", "70%", "50%")}
"""The quick suite runs the smallest budget on chain16 only: at that budget every graph here
runs into the time limit (chain16 included), which the full suite covers; this keeps the quick
suite under five minutes at a 30 s limit with two formulations."""


def suite_cases(
    suite: str, batch_size: int, costs: str, graph_dir: Path | None = None
) -> list[Case]:
    graphs = [synthetic("chain", 16), synthetic("residual", 16), synthetic("chain", 32)]
    cases = [Case("quick", g, devs) for g in graphs for devs in (("a",), DEVICES_2)]
    if suite == "full":
        cases = [Case("full", c.graph, c.devices) for c in cases]
        for g in (synthetic("chain", 64),):
            cases += [Case("full", g, devs) for devs in (("a",), DEVICES_2)]
        for net in NETS:
            try:
                g = net_graph(net, batch_size, costs, graph_dir)
            except Exception as exc:  # the capture/profile modules are optional here
                log.error("skipping %s: capture/profile failed: %s", net, exc)
                continue
            cases += [Case("full", g, devs) for devs in (("a",), DEVICES_2)]
    elif suite != "quick":
        raise ValueError(f"unknown suite {suite!r}")
    return cases


def budgets_for(g: Graph, asked: set[str] = frozenset()) -> list[tuple[str, int]]:
    """The suite's budgets, and any other percentage of keep-everything ``asked`` names
    (``--budgets 55%``)."""
    peak = keep_all_peak_bytes(g)
    fractions = [(label, frac) for label, frac in BUDGETS if frac is not None]
    named = {label for label, _ in BUDGETS}
    for label in sorted(asked - named):
        if label.endswith("%") and label[:-1].replace(".", "", 1).isdigit():
            fractions.append((label, float(label[:-1]) / 100))
    out = [(label, int(frac * peak)) for label, frac in fractions]
    lower, known = min_feasible_budget_bytes(g)
    # the smallest budget known to fit one device (== the smallest feasible when lower == known)
    out.append(("min" if lower >= known else "min_known", int(known)))
    return out


# ----------------------------------------------------------------------------- solving
def warm_schedule(inst: Instance):
    """The best single-device heuristic schedule that fits, embedded in the device mix."""
    best = None
    for d in range(inst.n_devices):
        single = inst.only_device(d, inst.budget_bytes[d])
        res = best_fitting(run_heuristics(single))
        if res is not None and (best is None or res.sim.time_s < best.sim.time_s):
            best = res
    return best


_LP_BOUNDS: dict[tuple, float | None] = {}


def _lp_bound_once(
    inst: Instance, options: SolverOptions, bopts: dict, formulation: str
) -> float | None:
    """:func:`lp_bound_s` of one written form of one instance (its builder for
    :data:`VARIANTS`), solved once per run: the default and coarse rows share the default
    model's relaxation. (A graph's name stands for the graph: within one run each name is
    one graph with one set of costs.)"""
    variant = VARIANTS.get(formulation)
    key = (
        inst.graph.name,
        inst.graph.size,
        inst.devices,
        inst.budget_bytes,
        tuple(sorted(bopts.items())),
        None if variant is None else formulation,
        options.time_limit_s,
    )
    if key not in _LP_BOUNDS:
        if variant is None:
            _LP_BOUNDS[key] = lp_bound_s(inst, options, bopts)
        else:
            _LP_BOUNDS[key] = lp_bound_s(inst, options, bopts, builder=variant)
    return _LP_BOUNDS[key]


def starting_schedule(
    inst: Instance, warm: str, solver: str, options: SolverOptions, mode: str
) -> tuple[Schedule | None, str, float | None]:
    """(schedule, label, simulated time) of the best start of kind ``warm`` for ``inst``.

    ``heuristic``: the best one-device heuristic schedule that fits its own device's budget (no
    solver); ``spread``: also the protocol's warm start (:func:`xengine.protocol.warm_start`,
    the one ``run.py`` uses), with the best heuristic on each device alone with the total
    memory standing in for the protocol's single-device rows."""
    x0, label, t0_s = None, "", None
    ws = warm_schedule(inst)
    if ws is not None:
        x0, label, t0_s = ws.schedule.on_devices(inst.devices), ws.strategy, ws.sim.time_s
    if warm == "spread" and inst.n_devices > 1:
        total = int(sum(inst.budget_bytes))
        alone = [
            best_fitting(run_heuristics(inst.only_device(d, total))) for d in range(inst.n_devices)
        ]
        start = warm_start(inst, [r for r in alone if r is not None], solver, options, mode)
        if start is not None and (x0 is None or start[2] < t0_s):
            label, x0, t0_s = start
    return x0, label, t0_s


def coarse_start_schedule(
    inst: Instance, max_group: int, options: SolverOptions
) -> tuple[Schedule | None, str, float | None]:
    """The default MILP (HiGHS) on the coarsened graph, from its own spread start, for a
    quarter of the time limit; its expansion is a start for the fine model. (None, "", None)
    when the coarse model has no schedule (its fused nodes need more memory)."""
    c = coarsen(inst.graph, max_group)
    c_inst = c.instance(inst)
    quarter = replace(
        options,
        time_limit_s=None if options.time_limit_s is None else options.time_limit_s / 4,
        threads=1,
    )
    x0, _, _ = starting_schedule(c_inst, "spread", "highs", quarter, "exact")
    res = solve_coarse(inst, c, solver="highs", options=quarter, warm_start=x0)
    if res.sim is None or not res.sim.within_budget:
        log.info("coarse start (max_group %d): none (%s)", max_group, res.message[:120])
        return None, "", None
    log.info("coarse start (max_group %d): %.6g s", max_group, res.sim.time_s)
    return res.schedule, f"coarse{max_group} MILP, expanded", res.sim.time_s


def running_gap(trace: list[tuple]):
    """Yield (elapsed_s, best incumbent so far, best bound so far, relative gap or None) for
    each point of ``trace`` ([(elapsed_s, incumbent or None, bound or None)], as
    :func:`xengine.strategies.solve.solve_xengine` records it); inf / -inf while there is none."""
    best_inc, best_bound = np.inf, -np.inf
    for el, inc, bound in trace:
        if inc is not None:
            best_inc = min(best_inc, inc)
        if bound is not None:
            best_bound = max(best_bound, bound)
        ok = np.isfinite(best_inc) and np.isfinite(best_bound) and best_inc > 0
        yield el, best_inc, best_bound, (best_inc - best_bound) / best_inc if ok else None


def time_to_gap_s(trace: list[tuple], level: float) -> float | None:
    """First elapsed time at which the best incumbent so far was within ``level`` (relative)
    of the best bound so far; None if it never was."""
    for el, _, _, gap in running_gap(trace):
        if gap is not None and gap <= level + 1e-12:
            return float(el)
    return None


def run_one(
    case: Case,
    budget: tuple[str, int],
    solver: str,
    formulation: str,
    options: SolverOptions,
    warm: str,
    with_lp: bool,
    repeat: int,
    with_rounding: bool = False,
    coarse_start: int = 0,
    lp_alongside: bool = False,
) -> dict:
    g = case.graph
    inst = Instance(g, case.devices, tuple([budget[1]] * len(case.devices)))
    bopts = FORMULATIONS[formulation]
    mode = "intervals" if formulation == "intervals" else "exact"
    if mode == "intervals":
        solver = "cpsat"
    row = {
        "suite": case.suite,
        "graph": g.name,
        "n_nodes": g.size,
        "n_edges": len(g.edges),
        "n_devices": len(case.devices),
        "budget": budget[0],
        "budget_bytes": budget[1],
        "solver": solver,
        "formulation": formulation,
        "repeat": repeat,
        "time_limit_s": options.time_limit_s,
        "warm_start": "",
        "note": "",
    }
    coarsening = None
    solve_inst = inst  # the instance the solver sees (warm starts are built for it)
    if formulation in COARSE:
        coarsening = coarsen(g, COARSE[formulation])
        solve_inst = coarsening.instance(inst)
    x0 = None
    if warm != "none":
        t_ws = time.perf_counter()
        x0, row["warm_start"], row["warm_start_s"] = starting_schedule(
            solve_inst, warm, solver, options, mode
        )
        if coarse_start and coarsening is None:
            sched, label, t_s = coarse_start_schedule(inst, coarse_start, options)
            if sched is not None and (x0 is None or t_s < row["warm_start_s"]):
                x0, row["warm_start"], row["warm_start_s"] = sched, label, t_s
        row["warm_start_time_s"] = time.perf_counter() - t_ws
    t0 = time.perf_counter()
    try:
        if coarsening is not None:
            res = solve_coarse(
                inst, coarsening, solver=solver, formulation=mode, options=options, warm_start=x0
            )
        else:
            if mode == "intervals" and (lp_alongside or not with_lp):
                bopts = {**bopts, "lp_bound": "alongside" if lp_alongside else False}
            res = solve_xengine(
                inst,
                solver=solver,
                formulation=mode,
                options=options,
                warm_start=x0,
                build_options=bopts,
                builder=VARIANTS.get(formulation, build),
                frontier=formulation == "default",
            )
    except SolverUnavailable as exc:
        row.update(status="unavailable", note=str(exc).splitlines()[0])
        return row
    row["total_s"] = time.perf_counter() - t0
    row.update(
        n_vars=res.n_vars,
        n_integer=res.n_integer,
        n_rows=res.n_rows,
        nnz=res.nnz,
        build_s=res.build_time_s,
        status=res.status,
        time_to_first_s=res.time_to_first_s,
        solve_s=res.solve_time_s,
        objective_s=res.objective_s,
        sim_time_s=res.sim.time_s if res.sim is not None else None,
        best_bound_s=res.best_bound_s,
        gap=res.gap,
    )
    trace = res.trace
    if trace and coarsening is None and mode == "exact":
        row["trace"] = trace
        for name, level in GAP_LEVELS.items():
            row[f"time_to_gap_{name}_s"] = time_to_gap_s(trace, level)
    if res.status in ("infeasible", "no_solution") and res.message:
        row["note"] = res.message[:200]
    if coarsening is not None:
        # the number a coarse solve reports is its expansion's fine simulated time; the coarse
        # model must still agree with the coarse simulator
        coarse = res.coarse
        cobj = None if coarse is None else coarse.objective_s
        csim = None if coarse is None else coarse.sim_time_s
        row["objective_s"] = None if res.sim is None else res.sim.time_s
        row["best_bound_s"] = row["gap"] = None
        if cobj is not None and csim is not None:
            ok = abs(cobj - csim) <= REL_TOL * max(1.0, abs(csim))
            row["agree"] = ok
            note = f"{coarse.nodes} coarse nodes, coarse objective {cobj:.6g} s"
            row["note"] = note if ok else f"BUG: coarse model {cobj:.9g} vs simulator {csim:.9g}"
        if res.status == "error":  # the expansion was refused by the fine simulator
            row["note"] = f"BUG: {res.message[:200]}"
    elif res.sim is not None and res.nothing_to_solve:
        # the start met the placement bound: no model was built, nothing to hold to it
        row["note"] = res.message[:200]
    elif res.sim is not None and res.frontier is not None and res.model_peak_bytes is None:
        # the frontier relaxation settled it (no MILP built): its answer is a schedule the
        # simulator replayed, and the objective reported is that replay's time
        row["agree"] = res.objective_s == res.sim.time_s
        row["note"] = res.message[:200]
    elif res.sim is not None:
        ok = agree(res)
        row["agree"] = ok
        if not ok:
            row["note"] = (
                f"BUG: model objective {res.objective_s:.9g} / peak {res.model_peak_bytes} vs "
                f"simulator {res.sim.time_s:.9g} / {res.sim.peak_bytes}"
            )
            log.error("%s %s: %s", g.name, formulation, row["note"])
    elif res.status == "error":
        row["note"] = res.message[:200]
    if mode == "intervals":  # solved inside solve_intervals, its time is in solve_s
        row["lp_bound_s"] = res.lp_bound_s
    elif with_lp and res.status in ("optimal", "feasible", "no_solution"):
        row["lp_bound_s"] = _lp_bound_once(inst, options, bopts, formulation)
    if res.status in ("optimal", "feasible", "no_solution"):
        pb = res.placement_bound_s
        row["placement_bound_s"] = pb if pb is not None else placement_bound_s(inst, options)
    if with_rounding and inst.n_devices == 1 and res.status in ("optimal", "feasible"):
        # Checkmate's LP rounding on the same instance: how far from the (best known) optimum
        rr = solve_lp_rounding(inst, options=options)
        row["rounding_s"] = rr.solve_time_s
        if rr.has_schedule and rr.sim.within_budget:
            row["rounding_time_s"] = rr.sim.time_s
            row["rounding_excess"] = rr.sim.time_s / res.sim.time_s - 1
        else:
            row["rounding_excess"] = "no fit"
    log.info(
        "%s D=%d %s %s/%s: %s obj %s in %.2f s (build %.2f s, first %s)",
        g.name,
        len(case.devices),
        budget[0],
        solver,
        formulation,
        res.status,
        "-" if row["objective_s"] is None else f"{row['objective_s']:.6g}",
        res.solve_time_s,
        res.build_time_s,
        "-" if row["time_to_first_s"] is None else f"{row['time_to_first_s']:.2f} s",
    )
    return row


def _label(r: dict) -> str:
    return f"{r['solver']}/{r['formulation']}"


def cross_check(rows: list[dict], rel_gap: float = 0.0) -> list[dict]:
    """Bug rows for formulations of one instance whose optima disagree."""
    bugs = []
    key = ("graph", "n_devices", "budget", "repeat")  # every solver and formulation
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), []).append(r)
    for k, rs in groups.items():
        opt = [r for r in rs if r["status"] == "optimal"]
        inc = [r for r in rs if r.get("objective_s") is not None]
        statuses = {r["status"] for r in rs}
        msgs = []
        if opt:
            best = min(r["objective_s"] for r in opt)
            worst = max(r["objective_s"] for r in opt)
            # "optimal" means within the solvers' relative gap of the optimum, so two proven
            # optima may differ by that much
            if worst - best > max(REL_TOL, rel_gap) * max(1.0, abs(best)):
                msgs.append(
                    "optima differ: "
                    + ", ".join(f"{_label(r)}={r['objective_s']:.9g}" for r in opt)
                )
            tol = max(REL_TOL, rel_gap) * max(1.0, abs(best))
            below = [r for r in inc if r["objective_s"] < best - tol]
            if below:
                msgs.append(
                    "incumbent below a proven optimum: "
                    + ", ".join(f"{_label(r)}={r['objective_s']:.9g}" for r in below)
                )
        if "infeasible" in statuses and inc:
            msgs.append("one formulation proves infeasible while another has a schedule")
        for m in msgs:
            log.error("BUG %s: %s", k, m)
            bug = {f: "" for f in FIELDS}
            bug.update(dict(zip(key, k, strict=True)))
            bug.update(solver="*", formulation="*", status="bug", note=m, suite=rs[0]["suite"])
            bugs.append(bug)
    return bugs


# ----------------------------------------------------------------------------- output
def write_csv(rows: list[dict], path: Path) -> None:
    common.write_csv(path, rows, FIELDS, only=True)


def write_traces(rows: list[dict], path: Path) -> int:
    """Every MILP row's gap over time (one line per report of the solver), for plotting and
    for time-to-gap figures at levels other than :data:`GAP_LEVELS`. Returns the line count."""
    n = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(TRACE_FIELDS)
        for r in rows:
            for el, best_inc, best_bound, gap in running_gap(r.get("trace") or ()):
                w.writerow(
                    [r[k] for k in TRACE_FIELDS[:6]]
                    + [
                        f"{el:.3f}",
                        "" if not np.isfinite(best_inc) else f"{best_inc:.9g}",
                        "" if not np.isfinite(best_bound) else f"{best_bound:.9g}",
                        "" if gap is None else f"{gap:.6g}",
                    ]
                )
                n += 1
    return n


def parse_cell(v: str):
    """A CSV cell as written: None, bool, int, float or the string."""
    if v == "":
        return None
    if v in ("True", "False"):
        return v == "True"
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def read_run(out: Path) -> list[dict]:
    """The rows an earlier run wrote to ``out`` (numbers parsed back), each MILP row with its
    trace from ``traces.csv``, so runs made side by side in separate processes (one per
    core) can be merged into one table and one set of figures (``--merge``)."""
    with (out / "solver_benchmark.csv").open() as fh:
        rows = [{k: parse_cell(v) for k, v in r.items()} for r in csv.DictReader(fh)]
    traces: dict[tuple, list[tuple]] = {}
    if (out / "traces.csv").exists():
        with (out / "traces.csv").open() as fh:
            for t in csv.DictReader(fh):
                t = {k: parse_cell(v) for k, v in t.items()}
                traces.setdefault(tuple(t[k] for k in TRACE_FIELDS[:6]), []).append(
                    (float(t["elapsed_s"]), t["incumbent_s"], t["bound_s"])
                )
    for r in rows:
        tr = traces.get(tuple(r[k] for k in TRACE_FIELDS[:6]))
        if tr:
            r["trace"] = tr
    return rows


def plot_gap_over_time(rows: list[dict], path: Path, min_solve_s: float = 10.0) -> bool:
    """The proven gap against solving time, one panel per instance whose slowest MILP row
    took at least ``min_solve_s`` (the six slowest instances), one line per formulation:
    where a faster form's curve crosses the reference's, "faster" depends on the gap asked
    for. Returns False (and writes nothing) when no instance qualifies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    by_inst: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("trace"):
            by_inst.setdefault((r["graph"], r["n_devices"], r["budget"]), []).append(r)
    slow = sorted(
        (max(float(r["solve_s"]) for r in rs), key)
        for key, rs in by_inst.items()
        if max(float(r["solve_s"]) for r in rs) >= min_solve_s
    )[-6:][::-1]
    if not slow:
        return False
    ncols = min(len(slow), 3)
    nrows = -(-len(slow) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.9 * nrows), squeeze=False)
    for ax in axes.flat[len(slow) :]:
        ax.set_visible(False)
    for ax, (_, key) in zip(axes.flat, slow, strict=False):
        for r in by_inst[key]:
            xs, ys = [], []
            for el, _, _, gap in running_gap(r["trace"]):
                if gap is not None:
                    xs.append(max(el, 0.1))
                    ys.append(max(100 * gap, 1e-3))
            if xs:
                label = f"{r['solver']} / {r['formulation']}"
                if len({x["repeat"] for x in by_inst[key]}) > 1:
                    label += f" #{r['repeat']}"
                ax.step(xs, ys, where="post", label=label)
        ax.axhline(0.1, color="grey", ls=":", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        # plain seconds at 1, 2, 5 x 10^k: these panels often span less than a decade
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("solving time (s)")
        ax.set_ylabel("proven gap (%)")
        ax.set_title(f"{key[0]}, {key[1]} device(s), {key[2]}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("proven gap over time (dotted: 0.1 %)", fontsize=10)
    save_figure(fig, path)
    return True


def plot(rows: list[dict], path: Path, time_limit_s: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    solved = [r for r in rows if r["status"] in ("optimal", "feasible", "no_solution")]
    fig, (ax_t, ax_g) = plt.subplots(1, 2, figsize=(12, 4.8))
    markers = {"default": "o", "reference": "s", "hazard": "^", "intervals": "D", "symmetry": "v"}
    combos = sorted({(r["solver"], r["formulation"]) for r in solved})
    for i, (solver, form) in enumerate(combos):
        rs = [r for r in solved if r["solver"] == solver and r["formulation"] == form]
        # x: nodes x devices (the model grows with both); small jitter per combo
        x = np.array([r["n_nodes"] * r["n_devices"] for r in rs], dtype=float)
        x = x * (1 + 0.08 * (i - (len(combos) - 1) / 2))
        y = np.array([max(float(r["solve_s"]), 1e-3) for r in rs])
        gaps = [r.get("gap") for r in rs]
        label = f"{solver} / {form}"
        ax_t.scatter(x, y, marker=markers.get(form, "x"), label=label, alpha=0.75)
        ax_g.scatter(
            x,
            [100 * (g if g not in (None, "") else np.nan) for g in gaps],
            marker=markers.get(form, "x"),
            label=label,
            alpha=0.75,
        )
        for xi, yi, r in zip(x, y, rs, strict=True):
            if r["status"] != "optimal":
                txt = "none" if r.get("gap") in (None, "") else f"{100 * r['gap']:.1f}%"
                ax_t.annotate(txt, (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if time_limit_s:
        ax_t.axhline(time_limit_s, color="grey", ls="--", lw=0.8, label="time limit")
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_xlabel("nodes x devices")
    ax_t.set_ylabel("solve time (s)")
    ax_t.set_title("time to optimal (annotated: gap at the limit)")
    ax_g.set_xscale("log")
    ax_g.set_xlabel("nodes x devices")
    ax_g.set_ylabel("gap at the end (%)")
    ax_g.set_title("gap")
    ax_t.legend(fontsize=7)
    save_figure(fig, path)


def plot_coarsening(rows: list[dict], path: Path) -> bool:
    """What coarsening costs and saves: per instance, the coarse row's schedule time over the
    ``default`` row's (fine MILP, same solver and limit) against their solve-time ratio.
    Returns False (and writes nothing) when the run has no coarse rows with a default row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = ("graph", "n_devices", "budget", "solver", "repeat")
    base = {
        tuple(r[k] for k in key): r
        for r in rows
        if r["formulation"] == "default" and r.get("objective_s") not in (None, "")
    }
    pts: dict[str, list[tuple[float, float, str]]] = {}
    for r in rows:
        b = base.get(tuple(r[k] for k in key))
        if r["formulation"] not in COARSE or b is None or r.get("objective_s") in (None, ""):
            continue
        excess = 100 * (float(r["objective_s"]) / float(b["objective_s"]) - 1)
        speed = float(r["solve_s"]) / max(float(b["solve_s"]), 1e-9)
        tag = f"{r['graph']} D{r['n_devices']} {r['budget']}"
        pts.setdefault(r["formulation"], []).append((speed, excess, tag))
    if not pts:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for form, ps in sorted(pts.items()):
        ax.scatter([p[0] for p in ps], [p[1] for p in ps], label=form, alpha=0.8)
        for sx, ex, tag in ps:
            ax.annotate(tag, (sx, ex), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.axhline(0, color="grey", lw=0.8)
    ax.axvline(1, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("solve time, coarse / fine default (log)")
    ax.set_ylabel("schedule time over the fine default's (%)")
    ax.set_title("Coarsening: expanded coarse schedule vs the fine MILP (same solver, limit)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True


def summary(rows: list[dict], formulations: list[str]) -> str:
    """Per instance: median solve time per (solver, formulation), status, and the ratio of
    each to the first column (``default`` when it runs). A coarse column's status is its
    schedule's time over the first column's, in percent."""
    rows = [r for r in rows if r["status"] not in ("bug", "unavailable")]
    milp_solvers = sorted({r["solver"] for r in rows if r["formulation"] != "intervals"})

    def col(r: dict) -> str:
        if r["formulation"] == "intervals" or len(milp_solvers) <= 1:
            return r["formulation"]
        return f"{r['solver']}/{r['formulation']}"

    order = {f: i for i, f in enumerate(formulations)}
    cols = sorted({col(r) for r in rows}, key=lambda c: (order.get(c.split("/")[-1], 99), c))
    base = next((c for c in cols if c.split("/")[-1] == "default"), cols[0] if cols else "")
    others = [c for c in cols if c != base]
    key = ("graph", "n_nodes", "n_devices", "budget")
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), {}).setdefault(col(r), []).append(r)
    head = ["graph", "n", "D", "budget"]
    for c in cols:
        head += [f"{c} s", f"{c} st"]
    head += [f"{c}/{base}" for c in others]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]

    def med(rs: list[dict]) -> float | None:
        ts = [float(r["solve_s"]) for r in rs if r.get("solve_s") not in (None, "")]
        return statistics.median(ts) if ts else None

    for k, by in groups.items():
        cells = [str(x) for x in k]
        meds = {}
        for c in cols:
            rs = by.get(c, [])
            meds[c] = med(rs)
            st = rs[0]["status"] if rs else "-"
            if st == "feasible" and rs[0].get("gap") not in (None, ""):
                st = f"gap {100 * rs[0]['gap']:.2f}%"
            base_obj = by.get(base, [{}])[0].get("objective_s")
            if rs and c.split("/")[-1] in COARSE and rs[0].get("objective_s") not in (None, ""):
                if base_obj not in (None, ""):  # what coarsening costs, against the base
                    st = f"{100 * (float(rs[0]['objective_s']) / float(base_obj) - 1):+.2f}%"
            cells += ["-" if meds[c] is None else f"{meds[c]:.2f}", st]
        for c in others:
            a, b = meds.get(c), meds.get(base)
            cells.append("-" if not a or not b else f"{a / b:.2f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("quick", "full"), default="quick")
    ap.add_argument("--time-limit-s", type=float, default=60.0)
    ap.add_argument(
        "--rel-gap",
        type=float,
        default=1e-4,
        help="relative gap at which a solve stops as optimal (1e-3: issue 5's 'proven optimal')",
    )
    ap.add_argument("--solvers", default="highs", help="comma-separated back-ends")
    ap.add_argument(
        "--formulations",
        default="default,reference,intervals",
        help=f"comma-separated, from {', '.join(FORMULATIONS)}",
    )
    ap.add_argument("--out", type=Path, default=Path("results/solver_benchmark"))
    ap.add_argument("--threads", type=int, default=1, help="MILP solvers' threads")
    ap.add_argument(
        "--cpsat-threads",
        type=int,
        default=2,
        help="CP-SAT workers for formulation 'intervals' (its portfolio needs more than one; "
        "this machine has two cores)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="solves per row (median reported)")
    ap.add_argument(
        "--warm-start",
        choices=("none", "heuristic", "spread"),
        default="none",
        help="heuristic: best one-device heuristic that fits; spread: also the one-device "
        "heuristics spread over the devices and the placed model "
        "(xengine.strategies.distribute), whose "
        "time (warm_start_time_s) is not in solve_s",
    )
    ap.add_argument(
        "--coarse-start",
        type=int,
        default=0,
        metavar="K",
        help="with --warm-start: also solve the graph coarsened to runs of up to K ops "
        "(HiGHS, a quarter of the time limit, its own spread start) and start the fine model "
        "from its expansion when that is faster (counted in warm_start_time_s)",
    )
    ap.add_argument(
        "--no-lp-bound",
        action="store_true",
        help="skip the LP-relaxation bound (the interval model's too: it then gets the whole "
        "time limit, with the placement bound only)",
    )
    ap.add_argument(
        "--lp-alongside",
        action="store_true",
        help="formulation 'intervals': compute the LP bound in a process of its own on one CPU "
        "for the whole time limit while CP-SAT searches on the others (PDLP on resnet50), "
        "instead of first, for half the limit",
    )
    ap.add_argument(
        "--rounding",
        action="store_true",
        help="one device: also run Checkmate's LP rounding (first formulation's rows) and "
        "record its time over the solver's schedule (rounding_excess; 'no fit' if none fits)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="solve nothing: merge the CSVs and traces of earlier runs (e.g. one formulation "
        "per core, run side by side) into --out, cross-check them and redraw the figures "
        "(give the --rel-gap the runs used: the cross-check allows that much)",
    )
    ap.add_argument("--graphs", default="", help="comma-separated graph names to keep")
    ap.add_argument("--devices", default="1,2", help="device counts to run: 1, 2 or 1,2")
    ap.add_argument(
        "--budgets",
        default="",
        help="budget labels to keep (90%%,70%%,50%%,min, or any other percentage: 55%%)",
    )
    ap.add_argument("--batch-size", type=int, default=8, help="full suite: nets' batch size")
    ap.add_argument(
        "--twins",
        action="store_true",
        help="two-device cases on two identical devices (a and a copy of it, a2) instead of "
        "a and b: where formulation 'symmetry' can act",
    )
    ap.add_argument(
        "--costs",
        choices=("profile", "h200", "bytes"),
        default="profile",
        help="nets' costs: measured CPU + a synthetic 4x device, the shipped CPU + H200 "
        "profiles, or output bytes (see net_graph)",
    )
    ap.add_argument(
        "--graph-dir",
        type=Path,
        default=None,
        help="--costs h200: folder of <net>-b<B>-cpu+cuda.graph.json files (default "
        "results/profiles; results/solver_benchmark/instances_v1 holds the version-1 graphs "
        "that the measurements before 2026-12-01 used)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in (
        "xengine.strategies.solve",
        "xengine.strategies.formulation",
        "baselines.checkmate",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)

    solvers = [s for s in args.solvers.split(",") if s]
    forms = [f for f in args.formulations.split(",") if f]
    bad = [f for f in forms if f not in FORMULATIONS]
    if bad:
        ap.error(f"unknown formulation(s) {bad}: choose from {list(FORMULATIONS)}")
    keep_graphs = {x for x in args.graphs.split(",") if x}
    keep_dev = {int(x) for x in args.devices.split(",") if x}
    keep_budgets = {x for x in args.budgets.split(",") if x}
    options = SolverOptions(
        time_limit_s=args.time_limit_s, rel_gap=args.rel_gap, threads=args.threads
    )
    cp_options = replace(options, threads=args.cpsat_threads)

    t_all = time.perf_counter()
    rows: list[dict] = []
    if args.merge:
        for d in args.merge:
            if not (d / "solver_benchmark.csv").exists():
                ap.error(f"--merge {d}: no solver_benchmark.csv there")
            rows += [r for r in read_run(d) if r["status"] != "bug"]
        forms = list(dict.fromkeys(r["formulation"] for r in rows))
    for case in (
        [] if args.merge else suite_cases(args.suite, args.batch_size, args.costs, args.graph_dir)
    ):
        if keep_graphs and case.graph.name not in keep_graphs:
            continue
        if len(case.devices) not in keep_dev:
            continue
        if args.twins and len(case.devices) == 2:
            case = Case(case.suite, twin_graph(case.graph), ("a", "a2"))
        for budget in budgets_for(case.graph, keep_budgets):
            if keep_budgets and budget[0] not in keep_budgets:
                continue
            quick_only = QUICK_BUDGETS.get(case.graph.name)
            if case.suite == "quick" and quick_only and budget[0] not in quick_only:
                continue
            for solver in solvers:
                for rep in range(args.repeats):
                    for form in forms:
                        rows.append(
                            run_one(
                                case,
                                budget,
                                solver,
                                form,
                                cp_options if form == "intervals" else options,
                                args.warm_start,
                                not args.no_lp_bound,
                                rep,
                                with_rounding=args.rounding and form == forms[0],
                                coarse_start=args.coarse_start,
                                lp_alongside=args.lp_alongside,
                            )
                        )
    rows += cross_check(rows, options.rel_gap)
    csv_path = args.out / "solver_benchmark.csv"
    write_csv(rows, csv_path)
    limit = args.time_limit_s
    if args.merge:
        limit = max((r["time_limit_s"] for r in rows if r.get("time_limit_s")), default=None)
    plot(rows, args.out / "solver_benchmark.png", limit)
    plot_coarsening(rows, args.out / "coarsening.png")
    write_traces(rows, args.out / "traces.csv")
    plot_gap_over_time(rows, args.out / "gap_over_time.png")
    log.info("%d rows in %.1f s -> %s", len(rows), time.perf_counter() - t_all, csv_path)
    print(summary(rows, forms))
    n_bug = sum(r["status"] == "bug" or str(r.get("note", "")).startswith("BUG") for r in rows)
    if n_bug:
        log.error("%d bug row(s): see %s", n_bug, csv_path)
    return 1 if n_bug else 0


if __name__ == "__main__":
    raise SystemExit(main())
