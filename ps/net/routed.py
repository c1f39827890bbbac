"""A shard's peers: connections identified by their routing id, and what they send in parts.

A shard never binds a connection with ``hello`` as a daemon does: a worker's connection to a shard
has the routing id ``<worker id>/<boot>`` (worker/link.py), checked against the worker table of
the shard's core (:func:`worker_of`, :meth:`ShardRole.live`). What a shard remembers of its
connections is bounded (:func:`remember_peer`: the least recent go past MAX_PARTS_PEERS). Its
workers' unfinished transfers (parts of gradient blocks) are the daemon's connection table
(ps/net/connections.py) with the slice's bounds (ps/net/transport.py ``slice_limits``), fed
through :class:`PartsIn`, which logs each kind of refusal at most once per 10 s.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from protocol.errors import RemoteProtocolError
from protocol.messages import Error, ErrorCode, Hello, Part, Welcome
from ps.net.connections import ConnectionLimits, Connections, RateLimitedLog

MAX_PARTS_PEERS = 4096  # connections remembered (told, taking parts, holding a transfer): the least recent go


@dataclass
class ShardRole:
    """What configures a :class:`~ps.net.transport.ServerTransport` for a shard's data path.

    ``answer``: every message to a worker goes through it (the shard's own send, which sends
    through the transport). ``welcome``: the welcome the shard sends, offering its shared memory
    under the prefix given (or none: ""). ``holds``: whether the shard holds a job's block
    already. ``core``: the shard's core (None until its run starts). ``boot``: the shard's (its
    shared memory's name). ``logger``: where the data path's lines go."""

    answer: Callable[[bytes, Any], None]
    welcome: Callable[[str], Welcome]
    holds: Callable[[int], bool]
    core: Callable[[], Any]
    boot: int
    logger: logging.Logger

    def live(self, rid: bytes) -> bool:
        """Whether ``rid`` is the routing id of a live worker as far as the shard's records say."""
        wid = worker_of(rid)
        core = self.core()
        w = core.workers.get(wid) if core is not None else None
        return w is not None and rid == f"{wid}/{w.boot:x}".encode()


def worker_of(rid: bytes) -> str:
    """The worker a shard's connection is of: its routing id is ``<worker id>/<boot>`` (worker/link.py)."""
    return rid.decode("ascii", "replace").rsplit("/", 1)[0]


def remember_peer(table: OrderedDict, rid: bytes) -> None:
    """``rid`` as the newest entry of a bounded table of connections."""
    table.pop(rid, None)
    table[rid] = None
    while len(table) > MAX_PARTS_PEERS:  # the least recent goes (told again / one frame: nothing breaks)
        table.popitem(last=False)


class ShardPeers:
    """What a shard remembers of its connections (bounded): those told that it takes parts (a
    welcome after the first job sent to them), those whose hello said they take parts; and what a
    hello or a ready changes of its same-host path."""

    def __init__(self, role: ShardRole, same_host: Any) -> None:
        self.role = role
        self.same_host = same_host  # ps/net/samehost.py SliceSameHost
        self.told: OrderedDict[bytes, None] = OrderedDict()
        self.parts: OrderedDict[bytes, None] = OrderedDict()

    def first_job(self, rid: bytes) -> bool:
        """Whether a job to ``rid`` is its first (that we remember): the welcome follows it."""
        if rid in self.told:
            return False
        remember_peer(self.told, rid)
        return True

    def hello(self, rid: bytes, h: Hello, send: Callable[[bytes, Welcome], bool]) -> None:
        """A worker's hello on its connection to the shard (its answer to the shard's welcome):
        whether it takes parts. Not answered, but for the welcome (``send``) that offers the
        shard's shared memory."""
        if rid != f"{h.worker_id}/{h.boot:x}".encode():
            self.role.answer(rid, Error(ErrorCode.REFUSED, "routing id is not <worker id>/<boot>"))
            return
        if h.parts:
            remember_peer(self.parts, rid)
        else:
            self.parts.pop(rid, None)
        same_host, core = self.same_host, self.role.core()
        same_host.restart(rid)
        if h.shm and same_host.offer(h, core.dim, core.dtype == np.float32):  # the core holds the slice
            same_host.offered(rid)
            if not send(rid, self.role.welcome(same_host.arena.prefix)):
                same_host.capable.pop(rid, None)  # never told: TCP


class PartsIn:
    """Workers' unfinished transfers to a shard (a connection table with the slice's bounds),
    and the rate-limited lines that say what was refused or dropped."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float], log: RateLimitedLog) -> None:
        self.transfers = Connections(limits, now=clock())
        self.clock = clock
        self.log = log

    def add(self, rid: bytes, part: Part, now: float, live: bool) -> None:
        """A part of a worker's gradient block (kept, bounded), only from a live worker's connection."""
        if not live:
            self.log.warning("peer", now, "refused a part from %r: not a live worker's connection", rid[:64])
            raise RemoteProtocolError("part from a connection that is not a live worker's")
        t = self.transfers
        dropped = t.counters.transfers_dropped
        try:
            t.add_part(t.get(rid, now), part, now)
        except RemoteProtocolError as e:  # one line (per kind, rate-limited); the answer says it too
            kind = "order" if "out of order" in str(e) else "bound"
            self.log.warning(kind, now, "refused a part from %r: %s (transfer dropped)", rid[:64], e)
            raise
        if t.counters.transfers_dropped > dropped:  # superseded by a new transfer, or evicted for this one
            self.log.warning("evicted", now, "dropped %d unfinished transfers: a new one from %r, or all of "
                             "them past %d bytes (the least recently fed evicted)",
                             t.counters.transfers_dropped - dropped, rid[:64], t.limits.transfer_total_bytes)

    def take(self, rid: bytes, xfer: int, nbytes: int) -> Any:
        """The bytes of ``rid``'s complete transfer ``xfer`` (the decoder's ``payload``)."""
        c = self.transfers.by_rid.get(rid)
        try:
            if c is None:
                raise RemoteProtocolError(f"transfer {xfer}: no parts received")
            return self.transfers.take_transfer(c, xfer, nbytes)
        except RemoteProtocolError as e:
            self.log.warning("transfer", self.clock(), "refused a message in parts from %r: %s", rid[:64], e)
            raise

    def expire(self, now: float) -> None:
        """Unfinished transfers without a part for ``transfer_timeout_s`` dropped (one line)."""
        t = self.transfers
        dropped = t.counters.transfers_dropped
        t.expire(now)
        if t.counters.transfers_dropped > dropped:
            self.log.warning("stale", now, "dropped %d unfinished transfers (no part for %g s)",
                             t.counters.transfers_dropped - dropped, t.limits.transfer_timeout_s)
