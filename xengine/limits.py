"""The ranges of what users give xengine: budgets, sizes, costs, graph size and files.

A value outside these ranges is not a harder problem but a mistake (a unit typed wrong, a
corrupt or hostile file), and some would break arithmetic or memory long before a solver
runs: ``1e30GB`` overflows an int64, a 200 000-node graph asks for 37 GiB of schedule arrays.
Each check says the limit and the value asked, before any large allocation.

The limits are far above any real device or network: a budget of 1 PiB, a tensor of 16 TiB
(an H200 has 141 GB), a cost of 10^15 s (FLOP-count graphs read as seconds stay below it),
and sums of every size of the largest graph stay exact in int64 and float64.
"""

from __future__ import annotations

MAX_BUDGET_BYTES = 2**50  # 1 PiB for one device
MAX_TENSOR_BYTES = 2**44  # 16 TiB for one node's output, workspace or autograd state
MAX_COST_S = 1e15  # one op's time, or a copy's latency
MAX_SCHEDULE_ARRAY_BYTES = 2**30  # one (devices x stages x nodes) array of bools: R, S, states
MAX_FILE_BYTES = 256 * 2**20  # a graph or profile file (a 30 000-node graph is ~10 MB)
MAX_NUMBER_DIGITS = 30  # an integer in a JSON file (2^64 has 20 digits)


def max_nodes(n_devices: int) -> int:
    """The largest graph whose schedule arrays (``n_devices`` x n x n bools each) stay within
    :data:`MAX_SCHEDULE_ARRAY_BYTES`."""
    n = int((MAX_SCHEDULE_ARRAY_BYTES / max(n_devices, 1)) ** 0.5)
    while n_devices * (n + 1) ** 2 <= MAX_SCHEDULE_ARRAY_BYTES:
        n += 1
    while n_devices * n**2 > MAX_SCHEDULE_ARRAY_BYTES:
        n -= 1
    return n


def schedule_size_problem(n_nodes: int, n_devices: int) -> str | None:
    """Why a graph of ``n_nodes`` on ``n_devices`` is too large to schedule, or None."""
    limit = max_nodes(n_devices)
    if n_nodes <= limit:
        return None
    gib = n_devices * n_nodes**2 / 2**30
    devices = f"{n_devices} device{'s' if n_devices > 1 else ''}"
    return (
        f"{n_nodes} nodes on {devices}: each schedule array would be {gib:.1f} GiB "
        f"({n_devices} x {n_nodes} x {n_nodes} bools); xengine takes up to {limit} nodes on "
        f"{devices} (1 GiB per array)"
    )
