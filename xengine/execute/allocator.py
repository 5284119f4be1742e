"""glibc's malloc held steady while steps are timed (docs/design.md section 4; issue 28,
"allocator effects").

On the CPU, torch's allocator takes every tensor from the C library's ``malloc``. glibc serves
a request above its *mmap threshold* (128 KiB at start) with a fresh ``mmap``, whose pages
fault in (and are zeroed) on first touch, and below it from its heap, whose pages stay mapped
and are reused. The threshold moves: each ``free`` of an mmapped chunk raises it to that
chunk's size (up to 32 MiB), and the heap's top is given back to the system above a *trim
threshold* that moves with it. So the same step costs what the process's history has set:
measured on resnet18 b2 32 px, a plain PyTorch step took 62.7 ms alone in a process and 34 ms
after a few executor steps (docs/measurements.md, "The compiled executor"). A schedule whose
tensors have other sizes than the plain step's can move the two differently, so that a ratio
timed at one moment of a process and measured minutes later may differ though neither the
schedule nor the machine did (how much it matters: docs/measurements.md, "Time fidelity").

:func:`steady_malloc` fixes both thresholds, as ``mallopt`` allows (which also turns the
moving threshold off): chunks up to 32 MiB, the most glibc takes, come from the heap, larger
ones are mapped each time, and the heap is not trimmed below 2 GiB free. Every step then pays
the same for its memory whatever ran before it, the plain step as much as a schedule. PyTorch's
CPU performance guide gets the same by preloading another allocator (jemalloc or tcmalloc);
this needs no library to install. Memory *measurements* do not change: the executor counts
the bytes torch asks for, not the pages the process holds (which stay at the step's
high-water mark). ``run.py`` calls it at start (the default, ``malloc=steady``;
``malloc=system`` leaves glibc as it is), as do the timing benchmarks (``--malloc``, the same
default); a library user calls it once before profiling. Without glibc (macOS, musl) it
does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest a C int takes: trimmed only above 2 GiB free

_state = {"mode": "system"}


def steady_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds for the rest of the process (module docstring).
    True when both were set (or already were); False without glibc, with a log line."""
    if _state["mode"] == "steady":
        return True
    libc = _glibc()
    if libc is None:
        log.info("malloc: not glibc; its thresholds stay as they are")
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = ok and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.warning("malloc: glibc refused the fixed thresholds; they stay as they are")
        return False
    _state["mode"] = "steady"
    log.info(
        "malloc: glibc thresholds fixed (mmap above %d MiB, no trimming below 2 GiB)",
        MMAP_THRESHOLD_BYTES >> 20,
    )
    return True


def mode() -> str:
    """``"steady"`` once :func:`steady_malloc` has run in this process, else ``"system"``:
    a profile's costs depend on it (it is part of the profile cache's key)."""
    return _state["mode"]


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


__all__ = ["MMAP_THRESHOLD_BYTES", "mode", "steady_malloc"]
