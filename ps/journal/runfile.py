"""The run description, ``run.json``: what a resume or a replay needs to rebuild the run (the
problem, the algorithm, the settings, the core's options, the wire dtype), written atomically
and validated when read back."""

from __future__ import annotations

import json
import os
from typing import Any

from ps.journal.statedir import StateError, fsync_dir
from ps.journal.statefiles import read_json

DEFAULT_WIRE_DTYPE = "f32"  # state directories written before --wire-dtype existed
# What a complete run.json holds (serve --state writes it): key -> type.
RUN_FIELDS: dict[str, type] = {"problem": str, "problem_options": dict, "algorithm": str, "settings": dict,
                               "core": dict}


def run_wire_dtype(run: dict[str, Any] | None) -> str:
    """The wire dtype a recorded run used (PROTOCOL.md §6.12): ``run["wire_dtype"]`` (else
    ``run["core"]["wire_dtype"]``), or ``"f32"`` when absent (older state directories, or no run).

    Raises:
        ValueError: the recorded value is not a wire dtype.
    """
    from protocol.wire import check_wire

    run = run or {}
    core = run.get("core")
    fallback = core.get("wire_dtype", DEFAULT_WIRE_DTYPE) if isinstance(core, dict) else DEFAULT_WIRE_DTYPE
    return check_wire(run.get("wire_dtype", fallback))


def write_run(state_dir: str, run: dict[str, Any]) -> None:
    """Atomically write the run description ``run.json``. It always carries ``wire_dtype``
    (``"f32"`` unless ``run`` says otherwise): recovery needs it to recompute the gradients the
    core applied."""
    run = {**run, "wire_dtype": run_wire_dtype(run)}
    path = os.path.join(state_dir, "run.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(run, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(state_dir)


def read_run(state_dir: str, *, complete: bool = False) -> dict[str, Any] | None:
    """The run description of ``state_dir`` (None if there is none); ``wire_dtype`` is filled in
    with ``"f32"`` when the file predates it.

    Args:
        complete: require every field a resume or a replay reads (``RUN_FIELDS``, and
            ``core.problem_options`` a map).
    Raises:
        StateError: ``run.json`` does not read as JSON (or is too large or too deeply nested to
            be one this program wrote), is not a map, has a field of the wrong
            type, or (``complete``) lacks one.
    """
    path = os.path.join(state_dir, "run.json")
    if not os.path.exists(path):
        return None
    run = read_json(path, "a run description")  # bounded size and depth (ps/journal/statefiles.py)
    for key, typ in RUN_FIELDS.items():
        if key in run and type(run[key]) is not typ:
            raise StateError(f"{path}: {key!r} must be a {typ.__name__}, got {type(run[key]).__name__}")
        if complete and key not in run:
            raise StateError(f"{path}: no {key!r} (it is not a complete run description)")
    if complete and type(run["core"].get("problem_options")) is not dict:
        raise StateError(f"{path}: core.problem_options must be a map")
    try:
        run["wire_dtype"] = run_wire_dtype(run)
    except ValueError as e:
        raise StateError(f"{path}: {e}") from None
    return run


def recorded_settings(run: dict) -> dict[str, Any]:
    """The settings the recorded ``run`` ran (algorithms/registry.py ``recorded_settings``): a key
    its run.json predates (``momentum_start``) means the value it ran then. Where the algorithm
    cannot be resolved, the settings as they are (building it reports why)."""
    import algorithms
    from algorithms.registry import recorded_settings as fill

    try:
        return fill(algorithms.ALGORITHMS, run["algorithm"], run["settings"])
    except ValueError:
        return dict(run["settings"])


def core_config(run: dict[str, Any]):
    from ps.core.config import CoreConfig

    try:
        return CoreConfig(**{**run["core"], "problem_options": dict(run["core"]["problem_options"])})
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"run.json: its core settings do not fit this version ({type(e).__name__}: {e})") from None
