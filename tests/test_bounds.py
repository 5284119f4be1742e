"""Lower bounds that hold for the whole problem (xengine.strategies.bounds)."""

from __future__ import annotations

import pytest

from tests.helpers import random_graph
from xengine.problem import Instance
from xengine.schedule import keep_all_schedule
from xengine.simulate import keep_all_peak_bytes, simulate
from xengine.solvers import SolverOptions
from xengine.strategies.bounds import lp_bound_s, placement_bound_s
from xengine.strategies.solve import solve_xengine

OPTS = SolverOptions(time_limit_s=60, rel_gap=1e-9)


@pytest.mark.parametrize("devices", [("a", "b"), ("a", "b", "c")])
@pytest.mark.parametrize("seed", range(6))
def test_placement_bound_is_the_optimum_without_memory_limits(seed, devices):
    """With memory to spare nothing is recomputed, so the optimum is a choice of devices and
    copies: exactly what the bound's MILP solves."""
    g = random_graph(seed, devices=devices)
    inst = Instance(g, devices, (10**12,) * len(devices))
    opt = solve_xengine(inst, options=OPTS)
    assert opt.status == "optimal"
    assert placement_bound_s(inst) == pytest.approx(opt.sim.time_s, rel=1e-7)


@pytest.mark.parametrize("devices", [("a", "b"), ("a", "b", "c")])
@pytest.mark.parametrize("seed", range(6))
def test_bounds_never_exceed_the_optimum(seed, devices):
    g = random_graph(seed, devices=devices, latency_s=0.3)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    seen = 0
    for frac in (0.6, 0.3, 0.0):
        inst = Instance(g, devices, (int(low + frac * (peak - low)),) * len(devices))
        opt = solve_xengine(inst, options=OPTS)
        if opt.status == "infeasible":
            continue
        assert opt.status == "optimal"
        seen += 1
        assert placement_bound_s(inst) <= opt.sim.time_s * (1 + 1e-9)
        assert lp_bound_s(inst) <= opt.sim.time_s * (1 + 1e-9)
    assert seen


@pytest.mark.parametrize("seed", range(4))
def test_lp_bound_defaults_to_the_tight_free_rows(seed):
    """The tight AND rows imply the hazard count, so their relaxation is never weaker; the
    default bound is theirs and still never above the optimum."""
    g = random_graph(seed, devices=("a", "b"), latency_s=0.3)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    inst = Instance(g, ("a", "b"), (int(low + 0.3 * (peak - low)),) * 2)
    default = lp_bound_s(inst)
    tight = lp_bound_s(inst, build_options={"free_rows": "tight"})
    hazard = lp_bound_s(inst, build_options={"free_rows": "hazard"})
    assert default == tight
    assert hazard <= tight * (1 + 1e-9)
    opt = solve_xengine(inst, options=OPTS)
    if opt.status == "optimal":
        assert tight <= opt.sim.time_s * (1 + 1e-9)


def test_pdlp_relaxes_the_hazard_rows_unless_told_otherwise():
    """PDLP converges faster on the hazard rows (resnet50: 47.73 against 42.73 ms after 570 s),
    so that is the form it relaxes by default; on this instance the two forms' optima differ
    (8.418 against 8.563 s), so the test sees which one was relaxed."""
    g = random_graph(0, devices=("a", "b"), latency_s=0.3)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    inst = Instance(g, ("a", "b"), (int(low + 0.3 * (peak - low)),) * 2)
    hazard = lp_bound_s(inst, build_options={"free_rows": "hazard"})
    tight = lp_bound_s(inst, build_options={"free_rows": "tight"})
    assert tight > hazard * (1 + 1e-3)
    opts = SolverOptions(time_limit_s=60)
    assert lp_bound_s(inst, opts, method="pdlp") == pytest.approx(hazard, rel=1e-4)
    told = lp_bound_s(inst, opts, {"free_rows": "tight"}, method="pdlp")
    assert told == pytest.approx(tight, rel=1e-4)


def test_placement_bound_on_one_device_is_the_keep_all_time():
    g = random_graph(2, devices=("a",))
    inst = Instance(g, ("a",), (10**12,))
    assert placement_bound_s(inst) == pytest.approx(simulate(inst, keep_all_schedule(inst)).time_s)


def test_placement_bound_keeps_nodes_off_devices_they_do_not_fit():
    """A node whose inputs, output and workspace exceed a device's budget runs elsewhere; with
    no device left for it there is no bound (and no schedule)."""
    g = random_graph(1, devices=("a", "b"))
    need = g.node_lower_bound_bytes()
    roomy = Instance(g, ("a", "b"), (10**12, 10**12))
    cramped = Instance(g, ("a", "b"), (10**12, int(need.max()) - 1))
    assert placement_bound_s(cramped) >= placement_bound_s(roomy)
    assert placement_bound_s(Instance(g, ("a", "b"), (int(need.max()) - 1,) * 2)) is None


def test_a_milp_stopped_at_its_limit_reports_the_better_bound():
    """HiGHS's bound at a time limit can be weaker than the placement bound; the run reports
    the better one, and an incumbent that meets it is proven optimal."""
    from xengine.result import StrategyResult
    from xengine.strategies.solve import _tighten_with_placement_bound

    g = random_graph(3, devices=("a", "b"))
    inst = Instance(g, ("a", "b"), (10**12, 10**12))
    bound = placement_bound_s(inst)

    def stopped(objective_s):
        return StrategyResult(
            "xengine",
            inst.devices,
            inst.budget_bytes,
            "feasible",
            objective_s=objective_s,
            best_bound_s=0.5 * bound,
            gap=1 - 0.5 * bound / objective_s,
        )

    met = stopped(bound)
    _tighten_with_placement_bound(met, inst, OPTS)
    assert met.status == "optimal" and met.gap == pytest.approx(0.0, abs=1e-12)
    above = stopped(1.1 * bound)
    _tighten_with_placement_bound(above, inst, OPTS)
    assert above.status == "feasible"
    assert above.best_bound_s == pytest.approx(bound)
    assert above.gap == pytest.approx(1 - 1 / 1.1)


@pytest.mark.parametrize("seed", range(4))
def test_lp_bound_by_interior_point_matches_the_simplex_optimum(seed):
    """The interior-point bound is taken from multipliers, not trusted from the solver; on a
    relaxation both methods solve it lands on the simplex optimum, never above it."""
    g = random_graph(seed, devices=("a", "b"), latency_s=0.3)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    inst = Instance(g, ("a", "b"), (int(low + 0.3 * (peak - low)),) * 2)
    simplex = lp_bound_s(inst, method="simplex")
    ipm = lp_bound_s(inst, method="ipm")
    assert simplex is not None and ipm is not None
    assert ipm <= simplex * (1 + 1e-9)
    assert ipm == pytest.approx(simplex, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_lp_bound_by_pdlp_is_proven_even_when_stopped_early(seed):
    """PDLP's last dual iterate bounds the relaxation from below at any stop: converged it is
    the simplex optimum to its tolerance, stopped after a few milliseconds it is lower."""
    g = random_graph(seed, devices=("a", "b"), latency_s=0.3)
    peak = keep_all_peak_bytes(g)
    low = int(g.node_lower_bound_bytes().max())
    inst = Instance(g, ("a", "b"), (int(low + 0.3 * (peak - low)),) * 2)
    simplex = lp_bound_s(inst, build_options={"free_rows": "hazard"}, method="simplex")
    full = lp_bound_s(inst, SolverOptions(time_limit_s=60), method="pdlp")  # the hazard rows
    assert full <= simplex * (1 + 1e-9)
    assert full == pytest.approx(simplex, rel=1e-4)
    early = lp_bound_s(inst, SolverOptions(time_limit_s=1e-3), method="pdlp")
    assert early is None or early <= full * (1 + 1e-9)


def test_lp_bound_rejects_an_unknown_method():
    g = random_graph(0, devices=("a",))
    with pytest.raises(ValueError, match="method must be"):
        lp_bound_s(Instance(g, ("a",), (10**12,)), method="barrier")


def _small_lp():
    """min -x0 - 2 x1  s.t.  x0 + x1 <= 1.5,  x1 - x0 >= -0.5,  0 <= x <= 1: optimum -2.5 at
    (0.5, 1); the multipliers (-1, 0) on the rows (reduced costs (0, -1)) prove it."""
    import numpy as np
    import scipy.sparse as sp

    from xengine.solvers import MilpModel

    return MilpModel(
        c=np.array([-1.0, -2.0]),
        A=sp.csr_matrix(np.array([[1.0, 1.0], [-1.0, 1.0]])),
        row_lb=np.array([-np.inf, -0.5]),
        row_ub=np.array([1.5, np.inf]),
        lb=np.zeros(2),
        ub=np.ones(2),
        integrality=np.zeros(2, dtype=bool),
    )


def test_dual_bound_is_the_optimum_at_optimal_multipliers_and_below_it_elsewhere():
    import numpy as np

    from xengine.solvers import SolverOptions as Opts
    from xengine.solvers import solve

    model = _small_lp()
    assert model.dual_bound(np.array([-1.0, 0.0])) == pytest.approx(-2.5)
    rng = np.random.default_rng(0)
    for _ in range(200):  # weak duality: any multipliers, however wrong, bound from below
        assert model.dual_bound(rng.normal(size=2) * 3) <= -2.5 + 1e-12
    # multipliers pointing at a row's infinite side are dropped, not turned into -inf
    assert np.isfinite(model.dual_bound(np.array([1.0, -1.0])))
    for method in ("simplex", "ipm"):
        sr = solve(model, "highs", Opts(relax=True, lp_method=method))
        assert sr.row_dual is not None
        assert model.dual_bound(sr.row_dual) == pytest.approx(-2.5, abs=1e-7)
    with pytest.raises(ValueError, match="shape"):
        model.dual_bound(np.zeros(3))


def test_lp_bound_alongside_that_fails_gives_no_bound(caplog):
    from xengine.strategies.bounds import LpBoundAlongside

    g = random_graph(0)
    inst = Instance(g, ("a", "b"), (int(0.7 * keep_all_peak_bytes(g)),) * 2)
    job = LpBoundAlongside(inst, SolverOptions(time_limit_s=10), method="nosuch")
    assert job.result() is None  # lp_bound_s raised ValueError in the other process
    assert "failed" in caplog.text and "nosuch" in caplog.text
