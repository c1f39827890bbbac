"""The same-host path of a server-side transport: iterates and gradients in shared memory (PROTOCOL.md §6.11, §12.1).

Both roles of :class:`~ps.net.transport.ServerTransport` use it. The rule of who gets the offer
(:func:`offers_shm`) is one. A daemon opens its arena when it starts (:func:`open_arena`: new
iterates are born in it) and keeps what a connection said on its ``Conn`` record. A shard
(:class:`SliceSameHost`) makes its arena for its slice when the first worker on its host asks,
keeps the connections it offered it to and those that opened it in bounded tables keyed by
routing id, answers a fetch with slot references (:meth:`SliceSameHost.job`) and reads a block
from the slots it lent (:meth:`SliceSameHost.block`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from algorithms._pool import POOL
from protocol.codec import encode
from protocol.messages import Error, ErrorCode, Hello, Job, JobKind, Reply
from protocol.wire import roundtrip, to_wire
from ps.core.iterates import EvictionCursor
from ps.net.routed import remember_peer

log = logging.getLogger("latecomer.server")


def offers_shm(hello: Hello, mode: str, host: str) -> bool:
    """Whether a server offers its shared memory to the worker of ``hello``: the worker asks, and
    its host id is the server's (``auto``) or whatever its host (``any``, its probe decides);
    never with ``off``."""
    return bool(hello.shm) and mode != "off" and (mode == "any" or hello.host_id == host)


def opened_shm(capable: bool, shm: bool, worker: Any) -> bool:
    """A daemon's worker's ready: whether it uses the shared memory it was offered (it opened it)."""
    if shm and capable:
        return True
    if capable:
        log.info("worker %s cannot open the shared memory: TCP for it", worker)
    return False


def open_arena(dim: int, boot: int) -> tuple[Any, str]:
    """A daemon's shared memory (protocol/shm.py), or (None, "") where unusable."""
    from protocol import shm as shm_mod

    if not shm_mod.shm_dir_usable():
        return None, ""
    try:
        shm_mod.remove_stale()
        arena = shm_mod.ShmArena(dim, boot)
        POOL.factory = arena.allocate  # new iterates are born in shared memory
        return arena, shm_mod.host_id()
    except OSError as e:
        log.warning("shared memory unavailable (%s): TCP only", e)
        return None, ""


def lend_job(arena: Any, wid: str, job: Job, store: Any) -> Job:
    """A daemon's job over the same-host path: the slot of each of its iterates (no frames) and
    the gradient slots lent for its reply."""
    refs = tuple(arena.iterate_slot(i, store[i]) for i in job.iterate_ids)
    n = 1 if job.kind == JobKind.FULL_GRAD else len(job.iterate_ids)
    return Job(job.job_id, job.kind, job.created_at, job.iterate_ids, job.seed, job.batch_size, job.shard,
               job.deadline, (), (), refs, arena.lend(wid, job.job_id, n), job.xfer, job.spin_us)


class LiveRoutingIds:
    """``rid in`` it: ``rid`` is a live worker's connection (ShmArena.sweep's ``workers``)."""

    def __init__(self, live: Callable[[bytes], bool]) -> None:
        self.live = live

    def __contains__(self, key: str) -> bool:
        return bool(key) and self.live(key.encode("ascii", "replace"))


class SliceSameHost:
    """A shard's same-host path (see the module docstring): its arena (None until made), the
    connections it was offered to (their hello said shm from this host) and those that opened
    it (ready shm)."""

    def __init__(self, mode: str, boot: int, logger: logging.Logger) -> None:
        self.mode, self.boot, self.log = mode, boot, logger
        self.arena: Any = None
        self.evictions = EvictionCursor()  # which iterates left the core's store (sweep)
        self.capable: OrderedDict[bytes, None] = OrderedDict()
        self.ready: OrderedDict[bytes, None] = OrderedDict()
        self.jobs_out = self.blocks_in = 0  # fetches answered with refs, blocks read from shared memory
        if mode != "off":
            from protocol import shm as shm_mod

            if shm_mod.shm_dir_usable():
                shm_mod.remove_stale()  # files of servers and shards of our PID namespace that died

    def restart(self, rid: bytes) -> None:
        """A hello on ``rid``: the path starts over (used only after a ready shm following the
        welcome that offers it; the slots this connection holds free are never lent again)."""
        self.capable.pop(rid, None)
        self.ready.pop(rid, None)
        if self.arena is not None:
            self.arena.retire_worker(rid.decode("ascii", "replace"))

    def offer(self, h: Hello, dim: int, float32: bool) -> bool:
        """Whether this shard offers its shared memory to the worker of hello ``h``: under the
        server's rules (:func:`offers_shm`), once its files could be made (for a slice of ``dim``
        values), for a float32 run."""
        from protocol import shm as shm_mod

        if not offers_shm(h, self.mode, shm_mod.host_id() if self.mode == "auto" else ""):
            return False
        if not float32 or dim <= 0:
            return False
        if self.arena is None:
            if not shm_mod.shm_dir_usable():
                self.mode = "off"
                return False
            try:
                self.arena = shm_mod.ShmArena(dim, self.boot)
            except OSError as e:
                self.log.warning("same-host path unavailable (%s): workers get slices over TCP", e)
                self.mode = "off"
                return False
            self.log.info("same-host path: slices and blocks through shared memory %s", self.arena.prefix)
        return True

    def offered(self, rid: bytes) -> None:
        remember_peer(self.capable, rid)

    def opened(self, rid: bytes, shm: bool, worker: str) -> None:
        """A worker's ready, the answer to the welcome that offered our shared memory: it opened it (or not)."""
        if shm and rid in self.capable:
            remember_peer(self.ready, rid)
            return
        if rid in self.capable:
            self.log.info("worker %s cannot open this shard's shared memory: TCP for it", worker[:64])
        self.ready.pop(rid, None)

    def job(self, rid: bytes, entry: Any, store: Any, wire: str, live: bool) -> Job | None:
        """The answer to a fetch over the same-host path: ``refs``, the slot of each of the job's
        iterates (``point_ids`` empty, no frames), and ``grad_slots`` lent for its block (the same
        ones if it is asked again). None (answered over TCP): not the live worker's connection, an
        iterate not stored, or the job's slots lent to another connection."""
        arena = self.arena
        key = rid.decode("ascii", "replace")
        if arena is None or not live or any(i not in store for i in entry.iterate_ids):
            return None
        held = arena.lent.get(entry.job_id)
        if held is not None and held[0] != key:
            return None
        refs = tuple(self.iterate_slot(i, store, wire) for i in entry.iterate_ids)
        if held is not None:
            slots = held[1]
        else:
            slots = arena.lend(key, entry.job_id, 1 if entry.kind == JobKind.FULL_GRAD else len(entry.iterate_ids))
        self.jobs_out += 1
        return Job(job_id=entry.job_id, kind=entry.kind, created_at=entry.created_at, iterate_ids=entry.iterate_ids,
                   seed=entry.seed, batch_size=entry.batch_size, shard=entry.shard, deadline=entry.deadline,
                   refs=refs, grad_slots=slots)

    def iterate_slot(self, iid: int, store: Any, wire: str) -> int:
        """The slot of iterate ``iid``: its slice as a worker over TCP sees it (float32 values of the
        run's wire dtype, so that both paths compute the same and replay recomputes it), copied once."""
        held = self.arena.copies.get(iid)
        if held is not None:
            return held[0]
        x = store[iid]
        return self.arena.iterate_slot(iid, x if wire == "f32" else roundtrip(x, wire))

    def block(self, rid: bytes, r: Reply, wire: str, held: bool, answer: Callable[[bytes, Any], None],
              warn: Callable[..., Any]) -> tuple[Reply, list] | None:
        """An ``in_shm`` reply: the block as the frames it stands for (a copy of the lent slots,
        in the run's wire dtype, as a TCP worker would have sent it: the journal, recovery and
        replay see the same message), or None when refused: its slots were not lent to this
        connection for this job (``err UNKNOWN_JOB``), or it carries frames too (``err BAD_SHAPE``).
        A refused reply changes nothing here and is not announced. ``held``: the shard holds
        this job's block already (acknowledged again, nothing read)."""
        if held:
            return dataclasses.replace(r, in_shm=False), []
        lent = None if self.arena is None else self.arena.gradients(rid.decode("ascii", "replace"), r.job_id)
        if lent is None or r.grads:
            code = ErrorCode.BAD_SHAPE if lent is not None else ErrorCode.UNKNOWN_JOB
            why = "in_shm with gradient frames" if lent is not None else "no shared-memory slots lent for this job"
            warn("shm", "refused a reply from %r: %s (job %d)", rid[:64], why, r.job_id)
            answer(rid, Error(code, why, job_id=r.job_id))
            return None
        grads = tuple(to_wire(np.array(g), wire) for g in lent)  # a copy: the worker may write again
        msg = Reply(job_id=r.job_id, created_at=r.created_at, grads=grads, loss=r.loss, count=r.count,
                    compute_s=r.compute_s, holds=r.holds)
        self.blocks_in += 1
        return msg, [rid, *encode(msg)]

    def sweep(self, core: Any, live: Callable[[bytes], bool]) -> None:
        """Slots the core no longer needs: copies of iterates gone from the store, gradient slots
        of jobs gone from the ledger (back to their connection while its worker is live, else unlinked)."""
        if self.arena is not None and core is not None:
            self.arena.sweep(core.store, core.ledger, LiveRoutingIds(live), self.evictions.take(core))

    def close(self) -> None:
        if self.arena is not None:
            self.log.info("same-host path: %d fetches answered through shared memory, %d blocks read from it",
                          self.jobs_out, self.blocks_in)
            self.arena.close()  # its files unlinked
