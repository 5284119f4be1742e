"""Lower bounds that hold for the whole problem (xengine.bounds)."""

from __future__ import annotations

import pytest

from tests.helpers import random_graph
from xengine.bounds import lp_bound_s, placement_bound_s
from xengine.problem import Instance
from xengine.schedule import keep_all_schedule
from xengine.simulate import simulate
from xengine.solve import solve_xengine
from xengine.solvers import SolverOptions

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
    peak = g.keep_all_peak_bytes()
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
    from xengine.solve import _tighten_with_placement_bound

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
