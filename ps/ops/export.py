"""``latecomer export``: a trained run as a state dict that plain PyTorch (or numpy) loads.

A run directory is either

- a ``serve --state DIR``: ``run.json`` names the problem; the iterate comes from the newest
  valid checkpoint (``--checkpoint LSN`` or ``--checkpoint PATH`` picks another), or from
  ``final_x.npy`` when there is no checkpoint;
- a ``serve --out DIR`` (or ``latecomer run --out``): ``problem.json`` names the problem and
  ``final_x.npy`` holds the final iterate.

The problem is rebuilt from its spec and options (a user's ``module:callable`` needs the
module importable: run from its folder). The directory is data: a problem or algorithm of the
user's own that it names is loaded only if the caller allows it (``--allow-problem``,
``--allow-algorithm``, ``allow_problem=``; problems/trust.py), so a tampered ``run.json`` naming
``os:system`` runs nothing. For a :class:`problems.torch_problem.TorchProblem`
the state dict is keyed by the model's parameter *and* buffer names, with BatchNorm statistics
re-estimated exactly as ``evaluate`` does, so ``model.load_state_dict(torch.load(FILE))`` works
on a fresh module and scores what the server's evaluation scored. Any other problem exports its
layout's blocks by name.

Formats: ``torch`` (``torch.save`` of a dict of tensors), ``safetensors`` (needs the optional
``safetensors`` package: ``pip install safetensors``), ``npy`` (a numpy ``.npz`` archive of the
same arrays, ``np.load(FILE)``).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from problems.trust import BUILTINS_ONLY, Allowed, UntrustedError, check_run
from ps.journal.statefiles import read_npy, read_problem_json

FORMATS = ("torch", "safetensors", "npy")


@dataclass(frozen=True)
class RunPoint:
    """Where an exported iterate comes from: the problem's spec and options, the iterate, its
    step, and a description of the source file."""

    problem: str
    problem_options: dict[str, Any]
    x: np.ndarray
    version: int | None
    source: str


def _checkpoint_path(run_dir: str, checkpoint: str) -> str:
    if checkpoint.isdigit():
        path = os.path.join(run_dir, f"ckpt-{int(checkpoint):012d}.bin")
        if not os.path.exists(path):
            have = sorted(f[5:-4].lstrip("0") or "0" for f in os.listdir(run_dir)
                          if f.startswith("ckpt-") and f.endswith(".bin"))
            raise ValueError(f"{run_dir} has no checkpoint at LSN {checkpoint} (have: {', '.join(have) or 'none'})")
        return path
    if not os.path.isfile(checkpoint):
        raise ValueError(f"--checkpoint {checkpoint}: neither a log sequence number nor a checkpoint file")
    return checkpoint


def locate(run_dir: str, checkpoint: str | int | None = None, *, allowed: Allowed = BUILTINS_ONLY) -> RunPoint:
    """The problem and the iterate a run directory holds (see the module docstring).

    Args:
        run_dir: a ``--state`` or ``--out`` directory.
        checkpoint: with a ``--state`` directory, a checkpoint's LSN or path (default: the newest).
        allowed: the user callables trusted where the directory names them (default: none).

    Raises:
        ValueError: not a run directory, no such checkpoint, a corrupt file, a user callable
            ``allowed`` does not trust (``UntrustedError``).
    """
    from ps.journal.checkpoints import latest_checkpoint, read_checkpoint
    from ps.journal.runfile import read_run

    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir} is not a directory")
    run = read_run(run_dir)
    final = os.path.join(run_dir, "final_x.npy")
    if run is not None:
        _check_problem_fields(run, os.path.join(run_dir, "run.json"))
        # the problem here; the algorithm where a checkpoint restores it (build_from_run)
        check_run(run, allowed, os.path.join(run_dir, "run.json"), check_algorithm=False)
        if checkpoint is not None:
            path = _checkpoint_path(run_dir, str(checkpoint))
            try:
                ck = read_checkpoint(path)
            except OSError as e:
                raise ValueError(f"cannot read {path}: {e.strerror}") from None
        else:
            ck = latest_checkpoint(run_dir)
        if ck is not None:
            from ps.core.server_core import ServerCore
            from ps.drivers.replay import build_from_run

            _, alg, cfg = build_from_run(run, allowed=allowed, where=os.path.join(run_dir, "run.json"))
            name = os.path.basename(path) if checkpoint is not None else f"ckpt-{ck[0]:012d}.bin"
            try:
                core = ServerCore.restore(alg, ck[1], cfg)
            except Exception as e:  # noqa: BLE001 - a checkpoint that verifies but does not restore: its content
                raise ValueError(f"{name} does not restore ({type(e).__name__}: {e}): export another with "
                                 f"--checkpoint LSN") from None
            return RunPoint(run["problem"], dict(run["problem_options"]), np.array(core.params(), copy=True),
                            core.version, f"{name} (LSN {ck[0]})")
        if not os.path.exists(final):
            raise ValueError(f"{run_dir} holds a run but no checkpoint and no final_x.npy yet")
        return RunPoint(run["problem"], dict(run["problem_options"]), _load_final(final), _summary_version(run_dir),
                        "final_x.npy")
    if checkpoint is not None:
        raise ValueError(f"--checkpoint needs a --state directory (with run.json); {run_dir} has none")
    problem_json = os.path.join(run_dir, "problem.json")
    if not os.path.exists(final):
        raise ValueError(f"{run_dir} is not a run directory (no run.json, no final_x.npy)")
    if not os.path.exists(problem_json):
        raise ValueError(f"{run_dir} has final_x.npy but no problem.json (it predates export): export the "
                         "--state directory instead")
    desc = read_problem_json(problem_json)  # bounded, and a map naming a problem (one line otherwise)
    check_run(desc, allowed, problem_json, check_algorithm=False)
    return RunPoint(desc["problem"], dict(desc["problem_options"]), _load_final(final),
                    _summary_version(run_dir), "final_x.npy")


def _check_problem_fields(run: dict[str, Any], where: str) -> None:
    """What export reads of a run.json is there (:func:`read_run` checked the types of what is):
    a StateError, one line, otherwise."""
    from ps.journal.statedir import StateError

    for key in ("problem", "problem_options"):
        if key not in run:
            raise StateError(f"{where}: no {key!r} (not a complete run description)")


def _load_final(path: str) -> np.ndarray:
    """final_x.npy through the checked reader: its header validated before anything is allocated
    (a StateError, one line, for a damaged one)."""
    return read_npy(path)


def _summary_version(run_dir: str) -> int | None:
    """The step summary.json records (None: none, or damaged: it only labels the export)."""
    from ps.journal.statefiles import SUMMARY_BYTES, read_json

    try:
        summary = read_json(os.path.join(run_dir, "summary.json"), "a run summary", max_bytes=SUMMARY_BYTES)
        return int(summary["version"])
    except (ValueError, KeyError, TypeError):  # StateError is a ValueError
        return None


def run_state_dict(run_dir: str, checkpoint: str | int | None = None, *, allowed: Allowed = BUILTINS_ONLY
                   ) -> tuple[dict[str, Any], Any, RunPoint]:
    """(state dict, problem, where from) of a run directory. A TorchProblem gives torch tensors
    keyed like its model's ``state_dict()``; any other problem numpy arrays by layout name.
    ``allowed``: as for :func:`locate`.

    Raises:
        ValueError: see :func:`locate`, and a problem that cannot be rebuilt here.
    """
    from problems import load_problem

    point = locate(run_dir, checkpoint, allowed=allowed)
    problem = load_problem(point.problem, point.problem_options, device="cpu")
    if point.x.shape != (problem.dim,):
        raise ValueError(f"the iterate in {run_dir} has shape {point.x.shape}, the problem {point.problem!r} "
                         f"has {problem.dim} parameters")
    to_dict = getattr(problem, "state_dict", None)
    if callable(to_dict) and hasattr(problem, "buffer_names"):
        return to_dict(point.x), problem, point
    from problems.torch_problem import flat_state

    return flat_state(problem, point.x), problem, point


def _patterns(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def state_dict(run_dir: str, *, checkpoint: str | int | None = None, allow_problem: str | tuple[str, ...] = (),
               allow_algorithm: str | tuple[str, ...] = ()) -> dict[str, Any]:
    """The state dict of a trained run (``--state`` or ``--out`` directory), see :func:`run_state_dict`.

    ``allow_problem``, ``allow_algorithm``: patterns (``"mymodel:make"``, ``"mymodel:*"``,
    problems/trust.py) of the problem and algorithm of your own the directory may name; the
    built-ins need none.

    Raises:
        ValueError: see :func:`run_state_dict`; a user callable the patterns do not allow.
    """
    allowed = Allowed.from_flags(_patterns(allow_problem), _patterns(allow_algorithm))
    try:
        return run_state_dict(run_dir, checkpoint, allowed=allowed)[0]
    except UntrustedError as e:  # say the keyword of this call, not the command line's flag
        raise UntrustedError(python_hint(str(e))) from None


def python_hint(message: str) -> str:
    """A refusal's ``add --allow-problem SPEC`` (or ``--allow-algorithm``) as the keyword a Python
    caller passes: ``pass allow_problem="SPEC"``."""
    def keyword(m: re.Match) -> str:
        spec = shlex.split(m.group(2))[0]
        return f'pass allow_{m.group(1)}="{spec}" (you trust that code)'

    return re.sub(r"add --allow-(problem|algorithm) ('[^']*'|\S+)", keyword, message)


def load_state_dict(model: Any, run_dir: str, *, checkpoint: str | int | None = None, strict: bool = True,
                    allow_problem: str | tuple[str, ...] = (), allow_algorithm: str | tuple[str, ...] = ()) -> Any:
    """Load a trained run into ``model`` (an ``nn.Module``) and return the module.

    Args:
        model: a fresh module of the run's architecture.
        run_dir: the run's ``--state`` or ``--out`` directory.
        checkpoint: a checkpoint's LSN or path (``--state`` directories only).
        strict: passed to ``nn.Module.load_state_dict``.
        allow_problem, allow_algorithm: as for :func:`state_dict`. The module that defines
            ``model``'s class is allowed too (you imported it), so a run of ``mymodel:make``
            loads into a ``mymodel.Net`` without more.

    Raises:
        ValueError: see :func:`run_state_dict`; keys or shapes that do not fit the module.
    """
    import torch

    own = getattr(type(model), "__module__", "") or ""
    mine = (own,) if own and own != "__main__" and own.split(".")[0].isidentifier() else ()
    sd = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v))
          for k, v in state_dict(run_dir, checkpoint=checkpoint, allow_problem=_patterns(allow_problem) + mine,
                                 allow_algorithm=allow_algorithm).items()}
    try:
        model.load_state_dict(sd, strict=strict)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ValueError(f"the run in {run_dir} does not fit this module: {' '.join(s.strip() for s in first)}") \
            from None
    return model


def write(sd: dict[str, Any], path: str, fmt: str, model: Any = None) -> None:
    """Write a state dict as ``fmt`` (see the module docstring). With ``model`` (a TorchProblem's
    module) safetensors are written by ``safetensors.torch.save_model`` after loading ``sd`` into
    it: tied tensors (GPT-2's embedding and head) once, in the form ``safetensors.torch.load_model``
    reads. Every format gets the mode a new file gets here (0666 less the umask), as torch.save's.

    Raises:
        ValueError: unknown format, or safetensors without the package.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (choose one of {', '.join(FORMATS)})")
    if fmt == "npy":
        arrays = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v) for k, v in sd.items()}
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        return
    import torch

    tensors = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)) for k, v in sd.items()}
    if fmt == "torch":
        torch.save(tensors, path)
        return
    try:
        from safetensors.torch import save_file, save_model
    except ImportError:
        raise ValueError("--format safetensors needs the safetensors package: pip install safetensors "
                         "(or pip install 'latecomer[export]')") from None
    if model is not None:
        model.load_state_dict(tensors, strict=True)
        save_model(model, path)
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    os.chmod(path, 0o666 & ~_umask())  # the library writes 0600


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@click.command("export")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="torch", show_default=True,
              help="torch: torch.save of a dict of tensors; safetensors; npy: a numpy .npz archive.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The file to write.")
@click.option("--checkpoint", default=None, metavar="LSN|PATH",
              help="With a --state directory: this checkpoint instead of the newest.")
@click.option("--allow-problem", "allow_problem", multiple=True, metavar="PATTERN",
              help="Trust this problem of your own (module:callable or a pattern such as 'mymodel:*') where the "
                   "directory names it (repeatable).")
@click.option("--allow-algorithm", "allow_algorithm", multiple=True, metavar="PATTERN",
              help="Trust this algorithm of your own (module:Class or a pattern) where run.json names it.")
def export(run_dir, fmt, output, checkpoint, allow_problem, allow_algorithm) -> None:
    """Export a run's trained model (a --state or --out directory) as a state dict.

    For a TorchProblem the keys are the model's parameter and buffer names (BatchNorm statistics
    re-estimated as evaluate does), so model.load_state_dict(torch.load(FILE)) works on a fresh
    module; other problems export their layout's blocks by name. A problem or algorithm of your
    own that the directory names needs --allow-problem/--allow-algorithm.
    """
    try:
        sd, problem, point = run_state_dict(run_dir, checkpoint,
                                            allowed=Allowed.from_flags(allow_problem, allow_algorithm))
        write(sd, output, fmt, model=getattr(problem, "model", None) if hasattr(problem, "buffer_names") else None)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e.strerror}") from None
    n_buffers = len(getattr(problem, "buffer_names", ()))
    step = f" at step {point.version}" if point.version is not None else ""
    click.echo(f"wrote {output}: {len(sd)} tensors ({problem.dim} trained parameters"
               f"{f', {n_buffers} buffers' if n_buffers else ''}) of {point.problem}{step} from {point.source}")
