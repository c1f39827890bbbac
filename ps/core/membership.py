"""Membership: workers joining and leaving. A hello joins a worker (or refuses it: protocol
version, quarantine, too many workers), or rejoins one after a reconnect or a server restart
(its jobs reconciled with what it says it holds); a heartbeat refreshes its credit and writes off
what it lost in transit; a worker removed (bye, timeout, quarantine, restart) leaves its jobs
written off.

The ``core`` argument below is a :class:`ps.core.server_core.ServerCore`."""

from __future__ import annotations

import math
from typing import Any

from protocol.messages import PROTOCOL_VERSION, PROTOCOL_VERSION_MIN, Error, ErrorCode, Heartbeat, Hello, Welcome
from ps.core.commands import Command, Send
from ps.core.faults import unbench
from ps.core.ledger import skip_job_ids
from ps.core.settlement import write_off
from ps.core.workers import WorkerInfo, add, forget, grant, reindex, seen, trusted_holds


def on_hello(core: Any, worker_id: str, hello: Hello, now: float, key: str = "") -> list[Command]:
    """A hello (``key``: the fingerprint of the worker's CURVE key): a join, a rejoin of the same
    incarnation (its jobs reconciled with what it holds) or a new incarnation (a new join); or a
    refusal (protocol version, quarantine, too many workers)."""
    if hello.vmax < PROTOCOL_VERSION_MIN or hello.vmin > PROTOCOL_VERSION:
        core.counters.invalid += 1
        return [Send(worker_id, Error(ErrorCode.UNSUPPORTED_VERSION,
                                      f"server speaks {PROTOCOL_VERSION_MIN}..{PROTOCOL_VERSION}"))]
    if core.quarantine.get(worker_id, -math.inf) > now:
        core.counters.refused += 1
        return [Send(worker_id, Error(ErrorCode.REFUSED, "quarantined"))]
    core.quarantine.pop(worker_id, None)
    out: list[Command] = []
    old = core.workers.get(worker_id)
    if old is None and len(core.workers) >= core.cfg.max_workers:
        core.counters.refused += 1
        return [Send(worker_id, Error(ErrorCode.REFUSED, f"too many workers ({core.cfg.max_workers})"))]
    if old is not None and old.boot != hello.boot:
        out += remove_worker(core, worker_id, now, reason="restarted")  # new incarnation = new join
        old = None
    same_run = hello.run_id == core.cfg.run_id  # else its cache and jobs belong to another run
    # An iterate id names the iterate of that version: one above ours (or a job id above our
    # next) came from an old server process whose last records were never journaled; this
    # process makes those ids again, with other values. Such iterates are not trusted, and the
    # job ids skip past what the worker saw, so no new job shares an id with one it holds.
    holds = trusted_holds(core, hello.holds) if same_run else set()
    if same_run:
        skip_job_ids(core, max([hello.seen, *hello.busy]))
    if old is None:
        w = WorkerInfo(
            worker_id=worker_id, boot=hello.boot, credit=grant(core, hello.credit), device=hello.device,
            host_id=hello.host_id, joined_at=now, last_seen=now, holds=holds, key=key)
        add(core, w)
        core.counters.workers_joined += 1
        core.round_blocked = False
        core.events.append({"ev": "joined", "worker_id": worker_id, "device": hello.device, "key": key, "t": now})
    else:  # same incarnation saying hello again (after a reconnect or a server restart)
        old.credit, old.holds = grant(core, hello.credit), holds
        seen(core, old, now)
        if old.benched:  # a hello brings a benched worker back (a new incarnation is a new join anyway)
            unbench(core, old, "hello", now)
        busy = set(hello.busy)
        if same_run:
            # Only what it holds survives. A worker says hello again on a new connection (its
            # own reconnect, or after a server restart); a job sent on the old one that it had
            # not seen yet died with that connection, and keeping it (as "in flight") left a
            # worker with credit 1 waiting for it for good, heartbeating, never given a job.
            gone = sorted(j for j in old.outstanding if j not in busy)
            write_off(core, old, gone, "server_restart" if old.reconnecting else "vanished", now)
        else:  # it worked for another run: on our welcome it drops everything it holds
            write_off(core, old, sorted(old.outstanding), "other_run", now)
        old.reconnecting = old.awaiting_hello = False
        reindex(core, old)
    out.append(Send(worker_id, Welcome(
        server_boot=core.server_boot, run_id=core.cfg.run_id, version=PROTOCOL_VERSION, problem=core.cfg.problem,
        problem_options=dict(core.cfg.problem_options),
        heartbeat_interval_s=core.cfg.heartbeat_interval_s,
        liveness_timeout_s=core.cfg.liveness_timeout_s)))
    return out + core.dispatch(now)


def on_heartbeat(core: Any, w: WorkerInfo, hb: Heartbeat, now: float) -> list[Command]:
    """Refresh credit and reconcile: a job the worker has seen but neither holds nor answered
    was lost in transit (messages on one connection arrive in order, so its reply would have
    come before this heartbeat). Write it off."""
    if hb.credit:
        w.credit = grant(core, hb.credit)
        reindex(core, w)
    busy = set(hb.busy)
    write_off(core, w, sorted(j for j in w.outstanding if j <= hb.seen and j not in busy), "vanished", now)
    return core.dispatch(now)


def remove_worker(core: Any, worker_id: str, now: float, *, reason: str) -> list[Command]:
    """Forget a worker; its outstanding jobs are written off as lost and the algorithm told."""
    w = forget(core, worker_id)
    if w is None:
        return []
    if reason not in ("bye", "restarted"):  # it did not leave of its own accord
        core.counters.workers_lost += 1
    lost = sorted(w.outstanding)
    write_off(core, w, lost, reason, now)
    core.events.append({"ev": "left", "worker_id": worker_id, "reason": reason, "lost": len(lost), "t": now})
    return core.dispatch(now)
