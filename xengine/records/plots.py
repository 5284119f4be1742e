"""Pictures of a schedule: memory per device over the steps, and R coloured by device.

Matplotlib with the Agg back-end (headless); every function returns the Figure so callers can
save it or log it to MLflow.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from xengine.problem import Instance  # noqa: E402
from xengine.schedule import keep_all_schedule  # noqa: E402
from xengine.simulate import Simulation, simulate  # noqa: E402

MIB = 2**20


def save_figure(fig: plt.Figure, path, dpi: int = 120) -> None:
    """Lay out, write (creating the folder) and close ``fig``: the end of every experiment's
    plot."""
    from pathlib import Path

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


DEVICE_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def memory_over_steps(inst: Instance, sim: Simulation, title: str = "") -> plt.Figure:
    """Memory of every device at every step, with each device's budget as a dashed line and
    the keep-everything schedule (no recomputation, one device) as a grey reference."""
    fig, ax = plt.subplots(figsize=(9, 4))
    ref = simulate(
        Instance.single(inst.graph, inst.devices[0], None),
        keep_all_schedule(Instance.single(inst.graph, inst.devices[0], None)),
    )
    ax.plot(ref.mem_bytes[0] / MIB, color="0.6", lw=1.2, label="keep everything (one device)")
    for d, name in enumerate(inst.devices):
        c = DEVICE_COLORS[d % len(DEVICE_COLORS)]
        ax.plot(sim.mem_bytes[d] / MIB, color=c, lw=1.5, label=f"{name}")
        if inst.budgets[d] < 2**60:
            ax.axhline(inst.budgets[d] / MIB, color=c, ls="--", lw=1, label=f"{name} budget")
    ax.set_xlabel("schedule step (one computed node per step)")
    ax.set_ylabel("activation memory (MiB)")
    ax.set_title(title or f"{inst.graph.name}: memory per device")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def r_matrix(inst: Instance, R: np.ndarray, title: str = "") -> plt.Figure:
    """Stage x node grid; a cell is coloured by the device that computes the node in that
    stage (white: not computed). The diagonal is the frontier; cells left of it are
    recomputations."""
    D, T, n = R.shape
    grid = np.zeros((T, n), dtype=int)
    for d in range(D):
        grid[R[d]] = d + 1
    cmap = ListedColormap(["white"] + [DEVICE_COLORS[d % len(DEVICE_COLORS)] for d in range(D)])
    size = min(10, 3 + n / 25)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=D, interpolation="nearest")
    ax.set_xlabel("node")
    ax.set_ylabel("stage")
    ax.set_title(title or f"{inst.graph.name}: R coloured by device")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=DEVICE_COLORS[d % len(DEVICE_COLORS)]) for d in range(D)
    ]
    ax.legend(handles, list(inst.devices), loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig
