"""Load a problem from its spec: a built-in name or a user's ``"module:callable"``.

Options arrive as msgpack scalars or, from the command line, as strings; each is converted to
the type of the factory's keyword default (``"64"`` -> 64, ``"true"`` -> True). Every user
mistake is a ``ValueError`` whose one-line message names the culprit.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any, Callable, Mapping, TypeVar

from algorithms._userimport import import_user_module
from problems.base import Problem

# Built-ins by name -> "module:factory", imported only when used: a worker that loads the
# quadratic never pays for importing torch.
BUILTIN_PROBLEMS: dict[str, str] = {
    "quadratic": "problems.quadratic:make_quadratic",
    "digits": "problems.digits:make_digits",
    "logreg": "problems.logreg:make_logreg",
    "mnist": "problems.mnist:make_mnist",
    "synthetic": "problems.synthetic:make_synthetic",
    "charlm": "problems.charlm:make_charlm",
}

REQUIRED_ATTRIBUTES = ("layout", "init_params", "grad", "evaluate")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_SCALARS = (bool, int, float, str)
WORKER_LOCAL_ATTR = "__latecomer_worker_local__"  # set by @worker_local on a factory
F = TypeVar("F", bound=Callable[..., Any])

# Factories of this process's own (a function of a script or a notebook, the Python API's
# ``latecomer.start(make)``), by their local name ``<local>:NAME#N``. Only this process and the
# workers it forks (which inherit this table) can resolve such a name; no other process, and so
# no peer on the network, can make one load anything.
LOCAL_MODULE = "<local>"
_LOCAL: dict[str, Callable[..., Any]] = {}


def is_local(spec: Any) -> bool:
    """Whether ``spec`` is a local name (:func:`register_local`), registered here or not."""
    return isinstance(spec, str) and spec.startswith(LOCAL_MODULE + ":")


def register_local(factory: Callable[..., Any]) -> str:
    """Register ``factory`` (a callable returning a problem) in this process; returns its local
    name ``<local>:NAME#N``, which :func:`load_problem` resolves in this process and in the
    processes it forks afterwards. The same callable registered again keeps its name.

    Raises:
        ValueError: ``factory`` is not callable.
    """
    if not callable(factory):
        raise ValueError(f"problem: expected a spec string or a callable returning a problem, got a "
                         f"{type(factory).__name__}")
    for name, f in _LOCAL.items():
        if f is factory:
            return name
    base = "".join(c if c.isalnum() or c == "_" else "_" for c in getattr(factory, "__name__", "") or "")
    name = f"{LOCAL_MODULE}:{base or 'factory'}#{len(_LOCAL) + 1}"
    _LOCAL[name] = factory
    return name


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The callable behind ``spec``: a ``BUILTIN_PROBLEMS`` entry, ``module:attr[.attr…]`` or a
    local name registered in this process (:func:`register_local`).

    A user's module is looked up on ``sys.path`` and then in the current working directory.

    Raises:
        ValueError: unknown name, malformed spec, module not importable (with what to do about
            it), attribute missing or not callable.
    """
    if is_local(spec):
        factory = _LOCAL.get(spec)
        if factory is None:
            raise ValueError(f"problem {spec!r}: a function of another process's own (a script's or a notebook's "
                             "factory); only that process and the workers it started can load it")
        return factory
    builtin = spec in BUILTIN_PROBLEMS
    module_name, sep, attr = BUILTIN_PROBLEMS.get(spec, spec).partition(":")
    if not sep or not module_name or not attr or module_name.startswith("."):
        raise ValueError(f"unknown problem {spec!r} (choose one of {', '.join(BUILTIN_PROBLEMS)}, "
                         "or give 'module:callable')")
    if builtin:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"problem {spec!r}: cannot import module {module_name!r} ({e})") from None
    else:
        obj = import_user_module("problem", spec, module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            where = getattr(obj, "__file__", None)
            raise ValueError(f"problem {spec!r}: module {module_name!r} has no attribute {attr!r}"
                             + (f" (imported from {where})" if where else ""))
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"problem {spec!r}: {attr!r} is not callable")
    return obj


def worker_local(*names: str) -> Callable[[F], F]:
    """Decorator for a problem factory: the options ``names`` may be overridden per worker.

    A worker started with ``latecomer work --problem-opt KEY=VALUE`` loads the server's problem
    with its own value of a worker-local option (a data path on that host, a local cache); every
    other option comes from the server. Overriding an option that is not declared here is refused.

    Example:
        >>> @worker_local("data_dir")
        ... def make(data_dir: str = "/data", device: str = "cpu"): ...
        >>> sorted(worker_local_options(make))
        ['data_dir']

    Raises:
        ValueError: a name that is not a non-empty string, or ``device`` (chosen per worker anyway).
    """
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"worker_local: option names must be identifiers, got {name!r}")
        if name == "device":
            raise ValueError("worker_local: 'device' is always the worker's own (latecomer work --device)")

    def deco(factory: F) -> F:
        declared = frozenset(getattr(factory, WORKER_LOCAL_ATTR, ())) | frozenset(names)
        setattr(factory, WORKER_LOCAL_ATTR, declared)
        return factory

    return deco


def worker_local_options(factory: Callable[..., Any]) -> frozenset[str]:
    """The options ``factory`` declared with :func:`worker_local` (empty if none)."""
    return frozenset(getattr(factory, WORKER_LOCAL_ATTR, ()))


def merge_worker_options(spec: str, options: Mapping[str, Any] | None,
                         overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options a worker loads the server's problem with: the server's ``options`` (from
    ``Welcome``) with this worker's ``overrides`` on top. Only worker-local options (declared
    with :func:`worker_local` on the factory) may be overridden.

    Raises:
        ValueError: an override of an option that is not worker-local (or an unloadable spec).
    """
    merged = dict(options or {})
    if not overrides:
        return merged
    allowed = worker_local_options(resolve_factory(spec))
    refused = sorted(set(overrides) - allowed)
    if refused:
        raise ValueError(f"problem {spec!r}: --problem-opt {', '.join(refused)}: not a worker-local option, the "
                         f"server sets it (worker-local: {', '.join(sorted(allowed)) or 'none'})")
    merged.update(overrides)
    return merged


def coerce_option(spec: str, key: str, value: Any, typ: type | None) -> Any:
    """Convert one option value to ``typ`` (bool, int, float, str; None = keep as is).

    Raises:
        ValueError: the value is not a scalar or cannot be read as ``typ``.
    """
    bad = f"problem {spec!r}: invalid value {value!r} for option {key!r}"
    if not isinstance(value, _SCALARS):
        raise ValueError(f"{bad} (options must be str, int, float or bool)")
    if typ is None or type(value) is typ:
        return value
    if isinstance(value, str):
        text = value.strip()
        if typ is bool and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        try:
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
        except ValueError:
            pass
    elif typ is float and type(value) is int:
        return float(value)
    raise ValueError(f"{bad} (expected {typ.__name__})")


def _option_types(factory: Callable[..., Any]) -> tuple[dict[str, type | None], list[str], bool, bool]:
    """Keyword options of ``factory``: name -> target type, required names, takes **kwargs, takes device."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins have no signature: accept anything
        return {}, [], True, True
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except (NameError, TypeError, AttributeError, SyntaxError):
        # Unresolvable annotations are only a hint: the defaults still give the types.
        hints = {}
    types: dict[str, type | None] = {}
    required, var_kw = [], False
    for name, p in params.items():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or name == "device":
            continue
        if p.default is p.empty:
            required.append(name)
        if p.default is not None and type(p.default) in _SCALARS:
            types[name] = type(p.default)
        else:
            types[name] = hints.get(name) if hints.get(name) in _SCALARS else None
    return types, required, var_kw, var_kw or "device" in params


def load_problem(spec: str, options: Mapping[str, Any] | None = None, device: str = "cpu") -> Problem:
    """Build the problem named by ``spec`` with ``options`` on ``device``.

    Args:
        spec: a key of ``BUILTIN_PROBLEMS`` or ``"module:callable"``; the callable is called with
            the options as keywords plus ``device`` (when it accepts one).
        options: keyword options; strings are converted to the type of the keyword's default.
        device: torch device for problems that use one (``"cpu"``, ``"cuda:0"``).

    Returns:
        The problem, with ``spec`` and ``options`` (the converted options as given, defaults
        not filled in) set, so ``load_problem(p.spec, p.options)`` rebuilds it elsewhere.

    Raises:
        ValueError: unknown problem, bad module path, missing callable, unknown or missing
            option, a value of the wrong type or out of range, or a result that lacks the
            problem interface.

    Example:
        >>> load_problem("quadratic", {"d": "8"}).dim
        8
    """
    factory = resolve_factory(spec)
    types, required, var_kw, takes_device = _option_types(factory)
    kwargs: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if key == "device":
            raise ValueError(f"problem {spec!r}: 'device' is not an option (it is chosen per process)")
        if key not in types and not var_kw:
            raise ValueError(f"problem {spec!r}: unknown option {key!r} (known: {', '.join(types) or 'none'})")
        kwargs[key] = coerce_option(spec, key, value, types.get(key))
    missing = [name for name in required if name not in kwargs]
    if missing:
        raise ValueError(f"problem {spec!r}: missing required option(s) {', '.join(missing)}")
    problem = factory(**kwargs, device=device) if takes_device else factory(**kwargs)
    lacking = [a for a in REQUIRED_ATTRIBUTES if not hasattr(problem, a)]
    if lacking:
        raise ValueError(f"problem {spec!r}: the callable returned a {type(problem).__name__} without "
                         f"{', '.join(lacking)}")
    try:
        problem.spec = spec
        problem.options = dict(kwargs)
    except AttributeError as e:
        raise ValueError(f"problem {spec!r}: cannot set spec/options on the returned object ({e})") from None
    return problem
