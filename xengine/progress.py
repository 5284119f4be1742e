"""One live status line on stderr while a strategy solves or a schedule executes (issue 17).

A long solve used to leave the console silent between the profiling bar and the table. Now
the pipeline opens a :class:`StatusLine` around each strategy and each execution; solvers
report to the active one (:func:`report`) with their incumbent and bound in seconds, the
executor with its step. On a terminal the line is redrawn in place every half second
(strategy, solver, elapsed, incumbent, bound, gap, or step k of n); when stderr is not a
terminal (CI logs, files) it becomes a plain line at the start and at most every
``plain_every_s`` seconds after. Log records printed meanwhile clear the line first and
redraw it after. Nothing of this goes to stdout, whose last lines stay the result table.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

_active: StatusLine | None = None
interrupted_during: str | None = None
"""The status line's last text when an interrupt ended its work (for the entry point's line)."""


def report(
    incumbent_s: float | None = None,
    bound_s: float | None = None,
    step: tuple[int, int] | None = None,
    phase: str | None = None,
) -> None:
    """Tell the active status line (if any) what the work in progress has reached; ``phase``
    names the part of the work now running (e.g. a relaxation before the full model)."""
    if _active is not None:
        _active.update(incumbent_s=incumbent_s, bound_s=bound_s, step=step, phase=phase)


class StatusLine:
    """A status line for one piece of work: ``with StatusLine("checkmate", "highs"): ...``."""

    def __init__(
        self,
        what: str,
        detail: str = "",
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        plain_every_s: float = 15.0,
    ) -> None:
        self.what, self.detail = what, detail
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.plain_every_s = plain_every_s
        self.incumbent_s: float | None = None
        self.bound_s: float | None = None
        self.step: tuple[int, int] | None = None
        self.phase: str | None = None
        self._t0 = time.perf_counter()
        self._last_plain = -float("inf")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = False
        self._patched: list[tuple[logging.Handler, object]] = []

    # ---------------------------------------------------------------- the text
    def text(self) -> str:
        el = time.perf_counter() - self._t0
        detail = ", ".join(x for x in (self.detail, self.phase) if x)
        head = self.what + (f" ({detail})" if detail else "")
        parts = [f"{el:.0f} s"]
        if self.step is not None:
            parts.append(f"step {self.step[0]} of {self.step[1]}")
        if self.incumbent_s is not None:
            parts.append(f"incumbent {1e3 * self.incumbent_s:.2f} ms")
        if self.bound_s is not None:
            parts.append(f"bound {1e3 * self.bound_s:.2f} ms")
        if self.incumbent_s and self.bound_s is not None:
            gap = abs(self.incumbent_s - self.bound_s) / abs(self.incumbent_s)
            parts.append(f"gap {100 * gap:.2f} %")
        return f"{head}: " + ", ".join(parts)

    # ---------------------------------------------------------------- life
    def __enter__(self) -> StatusLine:
        global _active
        if not self.enabled:
            return self
        self._previous = _active
        _active = self
        if self.tty:
            self._guard_log_handlers()
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        else:
            self._plain(force=True)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        global _active, interrupted_during
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            interrupted_during = interrupted_during or self.text()
        if not self.enabled:
            return
        _active = self._previous
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)
        with self._lock:
            self._clear()
        for h, emit in self._patched:
            h.emit = emit  # type: ignore[method-assign]

    def update(
        self,
        incumbent_s: float | None = None,
        bound_s: float | None = None,
        step: tuple[int, int] | None = None,
        phase: str | None = None,
    ) -> None:
        if phase is not None:
            self.phase = phase
        if incumbent_s is not None:
            self.incumbent_s = incumbent_s
        if bound_s is not None:
            self.bound_s = bound_s
        if step is not None:
            self.step = step
        if not self.tty:
            self._plain()

    # ---------------------------------------------------------------- drawing
    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        self.stream.write("\r\033[K" + self.text())
        self.stream.flush()
        self._shown = True

    def _clear(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False

    def _plain(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last_plain >= self.plain_every_s:
            self._last_plain = now
            self.stream.write(self.text() + "\n")
            self.stream.flush()

    def _guard_log_handlers(self) -> None:
        """Console log records clear the line before they print and redraw it after."""
        for h in logging.getLogger().handlers:
            if not isinstance(h, logging.StreamHandler) or isinstance(h, logging.FileHandler):
                continue
            if getattr(h, "stream", None) is not self.stream:
                continue
            emit = h.emit

            def guarded(record, emit=emit) -> None:
                with self._lock:
                    self._clear()
                    emit(record)

            self._patched.append((h, emit))
            h.emit = guarded  # type: ignore[method-assign]
