"""``task=max_batch`` (xengine/max_batch.py): the largest batch per strategy within a budget,
searched on graphs captured at each batch, executed at the answer, recorded and drawn."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.helpers import run_cli
from xengine.config import ConfigError, RunConfig
from xengine.max_batch import search_largest
from xengine.profile.workspace import capture_net
from xengine.simulate import keep_all_peak_bytes

REPO = Path(__file__).resolve().parents[1]
BUDGET_BYTES = 2_000_000  # mem=2MB: tiny's plain step fits batch 7, not 8 (checked below)


@pytest.mark.parametrize(
    ("threshold", "limit", "expected"),
    [
        (7, 512, (7, 8)),
        (1, 512, (1, 2)),
        (0, 512, (0, 1)),
        (600, 512, (512, None)),
        (300, 300, (300, None)),
        (299, 300, (299, 300)),
        (64, 512, (64, 65)),
    ],
)
def test_the_search_doubles_then_bisects_to_the_exact_threshold(threshold, limit, expected):
    asked = []

    def fits(b: int) -> bool:
        asked.append(b)
        return b <= threshold

    assert search_largest(fits, limit) == expected
    assert len(asked) == len(set(asked))  # no batch is tried twice
    assert max(asked) <= limit


def test_max_batch_needs_one_device_an_absolute_budget_and_our_strategies():
    base = {"task": "max_batch", "net": "tiny"}
    with pytest.raises(ConfigError, match="needs an absolute budget"):
        RunConfig(**base, mem=("70%",)).validate()
    with pytest.raises(ConfigError, match="runs on one device"):
        RunConfig(**base, devices=("cpu2", "cpu1"), mem=("2MB",)).validate()
    with pytest.raises(ConfigError, match="torch_sac measure every level"):
        RunConfig(**base, mem=("2MB",), strategies=("checkmate", "torch_sac")).validate()
    with pytest.raises(ConfigError, match="give net=, not graph="):
        RunConfig(**base, mem=("2MB",), graph_path="g.json").validate()
    with pytest.raises(ConfigError, match="task='batch' is not one of"):
        RunConfig(task="batch").validate()


def test_largest_batches_on_the_command_line_are_searched_executed_and_recorded(tmp_path):
    """tiny at 2 MB: plain PyTorch's largest batch is the last whose keep-everything peak
    (a plain step's) fits, measured there within 1 % of it; every strategy's answer fits by
    the simulator, is executed with a plain step's gradients, and is at least plain's (a
    strategy can always keep everything); the answers are MLflow metrics and a CSV."""
    proc = run_cli(
        tmp_path,
        "experiment=max_batch",
        "net=tiny",
        "mem=2MB",
        "strategy=[checkmate,checkpoint_all,chen_sqrtn]",
        "n_steps=1",
        "profile.repeats=1",
        "profile.warmup=0",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines() if ln.strip()}
    plain = int(lines["pytorch"][1])
    fits = [keep_all_peak_bytes(capture_net("tiny", b).graph) for b in (plain, plain + 1)]
    assert fits[0] <= BUDGET_BYTES < fits[1]
    measured_plain_mib = float(lines["pytorch"][6])
    assert abs(measured_plain_mib * 2**20 - fits[0]) <= 0.01 * fits[0]
    for name in ("checkmate", "checkpoint_all", "chen_sqrtn"):
        row = lines[name]
        assert int(row[1]) >= plain and row[3] == "yes", proc.stdout
        assert float(row[5]) * 2**20 <= BUDGET_BYTES * 1.0001  # predicted peak (MiB, rounded)
        assert row[-1] == "yes", proc.stdout  # gradients of a plain step at that batch
        assert float(row[8]) == pytest.approx(int(row[1]) / float(row[7]) * 1e3, rel=0.01)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = [r for r in client.search_runs(["1"]) if r.data.tags.get("xe.kind") == "max_batch"]
    assert run.data.metrics["pytorch/largest_batch"] == plain
    assert run.data.metrics["checkmate/largest_batch_over_plain"] == pytest.approx(
        int(lines["checkmate"][1]) / plain
    )
    assert run.data.tags["xe.experiment"] == "max_batch" and run.data.tags["xe.status"] == "ok"
    csv = client.download_artifacts(run.info.run_id, "largest_batch.csv", str(tmp_path))
    assert Path(csv).read_text().splitlines()[0].startswith("strategy,largest_batch")

    spec = importlib.util.spec_from_file_location("figures", REPO / "experiments" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    sys.modules["figures"] = figures
    spec.loader.exec_module(figures)
    out = tmp_path / "figs"
    (outcome,) = figures.make_figures(
        f"sqlite:///{tmp_path / 'mlflow.db'}", out=out, only=["max_batch"]
    )
    assert not outcome.skipped and (out / "max_batch.png").exists()
    data = (out / "max_batch.csv").read_text()
    assert f"pytorch,{plain}," in data
