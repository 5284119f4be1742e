"""Reading files users bring (graphs, profiles) as data: JSON only, never pickle or code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, what: str, error: type[Exception]) -> Any:
    """Parse the JSON file at ``path``; any failure raises ``error`` with one line naming the
    file and, for bad JSON, the line and column (``what``: e.g. "graph", "profile")."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{p}: {what} file does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{p}: cannot read {what} file: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(
            f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
