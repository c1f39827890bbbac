"""Who a daemon's connection speaks for: the hello rules of a server that binds connections to workers.

A daemon binds a connection to a worker with its ``hello`` (PROTOCOL.md §8) and answers it with
``welcome``. :class:`Admission` owns the rules a hello must pass before that (one connection is
one worker, a quarantined key is refused, a replaced incarnation that speaks again means two live
processes share the id, the caps on workers in total and per key) and the bounded tables those
rules remember. It reads the transport it serves (its connection table, the core's worker table,
the caps) and answers through it; it never changes the core.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable

from protocol.messages import ID_IN_USE, Bye, Error, ErrorCode, Heartbeat, Hello, Ready
from ps.net.connections import Conn, RateLimitedLog

log = logging.getLogger("latecomer.server")

MAX_SUPERSEDED = 4096  # replaced (worker id, boot) pairs remembered (Admission.refusal)


def remember(table: collections.OrderedDict, key: Any) -> None:
    """``key`` as the newest entry of a bounded table (the oldest dropped past MAX_SUPERSEDED)."""
    table[key] = None
    table.move_to_end(key)
    while len(table) > MAX_SUPERSEDED:
        table.popitem(last=False)


class Admission:
    """The hello rules of a daemon's transport (see the module docstring)."""

    def __init__(self, transport: Any, count: Callable[[str], Any]) -> None:
        self.transport = transport
        self.count = count  # what a message the core never sees counts as (ps/net/transport.py Count)
        self.needs_shards = False  # a sharded server's: a hello without `shards` is refused (PROTOCOL.md 12.1)
        self.refusals = RateLimitedLog(log)  # one line per 10 s per kind of refused hello
        # (worker id, boot) of incarnations a newer boot replaced: if one speaks again, two live
        # processes share the id (PROTOCOL.md 8.1). Oldest dropped past MAX_SUPERSEDED.
        self.superseded: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        # Ids proven shared that way: a new boot of one is refused while its holder is live (a twin
        # that restarts, e.g. under Restart=always, cannot take the id back and forth).
        self.contested: collections.OrderedDict[str, None] = collections.OrderedDict()

    def identify(self, conn: Conn, msg: Any, key: str, now: float) -> Any:
        """The worker a message is from (a str), or what it counts as (a ``Count``) or None: a
        hello binds its connection (or is refused), anything else must come over a bound
        connection with the same key."""
        t = self.transport
        if isinstance(msg, Hello):
            refused = self.refusal(conn, msg, key, now)
            if refused:
                return self.refuse(conn, msg.worker_id, refused[1], now, kind=refused[0])
            t.conns.bind(conn, msg.worker_id, key)  # a record bound to wid before loses it
            conn.parts = msg.parts
            conn.seal_capable = msg.seal and bool(key)
            conn.seal_segments = msg.seal_segments
            conn.seal_ciphers = msg.seal_ciphers
            conn.cpus = msg.cpus
            if t.arena is not None:
                t.arena.forget_worker(msg.worker_id)
                conn.shm_capable = t.offers_shm(msg)
            return msg.worker_id
        if conn.wid is None:
            if isinstance(msg, Bye):
                return None
            t.answer_error(conn, Error(ErrorCode.UNKNOWN_WORKER, "say hello first"))
            return self.count("stray" if isinstance(msg, (Heartbeat, Ready)) else "invalid")
        if conn.key != key:  # another key took this routing id over
            t.answer_error(conn, Error(ErrorCode.REFUSED, "key does not match the worker's"))
            return self.count("invalid")
        return conn.wid

    def refusal(self, conn: Conn, hello: Hello, key: str, now: float) -> tuple[str, str] | None:
        """Why the transport refuses this hello, as (kind for the log or "", text), or None."""
        t, wid = self.transport, hello.worker_id
        if self.needs_shards and not hello.shards:  # PROTOCOL.md §9, §12.1: it would compute on empty points
            return "no_shards", ("this server is sharded (PROTOCOL.md 12): the worker must follow welcome.shards "
                                 "and say hello.shards")
        if conn.wid is not None and conn.wid != wid:  # one connection cannot be two workers
            return "", "routing id already bound to another worker"
        if key and key in t.banned_keys:
            return "", "this key is quarantined"
        w = t.core.workers.get(wid)
        if (wid, hello.boot) in self.superseded or (  # a replaced incarnation speaks again: not a restart
                wid in self.contested and w is not None and w.boot != hello.boot
                and now - w.last_seen < t.core.cfg.liveness_timeout_s):  # a proven twin's next boot
            remember(self.contested, wid)
            return "id_in_use", (f"{ID_IN_USE}: {wid[:64]} belongs to another live process (a newer boot took it); "
                                 "give each worker its own --worker-id")
        if w is not None:
            if w.key != key:
                return "", "worker id in use with another key"
            if w.boot != hello.boot:  # a new incarnation replaces w: a restart, unless w speaks again
                remember(self.superseded, (wid, w.boot))
            return None
        # A new join: the caps.
        if len(t.core.workers) >= t.max_workers:
            return "max_workers", f"too many workers ({t.max_workers}; serve --max-workers)"
        if key and t.conns.workers_of_key(key) >= t.max_workers_per_key:
            return "max_workers_per_key", (f"key {key} already has {t.max_workers_per_key} workers "
                                           "(serve --max-workers-per-key)")
        return None

    def refuse(self, conn: Conn, wid: str, refusal: str, now: float, kind: str = "") -> Any:
        """A refused hello: answered ``err REFUSED`` and, for a ``kind`` of refusal an operator
        should hear of, logged at most once per 10 s; it counts as ``refused``."""
        if kind:
            self.refusals.warning(kind, now, "refused hello from worker %s: %s", wid[:64], refusal)
        self.transport.answer_error(conn, Error(ErrorCode.REFUSED, refusal))
        return self.count("refused")
