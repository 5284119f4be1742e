"""Ctrl-C and SIGTERM as one exception that says which signal it was (issue 19).

Python turns SIGINT into ``KeyboardInterrupt`` between two bytecodes, which is enough while a
run is in Python or torch. SIGTERM kills the process without any cleanup unless a handler is
installed, and a solver's native code may swallow an exception raised inside one of its
callbacks (HiGHS did: Ctrl-C became "Solve error" and the run went on). So the entry point
installs :func:`install` once, both signals raise :class:`Interrupted`, and every solver
back-end that runs native code runs it in a worker thread while the main thread waits in
Python (:func:`run_stoppable`; HiGHS has its own solver thread), stops the solve through
the solver's own thread-safe cancel and passes the interrupt on. The tracker marks the MLflow
run ``KILLED``, and the entry point prints one line and exits with 128 + the signal number.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

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


def run_stoppable(
    work: Callable[[], T], stop: Callable[[], None] | None, what: str, grace_s: float = 10.0
) -> T:
    """``work()`` in a worker thread while this one waits in Python, so that a signal is
    seen at once even while ``work`` is in native code (which must release the GIL).

    On an interrupt, ``stop()`` (a solver's thread-safe cancel, e.g. SCIP's
    ``interruptSolve``) is called, the worker given ``grace_s`` to end, and the interrupt
    raised again. Without ``stop`` (or past the grace) the worker, a daemon thread, is left to
    end with the process. An exception of ``work`` is raised here as it was."""
    box: dict[str, object] = {}
    done = threading.Event()  # not Thread.is_alive: a join cut by a signal can misreport it

    def run() -> None:
        try:
            box["out"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["exc"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=run, name=f"xengine-{what}", daemon=True)
    try:
        worker.start()  # inside: a signal while the thread starts stops it too
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        if stop is not None:
            # again and again: a cancel that lands before the solve has started is lost
            end = time.perf_counter() + grace_s
            while not done.is_set() and time.perf_counter() < end:
                stop()
                done.wait(0.1)
        if not done.is_set():
            log.info("%s: left running in its thread after the interrupt", what)
        raise
    if "exc" in box:
        raise box["exc"]  # type: ignore[misc]
    return box["out"]  # type: ignore[return-value]
