"""Every registered solver back-end on the same tiny problems with known optima.

The suite is parametrised over the registry (``xengine.solvers.SOLVERS``), so a new back-end
is tested as soon as it is registered; a back-end whose package is missing is skipped with the
reason. Back-ends that cannot take a kind of model must say so with SolverUnavailable.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import sys
from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp

from xengine.graph.synthetic import chain, training_graph
from xengine.graph.types import CopyModel
from xengine.problem import Instance
from xengine.simulate import keep_all_peak_bytes
from xengine.solvers import (
    QUADRATIC_CAPABLE,
    SOLVERS,
    SolverOptions,
    SolverUnavailable,
    solve,
)
from xengine.solvers.model import STATUSES, MilpModel
from xengine.strategies.formulation import build

NAMES = sorted(SOLVERS)
PACKAGES = {
    "highs": ["highspy"],
    "gurobi": ["gurobipy"],
    "scip": ["pyscipopt"],
    "cpsat": ["ortools"],
    "cvxpy": ["cvxpy", "highspy"],
    "cvxpy-scip": ["cvxpy", "pyscipopt"],
    "cvxpy-gurobi": ["cvxpy", "gurobipy"],
}
LINEAR_ONLY_MSG = "product"  # what a back-end without products must mention
TOL = 1e-6


def require(name: str) -> None:
    for pkg in PACKAGES.get(name, []):
        try:
            importlib.import_module(pkg)
        except ImportError:
            pytest.skip(f"solver={name} needs the {pkg!r} package, which is not installed")


def run(model: MilpModel, name: str, warm_start=None, progress=None, **opts):
    require(name)
    res = solve(model, name, SolverOptions(**opts), warm_start=warm_start, progress=progress)
    assert res.status in STATUSES
    assert res.solve_time_s >= 0
    if res.status in ("optimal", "feasible"):
        assert res.x is not None and res.x.shape == (model.n_vars,)
        check = (
            replace(model, integrality=np.zeros(model.n_vars, bool)) if opts.get("relax") else model
        )
        assert check.max_violation(res.x) <= 1e-5, res.message
        assert res.objective == pytest.approx(model.objective(res.x), rel=1e-7, abs=1e-7)
    else:
        assert res.x is None and res.objective is None
    return res


def milp(c, rows, row_lb, row_ub, lb, ub, integer, offset=0.0, q=None, name="t") -> MilpModel:
    A = sp.csr_matrix(np.asarray(rows, dtype=float))
    qi, qj, qv = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))
    if q:
        qi = np.array([t[0] for t in q], dtype=np.int64)
        qj = np.array([t[1] for t in q], dtype=np.int64)
        qv = np.array([t[2] for t in q], dtype=float)
    n = len(c)
    return MilpModel(
        c=np.asarray(c, dtype=float),
        A=A,
        row_lb=np.asarray(row_lb, dtype=float),
        row_ub=np.asarray(row_ub, dtype=float),
        lb=np.broadcast_to(np.asarray(lb, dtype=float), (n,)).copy(),
        ub=np.broadcast_to(np.asarray(ub, dtype=float), (n,)).copy(),
        integrality=np.broadcast_to(np.asarray(integer, dtype=bool), (n,)).copy(),
        offset=offset,
        q_i=qi,
        q_j=qj,
        q_val=qv,
        name=name,
    )


def brute_binary(model: MilpModel) -> float:
    """Optimum of an all-binary model by enumeration."""
    best = np.inf
    for bits in itertools.product((0.0, 1.0), repeat=model.n_vars):
        x = np.array(bits)
        if model.max_violation(x) <= 1e-9:
            best = min(best, model.objective(x))
    return best


# ---------------------------------------------------------------- canonical problems
INF = np.inf
VALUES = [10, 13, 7, 8, 9, 4]
WEIGHTS = [5, 6, 3, 4, 4, 2]


def knapsack() -> MilpModel:
    """Two rows (capacity 12, at most 3 items), offset 100: min 100 - value."""
    return milp(
        [-v for v in VALUES],
        [WEIGHTS, [1] * 6],
        [-INF, -INF],
        [12, 3],
        0,
        1,
        True,
        offset=100.0,
        name="knapsack",
    )


KNAPSACK_OPT = 100.0 - 26.0  # items 13 + 9 + 4 (weights 6 + 4 + 2) or 10 + 7 + 9


def lp() -> MilpModel:
    """min -x - y, x + 2y <= 4, 3x + y <= 6, x, y >= 0 (unbounded above): (1.6, 1.2), -2.8."""
    return milp([-1, -1], [[1, 2], [3, 1]], [-INF, -INF], [4, 6], 0, INF, False, name="lp")


def infeasible() -> MilpModel:
    """x + y >= 3 over binaries: infeasible already as an LP."""
    return milp([1, 1], [[1, 1]], [3], [INF], 0, 1, True, name="infeasible")


def integer_infeasible() -> MilpModel:
    """2x == 1 with x integer in [0, 5], y binary: LP-feasible, integer-infeasible."""
    return milp([1, 1], [[2, 0], [0, 1]], [1, 0], [1, 1], 0, [5, 1], True, name="int-infeasible")


def memory_like() -> MilpModel:
    """Binaries a, b, c with sizes 0.25/0.5/0.75; u1 = 0.25a + 0.5b, u2 = u1 + 0.75c (continuous,
    equality-defined like the formulation's U), u2 <= 1, ranged row 1 <= a+b+c <= 2;
    min -(3a + 4b + 5c) + 0.5 u2. Optimum a = c = 1: -8 + 0.5 = -7.5."""
    #       a      b     c    u1   u2
    rows = [
        [0.25, 0.5, 0, -1, 0],
        [0, 0, 0.75, 1, -1],
        [1, 1, 1, 0, 0],
    ]
    return milp(
        [-3, -4, -5, 0, 0.5],
        rows,
        [0, 0, 1],
        [0, 0, 2],
        [0, 0, 0, 0, 0],
        [1, 1, 1, 2, 1.0],
        [True, True, True, False, False],
        name="memory-like",
    )


MEMORY_LIKE_OPT = -7.5


def and_like() -> MilpModel:
    """Binaries r, z; continuous w in [0, 1] with w >= r + z - 1 (an AND, as the linearised
    paper model's W) and a non-integral cap w + 0.3 r <= 1.2; min 2w - 1.5r - 1.5z.
    Optimum: r = 1, z = 0 (or r = 0, z = 1), w = 0: -1.5."""
    return milp(
        [-1.5, -1.5, 2.0],
        [[-1, -1, 1], [0.3, 0, 1]],
        [-1, -INF],
        [INF, 1.2],
        0,
        1,
        [True, True, False],
        name="and-like",
    )


def half_and() -> MilpModel:
    """Binary r, continuous w in [0, 1] with w >= 0.5 r; min 2w - 1.5r: r = 1, w = 0.5, -0.5.
    w is *not* integral at the optimum (as an integer it would give 0): CP-SAT must refuse."""
    return milp([-1.5, 2.0], [[-0.5, 1]], [0], [INF], 0, 1, [True, False], name="half-and")


def quadratic() -> MilpModel:
    """Binaries; min -x0 - x1 - x2 + 3 x0 x1 + 1.5 x1 x2 - 0.5 x2 x2, x0 + x1 + x2 >= 1."""
    return milp(
        [-1, -1, -1],
        [[1, 1, 1]],
        [1],
        [INF],
        0,
        1,
        True,
        q=[(0, 1, 3.0), (1, 2, 1.5), (2, 2, -0.5)],
        name="quadratic",
    )


def hard_knapsack(n: int = 150, m: int = 15) -> MilpModel:
    r = np.random.default_rng(0)
    W = r.integers(10, 100, size=(m, n)).astype(float)
    v = r.integers(10, 100, size=n).astype(float)
    return milp(-v, W, np.full(m, -INF), W.sum(axis=1) / 3, 0, 1, True, name="hard-knapsack")


# ---------------------------------------------------------------- registry
def test_registry_entries_resolve_with_the_common_signature():
    assert "highs" in SOLVERS
    assert QUADRATIC_CAPABLE <= set(SOLVERS)
    for name, target in SOLVERS.items():
        mod, fn = target.split(":")
        try:
            f = getattr(importlib.import_module(mod), fn)
        except ImportError as exc:  # the back-end module itself must import without its solver
            pytest.fail(f"{name}: {exc}")
        params = list(inspect.signature(f).parameters)
        assert params[:4] == ["model", "options", "warm_start", "progress"], name


def test_every_registered_name_is_declared_by_its_module():
    from xengine.solvers import BACKENDS, cpsat, cvxpy_backend, gurobi, highs, scip

    declared = [b for mod in (highs, gurobi, scip, cpsat, cvxpy_backend) for b in mod.BACKENDS]
    assert sorted(b.name for b in declared) == NAMES
    for b in declared:
        assert BACKENDS[b.name] is b
        assert SOLVERS[b.name] == b.target
        assert b.target.split(":")[0].startswith("xengine.solvers."), b.name
        assert set(b.statuses.values()) <= set(STATUSES), b.name
        assert b.takes_milp, b.name
        assert set(b.packages) == set(PACKAGES[b.name]), b.name  # what require() imports
    assert [b.name for b in cvxpy_backend.BACKENDS] == ["cvxpy", "cvxpy-scip", "cvxpy-gurobi"]


def test_quadratic_set_is_the_declarations():
    from xengine.solvers import BACKENDS

    assert {n for n, b in BACKENDS.items() if b.takes_quadratic} == set(QUADRATIC_CAPABLE)
    assert set(QUADRATIC_CAPABLE) == {"gurobi", "scip"}
    assert {n for n, b in BACKENDS.items() if b.integer_only} == {"cpsat"}


def test_available_solvers_lists_only_installed_ones(monkeypatch):
    from xengine.solvers import BACKENDS, available_solvers

    def installed(name):
        for pkg in PACKAGES[name]:
            try:
                importlib.import_module(pkg)
            except ImportError:
                return False
        return True

    assert list(available_solvers()) == [n for n in BACKENDS if installed(n)]
    monkeypatch.setitem(sys.modules, "gurobipy", None)  # as if not installed
    names = available_solvers()
    assert "gurobi" not in names and "cvxpy-gurobi" not in names
    with pytest.raises(SolverUnavailable) as exc:  # an unknown name lists every known one
        solve(knapsack(), "nosuchsolver")
    msg = str(exc.value)
    assert "unknown solver 'nosuchsolver'" in msg
    assert "gurobi (not installed)" in msg
    assert all(n in msg for n in NAMES)


def test_declared_statuses_map_like_the_back_ends():
    from xengine.solvers import BACKENDS
    from xengine.solvers.cpsat import BACKEND as CPSAT
    from xengine.strategies import intervals

    assert intervals.CPSAT is CPSAT  # the interval model reads CP-SAT's statuses from here
    b = BACKENDS["highs"]
    assert b.status("kOptimal") == "optimal"
    assert b.status("kTimeLimit", has_solution=True) == "feasible"
    assert b.status("kTimeLimit", has_solution=False) == "no_solution"
    assert b.status("kUnbounded") == "error"  # not in the map


def test_importing_the_registry_imports_no_solver():
    import subprocess

    code = (
        "import sys, xengine.solvers as s; s.available_solvers(); "
        "print(sorted(m for m in ('highspy', 'gurobipy', 'pyscipopt', 'ortools', 'cvxpy') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("name", NAMES)
def test_declared_capabilities_are_what_the_back_end_does(name):
    from xengine.solvers import BACKENDS

    require(name)
    b = BACKENDS[name]
    for takes, model, opts in (
        (b.takes_quadratic, quadratic(), SolverOptions()),
        (b.takes_lp, knapsack(), SolverOptions(relax=True)),
    ):
        if takes:
            assert solve(model, name, opts).status == "optimal", name
        else:
            with pytest.raises(SolverUnavailable):
                solve(model, name, opts)


# ---------------------------------------------------------------- canonical problems, every solver
@pytest.mark.parametrize("name", NAMES)
def test_knapsack_optimum(name):
    m = knapsack()
    res = run(m, name)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(brute_binary(m), abs=1e-6)
    assert res.objective == pytest.approx(KNAPSACK_OPT, abs=1e-6)
    assert res.best_bound is not None and res.best_bound <= res.objective + 1e-6
    assert res.gap is not None and res.gap <= 1e-4 + 1e-9
    assert res.time_to_first_s is not None and res.time_to_first_s <= res.solve_time_s + 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_lp_optimum_or_clear_refusal(name):
    m = lp()
    if name == "cpsat":
        require(name)
        with pytest.raises(SolverUnavailable, match="integer"):
            solve(m, name)
        return
    res = run(m, name)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(-2.8, abs=1e-6)
    assert res.x == pytest.approx([1.6, 1.2], abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("make", [infeasible, integer_infeasible])
def test_infeasible(name, make):
    res = run(make(), name)
    assert res.status == "infeasible", res.message


@pytest.mark.parametrize("name", NAMES)
def test_equality_defined_continuous_columns(name):
    res = run(memory_like(), name)
    assert res.status == "optimal", res.message
    assert res.objective == pytest.approx(MEMORY_LIKE_OPT, abs=1e-6)
    assert res.x[3:] == pytest.approx([0.25, 1.0], abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_implied_integer_continuous_column(name):
    res = run(and_like(), name)
    assert res.status == "optimal", res.message
    assert res.objective == pytest.approx(-1.5, abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_fractional_continuous_column(name):
    m = half_and()
    if name == "cpsat":
        require(name)
        with pytest.raises(SolverUnavailable, match="continuous columns"):
            solve(m, name)
        return
    res = run(m, name)
    assert res.status == "optimal", res.message
    assert res.objective == pytest.approx(-0.5, abs=1e-6)
    assert res.x == pytest.approx([1.0, 0.5], abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_products_taken_or_refused(name):
    m = quadratic()
    if name not in QUADRATIC_CAPABLE:
        require(name)
        with pytest.raises(SolverUnavailable, match=LINEAR_ONLY_MSG):
            solve(m, name)
        return
    res = run(m, name)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(brute_binary(m), abs=1e-6)
    assert res.objective == pytest.approx(-2.5, abs=1e-6)  # x0 = x2 = 1


@pytest.mark.parametrize("name", NAMES)
def test_relax_gives_lp_bound(name):
    from scipy.optimize import linprog

    m = knapsack()
    ref = linprog(m.c, A_ub=m.A.toarray(), b_ub=m.row_ub, bounds=list(zip(m.lb, m.ub, strict=True)))
    if name == "cpsat":
        require(name)
        with pytest.raises(SolverUnavailable, match="relax"):
            solve(m, name, SolverOptions(relax=True))
        return
    res = run(m, name, relax=True)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(ref.fun + 100, abs=1e-6)
    assert res.objective < brute_binary(m) - 1e-3  # really relaxed: strictly below the MILP
    assert np.any(np.abs(res.x - np.round(res.x)) > 1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_warm_start_and_progress(name):
    m = knapsack()
    calls = []
    start = np.zeros(m.n_vars)  # feasible, far from optimal
    res = run(m, name, warm_start=start, progress=lambda *a: calls.append(a))
    assert res.status == "optimal"
    assert res.objective == pytest.approx(KNAPSACK_OPT, abs=1e-6)
    assert calls, "progress was never called"
    for el, inc, bnd in calls:  # (HiGHS also reports bound moves before any incumbent)
        assert el >= 0
        assert inc is None or bnd is None or bnd <= inc + 1e-6
    incs = [c[1] for c in calls if c[1] is not None]
    assert incs[-1] == pytest.approx(res.objective, abs=1e-6)
    assert min(incs) == pytest.approx(res.objective, abs=1e-6)
    # an infeasible start must not break the solve
    res2 = run(m, name, warm_start=np.ones(m.n_vars))
    assert res2.status == "optimal" and res2.objective == pytest.approx(KNAPSACK_OPT, abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_time_limit_status_consistency(name):
    m = hard_knapsack()
    res = run(m, name, time_limit_s=0.0)
    assert res.status in ("no_solution", "feasible", "optimal"), res.message
    res = run(m, name, time_limit_s=0.5)
    assert res.status in ("feasible", "optimal"), res.message
    assert res.solve_time_s < 0.5 + 3.0  # the limit is applied
    if res.status == "feasible" and res.best_bound is not None:
        assert res.best_bound <= res.objective + 1e-6
        assert res.gap == pytest.approx(
            abs(res.objective - res.best_bound) / abs(res.objective), rel=1e-6
        )


# ---------------------------------------------------------------- status mapping, directly
def test_gurobi_status_map():
    from xengine.solvers.gurobi import map_status

    assert map_status(2, 1) == "optimal"
    assert map_status(3, 0) == "infeasible"
    assert map_status(9, 1) == "feasible"  # TIME_LIMIT with incumbent
    assert map_status(9, 0) == "no_solution"
    for code in (7, 8, 10, 13, 15, 16, 17):
        assert map_status(code, 2) == "feasible"
        assert map_status(code, 0) == "no_solution"
    # INTERRUPTED is not a limit: solve_gurobi passes it on as an interrupt before mapping
    assert map_status(11, 2) == "error"
    assert map_status(5, 0) == "error"  # unbounded
    assert map_status(12, 1) == "error"  # numeric


def test_scip_status_map():
    from xengine.solvers.scip import map_status

    assert map_status("optimal", True) == "optimal"
    assert map_status("gaplimit", True) == "optimal"
    assert map_status("infeasible", False) == "infeasible"
    assert map_status("inforunbd", False, bounded=True) == "infeasible"
    assert map_status("inforunbd", False, bounded=False) == "error"
    for s in ("timelimit", "nodelimit", "memlimit", "userinterrupt", "stallnodelimit"):
        assert map_status(s, True) == "feasible"
        assert map_status(s, False) == "no_solution"
    assert map_status("unbounded", True) == "error"
    assert map_status("unknown", False) == "error"


def test_cpsat_status_map():
    from xengine.solvers.cpsat import map_status

    assert map_status("OPTIMAL") == "optimal"
    assert map_status("FEASIBLE") == "feasible"
    assert map_status("INFEASIBLE") == "infeasible"
    assert map_status("UNKNOWN") == "no_solution"
    assert map_status("MODEL_INVALID") == "error"


def test_cvxpy_status_map():
    from xengine.solvers.cvxpy_backend import map_status

    assert map_status("optimal", True) == "optimal"
    assert map_status("infeasible", False) == "infeasible"
    assert map_status("user_limit", True) == "feasible"
    assert map_status("user_limit", False) == "no_solution"
    assert map_status("optimal_inaccurate", True) == "feasible"
    assert map_status("unbounded", False) == "error"
    assert map_status("solver_error", False) == "error"


# ---------------------------------------------------------------- missing packages
@pytest.mark.parametrize(
    "name,module,pip",
    [
        ("gurobi", "gurobipy", "pip install gurobipy"),
        ("scip", "pyscipopt", "pip install pyscipopt"),
        ("cpsat", "ortools.sat.python", "pip install ortools"),
        ("cvxpy", "cvxpy", "pip install cvxpy"),
    ],
)
def test_missing_package_is_named(monkeypatch, name, module, pip):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    with pytest.raises(SolverUnavailable, match=pip):
        solve(knapsack(), name)


def test_cvxpy_missing_inner_solver_is_named():
    require("cvxpy")
    from xengine.solvers.cvxpy_backend import solve_cvxpy

    with pytest.raises(SolverUnavailable, match="NO_SUCH_SOLVER"):
        solve_cvxpy(knapsack(), SolverOptions(), cvxpy_solver="NO_SUCH_SOLVER")


def test_cvxpy_constraints_are_vectorised(monkeypatch):
    require("cvxpy")
    import cvxpy

    seen = []
    real = cvxpy.Problem

    def spy(objective, constraints=None):
        seen.append(len(constraints or []))
        return real(objective, constraints)

    monkeypatch.setattr(cvxpy, "Problem", spy)
    g = chain(4)
    f = build(Instance.single(g, "cpu", keep_all_peak_bytes(g)))
    assert f.model.n_rows > 100
    res = run(f.model, "cvxpy")
    assert res.status == "optimal"
    assert seen and seen[0] <= 3


# ---------------------------------------------------------------- CP-SAT integerisation
def test_cpsat_fgcd():
    pytest.importorskip("ortools")
    from xengine.solvers.cpsat import fgcd

    assert fgcd(np.array([0.3, 0.7])) == pytest.approx(0.1)
    assert fgcd(np.array([0.25, 0.5, 0.75, 0.0])) == pytest.approx(0.25)
    assert fgcd(np.array([1000 / 3000, 2000 / 3000])) == pytest.approx(1 / 3)
    assert fgcd(np.array([1.0, np.pi])) is None
    assert fgcd(np.zeros(3)) == 1.0


def test_cpsat_integerises_formulation_columns():
    pytest.importorskip("ortools")
    from xengine.solvers.cpsat import integerise

    g = chain(4)
    f = build(Instance.single(g, "cpu", int(0.7 * keep_all_peak_bytes(g))))
    integ = integerise(f.model)
    n_u = int((f.Uix >= 0).sum())
    assert int((integ.rule == 1).sum()) == n_u  # every memory column, by equality
    # U in units of gcd(bytes) / mem_scale: sigma * U is a byte count / gcd
    u = f.Uix[f.Uix >= 0]
    assert np.allclose(integ.sigma[u], f.mem_scale / 1000)

    f2 = build(two_device_instance(), mode="exact")
    integ2 = integerise(f2.model)
    n_x = int((f2.Xix >= 0).sum())
    assert n_x > 0 and int((integ2.rule == 2).sum()) == n_x  # copy indicators: implied


# ---------------------------------------------------------------- on the formulation
@pytest.mark.parametrize("frac", [1.0, 0.7])
def test_chain_formulation_same_optimum_everywhere(frac):
    g = chain(4)
    f = build(Instance.single(g, "cpu", int(frac * keep_all_peak_bytes(g))))
    ref = run(f.model, "highs")
    assert ref.status == "optimal"
    # tighter budget forces recomputation (a test that can fail if budgets were ignored)
    assert ref.objective == pytest.approx({1.0: 6.0, 0.7: 7.5}[frac])
    for name in NAMES:
        if name == "highs":
            continue
        try:
            res = run(f.model, name, rel_gap=1e-9)
        except pytest.skip.Exception:
            continue
        assert res.status == "optimal", (name, res.message)
        assert res.objective == pytest.approx(ref.objective, abs=1e-6), name


COPIES = {("a", "b"): CopyModel(1e-3, 1e4), ("b", "a"): CopyModel(2e-3, 1e4)}


def two_device_instance(n_layers: int = 2) -> Instance:
    """f0 is cheaper on b, f1 on a: the optimum splits the work and pays for copies."""
    g = training_graph(
        f"two{n_layers}",
        [(i, i + 1) for i in range(n_layers - 1)],
        n_layers,
        [1000, 2000, 1500][:n_layers],
        {"a": [1.0, 2.0, 1.5][:n_layers], "b": [0.5, 3.0, 0.7][:n_layers]},
        copy_models=COPIES,
    )
    pk = keep_all_peak_bytes(g)
    return Instance(g, ("a", "b"), (pk, pk))


def test_paper_miqp_with_products_equals_linearised():
    inst = two_device_instance(2)
    lin = build(inst, mode="paper", linearize=True)
    quad = build(inst, mode="paper", linearize=False)
    assert quad.model.is_quadratic and not lin.model.is_quadratic
    ref = run(lin.model, "highs", rel_gap=1e-9)
    assert ref.status == "optimal"
    # the optimum uses both devices, so copy (product) terms are really priced
    sched = lin.schedule_from(ref.x)
    assert sched.R.sum(axis=(1, 2)).min() > 0
    solved = 0
    for name in sorted(QUADRATIC_CAPABLE):
        try:
            res = run(quad.model, name, rel_gap=1e-9)
        except pytest.skip.Exception:
            continue
        except SolverUnavailable as exc:  # gurobi's size-limited licence
            assert "licence" in str(exc)
            continue
        solved += 1
        assert res.status == "optimal", (name, res.message)
        assert res.objective == pytest.approx(ref.objective, abs=1e-6), name
        x = res.x
        prod = float(np.sum(quad.model.q_val * x[quad.model.q_i] * x[quad.model.q_j]))
        assert prod > 1e-6, f"{name}: no copy term priced at the optimum"
    if solved == 0:
        pytest.skip("no quadratic-capable solver installed")
    # the linearised model on every linear back-end
    for name in NAMES:
        try:
            res = run(lin.model, name, rel_gap=1e-9)
        except pytest.skip.Exception:
            continue
        assert res.status == "optimal", (name, res.message)
        assert res.objective == pytest.approx(ref.objective, abs=1e-6), name


def test_exact_two_devices_same_optimum_everywhere():
    f = build(two_device_instance(2), mode="exact")
    ref = run(f.model, "highs", rel_gap=1e-9)
    assert ref.status == "optimal"
    for name in NAMES:
        try:
            res = run(f.model, name, rel_gap=1e-9)
        except pytest.skip.Exception:
            continue
        assert res.status == "optimal", (name, res.message)
        assert res.objective == pytest.approx(ref.objective, abs=1e-6), name


# ---------------------------------------------------------------- Gurobi's size-limited licence
def _too_big_linear() -> MilpModel:
    n = 2001
    return milp(
        -np.ones(n),
        sp.csr_matrix(np.ones((1, n))).toarray(),
        [-INF],
        [1000],
        0,
        1,
        True,
        name="big",
    )


@pytest.mark.parametrize("name", ["gurobi", "cvxpy-gurobi"])
def test_gurobi_licence_limit_is_reported(name):
    if name not in SOLVERS:
        pytest.skip(f"{name} not registered")
    require(name)
    m = _too_big_linear()
    try:
        res = solve(m, name)
    except SolverUnavailable as exc:
        msg = str(exc)
        assert "\n" not in msg
        assert "licence" in msg and "2001 variables" in msg and "2000" in msg
        assert "solver=highs" in msg and "GRB_LICENSE_FILE" in msg
    else:
        assert res.status == "optimal"
        pytest.skip("gurobipy has an unrestricted licence here: no size limit to report")


def test_gurobi_quadratic_licence_limit_is_reported():
    require("gurobi")
    f = build(two_device_instance(3), mode="paper", linearize=False)
    assert f.model.is_quadratic and f.model.n_vars > 200
    try:
        res = solve(f.model, "gurobi")
    except SolverUnavailable as exc:
        msg = str(exc)
        assert "licence" in msg and "with products" in msg and "200 variables" in msg
    else:
        assert res.status == "optimal"
        pytest.skip("gurobipy has an unrestricted licence here: no size limit to report")


def test_highs_solves_after_the_thread_count_changes():
    """HiGHS sizes one thread pool per process at its first solve; a later solve with another
    ``threads`` failed with status "Not Set" until the pool was reset."""
    from xengine.graph.synthetic import chain
    from xengine.problem import Instance
    from xengine.strategies.solve import solve_xengine

    g = chain(5)
    inst = Instance.single(g, g.devices[0], int(0.7 * keep_all_peak_bytes(g)))
    objectives = []
    for threads in (None, 1, 2, None):
        res = solve_xengine(inst, options=SolverOptions(time_limit_s=30, threads=threads))
        assert res.status == "optimal", (threads, res.message)
        objectives.append(res.objective_s)
    assert max(objectives) - min(objectives) < 1e-9


def test_highs_reports_its_bound_between_incumbents(monkeypatch):
    """The gap over time (issue 5's time-to-gap figures) needs the bound's moves, not only
    the incumbents': with the report interval at zero, the trace that solve_xengine keeps has
    bound-only points before the first incumbent, never a falling bound, and ends at the
    solver's final objective and bound."""
    import xengine.solvers.highs as highs_backend
    from xengine.strategies.solve import solve_xengine

    monkeypatch.setattr(highs_backend, "BOUND_REPORT_INTERVAL_S", 0.0)
    g = chain(16)
    budget = int(0.7 * keep_all_peak_bytes(g))
    res = solve_xengine(Instance(g, ("cpu",), (budget,)), options=SolverOptions(threads=1))
    assert res.status == "optimal"
    trace = res.trace
    assert trace[0][1] is None and trace[0][2] is not None  # a bound, no incumbent yet
    bounds = [b for _, _, b in trace if b is not None]
    assert len(bounds) >= 3 and np.all(np.diff(bounds) >= -1e-9)
    assert np.all(np.diff([t for t, _, _ in trace]) >= 0)
    assert trace[-1][1] == pytest.approx(res.objective_s, rel=1e-9)
    assert trace[-1][2] == pytest.approx(res.best_bound_s, rel=1e-9)
