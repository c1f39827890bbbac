"""What a shard holds and keeps: its core for the run, the gradient blocks workers sent it, its checkpoints.

:class:`ShardState` is the part of a :class:`~ps.sharded.shard.Shard` that is state rather than
I/O: the core built for the run the coordinator's ``start`` record describes (the algorithm bound
to this shard's blocks, the values of its slice), or restored from a checkpoint plus the blocks
journaled after it; a worker's block checked as the core checks a reply and journaled
(``blocks/``) before the coordinator is told ``have``; the checkpoints (``ckpt-<lsn>.bin``: the
core's snapshot after the coordinator's record ``lsn``, plus the blocks not yet applied).
:class:`ShardInputs` feeds the coordinator's records to that core with the blocks held.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from algorithms.wrappers import block_sq_sums, needs_block_norms, needs_step_norms
from protocol.codec import decode
from protocol.messages import JobKind, Reply
from ps.core.spec import TrainingSpec
from ps.journal.checkpoints import checkpoint_files, verified_checkpoints, write_checkpoint
from ps.journal.inputs import CoreInputs
from ps.journal.records import Record, journaled_norms
from ps.journal.replies import reply_from_wire
from ps.journal.runfile import core_config, recorded_settings, write_run
from ps.journal.segments import cut_torn_tail, last_lsn, read_journal
from ps.journal.statedir import StateError
from ps.journal.wal import Journal
from ps.net.routed import worker_of

log = logging.getLogger("latecomer.shard")


class ShardInputs(CoreInputs):
    """The coordinator's records fed to this shard's core: a reply the coordinator accepted
    (journaled without gradients) gets the gradient block this shard holds for its job."""

    def __init__(self, core: Any, blocks: dict[int, tuple], norms: tuple | None = None,
                 step_norms: tuple | None = None) -> None:
        super().__init__(core)
        self.blocks = blocks
        self.norms = norms  # (this shard's sub-layout, its first block's index, the layout's blocks) or None
        self.step_norms = step_norms  # (its first block's index, the layout's blocks) or None (lmo='l2')

    def recompute(self, core: Any, wid: str, fields: dict, problem: Any, wire: str) -> Any:
        jid = fields["job_id"]
        entry = core.ledger.get(jid)
        grads: tuple = ()
        if entry is not None and entry.worker_id == wid and not entry.received \
                and entry.created_at == fields["created_at"]:
            grads = self.blocks.pop(jid, None)
            if grads is None:
                raise StateError(f"the coordinator accepted job {jid}, and this shard holds no gradient block for "
                                 f"it (its blocks journal lost a record?)")
        block_sq, step_sq = journaled_norms(fields)
        if grads and self.norms is not None and entry.kind != JobKind.FULL_GRAD:
            layout, first, n = self.norms
            mine = block_sq_sums(grads[0], layout)
            if block_sq is None or len(block_sq) != n or block_sq[first:first + len(mine)] != mine:
                raise StateError(f"job {jid}: the coordinator's block norms {block_sq!r:.200} are not this shard's "
                                 f"{mine!r:.200} at blocks {first}.. of {n}")
        if grads and self.step_norms is not None:
            first, n = self.step_norms
            mine = step_sq_of(core, entry, grads, block_sq)
            if mine is not None and (step_sq is None or len(step_sq) != n
                                     or step_sq[first:first + len(mine)] != mine):
                raise StateError(f"job {jid}: the coordinator's step norms {step_sq!r:.200} are not this shard's "
                                 f"{mine!r:.200} at blocks {first}.. of {n}")
        return Reply(job_id=jid, created_at=fields["created_at"], grads=grads, loss=fields["loss"],
                     count=fields["count"], compute_s=fields["compute_s"], holds=tuple(fields["holds"]),
                     block_sq=block_sq, step_sq=step_sq)


def step_sq_of(core: Any, entry: Any, grads: tuple, block_sq: tuple | None) -> tuple | None:
    """This shard's blocks' figures for the step a reply of ``entry`` with these gradient blocks
    would make on the core's state now (``Algorithm.step_sq``; lmo='l2': its blocks of ‖u‖²)."""
    from algorithms.base import Result

    r = Result(job_id=entry.job_id, worker_id=entry.worker_id, created_at=entry.created_at, kind=entry.kind,
               iterate_ids=entry.iterate_ids, grads=grads, seed=entry.seed, shard=entry.shard, block_sq=block_sq)
    got = core.alg.step_sq(core.state, r)
    return None if got is None else tuple(got)


class ShardState:
    """A shard's core, blocks and checkpoints (see the module docstring); the shard's loop
    (ps/sharded/shard.py) sets the fields these methods use."""

    norms: tuple | None = None  # set by _build where the algorithm needs block norms (clip_norm)
    keep_blocks = False  # set by _build: the run logs payloads, and the blocks journal is never pruned
    step_norms: tuple | None = None  # likewise, norms of its state (lmo='l2')

    def _build(self, run: dict, now: float | None, snap: dict | None = None) -> None:
        """This shard's core for ``run``: new (at the coordinator's creation time ``now``) or
        restored from a checkpoint's snapshot."""
        from problems.trust import Allowed, UntrustedError, check_run
        from ps.core.server_core import ServerCore
        from ps.journal.runfile import run_wire_dtype

        shards = int(run.get("shards", 0))
        if not 0 <= self.index < shards:
            raise StateError(f"this shard has slot {self.index}, and the run has {shards} shards")
        try:
            check_run(run, self.allowed or Allowed(), "the coordinator's run",
                      problem_hint="--allow-problem {spec}", algorithm_hint="--allow-algorithm {spec}")
        except UntrustedError as e:
            raise StateError(str(e)) from None
        spec = TrainingSpec(problem=run["problem"], problem_options=run["problem_options"],
                            algorithm=run["algorithm"], settings=recorded_settings(run))
        problem, sharded = spec.build_sharded(shards)
        alg = sharded.parts[self.index]
        lo, hi = sharded.plan.ranges[self.index]
        cfg = core_config(run)
        if snap is None:
            x0 = np.asarray(problem.init_params(cfg.seed))[lo:hi]
            self.core = ServerCore(alg, x0, cfg, server_boot=0, now=now)
        else:
            self.core = ServerCore.restore(alg, snap, cfg, server_boot=0)
        self.core.record_issued = False
        self.range = (lo, hi)
        self.keep_blocks = bool(run.get("log_payloads"))  # serve --log-payloads: the blocks journal is the payloads
        self.transport.wire_dtype = run_wire_dtype(run)
        # clip_norm: the have of a block says its blocks' squared norms (algorithms/sharding.py)
        self.norms = (sharded.plan.sub_layout(self.index), sharded.plan.blocks[self.index][0],
                      len(sharded.plan.layout)) if needs_block_norms(alg) else None
        self.step_norms = (sharded.plan.blocks[self.index][0], len(sharded.plan.layout)) \
            if needs_step_norms(alg) else None
        self.inputs = ShardInputs(self.core, self.blocks, self.norms, self.step_norms)
        log.info("shard %d of %d: %s, values [%d, %d) (%.1f MB of float32)", self.index, shards,
                 ", ".join(name for name, _ in sharded.plan.sub_layout(self.index)), lo, hi, (hi - lo) * 4 / 1e6)

    def _restore(self, info: dict) -> None:
        """A restarted shard: its checkpoint, then the blocks journaled after it."""
        from ps.journal.runfile import read_run

        self.run_id, self.index, self.n_shards = info["run_id"], info["index"], info.get("shards", 0)
        run = read_run(self.state_dir, complete=True)
        blocks_dir = os.path.join(self.state_dir, "blocks")
        journal_next = 0
        if run is not None:
            for lsn, snap, path in verified_checkpoints(self.state_dir):
                extra = snap.pop("shard", None)
                try:
                    self._build(run, None, snap)
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("skipping %s: it does not restore (%s)", os.path.basename(path), e)
                    continue
                self.applied = lsn
                self.blocks.update({int(k): tuple(v) for k, v in extra["blocks"].items()})
                journal_next = int(extra["journal_next"])
                break
        if os.path.isdir(blocks_dir):
            cut_torn_tail(blocks_dir)
            for rec in read_journal(blocks_dir, from_lsn=journal_next):
                if rec.op == "block":
                    grads, why = reply_from_wire(decode(rec.body["frames"]), rec.body.get("wire", "f32"))
                    if why is None:
                        self.blocks[rec.body["job_id"]] = grads.grads
        ckpts = checkpoint_files(self.state_dir)
        self.ckpt_lsn = ckpts[0][0] if ckpts else -1
        log.info("shard %d resumed after record %d with %d blocks held", self.index, self.applied, len(self.blocks))

    def _open_journal(self) -> None:
        if self.state_dir and self.journal is None:
            d = os.path.join(self.state_dir, "blocks")
            os.makedirs(d, exist_ok=True)
            cut_torn_tail(d)
            self.journal = Journal(d, next_lsn=last_lsn(d) + 1, fsync=self.fsync, clock=self.clock)

    def checkpoint(self) -> None:
        if not self.state_dir or self.core is None:
            return
        if self.journal is not None:
            self.journal.sync()
        snap = self.core.snapshot()
        live = {j: g for j, g in self.blocks.items() if not self._settled(j)}
        snap["shard"] = {"blocks": {j: list(g) for j, g in live.items()},
                         "journal_next": self.journal.next_lsn if self.journal is not None else 0}
        write_checkpoint(self.state_dir, self.applied, snap)
        kept = checkpoint_files(self.state_dir)
        self.ckpt_lsn = kept[0][0] if kept else self.applied
        if self.journal is not None:  # blocks before the oldest kept checkpoint are in it, or were applied
            self.journal.rotate()
            oldest = next(verified_checkpoints(self.state_dir, newest_first=False), None)
            if oldest is not None and not self.keep_blocks:  # a run that logs payloads keeps them: replay reads them
                self.journal.prune(int(oldest[1]["shard"]["journal_next"]) - 1, 0)
        self.since_ckpt, self.ckpt_at = 0, self.clock()

    def _apply(self, rec: Record) -> None:
        """The coordinator's record ``rec``, the next one, applied to this shard's core (the first,
        the run's ``start``, builds it)."""
        if self.core is None:
            if rec.op != "start":
                raise StateError(f"this shard has no state and the coordinator sent record {rec.lsn} ({rec.op}), "
                                 f"not the run's start")
            run = dict(rec.body["run"])
            self._build(run, rec.body["now"])
            if self.range != self.span:
                raise StateError(f"the run gives this shard the values {self.range}, the coordinator said {self.span}")
            if self.state_dir:
                write_run(self.state_dir, run)
        else:
            self.inputs.apply(rec, None, self.wire)
            self.core.drain_events()
        self.applied = rec.lsn
        self.since_ckpt += 1
        self.records_n += 1
        if len(self.blocks) > 2 * len(self.core.ledger) + 64:  # blocks of jobs settled otherwise (written off)
            for j in [j for j in self.blocks if self._settled(j)]:
                del self.blocks[j]

    def _settled(self, job_id: int) -> bool:
        """Whether a job is over here: issued by a record applied and no longer in the ledger. A
        block restored from the journal may be of a job the records applied so far have not issued."""
        return job_id < self.core.next_job_id and job_id not in self.core.ledger

    def _block(self, rid: bytes, r: Reply, frames: list) -> None:
        core = self.core
        entry = core.ledger.get(r.job_id)
        if entry is None or entry.received or entry.worker_id != worker_of(rid) \
                or entry.created_at != r.created_at:
            return  # late (written off meanwhile), or not this worker's: the coordinator decides without it
        if r.job_id in self.blocks:
            self.haves.append((-1, self._have(r.job_id, r.created_at)))
            return
        msg, why = reply_from_wire(r, self.wire)
        problem = why or core._check_grads(entry, msg, core._in_run_dtype(msg))
        if problem is not None:
            self.haves.append((-1, [r.job_id, r.created_at, int(problem[0]), problem[1][:1000]]))
            return
        lsn = -1
        if self.journal is not None:
            lsn = self.journal.append("block", job_id=r.job_id, created_at=r.created_at,
                                      frames=[bytes(f) for f in frames], wire=self.wire)
        self.blocks[r.job_id] = core._in_run_dtype(msg)
        self.haves.append((lsn, self._have(r.job_id, r.created_at)))

    def _have(self, job_id: int, created_at: int) -> list:
        """The ``have`` of a block held: with its blocks' squared norms where the algorithm needs
        them (measured on the values the core applies, in the run's dtype)."""
        grads = self.blocks[job_id]
        entry = self.core.ledger.get(job_id)
        if self.norms is None or not grads or entry is None or entry.kind == JobKind.FULL_GRAD:
            return [job_id, created_at, 0, ""]
        return [job_id, created_at, 0, "", list(block_sq_sums(grads[0], self.norms[0]))]
