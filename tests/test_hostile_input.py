"""Absurd values, mistyped keys and hostile files against ``python run.py`` (issue 19).

Every case ends as the README promises for bad input: one line on stderr that names what is
wrong (the key as typed, the file and field, the limit), exit code 2, nothing on stdout, no
traceback and no MLflow store written. The list keeps the cases a user found, so that none
comes back, and more of our own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.helpers import run_cli
from xengine.limits import max_nodes

BASE = [
    "net=tiny",
    "mem=85%",
    "execute=false",
    "strategy=[checkpoint_all]",
    "profile.repeats=1",
    "profile.warmup=0",
    "profile.progress=false",
]


def _graph(nodes_patch=None) -> dict:
    """A valid three-node training graph (f, loss, grad_f), patched per node."""
    nodes = [
        {"id": 0, "name": "f", "kind": "fwd", "output_bytes": 16, "cost_s": {"cpu": 1e-3}},
        {"id": 1, "name": "loss", "kind": "loss", "output_bytes": 4, "cost_s": {"cpu": 1e-3}},
        {"id": 2, "name": "grad_f", "kind": "bwd", "fwd_index": 0, "output_bytes": 16,
         "cost_s": {"cpu": 1e-3}},
    ]  # fmt: skip
    for k, patch in (nodes_patch or {}).items():
        nodes[k].update(patch)
    links = [{"source": 0, "target": 1}, {"source": 1, "target": 2}, {"source": 0, "target": 2}]
    return {"format": "xengine-graph", "version": 2, "name": "g", "nodes": nodes, "links": links}


def _chain(n_forward: int) -> dict:
    nodes = [{"id": i, "name": f"f{i}", "kind": "fwd", "output_bytes": 4} for i in range(n_forward)]
    nodes.append({"id": n_forward, "name": "loss", "kind": "loss", "output_bytes": 4})
    nodes += [
        {"id": n_forward + 1 + i, "name": f"b{i}", "kind": "bwd", "output_bytes": 4,
         "fwd_index": n_forward - 1 - i}
        for i in range(n_forward)
    ]  # fmt: skip
    for v in nodes:
        v["cost_s"] = {"cpu": 1e-3}
    links = [{"source": i, "target": i + 1} for i in range(2 * n_forward)]
    return {
        "format": "xengine-graph",
        "version": 2,
        "name": "chain",
        "nodes": nodes,
        "links": links,
    }


def _write_files(d: Path) -> dict[str, Path]:
    files = {
        "big_bytes": _graph({0: {"output_bytes": 10**20}}),
        "cost": _graph({0: {"cost_s": {"cpu": 1e300}}}),
        "fwd_self": _graph({2: {"fwd_index": 2}}),
        "fwd_bwd": _graph({2: {"fwd_index": 1}}),
    }
    out = {}
    for name, data in files.items():
        out[name] = d / f"{name}.json"
        out[name].write_text(json.dumps(data))
    two_twins = _graph()
    two_twins["nodes"].append(dict(two_twins["nodes"][2], id=3, name="grad_f2"))
    two_twins["links"].append({"source": 0, "target": 3})
    out["two_twins"] = d / "two_twins.json"
    out["two_twins"].write_text(json.dumps(two_twins))
    text = json.dumps(_graph())
    out["digits30"] = d / "digits30.json"
    out["digits30"].write_text(text.replace('"output_bytes": 16', f'"output_bytes": {10**30}', 1))
    out["digits"] = d / "digits.json"
    out["digits"].write_text(text.replace('"output_bytes": 16', '"output_bytes": 1' + "0" * 5000))
    out["deep"] = d / "deep.json"
    out["deep"].write_text(
        '{"format": "xengine-graph", "nodes": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    out["binary"] = d / "binary.json"
    out["binary"].write_bytes(bytes(range(256)) * 16)
    out["profile_digits"] = d / "profile.json"
    out["profile_digits"].write_text(
        '{"format": "xengine-profile", "version": 1' + "0" * 5000 + "}"
    )
    return out


CASES = [
    # (args, words the one line must contain); {name} is a file of _write_files
    # 2. absurd budgets
    (["mem=1e30GB"], ["1e30GB", "limit", "PiB"]),
    (["mem=1e400GB"], ["1e400GB", "limit"]),
    (["mem=1e400%"], ["1e400%", "1000%"]),
    # 3. user files that gave tracebacks
    (["graph={big_bytes}"], ["big_bytes.json", "nodes[0].output_bytes", "2^44"]),
    (["graph={digits30}"], ["digits30.json", "31 digits"]),
    (["graph={digits}"], ["digits.json", "5001 digits"]),
    (["profile.path={profile_digits}"], ["profile.json", "digits", "profile file"]),
    (["graph={deep}"], ["deep.json", "nested too deeply"]),
    # 4. config errors that were Hydra's
    (["foo=1"], ["unknown key 'foo'", "foo=1"]),
    (["net.foo=1"], ["unknown key 'net.foo'", "net has", "batch_size"]),
    (
        ["tracking.tracking.enabled=false"],
        ["tracking.tracking.enabled", "did you mean tracking.enabled?"],
    ),
    (["mem={cpu: 1GB}"], ["mem={cpu: 1GB}", "mem.<device>=<size>"]),
    (["devices=cpu+"], ["devices=cpu+", "empty"]),
    (["net.name=resnet18\nx"], ["net.name", "newline"]),
    (["net.name=!!python/object/apply:os.system [ls]"], ["net.name", "YAML tag"]),
    (["mem=${nosuch}"], ["mem", "interpolation", "nosuch"]),
    (["net.name=${oc.env:XE_SURELY_UNSET}"], ["net.name", "XE_SURELY_UNSET"]),
    (["~nosuch"], ["~nosuch", "no key"]),
    # 5. silently wrong readings
    (["execute=maybe"], ["execute=maybe", "true or false"]),
    (["tracking.enabled=maybe"], ["tracking.enabled=maybe", "true or false"]),
    (["redo=sometimes"], ["redo=sometimes", "true or false"]),
    (["profile.progress=2"], ["profile.progress=2", "true or false"]),
    (["graph={fwd_self}"], ["fwd_self.json", "grad_f", "fwd_index"]),
    (["graph={fwd_bwd}"], ["fwd_bwd.json", "grad_f", "fwd_index"]),
    (["graph={two_twins}"], ["two_twins.json", "two backward twins"]),
    (["graph={cost}"], ["cost.json", "nodes[0].cost_s.cpu", "limit"]),
    # 7. thin messages
    (["mem=0%"], ["0%", "above 0%"]),
    (["devices=cpu2+cpu1", "mem.cpu2=abc"], ["mem.cpu2=abc", "not understood"]),
    (["graph={binary}"], ["binary.json", "not a JSON", "binary"]),
    (["net.image_size=1"], ["tiny", "pool"]),
    # more of our own
    (["solver.time_limit_s=abc"], ["solver.time_limit_s=abc", "a number"]),
    (["solver.time_limit_s=inf"], ["solver.time_limit_s=inf", "finite"]),
    (["net.batch_size=1.5"], ["net.batch_size=1.5", "whole number"]),
    (["net.batch_size=[1,2]"], ["net.batch_size", "whole number"]),
    (["graph={tmp}"], ["is a folder"]),
    (["devices=[cpu,]"], ["devices=[cpu,]", "empty"]),
    (["net.batch_size=[1"], ["net.batch_size=[1"]),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    return {**_write_files(d), "tmp": d}


def _fill(arg: str, files: dict[str, Path]) -> str:
    for name, path in files.items():
        arg = arg.replace("{" + name + "}", str(path))
    return arg


@pytest.mark.parametrize("args, words", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_records_nothing(tmp_path, files, args, words):
    proc = run_cli(tmp_path, *BASE, *(_fill(a, files) for a in args))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert proc.stdout == ""
    assert not (tmp_path / "mlflow.db").exists()  # nothing recorded, finished or not


def test_a_graph_too_large_to_schedule_is_refused_before_any_large_allocation(tmp_path):
    """A 200 000-node chain (the issue's 59 MB file) asked for a dense 37 GiB keep-all
    schedule; now its size is checked against the stated limit first."""
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(_chain(100_000)))
    proc = run_cli(tmp_path, *BASE, f"graph={path}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "200001 nodes on 1 device" in line and f"up to {max_nodes(1)} nodes" in line, line
    assert "37.3 GiB" in line


def test_a_sweep_skips_a_point_with_an_absurd_budget_and_runs_the_others(tmp_path):
    """In a sweep the bad point is recorded as skipped (not FAILED with a traceback), the good
    one finishes, and the sweep exits 0."""
    overrides = [a for a in BASE if not a.startswith("mem=")]
    proc = run_cli(tmp_path, *overrides, "mem=1e400GB,85%", "-m")  # after run_cli's own
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("xengine")
    runs = client.search_runs([exp.experiment_id], "tags.`xe.task` = 'run'")
    by_mem = {r.data.params.get("mem"): r for r in runs}
    assert set(by_mem) == {"1e400GB", "85%"}, by_mem.keys()
    bad, good = by_mem["1e400GB"], by_mem["85%"]
    assert bad.data.tags["xe.status"] == "skipped" and "limit" in bad.data.tags["xe.error"]
    assert good.info.status == "FINISHED" and good.data.tags["xe.status"] == "ok"
