"""The daemon's per-connection state, owned in one place and bounded.

Every routing id that sends the server anything gets one :class:`Conn` record, created on its
first message. The record holds all the transport state of that connection: the worker id a
``hello`` bound it to and the CURVE key it said it with, what the worker said it can do (parts,
same-host path), its unfinished ``part`` transfer, and its rate limits (error answers, ``status?``
answers). Nothing else in the daemon is keyed by routing id or by worker id.

A record is freed:

* when its worker leaves (``bye``) or is quarantined or revoked (:meth:`Connections.forget`);
* when its worker is written off (timeout, unreachable, restarted elsewhere): the record then
  keeps its binding, so what the worker still sends is recognised (a late reply is counted as
  late), but it counts as *idle* from then on (:meth:`Connections.release`);
* when an idle record (no live worker: never joined, refused, or written off) has been silent
  for ``idle_s``, or when there are more than ``max_idle`` idle records (the least recently heard
  goes first).

ZeroMQ's ROUTER does not say when a peer disconnects, so "the connection went" is seen through
these timeouts. Records of live workers are bounded by the worker caps; idle records by
``max_idle``; so the table never holds more than ``max_workers + max_idle`` records, whatever
the number of connections ever made. Each record's own memory is bounded too: one unfinished
transfer of at most ``transfer_bytes`` (dropped after ``transfer_timeout_s`` without a new part),
one pending ``status?`` token. All unfinished transfers together hold at most
``transfer_total_bytes``: a part that would pass it first evicts the transfers that were fed
least recently. Every operation is O(1) amortised (dicts and ordered dicts, a heap only for
the waiting ``status?`` requests), so the cost of a message does not grow with the number of
connections.

Pure: no sockets; every method takes ``now`` (the daemon's monotonic clock), so the unit tests
drive it with a fake clock.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from protocol.chunks import Reassembler
from protocol.errors import RemoteProtocolError
from protocol.messages import Part

DEFAULT_MAX_WORKERS = 10_000  # serve --max-workers
DEFAULT_MAX_WORKERS_PER_KEY = 8  # serve --max-workers-per-key (CurveZMQ only)


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of the connection table (SECURITY.md, "Limits and rates").

    Attributes:
        idle_s: an idle record (no live worker) silent this long is forgotten.
        max_idle: at most this many idle records; beyond, the least recently heard is forgotten.
        transfer_bytes: bytes one connection's unfinished transfer may hold (the daemon: two
            float64 gradients).
        transfer_total_bytes: bytes all unfinished transfers together may hold.
        transfer_timeout_s: an unfinished transfer that got no part for this long is dropped.
        status_rate, status_burst: ``status?`` answers per second per connection (token bucket).
        status_source_rate, status_source_burst: ... for all connections of one source (a CURVE
            key, a client address the front vouches for; see :meth:`Connections.status_ask`).
        status_global_rate, status_global_burst: ... for all connections together. A request
            past any waits (one per connection; more are dropped) and is answered in turn, least
            recently served first.
        error_interval_s: at most one error answer per connection in this interval.
        error_global_rate, error_global_burst: error answers per second for all connections.
        hb_refresh_s: a heartbeat identical (byte for byte) to the last one this connection
            handed on is dropped unread if that one is younger than this (the daemon: a third
            of the liveness timeout); 0: never. See :meth:`Connections.repeat_heartbeat`.
        hb_rate, hb_burst: heartbeats per second one connection gets handed on (token bucket; the
            daemon: at least 10/s, four times what its heartbeat interval asks); past it they
            are dropped unread (:meth:`Connections.heartbeat_flood`); 0: no bound.
    """

    idle_s: float = 10.0
    max_idle: int = 4096
    transfer_bytes: int = 64 << 20
    transfer_total_bytes: int = 256 << 20
    transfer_timeout_s: float = 10.0
    status_rate: float = 5.0
    status_burst: float = 10.0
    status_source_rate: float = 10.0
    status_source_burst: float = 20.0
    status_global_rate: float = 50.0
    status_global_burst: float = 50.0
    error_interval_s: float = 0.2
    error_global_rate: float = 100.0
    error_global_burst: float = 100.0
    hb_refresh_s: float = 0.0
    hb_rate: float = 10.0
    hb_burst: float = 10.0


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` held; starts full."""

    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now

    def take(self, now: float) -> bool:
        """Take a token if there is one."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def next_at(self) -> float:
        """When the next token is there, as of its last use (no clock needed)."""
        return self.at if self.tokens >= 1.0 else self.at + (1.0 - self.tokens) / self.rate

    def ready_at(self, now: float) -> float:
        """When the next token is there (``now`` if it is already)."""
        self._refill(now)
        return now if self.tokens >= 1.0 else now + (1.0 - self.tokens) / self.rate


class Conn:
    """One connection (routing id): everything the daemon knows about it."""

    __slots__ = ("rid", "wid", "key", "live", "last_heard", "parts", "shm_capable", "shm_ready", "xfer",
                 "xfer_at", "error_next", "status_bucket", "status_token", "status_seq", "status_last", "status_asks",
                 "status_auth", "source",
                 "hb_raw", "hb_at", "hb_bucket", "seal_capable", "seal_segments", "seal_ciphers", "cpus", "spin_us")

    def __init__(self, rid: bytes, now: float, limits: ConnectionLimits) -> None:
        self.rid = rid
        self.wid: str | None = None  # the worker a hello bound it to
        self.key = ""  # fingerprint of the CURVE key of that hello
        self.live = False  # its worker is in the core's worker table
        self.last_heard = now
        self.parts = False  # the worker takes large arrays in parts (§6.13)
        self.shm_capable = False  # said hello from this host, asking for shared memory
        self.seal_capable = False  # its hello asked for the sealed data path (§6.15)
        self.seal_segments = False  # ... and said it opens sealed frames in segments
        self.seal_ciphers: tuple[str, ...] = ()  # ... and the ciphers besides AES-256-GCM it can seal with
        self.shm_ready = False  # opened our shared memory (Ready.shm)
        self.cpus = 0  # the CPUs its hello said the worker may run on (0: not said)
        self.spin_us = 0  # the busy polling its jobs advise (Job.spin_us; the daemon's _adapt_busy_poll)
        self.xfer: Reassembler | None = None  # its unfinished transfer, if any
        self.xfer_at = 0.0  # when it last got a part
        self.error_next = 0.0  # when it may get its next error answer
        self.status_bucket = TokenBucket(limits.status_rate, limits.status_burst, now)
        self.status_token: int | None = None  # a status? request waiting for its answer
        self.status_seq = 0
        self.status_last = -float("inf")  # when it last got a status? answer
        self.status_asks = 0  # status? requests since its last answer (the dropped ones too)
        self.status_auth = False  # its waiting status? came with a key of the allow-list
        self.source = ""  # who is behind it, for the status? rates ("": itself alone)
        self.hb_raw: bytes | None = None  # the last heartbeat handed on (its frames joined), if small
        self.hb_at = 0.0  # when it was handed on
        self.hb_bucket = TokenBucket(limits.hb_rate, limits.hb_burst, now) if limits.hb_rate > 0 else None

    @property
    def xfer_bytes(self) -> int:
        return self.xfer.size if self.xfer is not None else 0


class Source:
    """The ``status?`` state of one source (Connections.status_ask): its bucket, its last
    answer, and how many records name it (it goes with the last)."""

    __slots__ = ("bucket", "last", "refs")

    def __init__(self, bucket: TokenBucket) -> None:
        self.bucket, self.last, self.refs = bucket, -float("inf"), 0


@dataclass
class ConnectionCounters:
    """What the table did (``status?`` shows them as ``conn.*``)."""

    expired: int = 0  # idle records forgotten after idle_s
    evicted: int = 0  # idle records forgotten because there were max_idle
    transfers_dropped: int = 0  # unfinished transfers dropped: timed out, evicted, superseded, record gone
    status_answered: int = 0
    status_dropped: int = 0  # a request while one of the same connection was still waiting
    errors_suppressed: int = 0  # error answers not sent (rate limits)
    hb_repeats: int = 0  # heartbeats dropped unread: a repeat of the last one, within hb_refresh_s
    hb_flood: int = 0  # heartbeats dropped unread: past the connection's heartbeat rate


class _StatusQueue:
    """The order and budgets of waiting ``status?`` requests (PROTOCOL.md 6.10): per connection, per
    source, then the global one, the least recently answered first (a mixin of :class:`Connections`,
    which holds the state)."""

    def status_ask(self, c: Conn, token: int, now: float, source: str = "", auth: bool = False) -> bool:
        """A ``status?`` from ``c``. True: answer it now. Otherwise it waits for its turn (see
        :meth:`status_due`), or, if one of ``c``'s requests is already waiting, it is dropped.

        ``source``: who is behind the connection (a CURVE key's fingerprint, a client address the
        front vouches for; "": the connection alone), whose answers share a bucket
        (``status_source_rate``) and whose last answer orders the waiting requests. ``auth``: the
        request came with a key of the allow-list: it never waits behind an anonymous one. It is
        answered at once only when nothing waits whose own buckets are ready: else it takes its
        place in line, least recently served first (:meth:`_status_rank`)."""
        c.status_asks += 1
        if c.status_token is not None:
            self.counters.status_dropped += 1
            return False
        self._set_source(c, source)
        c.status_auth = auth
        self._status_promote(now)
        if not self._status_ready_valid() and self._own_ready(c, now) <= now and self.status_global.take(now):
            self._answered(c, now)
            return True
        self.seq += 1
        c.status_token, c.status_seq = token, self.seq
        self._status_enqueue(c, now)
        return False

    def status_due(self, now: float) -> list[tuple[bytes, int]]:
        """The waiting ``status?`` requests whose turn has come: (routing id, token), as far as the
        global rate allows, authenticated ones first, then least recently served first: a source
        (then a connection) never answered, as the operator's one ``latecomer status``, goes
        before any flooder that was answered recently, however many wait."""
        out: list[tuple[bytes, int]] = []
        self._status_promote(now)
        ready = self.status_ready
        while self._status_ready_valid():
            rank, seq, rid = ready[0]
            c = self.by_rid[rid]
            if self._status_rank(c) != rank:  # its source was answered, or it asked, meanwhile: it moves back
                heapq.heapreplace(ready, (self._status_rank(c), seq, rid))
                continue
            if self._own_ready(c, now) > now:  # its source's bucket ran dry meanwhile
                heapq.heappop(ready)
                heapq.heappush(self.status_wait, (self._own_ready(c, now), seq, rid))
                continue
            if not self.status_global.take(now):
                break
            heapq.heappop(ready)
            out.append((rid, c.status_token))
            self._answered(c, now)
        return out

    def _answered(self, c: Conn, now: float) -> None:
        """``c`` gets an answer now: its tokens are taken, its (and its source's) last answer is now."""
        c.status_bucket.take(now)
        c.status_token = None
        c.status_last, c.status_asks = now, 0
        src = self.sources.get(c.source) if c.source else None
        if src is not None:
            src.bucket.take(now)
            src.last = now
        self.counters.status_answered += 1

    def _own_ready(self, c: Conn, now: float) -> float:
        """When both ``c``'s bucket and its source's have a token."""
        src = self.sources.get(c.source) if c.source else None
        t = c.status_bucket.ready_at(now)
        return t if src is None else max(t, src.bucket.ready_at(now))

    def _status_rank(self, c: Conn) -> tuple[int, float, float, int]:
        """A waiting request's place: authenticated first, then its source's last answer, then its
        connection's (-inf: never answered), then how often it asked since (a flooder that was
        never answered either goes after the operator's one request). A rank only grows while its
        request waits (its source answered, more asks), which :meth:`status_due` relies on."""
        src = self.sources.get(c.source) if c.source else None
        return (0 if c.status_auth else 1, c.status_last if src is None else src.last, c.status_last, c.status_asks)

    def _status_enqueue(self, c: Conn, now: float) -> None:
        ready_at = self._own_ready(c, now)
        if ready_at <= now:
            heapq.heappush(self.status_ready, (self._status_rank(c), c.status_seq, c.rid))
        else:
            heapq.heappush(self.status_wait, (ready_at, c.status_seq, c.rid))
        self._status_compact()

    def _status_promote(self, now: float) -> None:
        """Requests whose own buckets have filled move from waiting to the line."""
        wait = self.status_wait
        while wait and wait[0][0] <= now:
            _, seq, rid = heapq.heappop(wait)
            c = self._waiting(rid, seq)
            if c is not None:
                heapq.heappush(self.status_ready, (self._status_rank(c), seq, rid))

    def _status_ready_valid(self) -> bool:
        """Whether a request is in line (entries of records gone or answered are dropped first)."""
        ready = self.status_ready
        while ready and self._waiting(ready[0][2], ready[0][1]) is None:
            heapq.heappop(ready)
        return bool(ready)

    def _waiting(self, rid: bytes, seq: int) -> Conn | None:
        c = self.by_rid.get(rid)
        return c if c is not None and c.status_seq == seq and c.status_token is not None else None

    def _status_compact(self) -> None:
        """Entries of records that went stay in the heaps until they come up; should they pile up
        (connections that asked once and went), the heaps are rebuilt from the live ones: they
        never hold more than about twice the table's records (one waiting request per record)."""
        if len(self.status_ready) + len(self.status_wait) <= 2 * len(self.by_rid) + 64:
            return
        self.status_ready = [e for e in self.status_ready if self._waiting(e[2], e[1]) is not None]
        self.status_wait = [e for e in self.status_wait if self._waiting(e[2], e[1]) is not None]
        heapq.heapify(self.status_ready)
        heapq.heapify(self.status_wait)

    def _set_source(self, c: Conn, source: str) -> None:
        """``c``'s source (see :meth:`status_ask`); a source's record lives while a record names it."""
        if source == c.source:
            return
        self._source_gone(c)
        c.source = source
        if source:
            src = self.sources.get(source)
            if src is None:
                lim = self.limits
                src = self.sources[source] = Source(TokenBucket(lim.status_source_rate, lim.status_source_burst,
                                                                c.last_heard))
            src.refs += 1

    def _source_gone(self, c: Conn) -> None:
        src = self.sources.get(c.source) if c.source else None
        if src is not None:
            src.refs -= 1
            if src.refs <= 0:
                del self.sources[c.source]
        c.source = ""


class Connections(_StatusQueue):
    """The table of :class:`Conn` records (see the module docstring)."""

    def __init__(self, limits: ConnectionLimits | None = None, *, now: float = 0.0,
                 alloc: Callable[[int], Any] | None = None) -> None:
        self.limits = limits or ConnectionLimits()
        self.by_rid: dict[bytes, Conn] = {}
        self.by_wid: dict[str, Conn] = {}  # bound records (live workers and retained bindings)
        self.idle: OrderedDict[bytes, None] = OrderedDict()  # records without a live worker, least recent first
        self.key_live: dict[str, int] = {}  # CURVE key -> its live workers
        self.xfers: OrderedDict[bytes, None] = OrderedDict()  # records holding a transfer, least recently fed first
        self.xfer_total = 0
        self.alloc = alloc or (lambda n: np.empty(n, np.uint8))
        self.counters = ConnectionCounters()
        self.on_unbind: Callable[[bytes], None] | None = None  # a record lost its worker: its sealed session ends
        lim = self.limits
        self.status_global = TokenBucket(lim.status_global_rate, lim.status_global_burst, now)
        self.error_global = TokenBucket(lim.error_global_rate, lim.error_global_burst, now)
        self.sources: dict[str, Source] = {}  # named by at least one record
        self.status_wait: list[tuple[float, int, bytes]] = []  # (own buckets ready at, seq, rid)
        self.status_ready: list[tuple[tuple, int, bytes]] = []  # (rank, seq, rid): in line for a global token
        self.seq = 0

    # ------------------------------------------------------------------ records
    def __len__(self) -> int:
        return len(self.by_rid)

    @property
    def live(self) -> int:
        return len(self.by_rid) - len(self.idle)

    def get(self, rid: bytes, now: float) -> Conn:
        """The record of ``rid``, created on its first message; marks it heard from now."""
        c = self.by_rid.get(rid)
        if c is None:
            c = self.by_rid[rid] = Conn(rid, now, self.limits)
            self.idle[rid] = None
            self._trim()
        elif not c.live:
            self.idle.move_to_end(rid)
        c.last_heard = now
        return c

    # ------------------------------------------------------------------ heartbeat repeats
    def repeat_heartbeat(self, c: Conn, body: bytes, now: float) -> bool:
        """Whether the message ``body`` (its frames joined, routing id excluded) is a repeat that
        tells the server nothing: byte for byte the last heartbeat this connection handed on, less
        than ``hb_refresh_s`` ago, with nothing else from it in between. Such a heartbeat would only
        refresh a liveness the server refreshed moments ago (same credit, same busy list, same
        ``seen``: the same reconciliation), so it is counted and dropped before it is decoded,
        journaled or shown to the core. A worker that heartbeats faster than it was told to costs
        the server a bytes comparison per extra heartbeat; the one the core sees still refreshes
        its liveness at least every ``hb_refresh_s`` (a third of the liveness timeout)."""
        if c.hb_raw is None or c.hb_raw != body or now - c.hb_at >= self.limits.hb_refresh_s:
            return False
        self.counters.hb_repeats += 1
        return True

    def heartbeat_flood(self, c: Conn, now: float) -> bool:
        """Whether a heartbeat of ``c`` (not a repeat: its bytes vary) is past the connection's
        heartbeat rate (``hb_rate``, ``hb_burst``): then it is counted and dropped unread, before it
        is queued, decoded, journaled or shown to the core. A worker heartbeats once per interval
        (0.5 s at the defaults); one connection flooding heartbeats with varying bytes would
        otherwise have each handled in full, and the real workers' replies wait behind them (the
        issue: 1,417 -> 12 updates/s). Heartbeats may be lost (PROTOCOL.md: liveness allows three
        in a row), and the next one within the rate carries the newest credit and busy list."""
        b = c.hb_bucket
        if b is None or b.take(now):
            return False
        self.counters.hb_flood += 1
        return True

    def handed_on(self, c: Conn, body: bytes | None, now: float) -> None:
        """A message of ``c`` reached the core: a heartbeat (``body``: its frames joined, kept if
        at most 512 bytes) or anything else (``None``: the next heartbeat is handed on whatever it says)."""
        if body is not None and len(body) <= 512 and self.limits.hb_refresh_s > 0:
            c.hb_raw, c.hb_at = body, now
        else:
            c.hb_raw = None

    def bind(self, c: Conn, wid: str, key: str) -> None:
        """A hello bound ``c`` to worker ``wid`` (with ``key``). Another record bound to the same
        worker loses the binding (the worker reconnected under another routing id)."""
        old = self.by_wid.get(wid)
        if old is not None and old is not c:
            self._unbind(old)
        if c.wid is not None and c.wid != wid:
            self._unbind(c)
        if c.live and c.key != key:
            self._set_live(c, False, c.last_heard)
        c.wid, c.key = wid, key
        self.by_wid[wid] = c
        c.shm_ready = False

    def set_live(self, c: Conn, live: bool, now: float) -> None:
        """Whether ``c``'s worker is in the core's worker table (the daemon says so after each
        hello; :meth:`release` after a write-off). A live record never expires."""
        self._set_live(c, live, now)
        self._trim()

    def _set_live(self, c: Conn, live: bool, now: float) -> None:
        if live == c.live or (live and c.wid is None) or self.by_rid.get(c.rid) is not c:
            return
        c.live = live
        if live:
            self.idle.pop(c.rid, None)
            if c.key:
                self.key_live[c.key] = self.key_live.get(c.key, 0) + 1
        else:
            self._key_gone(c.key)
            c.last_heard = now  # idle from now on
            self.idle[c.rid] = None
            self.idle.move_to_end(c.rid)

    def release(self, wid: str, now: float) -> None:
        """``wid`` was written off (it is no longer in the core's table): its record keeps the
        binding, so its late messages are recognised, but becomes idle; its transfer is dropped."""
        c = self.by_wid.get(wid)
        if c is not None:
            self.drop_transfer(c)
            self.set_live(c, False, now)

    def forget(self, wid: str) -> None:
        """``wid`` said bye or was quarantined or revoked: its record goes."""
        c = self.by_wid.get(wid)
        if c is not None:
            self._drop(c)

    def workers_of_key(self, key: str) -> int:
        """Live workers that said hello with this CURVE key."""
        return self.key_live.get(key, 0)

    def bound(self) -> Iterator[Conn]:
        """Every bound record (a copy: callers may change the table)."""
        return iter(list(self.by_wid.values()))

    def expire(self, now: float) -> None:
        """Forget idle records silent for ``idle_s`` and drop transfers not fed for
        ``transfer_timeout_s``. Amortised O(1): both lists are in order of last activity."""
        lim = self.limits
        while self.idle:
            c = self.by_rid[next(iter(self.idle))]
            if now - c.last_heard < lim.idle_s:
                break
            self._drop(c)
            self.counters.expired += 1
        while self.xfers:
            c = self.by_rid[next(iter(self.xfers))]
            if now - c.xfer_at < lim.transfer_timeout_s:
                break
            self.drop_transfer(c)

    def next_deadline(self) -> float:
        """When :meth:`expire` or :meth:`status_due` next has something to do (inf: never)."""
        t = float("inf")
        if self.idle:
            t = self.by_rid[next(iter(self.idle))].last_heard + self.limits.idle_s
        if self.xfers:
            t = min(t, self.by_rid[next(iter(self.xfers))].xfer_at + self.limits.transfer_timeout_s)
        if self.status_wait:
            t = min(t, self.status_wait[0][0])
        if self.status_ready:
            t = min(t, self.status_global.next_at())
        return t

    def _trim(self) -> None:
        """At most ``max_idle`` idle records: the least recently heard go."""
        while len(self.idle) > self.limits.max_idle:
            self._drop(self.by_rid[next(iter(self.idle))])
            self.counters.evicted += 1

    def _unbind(self, c: Conn) -> None:
        if c.live:
            self._set_live(c, False, c.last_heard)
        if c.wid is not None and self.by_wid.get(c.wid) is c:
            del self.by_wid[c.wid]
        c.wid, c.key = None, ""
        c.parts = c.shm_capable = c.shm_ready = c.seal_capable = c.seal_segments = False
        c.seal_ciphers = ()
        c.cpus = c.spin_us = 0
        self.drop_transfer(c)
        if self.on_unbind is not None:
            self.on_unbind(c.rid)

    def _drop(self, c: Conn) -> None:
        self._unbind(c)
        self._source_gone(c)
        self.idle.pop(c.rid, None)
        self.by_rid.pop(c.rid, None)

    def _key_gone(self, key: str) -> None:
        if key:
            n = self.key_live.get(key, 0) - 1
            if n > 0:
                self.key_live[key] = n
            else:
                self.key_live.pop(key, None)

    # ------------------------------------------------------------------ transfers (§6.13)
    def add_part(self, c: Conn, part: Part, now: float) -> None:
        """Keep a part of ``c``'s transfer. Raises RemoteProtocolError (the transfer is then
        dropped) for a part out of order, past ``transfer_bytes``, or that cannot fit within
        ``transfer_total_bytes`` even after evicting every other unfinished transfer."""
        lim = self.limits
        r = c.xfer
        if r is None:
            r = c.xfer = Reassembler(lim.transfer_bytes, alloc=self.alloc)
        before, dropped = r.size, r.dropped
        n = memoryview(part.data).nbytes
        if part.xfer == r.xfer:  # the same transfer goes on: this part adds to what it holds
            grow = n
        else:  # a new one drops the unfinished one
            grow = n - before
        if (r.size if part.xfer == r.xfer else 0) + n > lim.transfer_total_bytes:  # could never fit
            self.drop_transfer(c)
            raise RemoteProtocolError(f"unfinished transfers would hold more than {lim.transfer_total_bytes} bytes")
        while self.xfer_total + grow > lim.transfer_total_bytes and self.xfers:
            victim = self.by_rid[next(iter(self.xfers))]
            if victim is c:
                self.xfers.move_to_end(c.rid)
                if len(self.xfers) == 1:
                    break
                continue
            self.drop_transfer(victim)
        if self.xfer_total + grow > lim.transfer_total_bytes:
            self.drop_transfer(c)
            raise RemoteProtocolError(f"unfinished transfers would hold more than {lim.transfer_total_bytes} bytes")
        try:
            r.add(part)
        finally:
            self.xfer_total += r.size - before
            self.counters.transfers_dropped += r.dropped - dropped
            r.dropped = dropped
            if r.size:
                c.xfer_at = now
                self.xfers[c.rid] = None
                self.xfers.move_to_end(c.rid)
            else:
                self.xfers.pop(c.rid, None)

    def take_transfer(self, c: Conn, xfer: int, nbytes: int) -> Any:
        """The bytes of ``c``'s complete transfer ``xfer`` (the decoder's ``payload``)."""
        r = c.xfer
        if r is None or not r.size:
            raise RemoteProtocolError(f"transfer {xfer}: no parts received")
        size = r.size
        try:
            return r.take(xfer, nbytes)
        finally:
            self.xfer_total -= size
            self.xfers.pop(c.rid, None)

    def drop_transfer(self, c: Conn) -> None:
        """Drop ``c``'s unfinished transfer (its memory goes back)."""
        r = c.xfer
        if r is not None:
            if r.size:
                self.xfer_total -= r.size
                self.counters.transfers_dropped += 1
            self.xfers.pop(c.rid, None)
            c.xfer = None

    # ------------------------------------------------------------------ rates
    def may_answer_error(self, c: Conn, now: float) -> bool:
        """Whether ``c`` may get an error answer now: at most one per ``error_interval_s`` per
        connection, and ``error_global_rate`` per second in all. A refused one is counted."""
        if c.error_next > now or not self.error_global.take(now):
            self.counters.errors_suppressed += 1
            return False
        c.error_next = now + self.limits.error_interval_s
        return True

    # ------------------------------------------------------------------ figures
    def figures(self) -> dict[str, int]:
        """For ``status?`` and summary.json."""
        c = self.counters
        return {"conn.records": len(self.by_rid), "conn.live": self.live, "conn.transfers": len(self.xfers),
                "conn.transfer_bytes": self.xfer_total, "conn.expired": c.expired, "conn.evicted": c.evicted,
                "conn.transfers_dropped": c.transfers_dropped, "conn.status_answered": c.status_answered,
                "conn.status_dropped": c.status_dropped, "conn.errors_suppressed": c.errors_suppressed,
                "conn.hb_repeats": c.hb_repeats, "conn.hb_flood": c.hb_flood}


class RateLimitedLog:
    """At most one log line per ``interval_s`` per kind; the next line says how many were left out."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.next: dict[str, float] = {}
        self.left_out: dict[str, int] = {}

    def warning(self, kind: str, now: float, fmt: str, *args: Any) -> bool:
        """Log ``fmt % args`` unless a line of this ``kind`` went out less than ``interval_s``
        ago. Returns whether it was logged."""
        if self.next.get(kind, -float("inf")) > now:
            self.left_out[kind] = self.left_out.get(kind, 0) + 1
            return False
        n = self.left_out.pop(kind, 0)
        if n:
            fmt += f" ({n} more like it in the last {self.interval_s:g} s not logged)"
        self.logger.warning(fmt, *args)
        self.next[kind] = now + self.interval_s
        return True
