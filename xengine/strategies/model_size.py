"""How much host memory a schedule MILP takes, estimated before it is built (issue 30, item 5).

Checkmate's MILP (the exact formulation on one device) has O(n^2) binaries, and its
constraint matrix grows as the number of nodes n times the number of edges E: nonzeros were
6.6 n E on residual graphs of 101 to 801 nodes made in code (181,941 at n = 101, E = 272;
11,658,857 at n = 801, E = 2,198) and up to 7.9 n E on captured nets (tiny 7.9, resnet18 at
64 px 7.7, a 2-layer hf_llama 7.4), so the estimate takes 7.9. The process that builds the
model and runs HiGHS on it peaked at 412 bytes per nonzero (n = 401: 1.25 GB for 2.9 M
nonzeros; the build alone peaks at 84 bytes per nonzero). A 2,500-node graph would need some
50 GB, which is why such a model is refused before it is built instead of taking the machine
down. Measured with one device; the estimate is not used for several.
"""

from __future__ import annotations

import os

from xengine.graph.types import Graph
from xengine.units import format_bytes

NNZ_PER_NODE_EDGE = 7.9
BYTES_PER_NNZ = 412
SHARE_OF_FREE = 0.8  # of the host memory free now, the most a model may take


def available_host_bytes() -> int:
    """The host memory a new allocation can have now: Linux's ``MemAvailable`` (free pages plus
    the page cache the kernel would drop), else the free pages (``sysconf``), else a large number.
    Free pages alone undercount on a machine whose cache holds the wheels just installed."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 2**62


def milp_nonzeros(graph: Graph) -> int:
    """The estimated nonzeros of the one-device MILP of ``graph``."""
    edges = len(graph.value_edges) + len(graph.state_edges)
    return int(NNZ_PER_NODE_EDGE * graph.size * edges)


def milp_bytes(graph: Graph) -> int:
    """The estimated peak host memory of building and solving that MILP."""
    return BYTES_PER_NNZ * milp_nonzeros(graph)


def milp_memory_problem(graph: Graph, free_bytes: int | None = None) -> str | None:
    """Why the one-device MILP of ``graph`` is not to be built here, or None."""
    free = available_host_bytes() if free_bytes is None else free_bytes
    need = milp_bytes(graph)
    if need <= SHARE_OF_FREE * free:
        return None
    return (
        f"the MILP of {graph.size} nodes would take about {format_bytes(need)} of host memory "
        f"(~{milp_nonzeros(graph):,} nonzeros at {BYTES_PER_NNZ} bytes each), more than "
        f"{SHARE_OF_FREE:.0%} of the {format_bytes(free)} free"
    )
