"""What every benchmark script writes the same way: its rows as CSV and the commit that made
them.

The long sweeps rewrite their CSV whole after every unit of work (a net, a solve), so a run
that is stopped or fails later keeps everything it measured; one writer here keeps the column
order and the empty cells in one place.
"""

from __future__ import annotations

import csv
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def columns(rows: Iterable[dict]) -> list[str]:
    """Every key of ``rows``, in the order it first appears (rows of one file may differ:
    a failed net's row has no measurements)."""
    return list(dict.fromkeys(k for r in rows for k in r))


def write_csv(
    path: Path, rows: Sequence[dict], fields: Sequence[str] | None = None, *, only: bool = False
) -> Path:
    """Write ``rows`` to ``path`` (its folder made), replacing what was there.

    ``fields`` fixes the columns (default: :func:`columns`); ``only`` drops keys outside
    them, where a row carries private data (e.g. a schedule) next to its figures. A key
    outside ``fields`` is otherwise an error, as in :class:`csv.DictWriter`. A missing key,
    or None, is an empty cell."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(fields) if fields is not None else columns(rows)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore" if only else "raise")
        w.writeheader()
        w.writerows(rows)
    return path


def commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it, ``unknown``
    outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (sha or "unknown") + ("+dirty" if dirty else "")
