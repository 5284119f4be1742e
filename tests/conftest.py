"""Fixtures shared by the test modules."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An initialised, empty MLflow SQLite store: creating one runs ~80 schema migrations
    (seconds), so tests that record a run start from a copy of this one."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def store(tmp_path, empty_store) -> Path:
    db = tmp_path / "mlflow.db"
    shutil.copy(empty_store, db)
    return db


@pytest.fixture
def uri(store: Path) -> str:
    """The tracking URI of ``store`` (a fresh copy of the empty store in ``tmp_path``)."""
    return f"sqlite:///{store}"


@pytest.fixture(autouse=True)
def _heuristics_computed_anew():
    """Each test computes its heuristics itself: the per-process memo of
    :func:`baselines.heuristics.computed_once` would otherwise carry one test's result (or its
    time limit's effect) into another."""
    from baselines.heuristics import forget

    forget()
    yield
