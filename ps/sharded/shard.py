"""A shard of a sharded server: one process holding a range of the parameter vector (PROTOCOL.md §12).

The shard runs the same :class:`~ps.core.server_core.ServerCore` as the coordinator, with the algorithm
bound to its blocks (``Sharded.parts[i]``, docs/ALGORITHMS.md §14), and feeds it the
coordinator's journal records in LSN order, live, exactly as recovery and ``latecomer replay``
feed a core (:class:`ps.journal.inputs.CoreInputs`): the ledger, ages, rounds, write-offs and every
decision of the algorithm come out the same, and the vector work is this shard's. The one
difference is where a reply's gradients come from: the coordinator's records hold none
(its iterate is empty), so an accepted reply gets this shard's gradient *block*, which the
worker sent here directly (:class:`~ps.sharded.state.ShardInputs`).

Data path (the ROUTER at ``--bind``: the server's one transport, :class:`~ps.net.transport.ServerTransport`
configured for a shard, which owns the socket, hello and ready, parts, the same-host path and the
wire dtype): a worker asks ``fetch`` {job, iterate ids} and gets a
``job`` whose points are this shard's slices of those iterates (waiting, bounded, until the
record that issued the job is applied here); it sends a ``reply`` whose gradients are its
slices. A block is checked as the core checks a reply (the job outstanding for that worker,
shape, dtype, finite, in the run's wire dtype), journaled (``blocks/``, ps/journal/wal.py's
journal), and once durable under the fsync policy the coordinator is told ``have``; the
coordinator hands the reply to its core only when every shard has it (ps/sharded/hub.py). The
core, the blocks and the checkpoints are the shard's state (ps/sharded/state.py); this module is
the loop, the control channel's side of it, and the fetches waiting for their job's record.

State directory (``--state``): ``shard.json`` (run id, index, endpoint), ``run.json`` (the run
description from the ``start`` record), ``ckpt-<lsn>.bin`` (the core's snapshot after the
coordinator's record ``lsn``, plus the blocks not yet applied) and ``blocks/wal-*.log``.
kill -9 and restart: the newest checkpoint, the blocks journaled after it, then the
coordinator sends the records after the checkpoint's LSN again; no accepted reply is lost
because the coordinator accepted it only after this shard's block was durable.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import secrets
import signal
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from protocol.messages import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Fetch,
    Welcome,
)
from ps.journal.records import Record
from ps.journal.statedir import StateError
from ps.journal.wal import Journal
from ps.net.routed import ShardRole, worker_of
from ps.net.transport import ServerTransport
from ps.sharded.control import ControlError, pack, unpack
from ps.sharded.state import ShardInputs, ShardState, step_sq_of

log = logging.getLogger("latecomer.shard")

PROGRESS_S = 0.2  # how often the shard reports (its heartbeat to the coordinator)
HELLO_S = 1.0  # shello again until welcomed
CHECKPOINT_RECORDS = 5000  # checkpoint after this many records ...
CHECKPOINT_S = 30.0  # ... or this long, whichever first
MAX_PARKED = 4096  # fetches waiting for their job to be issued here
PARKED_S = 30.0  # ... for at most this long (the worker asks again)
SHARD_FILE = "shard.json"



def saved_shard(state_dir: str) -> dict | None:
    """What a shard's ``--state`` directory says of it (``shard.json``: run id, index, shards,
    endpoint and the address it bound), None for a new directory. Raises StateError if it cannot
    be read."""
    path = os.path.join(state_dir, SHARD_FILE)
    if not os.path.exists(path):
        return None
    from ps.journal.statefiles import read_json

    info = read_json(path, "a shard description")  # the checked reader: bounded size and depth, one line
    if type(info.get("run_id")) is not int or type(info.get("index")) is not int:
        raise StateError(f"{path}: cannot be read (ValueError: not a shard description)")
    return info



def rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Lifeline:
    """When a shard gives up by itself (docs/SHARDING.md, "Faults"): the process that started it
    is gone (``parent``: that pid, for a local shard of ``serve --shards``, which is also killed by
    PR_SET_PDEATHSIG: this is the backstop; None: not watched), or nothing has come from the
    coordinator for ``coordinator_timeout`` seconds (its empty ``recs`` every 0.5 s is its
    heartbeat, PROTOCOL.md §12.3; 0: wait for ever). :meth:`check` runs on every pass of the
    shard's loop (at most 100 ms apart while it waits) and returns why it gives up, once it does."""

    def __init__(self, parent: int | None = None, coordinator_timeout: float = 0.0, getppid=os.getppid) -> None:
        self.parent, self.coordinator_timeout, self.getppid = parent, coordinator_timeout, getppid
        self.gave_up: str | None = None

    def check(self, now: float, last_contact: float) -> str | None:
        if self.gave_up is None and self.parent is not None and self.getppid() != self.parent:
            self.gave_up = f"the process that started this shard (pid {self.parent}) is gone"
        if self.gave_up is None and self.coordinator_timeout and now - last_contact > self.coordinator_timeout:
            self.gave_up = f"no coordinator for {self.coordinator_timeout:g} s"
        return self.gave_up


def _server_security(ctx: zmq.Context, keys_dir: str | None) -> Any:
    """CurveZMQ: the server's key pair, the workers on the allow-list (ps/net/security.py); None without keys."""
    if not keys_dir:
        return None
    from ps.net.security import ServerSecurity

    return ServerSecurity(ctx, keys_dir)


class Shard(ShardState):
    """One shard process's loop. ``run()`` returns why it stopped.

    Args:
        coordinator: the coordinator's shard endpoint (``serve`` logs it; ``--shard-bind``).
        bind: this shard's data endpoint for workers (port 0: the OS picks one; a restarted shard
            binds the endpoint its state directory recorded, so workers find it again).
        advertise: the endpoint workers are told (default: the bound one).
        state_dir: where the shard keeps its journal and checkpoints (None: nothing survives
            the process, and the run cannot recover this shard).
        allowed: what problems and algorithms the run may name (problems/trust.py); the shard
            never loads a user callable the coordinator names unless this allows it.
        fsync: the blocks journal's policy (ps/journal/wal.py).
        lifeline: when it gives up by itself (:class:`Lifeline`; default: never).
        token: the run's shard token, said in every ``shello`` (ps/sharded/hub_admit.py; "": none,
            which a coordinator without ``--keys`` refuses).
    """

    def __init__(self, coordinator: str, *, bind: str = "tcp://127.0.0.1:0", advertise: str | None = None,
                 state_dir: str | None = None, allowed: Any = None, fsync: str = "batch",
                 checkpoint_records: int = CHECKPOINT_RECORDS, checkpoint_s: float = CHECKPOINT_S,
                 keys_dir: str | None = None, context: zmq.Context | None = None, clock=time.monotonic,
                 shm: str = "auto", lifeline: Lifeline | None = None, token: str = "") -> None:
        self.coordinator, self.token = coordinator, token
        self.lifeline = lifeline or Lifeline()
        self.state_dir = state_dir
        self.allowed = allowed
        self.fsync = fsync
        self.checkpoint_records, self.checkpoint_s = checkpoint_records, checkpoint_s
        self.clock = clock
        self.own_ctx = context is None
        self.ctx = context or zmq.Context()
        self.security = _server_security(self.ctx, keys_dir)
        self.boot = secrets.randbits(63)
        self.index, self.run_id, self.n_shards = -1, 0, 0
        self.core: Any = None
        self.reduce_asked: dict[int, dict] = {}  # token -> a reduce? waiting for its record (lmo='l2')
        self.inputs: ShardInputs | None = None
        self.blocks: dict[int, tuple] = {}  # job id -> its gradient blocks (run dtype), journaled
        self.applied = -1  # the coordinator's last record applied here
        self.ckpt_lsn = -1  # the oldest checkpoint kept (the coordinator keeps its records after it)
        self.parked: dict[tuple[bytes, int], tuple[float, Fetch]] = {}
        self.haves: list[tuple[int, list]] = []  # (block record's LSN, have) not yet durable
        self.params_asked: list[tuple[int, int]] = []  # (token, lsn)
        self.welcomed = False
        self.failed = False
        self.stopping: str | None = None
        self.last_contact = clock()
        self.next_hello = self.next_progress = 0.0
        self.since_ckpt, self.ckpt_at = 0, clock()
        self.records_n, self.rate_t, self.records_s = 0, clock(), 0.0
        self.journal: Journal | None = None
        self.span = (0, 0)  # the values the coordinator's welcome gives this shard
        self.transport = ServerTransport(self.ctx, None, None, clock=clock, shm=shm, security=self.security,
                                         shard=self._role())
        self.lock = None
        if state_dir:
            from ps.journal.lock import StateLock

            os.makedirs(state_dir, exist_ok=True)
            self.lock = StateLock(state_dir)  # one process per shard directory (StateError if another holds it)
        saved = self._saved() if state_dir else None
        if saved is not None:
            self._restore(saved)
            bind = saved.get("bind", bind)
            advertise = advertise or saved.get("endpoint")
        self.bind_to, self.advertise, self.bound = bind, advertise, ""
        self.endpoint = advertise or ""  # told the coordinator once bound
        if self.core is not None:
            self._bind_data(self.range)
        self.ctl = self._control_socket()
        if state_dir:
            os.makedirs(os.path.join(state_dir, "blocks"), exist_ok=True)
            self._save_info()

    # ------------------------------------------------------------------ state
    def _saved(self) -> dict | None:
        return saved_shard(self.state_dir)

    def _save_info(self) -> None:
        info = {"run_id": self.run_id, "index": self.index, "shards": self.n_shards, "endpoint": self.endpoint,
                "bind": self.bound}
        path = os.path.join(self.state_dir, SHARD_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    # ------------------------------------------------------------------ sockets
    def _control_socket(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 1000
        s.routing_id = f"shard/{self.boot:x}".encode()
        s.sndhwm = s.rcvhwm = 10_000
        s.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if self.security is not None:
            self.security.apply_shard_client(s)
        s.connect(self.coordinator)
        return s

    # The data path's state is the transport's (ps/net/transport.py); these name it as the shard sees it.
    data = property(lambda self: self.transport.sock)  # the ROUTER workers reach
    wire = property(lambda self: self.transport.wire_dtype)  # the run's wire dtype
    transfers = property(lambda self: self.transport.parts.transfers if self.transport.parts else None)
    told = property(lambda self: self.transport.peers.told)  # connections sent the welcome that says parts
    parts_peers = property(lambda self: self.transport.peers.parts)  # connections whose hello said parts
    parts_in = property(lambda self: self.transport.parts_in)
    parts_out = property(lambda self: self.transport.parts_out)
    arena = property(lambda self: self.transport.same_host.arena)  # None until a worker on this host asks
    shm_capable = property(lambda self: self.transport.same_host.capable)  # offered the same-host path
    shm_ready = property(lambda self: self.transport.same_host.ready)  # opened it
    shm_jobs_out = property(lambda self: self.transport.same_host.jobs_out)
    shm_blocks_in = property(lambda self: self.transport.same_host.blocks_in)

    def _bind_data(self, span: tuple[int, int]) -> None:
        """Bind the data socket for the slice ``span`` (a restored shard knows it, a new one learns
        it from the coordinator's welcome)."""
        self.bound = self.transport.bind_slice(self.bind_to, span)
        self.endpoint = self.advertise or self.bound
        log.info("shard data on %s", self.endpoint)

    def _send_ctl(self, header: bytes, frames: tuple = ()) -> None:
        try:
            self.ctl.send_multipart([header, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # the coordinator is not there: everything is said again (shello, progress, haves on welcome)

    def _send_data(self, rid: bytes, msg: Any) -> None:
        """``msg`` to the worker at ``rid`` (ServerTransport.send_routed: a large job in parts, the
        first job to a connection followed by the welcome that says this shard takes parts)."""
        self.transport.send_routed(rid, msg)

    # ------------------------------------------------------------------ the loop
    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.stopping = f"signal {signal.Signals(signum).name}"
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        if self.security is not None:  # the allow-list re-read, as the coordinator's (SIGHUP)
            signal.signal(signal.SIGHUP, lambda signum, frame: self.security.reload())

    def run(self) -> str:
        self._open_journal()
        self.last_contact = self.clock()  # the coordinator's silence counts from here (a restore may take long)
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        try:
            while self.stopping is None:
                ready = dict(poller.poll(self._timeout_ms()))
                if self.ctl in ready:
                    self._drain(self.ctl, self._on_control)
                if self.data in ready:
                    self._drain(self.data, self._on_data)
                self._timers()
        except BaseException:
            self.failed = True
            raise
        finally:
            self.close()
        return self.stopping or "stopped"

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Any, most: int = 256) -> None:
        """Handle what ``sock`` holds, at most ``most`` messages (then the loop's timers run)."""
        for _ in range(most):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    def _timeout_ms(self) -> int:
        due = self.journal.sync_due_in() if self.journal is not None and self.haves else math.inf
        return max(0, min(100, math.ceil(min(due, PROGRESS_S) * 1000)))

    def _timers(self) -> None:
        now = self.clock()
        if self.stopping is None and self.lifeline.check(now, self.last_contact):
            self.stopping = self.lifeline.gave_up  # run() closes as on stop: checkpoint, journal, shared memory
            log.error("%s: stopping", self.stopping)
            return
        if self.journal is not None:
            self.journal.maybe_sync()
        self._flush_haves()
        if not self.welcomed and now >= self.next_hello:
            self._send_ctl(pack("shello", index=self.index, run_id=self.run_id, boot=self.boot,
                                endpoint=self.endpoint, applied=self.applied, ckpt=self.ckpt_lsn, token=self.token))
            self.next_hello = now + HELLO_S
        if self.welcomed and now - self.last_contact > 3 * HELLO_S + 2:
            log.warning("coordinator silent for %.1f s: saying shello again", now - self.last_contact)
            self.welcomed = False
        if now >= self.next_progress:
            if now > self.rate_t:
                self.records_s, self.records_n, self.rate_t = self.records_n / (now - self.rate_t + 1e-9), 0, now
            core = self.core
            self._send_ctl(pack("progress", applied=self.applied, ckpt=self.ckpt_lsn, endpoint=self.endpoint,
                                version=core.version if core else 0,
                                applied_count=core.counters.applied if core else 0, rss=rss_bytes(),
                                blocks=len(self.blocks), records_s=float(self.records_s)))
            self.next_progress = now + PROGRESS_S
        if self.transport.parts is not None:
            self.transport.parts.expire(now)  # unfinished transfers without a part for 10 s
        if self.parked:
            for key in [k for k, (t, _) in self.parked.items() if now - t > PARKED_S]:
                del self.parked[key]
        if self.core is not None and (self.since_ckpt >= self.checkpoint_records or
                                      (self.since_ckpt and now - self.ckpt_at >= self.checkpoint_s)):
            self.checkpoint()

    def _flush_haves(self) -> None:
        if not self.haves or not self.welcomed:
            return
        durable = self.journal.durable_lsn if self.journal is not None else math.inf
        ready = [h for lsn, h in self.haves if lsn <= durable]
        if ready:
            self.haves = [(lsn, h) for lsn, h in self.haves if lsn > durable]
            for i in range(0, len(ready), 4096):
                self._send_ctl(pack("have", jobs=ready[i:i + 4096]))

    # ------------------------------------------------------------------ control
    def _on_control(self, frames: list) -> None:
        try:
            m = unpack(frames[0], ("swelcome", "recs", "params?", "reduce?", "stop", "refuse"))
        except ControlError as e:
            log.warning("bad control message from the coordinator: %s", e)
            return
        self.last_contact = self.clock()
        t = m["t"]
        if t == "swelcome":
            self._on_welcome(m)
        elif t == "refuse":
            self.stopping = f"the coordinator refused this shard: {m['message']}"
        elif t == "stop":
            self.stopping = f"the coordinator stopped: {m['reason']}"
        elif not self.welcomed:
            return
        elif t == "recs":
            self._on_records(m, frames[1:])
        elif t == "params?":
            self.params_asked.append((m["token"], m["lsn"]))
            self._answer_params()
        elif t == "reduce?":
            if len(self.reduce_asked) < 64 or m["token"] in self.reduce_asked:  # the coordinator asks one at a time
                self.reduce_asked[m["token"]] = m
            self._answer_reduces()

    def _on_welcome(self, m: dict) -> None:
        if self.run_id and m["run_id"] != self.run_id:
            self.stopping = f"the coordinator serves run {m['run_id']:x}, this shard's state is of run {self.run_id:x}"
            return
        if self.index >= 0 and m["index"] != self.index:
            self.stopping = f"the coordinator gave slot {m['index']}, this shard's state is of slot {self.index}"
            return
        self.run_id, self.index, self.n_shards = m["run_id"], m["index"], m["shards"]
        self.span = (m["lo"], m["hi"])
        if not self.bound:
            try:
                self._bind_data(self.span)
            except OSError as e:
                self.stopping = str(e)
                return
        if self.state_dir:
            self._save_info()
        self.welcomed = True
        log.info("shard %d of %d: coordinator %s, records from %d", self.index, self.n_shards, self.coordinator,
                 m["from"])
        # Blocks held (e.g. journaled before a crash) are announced again: the coordinator may be waiting for them.
        again = [self._have(j, self.core.ledger[j].created_at) for j in self.blocks
                 if self.core is not None and j in self.core.ledger]
        self.haves.extend((-1, h) for h in again)

    def _on_records(self, m: dict, frames: list) -> None:
        if m["count"] != len(frames):
            log.warning("records message with %d frames for %d records: ignored", len(frames), m["count"])
            return
        lsn = m["first"]
        for f in frames:
            if lsn <= self.applied:
                lsn += 1
                continue
            if lsn != self.applied + 1:
                log.warning("record %d after %d: asking again", lsn, self.applied)
                self.welcomed = False  # shello with our LSN: the coordinator sends from there
                self.next_hello = 0.0
                return
            body = msgpack.unpackb(bytes(f), raw=False, strict_map_key=False)
            if type(body) is not dict or body.get("lsn") != lsn or type(body.get("op")) is not str:
                raise StateError(f"record {lsn} from the coordinator does not read")
            self._apply(Record(lsn, body["op"], body))
            lsn += 1
        self.transport.sweep()
        self._answer_parked()
        self._answer_params()
        self._answer_reduces()

    def _answer_params(self) -> None:
        if not self.params_asked or self.core is None:
            return
        left = []
        for token, lsn in self.params_asked:
            if lsn <= self.applied:
                x = np.ascontiguousarray(self.core.params())
                self._send_ctl(pack("params", token=token, lsn=self.applied, version=self.core.version), (x,))
            else:
                left.append((token, lsn))
        self.params_asked = left

    def _answer_reduces(self) -> None:
        """Answer each ``reduce?`` once the records up to its ``after`` are applied: this shard's
        figures for the step the job's reply would make now (the coordinator lets no other reply
        through meanwhile, so the state is the one the step will see)."""
        if not self.reduce_asked or self.core is None:
            return
        for token, m in list(self.reduce_asked.items()):
            if m["after"] > self.applied:
                continue
            del self.reduce_asked[token]
            entry, grads = self.core.ledger.get(m["job_id"]), self.blocks.get(m["job_id"])
            if entry is None or grads is None or entry.created_at != m["created_at"] or self.step_norms is None:
                log.warning("reduce? for job %d: %s", m["job_id"], "no such job here" if entry is None else
                            "no block held" if grads is None else "not a run that reduces")
                continue  # the coordinator drops the reduction when the job is settled, asks again when we rejoin
            got = step_sq_of(self.core, entry, grads, m["bsq"] or None)
            self._send_ctl(pack("reduce", token=token, job_id=m["job_id"], bsq=list(got or ())))

    # ------------------------------------------------------------------ data
    def _on_data(self, frames: list) -> None:
        now = self.clock()
        got = self.transport.receive_routed(frames, now)
        if got is None:
            return  # a part, a hello, a ready, or answered with an error
        rid, msg, frames = got
        if type(msg) is Fetch:
            self._fetch(rid, msg, now)
        else:
            self._block(rid, msg, frames[1:])

    def _role(self) -> ShardRole:
        """The shard's data path as the transport serves it (ps/net/routed.py)."""
        return ShardRole(answer=lambda rid, msg: self._send_data(rid, msg), welcome=self._welcome,
                         holds=self.blocks.__contains__, core=lambda: self.core, boot=self.boot, logger=log)

    def _welcome(self, shm: str) -> Welcome:
        """What tells a connection that this shard takes and sends parts (PROTOCOL.md §12.1), and
        offers it the shard's shared memory (``shm``, its prefix) or not ("")."""
        if shm:
            return Welcome(server_boot=self.boot, version=PROTOCOL_VERSION, problem=self.core.cfg.problem,
                           run_id=self.run_id, wire_dtype=self.wire, parts=True, shm=shm)
        return Welcome(server_boot=self.boot, version=PROTOCOL_VERSION, problem=self.core.cfg.problem,
                       run_id=self.run_id, wire_dtype=self.wire, parts=True)

    def _fetch(self, rid: bytes, f: Fetch, now: float) -> None:
        core = self.core
        entry = core.ledger.get(f.job_id)
        if entry is None:
            if f.job_id >= core.next_job_id:  # issued by a record not applied here yet
                if len(self.parked) < MAX_PARKED or (rid, f.job_id) in self.parked:
                    self.parked[(rid, f.job_id)] = (now, f)
                return
            self._send_data(rid, Error(ErrorCode.UNKNOWN_JOB, "job id not outstanding", job_id=f.job_id))
            return
        if entry.worker_id != worker_of(rid) or entry.created_at != f.created_at \
                or any(i not in entry.iterate_ids or i not in core.store for i in f.iterate_ids):
            self._send_data(rid, Error(ErrorCode.UNKNOWN_JOB, "not this worker's job, or not its iterates",
                                       job_id=f.job_id))
            return
        self._send_data(rid, self.transport.routed_job(rid, entry, f.iterate_ids))

    def _answer_parked(self) -> None:
        if not self.parked:
            return
        nxt, now = self.core.next_job_id, self.clock()
        for key in [k for k, (_, f) in self.parked.items() if f.job_id < nxt]:
            _, f = self.parked.pop(key)
            self._fetch(key[0], f, now)

    def close(self) -> None:
        try:
            if not self.failed:  # not after a record that could not be applied: its state is the checkpoint's
                self.checkpoint()
        except OSError as e:
            log.error("cannot write a checkpoint in %s: %s", self.state_dir, e)
        if self.journal is not None:
            self.journal.close()
        self.ctl.close(linger=500)
        self.transport.close()  # the data socket; the same-host path's files unlinked
        if self.security is not None:
            self.security.stop()
        if self.own_ctx:
            self.ctx.term()
        if self.lock is not None:
            self.lock.release()
