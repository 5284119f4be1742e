"""MLflow glue: one MLflow run per ``run.py`` invocation (docs/design.md section 9).

The tracking store defaults to SQLite under ``results/`` (embedded, no server to start) with
artifacts beside it in ``results/mlartifacts``; ``tracking.uri=...`` or the environment
variable ``MLFLOW_TRACKING_URI`` point it elsewhere (a tracking server works the same). The
config key wins over the environment, which wins over the default.

What a run holds:

* params: the resolved config, flattened to dotted keys (``net.name``, ``solver.time_limit_s``);
  ``run.py`` adds ``mem`` (the budgets as one text: ``70%`` or ``cpu2=1GB,cpu1=2GB``) and
  ``devices`` (``cpu2+cpu1``) when the config holds them as groups of keys;
* metrics: ``<strategy>/<quantity>_<unit>`` (``checkmate/predicted_time_ms``,
  ``checkmate/measured_peak_mib``, ``checkmate/solve_time_s``, ``checkmate/gap``; with several
  devices ``xengine/predicted_peak_mib.<device>``, ...), ``graph/...``, ``protocol/...``, and
  with several devices ``xengine/gain_vs_best_single`` (a fraction, predicted) and
  ``xengine/measured_gain_vs_best_single``;
* tags (prefix ``xe.``): ``xe.status`` (ok | partial | error | skipped), one
  ``xe.status.<strategy>`` per row, ``xe.note.<strategy>`` for errors, ``xe.profile_source`` /
  ``xe.profile_key`` / ``xe.profile_file`` for the profile used; with several devices
  ``xe.best_single``, ``xe.infeasible_single`` (row labels, or ``none``), ``xe.warm_start``;
* artifacts: ``config.yaml`` (composed config), ``hydra/`` (Hydra's own record of the job),
  ``schedules/<strategy>.json``, ``figures/<strategy>_memory.png`` and
  ``figures/<strategy>_R.png`` (:mod:`xengine.records.plots`), ``table.csv``, ``profile.json``, the
  job's log file.

This module and ``run.py`` are the only ones that know Hydra/OmegaConf.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_PARAM_CHARS = 6000
MAX_TAG_CHARS = 5000
_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")


def default_tracking_uri(results_dir: str | Path) -> str:
    return f"sqlite:///{Path(results_dir).resolve() / 'mlflow.db'}"


def resolve_tracking_uri(configured: str | None, results_dir: str | Path) -> str:
    """``tracking.uri`` if set, else ``$MLFLOW_TRACKING_URI``, else SQLite under results/."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(results_dir)


def artifact_location_for(uri: str) -> str | None:
    """Artifacts of a SQLite store go to ``mlartifacts/`` beside the database file; a server
    decides for itself (None)."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        return (db.parent / "mlartifacts").resolve().as_uri()
    return None


def store_lock(uri: str) -> AbstractContextManager[Any]:
    """A lock per SQLite store (a file in the temporary folder, named after the database) for
    this project's processes on one machine; a tracking server needs none."""
    if not uri.startswith("sqlite:///"):
        return nullcontext()
    import hashlib
    import tempfile

    from filelock import FileLock

    db = str(Path(uri[len("sqlite:///") :]).resolve())
    name = f"xe-store-{hashlib.sha256(db.encode()).hexdigest()[:16]}.lock"
    return FileLock(str(Path(tempfile.gettempdir()) / name), timeout=120)


def create_store(uri: str) -> None:
    """Make a missing SQLite store whole before anything opens it.

    MLflow creates the file and migrates its schema in place, so two processes that open a
    fresh store at once break it: of 8 pairs started together here, one of the pair failed
    in 6 and both in 2, leaving ``_alembic_tmp_*`` tables on which every later run into that
    store fails. So the schema is made in a file of another name, which is then linked into
    place (a link never overwrites), under :func:`store_lock`: the store appears complete
    or not at all. A server URI, or a file that exists, is left alone."""
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri[len("sqlite:///") :])
    if db.exists():
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    from mlflow import MlflowClient

    with store_lock(uri):
        if db.exists():
            return
        tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
            try:
                os.link(tmp, db)
            except FileExistsError:
                pass  # made meanwhile by a process that does not take the lock (mlflow ui)
            except OSError:  # no hard links on this file system: a rename, under the lock
                if not db.exists():
                    os.replace(tmp, db)
        finally:
            tmp.unlink(missing_ok=True)
        log.info("made the tracking store %s", db)


def open_client(uri: str) -> Any:
    """An :class:`mlflow.MlflowClient` on ``uri``, the store made whole first
    (:func:`create_store`): every process of this project opens its store through here."""
    from mlflow import MlflowClient

    create_store(uri)
    return MlflowClient(tracking_uri=uri)


def flatten_config(cfg: Any) -> dict[str, str]:
    """Resolved config as ``{"net.name": "resnet18", "strategy": "checkmate,chen_sqrtn", ...}``."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, (list, tuple)):
            out[prefix] = ",".join(str(x) for x in node)
        else:
            out[prefix] = "null" if node is None else str(node)

    walk("", data)
    return out


def config_yaml(cfg: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)


def _key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", key)[:250]


def _git_commit(repo: Path) -> dict[str, str]:
    """Commit and dirtiness of the code that ran (read-only git queries)."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"xe.git_commit": commit, "xe.git_dirty": str(bool(dirty)).lower()}


class MlflowTracker:
    """A context manager around one MLflow run; the methods log into it right away.

    It uses an explicit :class:`mlflow.MlflowClient` (no global active run), so a crash in one
    job of a sweep cannot leave a run "active" for the next job. On exit the run is marked
    FINISHED, or FAILED (an exception) or KILLED (Ctrl-C), and ``xe.status`` says why.
    """

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        tags: Mapping[str, str] | None = None,
        repo: Path | None = None,
        console_level: int = logging.WARNING,
    ) -> None:
        self.uri = uri
        self.experiment = experiment
        self.run_name = run_name
        self._tags = dict(tags or {})
        self._repo = repo
        self._console_level = console_level
        self.run_id: str | None = None
        self.client: Any = None

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> MlflowTracker:
        from mlflow.exceptions import MlflowException

        # MLflow configures its own stderr handler when imported; keep it as quiet as ours
        # (it would announce database creation and migrations on every fresh store).
        logging.getLogger("mlflow").setLevel(max(self._console_level, logging.INFO))
        logging.getLogger("alembic").setLevel(max(self._console_level, logging.INFO))
        self.client = open_client(self.uri)
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(
                    self.experiment, artifact_location=artifact_location_for(self.uri)
                )
            except MlflowException:  # another job of a sweep created it first
                exp_id = self.client.get_experiment_by_name(self.experiment).experiment_id
        else:
            exp_id = exp.experiment_id
        from xengine import __version__

        tags = {"xe.version": __version__, **self._tags}
        if self._repo is not None:
            tags.update(_git_commit(self._repo))
        run = self.client.create_run(exp_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        log.info(
            "MLflow run %s (%s) in %s, experiment %r",
            self.run_id,
            self.run_name,
            self.uri,
            self.experiment,
        )
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self.run_id is None:
            return False
        try:
            if exc_type is None:
                status = "FINISHED"
            elif issubclass(exc_type, KeyboardInterrupt):
                status = "KILLED"
                self.tags({"xe.status": "killed"})
            else:
                status = "FAILED"
                self.tags({"xe.status": "error", "xe.error": f"{exc_type.__name__}: {exc}"})
            self.client.set_terminated(self.run_id, status)
        except Exception as err:  # never hide the original error behind a tracking one
            log.warning("could not close MLflow run %s: %s", self.run_id, err)
        return False

    # ---------------------------------------------------------------- logging
    def params(self, values: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(_key(k), str(v)[:MAX_PARAM_CHARS]) for k, v in values.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def metrics(self, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_key(k), float(v), now, 0) for k, v in values.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def tags(self, values: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(_key(k), str(v)[:MAX_TAG_CHARS]) for k, v in values.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, tags=items[i : i + 100])

    def json_artifact(self, data: Any, artifact_file: str) -> None:
        self.client.log_text(self.run_id, json.dumps(data, indent=1), artifact_file)

    def text_artifact(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def file_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def dir_artifacts(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(path), artifact_path)

    def figure(self, fig: Any, artifact_file: str) -> None:
        """A matplotlib figure as a PNG (the caller closes it)."""
        self.client.log_figure(self.run_id, fig, artifact_file)
