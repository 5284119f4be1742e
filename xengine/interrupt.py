"""Ctrl-C and SIGTERM as one exception that says which signal it was (issue 19).

Python turns SIGINT into ``KeyboardInterrupt`` between two bytecodes, which is enough while a
run is in Python or torch. SIGTERM kills the process without any cleanup unless a handler is
installed, and a solver's native code may swallow an exception raised inside one of its
callbacks (HiGHS did: Ctrl-C became "Solve error" and the run went on). So the entry point
installs :func:`install` once, both signals raise :class:`Interrupted`, and every solver
back-end that runs native code waits for it in Python and passes the interrupt on
(:mod:`xengine.solvers.highs`). The tracker marks the MLflow run ``KILLED``, and the entry
point prints one line and exits with 128 + the signal number.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run was asked to stop by ``signum`` (SIGINT: Ctrl-C, or SIGTERM)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum: int, _frame) -> None:  # noqa: ANN001 - a signal handler's frame
    raise Interrupted(signum)


def install() -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        signal.signal(s, _raise)


def exit_code(exc: BaseException) -> int:
    """128 + the signal of an interrupt (130 for a plain KeyboardInterrupt)."""
    return exc.exit_code if isinstance(exc, Interrupted) else 128 + signal.SIGINT
