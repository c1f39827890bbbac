"""The daemon's receive schedule: which received message is handled when.

Owns the bounded backlog of messages received ahead of handling, its slices, and the pause
after a costly message (a job hoarder's ready) that lets the workers that train be served
first. The daemon (ps/drivers/daemon.py) handles each message it is handed, one at a time; this
only decides the order, so each connection's messages still reach the core in the order it
sent them.
"""

from __future__ import annotations

import collections
import math
from typing import Any

from protocol.codec import looks_like_heartbeat
from ps.net.transport import SMALL_MESSAGE

BACKLOG_SLICE = 16  # backlogged messages handled before the socket is looked at again (ReceiveSchedule.batch) ...
BACKLOG_SLICE_S = 0.001  # ... or fewer, once they took this long (a hoarder's ready issues 64 jobs: ~5 ms)
BATCH_S = 0.005  # ... for at most this long before the loop's timers run
BURST_SENDS = 8  # a backlog message that sends this many messages (jobs), while workers that train are active, ...
PAUSE_SHARE = 0.5  # ... is followed by a pause of this share of its cost, for their messages (ReceiveSchedule.batch)
TRAINING_RECENT_S = 0.01  # "active": one of their messages was handled this recently
MAX_BACKLOG = 4096  # messages received ahead of handling, at most ...
MAX_BACKLOG_BYTES = 64 << 20  # ... and bytes
URGENT_PER_PASS = 8  # messages of one connection handled ahead of the backlog per pass; the rest queue behind
MAX_READS = 256  # messages read per pass, at most (dropped ones count): ~2 ms before the urgent are handled


def _nbytes(frames: list) -> int:
    return sum(len(f) for f in frames)


class ReceiveSchedule:
    """The order in which the daemon handles what its socket holds (see :meth:`batch`).

    It reads the daemon's clock, transport, connection table, core and ``sends`` (the messages
    the daemon sent: what a handled message cost) at the time of each use, and hands each
    message to ``daemon._handle``.
    """

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.backlog: collections.deque[list] = collections.deque()  # received, not yet handled
        self.backlogged: dict[bytes, int] = {}  # routing id -> its messages in the backlog
        self.backlog_hb: dict[bytes, bytes] = {}  # routing id -> its last message queued, where that is a heartbeat
        self.backlog_bytes = 0
        self.last_urgent = -math.inf  # when a message of a worker that trains was last handled
        self.paused_until = -math.inf  # the backlog waits until then (batch)

    def due(self, now: float) -> float:
        """When the backlog is next to be handled (inf: it is empty): the loop's poll waits no longer."""
        return max(now, self.paused_until) if self.backlog else math.inf

    def batch(self) -> None:
        """Receive -> journal -> core -> send (``Daemon._on_frames``), scheduled so that thousands of
        connections cannot starve the workers that do the training. Everything the socket holds
        is received at once (receiving costs a few µs; handling a message, tens): messages of
        workers that have answered jobs are handled now, in arrival order; the others (hellos,
        readys, heartbeats of idle or new workers, anything from an unknown connection) wait in a
        backlog, handled BACKLOG_SLICE at a time or for BACKLOG_SLICE_S (whichever ends first),
        the socket looked at again between slices (for at most BATCH_S, then the loop's timers
        run). A connection with messages in the backlog has all its later ones queued behind
        them, so each connection's messages are handled in the order it sent them. The backlog
        is bounded (MAX_BACKLOG messages, MAX_BACKLOG_BYTES): past it, messages wait in libzmq's
        queues (its high-water marks).

        A costly message (one that sends BURST_SENDS messages or more: a ready of a job hoarder
        issues 64 jobs, ~5 ms) while workers that train are active is followed by a pause of the backlog for
        PAUSE_SHARE of its cost, in which the loop waits for their messages: a worker with
        credit 1 answers within about a millisecond, and without the pause each of its jobs
        waited behind the next costly message (400 hoarders joining took the training workers to
        0.06 of their rate, then 0.3 with the slice bounded by time). The costly messages keep at
        least 1 / (1 + PAUSE_SHARE) of the loop, so joining goes on; cheap ones (hellos,
        heartbeats) never pause it."""
        d = self.daemon
        deadline = d.clock() + BATCH_S
        while True:
            urgent = self._receive_all()
            for frames in urgent:
                d._handle(frames)
                if d.stopping is not None:
                    return
            now = d.clock()
            if urgent:
                self.last_urgent = now
            if not self.backlog or now < self.paused_until:
                return
            self._backlog_slice(now)
            if d.stopping is not None or d.clock() >= deadline:
                return

    def _backlog_slice(self, t0: float) -> None:
        """Handle a slice of the backlog (see :meth:`batch`); pause it after a costly message."""
        d = self.daemon
        slice_end, costly, t = t0 + BACKLOG_SLICE_S, 0.0, t0
        for _ in range(min(BACKLOG_SLICE, len(self.backlog))):
            sent = d.sends
            d._handle(self._unqueue())
            now = d.clock()
            if d.sends - sent >= BURST_SENDS:
                costly += now - t
            t = now
            if d.stopping is not None or t >= slice_end:
                break
        if costly and t - self.last_urgent < TRAINING_RECENT_S:
            self.paused_until = t + PAUSE_SHARE * costly

    def _unqueue(self) -> list:
        frames = self.backlog.popleft()
        rid = frames[0].bytes
        left = self.backlogged[rid] - 1
        if left:
            self.backlogged[rid] = left
        else:
            del self.backlogged[rid]
            self.backlog_hb.pop(rid, None)
        self.backlog_bytes -= _nbytes(frames)
        return frames

    def _receive_all(self) -> list:
        """What the socket holds (within the backlog's bounds and MAX_READS): the urgent messages,
        returned, and the rest appended to the backlog. Each connection pays for its own flood:
        its heartbeats past its rate are dropped unread (Connections.heartbeat_flood: a token
        taken or not), and only its first URGENT_PER_PASS messages of a pass go ahead of the
        backlog, so the replies of the other workers read in the same pass are handled first."""
        d = self.daemon
        urgent, workers, now, per_pass = [], d.core.workers, d.clock(), {}
        for reads, frames in enumerate(d.transport.pending(), 1):
            rid = frames[0].bytes
            queued = rid in self.backlogged
            c = self._admit(rid, frames, queued, now)
            if c is not False:
                n = per_pass[rid] = per_pass.get(rid, 0) + 1
                w = workers.get(c.wid) if c is not None and c.live else None
                if w is not None and w.jobs_done and not queued and n <= URGENT_PER_PASS:
                    urgent.append(frames)
                else:
                    self._enqueue(rid, frames)
            if (len(urgent) + len(self.backlog) >= MAX_BACKLOG or self.backlog_bytes >= MAX_BACKLOG_BYTES
                    or reads >= MAX_READS):
                break
        return urgent

    def _admit(self, rid: bytes, frames: list, queued: bool, now: float) -> Any:
        """The record of a message's connection (None: none yet), or False: the message is a
        heartbeat that is dropped unread (a repeat, or past its connection's rate)."""
        transport = self.daemon.transport
        conns = transport.conns
        c = conns.by_rid.get(rid)
        if (self._queued_repeat(rid, frames) if queued  # is_repeat's own first tests, then the call
                else c is not None and c.hb_raw is not None and transport.is_repeat(c, frames, now)):
            return False  # a heartbeat repeat: dropped unread (ps/net/connections.py)
        if len(frames) == 2 and len(frames[1]) <= SMALL_MESSAGE and looks_like_heartbeat(frames[1].bytes):
            c = c if c is not None else conns.get(rid, now)
            if conns.heartbeat_flood(c, now):
                return False
        return c

    def _enqueue(self, rid: bytes, frames: list) -> None:
        self.backlog.append(frames)
        self.backlogged[rid] = self.backlogged.get(rid, 0) + 1
        self.backlog_bytes += _nbytes(frames)
        body = frames[1].bytes if len(frames) == 2 and len(frames[1]) <= SMALL_MESSAGE else None
        if body is not None and looks_like_heartbeat(body):
            self.backlog_hb[rid] = body
        else:
            self.backlog_hb.pop(rid, None)

    def _queued_repeat(self, rid: bytes, frames: list) -> bool:
        """Whether a message of a connection with messages in the backlog is byte for byte the
        heartbeat it queued last, with nothing in between: that one is still to be handed on (and
        refreshes the worker's liveness when it is, later than this one arrived), so this one would
        tell the core nothing. Dropped and counted as a repeat, like one that repeats the heartbeat
        handed on last (ServerTransport.is_repeat). Without it a server that fell behind queued
        every repeat of every connection with a message waiting (a full backlog of them: 4,000
        fakes heartbeating every 0.4 s kept it at MAX_BACKLOG and the real workers at a quarter of
        their rate, while the messages waiting in libzmq held its decoder buffers)."""
        tail = self.backlog_hb.get(rid)
        if tail is None or len(frames) != 2 or len(frames[1]) != len(tail) or frames[1].bytes != tail:
            return False
        self.daemon.conns.counters.hb_repeats += 1
        return True
