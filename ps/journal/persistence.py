"""The daemon's side of the state directory: :class:`Persistence` journals every core input
before the core sees it (ps/journal/inputs.py calls it), checkpoints, and bounds the journal.

``max_journal_bytes`` bounds the journal: a checkpoint is forced when the current segment
reaches a quarter of it, and once the journal holds more than three quarters, segments whose
records are all covered by the oldest checkpoint kept are removed; ``latecomer replay`` then
starts from the oldest kept checkpoint.

When the state directory cannot be written (disk full), :class:`Persistence` pauses: nothing
more reaches the core (so no job is issued and no message is accepted), the daemon says so in
its log and ``latecomer status``, and it resumes by itself once a probe write succeeds.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from ps.journal.checkpoints import KEEP_CHECKPOINTS, checkpoint_files, write_checkpoint
from ps.journal.inputs import CoreInputs
from ps.journal.lock import StateLock
from ps.journal.records import MAX_RECORD_BYTES
from ps.journal.wal import Journal

log = logging.getLogger("latecomer.persist")  # one logger for the state directory (its name predates the split)

DEFAULT_MAX_JOURNAL_BYTES = 1 << 30
RESUME_PROBE_S = 0.5
RESUME_FREE_BYTES = 1 << 20


def _frame_bytes(f: Any) -> bytes:
    b = getattr(f, "bytes", None)  # zmq.Frame
    return b if b is not None else bytes(f)


def canonical_frames(frames: list) -> list[bytes]:
    """A message's frames as the core consumes it: decoded, then encoded again, so that what the
    decoder ignores (unknown header keys, unknown keys in array descriptors, padding) is not
    kept. ``frames`` already decoded once (the daemon's check), with the same result."""
    from protocol.codec import decode, encode

    return [_frame_bytes(f) for f in encode(decode(frames, max_array_bytes=MAX_RECORD_BYTES))]


def _why(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


class Persistence:
    """Journal and checkpoints for one daemon incarnation.

    Args:
        state_dir: the server's state directory.
        journal: the open journal of this incarnation.
        checkpoint_every: checkpoint after this many new versions (0: never by count).
        checkpoint_interval_s: checkpoint at least this often (0: never by time).
        log_payloads: journal every reply's gradients. Off (the default), accepted gradients
            are recomputed from their recorded seeds on recovery and replay, which requires a
            deterministic oracle (CPU); on, replay needs no oracle at the cost of writing every
            accepted gradient to disk (4·d bytes per reply, per gradient).
        max_journal_bytes: bound on the journal's segments on disk (0: none). A checkpoint is
            forced when the current segment reaches a quarter of it; once the journal holds more
            than three quarters, the oldest segments the kept checkpoints cover are removed. With
            ``keep`` = 3 the segments the checkpoints need hold at most three quarters, so the
            journal stays within the bound, give or take one loop pass of records (MAX_BATCH).
        lock: the server's :class:`StateLock`, released by :meth:`close`.

    Disk full: when a record or a checkpoint cannot be written, the persistence *pauses*
    (:attr:`paused` holds why): :meth:`append` and :meth:`record_message` return False without
    writing, so the daemon feeds nothing more to the core (no job is issued, no message
    accepted: what is not journaled never happened). Every ``RESUME_PROBE_S`` :meth:`after_batch`
    probes: with enough free space and a ``resume`` record written, it resumes (the core's
    clock is rebased, as after a restart, so no worker is written off for the pause).
    """

    def __init__(self, state_dir: str, journal: Journal, *, checkpoint_every: int = 1000,
                 checkpoint_interval_s: float = 30.0, log_payloads: bool = False, keep: int = KEEP_CHECKPOINTS,
                 max_journal_bytes: int = DEFAULT_MAX_JOURNAL_BYTES, lock: StateLock | None = None) -> None:
        self.state_dir = state_dir
        self.journal = journal
        self.every = checkpoint_every
        self.interval_s = checkpoint_interval_s
        self.log_payloads = log_payloads
        self.keep = keep
        self.max_journal_bytes = max_journal_bytes
        self.lock = lock
        self.wire_dtype = "f32"  # the run's --wire-dtype (from run.json)
        self.ckpt_version = -1
        self.ckpt_time = time.monotonic()
        self.ckpt_bytes = 0
        self.checkpoints = 0
        self.checkpoint_s = 0.0
        self.segments_removed = 0
        self.paused: str | None = None  # why the state directory cannot be written (None: it can)
        self.paused_at = 0.0
        self.pauses = 0
        self.not_accepted = 0  # core inputs refused while paused
        self.next_probe = 0.0
        # A sharded server's shards still need the records from this LSN on (the oldest of
        # their checkpoints): segments holding them are kept (None: no shards).
        self.retain_from: int | None = None

    # ---- writing, and pausing when it fails
    def _pause(self, why: str) -> None:
        if self.paused is None:
            self.paused, self.paused_at = why, time.monotonic()
            self.pauses += 1
            self.next_probe = self.paused_at + RESUME_PROBE_S
            log.error("%s: issuing no jobs and accepting no messages until the state directory %s can be written "
                      "again (probed every %g s)", why, self.state_dir, RESUME_PROBE_S)

    def append(self, op: str, **body: Any) -> bool:
        """Journal one core input. False (nothing written, the input must not reach the core)
        while paused or if the write fails, which pauses."""
        if self.paused is not None:
            self.not_accepted += 1
            return False
        try:
            self.journal.append(op, **body)
            return True
        except OSError as e:
            self._pause(f"cannot write the journal {self.journal.path}: {_why(e)}")
            self.not_accepted += 1
            return False

    def record_message(self, core: Any, wid: str, msg: Any, frames: list, now: float, key: str = "",
                       wire: str | None = None, refused: bool = False, refusal: Any = None) -> bool:
        """Journal one message before the core sees it. Returns False if it could not be
        journaled (paused: the disk is full): then the core must not see it.

        ``wire``: for a reply that did not travel in the run's wire dtype (the same-host path
        exchanges float32 whatever the run's ``--wire-dtype``), the dtype it did travel in; then
        ``frames`` are float32. ``refused``: the transport refuses the reply (always journaled
        whole, so that recovery refuses it again; ``refusal``, when given, is kept in the record:
        a sharded server's shards refused the reply's gradient blocks, which the record does not
        hold). Messages are journaled re-encoded from their
        decoded fields (:func:`canonical_frames`): a heartbeat padded with 60 KB of unknown keys
        takes as little room as a plain one."""
        from protocol.messages import Reply

        if self.paused is not None:
            self.not_accepted += 1
            return False
        extra: dict[str, Any] = {} if wire is None else {"wire": wire}
        if refusal is not None:
            extra["refusal"] = [int(refusal[0]), str(refusal[1])]
        if isinstance(msg, Reply) and msg.block_sq is not None:  # a sharded coordinator's, from its shards
            extra["bsq"] = [float(v) for v in msg.block_sq]
        if isinstance(msg, Reply) and msg.step_sq is not None:  # likewise (lmo='l2')
            extra["ssq"] = [float(v) for v in msg.step_sq]
        if isinstance(msg, Reply) and not self.log_payloads and not refused and core.reply_verdict(wid, msg) != "bad":
            # Accepted (or ignored) replies travel without their gradients: recomputed from the seed.
            fields = {"job_id": msg.job_id, "created_at": msg.created_at, "loss": msg.loss, "count": msg.count,
                      "compute_s": msg.compute_s, "holds": list(msg.holds), **extra}
            return self.append("reply", wid=wid, now=now, reply=fields)
        if isinstance(msg, Reply) and msg.grads:  # its gradients may have been converted from the wire dtype
            kept = canonical_frames(frames)
        else:  # the daemon hands other messages to the core as decoded
            from protocol.codec import encode

            kept = [_frame_bytes(f) for f in encode(msg)]
        return self.append("msg", wid=wid, now=now, frames=kept, key=key, **extra)

    # ---- after each batch of messages: sync, checkpoints, the journal's bound, the probe
    @property
    def forced_checkpoint_bytes(self) -> int:
        """A checkpoint is forced once the current segment holds this many bytes (0: never)."""
        return self.max_journal_bytes // (self.keep + 1) if self.max_journal_bytes else 0

    def sync_due_in(self) -> float:
        """Seconds until :meth:`after_batch` has the journal's group commit to do (inf: none, or
        paused): the daemon's poll timeout is at most this, so ``--fsync batch`` syncs within
        ``BATCH_FSYNC_S`` of a record, not within one poll."""
        return math.inf if self.paused is not None else self.journal.sync_due_in()

    def after_batch(self, core: Any, now: float) -> None:
        if self.paused is not None:
            self._probe(core, now)
            return
        try:
            self.journal.maybe_sync()
        except OSError as e:
            self._pause(f"cannot sync the journal {self.journal.path}: {_why(e)}")
            return
        due_count = self.every and core.version - self.ckpt_version >= self.every
        due_time = self.interval_s and time.monotonic() - self.ckpt_time >= self.interval_s
        due_bytes = self.forced_checkpoint_bytes and self.journal.size >= self.forced_checkpoint_bytes
        if due_count or due_bytes or (due_time and core.version != self.ckpt_version):
            self.checkpoint(core)

    def checkpoint(self, core: Any) -> str | None:
        """Write a checkpoint of ``core`` (then rotate and trim the journal as its bound asks).
        Returns its path, or None if it could not be written (which pauses)."""
        t0 = time.monotonic()
        if not self.append("checkpoint", version=core.version):
            return None
        try:
            self.journal.sync()
            path = write_checkpoint(self.state_dir, self.journal.next_lsn - 1, core.snapshot(), keep=self.keep)
            self.ckpt_bytes = os.path.getsize(path)
        except OSError as e:
            self._pause(f"cannot write a checkpoint in {self.state_dir}: {_why(e)}")
            return None
        self.ckpt_version = core.version
        self.ckpt_time = time.monotonic()
        self.checkpoints += 1
        self._trim()
        self.checkpoint_s += time.monotonic() - t0
        return path

    def _trim(self) -> None:
        """Right after a checkpoint: start a new segment once the current one is big enough to be
        worth removing later, and remove covered segments while the journal is over its bound."""
        if not self.max_journal_bytes:
            return
        j = self.journal
        try:
            if j.size >= self.max_journal_bytes // (4 * (self.keep + 1)):
                j.rotate()
            # Room for the current segment to grow to a forced checkpoint's size without passing the bound.
            budget = self.max_journal_bytes - self.forced_checkpoint_bytes
            if j.total_bytes() > budget:
                kept = checkpoint_files(self.state_dir)
                if kept:
                    covered = kept[0][0] if self.retain_from is None else min(kept[0][0], self.retain_from - 1)
                    self.segments_removed += j.prune(covered, budget)
        except OSError as e:
            log.warning("cannot rotate or trim the journal in %s: %s", self.state_dir, _why(e))

    def _probe(self, core: Any, now: float) -> None:
        """While paused: resume once there is room again (free space for two checkpoints, and a
        ``resume`` record written)."""
        t = time.monotonic()
        if t < self.next_probe:
            return
        self.next_probe = t + RESUME_PROBE_S
        try:
            st = os.statvfs(self.state_dir)
            if st.f_bavail * st.f_frsize < max(RESUME_FREE_BYTES, 2 * self.ckpt_bytes):
                return
            self.journal.append("resume", now=now)  # synced by the next after_batch
        except OSError:
            return
        paused_s, why = t - self.paused_at, self.paused
        self.paused = None
        CoreInputs(core).resumed(now)  # what replaying the "resume" record does
        log.warning("the state directory %s is writable again after %.1f s paused (%s; %d messages were not "
                    "accepted meanwhile): training resumes", self.state_dir, paused_s, why, self.not_accepted)

    def status(self) -> dict[str, Any]:
        """Figures for ``latecomer status`` and the metrics: paused (and why), journal bytes."""
        out: dict[str, Any] = {"journal_bytes": self.journal.total_bytes()}
        if self.paused is not None:
            out.update({"paused": self.paused[:200], "paused_s": time.monotonic() - self.paused_at})
        return out

    def close(self) -> None:
        try:
            self.journal.close()
        except OSError as e:
            log.error("cannot sync the journal %s at exit: %s", self.journal.path, _why(e))
        finally:
            if self.lock is not None:
                self.lock.release()
