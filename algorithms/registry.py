"""Algorithm registry and hyper-parameter parsing (CLI ``--set key=value`` and TOML files).

An algorithm is named by its registry name or, for a user's own, by ``"module:Class"`` (a
subclass of :class:`algorithms.base.Algorithm` that is a dataclass, found on ``sys.path`` or in
the current working directory). Settings are the algorithm's own hyper-parameters plus the
wrapper keys of ``algorithms/wrappers.py`` (schedule, weight decay, clipping); ``build`` splits
them and wraps. Every user mistake is a ``ValueError`` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any, Mapping

from algorithms._userimport import import_user_module
from algorithms.base import Algorithm
from algorithms.wrappers import WRAPPER_KEYS, WrapperSettings, chain


def hyper_parameters(cls: type) -> dict[str, tuple[type, Any]]:
    """name -> (type, default) of an algorithm's hyper-parameters (its ``__init__`` fields).

    Raises:
        ValueError: ``cls`` is not a dataclass or its annotations cannot be resolved.
    """
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"{getattr(cls, '__name__', cls)!r} is not a dataclass")
    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:  # NameError of an unresolvable annotation, mostly
        raise ValueError(f"{cls.__name__}: cannot resolve its field annotations ({type(e).__name__}: {e})") \
            from None
    return {f.name: (hints.get(f.name, Any), f.default) for f in dataclasses.fields(cls) if f.init}


def resolve(registry: Mapping[str, type[Algorithm]], name: str) -> type[Algorithm]:
    """The class named ``name``: a registry entry or a user's ``"module:Class"``.

    Raises:
        ValueError: unknown name, malformed spec, module not importable, attribute missing, or
            an attribute that is not an Algorithm subclass defined as a dataclass.
    """
    if name in registry:
        return registry[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr or module_name.startswith("."):
        raise ValueError(f"unknown algorithm {name!r} (choose one of {', '.join(sorted(registry))}, "
                         "or give 'module:Class' for your own)")
    obj: Any = import_user_module("algorithm", name, module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            where = getattr(obj, "__file__", None)
            raise ValueError(f"algorithm {name!r}: module {module_name!r} has no attribute {attr!r}"
                             + (f" (imported from {where})" if where else ""))
        obj = getattr(obj, part)
    if not (inspect.isclass(obj) and issubclass(obj, Algorithm)):
        raise ValueError(f"algorithm {name!r}: {attr} is not a subclass of algorithms.Algorithm")
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"algorithm {name!r}: {attr} is not a dataclass (decorate it with "
                         "@dataclasses.dataclass(frozen=True); its fields are the hyper-parameters)")
    return obj


def _coerce(name: str, typ: Any, value: Any) -> Any:
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, inner[0], value)
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"Invalid {name}: {value!r} (choose one of {', '.join(map(str, args))})")
        return value
    if isinstance(value, str):
        s = value.strip()
        try:
            if typ is bool:
                if s.lower() in ("1", "true", "yes", "on"):
                    return True
                if s.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if typ is int:
                return int(s)
            if typ is float:
                return float(s)
        except ValueError:
            raise ValueError(f"Invalid {name}: {value!r} (expected {typ.__name__})") from None
        if typ is str:
            return s
        if origin is tuple:
            return tuple(_coerce(name, args[0], p) for p in s.strip("()[]").split(",") if p.strip())
        raise ValueError(f"Invalid {name}: cannot parse {value!r}")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ in (int, float, bool, str) and type(value) is not typ:
        raise ValueError(f"Invalid {name}: {value!r} (expected {typ.__name__})")
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(_coerce(name, args[0], v) for v in value)
    return value


def _split(cls: type[Algorithm], name: str, settings: Mapping[str, Any] | None
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the algorithm's own settings, the wrapper settings), both parsed by field type.

    A key that is a field of the algorithm is its own, even if a wrapper has the same name.
    """
    hp = hyper_parameters(cls)
    wp = hyper_parameters(WrapperSettings)
    own, wrap = {}, {}
    for key, value in (settings or {}).items():
        if key in hp:
            own[key] = _coerce(key, hp[key][0], value)
        elif key in wp:
            wrap[key] = _coerce(key, wp[key][0], value)
        else:
            raise ValueError(f"unknown hyper-parameter {key!r} for {name} (known: {', '.join(hp) or 'none'}; "
                             f"wrappers: {', '.join(WRAPPER_KEYS)})")
    return own, wrap


def complete_settings(registry: Mapping[str, type[Algorithm]], name: str, settings: Mapping[str, Any] | None,
                      *, max_steps: int | None = None) -> dict[str, Any]:
    """``settings`` with the defaults the run's context provides filled in, to be recorded.

    ``decay_steps`` of a linear or cosine schedule defaults to ``max_steps`` (the server's step
    limit); a run's state directory stores the completed settings so that resume and replay
    rebuild the very same schedule. A key the algorithm pins (``recorded_defaults``: a default
    that changed, such as ``momentum_start``) is written with its current default, so that a
    later default does not change the run; :func:`recorded_settings` reads older records.

    Raises:
        ValueError: as :func:`build` for an unknown algorithm or key.
    """
    out = dict(settings or {})
    cls = resolve(registry, name)
    own, wrap = _split(cls, name, out)
    for key in _recorded_defaults(cls):  # pinned: a later default must not change how this run replays
        if key not in out:
            out[key] = hyper_parameters(cls)[key][1]
    if (wrap.get("lr_schedule") in ("linear", "cosine") and "decay_steps" not in wrap
            and "decay_steps" not in own and "decay_steps" not in hyper_parameters(cls) and max_steps is not None):
        out["decay_steps"] = int(max_steps)
    return out


def _recorded_defaults(cls: type) -> dict[str, Any]:
    """``cls.recorded_defaults`` (key -> the value a run recorded without that key ran), only
    for keys that are hyper-parameters of ``cls``."""
    legacy = getattr(cls, "recorded_defaults", None) or {}
    hp = hyper_parameters(cls)
    return {k: v for k, v in dict(legacy).items() if k in hp}


def recorded_settings(registry: Mapping[str, type[Algorithm]], name: str,
                      settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings a recorded run (run.json) ran: ``settings`` with each key the algorithm pins
    (its ``recorded_defaults``) and the record lacks set to the value such a record ran.

    :func:`complete_settings` writes those keys into every new record, so a record without one
    predates the key and ran its old default (``ringmaster-lmo`` and ``delay-adaptive-muon``
    before ``momentum_start``: ``"first"``). Call it where a run is rebuilt from its record
    (resume, replay, a shard joining, export); never for a new run's settings.

    Raises:
        ValueError: as :func:`resolve` for an unknown algorithm.
    """
    out = dict(settings or {})
    for key, value in _recorded_defaults(resolve(registry, name)).items():
        out.setdefault(key, value)
    return out


def build(registry: Mapping[str, type[Algorithm]], name: str, settings: Mapping[str, Any] | None = None,
          *, max_steps: int | None = None) -> Algorithm:
    """Instantiate ``registry[name]`` (or the user's ``"module:Class"``) with ``settings``.

    Strings are parsed by field type. Wrapper keys (``algorithms.wrappers.WRAPPER_KEYS``) wrap
    the algorithm (:func:`algorithms.wrappers.chain`); ``max_steps`` is the default of
    ``decay_steps``.

    Raises:
        ValueError: unknown algorithm, unknown hyper-parameter or out-of-range value, with a
            message that names the culprit and the valid choices.
    """
    cls = resolve(registry, name)
    own, wrap = _split(cls, name, complete_settings(registry, name, settings, max_steps=max_steps))
    alg = cls(**own)
    if not wrap:
        return alg
    return chain(alg, WrapperSettings(**wrap), given=tuple(wrap))


_SECTION = re.compile(r"^(Args|Arguments|Attributes|Parameters|Hyper-parameters):\s*$")
_ENTRY = re.compile(r"^([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _docstring_entries(doc: str | None) -> dict[str, str]:
    """name -> one-line text from the ``Args:``/``Attributes:`` sections of a Google-style docstring."""
    out: dict[str, str] = {}
    if not doc:
        return out
    lines = inspect.cleandoc(doc).splitlines()
    i = 0
    while i < len(lines):
        if not _SECTION.match(lines[i]):
            i += 1
            continue
        i += 1
        entry_indent = None
        names: list[str] = []
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                i += 1
                continue
            indent = len(line) - len(line.lstrip())
            if indent == 0:
                break
            if entry_indent is None:
                entry_indent = indent
            m = _ENTRY.match(line.strip()) if indent == entry_indent else None
            if m:
                names = [n.strip() for n in m.group(1).split(",")]
                for n in names:
                    out[n] = m.group(2).strip()
            elif names:
                for n in names:
                    out[n] = f"{out[n]} {line.strip()}".strip()
            i += 1
    return out


def describe(cls: type) -> dict[str, str]:
    """Hyper-parameter -> its meaning in one line, for every hyper-parameter of ``cls``.

    From the field's ``metadata["help"]`` if it has one, else from an ``Args:`` or
    ``Attributes:`` section of the docstring of the class (or of a base class); ``""`` when
    neither says anything.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update({k: v for k, v in _docstring_entries(klass.__dict__.get("__doc__")).items() if v})
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        text = f.metadata.get("help") if f.metadata else None
        out[f.name] = " ".join(str(text or docs.get(f.name, "")).split())
    return out


def summary(cls: type) -> str:
    """The first paragraph of the class docstring as one line ("" if it has none of its own)."""
    doc = cls.__dict__.get("__doc__") or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(cls.__name__ + "("):
        return ""  # dataclass's generated signature, not a description
    first = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(first.split())
