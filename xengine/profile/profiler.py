"""Measured costs: per node and device compute time, per device pair copy time
(docs/design.md section 4).

Every forward, loss and backward node is timed exactly as the executor runs it and as a step
pays for it: inside keep-everything steps of the compiled executor, ops back to back, on each
device (:func:`_time_step`), the median of ``repeats`` steps after ``warmup`` steps. Copies
between two devices are timed at a few sizes with the executor's copy and fitted as latency +
bytes / bandwidth.

Profiles are cached on disk as JSON, keyed by a hash of what the times depend on: network,
batch, mode, dtype, input shape, the captured graph's structure, each device's identity (CPU
model and threads, GPU name) and the torch / torchvision versions. A profile file is read as
data (``json``, never pickle) and every field is validated; errors name the file and field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xengine.execute import allocator
from xengine.files import read_json
from xengine.graph.capture import CapturedModel
from xengine.graph.types import CopyModel, Graph
from xengine.limits import MAX_COST_S, MAX_TENSOR_BYTES
from xengine.torch_state import TorchState, every_rng_device

log = logging.getLogger(__name__)

FORMAT = "xengine-profile"
VERSION = 2  # 2: op workspaces per device ("workspace_bytes"); 1 files still load
READS_VERSIONS = (1, 2)
COPY_SIZES_BYTES = (2**12, 2**16, 2**20, 2**22, 2**24)
# how compute times are taken (part of the cache key: a change of method measures again)
TIMING = "keep-everything steps on the device itself, compiled executor, ops back to back"
KEY_FIELDS = ("net", "batch_size", "mode", "dtype", "devices", "torch")


class ProfileError(ValueError):
    """A profile file is malformed or does not fit the graph; the message names file and field."""


@dataclass(frozen=True)
class Profile:
    key: dict[str, Any]
    compute_s: dict[str, dict[str, float]]  # device -> node name -> seconds (median)
    copy: dict[tuple[str, str], CopyModel]  # (src, dst) -> latency + bandwidth
    source: str  # "measured on <host> <cpu> at <utc>" or the file it was loaded from
    measured: str = ""  # where and when it was measured (kept in the file)
    # device -> node name -> bytes an op needs only while it runs there (its temporaries
    # depend on the device, its thread count and the CPU kind); empty in version-1 files
    workspace_bytes: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.compute_s)

    @property
    def key_hash(self) -> str:
        return key_hash(self.key)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "key": json.loads(json.dumps(self.key)),  # a copy: callers may edit the result
            "measured": self.measured or self.source,
            "compute_s": {d: dict(t) for d, t in self.compute_s.items()},
            "workspace_bytes": {d: dict(t) for d, t in self.workspace_bytes.items()},
            "copy": [
                {
                    "src": a,
                    "dst": b,
                    "latency_s": m.latency_s,
                    "bandwidth_bytes_per_s": m.bandwidth_bytes_per_s,
                }
                for (a, b), m in sorted(self.copy.items())
            ],
        }

    @classmethod
    def from_json(cls, data: Any, source_path: str | Path) -> Profile:
        src = str(source_path)

        def fail(fld: str, msg: str) -> ProfileError:
            return ProfileError(f"{src}: field {fld!r}: {msg}")

        if not isinstance(data, dict):
            raise ProfileError(f"{src}: a profile file must hold a JSON object")
        if data.get("format") != FORMAT:
            raise fail("format", f"expected {FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") not in READS_VERSIONS or isinstance(data.get("version"), bool):
            raise fail("version", f"expected 1 or {VERSION}, got {data.get('version')!r}")
        key = data.get("key")
        if not isinstance(key, dict):
            raise fail("key", "missing or not an object")
        for k in KEY_FIELDS:
            if k not in key:
                raise fail(f"key.{k}", "missing")
        if not isinstance(key["batch_size"], int) or isinstance(key["batch_size"], bool):
            raise fail("key.batch_size", f"expected an integer, got {key['batch_size']!r}")
        if not isinstance(key["devices"], dict):
            raise fail("key.devices", "expected an object")
        comp = data.get("compute_s")
        if not isinstance(comp, dict) or not comp:
            raise fail("compute_s", "missing or empty (expected device -> node -> seconds)")
        compute_s: dict[str, dict[str, float]] = {}
        for dev, table in comp.items():
            if not isinstance(table, dict) or not table:
                raise fail(f"compute_s.{dev}", "expected a non-empty object node -> seconds")
            compute_s[dev] = {}
            for node, t in table.items():
                compute_s[dev][node] = _nonneg(
                    t, lambda m, n=node, d=dev: fail(f"compute_s.{d}.{n}", m)
                )
        copies: dict[tuple[str, str], CopyModel] = {}
        raw = data.get("copy", [])
        if not isinstance(raw, list):
            raise fail("copy", "expected a list")
        for i, e in enumerate(raw):
            if not isinstance(e, dict):
                raise fail(f"copy[{i}]", "expected an object")
            for f in ("src", "dst"):
                if not isinstance(e.get(f), str):
                    raise fail(f"copy[{i}].{f}", f"expected a device name, got {e.get(f)!r}")
            lat = _nonneg(e.get("latency_s"), lambda m, i=i: fail(f"copy[{i}].latency_s", m))
            bw = _nonneg(
                e.get("bandwidth_bytes_per_s"),
                lambda m, i=i: fail(f"copy[{i}].bandwidth_bytes_per_s", m),
                limit=None,
            )
            if bw <= 0:
                raise fail(f"copy[{i}].bandwidth_bytes_per_s", "must be positive")
            copies[(e["src"], e["dst"])] = CopyModel(lat, bw)
        measured = data.get("measured", "")
        if not isinstance(measured, str):
            raise fail("measured", "expected a string")
        workspace = _read_workspace(data.get("workspace_bytes", {}), fail)
        return cls(
            key=key,
            compute_s=compute_s,
            copy=copies,
            source=src,
            measured=measured,
            workspace_bytes=workspace,
        )

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
        tmp.replace(p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        data = read_json(p, "profile", ProfileError)
        return cls.from_json(data, p)


def _read_workspace(raw: Any, fail) -> dict[str, dict[str, int]]:
    if not isinstance(raw, dict):
        raise fail("workspace_bytes", "expected an object device -> node -> bytes")
    out: dict[str, dict[str, int]] = {}
    for dev, table in raw.items():
        if not isinstance(table, dict):
            raise fail(f"workspace_bytes.{dev}", "expected an object node -> bytes")
        out[dev] = {}
        for node, b in table.items():
            f = _nonneg(
                b,
                lambda m, n=node, d=dev: fail(f"workspace_bytes.{d}.{n}", m),
                MAX_TENSOR_BYTES,
                "bytes",
            )
            if f != int(f):
                raise fail(f"workspace_bytes.{dev}.{node}", f"expected whole bytes, got {b!r}")
            out[dev][node] = int(f)
    return out


def _nonneg(x: Any, fail, limit: float | None = MAX_COST_S, unit: str = "s") -> float:
    """A finite number >= 0, at most ``limit`` (``xengine.limits``; seconds by default)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise fail(f"expected a number, got {x!r}")
    if not math.isfinite(x) or x < 0:
        raise fail(f"expected a finite non-negative number, got {x!r}")
    if limit is not None and x > limit:
        raise fail(f"{x:.4g} {unit} is above the limit of {limit:.4g} {unit}")
    return float(x)


# ---------------------------------------------------------------------- identity and key
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def device_identity(name: str) -> dict[str, Any]:
    from xengine.execute.executor import parse_device

    spec = parse_device(name)
    if spec.is_cuda:
        props = torch.cuda.get_device_properties(spec.torch_device)
        return {
            "kind": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory),
            "cuda": torch.version.cuda,
        }
    return {"kind": "cpu", "model": cpu_model(), "threads": spec.threads, "cpus": os.cpu_count()}


def profile_key(captured: CapturedModel, devices: Sequence[str]) -> dict[str, Any]:
    import torchvision

    meta = captured.graph.meta
    return {
        "net": captured.net,
        "batch_size": captured.batch_size,
        "mode": captured.mode,
        "dtype": captured.dtype,
        "image_size": meta.get("image_size"),
        "input_shape": [int(s) for s in captured.example_input.shape],
        "num_classes": meta.get("num_classes"),
        "graph_sha": meta.get("graph_sha"),
        "devices": {d: device_identity(d) for d in devices},
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "timing": TIMING,
        "malloc": allocator.mode(),
    }


def key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(cache_dir: Path, key: Mapping[str, Any]) -> Path:
    return Path(cache_dir) / f"{key['net']}-b{key['batch_size']}-{key['mode']}-{key_hash(key)}.json"


# ---------------------------------------------------------------------- measuring
def profile_model(
    captured: CapturedModel,
    devices: Sequence[str],
    repeats: int = 5,
    warmup: int = 2,
    cache_dir: Path | None = Path("results/cache/profiles"),
    progress: bool = True,
) -> Profile:
    """Measure (or load from the cache) the compute and copy costs of ``captured``'s graph."""
    devices = tuple(devices)
    if not devices:
        raise ValueError("profile_model needs at least one device")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    key = profile_key(captured, devices)
    path = cache_path(cache_dir, key) if cache_dir is not None else None
    if path is not None and path.exists():
        try:
            cached = Profile.load(path)
        except ProfileError as exc:
            log.warning("ignoring unreadable cached profile: %s", exc)
        else:
            if cached.key == key:
                log.info(
                    "profile of %s (batch %d) loaded from %s", key["net"], key["batch_size"], path
                )
                return cached
            log.warning("cached profile %s has another key; measuring again", path)
    t0 = time.perf_counter()
    compute_s, copy, workspace = _measure(captured, devices, repeats, warmup, progress)
    measured = (
        f"measured on {socket.gethostname()} ({cpu_model()}"
        + "".join(f", {k['name']}" for k in key["devices"].values() if k.get("kind") == "cuda")
        + f") at {datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}"
    )
    prof = Profile(
        key=key,
        compute_s=compute_s,
        copy=copy,
        source=measured,
        measured=measured,
        workspace_bytes=workspace,
    )
    log.info(
        "profiled %s (batch %d) on %s in %.1f s",
        key["net"],
        key["batch_size"],
        ", ".join(devices),
        time.perf_counter() - t0,
    )
    if path is not None:
        prof.save(path)
        log.info("profile saved to %s", path)
    return prof


def _measure(
    captured: CapturedModel,
    devices: tuple[str, ...],
    repeats: int,
    warmup: int,
    progress: bool,
) -> tuple[
    dict[str, dict[str, float]], dict[tuple[str, str], CopyModel], dict[str, dict[str, int]]
]:
    from tqdm.auto import tqdm

    from xengine.execute.executor import _Runtime
    from xengine.profile.workspace import measure_workspace_bytes

    g = captured.graph
    start = TorchState(
        captured.gm.buffers(), rng=every_rng_device(), grads_of=captured.module.parameters()
    )
    threads0 = torch.get_num_threads()
    rt = _Runtime(captured, devices)
    compute_s: dict[str, dict[str, float]] = {}
    copy: dict[tuple[str, str], CopyModel] = {}
    workspace: dict[str, dict[str, int]] = {}
    n_pairs = len(devices) * (len(devices) - 1)
    bar = tqdm(
        total=len(devices) * (g.size + 1) + n_pairs,
        desc=f"profiling {captured.net}",
        disable=not progress,
        leave=False,
    )
    try:
        for d in devices:
            compute_s[d] = _time_step(rt, d, repeats, warmup, bar)
        rt.reset()
        for d in devices:
            ws = measure_workspace_bytes(captured, d)
            workspace[d] = {v.name: int(w) for v, w in zip(g.nodes, ws, strict=True)}
            bar.update(1)
        for a in devices:
            for b in devices:
                if a != b:
                    copy[(a, b)] = _fit_copy(rt, a, b, repeats, warmup)
                    bar.update(1)
    finally:
        bar.close()
        rt.reset()
        torch.set_num_threads(threads0)
        start.restore()
    return compute_s, copy, workspace


def _sync(rt, *names: str) -> None:
    for d in names:
        s = rt.specs[d]
        if s.is_cuda:
            torch.cuda.synchronize(s.torch_device)


def _time_step(rt, d: str, repeats: int, warmup: int, bar) -> dict[str, float]:
    """Every node timed the way a step pays for it (docs/design.md section 4): ``warmup + repeats``
    keep-everything steps on ``d`` run by the compiled executor, each node's time the interval
    from its start to the next node's start, ops queued back to back. On the CPU the clock is
    ``perf_counter`` (ops are synchronous); on CUDA it is an event recorded on the stream
    (read after the step), so a small kernel costs what it adds to the queue, not a launch
    and a synchronisation. Backward nodes that run fused start when autograd reaches them (a
    pre-hook), so they are timed inside the one pass a step makes; the frees after a node are
    part of its time. The median over the repeats is the node's cost."""
    from xengine.execute.executor import compile_program
    from xengine.problem import Instance
    from xengine.schedule import keep_all_schedule
    from xengine.simulate import simulate

    g = rt.g
    inst = Instance.single(g.with_costs({d: {v.name: 0.0 for v in g.nodes}}), d, None)
    # the one-device schedule's ops name device 0; on the runtime, d is device `here`
    here = rt.devices.index(d)
    ops = [
        dataclasses.replace(op, device=here) for op in simulate(inst, keep_all_schedule(inst)).ops
    ]
    program = compile_program(rt, ops)
    spec = rt.specs[d]
    samples: list[list[float]] = [[] for _ in range(g.size)]
    marks: list[tuple[int, Any]] = []
    if spec.is_cuda:

        def mark(node: int) -> None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((node, ev))
    else:

        def mark(node: int) -> None:
            marks.append((node, time.perf_counter()))

    for r in range(warmup + repeats):
        marks.clear()
        rt.reset()
        rt.zero_grads()
        _sync(rt, d)
        rt.clock = mark
        try:
            for fn, label in program:
                kind, _, node = label.split("|")[1:4]
                if kind == "compute":
                    mark(int(node))
                fn()
            mark(-1)
        finally:
            rt.clock = None
        _sync(rt, d)
        if r >= warmup:
            for (v, a), (_, b) in zip(marks, marks[1:], strict=False):
                dt = a.elapsed_time(b) / 1e3 if spec.is_cuda else b - a
                samples[v].append(dt)
    rt.reset()
    rt.zero_grads()
    bar.update(g.size)
    return {
        v.name: float(statistics.median(samples[i])) if samples[i] else 0.0
        for i, v in enumerate(g.nodes)
    }


def _fit_copy(rt, src: str, dst: str, repeats: int, warmup: int) -> CopyModel:
    """Time the executor's copy at a few sizes; least-squares fit of latency + bytes/bandwidth
    (both clamped: latency >= 0, bandwidth > 0)."""
    sizes, times = [], []
    dev = rt.specs[src].torch_device
    for nbytes in COPY_SIZES_BYTES:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        ts = []
        for _ in range(warmup + repeats):
            _sync(rt, src, dst)
            rt._set_threads(dst)
            t0 = time.perf_counter()
            y = rt.copy_tensor(t, dst)
            _sync(rt, src, dst)
            ts.append(time.perf_counter() - t0)
            del y
        sizes.append(float(nbytes))
        times.append(float(statistics.median(ts[warmup:])))
    slope, intercept = np.polyfit(np.asarray(sizes), np.asarray(times), 1)
    if slope <= 0:  # noise swamped the size dependence: use the largest copy's rate
        slope = times[-1] / sizes[-1]
    latency = max(0.0, float(intercept))
    return CopyModel(latency_s=latency, bandwidth_bytes_per_s=float(1.0 / max(slope, 1e-18)))


# ---------------------------------------------------------------------- applying
def apply_profile(graph: Graph, profile: Profile) -> Graph:
    """``graph`` with the profile's compute times and copy models; a profile of another net,
    batch, mode or graph is an error naming the profile's file and the field."""
    src = profile.source
    meta = graph.meta or {}
    for f in ("net", "batch_size", "mode", "dtype", "input_shape", "graph_sha"):
        if f in meta and f in profile.key and meta[f] is not None:
            if profile.key[f] != meta[f]:
                raise ProfileError(
                    f"{src}: field 'key.{f}' is {profile.key[f]!r} but the graph "
                    f"{graph.name!r} has {meta[f]!r}: the profile was measured for another "
                    + ("graph" if f == "graph_sha" else f.replace("_", " "))
                )
    names = [v.name for v in graph.nodes]
    name_set = set(names)
    for d, table in profile.compute_s.items():
        missing = [x for x in names if x not in table]
        extra = sorted(set(table) - name_set)
        if missing or extra:
            what = []
            if missing:
                what.append(
                    f"has no time for {len(missing)} node(s) of the graph (first: {missing[0]!r})"
                )
            if extra:
                what.append(f"times {len(extra)} node(s) the graph lacks (first: {extra[0]!r})")
            raise ProfileError(f"{src}: field 'compute_s.{d}' " + " and ".join(what))
    for d, table in profile.workspace_bytes.items():
        missing = [x for x in names if x not in table]
        if missing:
            raise ProfileError(
                f"{src}: field 'workspace_bytes.{d}' has no workspace for {len(missing)} "
                f"node(s) of the graph (first: {missing[0]!r})"
            )
    workspace = {d: {x: t[x] for x in names} for d, t in profile.workspace_bytes.items()}
    return graph.with_costs(profile.compute_s, profile.copy, workspace)


__all__ = [
    "Profile",
    "ProfileError",
    "apply_profile",
    "cache_path",
    "device_identity",
    "profile_key",
    "profile_model",
]
