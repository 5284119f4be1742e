"""The live status line (xengine/progress.py): in place on a terminal, plain lines elsewhere,
never on stdout, and log records printed meanwhile do not run into it."""

from __future__ import annotations

import io
import logging
import re
import time

from xengine import progress
from xengine.progress import StatusLine


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_stderr_is_not_a_terminal():
    out = io.StringIO()
    with StatusLine("checkmate", "highs", stream=out, plain_every_s=0.0):
        progress.report(incumbent_s=0.2, bound_s=0.15)
        progress.report(step=(2, 5))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("checkmate (highs): 0 s")
    assert "incumbent 200.00 ms, bound 150.00 ms, gap 25.00 %" in lines[1]
    assert "step 2 of 5" in lines[2]
    assert "\r" not in out.getvalue()
    # no line open: reports go nowhere
    progress.report(incumbent_s=1.0)


def test_plain_lines_are_rate_limited():
    out = io.StringIO()
    with StatusLine("lp_rounding", stream=out, plain_every_s=3600.0):
        for k in range(20):
            progress.report(step=(k, 20))
    assert len(out.getvalue().splitlines()) == 1  # the start line only


def test_on_a_terminal_the_line_is_redrawn_in_place_and_cleared():
    tty = _Tty()
    handler = logging.StreamHandler(tty)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with StatusLine("xengine", "highs", stream=tty):
            progress.report(incumbent_s=0.3, bound_s=0.3)
            time.sleep(0.7)
            logging.getLogger("x").warning("a log record")
            time.sleep(0.6)
    finally:
        root.removeHandler(handler)
    text = tty.getvalue()
    assert re.search(
        r"\r\033\[Kxengine \(highs\): \d s, incumbent 300.00 ms, bound 300.00 ms, gap 0.00 %", text
    )
    # the record starts on a cleared line, and the line is cleared at the end
    before, after = text.split("a log record")
    assert before.endswith("\r\033[K")
    assert text.endswith("\r\033[K")
    assert handler.emit.__func__ is logging.StreamHandler.emit  # the guard is undone


def test_disabled_status_line_writes_nothing():
    out = io.StringIO()
    with StatusLine("checkmate", stream=out, enabled=False):
        progress.report(incumbent_s=1.0)
    assert out.getvalue() == ""


def test_the_line_goes_to_stderr_not_stdout(capsys):
    with StatusLine("checkmate", "highs", plain_every_s=0.0):
        progress.report(incumbent_s=0.1)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "checkmate (highs)" in captured.err
