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

from xengine.max_batch import BatchAnswer
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
    ("pred / plain", lambda r: _num(r.predicted_over_plain, ".3f")),
    ("meas / plain", lambda r: _num(r.measured_over_plain, ".3f")),
    ("pred peak MiB", lambda r: _per_device(r.predicted_peak_bytes, MIB, ".2f")),
    ("meas peak MiB", lambda r: _per_device(r.measured_peak_bytes, MIB, ".2f")),
    ("budget MiB", lambda r: _per_device(r.budget_bytes, MIB, ".2f")),
    ("solve s", lambda r: _num(r.solve_time_s, ".2f")),
    ("compile s", lambda r: _num(r.compile_time_s, ".1f")),
    ("gap %", lambda r: _num(None if r.gap is None else 100 * r.gap, ".2f")),
    ("grads match", lambda r: _yes_no(r.grads_match)),
]
"""(header, cell) for the printed table."""

SHOWN_WHEN_USED = frozenset({"compile s", "pred / plain", "meas / plain"})
"""Columns only some rows fill (PyTorch's compiled policies; rows timed in context, or executed
beside a plain step): left out of a table in which no row has a value, so that a run has no
column of dashes (the default run has no compiled policy, a solve-only run times nothing)."""

CSV_FIELDS: list[tuple[str, Callable[[RunRow], object]]] = [
    ("strategy", lambda r: r.label),
    ("devices", lambda r: "+".join(r.devices)),
    ("status", lambda r: r.status),
    (
        "predicted_time_ms",
        lambda r: None if r.predicted_time_s is None else r.predicted_time_s * 1e3,
    ),
    ("measured_time_ms", lambda r: None if r.measured_time_s is None else r.measured_time_s * 1e3),
    ("predicted_over_plain", lambda r: r.predicted_over_plain),
    ("measured_over_plain", lambda r: r.measured_over_plain),
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


def text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """Fixed-width lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *(line(b) for b in body)]


def format_table(rows: Sequence[RunRow], title: str = "", footer: Sequence[str] = ()) -> str:
    """A fixed-width text table (a column of :data:`SHOWN_WHEN_USED` only where a row has a
    value), then ``footer`` lines, then one note line per row that has a note."""
    out = [title] if title else []
    cols = [
        (h, cell)
        for h, cell in COLUMNS
        if h not in SHOWN_WHEN_USED or any(cell(r) != "-" for r in rows)
    ]
    out += text_table([h for h, _ in cols], [[cell(r) for _, cell in cols] for r in rows])
    out += list(footer)
    notes = [f"  {r.label}: {r.note}" for r in rows if r.note]
    if notes:
        out += ["notes:", *notes]
    return "\n".join(out)


# ------------------------------------------------------------------------------ task=max_batch
BATCH_FIELDS: tuple[tuple[str, Callable[[BatchAnswer, BatchAnswer], object]], ...] = (
    ("strategy", lambda a, p: a.strategy),
    ("largest_batch", lambda a, p: a.largest),
    ("first_unfit_batch", lambda a, p: a.first_unfit),
    ("proven", lambda a, p: a.proven),
    ("over_plain", lambda a, p: None if a.over(p) is None else round(a.over(p), 3)),
    ("predicted_peak_mib", lambda a, p: _mib(a.predicted_peak_bytes)),
    ("measured_peak_mib", lambda a, p: _mib(a.measured_peak_bytes)),
    (
        "measured_time_ms",
        lambda a, p: None if a.measured_time_s is None else a.measured_time_s * 1e3,
    ),
    ("samples_per_s", lambda a, p: a.samples_per_s),
    ("grads_match", lambda a, p: a.grads_match),
)
"""The columns of ``task=max_batch``'s table and CSV; ``p`` is plain PyTorch's answer."""


def _mib(b: int | None) -> float | None:
    return None if b is None else round(b / MIB, 3)


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def batch_table(answers: Sequence[BatchAnswer], title: str = "") -> str:
    """The largest batch per strategy, plain PyTorch first; a note per answer that has one
    (and where a solver left the answer unproven)."""
    plain = answers[0]
    body = [[_cell(get(a, plain)) for _, get in BATCH_FIELDS] for a in answers]
    out = [title] if title else []
    out += text_table([name for name, _ in BATCH_FIELDS], body)
    notes = [f"  {a.strategy}: {a.note}" for a in answers if a.note]
    notes += [
        f"  {a.strategy}: a solver stopped without an answer above batch {a.largest}; "
        "the largest batch proven to fit is shown"
        for a in answers
        if not a.proven
    ]
    if notes:
        out += ["notes:", *notes]
    return "\n".join(out)


def batch_csv(answers: Sequence[BatchAnswer]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([name for name, _ in BATCH_FIELDS])
    for a in answers:
        w.writerow(["" if (v := get(a, answers[0])) is None else v for _, get in BATCH_FIELDS])
    return buf.getvalue()


def table_csv(rows: Sequence[RunRow]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([name for name, _ in CSV_FIELDS])
    for r in rows:
        w.writerow(["" if (v := get(r)) is None else v for _, get in CSV_FIELDS])
    return buf.getvalue()
