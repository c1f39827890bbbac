"""Import a user's module named in a ``module:attr`` spec (``--problem``, ``--algorithm``).

One place for both loaders (problems/loader.py, algorithms/registry.py), so a user's module is
found, and its failures are worded, the same way for problems and algorithms.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_user_module(kind: str, spec: str, module_name: str) -> Any:
    """Import ``module_name`` the way ``python -m`` would find it: the current working directory
    is searched too (appended to ``sys.path``, so it never shadows an installed package), for the
    console script as for ``python -m ps``.

    Args:
        kind: what the spec names (``"problem"``, ``"algorithm"``), for the messages.
        spec: the whole ``module:attr`` spec, for the messages.
        module_name: the module part of the spec.

    Raises:
        ValueError: one line: the module is not found (saying where to run from), or importing
            it failed (a missing dependency, or the module raised).
    """
    cwd = os.getcwd()
    if cwd not in (os.path.abspath(p or ".") for p in sys.path):
        sys.path.append(cwd)
    importlib.invalidate_caches()
    top = module_name.split(".")[0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r}: run from the folder that "
                             f"holds {top}.py (or its package {top}/), or add that folder to PYTHONPATH "
                             f"({e})") from None
        raise ValueError(f"{kind} {spec!r}: importing module {module_name!r} failed: {e}") from None
    except Exception as e:  # the user's module raised while importing: one line, not a traceback
        raise ValueError(f"{kind} {spec!r}: importing module {module_name!r} failed: "
                         f"{type(e).__name__}: {e}") from None
