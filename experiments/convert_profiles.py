"""Convert shipped profiles to the graph captured today, without re-measuring.

The profiles under ``results/profiles/`` were measured on a machine with an H200, which this
one does not have. Their costs are per node *name*, and the value / state split changes which
links a graph has, not its nodes: so each profile is kept as measured (compute times per device
and copy fits), its key is pointed at the graph that this machine captures today, and the
``.graph.json`` beside it is written anew (version 2: states, value links only where autograd
saves, the profile's costs). Op workspaces were not measured per device then: the converted
profile has none, so runs use the workspaces captured here (CPU, this machine's threads), and
the file's ``measured`` field says so.

Since issue 20 a view op (``flatten``, ``reshape``, dropout with p = 0) is folded into the op
that reads it: the converter drops the times of those nodes and their backward nodes (they
timed a copy the executor no longer makes, a view costs nothing) and says so in ``measured``.
A node of today's graph that the profile does not time is an error.

    python experiments/convert_profiles.py results/profiles/*.profile.json \
        results/profiles/more_batch_sizes/*.profile.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xengine.graph.io import save_graph  # noqa: E402
from xengine.profile.profiler import Profile, apply_profile  # noqa: E402
from xengine.profile.workspace import capture_net  # noqa: E402

log = logging.getLogger("convert_profiles")
NOTE = "converted to graph version 2 (values and autograd states)"
VIEWS_NOTE = "views folded into their readers (issue 20): the times of"


def convert(path: Path) -> Path:
    prof = Profile.load(path)
    key = prof.key
    cap = capture_net(
        key["net"],
        key["batch_size"],
        mode=key["mode"],
        image_size=key.get("image_size"),
        num_classes=key.get("num_classes"),
    )
    graph = cap.graph
    names = {v.name for v in graph.nodes}
    dropped: set[str] = set()
    for d, table in prof.compute_s.items():
        missing = names - set(table)
        if missing:
            raise SystemExit(
                f"{path}: compute_s.{d} has no time for {len(missing)} node(s) captured here "
                f"(first: {sorted(missing)[0]!r})"
            )
        dropped |= set(table) - names
    compute_s = {
        d: {v: t for v, t in table.items() if v in names} for d, table in prof.compute_s.items()
    }
    measured = prof.measured
    if dropped:
        log.info("%s: dropping the times of %s (views, folded)", path, ", ".join(sorted(dropped)))
        measured += (
            f"; {VIEWS_NOTE} {', '.join(sorted(dropped))} dropped on "
            f"{datetime.now(UTC).strftime('%Y-%m-%d')}"
        )
    if NOTE not in measured:
        measured += (
            f"; {NOTE} on {datetime.now(UTC).strftime('%Y-%m-%d')} from a capture with torch "
            f"{torch.__version__}: costs as measured, no per-device op workspaces "
            "(the capture's CPU workspaces apply)"
        )
    new = Profile(
        key={**key, "graph_sha": graph.meta["graph_sha"]},
        compute_s=compute_s,
        copy=prof.copy,
        source=str(path),
        measured=measured,
        workspace_bytes={},
    )
    new.save(path)
    graph_path = path.with_name(path.name.replace(".profile.json", ".graph.json"))
    save_graph(apply_profile(graph, new), graph_path)
    log.info(
        "%s: graph %s -> %s, %s written", path, key["graph_sha"], new.key["graph_sha"], graph_path
    )
    return graph_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for p in args.profiles:
        print(convert(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
