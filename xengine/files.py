"""Reading files users bring (graphs, profiles) as data: JSON only, never pickle or code.

A file is refused with one line naming it when it is larger than
:data:`~xengine.limits.MAX_FILE_BYTES`, not UTF-8 text, not JSON, nested deeper than the
parser can follow, or holds an integer of more than :data:`~xengine.limits.MAX_NUMBER_DIGITS`
digits (Python would spend time and memory converting it, and no size or count is that large).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xengine.limits import MAX_FILE_BYTES, MAX_NUMBER_DIGITS
from xengine.units import format_bytes


class _TooManyDigits(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise _TooManyDigits(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def read_json(path: str | Path, what: str, error: type[Exception]) -> Any:
    """Parse the JSON file at ``path``; any failure raises ``error`` with one line naming the
    file and, for bad JSON, the line and column (``what``: e.g. "graph", "profile")."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if p.is_dir():
            raise error(f"{p}: is a folder, not a {what} file")
        if size > MAX_FILE_BYTES:
            raise error(
                f"{p}: {what} file is {format_bytes(size)}, above the limit of "
                f"{format_bytes(MAX_FILE_BYTES)}"
            )
        data = p.read_bytes()
    except FileNotFoundError:
        raise error(f"{p}: {what} file does not exist") from None
    except OSError as exc:
        raise error(f"{p}: cannot read {what} file: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{p}: not a JSON {what} file: byte {exc.start} is not UTF-8 text (a binary file?)"
        ) from None
    try:
        return json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise error(
            f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except _TooManyDigits as exc:
        raise error(
            f"{p}: {exc} is more than the {MAX_NUMBER_DIGITS} digits a {what} file may hold"
        ) from None
    except RecursionError:
        raise error(f"{p}: nested too deeply to be a {what} file") from None
