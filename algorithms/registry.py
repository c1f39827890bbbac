"""Algorithm registry and hyper-parameter parsing (CLI ``--set key=value`` and TOML files)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from algorithms.base import Algorithm


def hyper_parameters(cls: type[Algorithm]) -> dict[str, tuple[type, Any]]:
    """name -> (type, default) of an algorithm's hyper-parameters."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)}


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


def build(registry: Mapping[str, type[Algorithm]], name: str, settings: Mapping[str, Any] | None = None) -> Algorithm:
    """Instantiate ``registry[name]`` with ``settings`` (strings are parsed by field type).

    Raises:
        ValueError: unknown algorithm, unknown hyper-parameter or out-of-range value, with a
            message that names the culprit and the valid choices.
    """
    if name not in registry:
        raise ValueError(f"unknown algorithm {name!r} (choose one of {', '.join(sorted(registry))})")
    cls = registry[name]
    hp = hyper_parameters(cls)
    kwargs = {}
    for key, value in (settings or {}).items():
        if key not in hp:
            raise ValueError(f"unknown hyper-parameter {key!r} for {name} (known: {', '.join(hp) or 'none'})")
        kwargs[key] = _coerce(key, hp[key][0], value)
    return cls(**kwargs)
