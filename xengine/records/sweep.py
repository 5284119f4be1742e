"""Resumable sweeps on MLflow (docs/design.md section 9).

A sweep point is identified by the *fingerprint* of its resolved config: the config with the
keys that do not change the result (where outputs go, how chatty the console is, the tracking
store itself) removed, serialised with sorted keys and hashed. ``run.py`` tags every run with
``xe.fingerprint`` and, before doing any work, asks :func:`find_finished_run` whether a run
with the same fingerprint already finished; if so the point is skipped (unless ``redo=true``).

All points of one Hydra multirun hang under one *parent run* (:func:`parent_run_for_sweep`),
keyed by the sweep id (the sweep's output folder): children are created with the tag
``mlflow.parentRunId`` and the MLflow UI groups them under it. :class:`SweepCallback`
(``hydra.callbacks``) creates the store, the experiment and the parent run in the launching
process before any job starts - which also keeps parallel jobs (submitit, joblib) from racing
on a fresh SQLite store's schema migration - and closes the parent with a summary when the
sweep ends.

Library functions take an :class:`mlflow.MlflowClient`; only :class:`SweepCallback` reads a
Hydra config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

FINGERPRINT_TAG = "xe.fingerprint"
SWEEP_ID_TAG = "xe.sweep_id"
ROLE_TAG = "xe.role"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag for nested runs (UI grouping)

VOLATILE_KEYS: tuple[str, ...] = (
    "hydra",
    "results_dir",
    "log_level",
    "tracking",
    "redo",
    "profile.cache_dir",
    "profile.progress",
)
"""Dotted keys (a key drops its whole subtree) that never change what a run computes."""

BAD_STATUSES = frozenset({"error", "killed", "wrong"})
"""``xe.status`` values of runs that must be redone even when MLflow says FINISHED (``wrong``:
an executed schedule gave a wrong answer, see ``xengine.result.run_status``)."""


# ------------------------------------------------------------------------------ fingerprint
def _drop(node: Any, path: tuple[str, ...]) -> None:
    if not isinstance(node, dict) or not path:
        return
    head, *rest = path
    if not rest:
        node.pop(head, None)
    else:
        _drop(node.get(head), tuple(rest))


def _plain(node: Any) -> Any:
    """Dicts and lists of JSON scalars, with tuples as lists and other objects as strings."""
    if isinstance(node, Mapping):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    return str(node)


def config_fingerprint(
    resolved_cfg: Mapping[str, Any], volatile: Iterable[str] = VOLATILE_KEYS
) -> str:
    """A stable 16-hex-digit hash of ``resolved_cfg`` without the ``volatile`` dotted keys.

    ``resolved_cfg`` is the plain resolved config
    (``OmegaConf.to_container(cfg, resolve=True)``). Key order does not matter; values do,
    including their types (``1`` and ``"1"`` differ).

    :param resolved_cfg: nested mapping of the resolved config.
    :param volatile: dotted keys to leave out (a key drops its whole subtree).
    :return: the fingerprint, e.g. ``"3f2a9c0d1b7e4a55"``.
    """
    data = _plain(resolved_cfg)
    for key in volatile:
        _drop(data, tuple(key.split(".")))
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------ store helpers
def _experiment_id(client: Any, experiment: str, create: bool = False) -> str | None:
    """The id of the experiment named ``experiment`` (or with that id); created on request."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(experiment)
    if exp is None and experiment.isdigit():
        try:
            exp = client.get_experiment(experiment)
        except MlflowException:
            exp = None
    if exp is not None:
        return exp.experiment_id
    if not create:
        return None
    from xengine.records.tracking import artifact_location_for

    uri = str(getattr(client, "tracking_uri", ""))
    try:
        return client.create_experiment(experiment, artifact_location=artifact_location_for(uri))
    except MlflowException:  # created meanwhile by another process
        return client.get_experiment_by_name(experiment).experiment_id


def ensure_store(uri: str, experiment: str) -> str:
    """Create the tracking store (schema migrations of a fresh SQLite file) and the
    experiment if needed; return the experiment id. Run it once before parallel jobs start.
    """
    from xengine.records.tracking import open_client

    return _experiment_id(open_client(uri), experiment, create=True)


def _store_lock(client: Any) -> AbstractContextManager[Any]:
    """The store's lock (:func:`xengine.records.tracking.store_lock`), so that jobs of a sweep
    that look for the parent at the same time make only one. A tracking server gets no lock:
    there :class:`SweepCallback` makes the parent before the jobs start (or the convergence
    rule of :func:`parent_run_for_sweep` applies)."""
    from xengine.records.tracking import store_lock

    return store_lock(str(getattr(client, "tracking_uri", "")))


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


# ------------------------------------------------------------------------------ resuming
def find_finished_run(client: Any, experiment: str, fingerprint: str) -> str | None:
    """The newest run of ``experiment`` (name or id) that FINISHED with tag
    ``xe.fingerprint == fingerprint`` and whose ``xe.status`` is not in :data:`BAD_STATUSES`.

    :return: its run id, or None (also when the experiment does not exist yet).
    """
    exp_id = _experiment_id(client, experiment)
    if exp_id is None:
        return None
    runs = client.search_runs(
        [exp_id],
        filter_string=(
            f"tags.`{FINGERPRINT_TAG}` = '{_quote(fingerprint)}' and attributes.status = 'FINISHED'"
        ),
        order_by=["attributes.start_time DESC"],
        max_results=50,
    )
    for run in runs:
        if run.data.tags.get("xe.status", "") not in BAD_STATUSES:
            return run.info.run_id
    return None


# ------------------------------------------------------------------------------ parent runs
def _sweep_parents(client: Any, exp_id: str, sweep_id: str) -> list[Any]:
    runs = client.search_runs(
        [exp_id],
        filter_string=(
            f"tags.`{SWEEP_ID_TAG}` = '{_quote(sweep_id)}' and tags.`{ROLE_TAG}` = 'sweep'"
        ),
        max_results=100,
    )
    return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))


def parent_run_for_sweep(
    client: Any,
    experiment: str,
    sweep_id: str,
    *,
    keep_open: bool = False,
    run_name: str | None = None,
) -> str:
    """The parent run of the sweep ``sweep_id`` in ``experiment``: found, or created.

    Children are started with the tag ``mlflow.parentRunId`` set to the returned id
    (``MlflowTracker(..., tags={"mlflow.parentRunId": parent})``). A parent created here is
    marked FINISHED at once unless ``keep_open`` (then :func:`finish_sweep` closes it; that
    is what :class:`SweepCallback` does). Parallel callers on a SQLite store make one parent
    (a file lock beside the database); on a tracking server a caller that finds an older
    parent after making its own deletes its own (best effort: a caller that looked before
    the other one wrote may keep a second parent; :class:`SweepCallback` avoids the race).

    :param client: an :class:`mlflow.MlflowClient`.
    :param experiment: experiment name (or id); created when missing.
    :param sweep_id: any string that names the sweep (``run.py`` uses the sweep folder).
    :param keep_open: leave a newly created parent RUNNING.
    :param run_name: name of a new parent (default ``sweep <last part of sweep_id>``).
    :return: the parent's run id.
    """
    with _store_lock(client):
        exp_id = _experiment_id(client, experiment, create=True)
        found = _sweep_parents(client, exp_id, sweep_id)
        if found:
            return found[0].info.run_id
        name = run_name or "sweep " + "/".join(sweep_id.rstrip("/").split("/")[-2:])
        tags = {SWEEP_ID_TAG: sweep_id, ROLE_TAG: "sweep", "xe.task": "sweep"}
        mine = client.create_run(exp_id, run_name=name, tags=tags).info.run_id
        found = _sweep_parents(client, exp_id, sweep_id)
    chosen = found[0].info.run_id if found else mine
    if chosen != mine:
        log.info("sweep %s: parent %s made by another job; deleting %s", sweep_id, chosen, mine)
        client.delete_run(mine)
        return chosen
    if not keep_open:
        client.set_terminated(mine, "FINISHED")
    log.info("sweep %s: parent run %s", sweep_id, mine)
    return mine


def sweep_children(client: Any, parent_run_id: str) -> list[Any]:
    """Runs whose ``mlflow.parentRunId`` is ``parent_run_id``."""
    parent = client.get_run(parent_run_id)
    return client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{_quote(parent_run_id)}'",
        max_results=50000,
    )


def adopt_orphans(client: Any, parent_run_id: str) -> int:
    """Give the parent's tag to the points of its sweep that carry the sweep id but no parent
    (a job that could not reach the store when it looked for the parent still runs, and
    tags its sweep id), so that the sweep's summary counts every point that ran; return how
    many were adopted."""
    parent = client.get_run(parent_run_id)
    sweep_id = parent.data.tags.get(SWEEP_ID_TAG)
    if sweep_id is None:
        return 0
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{SWEEP_ID_TAG}` = '{_quote(sweep_id)}'",
        max_results=50000,
    )
    orphans = [
        r for r in runs if r.data.tags.get(ROLE_TAG) != "sweep" and PARENT_TAG not in r.data.tags
    ]
    for run in orphans:
        client.set_tag(run.info.run_id, PARENT_TAG, parent_run_id)
    if orphans:
        log.warning(
            "sweep %s: %d point(s) had not found the parent run; now under %s",
            sweep_id,
            len(orphans),
            parent_run_id,
        )
    return len(orphans)


def finish_sweep(client: Any, parent_run_id: str) -> dict[str, int]:
    """Tag the parent with counts of its children by ``xe.status`` (``xe.n_runs``,
    ``xe.n_ok``, ``xe.n_error``, ...) in one write and mark it FINISHED; return the counts.
    Points of the sweep that had not found the parent are adopted first."""
    from mlflow.entities import RunTag

    adopt_orphans(client, parent_run_id)
    children = sweep_children(client, parent_run_id)
    counts = Counter(r.data.tags.get("xe.status", r.info.status.lower()) for r in children)
    summary = {"n_runs": sum(counts.values()), **{f"n_{k}": v for k, v in counts.items()}}
    client.log_batch(parent_run_id, tags=[RunTag(f"xe.{k}", str(v)) for k, v in summary.items()])
    client.set_terminated(parent_run_id, "FINISHED", end_time=int(time.time() * 1000))
    return summary


STORE_ATTEMPTS = 4
"""Tries of a sweep's own store writes (the parent and its summary) before giving up."""

STORE_RETRY_S = 3.0
"""Wait between those tries: a store may be busy for a moment (a SQLite file that another
process, not this project's, is still migrating; "database is locked" past SQLite's 5 s busy
timeout), a tracking server may be restarting."""


def with_retries(what: str, call: Callable[[], T]) -> T:
    """``call()``, tried :data:`STORE_ATTEMPTS` times :data:`STORE_RETRY_S` apart; the last
    error is raised. A point whose parent lookup fails once would otherwise run unparented,
    and a summary that fails once would be lost."""
    for attempt in range(1, STORE_ATTEMPTS + 1):
        try:
            return call()
        except Exception as exc:
            if attempt == STORE_ATTEMPTS:
                raise
            log.info("%s failed (%s); trying again in %.0f s", what, exc, STORE_RETRY_S)
            time.sleep(STORE_RETRY_S)
    raise AssertionError("unreachable")  # pragma: no cover


# ------------------------------------------------------------------------------ Hydra hook
try:
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # pragma: no cover - hydra is a dependency
    _Callback = object  # type: ignore[assignment,misc]


def sweep_id_of(hydra_cfg: Any) -> str:
    """The id a sweep's parent run carries: the sweep's output folder."""
    return str(hydra_cfg.sweep.dir)


def sweep_size(hydra_cfg: Any) -> int | None:
    """How many points Hydra's basic sweeper makes of this multirun: the product of the sweep
    values of ``hydra.sweeper.params`` and the command line (which wins for the same key), as
    the sweeper itself expands them (one point per combination of the discrete sweeps), with
    Hydra's public override parser. ``None`` when they cannot be parsed here."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = hydra_cfg.sweeper.get("params") or {}
        overrides = [f"{k}={v}" for k, v in params.items()]
        overrides += list(hydra_cfg.overrides.task)
        counts: dict[str, int] = {}
        for o in OverridesParser.create().parse_overrides(overrides):
            sweep = o.is_sweep_override() and o.is_discrete_sweep()
            counts[o.get_key_element()] = len(list(o.sweep_string_iterator())) if sweep else 1
        return math.prod(counts.values())
    except Exception as exc:  # a progress line is not worth failing a sweep for
        log.debug("sweep size unknown: %s", exc)
        return None


SWEEP_SIZE_ENV = "XENGINE_SWEEP_SIZE"


_OPEN_PARENT: list[tuple[str, str]] = []
"""(tracking URI, run id) of the sweep parent this process opened and has not closed."""


def kill_open_sweep() -> None:
    """Mark the sweep parent that this process opened ``KILLED`` (an interrupted sweep: its
    points that had not finished run again when it is resumed)."""
    while _OPEN_PARENT:
        uri, run_id = _OPEN_PARENT.pop()
        try:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            client.set_tag(run_id, "xe.status", "killed")
            client.set_terminated(run_id, "KILLED")
        except Exception as exc:  # never hide the interrupt behind a tracking error
            log.warning("could not close the sweep's parent run %s: %s", run_id, exc)


class SweepCallback(_Callback):
    """``hydra.callbacks.sweep._target_=xengine.records.sweep.SweepCallback``.

    On multirun start (in the launching process, before any job): count the points, create the
    store, the experiment and the sweep's parent run. On each job's start: log "sweep point k
    of N". On multirun end: close the parent with a summary (delete it when it has no child: a
    resumed sweep whose points had all finished). Tracking steps do nothing when
    ``tracking.enabled`` is false.
    """

    def __init__(self) -> None:
        self._uri: str | None = None
        self._experiment = ""
        self._sweep_id = ""
        self._parent: str | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        import os

        from mlflow import MlflowClient
        from omegaconf import OmegaConf

        from xengine.records.tracking import resolve_tracking_uri

        n = sweep_size(OmegaConf.select(config, "hydra"))
        if n is not None:
            # jobs in other processes (submitit) inherit the count through the environment
            os.environ[SWEEP_SIZE_ENV] = str(n)
            log.info("sweep of %d point(s) into %s", n, sweep_id_of(config.hydra))
        if not config.tracking.enabled:
            return
        self._uri = resolve_tracking_uri(config.tracking.uri, config.results_dir)
        self._experiment = str(config.tracking.experiment)
        self._sweep_id = sweep_id_of(config.hydra)
        uri = self._uri

        def make() -> str:
            ensure_store(uri, self._experiment)
            client = MlflowClient(tracking_uri=uri)
            return parent_run_for_sweep(client, self._experiment, self._sweep_id, keep_open=True)

        try:
            self._parent = with_retries("making the sweep's parent run", make)
            _OPEN_PARENT.append((self._uri, self._parent))
        except Exception as exc:  # tracking trouble must not stop the sweep
            log.warning("could not create the sweep's parent run: %s", exc)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        import os

        from hydra.core.hydra_config import HydraConfig

        try:
            hc = HydraConfig.get()
        except ValueError:
            return
        if hc.mode is None or hc.mode.name != "MULTIRUN":
            return
        k = int(hc.job.num) + 1
        n = os.environ.get(SWEEP_SIZE_ENV)
        where = f"{k} of {n} ({int(n) - k} after this one)" if n else f"{k}"
        log.info("sweep point %s: %s", where, " ".join(hc.overrides.task) or "(defaults)")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self._uri is None:
            return
        _OPEN_PARENT.clear()
        from mlflow import MlflowClient

        try:
            client = MlflowClient(tracking_uri=self._uri)
            if self._parent is None:  # not made at the start: the one the jobs found or made
                self._parent = parent_run_for_sweep(client, self._experiment, self._sweep_id)
            parent = self._parent
            summary = with_retries(
                "closing the sweep's parent run", lambda: finish_sweep(client, parent)
            )
            if summary["n_runs"] == 0:  # every point had finished before: an empty parent
                client.delete_run(self._parent)
                log.info("sweep: every point had already finished; no parent run kept")
            else:
                log.info("sweep parent run %s: %s", self._parent, summary)
        except Exception as exc:
            log.warning("could not close the sweep's parent run %s: %s", self._parent, exc)


__all__ = [
    "FINGERPRINT_TAG",
    "PARENT_TAG",
    "STORE_ATTEMPTS",
    "SWEEP_ID_TAG",
    "SWEEP_SIZE_ENV",
    "VOLATILE_KEYS",
    "SweepCallback",
    "adopt_orphans",
    "config_fingerprint",
    "ensure_store",
    "find_finished_run",
    "finish_sweep",
    "kill_open_sweep",
    "parent_run_for_sweep",
    "sweep_children",
    "sweep_id_of",
    "sweep_size",
    "with_retries",
]
