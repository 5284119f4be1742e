"""The command line as the user typed it, checked and rewritten before Hydra reads it, and
the configuration Hydra composed from it, read into the library's plain :class:`RunConfig`.

Hydra answers a bad override with several lines of its own, sometimes quoting text the user
never typed (after :func:`rewrite_argv`), and exits 1. Here every override is checked first and
a mistake becomes one :class:`~xengine.config.ConfigError` line naming the key as typed:

* text Hydra cannot take or should not (a newline or other control character, a YAML tag such
  as ``!!python/object``);
* a ``net=`` that is neither a file in ``conf/net`` nor a torchvision classification model
  (with the closest names), a ``solver=`` with no file in ``conf/``, a device mix with an empty name
  (``devices=cpu+``), a budget written as a mapping (``mem={cpu: 1GB}``);
* a key the configuration does not have, with the closest one it has (``net.foo`` -> did you
  mean ``net.name``?); any other refusal of Hydra's, in its first line.

The keys are checked by composing the configuration once, as Hydra will, with the first value
of each sweep. :func:`rewrite_argv` then turns the spellings Hydra cannot take as they are
into ones it can: ``mem.cuda=1GB`` -> ``++mem.cuda=1GB`` (a new key of the ``mem`` group of
keys), ``mem=2GB`` -> ``mem.all=2GB`` when per-device budgets are also given (or when it is a
list), a device mix that is not a file of ``conf/devices/`` (``devices=[cpu3,cpu1]``,
``devices=cpu3+cpu1``) -> ``devices.names=[cpu3,cpu1]``, and a torchvision model without a
file of ``conf/net/`` (``net=mnasnet0_5``) -> ``net=torchvision net.name=mnasnet0_5``.

Reading the composed configuration (:func:`run_config_from`), every interpolation must
resolve, and every value must be of its key's kind: a boolean is true/false (yes/no, on/off,
1/0), never any text (``execute=maybe`` is an error, not true).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from xengine.config import ConfigError, RunConfig
from xengine.units import MemorySpecError

_HYDRA_FUNCTION = re.compile(r"^\w+\(")  # choice(...), range(...), glob(...), ...
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_GROUPS = ("net", "solver", "strategy", "formulation", "devices", "experiment")


def prepare_argv(argv: list[str], conf: Path) -> list[str]:
    """``argv`` checked (module docstring) and rewritten for Hydra; raises ConfigError."""
    overrides = [a for a in argv if not a.startswith("-")]
    for arg in overrides:
        _check_text(arg)
    check_group_choices(overrides, conf)
    for arg in overrides:
        _check_value_shape(arg)
    pairs = [(typed, r) for typed in argv for r in rewrite_argv([typed], conf, context=argv)]
    _check_keys(pairs, conf)
    return [r for _typed, r in pairs]


def _split(arg: str) -> tuple[str, str, str]:
    """``+key=value`` -> (``+key``, ``key``, ``value``)."""
    key, _sep, value = arg.partition("=")
    return key, key.lstrip("+~"), value


def _check_text(arg: str) -> None:
    key, _bare, value = _split(arg)
    if _CONTROL.search(arg):
        raise ConfigError(
            f"{key}: the value holds a newline or another control character "
            f"({value[:40]!r}); give it on one line"
        )
    if value.lstrip("'\"").startswith("!!") or "!!python" in value:
        raise ConfigError(
            f"{key}={value[:60]}: values are plain data; a YAML tag (!!...) is not taken"
        )


def check_group_choices(argv: list[str], conf: Path) -> None:
    """``net=foo`` / ``solver=foo`` / ``strategy=[checkmate,foo]`` with no
    ``conf/<group>/foo.yaml``: one line (Hydra itself would print a multi-line listing)."""
    for arg in argv:
        _key, bare, value = _split(arg)
        if "=" not in arg or bare not in ("net", "solver", "formulation", "strategy"):
            continue
        if "(" in value:
            continue
        options = sorted(p.stem for p in (conf / bare).glob("*.yaml"))
        missing = [c for c in _choices(value) if c not in options]
        if bare == "net" and missing:
            _check_net_names(value, missing, options)
            continue
        for choice in missing:
            raise ConfigError(f"unknown {bare} {choice!r}: choose one of {', '.join(options)}")


def _check_net_names(value: str, missing: list[str], options: list[str]) -> None:
    """``net=<model>`` without a file: any torchvision classification model (rewritten to
    ``net=torchvision net.name=<model>``); an unknown name is one line with the closest."""
    from xengine.graph.capture import OWN_NETS, check_net_name
    from xengine.graph.types import GraphError

    for name in missing:
        try:
            check_net_name(name)
        except GraphError as exc:
            raise ConfigError(str(exc)) from None
    own = [c for c in _choices(value) if c in OWN_NETS]
    if own:
        raise ConfigError(
            f"net={value}: a sweep mixing {', '.join(own)} with torchvision models that have "
            f"no file in conf/net ({', '.join(missing)}) cannot be written as one override; "
            "sweep them in two runs"
        )


def _choices(value: str) -> list[str]:
    """The options named by a group override: ``a,b`` (a sweep), ``[a,b]`` (several at once,
    the ``strategy`` group), or ``[a],[b,c]`` (a sweep of those)."""
    out = []
    for part in split_top(value):
        out += [c.strip() for c in part.strip().strip("[]").split(",") if c.strip()]
    return out


def _check_value_shape(arg: str) -> None:
    """Values whose shape Hydra would take and then mistake: an empty device name, a budget
    written as a mapping."""
    _key, bare, value = _split(arg)
    if "=" not in arg or _HYDRA_FUNCTION.match(value):
        return
    if bare == "devices":
        for choice in split_top(value):
            if any(not n for n in _device_names(choice)):
                raise ConfigError(
                    f"devices={value}: a device name is empty; name each device of the mix, "
                    "e.g. devices=cpu2+cpu1"
                )
    if (bare == "mem" or bare.startswith("mem.")) and value.strip().startswith("{"):
        raise ConfigError(
            f"{bare}={value}: give budgets as mem=<size> (every device), mem=[<size>,...] (one "
            "per device) or mem.<device>=<size> (e.g. mem.cpu=1GB), not as a mapping"
        )


def split_top(value: str) -> list[str]:
    """``a,[b,c],d`` -> ``["a", "[b,c]", "d"]`` (commas outside brackets)."""
    parts, depth, cur = [], 0, ""
    for ch in value:
        depth += ch in "[({"
        depth -= ch in "])}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def _device_names(choice: str) -> list[str]:
    choice = choice.strip()
    names = choice[1:-1].split(",") if choice.startswith("[") else choice.split("+")
    return [n.strip() for n in names]


def _device_list(choice: str) -> str:
    """``cpu3+cpu1`` / ``[cpu3,cpu1]`` / ``cpu3`` -> ``[cpu3,cpu1]`` (Hydra list syntax)."""
    return "[" + ",".join(_device_names(choice)) + "]"


def rewrite_argv(argv: list[str], conf: Path, context: list[str] | None = None) -> list[str]:
    """Command-line items as Hydra can take them (see the module docstring), one for one
    except ``net=<model without a file>``, which becomes two; ``context``: the whole command
    line, when ``argv`` is a part of it."""
    per_device_mem = any(
        a.lstrip("+").startswith("mem.") and not a.lstrip("+").startswith("mem.all=")
        for a in (argv if context is None else context)
    )
    options = {p.stem for p in (conf / "devices").glob("*.yaml")}
    nets = {p.stem for p in (conf / "net").glob("*.yaml")}
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+~")
        if not sep or key.startswith("~") or _HYDRA_FUNCTION.match(value):
            out.append(arg)
        elif bare == "mem" and (per_device_mem or "[" in value):
            out.append(f"mem.all={value}")
        elif bare.startswith("mem.") and bare.count(".") == 1 and bare != "mem.all":
            # a Hydra key cannot hold ':': mem.cuda:1 is kept as mem.cuda_1 (see run.py)
            out.append(f"++{bare.replace(':', '_')}={value}")
        elif bare == "net" and any(c not in nets for c in _choices(value)):
            # a torchvision model without a file of its own (checked by check_group_choices)
            out += ["net=torchvision", f"net.name={value}"]
        elif bare == "devices":
            choices = split_top(value)
            if all(c.strip() in options for c in choices):
                out.append(f"devices={value}")
            else:  # an ad-hoc mix (or a sweep with one): the list itself
                out.append("devices.names=" + ",".join(_device_list(c) for c in choices))
        else:
            out.append(arg)
    return out


# ------------------------------------------------------------------------------ keys
def _check_keys(pairs: list[tuple[str, str]], conf: Path) -> None:
    """Compose the configuration as Hydra will (the first value of each sweep) and say a
    refusal in one line, naming the override as the user typed it (``pairs``: each item as
    typed with one item it was rewritten to)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    pairs = [(t, r) for t, r in pairs if not t.startswith("-")]
    first = []
    for t, r in pairs:
        first.append(_first_value(t, r))
    try:
        with initialize_config_dir(config_dir=str(conf.resolve()), version_base="1.3"):
            compose("config", overrides=first)
    except HydraException as exc:
        raise ConfigError(_explain(exc, pairs, conf)) from None


def _first_value(typed: str, rewritten: str) -> str:
    """``key=a,b`` -> ``key=a``: one point of a sweep, for checking keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_override(rewritten)
    except HydraException as exc:
        raise ConfigError(f"{typed}: {_first_line(exc)}") from None
    if not override.is_sweep_override():
        return rewritten
    key = rewritten.partition("=")[0]
    value = next(iter(override.sweep_string_iterator()), "")
    return f"{key}={value}"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _explain(exc: BaseException, pairs: list[tuple[str, str]], conf: Path) -> str:
    """One line for Hydra's refusal: an unknown key with the closest valid one, else the
    first line of Hydra's message, with the override as typed."""
    text = str(exc)
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        key = m.group(1)
        typed = next((t for t, r in pairs if _split(r)[1] == key), key)
        return f"unknown key {_split(typed)[1]!r} ({typed}){_closest(key, pairs, conf)}"
    m = re.search(r"'([^']+)' does not exist", text)
    if m:
        return f"~{m.group(1)}: there is no key {m.group(1)!r} to delete"
    return f"cannot apply the command line: {_first_line(exc)}"


def _closest(key: str, pairs: list[tuple[str, str]], conf: Path) -> str:
    """``: did you mean net.name?`` (or ``: net has batch_size, ...``) from the keys of the
    configuration with the same group choices; nothing if none is close."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    groups = [_first_value(t, r) for t, r in pairs if _split(r)[1] in _GROUPS]
    try:
        with initialize_config_dir(config_dir=str(conf.resolve()), version_base="1.3"):
            cfg = compose("config", overrides=groups)
        keys = sorted(set(_keys(OmegaConf.to_container(cfg, resolve=False))))
    except Exception:  # noqa: BLE001 - the hint is a courtesy; the line stands without it
        return ""
    head, _, leaf = key.rpartition(".")
    ancestors = {key.rsplit(".", k)[0] for k in range(1, key.count(".") + 1)}
    match = difflib.get_close_matches(key, [k for k in keys if k not in ancestors], 1, 0.6)
    if match:
        return f": did you mean {match[0]}?"
    under = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == head]
    if head in keys and under:
        return f": {head} has {', '.join(sorted(under))}"
    return ""


def _keys(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            key = f"{prefix}{k}"
            yield key
            yield from _keys(v, key + ".")


# ------------------------------------------------------------------- the composed config
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def check_resolves(cfg: DictConfig) -> None:
    """Every interpolation of ``cfg`` (``${...}``) resolves; else one line naming the key."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "a value"
        msg = str(getattr(exc, "msg", None) or exc).strip().splitlines()[0]
        msg = re.sub(r"^\w+ raised while resolving interpolation: ", "", msg)
        raise ConfigError(f"{key}: an interpolation cannot be resolved: {msg}") from None


def _get(cfg: DictConfig, key: str, kind: type, optional: bool = False, default: Any = None):
    """``cfg``'s value at ``key`` as ``kind`` (bool: true/false, yes/no, on/off, 1/0 only);
    one line naming the key if it is not one."""
    value = OmegaConf.select(cfg, key, default=default)
    if value is None and optional:
        return None
    if kind is bool:
        text = str(value).strip().lower()
        if isinstance(value, bool) or text in _TRUE | _FALSE:
            return value if isinstance(value, bool) else text in _TRUE
        raise ConfigError(f"{key}={value}: expected true or false")
    if isinstance(value, (DictConfig, ListConfig)) or isinstance(value, bool) and kind is not str:
        raise ConfigError(f"{key}={value}: expected {_KIND_TEXT[kind]}")
    try:
        out = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}={value}: expected {_KIND_TEXT[kind]}") from None
    if kind is int and isinstance(value, float) and value != out:
        raise ConfigError(f"{key}={value}: expected {_KIND_TEXT[kind]}")
    if kind is float and not math.isfinite(out):
        raise ConfigError(f"{key}={value}: expected a finite number")
    return out


_KIND_TEXT = {int: "a whole number", float: "a number", str: "a text"}


def as_tuple(value: Any) -> tuple[str, ...]:
    """``cpu`` / ``"cpu,cuda"`` / ``"cpu+cuda"`` / ``[cpu, cuda]`` -> ``("cpu", "cuda")``."""
    if isinstance(value, (list, tuple, ListConfig)):
        return tuple(str(v).strip() for v in value)
    return tuple(s.strip() for s in re.split(r"[,+]", str(value)))


def strategies_of(cfg: DictConfig) -> tuple[str, ...]:
    """The strategies chosen from the ``strategy`` group (``conf/strategy/<name>.yaml`` each
    adds the key ``<name>``), in the order given; a plain list where a config sets one."""
    node = OmegaConf.select(cfg, "strategy")
    if node is None:
        return ()
    if isinstance(node, DictConfig):
        return tuple(str(k) for k in node)
    return as_tuple(node)


def devices_of(cfg: DictConfig) -> tuple[str, ...]:
    """The device mix: the ``devices`` group (``names: [cpu2, cpu1]``, or ``auto``: every
    device torch sees), or a plain list or ``+``-joined string where a config sets
    ``devices`` directly."""
    from xengine.execute.executor import available_devices

    names = _device_names_of(cfg)
    return available_devices() if names == ("auto",) else names


def _device_names_of(cfg: DictConfig) -> tuple[str, ...]:
    dev = cfg.devices
    if isinstance(dev, DictConfig):
        if "names" not in dev:
            raise ConfigError("devices has no 'names': choose devices=<mix> (conf/devices/)")
        dev = dev.names
    return as_tuple(dev)


def asks_auto(cfg: DictConfig) -> bool:
    """``devices=auto``: the mix is whatever torch sees."""
    return _device_names_of(cfg) == ("auto",)


def mem_of(cfg: DictConfig) -> tuple[str, ...] | dict[str, Any]:
    """``mem``: a string or list (every device / one per device) or the group of keys
    ``{all: ..., <device>: ...}``."""
    mem = cfg.mem
    if isinstance(mem, DictConfig):
        out = {}
        for k, v in mem.items():
            if isinstance(v, DictConfig):
                raise ConfigError(f"mem.{k}: a budget is a size or a share, not a mapping")
            name = re.sub(r"^cuda_(\d+)$", r"cuda:\1", str(k))
            out[name] = _as_list(v) if isinstance(v, ListConfig) else str(v)
        return out
    if isinstance(mem, ListConfig):
        return _as_list(mem)
    return (str(mem),)


def _as_list(value: ListConfig) -> tuple[str, ...]:
    return tuple(str(v).strip() for v in value)


def run_config_from(cfg: DictConfig) -> RunConfig:
    """The plain configuration the library takes; a value of the wrong kind is one
    :class:`ConfigError` line naming its key."""
    from xengine.solvers import SolverOptions

    check_resolves(cfg)
    return RunConfig(
        net=_get(cfg, "net.name", str),
        batch_size=_get(cfg, "net.batch_size", int),
        image_size=_get(cfg, "net.image_size", int),
        num_classes=_get(cfg, "net.num_classes", int, default=1000),
        granularity=_get(cfg, "net.granularity", str, default="module"),
        num_layers=_get(cfg, "net.num_layers", int, optional=True),
        width=_get(cfg, "net.width", int, optional=True),
        mode=_get(cfg, "mode", str),
        graph_path=_get(cfg, "graph", str, optional=True),
        devices=devices_of(cfg),
        mem=mem_of(cfg),
        solver=_get(cfg, "solver.name", str),
        solver_options=SolverOptions(
            time_limit_s=_get(cfg, "solver.time_limit_s", float, optional=True),
            rel_gap=_get(cfg, "solver.rel_gap", float),
            threads=_get(cfg, "solver.threads", int, optional=True),
            seed=_get(cfg, "solver.seed", int),
        ),
        formulation=_get(cfg, "formulation.name", str),
        max_computes=_get(cfg, "formulation.max_computes", int, default=2),
        lp_bound=_get(cfg, "formulation.lp_bound", str, default="before"),
        coarsen=_get(cfg, "formulation.coarsen", int, optional=True),
        strategies=strategies_of(cfg),
        execute=_get(cfg, "execute", bool),
        n_steps=_get(cfg, "n_steps", int),
        warmup=_get(cfg, "warmup", int),
        profile_path=_get(cfg, "profile.path", str, optional=True),
        profile_repeats=_get(cfg, "profile.repeats", int),
        context_rounds=_get(cfg, "profile.context_rounds", int),
        profile_warmup=_get(cfg, "profile.warmup", int),
        profile_cache_dir=_get(cfg, "profile.cache_dir", str),
        progress=_get(cfg, "profile.progress", bool),
        malloc=_get(cfg, "malloc", str, default="steady"),
        seed=_get(cfg, "seed", int),
        grad_rtol=_get(cfg, "grad_rtol", float),
        grad_atol=_get(cfg, "grad_atol", float),
        task=_get(cfg, "task", str, default="run"),
        batch_limit=_get(cfg, "batch_limit", int, default=1024),
    )


def flag(cfg: DictConfig, key: str, default: bool = False) -> bool:
    """A boolean of ``cfg`` (``tracking.enabled``, ``redo``), read strictly (see :func:`_get`)."""
    return _get(cfg, key, bool, default=default)


def mem_and_devices(cfg: DictConfig) -> tuple[str, str]:
    """The budgets and the device mix as short texts (``70%``, ``cpu2+cpu1``); a config that
    cannot be read (a skipped point of a sweep) gives its raw values."""
    try:
        devices = devices_of(cfg)
        mem = RunConfig(devices=devices, mem=mem_of(cfg)).mem_text
        return mem, "+".join(devices)
    except (ConfigError, MemorySpecError, TypeError, ValueError, OmegaConfBaseException):
        raw = OmegaConf.to_container(cfg, resolve=False)
        return str(raw.get("mem")), str(raw.get("devices"))


def one_device_note(cfg: DictConfig, run_cfg: RunConfig) -> str | None:
    """With ``devices=auto`` and one device found: the line that says XEngine needs two, and
    how to ask for them."""
    if not asks_auto(cfg) or len(run_cfg.devices) != 1:
        return None
    return (
        f"XEngine needs two devices and torch sees one ({run_cfg.devices[0]}): only "
        "single-device strategies run; ask for two with devices=cpu2+cpu1, or plan for a GPU "
        "with devices=cpu+cuda profile.path=results/profiles/resnet18-b4-cpu+cuda.profile.json "
        "execute=false"
    )
