"""What "the step as one explicit program" costs before it recomputes anything (issue 58, item 5).

One of the two executor designs the issue asks to prototype: the joint forward-backward graph
at ATen level (``make_fx`` of a step that calls ``torch.autograd.grad``), run as the
straight-line code torch.fx writes for it (every value set to ``None`` after its last use, so
memory is the program's references). This script measures the keep-everything program only:
the Python cost per ATen op that every schedule of that design would pay, against a plain
PyTorch step, the two run in turn (plain, program, plain, ...) so that the machine's drift
cancels in each pair's ratio.

    python experiments/joint_program_cost.py --nets gpt2_small:2:128,resnet18:4:224 --pairs 30

Writes ``results/executor_cost/joint_program.{csv,png}`` (``--out``); one row per net.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch.func import functional_call  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.common import commit, write_csv  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402
from xengine.records.plots import save_figure  # noqa: E402

log = logging.getLogger("joint_program_cost")
OUT = ROOT / "results" / "executor_cost"


def measure(net: str, batch: int, size: int, pairs: int, warmup: int = 3) -> dict:
    """The keep-everything joint program against a plain step of ``net``: medians of
    ``pairs`` pairs after ``warmup``, and the median of each pair's ratio."""
    cap = capture_net(net, batch, image_size=size)
    model, x, y = cap.module, cap.example_input, cap.target
    model.train()
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def joint(params, buffers, x, y):
        loss = cap.loss(functional_call(model, (params, buffers), (x,)), y)
        return loss, torch.autograd.grad(loss, list(params.values()))

    gm = make_fx(joint)(params, buffers, x, y)
    n_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        cap.loss(model(x), y).backward()

    def program() -> None:
        gm(params, buffers, x, y)

    for _ in range(warmup):
        plain()
        program()
    plain_s, program_s = [], []
    for _ in range(pairs):
        t0 = time.perf_counter()
        plain()
        t1 = time.perf_counter()
        program()
        program_s.append(time.perf_counter() - t1)
        plain_s.append(t1 - t0)
    ratios = sorted(g / p for g, p in zip(program_s, plain_s, strict=True))
    extra_s = statistics.median(program_s) - statistics.median(plain_s)
    return {
        "net": net,
        "batch": batch,
        "size": size,
        "n_nodes": cap.graph.size,
        "n_aten_ops": n_ops,
        "pairs": pairs,
        "plain_ms": 1e3 * statistics.median(plain_s),
        "program_ms": 1e3 * statistics.median(program_s),
        "program_over_plain": statistics.median(ratios),
        "ratio_q1": ratios[len(ratios) // 4],
        "ratio_q3": ratios[(3 * len(ratios)) // 4],
        "extra_us_per_aten_op": 1e6 * extra_s / n_ops,
        "threads": torch.get_num_threads(),
    }


def plot(rows: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [f"{r['net']} b{r['batch']} {r['size']}" for r in rows]
    med = [r["program_over_plain"] for r in rows]
    err = [
        [m - r["ratio_q1"] for m, r in zip(med, rows, strict=True)],
        [r["ratio_q3"] - m for m, r in zip(med, rows, strict=True)],
    ]
    ax.bar(names, med, yerr=err, capsize=4, color="tab:blue")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.02, color="tab:red", lw=0.8, ls="--", label="issue 58's keep-everything bar")
    ax.set_ylabel("joint program / plain step")
    ax.set_title(
        "Keep-everything as one ATen program\n(median and quartiles of pair ratios)", fontsize=10
    )
    ax.legend(fontsize=8)
    save_figure(fig, out / "joint_program.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="gpt2_small:2:128,resnet18:4:224", help="net:batch:size,...")
    ap.add_argument("--pairs", type=int, default=30, help="timed pairs per net")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows = []
    for spec in args.nets.split(","):
        net, batch, size = spec.split(":")
        row = {"commit": commit(), **measure(net, int(batch), int(size), args.pairs)}
        log.info(
            "%s: %d ATen ops, program / plain %.3f (%.1f us per op more)",
            net,
            row["n_aten_ops"],
            row["program_over_plain"],
            row["extra_us_per_aten_op"],
        )
        rows.append(row)
        write_csv(args.out / "joint_program.csv", rows)
    plot(rows, args.out)


if __name__ == "__main__":
    main()
