"""Jobs in: their iterates taken from the message, the server's shared memory or the shards (or
asked for again when missing), the job handed to the compute thread, and its gradients put where
the server reads them.

A part of :class:`worker.link.Worker` (its base class): the state it reads and writes is the
worker's (worker/link.py ``Worker.__init__``).
"""

from __future__ import annotations

import logging

import numpy as np

from protocol.messages import Error, ErrorCode, Job
from protocol.wire import from_wire, to_wire
from worker.replies import printable

log = logging.getLogger("latecomer.worker")
_F32 = np.dtype(np.float32)
_NO_IDS: frozenset[int] = frozenset()  # pinned by no job


class JobIntake:
    """Jobs to the compute thread, gradients to where the server reads them (mixed into :class:`worker.link.Worker`)."""

    def _from_shard(self, i: int) -> None:
        for what, x in self.shards.receive(i):
            if what == "gone":  # settled at the server (written off, cancelled): drop it
                self.jobs.pop(x, None)
            elif what == "resend":  # its block went through slots a restarted shard never lent
                self._resend_block(i, x)
            elif x.job_id in self.jobs:
                self._on_job(x, whole=True)

    def _on_job(self, job: Job, whole: bool = False) -> None:
        if self.compute is None:
            return
        if job.job_id > self.seen:
            self.seen = job.job_id
        if self.shards is not None and not whole:  # its iterates come from the shards
            self.jobs[job.job_id] = job
            need = tuple(dict.fromkeys(i for i in job.iterate_ids if self.cache.get(i) is None))
            self.shards.fetch(job, need, self.clock())
            return
        if job.refs or job.grad_slots:  # same-host path: the iterates are in shared memory
            self._on_shm_job(job)
            return
        cache, given = self.cache, job.points
        p = given[0] if len(given) == 1 else None
        if type(p) is np.ndarray and p.dtype == _F32 and self.wire == "f32" and job.iterate_ids == job.point_ids:
            cache.put(job.point_ids[0], p)  # the common case: the job's one iterate, in it (what the loop does)
            self.jobs[job.job_id] = job
            points = (p,)
        else:
            points = self._take_points(job)
            if points is None:
                return
        if self.waiting:
            self.waiting.pop(job.job_id, None)
        self._run(job, points)
        if len(cache.items) > cache.capacity:
            cache.evict({i for j in self.jobs.values() for i in j.iterate_ids} if self.jobs else _NO_IDS)

    def _take_points(self, job: Job) -> tuple | None:
        """The iterates ``job`` names: those it carries cached, the others from the cache; None
        (the job dropped, or waiting for what the server is asked for) if one is not there."""
        cache, wire = self.cache, self.wire
        for iid, p in zip(job.point_ids, job.points, strict=True):
            if wire == "f32" and type(p) is np.ndarray and p.dtype == _F32:  # from_wire's identity, unchecked
                cache.put(iid, p)
                continue
            try:
                cache.put(iid, from_wire(p, wire))
            except ValueError as e:
                log.warning("job %d: %s", job.job_id, e)
                return None  # never cached: the server's ledger writes the job off as vanished
        self.jobs[job.job_id] = job
        points = tuple([cache.get(i) for i in job.iterate_ids])
        for p in points:
            if p is None:
                self._ask_missing(job, points)
                return None
        return points

    def _ask_missing(self, job: Job, points: tuple) -> None:
        """Some iterates of ``job`` are not in the cache: it waits, and the server is asked for them."""
        missing = tuple(i for i, p in zip(job.iterate_ids, points, strict=True) if p is None)
        self.waiting[job.job_id] = job
        self._send(Error(ErrorCode.MISSING_ITERATE, "iterate not in cache", job_id=job.job_id,
                         iterate_ids=missing))

    def _resend_block(self, i: int, jid: int) -> None:
        """Job ``jid``'s block to shard ``i`` again, as frames, from the reply kept for a resend
        (a reply no longer kept is not sent again: the coordinator writes the job off in time)."""
        r = next((r for _, r in reversed(self.recent) if r.job_id == jid), None)
        if r is not None and r.grads and not self.shards.send_block(i, r):
            log.warning("shard %d: job %d's block could not be sent again (its pipe is full)", i, jid)

    def _on_shm_job(self, job: Job) -> None:
        self.jobs[job.job_id] = job
        self.shm_jobs[job.job_id] = [self.server_boot, None]
        if self.shm is None or len(job.refs) != len(job.iterate_ids):
            self.jobs.pop(job.job_id, None)
            self._send(Error(ErrorCode.REFUSED, "shared-memory job, but no shared memory here", job_id=job.job_id))
            return
        try:
            points = tuple(self.shm.view(s) for s in job.refs)
        except (OSError, ValueError) as e:
            self.jobs.pop(job.job_id, None)
            self._send(Error(ErrorCode.REFUSED, printable(f"shared memory: {e}")[:200], job_id=job.job_id))
            return
        self._run(job, points)

    def _run(self, job: Job, points: tuple) -> None:
        compute = self.compute
        if compute.can_inline():
            reply, error = compute.execute_inline(job, points, self.cache.ids())  # sent at once: the holds are now
            if error is None and self.welcomed and not (reply.in_shm or compute.outbox or self.unsent):
                self._reply_now(reply)  # nothing before it, nothing to detach or redo: the common case
            else:
                compute.outbox.append((job.job_id, reply, error))
                self._send_results()
        else:
            compute.submit(job, points)

    def _finish(self, job: Job, grads: tuple) -> tuple[tuple, bool]:
        """On the compute side, after the gradients: put them where the server reads them.
        Returns the reply's gradients and whether they went to shared memory."""
        if job.grad_slots:
            if len(grads) != len(job.grad_slots):
                raise ValueError(f"{len(grads)} gradients for {len(job.grad_slots)} shared-memory slots")
            for g, slot in zip(grads, job.grad_slots, strict=True):
                dst = self.shm.view(slot, writable=True)
                if dst.size != g.size:
                    raise ValueError(f"gradient of {g.size} values, shared-memory slot of {dst.size}")
                np.copyto(dst, g.reshape(-1))
            held = self.shm_jobs.get(job.job_id)
            if held is not None:
                held[1] = grads  # for a resend to a restarted server
            return (), True
        if self.wire != "f32":
            return tuple(to_wire(g, self.wire) for g in grads), False
        return grads, False
