"""Whose mistake a capture failure is (issue 27, docs/design.md section 10): a model that
fails on its own example batch is the user's (one ``GraphError`` line, exit 2); our replay of
an op failing on a model that runs is ours (``InternalError``: exit 3, a line that says so,
the traceback in the run's log file)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import cli_command
from xengine.graph.capture import OpSpec, trace
from xengine.graph.types import GraphError, InternalError


class _WrongWidth(nn.Module):
    """Its second layer expects 7 features and gets 5: the model itself fails."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(7, 2)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_model_that_fails_on_its_batch_is_the_users_mistake():
    with pytest.raises(GraphError, match="the model fails on the example batch at op 'b'"):
        trace(_WrongWidth(), torch.randn(4, 3), torch.zeros(4, dtype=torch.long))


def _broken_bind(self, root):
    def run(leaves, x):
        raise RuntimeError("replay broke")

    return run


def test_a_failing_replay_of_a_model_that_runs_is_ours(monkeypatch):
    monkeypatch.setattr(OpSpec, "bind", _broken_bind)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    with pytest.raises(InternalError, match="failed although the model runs.*replay broke"):
        trace(model, torch.randn(4, 3), torch.zeros(4, dtype=torch.long))


_PATCHED_RUN = """
import runpy, sys
from xengine.graph.capture import OpSpec

def bind(self, root):
    def run(leaves, x):
        raise RuntimeError("replay broke")
    return run

OpSpec.bind = bind  # our capture breaks; the model itself is fine
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_cli_reports_our_failure_as_ours_with_the_traceback_in_the_log(tmp_path):
    cmd, env = cli_command(tmp_path, "net=tiny", "net.batch_size=2", "net.image_size=32")
    proc = subprocess.run(
        [sys.executable, "-c", _PATCHED_RUN, *cmd[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 3, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("internal error (a bug in xengine, not in your input): "), last
    assert "Traceback" not in proc.stderr  # one line on the terminal
    log = Path(re.search(r"the traceback is in (\S+\.log)", last).group(1))
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: replay broke" in text
