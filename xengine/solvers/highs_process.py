"""HiGHS in a process of its own, so that a time limit holds even where HiGHS does not poll it.

HiGHS checks its time limit and its interrupt callbacks in the simplex and the MIP search
only. On models of 400k-1.1M variables its presolve and the work before the root LP ran for
minutes past both (GPT-2, 12 layers, 50 %: the MILP was given about 70 s and took 218 s, so
the strategy took 412 s under a 300 s limit; docs/measurements.md, "Repeated at 11cbf50").
A thread cannot be stopped from outside, a process can: :func:`solve_in_process` writes the
model to a temporary folder, runs :func:`main` on it in a new Python process (which
solves it with :func:`xengine.solvers.highs.solve_highs` as in-process), forwards the child's
progress lines to ``progress`` and keeps every improving incumbent the child writes. A child
still running :data:`KILL_GRACE_S` after its own cancel should have ended it is killed; the
answer is then its last incumbent (or the MIP start) at its true cost, with the last bound it
reported, and the message says so.

:func:`xengine.solvers.highs.solve_highs` sends a MIP with a time limit here when it has at
least :data:`OWN_PROCESS_MIN_NNZ` nonzeros (small models keep the cheaper in-process solve).
The child dies with its parent: it watches its stdin, which only the parent holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xengine.solvers.model import MilpModel, ProgressFn, SolveResult, SolverOptions, relative_gap

log = logging.getLogger(__name__)

OWN_PROCESS_MIN_NNZ = 200_000
"""A HiGHS MIP with a time limit and at least this many nonzeros runs in its own process
(starting one costs about half a second; the models whose presolve overran were 0.4-9 M)."""
KILL_GRACE_S = 5.0
"""Past the limit and the in-process cancel's grace (:data:`highs.DEADLINE_GRACE_S`), what
the child gets to end on its own before it is killed."""
_MODEL, _START, _OPTIONS, _INCUMBENT, _RESULT = (
    "model.npz",
    "start.npy",
    "options.json",
    "incumbent.npy",
    "result.npz",
)


def uses_own_process(model: MilpModel, options: SolverOptions) -> bool:
    """Whether :func:`solve_highs` runs ``model`` here (a MIP with a limit, large enough)."""
    return (
        options.time_limit_s is not None
        and not options.relax
        and model.n_integer > 0
        and model.A.nnz >= OWN_PROCESS_MIN_NNZ
    )


# ------------------------------------------------------------------------------ the parent
def solve_in_process(
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
    cancel_grace_s: float = 2.0,
) -> SolveResult:
    """Solve ``model`` with HiGHS in a child process that is killed once the time limit, the
    grace of the child's own cancel (``cancel_grace_s``, ``highs.DEADLINE_GRACE_S``) and
    :data:`KILL_GRACE_S` have passed (module docstring). Otherwise the arguments and the
    result of ``solve_highs``."""
    t0 = time.perf_counter()
    limit_s = float(options.time_limit_s)
    with tempfile.TemporaryDirectory(prefix="xengine-highs-") as tmp:
        folder = Path(tmp)
        _write(folder, model, options, warm_start, deadline_unix_s=time.time() + limit_s)
        child = subprocess.Popen(
            _command(folder),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            watch = _Watch(child, t0, progress)
            kill_at = t0 + limit_s + cancel_grace_s + KILL_GRACE_S
            killed = watch.until(kill_at)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            child.stdin.close()
        elapsed = time.perf_counter() - t0
        if (folder / _RESULT).exists():  # written whole (renamed into place), even if killed
            return _read_result(folder, watch, elapsed)
        if not killed:
            return SolveResult.failed(
                "highs",
                elapsed,
                f"HiGHS's process ended with exit code {child.returncode} and no result "
                "(its error is in the log above)",
            )
        return _after_kill(folder, model, options, warm_start, watch, elapsed)


_CHILD = (
    "import sys; from pathlib import Path; from xengine.solvers.highs import solve_highs; "
    f"from {__name__} import main; main(Path(sys.argv[1]), solve_highs)"
)
"""The child's program: :func:`main` with ``solve_highs``, named here in a string so that
this module does not import ``highs`` (which imports it); not ``-m``, because the package
imports this module before ``-m`` would run it, and runpy warns."""


def _command(folder: Path) -> list[str]:
    """The child's command line: :func:`main` on ``folder``."""
    return [sys.executable, "-c", _CHILD, str(folder)]


def _write(
    folder: Path,
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None,
    deadline_unix_s: float,
) -> None:
    if model.is_quadratic:
        raise ValueError("HiGHS takes linear models only")
    A = model.A.tocsr()
    np.savez(
        folder / _MODEL,
        c=model.c,
        data=A.data,
        indices=A.indices,
        indptr=A.indptr,
        shape=np.asarray(A.shape),
        row_lb=model.row_lb,
        row_ub=model.row_ub,
        lb=model.lb,
        ub=model.ub,
        integrality=model.integrality,
        offset=np.asarray(model.offset),
    )
    if warm_start is not None:
        np.save(folder / _START, np.asarray(warm_start, dtype=float))
    opts = dataclasses.asdict(options)
    (folder / _OPTIONS).write_text(json.dumps({"options": opts, "deadline": deadline_unix_s}))


class _Watch:
    """The parent's side of the child's progress lines: each is passed to ``progress``; the
    first incumbent's time and the last finite bound are kept for a killed child's answer."""

    def __init__(self, child: subprocess.Popen, t0: float, progress: ProgressFn | None):
        self.child, self.t0, self.progress = child, t0, progress
        self.lines: queue.Queue = queue.Queue()
        self.first_incumbent_s: float | None = None
        self.bound: float | None = None
        threading.Thread(target=self._read, daemon=True, name="xengine-highs-lines").start()

    def _read(self) -> None:
        for raw in self.child.stdout:
            self.lines.put(raw)
        self.lines.put(None)

    def until(self, kill_at: float) -> bool:
        """Forward lines until the child's output ends; True when ``kill_at`` came first."""
        while True:
            try:
                raw = self.lines.get(timeout=0.1)
            except queue.Empty:
                if time.perf_counter() > kill_at:
                    return True
                continue
            if raw is None:
                return False
            self._forward(json.loads(raw))

    def _forward(self, event: dict) -> None:
        elapsed = time.perf_counter() - self.t0
        obj, bound = event.get("objective"), event.get("bound")
        if bound is not None and np.isfinite(bound):
            self.bound = bound
        if event.get("incumbent") and self.first_incumbent_s is None:
            self.first_incumbent_s = elapsed
        if self.progress is not None:
            self.progress(elapsed, obj, bound if bound is not None and np.isfinite(bound) else None)


def _read_result(folder: Path, watch: _Watch, elapsed: float) -> SolveResult:
    """The child's own result (it ended by itself), timed from the parent's start."""
    with np.load(folder / _RESULT, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        x = z["x"] if "x" in z.files else None
        row_dual = z["row_dual"] if "row_dual" in z.files else None
    meta["solve_time_s"] = elapsed
    if meta.get("time_to_first_s") is not None and watch.first_incumbent_s is not None:
        meta["time_to_first_s"] = watch.first_incumbent_s
    return SolveResult(x=x, row_dual=row_dual, **meta)


def _after_kill(
    folder: Path,
    model: MilpModel,
    options: SolverOptions,
    warm_start: np.ndarray | None,
    watch: _Watch,
    elapsed: float,
) -> SolveResult:
    """A killed child's answer: its last incumbent, else the MIP start, at its true cost."""
    x, which = None, "no schedule"
    if (folder / _INCUMBENT).exists():
        x, which = np.load(folder / _INCUMBENT), "its last incumbent"
    elif warm_start is not None and model.max_violation(warm_start) <= 1e-6:
        x, which = np.asarray(warm_start, dtype=float), "the MIP start"
    obj = None if x is None else model.objective(x)
    bound = watch.bound
    if bound is not None and obj is not None:
        bound = min(bound, obj)
    message = (
        f"time limit ({options.time_limit_s:g} s): HiGHS did not stop (it polls the limit in "
        f"the simplex and the search only), so xengine ended its process after {elapsed:.1f} s; "
        f"kept {which}"
    )
    log.info("highs: %s", message)
    return SolveResult(
        solver="highs",
        status="feasible" if x is not None else "no_solution",
        x=x,
        objective=obj,
        best_bound=bound,
        gap=relative_gap(obj, bound),
        solve_time_s=elapsed,
        message=message,
        time_to_first_s=watch.first_incumbent_s,
    )


# ------------------------------------------------------------------------------ the child
def _read_model(folder: Path) -> MilpModel:
    with np.load(folder / _MODEL, allow_pickle=False) as z:
        A = sp.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
        return MilpModel(
            c=z["c"],
            A=A,
            row_lb=z["row_lb"],
            row_ub=z["row_ub"],
            lb=z["lb"],
            ub=z["ub"],
            integrality=z["integrality"],
            offset=float(z["offset"]),
        )


def _die_with_parent() -> None:
    """Exit when stdin closes: only the parent holds its other end."""

    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="xengine-parent-watch").start()


def main(folder: Path, solve_highs: Callable[..., SolveResult]) -> None:
    """The child: solve the model in ``folder`` with ``solve_highs`` (``highs.solve_highs``)
    in-process; progress lines on the original stdout (HiGHS's own output goes to stderr),
    each improving incumbent to a file."""
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything native code prints belongs to the log, not to the event lines
    _die_with_parent()
    model = _read_model(folder)
    meta = json.loads((folder / _OPTIONS).read_text())
    options = SolverOptions(**meta["options"])
    options = dataclasses.replace(options, time_limit_s=max(meta["deadline"] - time.time(), 0.0))
    start = np.load(folder / _START) if (folder / _START).exists() else None

    def send(**event) -> None:
        events.write(json.dumps(event) + "\n")

    fresh = [False]  # an incumbent written since the last line

    def on_incumbent(x: np.ndarray) -> None:  # called before progress() with its objective
        tmp = folder / ("partial-" + _INCUMBENT)
        np.save(tmp, x)
        os.replace(tmp, folder / _INCUMBENT)
        fresh[0] = True

    def progress(_elapsed_s: float, obj: float | None, bound: float | None) -> None:
        send(objective=obj, bound=bound, incumbent=fresh[0])
        fresh[0] = False

    res = solve_highs(model, options, start, progress, on_incumbent=on_incumbent, _in_child=True)
    arrays = {k: v for k, v in (("x", res.x), ("row_dual", res.row_dual)) if v is not None}
    meta = {k: v for k, v in dataclasses.asdict(res).items() if k not in ("x", "row_dual")}
    tmp = folder / ("partial-" + _RESULT)
    np.savez(tmp, meta=np.asarray(json.dumps(meta)), **arrays)
    os.replace(tmp, folder / _RESULT)
    events.close()
