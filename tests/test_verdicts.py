"""Honest verdicts (docs/design.md section 10): a run whose executed schedule gives a wrong
answer is never recorded ``ok``. Each case is made to happen for real on the tiny net: a
program deliberately corrupted (one op computes something else than the model's), and a budget
deliberately undercut (the simulator is handed a graph whose values are half their real size,
so a schedule it finds within the budget measures over it). The reference step and the
comparison of gradients are the real ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import Recorder, tiny_run
from xengine.config import RunConfig
from xengine.pipeline import run_pipeline
from xengine.prepare import prepare
from xengine.records.report import format_table, table_csv
from xengine.result import run_status, wrong_lines
from xengine.simulate import keep_all_peak_bytes


def _cfg(tmp_path, mem: str = "100%", batch_size: int = 2, image_size: int = 32) -> RunConfig:
    return tiny_run(tmp_path, mem=mem, batch_size=batch_size, image_size=image_size)


def _corrupt_add(prep):
    """The executor's ``add`` op computes 1.5 (a + b); the plain step runs the model itself."""
    ops = list(prep.captured.ops)
    k = next(i for i, op in enumerate(ops) if op.name == "add")
    ops[k] = dataclasses.replace(ops[k], target=lambda a, b: torch.add(a, b) * 1.5)
    captured = dataclasses.replace(prep.captured, ops=tuple(ops))
    return dataclasses.replace(prep, captured=captured)


def test_wrong_gradients_make_the_run_wrong(tmp_path):
    cfg = _cfg(tmp_path)
    rec = Recorder()
    rows = run_pipeline(cfg, rec, _corrupt_add(prepare(cfg)))
    row = {r.label: r for r in rows}["checkpoint_all"]
    assert row.grads_match is False
    assert row.wrong.startswith("loss or gradients differ from plain PyTorch's"), row.wrong
    assert rec.tags_["xe.wrong.checkpoint_all"] == row.wrong
    assert run_status(rows) == "wrong"
    table = format_table(rows, footer=wrong_lines(rows))
    assert "WRONG (run status: wrong):" in table and "  checkpoint_all: loss or" in table
    assert "loss or gradients differ" in table_csv(rows)


def test_right_answers_make_the_run_ok(tmp_path):
    cfg = _cfg(tmp_path)
    rows = run_pipeline(cfg, Recorder(), prepare(cfg))
    assert all(not r.wrong for r in rows) and run_status(rows) == "ok"
    assert wrong_lines(rows) == []


def _halve_values(graph):
    nodes = [dataclasses.replace(v, output_bytes=v.output_bytes // 2) for v in graph.nodes]
    return dataclasses.replace(graph, nodes=tuple(nodes))


def test_a_measured_peak_over_the_budget_makes_the_run_wrong(tmp_path):
    size = {"batch_size": 16, "image_size": 64}  # keep-everything 16 MiB, 11 MiB at half size
    real = prepare(_cfg(tmp_path, **size))
    half = _halve_values(real.graph)  # what the simulator and the executor's check are told
    budget = int(1.25 * keep_all_peak_bytes(half))  # fits the half-size graph (with the
    # profile's workspaces, measured later, not those of the capture), not reality
    assert keep_all_peak_bytes(real.graph) > budget + 2**21
    cfg = _cfg(tmp_path, mem=f"{budget}B", **size)  # prepare() would refuse it on the real graph
    captured = dataclasses.replace(real.captured, graph=half)
    prep = dataclasses.replace(real, graph=half, captured=captured, budget_bytes=(budget,))
    rows = run_pipeline(cfg, Recorder(), prep)
    row = {r.label: r for r in rows}["checkpoint_all"]
    assert row.status == "feasible" and row.predicted_peak_bytes[0] <= budget, row
    assert row.measured_peak_bytes[0] > budget + max(2**20, 0.01 * budget), row
    assert row.grads_match is True  # the answer's numbers are right; its memory is not
    assert "exceeds the budget" in row.wrong and run_status(rows) == "wrong"


def test_the_compile_column_shows_only_where_a_row_compiled():
    """A column only compiled policies fill is left out of a table where none ran (the
    default run's), and shown, with a dash for the others, where one did."""
    from xengine.result import RunRow

    plain = RunRow(label="checkmate", strategy="checkmate", devices=("cpu",), status="feasible")
    compiled = dataclasses.replace(plain, label="torch_budget", compile_time_s=12.34)
    header = format_table([plain]).splitlines()[0]
    assert "compile s" not in header and "solve s" in header and "gap %" in header
    lines = format_table([plain, compiled]).splitlines()
    assert "compile s" in lines[0]
    assert lines[3].split()[-3] == "12.3" and lines[2].split()[-3] == "-"


def test_every_executed_row_is_timed_beside_a_plain_step(tmp_path):
    """Each executed schedule's steps follow plain steps: its row has its time in plain steps
    (the table's ``meas / plain``, the CSV's and MLflow's ``measured_over_plain``), which the
    machine's drift between rows does not move; the plain row itself has none."""
    import statistics

    cfg = dataclasses.replace(_cfg(tmp_path), n_steps=3, warmup=1, context_rounds=2)
    rec = Recorder()
    rows = run_pipeline(cfg, rec, prepare(cfg))
    ref, row = rows[0], {r.label: r for r in rows}["checkpoint_all"]
    assert ref.status == "reference" and ref.measured_over_plain is None
    ex = row.execution
    assert len(ex.plain_beside_s) == len(ex.step_times_s) == 3 and row.grads_match is True
    pairs = zip(ex.step_times_s, ex.plain_beside_s, strict=True)
    assert row.measured_over_plain == statistics.median(t / p for t, p in pairs)
    assert rec.metrics_["checkpoint_all/measured_over_plain"] == row.measured_over_plain
    assert "meas / plain" in format_table(rows).splitlines()[0]
    line = next(x for x in format_table(rows).splitlines() if x.startswith("checkpoint_all"))
    assert f" {row.measured_over_plain:.3f} " in line
    assert "measured_over_plain" in table_csv(rows).splitlines()[0]
    assert "meas / plain" not in format_table([ref]).splitlines()[0]
    # the prediction in plain steps: over the plain step beside its timing in context
    assert row.context_plain_time_s > 0
    assert row.predicted_over_plain == row.predicted_time_s / row.context_plain_time_s
    assert f" {row.predicted_over_plain:.3f} " in line
    assert rec.metrics_["checkpoint_all/predicted_over_plain"] == row.predicted_over_plain


def test_without_rounds_the_prediction_is_in_keep_everything_predictions(tmp_path):
    """With no rounds in context (``context_rounds=0``) a row's ``pred / plain`` is its
    prediction over keep-everything's on the same costs (keep-everything measures as one plain
    step), so prediction and measurement are compared from one run; keep-everything's own is
    1 and a recomputing schedule's is above it."""
    cfg = dataclasses.replace(
        _cfg(tmp_path, mem="90%"),
        context_rounds=0,
        n_steps=1,
        warmup=0,
        strategies=("checkpoint_all", "chen_sqrtn"),
    )
    rows = {r.label: r for r in run_pipeline(cfg, Recorder(), prepare(cfg))}
    keep, chen = rows["checkpoint_all"], rows["chen_sqrtn"]
    assert chen.context_plain_time_s is None and chen.keep_all_time_s == keep.keep_all_time_s
    assert keep.predicted_over_plain == pytest.approx(1.0, rel=1e-12)
    assert chen.predicted_over_plain == chen.predicted_time_s / keep.predicted_time_s > 1.0
    line = next(x for x in format_table(list(rows.values())).splitlines() if x.startswith("chen"))
    assert "pred / plain" in format_table(list(rows.values())).splitlines()[0]
    assert f" {chen.predicted_over_plain:.3f} " in line
