"""Measured, cached cost profiles (xengine/profile/profiler.py)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from _nets import tiny

import xengine.profile.profiler as profiler
from xengine.problem import Instance
from xengine.profile.profiler import Profile, ProfileError, apply_profile, profile_model
from xengine.profile.workspace import capture_net
from xengine.schedule import keep_all_schedule
from xengine.simulate import simulate


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """A profile of tiny (batch 8) on two logical CPU devices, measured into a cache dir."""
    cache = tmp_path_factory.mktemp("profiles")
    prof = profile_model(tiny(), ["cpu1", "cpu2"], repeats=1, warmup=0, cache_dir=cache)
    return prof, cache


def test_profile_times_every_node_on_every_device(cached):
    prof, cache = cached
    names = [v.name for v in tiny().graph.nodes]
    assert prof.devices == ("cpu1", "cpu2")
    for d in prof.devices:
        assert list(prof.compute_s[d]) == names
        assert all(t > 0 for t in prof.compute_s[d].values())
    assert set(prof.copy) == {("cpu1", "cpu2"), ("cpu2", "cpu1")}
    for m in prof.copy.values():
        assert m.latency_s >= 0 and m.bandwidth_bytes_per_s > 0
    assert prof.key["batch_size"] == 8 and prof.key["net"] == "tiny"
    assert prof.key["devices"]["cpu2"]["threads"] == 2
    assert prof.source.startswith("measured on ")
    (path,) = cache.glob("*.json")
    assert path.name.startswith("tiny-b8-train-")


def test_each_device_is_timed_on_itself(monkeypatch):
    # a one-device keep-everything schedule names device 0; timing cpu1 must run on cpu1
    # (it ran on the first device of the mix: cpu2's threads, so cpu1 looked the faster one)
    from xengine.execute.executor import _Runtime

    seen: list[str] = []
    compute, run_group = _Runtime.compute, _Runtime.run_group

    def spy_compute(self, node, d, *args, **kwargs):
        seen.append(d)
        return compute(self, node, d, *args, **kwargs)

    def spy_group(self, gp):
        seen.append(gp.device)
        return run_group(self, gp)

    monkeypatch.setattr(_Runtime, "compute", spy_compute)
    monkeypatch.setattr(_Runtime, "run_group", spy_group)
    rt = _Runtime(tiny(), ("cpu2", "cpu1"))
    for d in ("cpu1", "cpu2"):
        seen.clear()
        profiler._time_step(rt, d, repeats=1, warmup=0, bar=SimpleNamespace(update=abs))
        assert seen and set(seen) == {d}


def test_cache_hit_returns_the_profile_without_timing(cached, monkeypatch):
    prof, cache = cached

    def no_timing(*args, **kwargs):
        raise AssertionError("profile_model measured again instead of reading the cache")

    monkeypatch.setattr(profiler, "_measure", no_timing)
    again = profile_model(tiny(), ["cpu1", "cpu2"], repeats=1, warmup=0, cache_dir=cache)
    assert again.compute_s == prof.compute_s and again.copy == prof.copy
    assert again.key == prof.key
    (path,) = cache.glob("*.json")
    assert again.source == str(path)
    # another device mix is another key: it is measured, not read from this file
    with pytest.raises(AssertionError, match="measured again"):
        profile_model(tiny(), ["cpu1"], repeats=1, warmup=0, cache_dir=cache)


def test_save_load_round_trip(cached, tmp_path):
    prof, _ = cached
    path = prof.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["format"] == "xengine-profile" and data["version"] == 2
    back = Profile.load(path)
    assert back.key == prof.key and back.compute_s == prof.compute_s and back.copy == prof.copy
    assert back.workspace_bytes == prof.workspace_bytes
    assert set(prof.workspace_bytes) == {"cpu1", "cpu2"}
    assert back.source == str(path) and back.measured == prof.measured


def test_workspaces_are_measured_per_device_and_applied(cached):
    """Op temporaries depend on the device's thread count: each device gets its own figure,
    the instance reads it, and the backward ops need at least their parameter gradients."""
    prof, _ = cached
    g = apply_profile(tiny().graph, prof)
    by = {v.name: v for v in g.nodes}
    for d in ("cpu1", "cpu2"):
        assert set(prof.workspace_bytes[d]) == set(by)
        assert by["grad_fc"].workspace_on(d) == prof.workspace_bytes[d]["grad_fc"]
        assert by["grad_fc"].workspace_on(d) >= 10 * 8 * 16 * 16 * 4
    inst = Instance(g, ("cpu1", "cpu2"), (10**9, 10**9))
    names = [v.name for v in g.nodes]
    for k, d in enumerate(inst.devices):
        assert list(inst.workspace_bytes[k]) == [prof.workspace_bytes[d][x] for x in names]


def test_applied_profile_drives_the_simulator(cached):
    prof, _ = cached
    g = apply_profile(tiny().graph, prof)
    assert g.devices == ("cpu1", "cpu2")
    inst = Instance(g, ("cpu1", "cpu2"), (10**9, 10**9))
    sim = simulate(inst, keep_all_schedule(inst))
    assert sim.time_s == pytest.approx(sum(prof.compute_s["cpu1"].values()))
    m = prof.copy[("cpu1", "cpu2")]
    assert g.copy_time_s("cpu1", "cpu2", 10**6) == pytest.approx(m.time_s(10**6))


def test_profile_of_another_batch_is_a_clear_error(cached):
    prof, cache = cached
    (path,) = cache.glob("*.json")
    other = capture_net("tiny", 4, measure_workspace=False)
    with pytest.raises(ProfileError, match=rf"{path.name}: field 'key.batch_size' is 8 .* 4"):
        apply_profile(other.graph, Profile.load(path))
    # the same graph but another net name is also refused
    renamed = Profile({**prof.key, "net": "resnet18"}, prof.compute_s, prof.copy, "p.json")
    with pytest.raises(ProfileError, match="p.json: field 'key.net'"):
        apply_profile(tiny().graph, renamed)


def test_profile_missing_a_node_is_a_clear_error(cached, tmp_path):
    prof, _ = cached
    data = prof.to_json()
    del data["compute_s"]["cpu1"]["fc"]
    path = tmp_path / "short.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"short\.json: field 'compute_s.cpu1'.*'fc'"):
        apply_profile(tiny().graph, Profile.load(path))


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["compute_s"]["cpu1"].update(conv1="fast"), "compute_s.cpu1.conv1"),
        (lambda d: d["compute_s"]["cpu1"].update(conv1=-1.0), "compute_s.cpu1.conv1"),
        (lambda d: d["key"].pop("batch_size"), "key.batch_size"),
        (lambda d: d.update(format="pickle"), "format"),
        (lambda d: d["copy"][0].update(bandwidth_bytes_per_s=0), "copy[0].bandwidth_bytes_per_s"),
    ],
)
def test_malformed_profile_files_name_the_field(cached, tmp_path, edit, field):
    prof, _ = cached
    data = prof.to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=rf"bad\.json: field '{re.escape(field)}'"):
        Profile.load(path)


def test_unreadable_profile_files(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        Profile.load(tmp_path / "none.json")
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ProfileError, match=r"x\.json: not valid JSON"):
        Profile.load(p)
