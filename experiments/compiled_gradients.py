"""What ``torch.compile`` does to a training step's memory and gradients, apart from its
activation budget: the two facts behind the ``torch_budget`` rows (docs/design.md section 6,
docs/measurements.md "Against the compiler's memory budget").

Per net, one CPU device, the module compiled at ``activation_memory_budget`` 1.0 (the min-cut
partitioner's own choice) by ``aot_eager`` (no fusion) and by inductor, beside a plain step:

* the measured activation peak (allocator's peak above the step's start, less the gradients
  a step makes when it starts without them), with the gradients kept and accumulated into
  (the protocol of every row, and of gradient accumulation) and with ``set_to_none``
  (``optimizer.zero_grad()``'s default). A compiled backward returns every gradient at once
  before autograd adds them into ``.grad``, so with gradients kept it holds them twice;
* the largest gradient error against a float64 step (dropout off), as a fraction of each
  tensor's largest magnitude: eager's, aot_eager's and inductor's.

Writes ``results/compiled_gradients/compiled_gradients.csv`` and ``compiled_gradients.png``.

    python experiments/compiled_gradients.py                  # 5 nets, b2 128, ~5 min
    python experiments/compiled_gradients.py --nets resnet18 --batch 4
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baselines.pytorch import compiled, without_dropout  # noqa: E402
from experiments.common import write_csv  # noqa: E402
from xengine.execute.executor import PlainStep, reference_step  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402

log = logging.getLogger("compiled_gradients")
OUT = ROOT / "results" / "compiled_gradients"
NETS = ("resnet18", "mobilenet_v2", "vit_b_16", "gpt2_small", "squeezenet1_0")
MIB = 2**20


def peak_mib(cap, rewrite, set_to_none: bool) -> float:
    """One warm-up step (it compiles), then one profiled step's activation peak."""
    with PlainStep(cap, "cpu", rewrite=rewrite, set_to_none=set_to_none) as step:
        step.step()
        return step.cpu_peak()[0] / MIB


def float64_grads(cap) -> dict[str, torch.Tensor]:
    module = copy.deepcopy(cap.module).double().train()
    without_dropout(None)(module)
    for p in module.parameters():
        p.grad = None
    x = cap.example_input
    cap.loss(module(x.double() if x.is_floating_point() else x), cap.target).backward()
    return {n: p.grad.float() for n, p in module.named_parameters() if p.grad is not None}


def rel_error(grads: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ``max |a - b| / max |b|`` over the tensors, and which tensor; a tensor
    whose exact gradient is (nearly) zero, such as a batch norm's bias before another batch
    norm or ViT's class token, is measured against 1e-4 of the largest gradient of all."""
    floor = 1e-4 * max(float(g.abs().max()) for g in exact.values())
    errs = {
        n: float((grads[n] - g).abs().max()) / max(float(g.abs().max()), floor)
        for n, g in exact.items()
    }
    name = max(errs, key=errs.get)
    return errs[name], name


def measure(net: str, batch: int, size: int) -> dict:
    classes = None if net == "gpt2_small" else 10  # the decoder's vocabulary stays its own
    cap = capture_net(net, batch, image_size=size, num_classes=classes)
    grad_mib = sum(p.numel() * p.element_size() for p in cap.module.parameters()) / MIB
    row = {"net": net, "batch": batch, "size": size, "grad_mib": round(grad_mib, 3)}
    exact = float64_grads(cap)
    for name, rewrite in (
        ("plain", None),
        ("aot_eager", compiled("aot_eager", 1.0)),
        ("inductor", compiled("inductor", 1.0)),
    ):
        torch.manual_seed(0)
        row[f"{name}_kept_peak_mib"] = round(peak_mib(cap, rewrite, False), 3)
        row[f"{name}_set_to_none_peak_mib"] = round(peak_mib(cap, rewrite, True), 3)
        run = reference_step(cap, 1, 1, measure_memory=False, rewrite=without_dropout(rewrite))
        err, where = rel_error(run.param_grads, exact)
        row[f"{name}_grad_error_vs_float64"] = f"{err:.3g}"
        row[f"{name}_worst_tensor"] = where
        log.info("%s %s: %s", net, name, {k: v for k, v in row.items() if k.startswith(name)})
    return row


def plot(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    kinds = [
        (f"{n}_{m}_peak_mib", f"{n}, {m.replace('_', ' ')}")
        for n in ("plain", "aot_eager", "inductor")
        for m in ("kept", "set_to_none")
    ]
    width = 0.8 / len(kinds)
    for k, (key, label) in enumerate(kinds):
        xs = [i + (k - len(kinds) / 2 + 0.5) * width for i in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [r["net"] for r in rows])
    ax.set_ylabel("measured activation peak (MiB)")
    ax.set_title("Compiled at activation_memory_budget 1.0: gradients kept vs set to None")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="+", default=list(NETS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [measure(net, args.batch, args.size) for net in args.nets]
    path = OUT / "compiled_gradients.csv"
    write_csv(path, rows)
    plot(rows, OUT / "compiled_gradients.png")
    print(path.read_text())


if __name__ == "__main__":
    main()
