"""The journal's writer: :class:`Journal` appends records to the current segment, starts new
ones (:meth:`Journal.rotate`), removes the ones the checkpoints cover (:meth:`Journal.prune`),
and syncs them as the fsync policy says.

Durability: ``--fsync always`` fsyncs each record before it counts; ``batch`` fsyncs at most
``BATCH_FSYNC_S`` (10 ms) after the last sync (group commit; the daemon's poll wakes for it:
:meth:`Journal.sync_due_in`); ``never`` leaves records to the OS. A new segment and a removed
one are made durable by fsyncing the directory.
"""

from __future__ import annotations

import math
import os
import time
import zlib
from typing import Any, Callable

import msgpack

from ps.journal.records import REC_HEADER
from ps.journal.segments import Segment, first_lsn, journal_segments
from ps.journal.statedir import StateError, fsync_dir

FSYNC_POLICIES = ("always", "batch", "never")
BATCH_FSYNC_S = 0.01


class Journal:
    """Append-only journal: a new segment per server incarnation (``wal-NNNNNN.log``), and a
    new one after a checkpoint when :meth:`rotate` is called.

    A record is written whole or not at all: a write the OS refuses part-way (disk full) is cut
    back to the record's start and the OSError raised, so the segment never holds a partial
    record followed by good ones.
    """

    def __init__(self, state_dir: str, *, next_lsn: int, fsync: str = "batch",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.fsync = fsync
        self.clock = clock  # the group commit's clock (tests may substitute one)
        self.state_dir = state_dir
        self.closed = [Segment(path, number, first_lsn(path), os.path.getsize(path))
                       for number, path in journal_segments(state_dir)]
        if next_lsn == 0 and any(s.size for s in self.closed):
            raise StateError(f"{state_dir} holds journal segments but no run description (run.json): a new run "
                             f"cannot start there; give an empty --state directory")
        self.next_lsn = next_lsn
        self.dirty = False
        self.last_sync = clock()
        self.bytes_written = 0
        self.cut_to: int | None = None  # a refused write could not be cut back yet: do it first
        # The last LSN as durable as the fsync policy makes it (written; under "batch", synced).
        # A sharded server ships records to its shards up to here, never past (ps/sharded/hub.py).
        self.durable_lsn = next_lsn - 1
        self.tap: list | None = None  # when a list: (lsn, record body bytes) of each record written
        self.fd = -1
        self._open((self.closed[-1].number + 1) if self.closed else 1)

    def _open(self, number: int) -> None:
        path = os.path.join(self.state_dir, f"wal-{number:06d}.log")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if self.fd >= 0:
            os.close(self.fd)
            self.closed.append(Segment(self.path, self.number, self.start_lsn, self.size))
        self.fd, self.path, self.number = fd, path, number
        self.start_lsn = self.next_lsn  # every record before this segment has a smaller LSN
        self.size = os.fstat(fd).st_size
        fsync_dir(self.state_dir)

    def append(self, op: str, **body: Any) -> int:
        """Write one record; returns its LSN. Raises OSError (the record not written) if the OS
        refuses the write (or, under ``--fsync always``, its fsync)."""
        lsn = self.next_lsn
        data = msgpack.packb({"lsn": lsn, "op": op, **body}, use_bin_type=True)
        rec = REC_HEADER.pack(len(data), zlib.crc32(data)) + data
        if self.cut_to is not None:
            os.ftruncate(self.fd, self.cut_to)
            self.size, self.cut_to = self.cut_to, None
        start = self.size
        view = memoryview(rec)
        try:
            while view:
                view = view[os.write(self.fd, view):]
            if self.fsync == "always":
                os.fsync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                self.cut_to = start
            raise
        self.size += len(rec)
        self.bytes_written += len(rec)
        self.next_lsn += 1
        self.dirty = self.fsync != "always"
        if self.fsync != "batch":
            self.durable_lsn = lsn
        if self.tap is not None:
            self.tap.append((lsn, data))
        return lsn

    def sync(self) -> None:
        if self.dirty:
            if self.fsync != "never":
                os.fsync(self.fd)
            self.dirty = False
        self.durable_lsn = self.next_lsn - 1
        self.last_sync = self.clock()

    def maybe_sync(self) -> None:
        """Group commit: flush and fsync if the batch window has passed."""
        if self.dirty and (self.fsync != "batch" or self.clock() - self.last_sync >= BATCH_FSYNC_S):
            self.sync()

    def sync_due_in(self) -> float:
        """Seconds until :meth:`maybe_sync` has a group commit to do (0: now; inf: nothing to
        sync, or not ``--fsync batch``). The daemon's poll waits no longer than this."""
        if not self.dirty or self.fsync != "batch":
            return math.inf
        return max(0.0, self.last_sync + BATCH_FSYNC_S - self.clock())

    def rotate(self) -> None:
        """Continue in a new segment (after a checkpoint, so that the old one can be removed once
        the checkpoints kept cover it). Raises OSError if the new file cannot be created."""
        if self.size:
            self.sync()
            self._open(self.number + 1)

    def total_bytes(self) -> int:
        return sum(s.size for s in self.closed) + self.size

    def prune(self, covered_lsn: int, budget: int) -> int:
        """Remove the oldest segments whose records all have an LSN <= ``covered_lsn`` (the
        oldest checkpoint kept), while the journal holds more than ``budget`` bytes. Returns how
        many were removed."""
        starts = [s.first_lsn for s in self.closed] + [self.start_lsn]
        cut = 0  # segments [0, cut) are covered: the LSNs of segment `cut` start at <= covered + 1
        for j, first in enumerate(starts):
            if first is not None and first <= covered_lsn + 1:
                cut = j
        removed = 0
        while removed < cut and self.total_bytes() > budget:
            seg = self.closed.pop(0)
            try:
                os.remove(seg.path)
            except FileNotFoundError:
                pass
            removed += 1
        if removed:
            fsync_dir(self.state_dir)
        return removed

    def close(self) -> None:
        try:
            self.sync()
        finally:
            os.close(self.fd)
