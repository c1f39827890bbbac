"""latecomer's public Python API: what a user's problem module and scripts import.

Everything importable as ``latecomer.NAME`` is the stable API; every other module of the
distribution (``ps``, ``worker``, ``protocol``, ``algorithms``, ``problems``, ...) is internal
and may change without notice.

- :class:`TorchProblem`: bring your own PyTorch model (``nn.Module``, loss, datasets); return
  one from a factory ``make(device="cpu")`` and serve it with ``latecomer serve --problem
  mymodule:make`` from the folder that holds ``mymodule.py``. :func:`job_seed` is the seed of
  the job being computed (seed your own numpy/``random`` transforms from it).
- :class:`Problem`, :class:`GradResult`, :func:`load_problem`: the problem interface for
  problems written from scratch, and the loader both server and workers use.
- :func:`worker_local`: decorate a factory to let workers override some options
  (``latecomer work --problem-opt data_dir=/local/path``).
- :func:`state_dict`, :func:`load_state_dict`: a trained run (``serve --state DIR`` or
  ``--out DIR``) as a state dict, or loaded into a fresh module (``latecomer export`` does the
  same from the command line).
- :class:`Algorithm`, :class:`JobSpec`, :class:`Result`, :class:`Outcome`, :func:`publish`,
  :class:`JobKind`, :func:`check_hyper`: the interface of server algorithms (load your own
  with ``--algorithm mymodule:MyAlgorithm``; check it with ``latecomer.testing.check_algorithm``).

- :func:`start`, :func:`train`, :class:`Run`, :func:`connect`, :class:`Client`: start a server
  and local workers from a script or a notebook, watch the run (status, live evaluations), get
  the trained model back, read a running server's status (latecomer/api.py).

Imports are lazy: ``import latecomer`` does not import torch; the first use of a torch-backed
name (``TorchProblem``, ``job_seed``) does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> "module:attribute", imported on first use (module __getattr__, PEP 562)
_EXPORTS: dict[str, str] = {
    "TorchProblem": "problems.torch_problem:TorchProblem",
    "job_seed": "problems.torch_problem:job_seed",
    "Problem": "problems.base:Problem",
    "GradResult": "problems.base:GradResult",
    "load_problem": "problems.loader:load_problem",
    "worker_local": "problems.loader:worker_local",
    "state_dict": "ps.ops.export:state_dict",
    "load_state_dict": "ps.ops.export:load_state_dict",
    "Algorithm": "algorithms.base:Algorithm",
    "JobSpec": "algorithms.base:JobSpec",
    "Result": "algorithms.base:Result",
    "Outcome": "algorithms.base:Outcome",
    "publish": "algorithms.base:publish",
    "check_hyper": "algorithms.base:check_hyper",
    "JobKind": "protocol.messages:JobKind",
    "start": "latecomer.api:start",
    "train": "latecomer.api:train",
    "connect": "latecomer.api:connect",
    "Run": "latecomer.api:Run",
    "Client": "latecomer.api:Client",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from algorithms.base import Algorithm, JobSpec, Outcome, Result, check_hyper, publish  # noqa: F401
    from latecomer.api import Client, Run, connect, start, train  # noqa: F401
    from problems.base import GradResult, Problem  # noqa: F401
    from problems.loader import load_problem, worker_local  # noqa: F401
    from problems.torch_problem import TorchProblem, job_seed  # noqa: F401
    from protocol.messages import JobKind  # noqa: F401
    from ps.ops.export import load_state_dict, state_dict  # noqa: F401


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'latecomer' has no attribute {name!r}")
    module, attr = target.split(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
