"""Parsing and printing memory sizes.

Users write budgets as ``2GB`` (powers of 10), ``512MiB`` (powers of 2) or ``60%`` (a share of
the keep-everything peak, resolved later when the graph is known). docs/design.md section 9.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from xengine.limits import MAX_BUDGET_BYTES

_UNITS_BYTES = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*$")


class MemorySpecError(ValueError):
    """A memory string the user wrote cannot be understood."""


@dataclass(frozen=True)
class MemorySpec:
    """A budget as the user wrote it: absolute bytes, or a fraction of the keep-everything peak."""

    text: str
    bytes: int | None = None
    fraction: float | None = None

    def resolve_bytes(self, keep_all_peak_bytes: int) -> int:
        """Absolute budget in bytes; a percentage is taken of ``keep_all_peak_bytes``."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(round(self.fraction * keep_all_peak_bytes))


def parse_memory(text: str | int | float) -> MemorySpec:
    """Parse ``2GB``, ``512MiB``, ``1.5e9``, ``60%`` (case-insensitive units).

    Raises :class:`MemorySpecError` with a one-line explanation on anything else, including
    negative numbers and unknown units such as ``2XB``.
    """
    if isinstance(text, bool):
        raise MemorySpecError(f"memory size {text!r} is not a size")
    if isinstance(text, (int, float)):
        if text < 0:
            raise MemorySpecError(f"memory size {text!r} is negative")
        return MemorySpec(text=str(text), bytes=_within_limit(str(text), float(text)))
    raw = str(text)
    if raw.strip().startswith("-"):
        raise MemorySpecError(f"memory size {raw!r} is negative: a budget must be positive")
    m = _PATTERN.match(raw)
    if not m:
        raise MemorySpecError(
            f"memory size {raw!r} is not understood: write e.g. 2GB, 512MiB, 1500000B or 60%"
        )
    value = float(m.group(1))
    unit = m.group(2).upper() or "B"
    if unit == "%":
        if value == 0:
            raise MemorySpecError(
                f"memory share {raw!r} leaves the device no memory: give a share above 0% "
                "(at most 1000%), or leave the device out of devices="
            )
        if not value <= 1000:  # also inf and nan
            raise MemorySpecError(
                f"memory share {raw!r} is above 1000% of the keep-everything peak: a budget "
                "that large is keep-everything already"
            )
        return MemorySpec(text=raw, fraction=value / 100.0)
    if unit not in _UNITS_BYTES:
        raise MemorySpecError(
            f"memory size {raw!r} has unknown unit {m.group(2)!r}: use B, KB, MB, GB (powers "
            "of 10), KiB, MiB, GiB (powers of 2) or %"
        )
    return MemorySpec(text=raw, bytes=_within_limit(raw, value * _UNITS_BYTES[unit]))


def _within_limit(raw: str, n_bytes: float) -> int:
    """``n_bytes`` as an int, if it is a budget one device could have (``xengine.limits``)."""
    if not n_bytes <= MAX_BUDGET_BYTES:  # also inf and nan
        raise MemorySpecError(
            f"memory size {raw!r} is above the limit of {format_bytes(MAX_BUDGET_BYTES)} "
            f"(2^50 bytes) for one device"
        )
    return int(round(n_bytes))


def format_bytes(n_bytes: float) -> str:
    """Human-readable size with binary units (``12.3 MiB``)."""
    n = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
