"""Graph JSON files (node-link format), docs/design.md section 3.

A graph file is plain JSON, read as data (never evaluated or unpickled)::

    {"format": "xengine-graph", "version": 2, "name": "net", "fixed_bytes": 0,
     "nodes": [{"id": 0, "name": "bn1", "kind": "fwd", "output_bytes": 4096,
                "state_bytes": 64, "workspace_bytes": 0,
                "device_workspace_bytes": {"cpu2": 128}, "cost_s": {"cpu": 0.001},
                "fwd_index": null}, ...],
     "links": [{"source": 0, "target": 1, "kind": "value", "copyable": true},
               {"source": 0, "target": 7, "kind": "state"}],
     "copy": [{"src": "cpu", "dst": "cuda", "latency_s": 1e-5,
               "bandwidth_bytes_per_s": 1e10}]}

Nodes may come in any order and ids may be any JSON scalars: nodes are renumbered in a
topological order that keeps the file's order wherever the links allow (so a file already in
topological order keeps its numbering). ``fwd_index`` names a node *id*, like the links do.

Version 2 adds what autograd keeps (docs/design.md section 3): ``state_bytes`` per forward node,
``device_workspace_bytes`` (workspace measured per device) and the ``kind`` of each link:
``value`` (the target reads the source's value) or ``state`` (the target is the source's
backward op and reads its autograd state; never copyable). Version-1 files have neither:
they load unchanged, with their ``copyable: false`` links read as values kept for the
backward op, as they were written.

Checkmate's exported layer graphs (networkx node-link JSON, e.g. MOCCASIN's ``*_train_nx.json``)
load as they are: ``cost_ram`` is read as ``output_bytes``, ``cost_cpu`` as the cost on device
``cpu``, ``backward: true/false`` as the kind when ``kind`` is absent, ``edges`` as ``links``,
and ``cost_ram_fixed`` as ``fixed_bytes``. Unknown fields are ignored.

Every error is a :class:`GraphError` whose message names the file and the field.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xengine.files import read_json
from xengine.graph.types import EDGE_KINDS, NODE_KINDS, CopyModel, Edge, Graph, GraphError, Node
from xengine.limits import MAX_COST_S, MAX_TENSOR_BYTES

FORMAT = "xengine-graph"
VERSION = 2
READS_VERSIONS = (1, 2)


def load_graph(path: str | Path) -> Graph:
    """Read a graph file; see the module docstring for the format."""
    p = Path(path)
    data = read_json(p, "graph", GraphError)
    return graph_from_dict(data, source=str(p), default_name=p.stem)


def save_graph(graph: Graph, path: str | Path) -> None:
    """Write ``graph`` as JSON; node ids are the node indices."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(graph_to_dict(graph), indent=1) + "\n", encoding="utf-8")


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": graph.name,
        "fixed_bytes": int(graph.fixed_bytes),
        "nodes": [
            {
                "id": i,
                "name": v.name,
                "kind": v.kind,
                "output_bytes": int(v.output_bytes),
                "state_bytes": int(v.state_bytes),
                "workspace_bytes": int(v.workspace_bytes),
                "device_workspace_bytes": {
                    d: int(w) for d, w in sorted(v.device_workspace_bytes.items())
                },
                "cost_s": {d: float(c) for d, c in sorted(v.cost_s.items())},
                "fwd_index": v.fwd_index,
            }
            for i, v in enumerate(graph.nodes)
        ],
        "links": [
            {"source": e.src, "target": e.dst, "kind": e.kind, "copyable": bool(e.copyable)}
            for e in sorted(graph.edges, key=lambda e: (e.src, e.dst, e.kind))
        ],
        "copy": [
            {
                "src": a,
                "dst": b,
                "latency_s": float(m.latency_s),
                "bandwidth_bytes_per_s": float(m.bandwidth_bytes_per_s),
            }
            for (a, b), m in sorted(graph.copy_models.items())
        ],
    }


# ---------------------------------------------------------------------------------- parsing
def _err(source: str, field: str, msg: str) -> GraphError:
    return GraphError(f"{source}: {field}: {msg}")


def _number(
    source: str, field: str, value: Any, *, integer: bool = False, seconds: bool = True
) -> float | int:
    """A finite, non-negative number (bools are not numbers here) within its stated range
    (``xengine.limits``): bytes (``integer``) up to ``MAX_TENSOR_BYTES``, ``seconds`` up to
    ``MAX_COST_S``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(source, field, f"expected a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise _err(source, field, f"expected a finite non-negative number, got {value!r}")
    if integer:
        if value != int(value):
            raise _err(source, field, f"expected a whole number of bytes, got {value!r}")
        if value > MAX_TENSOR_BYTES:
            raise _err(
                source, field, f"{value:.4g} bytes is above the limit of 2^44 bytes (16 TiB)"
            )
        return int(value)
    if seconds and value > MAX_COST_S:
        raise _err(source, field, f"{value:.4g} s is above the limit of {MAX_COST_S:.0e} s")
    return float(value)


def _node_id(source: str, field: str, value: Any) -> Any:
    if isinstance(value, (dict, list)) or value is None:
        raise _err(source, field, f"a node id must be a number or a string, got {value!r}")
    return value


def _get(source: str, field: str, obj: Mapping[str, Any], *keys: str) -> Any:
    """The first of ``keys`` present in ``obj``; an error naming ``field.keys[0]`` if none."""
    for k in keys:
        if k in obj:
            return obj[k]
    alias = f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""
    raise _err(source, f"{field}.{keys[0]}", f"missing{alias}")


def graph_from_dict(data: Any, source: str = "graph", default_name: str = "graph") -> Graph:
    """Build a :class:`Graph` from parsed JSON; ``source`` names the file in errors.

    The steps follow the file (see the module docstring): the header, the nodes keyed by
    their ids, the links between ids, a topological renumbering, the copy models. Each step
    checks its own part, so the first error met is the one reported."""
    version, name, fixed_bytes, raw_nodes, raw_links = _read_header(data, source, default_name)
    ids, pos_of, parsed = _read_nodes(raw_nodes, source)
    edges = _read_links(raw_links, ids, pos_of, version, source)
    pairs = {(u, v) for u, v, _ in edges}
    order = _topological_order(len(parsed), pairs, [p["name"] for p in parsed], source)
    new_index = {old: new for new, old in enumerate(order)}
    nodes = _renumbered_nodes(parsed, order, pos_of, new_index, source)
    copy_models = _read_copy_models(data.get("copy", []), source)
    try:
        return Graph(
            name,
            tuple(nodes),
            tuple(
                Edge(new_index[u], new_index[v], c, kind)
                for (u, v, kind), c in sorted(edges.items())
            ),
            fixed_bytes=fixed_bytes,
            copy_models=copy_models,
            meta={"source": source},
        )
    except GraphError as exc:
        raise GraphError(f"{source}: {exc}") from None


def _read_header(
    data: Any, source: str, default_name: str
) -> tuple[Any, str, int, list[Any], list[Any]]:
    """Format, version, name and fixed bytes, and the node and link lists (not yet read).

    The version decides how links are read (version 1 has value links only, docs/design.md
    section 3); the name and fixed bytes may sit where networkx or Checkmate put them."""
    if not isinstance(data, dict):
        raise _err(source, "top level", f"expected a JSON object, got {type(data).__name__}")
    fmt = data.get("format", FORMAT)
    if fmt != FORMAT:
        raise _err(source, "format", f"expected {FORMAT!r}, got {fmt!r}")
    version = data.get("version", 1)
    if version not in READS_VERSIONS or isinstance(version, bool):
        raise _err(
            source, "version", f"this xengine reads versions 1 and {VERSION}, got {version!r}"
        )
    name = data.get("name")
    if name is None and isinstance(data.get("graph"), dict):
        name = data["graph"].get("name")  # networkx keeps graph attributes under "graph"
    name = str(name) if name is not None else default_name
    fixed = data.get("fixed_bytes", data.get("cost_ram_fixed", 0))
    fixed_bytes = int(_number(source, "fixed_bytes", fixed, integer=True))

    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise _err(source, "nodes", "expected a non-empty list of nodes")
    raw_links = data.get("links", data.get("edges", []))
    if not isinstance(raw_links, list):
        raise _err(source, "links", "expected a list of links")
    return version, name, fixed_bytes, raw_nodes, raw_links


def _read_nodes(
    raw_nodes: list[Any], source: str
) -> tuple[list[Any], dict[Any, int], list[dict[str, Any]]]:
    """The nodes in file order: their ids, each id's position, and each node's fields.

    Ids and names must be unique: links and ``fwd_index`` name ids, and a profile's tables
    name nodes (``compute_s[device][node name]``)."""
    ids: list[Any] = []
    pos_of: dict[Any, int] = {}
    names_seen: dict[str, int] = {}
    parsed: list[dict[str, Any]] = []
    for k, raw in enumerate(raw_nodes):
        field = f"nodes[{k}]"
        if not isinstance(raw, dict):
            raise _err(source, field, f"expected an object, got {raw!r}")
        nid = _node_id(source, f"{field}.id", raw.get("id", k))
        if nid in pos_of:
            raise _err(
                source, f"{field}.id", f"id {nid!r} is used twice (also nodes[{pos_of[nid]}])"
            )
        pos_of[nid] = k
        ids.append(nid)
        nname = str(raw.get("name", nid))
        if nname in names_seen:
            raise _err(
                source,
                f"{field}.name",
                f"{nname!r} is used twice (also nodes[{names_seen[nname]}])",
            )
        names_seen[nname] = k
        parsed.append({"name": nname, **_read_node_fields(raw, field, source)})
    return ids, pos_of, parsed


def _read_node_fields(raw: Mapping[str, Any], field: str, source: str) -> dict[str, Any]:
    """One node's kind, bytes (value, workspace, state, workspace per device), costs per
    device and ``fwd_index`` (an id, resolved once every node is known).

    Checkmate's names are read where ours are absent: ``backward`` for the kind,
    ``cost_ram`` for the output bytes, ``cost_cpu`` for the cost on ``cpu``."""
    kind = _read_node_kind(raw, field, source)
    out_field = "output_bytes" if "output_bytes" in raw else "cost_ram"
    out_bytes = _number(
        source,
        f"{field}.{out_field}",
        _get(source, field, raw, "output_bytes", "cost_ram"),
        integer=True,
    )
    ws = _number(source, f"{field}.workspace_bytes", raw.get("workspace_bytes", 0), integer=True)
    state = _number(source, f"{field}.state_bytes", raw.get("state_bytes", 0), integer=True)
    dws = raw.get("device_workspace_bytes", {})
    if not isinstance(dws, dict):
        raise _err(
            source,
            f"{field}.device_workspace_bytes",
            f"expected an object device -> bytes, got {dws!r}",
        )
    dev_ws = {
        str(d): int(_number(source, f"{field}.device_workspace_bytes.{d}", w, integer=True))
        for d, w in dws.items()
    }
    cost: dict[str, float] = {}
    if "cost_s" in raw:
        table = raw["cost_s"]
        if not isinstance(table, dict):
            raise _err(
                source,
                f"{field}.cost_s",
                f"expected an object device -> seconds, got {table!r}",
            )
        for dev, val in table.items():
            cost[str(dev)] = float(_number(source, f"{field}.cost_s.{dev}", val))
    if "cost_cpu" in raw and "cpu" not in cost:
        cost["cpu"] = float(_number(source, f"{field}.cost_cpu", raw["cost_cpu"]))
    fwd = raw.get("fwd_index")
    if fwd is not None:
        fwd = _node_id(source, f"{field}.fwd_index", fwd)
    return {
        "kind": kind,
        "out": int(out_bytes),
        "ws": int(ws),
        "state": int(state),
        "dev_ws": dev_ws,
        "cost": cost,
        "fwd": fwd,
    }


def _read_node_kind(raw: Mapping[str, Any], field: str, source: str) -> str:
    """``kind`` (one of ``NODE_KINDS``), else Checkmate's ``backward`` flag."""
    if "kind" in raw:
        kind = raw["kind"]
        if kind not in NODE_KINDS:
            raise _err(source, f"{field}.kind", f"{kind!r} is not one of {', '.join(NODE_KINDS)}")
        return kind
    if "backward" in raw:
        if not isinstance(raw["backward"], bool):
            raise _err(
                source, f"{field}.backward", f"expected true or false, got {raw['backward']!r}"
            )
        return "bwd" if raw["backward"] else "fwd"
    raise _err(source, f"{field}.kind", "missing (or a Checkmate 'backward' flag)")


def _read_links(
    raw_links: list[Any], ids: list[Any], pos_of: dict[Any, int], version: Any, source: str
) -> dict[tuple[int, int, str], bool]:
    """The links as ``(source position, target position, kind) -> copyable``.

    A ``state`` link (version 2) ties a backward op to its forward op's autograd state and is
    never copyable (docs/design.md section 3); a value link is copyable unless the file says not
    (version-1 files mark the values kept for the backward op that way)."""
    edges: dict[tuple[int, int, str], bool] = {}
    for k, raw in enumerate(raw_links):
        field = f"links[{k}]"
        if not isinstance(raw, dict):
            raise _err(source, field, f"expected an object, got {raw!r}")
        ends = []
        for end in ("source", "target"):
            nid = _get(source, field, raw, end)
            if isinstance(nid, (dict, list)) or nid not in pos_of:
                raise _err(source, f"{field}.{end}", f"node id {nid!r} does not exist")
            ends.append(pos_of[nid])
        kind = raw.get("kind", "value")
        if kind not in EDGE_KINDS or (kind != "value" and version < 2):
            allowed = ", ".join(EDGE_KINDS) if version >= 2 else "value (version 1)"
            raise _err(source, f"{field}.kind", f"{kind!r} is not one of {allowed}")
        copyable = raw.get("copyable", kind == "value")
        if not isinstance(copyable, bool):
            raise _err(source, f"{field}.copyable", f"expected true or false, got {copyable!r}")
        if kind == "state" and copyable:
            raise _err(source, f"{field}.copyable", "a state link cannot be copyable")
        key = (ends[0], ends[1], kind)
        if key in edges:
            raise _err(source, field, f"link {ids[key[0]]!r} -> {ids[key[1]]!r} appears twice")
        edges[key] = copyable
    return edges


def _renumbered_nodes(
    parsed: list[dict[str, Any]],
    order: list[int],
    pos_of: dict[Any, int],
    new_index: dict[int, int],
    source: str,
) -> list[Node]:
    """The :class:`Node` objects in topological ``order``, ``fwd_index`` as the new index.

    :class:`Node` checks its own values; its error is reported under the node's position in
    the file."""
    nodes = []
    for old in order:
        p = parsed[old]
        fwd_index = None
        if p["fwd"] is not None:
            if p["fwd"] not in pos_of:
                raise _err(
                    source, f"nodes[{old}].fwd_index", f"node id {p['fwd']!r} does not exist"
                )
            fwd_index = new_index[pos_of[p["fwd"]]]
        try:
            nodes.append(
                Node(
                    p["name"],
                    p["kind"],
                    p["out"],
                    p["cost"],
                    workspace_bytes=p["ws"],
                    fwd_index=fwd_index,
                    state_bytes=p["state"],
                    device_workspace_bytes=p["dev_ws"],
                )
            )
        except GraphError as exc:
            raise _err(source, f"nodes[{old}]", str(exc)) from None
    return nodes


def _read_copy_models(raw_copy: Any, source: str) -> dict[tuple[str, str], CopyModel]:
    """Per ordered device pair, latency + bytes / bandwidth (the copy model of docs/design.md
    section 4); a bandwidth must be positive, since a copy's time divides by it."""
    copy_models: dict[tuple[str, str], CopyModel] = {}
    if not isinstance(raw_copy, list):
        raise _err(
            source, "copy", "expected a list of {src, dst, latency_s, bandwidth_bytes_per_s}"
        )
    for k, raw in enumerate(raw_copy):
        field = f"copy[{k}]"
        if not isinstance(raw, dict):
            raise _err(source, field, f"expected an object, got {raw!r}")
        a = str(_get(source, field, raw, "src"))
        b = str(_get(source, field, raw, "dst"))
        lat = float(_number(source, f"{field}.latency_s", _get(source, field, raw, "latency_s")))
        bw = float(
            _number(
                source,
                f"{field}.bandwidth_bytes_per_s",
                _get(source, field, raw, "bandwidth_bytes_per_s"),
                seconds=False,
            )
        )
        if bw <= 0:
            raise _err(source, f"{field}.bandwidth_bytes_per_s", "must be positive")
        copy_models[(a, b)] = CopyModel(lat, bw)
    return copy_models


def _topological_order(n: int, edges, names: list[str], source: str) -> list[int]:
    """Kahn's algorithm taking the lowest file position first (stable); a cycle is an error
    that names the nodes on one cycle."""
    succ: list[list[int]] = [[] for _ in range(n)]
    preds: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for u, v in edges:
        succ[u].append(v)
        preds[v].append(u)
        indeg[v] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        u = heapq.heappop(ready)
        order.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(ready, v)
    if len(order) == n:
        return order
    # Every node left has a predecessor that is also left: walk back until a node repeats.
    left = set(range(n)) - set(order)
    walk: list[int] = []
    seen: dict[int, int] = {}
    v = min(left)
    while v not in seen:
        seen[v] = len(walk)
        walk.append(v)
        v = min(u for u in preds[v] if u in left)
    cycle = walk[seen[v] :][::-1]
    path = " -> ".join(repr(names[i]) for i in cycle + [cycle[0]])
    raise _err(source, "links", f"the links form a cycle: {path}")
