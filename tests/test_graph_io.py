"""Graph JSON files: round trip, renumbering, Checkmate aliases, and errors that name the field."""

from __future__ import annotations

import json

import pytest

from xengine.graph.io import graph_from_dict, graph_to_dict, load_graph, save_graph
from xengine.graph.synthetic import chain, training_graph
from xengine.graph.types import CopyModel, GraphError


def _write(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def _node(i, kind="fwd", out=8, **extra):
    return {
        "id": i,
        "name": f"n{i}",
        "kind": kind,
        "output_bytes": out,
        "cost_s": {"cpu": 1.0},
        **extra,
    }


def test_round_trip_keeps_every_field(tmp_path):
    g = training_graph(
        "dag",
        [(0, 1), (0, 2), (1, 2)],
        3,
        [100, 200, 300],
        {"cpu": [0.1, 0.2, 0.3], "cuda": [0.01, 0.02, 0.03]},
        copy_models={("cpu", "cuda"): CopyModel(1e-5, 1e10), ("cuda", "cpu"): CopyModel(2e-5, 5e9)},
    )
    g = type(g)(g.name, g.nodes, g.edges, fixed_bytes=12345, copy_models=g.copy_models)
    path = tmp_path / "g.json"
    save_graph(g, path)
    back = load_graph(path)
    assert back.name == g.name
    assert back.nodes == g.nodes
    assert set(back.edges) == set(g.edges)
    assert any(not e.copyable for e in back.edges)  # the autograd-state edges survive
    assert back.fixed_bytes == 12345
    assert dict(back.copy_models) == dict(g.copy_models)
    assert [v.fwd_index for v in back.nodes] == [v.fwd_index for v in g.nodes]
    assert back.meta["source"] == str(path)


def test_nodes_in_any_order_are_renumbered_topologically_and_stably():
    g = chain(3)
    data = graph_to_dict(g)
    data["nodes"] = list(reversed(data["nodes"]))
    # ids are strings now, to show they are names, not positions
    for v in data["nodes"]:
        v["id"] = f"id{v['id']}"
        if v["fwd_index"] is not None:
            v["fwd_index"] = f"id{v['fwd_index']}"
    for e in data["links"]:
        e["source"], e["target"] = f"id{e['source']}", f"id{e['target']}"
    back = graph_from_dict(data, source="mem.json")
    assert [v.name for v in back.nodes] == [v.name for v in g.nodes]
    assert set(back.edges) == set(g.edges)
    assert [v.fwd_index for v in back.nodes] == [v.fwd_index for v in g.nodes]


def test_independent_nodes_keep_file_order():
    data = {
        "nodes": [_node("c"), _node("a"), _node("b")],
        "links": [{"source": "b", "target": "c"}],
    }
    back = graph_from_dict(data)
    # c must follow b; a stays before b as in the file
    assert [v.name for v in back.nodes] == ["na", "nb", "nc"]


def test_cycle_names_the_nodes_on_it(tmp_path):
    data = {
        "nodes": [_node(0), _node(1), _node(2), _node(3)],
        "links": [
            {"source": 0, "target": 1},
            {"source": 1, "target": 2},
            {"source": 2, "target": 3},
            {"source": 3, "target": 1},
        ],
    }
    path = _write(tmp_path / "cyc.json", data)
    with pytest.raises(GraphError) as ei:
        load_graph(path)
    msg = str(ei.value)
    assert path in msg and "cycle" in msg
    for name in ("'n1'", "'n2'", "'n3'"):
        assert name in msg
    assert "'n0'" not in msg


def test_link_to_missing_node_names_file_index_and_id(tmp_path):
    data = {
        "nodes": [_node(0), _node(1)],
        "links": [{"source": 0, "target": 1}, {"source": 1, "target": 7}],
    }
    path = _write(tmp_path / "missing.json", data)
    with pytest.raises(GraphError) as ei:
        load_graph(path)
    msg = str(ei.value)
    assert path in msg and "links[1].target" in msg and "7" in msg


def test_checkmate_aliases(tmp_path):
    # networkx node-link as Checkmate / MOCCASIN export it:
    # no kind, backward flags, cost_cpu / cost_ram
    data = {
        "directed": True,
        "multigraph": False,
        "graph": {"name": "vgg_like"},
        "nodes": [
            {"id": 0, "name": "conv", "backward": False, "cost_cpu": 3, "cost_ram": 400},
            {"id": 1, "name": "loss", "backward": False, "cost_cpu": 1, "cost_ram": 4},
            {"id": 2, "name": "grad_conv", "backward": True, "cost_cpu": 6, "cost_ram": 400},
        ],
        "links": [
            {"source": 0, "target": 1},
            {"source": 1, "target": 2},
            {"source": 0, "target": 2},
        ],
    }
    g = load_graph(_write(tmp_path / "cm.json", data))
    assert g.name == "vgg_like"
    assert [v.kind for v in g.nodes] == ["fwd", "fwd", "bwd"]
    assert [v.output_bytes for v in g.nodes] == [400, 4, 400]
    assert [v.cost_s["cpu"] for v in g.nodes] == [3.0, 1.0, 6.0]
    assert g.devices == ("cpu",)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["nodes"][1].update(output_bytes=-5), "nodes[1].output_bytes"),
        (lambda d: d["nodes"][1].update(output_bytes="big"), "nodes[1].output_bytes"),
        (lambda d: d["nodes"][0].update(kind="forward"), "nodes[0].kind"),
        (lambda d: d["nodes"][0].pop("kind"), "nodes[0].kind"),
        (lambda d: d["nodes"][0].update(cost_s={"cpu": "fast"}), "nodes[0].cost_s.cpu"),
        (lambda d: d["nodes"][1].update(name="n0"), "nodes[1].name"),
        (lambda d: d["nodes"][1].update(id=0), "nodes[1].id"),
        (lambda d: d["links"][0].pop("source"), "links[0].source"),
        (lambda d: d["links"].append({"source": 0, "target": 1}), "links[1]"),
        (lambda d: d.update(format="onnx"), "format"),
        (lambda d: d.update(version=3), "version"),
        (lambda d: d.update(nodes=[]), "nodes"),
        (
            lambda d: d.update(copy=[{"src": "cpu", "dst": "cuda", "latency_s": 0}]),
            "copy[0].bandwidth_bytes_per_s",
        ),
    ],
)
def test_malformed_fields_are_named(tmp_path, mutate, field):
    data = {
        "format": "xengine-graph",
        "version": 1,
        "nodes": [_node(0), _node(1)],
        "links": [{"source": 0, "target": 1}],
    }
    mutate(data)
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(GraphError) as ei:
        load_graph(path)
    assert path in str(ei.value)
    assert field in str(ei.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(GraphError, match="does not exist"):
        load_graph(tmp_path / "nope.json")
    bad = tmp_path / "broken.json"
    bad.write_text('{"nodes": [')
    with pytest.raises(GraphError, match=r"broken\.json: not valid JSON \(line 1"):
        load_graph(bad)


def test_file_is_data_not_code(tmp_path):
    # a string where a number belongs is rejected, never evaluated
    data = {"nodes": [_node(0, out="__import__('os').system('false')")], "links": []}
    with pytest.raises(GraphError, match="nodes\\[0\\].output_bytes"):
        load_graph(_write(tmp_path / "evil.json", data))


# --------------------------------------------------------------------------- version 2
def _v2() -> dict:
    """f0 -> loss -> b0, with f0's state read by b0."""
    return {
        "format": "xengine-graph",
        "version": 2,
        "nodes": [
            _node(0, state_bytes=16),
            _node(1, kind="loss"),
            _node(2, kind="bwd", fwd_index=0, device_workspace_bytes={"cpu2": 64}),
        ],
        "links": [
            {"source": 0, "target": 1, "kind": "value"},
            {"source": 1, "target": 2},
            {"source": 0, "target": 2, "kind": "state"},
        ],
    }


def test_version_2_round_trip_keeps_states_and_workspaces(tmp_path):
    g = graph_from_dict(_v2(), source="v2.json")
    assert g.has_states and list(g.state_bytes) == [16, 0, 0]
    assert g.state_reader[0] == 2 and g.state_source[2] == 0
    assert g.predecessors[2] == (1,)  # the state link is not a value read
    assert g.nodes[2].workspace_on("cpu2") == 64 and g.nodes[2].workspace_on("cpu") == 0
    save_graph(g, tmp_path / "g.json")
    back = load_graph(tmp_path / "g.json")
    assert back.nodes == g.nodes and set(back.edges) == set(g.edges)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["links"][2].update(target=1), "state link n0->n1 must join a forward op"),
        (lambda d: d["nodes"][0].update(state_bytes=-1), "nodes[0].state_bytes"),
        (lambda d: d["links"][2].update(copyable=True), "links[2].copyable"),
        (lambda d: d["links"][2].update(kind="grad"), "links[2].kind"),
        (lambda d: d.update(version=1), "links[2].kind"),  # version 1 has no state links
        (lambda d: d["nodes"][2].update(fwd_index=2), "fwd_index must name a forward node"),
        (
            lambda d: d["nodes"].append(_node(3, kind="bwd", fwd_index=0)),
            "'n0' has two backward twins, 'n2' and 'n3'",
        ),
        (lambda d: d["nodes"][1].update(state_bytes=4), "only a forward op has an autograd"),
        (
            lambda d: d["nodes"][2].update(device_workspace_bytes={"cpu": -3}),
            "nodes[2].device_workspace_bytes.cpu",
        ),
    ],
)
def test_version_2_errors_name_the_file_and_the_field(tmp_path, mutate, message):
    data = _v2()
    mutate(data)
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(GraphError) as ei:
        load_graph(path)
    assert path in str(ei.value) and message in str(ei.value), str(ei.value)


def test_schedule_keeping_a_state_where_its_op_never_ran_is_refused():
    from xengine.problem import Instance
    from xengine.schedule import Schedule, keep_all_schedule
    from xengine.simulate import ScheduleError, simulate

    g = graph_from_dict(_v2(), source="v2.json")
    cm = CopyModel(0.0, 1e9)
    g = g.with_costs(
        {"cpu2": {v.name: 1.0 for v in g.nodes}}, {("cpu", "cpu2"): cm, ("cpu2", "cpu"): cm}
    )
    inst = Instance(g, ("cpu", "cpu2"), (10**6, 10**6))
    ok = keep_all_schedule(inst)
    simulate(inst, ok)
    data = ok.to_json()
    assert data["version"] == 2 and data["S_state"] == [[0, 1, 0], [0, 2, 0]]
    data["S_state"] = [[1, 1, 0], [1, 2, 0]]  # on cpu2, where f0 never ran
    bad = Schedule.from_json(data, source="s.json")
    with pytest.raises(ScheduleError, match=r"the state of node 0 \(n0\) is kept on cpu2"):
        simulate(inst, bad)
    v1 = {k: v for k, v in ok.to_json().items() if k != "S_state"} | {"version": 1}
    assert Schedule.from_json(v1).S_state is None
    assert simulate(inst, Schedule.from_json(v1)).peak_bytes.tolist() == (
        simulate(inst, ok).peak_bytes.tolist()
    )
