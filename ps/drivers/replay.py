"""Exact replay of a recorded run, and re-running its delay trace under another algorithm.

``replay_run`` feeds the whole journal of a state directory through a fresh ServerCore, the
way the daemon fed it (including server restarts, and created at the time the journal's
``start`` record gives, so clock-driven rounds fall where they fell), recomputing
journaled-without-payload gradients from their seeds with the problem's oracle. On a deterministic (CPU) oracle the
final iterate equals the recorded one bit for bit. Once ``serve --max-journal-bytes`` has
removed the journal's head, replay starts from the oldest kept checkpoint that covers where
the journal starts (the run before it is no longer on disk to check).

``recorded_durations`` extracts, per worker, the sequence of job durations of the recorded run
(issue to reply); ``TraceDelays`` plays them back in the simulator, so another algorithm can be
compared on the very same heterogeneity (like for like).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from problems.trust import BUILTINS_ONLY, Allowed, check_run
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore
from ps.drivers.replay_blocks import BlockInputs, read_blocks, shard_block_dirs
from ps.journal.recovery import apply_checked, restore_checkpoint
from ps.journal.runfile import read_run, run_wire_dtype
from ps.journal.segments import first_journal_lsn, read_journal, run_start
from ps.journal.statedir import StateError
from ps.journal.statefiles import read_npy


@dataclass
class ReplayResult:
    records: int
    version: int
    final_x: np.ndarray
    counters: dict[str, int]
    durations: dict[str, list[float]] = field(default_factory=dict)  # worker -> job durations (s)
    applied: list[tuple[int, int, str]] = field(default_factory=list)  # (job_id, created_at, worker)
    start_lsn: int = 0  # the first record replayed (> 0: from a checkpoint, the journal's head removed)
    from_checkpoint: str = ""  # the checkpoint file replay started from ("": the start of the run)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.final_x).tobytes()).hexdigest()


def build_from_run(run: dict[str, Any], *, algorithm: str | None = None, settings: dict | None = None,
                   allowed: Allowed = BUILTINS_ONLY, where: str = "run.json"):
    """(problem, algorithm, core config) of a recorded run, optionally with another algorithm
    (``algorithm``, named by the caller, so trusted).

    A problem or algorithm of the user's own (``module:callable``) that ``run`` names is loaded
    only if ``allowed`` trusts it (problems/trust.py; the default trusts only the built-ins): a
    run.json is data, and naming ``os:system`` in it must not run anything.

    Raises:
        ValueError: an unloadable problem or algorithm; ``UntrustedError`` (a ValueError) for an
            untrusted one, naming the flag to add.
    """
    import algorithms
    from algorithms.registry import recorded_settings
    from problems import load_problem

    check_run(run, allowed, where, check_algorithm=algorithm is None)

    problem = load_problem(run["problem"], run["problem_options"])
    if algorithm:
        alg = algorithms.build(algorithm, settings)
    else:  # as recorded: a key the record predates means the value it ran then (recorded_settings)
        alg = algorithms.build(run["algorithm"], recorded_settings(algorithms.ALGORITHMS, run["algorithm"],
                                                                   run["settings"]))
    bind = getattr(alg, "bind", None)
    if bind is not None:
        alg = algorithms.base.bind_layout(alg, problem.layout, getattr(problem, "lmo_mask", None))
    try:
        cfg = CoreConfig(**{**run["core"], "problem_options": dict(run["core"]["problem_options"])})
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"run.json: its core settings do not fit this version ({type(e).__name__}: {e})") from None
    return problem, alg, cfg


def replay_run(state_dir: str, allowed: Allowed = BUILTINS_ONLY, shard_dirs: tuple = ()) -> ReplayResult:
    """Replay the journal of ``state_dir`` from the start (or from the oldest kept checkpoint, once
    the journal's head was removed: ``ReplayResult.from_checkpoint``).

    ``allowed``: the user callables trusted where run.json names them (default: built-ins only).
    ``shard_dirs``: a sharded run that logged its payloads: its shards' state directories in slot
    order (default: the local shards', ``<state>/shard-<i>``), whose blocks are the gradients.

    Raises:
        ValueError: no run, or one that cannot be rebuilt (``UntrustedError``: a user callable
            ``allowed`` does not trust).
    """
    run = read_run(state_dir, complete=True)
    if run is None:
        raise ValueError(f"{state_dir} holds no run (no run.json)")
    problem, alg, cfg = build_from_run(run, allowed=allowed, where=os.path.join(state_dir, "run.json"))
    if "torch" in sys.modules:  # a torch problem, built-in or the user's (a TorchProblem): the workers'
        sys.modules["torch"].set_num_threads(1)  # default of one thread gives the same bits
    # From the start of the run; once the journal's head was removed (serve --max-journal-bytes),
    # from the oldest kept checkpoint that covers where the journal starts.
    first, start, source = first_journal_lsn(state_dir) or 0, 0, ""
    if first and run.get("shards"):
        # A sharded run's checkpoints are its coordinator's (no vector) and its shards'; replay runs
        # the journal through one unsharded core, from the run's first record.
        raise StateError(f"{state_dir}: a sharded run replays from its first record, and the journal starts at LSN "
                         f"{first} (its head was removed)")
    if first:
        found = restore_checkpoint(lambda snap: ServerCore.restore(alg, snap, cfg), state_dir, newest_first=False,
                                   min_lsn=first - 1)
        if found is None:
            raise StateError(f"{state_dir}: the journal starts at LSN {first} (its head was removed) and no "
                             f"checkpoint kept covers it: nothing to replay from")
        core, lsn, source = found
        start = lsn + 1
    else:  # created when the live core was (the start record's time: clock-driven rounds start from it)
        start_rec = run_start(state_dir) or {}
        core = ServerCore(alg, problem.init_params(cfg.seed), cfg, now=start_rec.get("now", 0.0))
    issued_at: dict[int, tuple[str, float]] = {}
    durations: dict[str, list[float]] = {}
    applied: list[tuple[int, int, str]] = []
    n = 0
    wire_dtype = run_wire_dtype(run)
    inputs = None
    if run.get("shards") and run.get("log_payloads"):  # the gradients are the shards' blocks (replay_blocks.py)
        inputs = BlockInputs(core, read_blocks(shard_block_dirs(state_dir, int(run["shards"]), shard_dirs)))
    for rec in read_journal(state_dir, from_lsn=start):
        apply_checked(core, rec, problem, wire_dtype, inputs)
        n += 1
        for ev in core.drain_events():
            kind = ev["ev"]
            if kind == "issued":
                issued_at[ev["job_id"]] = (ev["worker_id"], ev["t"])
            elif kind in ("applied", "dropped") and ev["job_id"] in issued_at:
                wid, t0 = issued_at.pop(ev["job_id"])
                durations.setdefault(wid, []).append(ev["t"] - t0)
                if kind == "applied":
                    applied.append((ev["job_id"], ev["created_at"], ev["worker_id"]))
    return ReplayResult(records=n, version=core.version, final_x=np.array(core.params(), copy=True),
                        counters=core.counters.as_dict(), durations=durations, applied=applied, start_lsn=start,
                        from_checkpoint=os.path.basename(source))


def recorded_final_x(state_dir: str) -> np.ndarray | None:
    """The iterate the server held when it last stopped cleanly (final_x.npy), else None. Read
    through the checked reader: a damaged file is a StateError (one line), never a big allocation."""
    path = os.path.join(state_dir, "final_x.npy")
    return read_npy(path) if os.path.exists(path) else None


class TraceDelays:
    """Plays back recorded per-worker job durations in the simulator (cycling when the new run
    needs more jobs than were recorded). Duck-types :class:`ps.drivers.sim.DelayModel`."""

    def __init__(self, seqs: list[list[float]]) -> None:
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("every worker needs at least one recorded duration")
        self.tau = tuple(float(np.mean(s)) for s in seqs)
        self._seqs = [list(s) for s in seqs]
        self._next = [0] * len(seqs)

    def duration(self, i: int, job: Any, sample_cost: float, rng: np.random.Generator) -> float:
        seq = self._seqs[i]
        d = seq[self._next[i] % len(seq)]
        self._next[i] += 1
        return d
