"""The solver benchmark's smallest run: both formulations agree, every schedule is checked."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
try:
    import solver_benchmark  # noqa: E402
finally:
    sys.path.remove(str(REPO / "experiments"))


def test_quick_two_device_row_with_spread_start(tmp_path):
    rc = solver_benchmark.main(
        [
            "--suite=quick",
            "--graphs=chain16",
            "--devices=2",
            "--budgets=70%",
            "--time-limit-s=30",
            "--formulations=default,reference",
            "--warm-start=spread",
            f"--out={tmp_path}",
        ]
    )
    assert rc == 0  # no bug rows: optima agree, model == simulator
    rows = list(csv.DictReader((tmp_path / "solver_benchmark.csv").open()))
    assert [r["formulation"] for r in rows] == ["default", "reference"]
    for r in rows:
        assert r["status"] == "optimal" and r["agree"] == "True"
        assert r["warm_start"]  # a start was found and used
        assert float(r["objective_s"]) <= float(r["warm_start_s"]) + 1e-9
        assert float(r["lp_bound_s"]) <= float(r["objective_s"]) + 1e-9
        assert float(r["placement_bound_s"]) <= float(r["objective_s"]) + 1e-9
        # proven optimal: every gap level was reached, the looser ones no later
        times = [float(r[f"time_to_gap_{k}_s"]) for k in solver_benchmark.GAP_LEVELS]
        assert times == sorted(times) and times[-1] <= float(r["solve_s"]) + 1e-6
    assert abs(float(rows[0]["objective_s"]) - float(rows[1]["objective_s"])) < 1e-6
    assert (tmp_path / "solver_benchmark.png").stat().st_size > 0
    trace = list(csv.DictReader((tmp_path / "traces.csv").open()))
    assert {t["formulation"] for t in trace} == {"default", "reference"}
    for form in ("default", "reference"):
        gaps = [float(t["gap"]) for t in trace if t["formulation"] == form and t["gap"]]
        assert gaps and gaps == sorted(gaps, reverse=True) and gaps[-1] <= 1e-4 + 1e-9


def test_time_to_gap_takes_the_best_incumbent_and_bound_so_far():
    trace = [(1.0, None, 80.0), (2.0, 110.0, 90.0), (3.0, 120.0, 99.0), (4.0, 100.0, 99.5)]
    # at 2 s: 110 against 90 (18 %); at 3 s the incumbent is still 110, the bound 99 (10 %)
    assert solver_benchmark.time_to_gap_s(trace, 0.2) == 2.0
    assert solver_benchmark.time_to_gap_s(trace, 0.1) == 3.0
    assert solver_benchmark.time_to_gap_s(trace, 0.005) == 4.0
    assert solver_benchmark.time_to_gap_s(trace, 0.001) is None
    assert solver_benchmark.time_to_gap_s([], 0.5) is None


def test_gap_over_time_plot_only_for_slow_instances(tmp_path):
    def row(form, solve_s, trace):
        key = {"graph": "g", "n_devices": 2, "budget": "50%", "repeat": 0, "solver": "highs"}
        return {**key, "formulation": form, "solve_s": solve_s, "trace": trace}

    fast = [row("default", 2.0, [(1.0, 10.0, 9.0), (2.0, 10.0, 10.0)])]
    assert not solver_benchmark.plot_gap_over_time(fast, tmp_path / "a.png")
    assert not (tmp_path / "a.png").exists()
    slow = fast + [row("reference", 40.0, [(1.0, None, 8.0), (5.0, 11.0, 9.0), (40.0, 10.0, 9.5)])]
    assert solver_benchmark.plot_gap_over_time(slow, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0
    assert solver_benchmark.write_traces(slow, tmp_path / "t.csv") == 5


def test_one_device_row_measures_lp_rounding_against_the_optimum(tmp_path):
    rc = solver_benchmark.main(
        [
            "--suite=quick",
            "--graphs=chain16",
            "--devices=1",
            "--budgets=90%",
            "--time-limit-s=30",
            "--formulations=default",
            "--rounding",
            "--no-lp-bound",
            f"--out={tmp_path}",
        ]
    )
    assert rc == 0
    (row,) = list(csv.DictReader((tmp_path / "solver_benchmark.csv").open()))
    assert row["status"] == "optimal"
    if row["rounding_excess"] != "no fit":  # a rounded schedule is never below the optimum
        assert float(row["rounding_excess"]) >= -1e-9
        expect = float(row["rounding_time_s"]) / float(row["sim_time_s"]) - 1
        assert float(row["rounding_excess"]) == pytest.approx(expect)


def test_cross_check_allows_the_solvers_gap_between_proven_optima():
    """Two 'optimal' rows may differ by the relative gap the solvers stop at, not more."""

    def row(form, obj):
        key = {"graph": "g", "n_devices": 2, "budget": "90%", "repeat": 0, "suite": "q"}
        return {**key, "solver": "s", "formulation": form, "status": "optimal", "objective_s": obj}

    close = [row("default", 111.801), row("intervals", 111.806)]
    assert solver_benchmark.cross_check(close, rel_gap=1e-4) == []
    far = [row("default", 111.801), row("intervals", 111.9)]
    bugs = solver_benchmark.cross_check(far, rel_gap=1e-4)
    assert len(bugs) == 1 and "optima differ" in bugs[0]["note"]


def test_coarse_rows_report_the_expanded_fine_schedule(tmp_path):
    """A coarse row's objective is its expansion's fine simulated time: never below the fine
    optimum (the run's cross-check would add a bug row), from a smaller model."""
    rc = solver_benchmark.main(
        [
            "--suite=quick",
            "--graphs=chain16",
            "--devices=1",
            "--budgets=90%",
            "--time-limit-s=30",
            "--formulations=default,coarse2",
            "--no-lp-bound",
            f"--out={tmp_path}",
        ]
    )
    assert rc == 0
    fine, coarse = list(csv.DictReader((tmp_path / "solver_benchmark.csv").open()))
    assert (fine["formulation"], coarse["formulation"]) == ("default", "coarse2")
    assert fine["status"] == "optimal" and coarse["status"] == "feasible"
    assert coarse["agree"] == "True" and "coarse nodes" in coarse["note"]
    assert float(coarse["objective_s"]) >= float(fine["objective_s"]) * (1 - 1e-9)
    assert int(coarse["n_vars"]) < int(fine["n_vars"])
    assert coarse["best_bound_s"] == "" and coarse["gap"] == ""
    assert float(coarse["placement_bound_s"]) <= float(coarse["objective_s"])
    assert (tmp_path / "coarsening.png").stat().st_size > 0


def test_coarse_start_is_taken_only_when_it_beats_the_spread_start(tmp_path):
    rc = solver_benchmark.main(
        [
            "--suite=quick",
            "--graphs=chain32",
            "--devices=2",
            "--budgets=90%",
            "--time-limit-s=20",
            "--formulations=default",
            "--warm-start=spread",
            "--coarse-start=2",
            "--no-lp-bound",
            f"--out={tmp_path}",
        ]
    )
    assert rc == 0
    (row,) = list(csv.DictReader((tmp_path / "solver_benchmark.csv").open()))
    g = solver_benchmark.synthetic("chain", 32)
    inst = solver_benchmark.Instance(g, ("a", "b"), (int(row["budget_bytes"]),) * 2)
    spread, _, spread_s = solver_benchmark.starting_schedule(
        inst, "spread", "highs", solver_benchmark.SolverOptions(time_limit_s=20), "exact"
    )
    assert float(row["warm_start_s"]) <= spread_s + 1e-9
    if row["warm_start"].startswith("coarse2"):
        assert float(row["warm_start_s"]) < spread_s
    assert float(row["objective_s"]) <= float(row["warm_start_s"]) + 1e-9


def test_lp_bound_alongside_row(tmp_path):
    rc = solver_benchmark.main(
        [
            "--suite=quick",
            "--graphs=chain16",
            "--devices=2",
            "--budgets=70%",
            "--time-limit-s=10",
            "--formulations=intervals",
            "--warm-start=heuristic",
            "--lp-alongside",
            f"--out={tmp_path}",
        ]
    )
    assert rc == 0
    (row,) = list(csv.DictReader((tmp_path / "solver_benchmark.csv").open()))
    assert row["agree"] == "True"
    assert float(row["lp_bound_s"]) <= float(row["best_bound_s"]) + 1e-9
    assert float(row["best_bound_s"]) <= float(row["objective_s"]) + 1e-9


def test_heuristics_on_the_shipped_nets(tmp_path):
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import heuristics_nets
    finally:
        sys.path.remove(str(REPO / "experiments"))
    assert heuristics_nets.main(["--nets=vgg16", "--devices=b", f"--out={tmp_path}"]) == 0
    rows = list(csv.DictReader((tmp_path / "heuristics_nets.csv").open()))
    assert len(rows) == 4 * 4  # 90 / 70 / 50 % and the smallest budget, four heuristics
    # 50 % is below vgg16 b8's smallest feasible budget since keep-all keeps what autograd
    # keeps (490 of its 947 MiB are one op: the first classifier layer and its gradient)
    for budget in ("90%", "70%", "min"):
        by = {r["strategy"]: r for r in rows if r["budget"] == budget}
        ours, chen = by["recompute_greedy"], by["chen_greedy"]
        assert ours["status"] == "feasible"
        assert float(ours["peak_mib"]) <= int(ours["budget_bytes"]) / 2**20 + 0.005  # 2 decimals
        # the cost-aware greedy beats Chen's segments on vgg16 with H200 costs
        assert float(ours["time_ms"]) < float(chen["time_ms"])
    assert (tmp_path / "heuristics_nets_b.png").stat().st_size > 0


def test_runs_made_side_by_side_merge_into_one_table(tmp_path):
    common = ["--suite=quick", "--graphs=chain16", "--devices=1", "--budgets=90%"]
    common += ["--time-limit-s=30", "--no-lp-bound"]
    for form in ("default", "reference"):
        argv = common + [f"--formulations={form}", f"--out={tmp_path / form}"]
        assert solver_benchmark.main(argv) == 0
    merged = tmp_path / "merged"
    rc = solver_benchmark.main(
        ["--merge", str(tmp_path / "default"), str(tmp_path / "reference"), f"--out={merged}"]
    )
    assert rc == 0
    rows = list(csv.DictReader((merged / "solver_benchmark.csv").open()))
    assert [r["formulation"] for r in rows] == ["default", "reference"]
    for r in rows:  # carried over as the run wrote it
        (one,) = list(csv.DictReader((tmp_path / r["formulation"] / "solver_benchmark.csv").open()))
        for k in ("status", "objective_s", "solve_s", "time_to_gap_1pct_s", "agree"):
            assert r[k] == one[k]
    trace = list(csv.DictReader((merged / "traces.csv").open()))
    assert {t["formulation"] for t in trace} == {"default", "reference"}
    with pytest.raises(SystemExit):  # a folder without a run is refused, not skipped
        solver_benchmark.main(["--merge", str(tmp_path / "nothing"), f"--out={merged}"])


def test_solver_scaling_counts_the_memory_of_child_processes():
    """HiGHS's large MILPs run in a child process (xengine/solvers/highs_process.py): the
    scaling rows' peak memory must include it, not only the worker's own."""
    import os
    import subprocess

    from experiments.solver_scaling import _rss_bytes, _TreePeak

    own_bytes = _rss_bytes(os.getpid())
    tree = _TreePeak()
    hold = "import numpy as np, time; a = np.ones(50_000_000); time.sleep(1.5)"  # 400 MB
    subprocess.run([sys.executable, "-c", hold], check=True)
    peak = tree.stop()
    assert peak >= own_bytes + 350 * 2**20
