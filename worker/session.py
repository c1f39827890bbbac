"""The worker's side of its session with a server: every inbound message but jobs dispatched here,
the welcome (the problem loaded or refused, what it holds settled against the run, the transport
and timing taken, the shards linked), a worker id another process holds.

A part of :class:`worker.link.Worker` (its base class): the state it reads and writes is the
worker's (worker/link.py ``Worker.__init__``); no socket here, the worker's ``_send`` sends.
"""

from __future__ import annotations

import logging
import sys

from problems.trust import worker_refusal
from protocol.codec import decode
from protocol.errors import RemoteProtocolError
from protocol.messages import ID_IN_USE, Bye, Cancel, Error, ErrorCode, Heartbeat, Job, Part, Ready, Welcome
from protocol.seal import GCM
from protocol.shm import ShmReader, shm_dir_usable
from worker.identity import BASE_MAX
from worker.runner import ComputeThread
from worker.shards import ShardLinks

log = logging.getLogger("latecomer.worker")


class ServerSession:
    """The session: inbound dispatch and the welcome (mixed into :class:`worker.link.Worker`)."""

    def _on_frames(self, frames: list) -> None:
        try:
            msg = decode(frames, payload=self.parts.take)
            kind = type(msg)  # the message classes are final: no isinstance needed
            if kind is Part:
                self.parts.add(msg)
                return
        except RemoteProtocolError as e:
            log.warning("undecodable message from server: %s", e)
            return
        if kind is Job:  # the common case first
            if msg.spin_us != self.spin_us:
                self._advised(msg.spin_us)
            self._on_job(msg)
        elif kind is Welcome:
            self._on_welcome(msg)
        elif kind is Cancel:
            ids = set(msg.job_ids)
            if self.shards is not None:
                self.shards.cancel(ids)
            for jid in ids:
                self.jobs.pop(jid, None)
                self.waiting.pop(jid, None)
            if self.compute is not None:
                self.compute.cancel(ids)
        elif kind is Heartbeat:
            if self.server_boot is not None and msg.boot != self.server_boot:
                log.warning("server restarted: saying hello again")
                self.welcomed = False
        elif kind is Bye:
            self.stopping = f"server said bye: {msg.reason}"
        elif kind is Error:
            if msg.code == ErrorCode.UNKNOWN_WORKER:
                self.welcomed = False  # the server forgot us (restart, timeout): hello again
            elif msg.code == ErrorCode.UNSUPPORTED_VERSION:
                self.stopping = f"server refused: {msg.message}"
            elif msg.code == ErrorCode.REFUSED and msg.message.startswith(ID_IN_USE) and not self.welcomed:
                self._id_in_use(msg.message)
            elif msg.code == ErrorCode.REFUSED:  # e.g. benched: every job failed (PROTOCOL.md 8.8)
                log.warning("server refused: %s", msg.message)
            else:
                log.info("server error %s: %s (job %s)", msg.code.name, msg.message, msg.job_id)

    def _advised(self, spin_us: int) -> None:
        """The server's busy-poll advice changed (Job.spin_us): followed unless ``busy_poll`` is off."""
        self.spin_us = spin_us
        self.spin.set_bound(spin_us / 1e6 if self.cfg.busy_poll == "auto" else 0.0)
        log.info("busy polling %s", f"up to {spin_us} µs, as the server advises" if self.spin.bound else "off")

    def _id_in_use(self, text: str) -> None:
        """Another live process has our worker id (two hosts or containers of one name sharing a
        key, PROTOCOL.md 8.1): a default id becomes ``ID-BOOT`` (this process's boot, so unique),
        and the hello goes again at once; an id the user gave stops the worker with one line."""
        if self.id_claim is None:
            self.stopping = f"server refused: {text}"
            return
        new_id = f"{self.worker_id[:BASE_MAX]}-{self.boot & 0xFFFFFF:06x}"
        log.warning("worker id %s is taken by another live process: this worker is %s from now on",
                    self.worker_id, new_id)
        self.id_claim.release()
        self.id_claim, self.worker_id = None, new_id
        self.next_hello = self.clock()

    def _on_welcome(self, w: Welcome) -> None:
        """A welcome: load the problem it names (if allowed and not loaded yet), settle what we
        hold against its run (another run: drop all; the same run from a new server process:
        resend), take its transport (wire dtype, parts, shared memory) and timing, say ready."""
        key = (w.problem, tuple(sorted(w.problem_options.items())))
        refusal = worker_refusal(w.problem, self.allowed)
        if refusal is not None:  # never import what a server names unless our command line allows it
            self._close_compute()
            self.problem_key, self.loaded, self.welcomed = key, False, True  # welcomed: bye on the way out
            self._load_failed(refusal)
            return
        if key != self.problem_key:
            self._start_loading(key, w)
        self._settle_run(w)
        self.server_boot = w.server_boot
        self.wire = w.wire_dtype
        self.parts_ok = w.parts
        # under CurveZMQ: the sealed data connection (PROTOCOL.md §6.15)
        self._open_seal(w.seal, w.seal_segments, w.seal_cipher or GCM)
        self.shm = self._open_shm(w) if w.shm else None
        self._link_shards(w.shards)
        self.hb_interval = w.heartbeat_interval_s
        self.liveness = w.liveness_timeout_s
        self.welcomed = True
        if self.loaded:  # same problem as before (e.g. a server restart): ready at once
            self._send(Ready(credit=self.cfg.credit, holds=self.cache.ids(), shm=self.shm is not None))
        self._send_results()

    def _link_shards(self, shards: tuple) -> None:
        """A sharded server: connect to its shards (again, if they moved), else none. The fetches
        still open for jobs we hold are asked of the new shards; those of jobs we dropped (another
        run) are forgotten."""
        old = self.shards
        if old is not None:
            old.cancel({j for j in old.assembling if j not in self.jobs})
        if old is not None and old.map == tuple(shards):
            old.wire = self.wire
            return
        open_fetches = list(old.assembling.values()) if old is not None else []
        if old is not None:
            old.close()
            self.shards = None
        if shards:  # the same-host path to a shard on this host, as to the server (--shm)
            self.shards = ShardLinks(self.ctx, shards, f"{self.worker_id}/{self.boot:x}".encode(), curve=self.curve,
                                     shm=self.cfg.shm == "auto" and shm_dir_usable(), wire=self.wire)
            log.info("sharded server: %d shards", len(shards))
            now = self.clock()
            for a in open_fetches:  # the new shards are asked for every piece (the old ones' are stale)
                self.shards.fetch(a.job, a.need, now)

    def _close_compute(self) -> None:
        if self.compute is not None:
            self.compute.close()
            self.compute = None

    def _start_loading(self, key: tuple, w: Welcome) -> None:
        """A new problem: its compute thread loads it (the worker's own options merged in)."""
        self._close_compute()
        spec, options, device, threads = w.problem, dict(w.problem_options), self.cfg.device, self.cfg.threads
        overrides = dict(self.cfg.problem_overrides)

        def load():
            if overrides:  # refused (a failed load) unless the factory declares them worker-local
                from problems.loader import merge_worker_options
                problem = self._load_problem(spec, merge_worker_options(spec, options, overrides), device=device)
            else:
                problem = self._load_problem(spec, options, device=device)
            if threads and "torch" in sys.modules:  # only torch problems pay for importing torch
                sys.modules["torch"].set_num_threads(threads)
            return problem

        self.problem_key = key
        self.loaded = False
        self.compute = ComputeThread(load, self.cfg.delay, finish=self._finish)
        self.cache.items.clear()
        self.jobs.clear()
        self.waiting.clear()

    def _settle_run(self, w: Welcome) -> None:
        if w.run_id != self.run_id:
            # Another run (a fresh server): nothing we hold belongs to it. A resumed run keeps its
            # run id, and then our unanswered jobs and unsent replies are still wanted.
            if self.jobs and self.compute is not None:
                self.compute.cancel(set(self.jobs))
            self.jobs.clear()
            self.waiting.clear()
            self.unsent.clear()
            self.recent.clear()
            self.cache.items.clear()  # iterate ids restart at 0 in every run
            self.seen = -1
            self.run_id = w.run_id
        elif self.server_boot is not None and w.server_boot != self.server_boot:
            # The same run, resumed by a new server process: resend what it may not have read.
            pending = {r.job_id for r in self.unsent}
            resend = [r for _, r in self.recent if r.job_id not in pending] + self.unsent
            # Gradients left in the old server's shared memory travel as frames now.
            self.unsent = [r for r in (self._detach(r, w.wire_dtype) for r in resend) if r is not None]
            self.recent.clear()

    def _open_shm(self, w: Welcome) -> ShmReader | None:
        """The server's shared memory (the same-host path), if its probe succeeds from here."""
        try:
            reader = ShmReader(w.shm)
            why = reader.probe(w.server_boot)
        except ValueError as e:
            why = str(e)
        if why is None:
            log.info("same-host path: iterates and gradients through shared memory %s", w.shm)
            return reader
        log.warning("same-host path unavailable (%s): using TCP", why)
        return None
