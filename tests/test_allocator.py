"""glibc's malloc held steady (xengine/execute/allocator.py): after :func:`steady_malloc` a
request of a few MiB comes from the heap instead of a fresh mapping, whatever came before.
Run in a child process: the thresholds are the whole process's."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import ctypes, json
    from xengine.execute import allocator

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)

    class Info(ctypes.Structure):  # struct mallinfo2 (glibc >= 2.33)
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Info

    def mapped_chunks(size):  # how many new mappings a request of ``size`` bytes makes
        n0 = libc.mallinfo2().hblks
        p = libc.malloc(size)
        n = libc.mallinfo2().hblks - n0
        libc.free(p)
        return n

    out = {"before": [mapped_chunks(4 << 20), allocator.mode()]}
    out["ok"] = allocator.steady_malloc()
    out["after"] = [mapped_chunks(4 << 20), mapped_chunks(64 << 20), allocator.mode()]
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
    reason="glibc only",
)
def test_steady_malloc_serves_megabytes_from_the_heap():
    done = subprocess.run(
        [sys.executable, "-c", "import ctypes.util\n" + CHILD],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    out = json.loads(done.stdout)
    # glibc's own start: 4 MiB is above its 128 KiB threshold, so it is a fresh mapping
    assert out["before"] == [1, "system"]
    assert out["ok"] is True
    # fixed at 32 MiB: 4 MiB comes from the heap, 64 MiB is still mapped
    assert out["after"] == [0, 1, "steady"]


def test_the_run_config_refuses_an_unknown_malloc():
    from xengine.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="malloc='jemalloc' is not one of steady, system"):
        RunConfig(malloc="jemalloc").validate()
