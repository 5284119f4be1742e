"""Helpers shared by the tests: small graphs, the CLI in a subprocess, a recording tracker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from xengine.config import RunConfig
from xengine.graph.synthetic import training_graph
from xengine.graph.types import CopyModel, Graph

RESIDUAL = [(0, 1), (1, 2), (2, 3), (0, 3)]
INCEPTION = [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)]
DOUBLE_SKIP = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 2), (2, 4)]


def copy_models(devices, latency_s: float = 0.01, bandwidth: float = 1e18) -> dict:
    return {(a, b): CopyModel(latency_s, bandwidth) for a in devices for b in devices if a != b}


def random_graph(
    seed: int, devices=("a", "b"), latency_s: float = 0.05, states: bool = False
) -> Graph:
    """A small training graph with random bytes and random per-device costs; with ``states``,
    in the captured graphs' form: random autograd states (some zero, some larger than the
    value, as max-pool indices are) and values kept for backward only where saved."""
    r = np.random.default_rng(seed)
    shapes = [
        (3, [(0, 1), (1, 2)]),
        (4, RESIDUAL),
        (5, INCEPTION),
        (5, DOUBLE_SKIP),
    ]
    nf, fe = shapes[seed % len(shapes)]
    return training_graph(
        f"rand{seed}",
        fe,
        nf,
        list(r.integers(1, 5, nf) * 1000),
        {d: list(np.round(r.uniform(0.5, 2.0, nf), 3)) for d in devices},
        saves_input=bool(seed % 2),
        copy_models=copy_models(devices, latency_s=latency_s, bandwidth=1e6),
        state_bytes=list(r.choice([0, 500, 3000], nf)) if states else None,
        saves_output=list(r.random(nf) < 0.5) if states else None,
    )


REPO = Path(__file__).resolve().parents[1]


def cli_command(tmp_path: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    """``run.py`` with its results and MLflow store under ``tmp_path``, and its environment."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    cmd = [
        sys.executable,
        str(REPO / "run.py"),
        f"results_dir={tmp_path / 'results'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        *args,
    ]
    return cmd, env


def run_cli(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd, env = cli_command(tmp_path, *args)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
    )


class Recorder:
    """A tracker that keeps what it is given."""

    def __init__(self):
        self.metrics_, self.tags_, self.artifacts = {}, {}, {}

    def metrics(self, values):
        self.metrics_.update(values)

    def tags(self, values):
        self.tags_.update(values)

    def json_artifact(self, data, artifact_file):
        self.artifacts[artifact_file] = data

    def text_artifact(self, text, artifact_file):
        self.artifacts[artifact_file] = text

    def file_artifact(self, path, artifact_path=None):
        self.artifacts[Path(path).name] = Path(path).read_text()


def tiny_run(
    tmp_path: Path,
    strategies: tuple[str, ...] = ("checkpoint_all",),
    mem: str = "100%",
    batch_size: int = 2,
    image_size: int = 32,
) -> RunConfig:
    """The tiny net, one step per schedule, a quick profile cached under ``tmp_path``."""
    return RunConfig(
        net="tiny",
        batch_size=batch_size,
        image_size=image_size,
        num_classes=10,
        mem=(mem,),
        strategies=strategies,
        n_steps=1,
        warmup=0,
        profile_repeats=1,
        profile_warmup=0,
        profile_cache_dir=str(tmp_path / "profiles"),
        progress=False,
    )
