"""Replies out: results taken from the compute thread and sent in order once welcomed, the ones a
crashed or restarted server may not have read kept for a resend, a reply in the previous server's
shared memory detached into frames, a problem that cannot be loaded reported.

A part of :class:`worker.link.Worker` (its base class): the state it reads and writes is the
worker's (worker/link.py ``Worker.__init__``).
"""

from __future__ import annotations

import dataclasses
import logging

from protocol.codec import error_text
from protocol.messages import Error, ErrorCode, Ready, Reply
from protocol.wire import to_wire
from worker.runner import ComputeThread

log = logging.getLogger("latecomer.worker")


class ReplySender:
    """Replies to the server and what a resend needs (mixed into :class:`worker.link.Worker`)."""

    def _send_results(self) -> None:
        while True:
            try:
                jid, reply, error = self.compute.outbox.popleft()
            except IndexError:
                break
            if jid == ComputeThread.LOAD_FAILED:
                self._load_failed(error)
                return
            if jid == ComputeThread.LOADED:
                self.loaded = True
                if self.welcomed:
                    self._send(Ready(credit=self.cfg.credit, holds=self.cache.ids(), shm=self.shm is not None))
                continue
            if self.jobs.pop(jid, None) is None:
                continue  # cancelled meanwhile
            if error is not None:  # the compute side logged it (FailureLog); the server records a failed job
                self._send(Error(ErrorCode.COMPUTE_FAILED, error_text(error), job_id=jid))
                continue
            self.unsent.append(reply)
        while self.unsent and self.welcomed:
            r = self.unsent[0]
            if r.in_shm and self.shm_jobs.get(r.job_id, (None,))[0] != self.server_boot:
                r = self._detach(r, self.wire)  # computed for the previous server process
                if r is None:
                    self.unsent.pop(0)
                    continue
            holds = self.cache.ids()
            if r.holds != holds:  # computed inline, the reply says it already
                r = _with_holds(r, holds)
            if not self._send(r):
                break
            self.unsent.pop(0)
            self._sent(r)
        if self.shm_jobs:
            self._keep_shm_jobs()

    def _reply_now(self, r: Reply) -> None:
        """What :meth:`_send_results` does with a reply computed inline when the outbox and the
        unsent replies are empty and the server has welcomed us, without its general steps: the
        reply says what the cache holds now (the inline path built it so) and is in frames."""
        if self.jobs.pop(r.job_id, None) is None:
            return  # cancelled meanwhile
        if self._send(r):
            self._sent(r)
        else:
            self.unsent.append(r)
        if self.shm_jobs:
            self._keep_shm_jobs()

    def _sent(self, r: Reply) -> None:
        """A reply went out: counted, and kept for a resend while a crashed server may not have read it."""
        self.replies_sent += 1
        now = self.clock()
        recent = self.recent
        recent.append((now, r))
        while recent and now - recent[0][0] > self.liveness:
            recent.popleft()

    def _keep_shm_jobs(self) -> None:
        """Keep only the shared-memory jobs a resend after a server restart could need."""
        keep = {r.job_id for _, r in self.recent} | {r.job_id for r in self.unsent} | set(self.jobs)
        for jid in [j for j in self.shm_jobs if j not in keep]:
            del self.shm_jobs[jid]

    def _load_failed(self, reason: str) -> None:
        """The welcome's problem cannot be loaded here: tell the server why (PROBLEM_UNAVAILABLE)
        and stop; :func:`run_worker` then prints the reason and exits with status 3."""
        spec = self.problem_key[0] if self.problem_key else "?"
        # The loader's one-line ValueErrors name the spec already, and so does our line.
        reason = reason.removeprefix("ValueError: ").removeprefix(f"problem {spec!r}: ")
        self.failure = self.stopping = f"cannot load problem {spec}: {reason}"
        self._send(Error(ErrorCode.PROBLEM_UNAVAILABLE, error_text(reason)))

    def _detach(self, r: Reply, wire: str) -> Reply | None:
        """A shared-memory reply as a frame reply (for a new server process, which cannot read
        the old one's slots); None if its gradients are gone, or if the wire dtype is not f32:
        the gradient was computed at the exact float32 iterate, not at the quantized one a TCP
        reply implies, and recovery recomputes it at the latter. The new server writes a
        dropped job off (it is not in our busy list)."""
        if not r.in_shm:
            return r
        grads = self.shm_jobs.get(r.job_id, (None, None))[1]
        if grads is None or wire != "f32":
            log.info("job %d: its reply went to the previous server's shared memory; dropped", r.job_id)
            return None
        return dataclasses.replace(r, grads=tuple(to_wire(g, wire) for g in grads), in_shm=False)


def _with_holds(r: Reply, holds: tuple[int, ...]) -> Reply:
    """``dataclasses.replace(r, holds=holds)``, at a third of the cost (once per reply)."""
    return Reply(job_id=r.job_id, created_at=r.created_at, grads=r.grads, loss=r.loss, count=r.count,
                 compute_s=r.compute_s, holds=holds, in_shm=r.in_shm)


def printable(text: str) -> str:
    """Protocol strings are printable: tracebacks and odd bytes become spaces."""
    return "".join(c if c.isprintable() else " " for c in text)
