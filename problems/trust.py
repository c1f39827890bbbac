"""Which code a latecomer process may import and call when someone else names it.

A problem spec ``"module:callable"`` or an algorithm ``"module:Class"`` is code: loading it
imports the module and calls the callable. A name that arrives from outside this process's own
command line (a server's ``welcome`` to a worker; ``run.json`` or ``problem.json`` in a state
directory) is loaded only if it is **trusted**:

- the built-in problems (``problems.loader.BUILTIN_PROBLEMS``, by name or by their exact
  ``module:factory``) and algorithms (registry names: any name without ``:``, which never
  imports anything) always are;
- a user's callable is when the command line names it: exactly (``--problem``/``--algorithm``
  of ``latecomer serve`` resuming a state directory) or by a pattern (``--allow-problem``,
  ``--allow-algorithm``, repeatable; ``LATECOMER_ALLOW_PROBLEM`` for ``latecomer work``).

Patterns are fnmatch-style (``*``, ``?``, ``[seq]``; case-sensitive) over ``module:attr``:

========================  ==========================================================
``mymodel:make``           exactly that callable
``mymodel:*``, ``mymodel``  any callable of module ``mymodel`` (no ``:``: the module part)
``mypkg.*``                any callable of ``mypkg`` and of its submodules
``mypkg.*:make``           ``make`` of any submodule of ``mypkg``
========================  ==========================================================

A local name ``<local>:NAME#N`` (a function of a script or a notebook registered by the Python
API, problems/loader.py ``register_local``) is trusted only where named exactly: by the
process that registered it and by the workers it forked, never by a pattern.

A pattern must begin with a module name's first character (a letter or ``_``): ``*`` alone
would trust whatever a server names, ``os:system`` included, and is refused.

Nothing here imports anything: checks run before the loader touches a module.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass

from problems.loader import BUILTIN_PROBLEMS, is_local

ENV_ALLOW_PROBLEM = "LATECOMER_ALLOW_PROBLEM"  # `latecomer work`: patterns separated by white space
_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.*?\[\]!]*(:[A-Za-z0-9_.*?\[\]!]+)?$")
_BUILTIN_TARGETS = frozenset(BUILTIN_PROBLEMS.values())


class UntrustedError(ValueError):
    """A callable named by someone else that this process's command line does not allow."""


def check_pattern(pattern: str, flag: str = "--allow-problem") -> str:
    """``pattern`` if it is a valid allow pattern (see the module docstring).

    Raises:
        ValueError: empty, white space or odd characters, more than one ``:``, or a pattern
            that does not begin with a module name (``*``, ``?x``, ``:make``).
    """
    if not isinstance(pattern, str) or not _PATTERN.match(pattern):
        raise ValueError(f"{flag} {pattern!r}: expected MODULE, MODULE:CALLABLE or an fnmatch pattern of "
                         "them beginning with a module name (e.g. 'mymodel:make', 'mymodel:*', 'mypkg.*')")
    return pattern


def matches(pattern: str, spec: str) -> bool:
    """Whether allow ``pattern`` covers ``spec`` (``module:attr``).

    Example:
        >>> [matches("mypkg.*", s) for s in ("mypkg:make", "mypkg.sub:make", "mypkgx:make", "other:make")]
        [True, True, False, False]
        >>> matches("mymodel:make", "mymodel:make"), matches("mymodel:make", "mymodel:make_other")
        (True, False)
    """
    module, sep, _ = spec.partition(":")
    if not sep:
        return False
    if ":" in pattern:
        return fnmatch.fnmatchcase(spec, pattern)
    if fnmatch.fnmatchcase(module, pattern):
        return True
    return pattern.endswith(".*") and module == pattern[:-2]  # "mypkg.*" covers mypkg itself


def is_user_problem(spec: str) -> bool:
    """True for a spec that would import a user's module: ``module:callable`` that is not a
    built-in's own target. A name without ``:`` is a built-in or unknown (never imported)."""
    return ":" in spec and spec not in _BUILTIN_TARGETS


def is_user_algorithm(name: str) -> bool:
    """True for ``module:Class`` (registry names have no ``:`` and import nothing)."""
    return ":" in name


@dataclass(frozen=True)
class Allowed:
    """The user callables this process trusts beyond the built-ins.

    Attributes:
        problems: allow patterns for problem specs (validated by :func:`check_pattern`).
        algorithms: allow patterns for algorithm specs.
        named_problems: specs the command line names exactly (``--problem``).
        named_algorithms: algorithm specs the command line names exactly (``--algorithm``).
    """

    problems: tuple[str, ...] = ()
    algorithms: tuple[str, ...] = ()
    named_problems: frozenset[str] = frozenset()
    named_algorithms: frozenset[str] = frozenset()

    @classmethod
    def from_flags(cls, problems=(), algorithms=()) -> Allowed:
        """From ``--allow-problem``/``--allow-algorithm`` values (each may hold several patterns
        separated by white space, as an environment variable does).

        Raises:
            ValueError: an invalid pattern, naming the flag.
        """
        return cls(tuple(check_pattern(p, "--allow-problem") for v in problems for p in v.split()),
                   tuple(check_pattern(p, "--allow-algorithm") for v in algorithms for p in v.split()))

    def naming(self, *, problem: str | None = None, algorithm: str | None = None) -> Allowed:
        """This, plus the exact ``problem`` and ``algorithm`` a command line names."""
        return Allowed(self.problems, self.algorithms,
                       self.named_problems | ({problem} if problem else set()),
                       self.named_algorithms | ({algorithm} if algorithm else set()))

    def problem_ok(self, spec: str) -> bool:
        """Whether problem ``spec`` may be loaded. A local name (``<local>:NAME#N``, a factory of
        the Python API's caller) only when named exactly: no pattern ever matches one."""
        if is_local(spec):
            return spec in self.named_problems
        return (not is_user_problem(spec) or spec in self.named_problems
                or any(matches(p, spec) for p in self.problems))

    def algorithm_ok(self, name: str) -> bool:
        """Whether algorithm ``name`` may be loaded."""
        return (not is_user_algorithm(name) or name in self.named_algorithms
                or any(matches(p, name) for p in self.algorithms))


BUILTINS_ONLY = Allowed()  # trusts the built-ins and nothing else: the default of every reader of a state directory


def worker_refusal(spec: str, allowed: Allowed) -> str | None:
    """Why a worker refuses the problem a server named (one line, starting with the spec as the
    loader's messages do), or None if it may load it."""
    if allowed.problem_ok(spec):
        return None
    if is_local(spec):
        return (f"problem {spec!r}: not allowed here (a function of another process's own, which only the workers "
                "that process started may load)")
    return (f"problem {spec!r}: not allowed here (a worker loads the built-in problems and what its --allow-problem "
            f"patterns match, never other code a server names): add --allow-problem {shlex.quote(spec)} to "
            "`latecomer work` if you trust that code")


def check_run(run: dict, allowed: Allowed, where: str, *, problem_hint: str = "--allow-problem {spec}",
              algorithm_hint: str = "--allow-algorithm {spec}", check_algorithm: bool = True) -> None:
    """Refuse a state directory's ``run`` (run.json or problem.json) that names a user callable
    the command line does not allow.

    Args:
        run: the parsed file; its ``problem`` (and ``algorithm``) entries are checked.
        allowed: what the command line allows.
        where: the file, for the message.
        problem_hint, algorithm_hint: what to tell the user to add, ``{spec}`` standing for the
            shell-quoted spec (``"--allow-problem {spec} (or --problem {spec})"`` for ``serve``).
        check_algorithm: False where only the problem is loaded.

    Raises:
        UntrustedError: one line naming the callable and the flag to add.
    """
    problem = run.get("problem")
    if isinstance(problem, str) and not allowed.problem_ok(problem):
        raise UntrustedError(_refusal(where, "problem", problem, problem_hint))
    algorithm = run.get("algorithm")
    if check_algorithm and isinstance(algorithm, str) and not allowed.algorithm_ok(algorithm):
        raise UntrustedError(_refusal(where, "algorithm", algorithm, algorithm_hint))


def _refusal(where: str, kind: str, spec: str, hint: str) -> str:
    return (f"{where} names the {kind} {spec}, code of your own: it runs only if the command line names it "
            f"too: add {hint.format(spec=shlex.quote(spec))}")
