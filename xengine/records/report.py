"""The comparison table: one row per strategy (and the plain PyTorch reference).

The same rows become the printed table, ``table.csv`` (an MLflow artifact) and the MLflow
metrics; units are in the column names. Several devices show as ``a / b`` in device order
(peaks and budgets of the XEngine row). A run over several devices ends with the paper's
headline: XEngine's gain over the fastest single-device schedule, and which single-device
schedules do not fit the total memory (:func:`summary_lines`).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence

from xengine.protocol import Summary
from xengine.result import MIB, RunRow
from xengine.units import format_bytes

Cell = Callable[[RunRow], str]


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _per_device(values: tuple[int, ...] | None, scale: float, fmt: str) -> str:
    if not values:
        return "-"
    return " / ".join(format(v / scale, fmt) for v in values)


def _yes_no(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "no")


COLUMNS: list[tuple[str, Cell]] = [
    ("strategy", lambda r: r.label),
    ("status", lambda r: r.status),
    (
        "pred time ms",
        lambda r: _num(None if r.predicted_time_s is None else r.predicted_time_s * 1e3, ".2f"),
    ),
    (
        "meas time ms",
        lambda r: _num(None if r.measured_time_s is None else r.measured_time_s * 1e3, ".2f"),
    ),
    ("pred peak MiB", lambda r: _per_device(r.predicted_peak_bytes, MIB, ".2f")),
    ("meas peak MiB", lambda r: _per_device(r.measured_peak_bytes, MIB, ".2f")),
    ("budget MiB", lambda r: _per_device(r.budget_bytes, MIB, ".2f")),
    ("solve s", lambda r: _num(r.solve_time_s, ".2f")),
    ("compile s", lambda r: _num(r.compile_time_s, ".1f")),
    ("gap %", lambda r: _num(None if r.gap is None else 100 * r.gap, ".2f")),
    ("grads match", lambda r: _yes_no(r.grads_match)),
]
"""(header, cell) for the printed table."""

CSV_FIELDS: list[tuple[str, Callable[[RunRow], object]]] = [
    ("strategy", lambda r: r.label),
    ("devices", lambda r: "+".join(r.devices)),
    ("status", lambda r: r.status),
    (
        "predicted_time_ms",
        lambda r: None if r.predicted_time_s is None else r.predicted_time_s * 1e3,
    ),
    ("measured_time_ms", lambda r: None if r.measured_time_s is None else r.measured_time_s * 1e3),
    ("predicted_peak_mib", lambda r: _per_device(r.predicted_peak_bytes, MIB, ".6f")),
    ("measured_peak_mib", lambda r: _per_device(r.measured_peak_bytes, MIB, ".6f")),
    ("budget_mib", lambda r: _per_device(r.budget_bytes, MIB, ".6f")),
    ("fixed_mib", lambda r: None if r.fixed_bytes is None else r.fixed_bytes / MIB),
    ("solve_time_s", lambda r: r.solve_time_s),
    ("compile_time_s", lambda r: r.compile_time_s),
    ("gap_pct", lambda r: None if r.gap is None else 100 * r.gap),
    ("n_recomputes", lambda r: r.n_recomputes),
    ("grads_match", lambda r: _yes_no(r.grads_match)),
    ("note", lambda r: r.note),
    ("wrong", lambda r: r.wrong),
    ("alone_with_total_memory", lambda r: "yes" if r.alone else ""),
    ("grads_max_rel_diff", lambda r: r.grads_max_rel_diff),
]
"""(column, value) for ``table.csv``: full precision, empty cells for missing values."""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def summary_lines(summary: Summary, devices: Sequence[str]) -> list[str]:
    """The lines under the table of a run over several devices."""
    tb = summary.total_budget_bytes
    total = "" if tb is None else f" ({format_bytes(tb)})"
    out = [
        f"per-device values ({' / '.join(devices)}) are in device order; single-device rows "
        f"(<strategy>.<device>) ran on that device alone with the total memory{total}"
    ]
    x, b = summary.xengine, summary.best_single
    if x is None:
        out.append("xengine: not run")
    elif b is None:
        out.append("xengine gain: - (no single-device schedule fits the total memory)")
    elif summary.gain is None:
        out.append(f"xengine gain: - (xengine {x.status}, no schedule within the budgets)")
    else:
        line = (
            f"xengine gain over the fastest single-device schedule ({b.label}): "
            f"{_pct(summary.gain)} predicted ({x.predicted_time_s * 1e3:.2f} vs "
            f"{b.predicted_time_s * 1e3:.2f} ms)"
        )
        if summary.measured_gain is not None:
            line += (
                f", {_pct(summary.measured_gain)} measured ({x.measured_time_s * 1e3:.2f} vs "
                f"{b.measured_time_s * 1e3:.2f} ms)"
            )
        out.append(line)
    out.append(
        "infeasible alone with the total memory: "
        + (", ".join(summary.infeasible_single) or "none")
    )
    return out


def format_table(rows: Sequence[RunRow], title: str = "", footer: Sequence[str] = ()) -> str:
    """A fixed-width text table, then ``footer`` lines, then one note line per row that has
    a note."""
    header = [h for h, _ in COLUMNS]
    body = [[cell(r) for _, cell in COLUMNS] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    out = [title] if title else []
    out += [line(header), "  ".join("-" * w for w in widths)]
    out += [line(b) for b in body]
    out += list(footer)
    notes = [f"  {r.label}: {r.note}" for r in rows if r.note]
    if notes:
        out += ["notes:", *notes]
    return "\n".join(out)


def table_csv(rows: Sequence[RunRow]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([name for name, _ in CSV_FIELDS])
    for r in rows:
        w.writerow(["" if (v := get(r)) is None else v for _, get in CSV_FIELDS])
    return buf.getvalue()
