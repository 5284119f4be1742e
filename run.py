#!/usr/bin/env python
"""Entry point: ``python run.py [net=resnet50] [mem=2GB] [solver=gurobi] ...``.

Before Hydra reads the command line, :func:`xengine.commandline.prepare_argv` checks every
override (one line for a mistake, naming the key as typed) and rewrites the spellings Hydra
cannot take as they are (``mem.cuda=1GB``, ``devices=cpu3+cpu1``). Hydra then composes the
config (``conf/``) and :func:`xengine.job.run_job` runs the point inside one MLflow run and
prints the comparison table on stdout; logs go to stderr and to the run's folder under
``results/runs/``. Bad input ends with one ``error:`` line on stderr and exit code 2 (in a
sweep, ``-m``, the point is recorded as skipped and the sweep goes on).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def _interrupted_while_starting(signum: int, _frame) -> None:  # noqa: ANN001
    """Ctrl-C / SIGTERM while the imports below load (seconds): one line, not a traceback.
    ``__main__`` installs the run's own handlers once they are loaded."""
    name = signal.Signals(signum).name
    sys.stderr.write(f"interrupted: {name} while starting; nothing is recorded\n")
    os._exit(128 + signum)


if __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _interrupted_while_starting)


import hydra
from omegaconf import DictConfig, OmegaConf

from xengine import interrupt
from xengine.commandline import prepare_argv
from xengine.config import ConfigError
from xengine.job import fail, interrupted, run_job

REPO = Path(__file__).resolve().parent
OmegaConf.register_new_resolver("xe_repo", lambda: str(REPO), replace=True)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    interrupt.install()
    try:
        try:
            sys.argv[1:] = prepare_argv(sys.argv[1:], REPO / "conf")
        except ConfigError as exc:
            fail(str(exc))
        main()
    except KeyboardInterrupt as exc:
        interrupted(exc)
