"""How much host memory a schedule MILP takes, estimated before it is built (issue 30, item 5).

Checkmate's MILP (the exact formulation on one device) has O(n^2) binaries, and its
constraint matrix grows as the number of nodes n times the number of edges E: nonzeros were
6.6 n E on residual graphs of 101 to 801 nodes made in code (181,941 at n = 101, E = 272;
11,658,857 at n = 801, E = 2,198) and up to 7.9 n E on captured nets (tiny 7.9, resnet18 at
64 px 7.7, a 2-layer hf_llama 7.4), so the estimate takes 7.9. The process that builds the
model and runs HiGHS on it peaked at 412 bytes per nonzero (n = 401: 1.25 GB for 2.9 M
nonzeros; the build alone peaks at 84 bytes per nonzero). A 2,500-node graph would need some
50 GB, which is why such a model is refused before it is built instead of taking the machine
down.

XEngine's model over D devices grows as D^2 (copies between every pair of devices): built with
the tight FREE rows it uses, tiny and resnet18 at 64 px had 0.95-0.96 x 7.9 n E nonzeros on
one device, 3.5x that on two and 6.6-6.7x on three; GPT-2 with 12 layers had 9,381,571 on two
devices, 3.74x the one-device estimate. So the estimate for D devices is 7.9 n E D^2, times
:data:`TIGHT_ROWS_FACTOR` for the tight rows: 1.13-1.18x the model built on two devices,
1.36-1.39x on three.

The frontier relaxation over D devices (:mod:`xengine.strategies.device_frontier`) had 0.20-0.24
of that estimate without its step rows (resnet18 b8 over two devices, version-1 and -2 graphs;
GPT-2 with 12 layers: 2,555,886), so it is estimated as :data:`FRONTIER_SHARE_OF_MILP` of it,
plus the step rows' own count, and refused the same way.
"""

from __future__ import annotations

import os

from xengine.graph.types import Graph
from xengine.units import format_bytes

NNZ_PER_NODE_EDGE = 7.9
BYTES_PER_NNZ = 412
TIGHT_ROWS_FACTOR = 1.06  # 1 / 0.95: the tight FREE rows' nonzeros over the hazard rows'
SHARE_OF_FREE = 0.8  # of the host memory free now, the most a model may take
FRONTIER_SHARE_OF_MILP = 0.25  # the relaxation over D devices against the MILP's estimate


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


def milp_nonzeros(graph: Graph, n_devices: int = 1, tight_rows: bool = False) -> int:
    """The estimated nonzeros of the MILP of ``graph`` over ``n_devices`` devices: Checkmate's
    (one device, hazard rows) or XEngine's (``tight_rows``)."""
    edges = len(graph.value_edges) + len(graph.state_edges)
    factor = n_devices**2 * (TIGHT_ROWS_FACTOR if tight_rows else 1.0)
    return int(NNZ_PER_NODE_EDGE * graph.size * edges * factor)


def milp_bytes(graph: Graph, n_devices: int = 1, tight_rows: bool = False) -> int:
    """The estimated peak host memory of building and solving that MILP."""
    return BYTES_PER_NNZ * milp_nonzeros(graph, n_devices, tight_rows)


def milp_memory_problem(
    graph: Graph, free_bytes: int | None = None, n_devices: int = 1, tight_rows: bool = False
) -> str | None:
    """Why the MILP of ``graph`` over ``n_devices`` devices is not to be built here, or None."""
    free = available_host_bytes() if free_bytes is None else free_bytes
    need = milp_bytes(graph, n_devices, tight_rows)
    if need <= SHARE_OF_FREE * free:
        return None
    over = "" if n_devices == 1 else f" over {n_devices} devices"
    nnz = milp_nonzeros(graph, n_devices, tight_rows)
    return (
        f"the MILP of {graph.size} nodes{over} would take about {format_bytes(need)} of host "
        f"memory (~{nnz:,} nonzeros at {BYTES_PER_NNZ} bytes each), more than "
        f"{SHARE_OF_FREE:.0%} of the {format_bytes(free)} free"
    )


def frontier_nonzeros(graph: Graph, n_devices: int) -> int:
    """The estimated nonzeros of the frontier relaxation over ``n_devices`` devices, without
    its step rows."""
    return int(FRONTIER_SHARE_OF_MILP * milp_nonzeros(graph, n_devices, True))


def frontier_memory_problem(
    graph: Graph, n_devices: int, step_nonzeros: int = 0, free_bytes: int | None = None
) -> str | None:
    """Why the frontier relaxation over ``n_devices`` devices (with ``step_nonzeros`` of step
    rows) is not to be built here, or None."""
    free = available_host_bytes() if free_bytes is None else free_bytes
    nnz = frontier_nonzeros(graph, n_devices) + step_nonzeros
    need = BYTES_PER_NNZ * nnz
    if need <= SHARE_OF_FREE * free:
        return None
    return (
        f"the frontier relaxation of {graph.size} nodes over {n_devices} devices would take "
        f"about {format_bytes(need)} of host memory (~{nnz:,} nonzeros), more than "
        f"{SHARE_OF_FREE:.0%} of the {format_bytes(free)} free"
    )
