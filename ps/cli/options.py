"""What the commands share: option groups (training, trust, --log-to), their click callbacks,
and the merge of a --config file with the flags into a :class:`TrainingSpec`."""

from __future__ import annotations

import logging
import math
from typing import Any

import click

from problems.loader import BUILTIN_PROBLEMS
from ps.core.spec import TrainingSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package (a dependency there)
    import tomli as tomllib


def parse_pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        key, sep, val = v.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {v!r}", param_hint=what)
        out[key.strip()] = val.strip()
    return out


def training_spec(problem: str | None, problem_opt: tuple[str, ...], algorithm: str | None,
                  settings: tuple[str, ...], config: str | None, *, default_problem: str,
                  default_algorithm: str, default_settings: dict[str, Any] | None = None) -> TrainingSpec:
    """Merge a TOML config file (``[problem] name=..., key=...``, ``[algorithm] name=..., key=...``)
    with command-line flags (flags win)."""
    file_problem: dict[str, Any] = {}
    file_alg: dict[str, Any] = {}
    if config:
        try:
            with open(config, "rb") as f:
                doc = tomllib.load(f)
        except OSError as e:
            raise click.BadParameter(f"cannot read {config}: {e.strerror}", param_hint="--config") from None
        except tomllib.TOMLDecodeError as e:
            raise click.BadParameter(f"{config} is not valid TOML: {e}", param_hint="--config") from None
        unknown = set(doc) - {"problem", "algorithm"}
        if unknown:
            raise click.BadParameter(f"unknown section(s) {sorted(unknown)} in {config}", param_hint="--config")
        file_problem = dict(doc.get("problem", {}))
        file_alg = dict(doc.get("algorithm", {}))
    p_name = problem or file_problem.pop("name", None) or default_problem
    file_problem.pop("name", None)
    a_name = algorithm or file_alg.pop("name", None) or default_algorithm
    file_alg.pop("name", None)
    base_settings = dict(default_settings or {}) if a_name == default_algorithm and not file_alg else {}
    return TrainingSpec(problem=p_name, problem_options={**file_problem, **parse_pairs(problem_opt, "--problem-opt")},
                        algorithm=a_name, settings={**base_settings, **file_alg, **parse_pairs(settings, "--set")})


def training_options(default_problem: str, default_algorithm: str):
    def deco(f):
        f = click.option("--config", type=click.Path(dir_okay=False),
                         help="TOML file with [problem] and [algorithm] tables (flags override it).")(f)
        f = click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
                         help="Algorithm hyper-parameter, e.g. --set lr=0.05 (repeatable).")(f)
        f = click.option("--algorithm", "-a", default=None,
                         help=f"Algorithm name (default {default_algorithm}; see `latecomer algorithms`).")(f)
        f = click.option("--problem-opt", multiple=True, metavar="KEY=VALUE",
                         help="Problem option, e.g. --problem-opt d=256 (repeatable).")(f)
        f = click.option("--problem", "-p", default=None,
                         help=f"Built-in problem ({', '.join(BUILTIN_PROBLEMS)}) or module:callable "
                              f"(default {default_problem}).")(f)
        return f
    return deco


def allow_patterns(ctx, param, value):
    """``--allow-problem``/``--allow-algorithm`` values as validated patterns (problems/trust.py);
    one value may hold several separated by white space (as ``LATECOMER_ALLOW_PROBLEM`` does)."""
    from problems.trust import check_pattern

    try:
        return tuple(check_pattern(p, param.opts[0]) for v in value or () for p in v.split())
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix(f"{param.opts[0]} "), param_hint=param.opts[0]) from None


def allowed_from(allow_problem=(), allow_algorithm=()):
    """The trust of a command that reads a state directory (problems/trust.py)."""
    from problems.trust import Allowed

    return Allowed(tuple(allow_problem), tuple(allow_algorithm))


def allow_options(f):
    """``--allow-problem`` and ``--allow-algorithm`` for commands that load what a state directory names."""
    f = click.option("--allow-algorithm", "allow_algorithm", multiple=True, metavar="PATTERN",
                     callback=allow_patterns,
                     help="Trust this algorithm of your own (module:Class or an fnmatch pattern) where a state "
                          "directory names it (repeatable).")(f)
    f = click.option("--allow-problem", "allow_problem", multiple=True, metavar="PATTERN", callback=allow_patterns,
                     help="Trust this problem of your own (module:callable or an fnmatch pattern such as "
                          "'mymodel:*') where a state directory names it (repeatable).")(f)
    return f


def busy_poll_setting(ctx, param, value):
    """``serve --busy-poll-us``: ``auto`` or microseconds, 0 to 100,000 (ps/net/loopwait.py BusyPoll)."""
    from ps.net.loopwait import BusyPoll

    try:
        return BusyPoll.parse(str(value))
    except ValueError:
        raise click.BadParameter(f"expected auto or a whole number of microseconds from 0 to 100000, "
                                 f"got {value!r}") from None


def positive(ctx, param, value):
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise click.BadParameter(f"must be > 0, got {value}")
    return value


def finite(ctx, param, value):
    """click callback: NaN and infinity are refused (FloatRange lets them through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}")
    return value


def _log_to_specs(ctx, param, value):
    """click callback: each ``--log-to`` spec checked (ps/observe/loggers.py), one line for a bad one."""
    from ps.observe.loggers import check_spec

    try:
        return tuple(check_spec(v) for v in value or ())
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("--log-to "), param_hint="--log-to") from None


log_to_option = click.option(
    "--log-to", "log_to", multiple=True, metavar="SPEC", callback=_log_to_specs,
    help="Log the run's figures and settings (repeatable): tensorboard:DIR, wandb, wandb:PROJECT, mlflow:URI.")


def add_loggers(daemon: Any, specs: tuple[str, ...]) -> None:
    """One logger (ps/observe/loggers.py) per ``--log-to`` spec, observing ``daemon``."""
    from ps.observe.loggers import log, make_logger

    if specs and not log.isEnabledFor(logging.INFO):
        log.setLevel(logging.INFO)  # where each logger writes is said even under `run`'s warning level
    for spec in specs:
        try:
            daemon.add_observer(make_logger(spec))
        except ValueError as e:
            raise click.BadParameter(str(e).removeprefix("--log-to "), param_hint="--log-to") from None


def cipher_threads_env() -> None:
    """``LATECOMER_CIPHER_THREADS`` and ``LATECOMER_SEAL_CIPHERS`` (protocol/seal.py) checked before
    anything starts: a bad value is a one-line usage error here, not a failure at the first large
    sealed message (or the first hello)."""
    from protocol.seal import CIPHER_THREADS_ENV, available_ciphers, threads_from_env

    try:
        threads_from_env()
    except ValueError as e:
        raise click.UsageError(f"{e} (the environment variable {CIPHER_THREADS_ENV})") from None
    try:
        available_ciphers()  # LATECOMER_SEAL_CIPHERS
    except ValueError as e:
        raise click.UsageError(str(e)) from None
