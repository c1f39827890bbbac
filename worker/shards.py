"""A worker's links to the shards of a sharded server (PROTOCOL.md §12).

The coordinator's ``job`` carries headers only. For each job the worker asks every shard
``fetch`` {job, the iterate ids it does not cache} (always, even for none: the answer also says
the shard knows the job, so its gradient block will be taken), and gets back a ``job`` whose
points are that shard's slices; the slices concatenated in shard order are the iterates. Its
reply goes as gradient slices to each shard, then as a header (empty gradients) to the
coordinator, which counts it once every shard has the block.

A fetch is asked again only on evidence that the shard lost it (a shard that restarted, a
connection that dropped): the shard answered a fetch asked after it (a shard answers a worker's
fetches in the order their jobs were issued, which is the order the worker asks them), or the
shard has sent this worker nothing for a while since it was asked: four times the longest a
shard took to answer one so far, at least ``REFETCH_MIN_S`` (before any answer,
``REFETCH_FIRST_S``). A shard busy sending earlier slices over a slow link is never asked
again, so it never sends the same slices twice. A shard that answers UNKNOWN_JOB ends the job
here (it was settled: written off, cancelled). An answer that is not what was asked (other ids,
or slices that are not ``hi - lo`` values in the frame dtype of the run's wire dtype) is dropped,
with one line for a bad slice, and the fetch stays open (PROTOCOL.md §10).

Large messages in parts (PROTOCOL.md §6.13, §12.1): a shard sends ``welcome`` {parts: true}
after the first ``job`` it sends a connection (and again after it restarted); the worker
answers ``hello`` {parts: true}. From then on a gradient block above ``CHUNK_THRESHOLD`` goes to
that shard as ``part`` messages and the ``reply`` with ``xfer``, and the shard sends a slice
above the threshold the same way, reassembled here per shard connection with the bounds of the
worker's link to the server (one transfer at a time, at most two arrays of
``DEFAULT_MAX_ARRAY_BYTES``). Without that welcome (a shard of an older release) every block
travels in one frame, as every slice does to a worker that never says hello to a shard.

The same-host path (PROTOCOL.md §6.11, §12.1) per shard: a worker that may use shared memory
says ``shm`` and its ``host_id`` in that hello; a shard on its host answers with a second
``welcome`` naming its shared memory (``shm``: the prefix of its files), the worker opens its
probe file and answers ``ready`` {shm: true} (false: it cannot, and stays on TCP). From then on
the shard answers a fetch with ``refs`` (the slot of each of the job's iterates: its slice, as
float32 values of the run's wire dtype) and ``grad_slots`` lent for the job's block; the worker
copies the slices it needs out of the slots, writes its gradient slice into the lent slots (once
per job: a reply sent again is never written again) and sends the block as ``reply``
{in_shm: true} without frames. A block whose slots belong to a shard process or a handshake that
is gone travels as frames. Every later welcome without ``shm`` starts over.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from protocol.chunks import Reassembler, chunking
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import (
    DEFAULT_MAX_ARRAY_BYTES,
    Error,
    ErrorCode,
    Fetch,
    Hello,
    Job,
    JobKind,
    Part,
    Ready,
    Reply,
    Welcome,
)
from protocol.shm import ShmReader, host_id
from protocol.wire import WIRE_NUMPY, from_wire, to_wire
from worker.sockio import recv_frames, send_frames

log = logging.getLogger("latecomer.worker")

REFETCH_MIN_S = 2.0  # a fetch is asked again no sooner than this ...
REFETCH_FIRST_S = 10.0  # ... and, before any shard has answered one, this
MAX_SHM_JOBS = 1024  # jobs whose lent gradient slots are remembered (a reply sent again after that: frames)
_NOBLOCK = zmq.NOBLOCK


@dataclass
class Assembly:
    job: Job
    need: tuple[int, ...]
    pieces: dict[int, Job] = field(default_factory=dict)  # shard index -> its answer
    asked_at: float = 0.0
    first_asked: float = 0.0
    seq: int = 0  # the order it was (last) asked in
    shm: set = field(default_factory=set)  # shards whose pieces are views of their shared memory


class ShardLinks:
    """DEALER sockets to every shard's data endpoint and the jobs being assembled from them."""

    def __init__(self, ctx: zmq.Context, shards: tuple, routing_id: bytes,
                 curve: tuple[bytes, bytes, bytes] | None = None, *, parts: bool = True, shm: bool = False,
                 wire: str = "f32") -> None:
        """``curve``: (public, secret, server public) when the server runs CurveZMQ: every shard is
        a CURVE server under the server's key pair, so the worker connects to each as to it.
        ``routing_id``: ``<worker id>/<boot in hex>``, as on the link to the coordinator.
        ``parts``: answer a shard's welcome with a hello, taking and sending large arrays in parts
        (False: every slice and block in one frame, as a worker that never says hello to a shard).
        ``shm``: ask each shard for the same-host path in that hello (with ``parts`` only).
        ``wire``: the run's wire dtype (Welcome.wire_dtype)."""
        self.map = tuple(shards)
        self.ranges = tuple((lo, hi) for _, lo, hi in shards)
        self.socks: list[zmq.Socket] = []
        for ep, _, _ in shards:
            s = ctx.socket(zmq.DEALER)
            s.linger = 500
            s.routing_id = routing_id
            s.sndhwm = s.rcvhwm = 1000
            s.setsockopt(zmq.TCP_KEEPALIVE, 1)
            s.ipv6 = ep.startswith("tcp://[")
            if curve is not None:
                s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
            s.connect(ep)
            self.socks.append(s)
        self.assembling: dict[int, Assembly] = {}
        self.slowest = 0.0  # the longest a shard took to answer a fetch (s)
        self.heard = [0.0] * len(self.socks)  # when each shard last sent us anything
        self.answered = [0] * len(self.socks)  # the latest ``seq`` each shard answered
        self.seq = 0
        self.clock = time.monotonic
        n = len(self.socks)
        self.parts_ok = [False] * n  # shard i takes parts: its welcome said so
        self.parts = [Reassembler(2 * DEFAULT_MAX_ARRAY_BYTES) for _ in range(n)]  # its transfer to us
        self.next_xfer = 0
        self.chunking = chunking(curve is not None)  # how the blocks it sends in parts are split
        self.parts_in = self.parts_out = 0
        self.hello: list | None = None  # what we answer a shard's welcome (None: we never use parts)
        if parts:
            wid, _, boot = routing_id.decode("ascii").rpartition("/")
            self.hello = encode(Hello(worker_id=wid, boot=int(boot, 16), credit=1, parts=True, shm=shm,
                                      host_id=host_id() if shm else ""))
        self.wire = wire
        self.shm: list[ShmReader | None] = [None] * n  # shard i's shared memory, once we said ready to it
        # job id -> {shard index: [the reader its slots belong to, grad_slots, written]}
        self.shm_jobs: OrderedDict[int, dict[int, list]] = OrderedDict()
        self.shm_in = self.shm_out = 0  # pieces read from, blocks written to, shared memory

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.socks = []

    def fetch(self, job: Job, need: tuple[int, ...], now: float) -> None:
        a = self.assembling[job.job_id] = Assembly(job, need, asked_at=now, first_asked=now)
        self._ask(a, range(len(self.socks)))

    def _ask(self, a: Assembly, shards: Any) -> None:
        self.seq += 1
        a.seq = self.seq
        frames = encode(Fetch(job_id=a.job.job_id, created_at=a.job.created_at, iterate_ids=a.need))
        for i in shards:
            try:
                send_frames(self.socks[i], frames, _NOBLOCK)
            except zmq.Again:
                pass  # asked again (refetch)

    def refetch_after(self) -> float:
        return max(REFETCH_MIN_S, 4 * self.slowest) if self.slowest else REFETCH_FIRST_S

    def lost_at(self, a: Assembly, now: float, wait: float) -> list[int]:
        """The shards that have evidently lost fetch ``a``: each answered a later fetch, or has
        been silent to us for ``wait`` since ``a`` was asked."""
        return [i for i in range(len(self.socks)) if i not in a.pieces
                and (self.answered[i] > a.seq or now - max(a.asked_at, self.heard[i]) >= wait)]

    def refetch(self, now: float) -> None:
        wait = self.refetch_after()
        for a in self.assembling.values():
            lost = self.lost_at(a, now, wait)
            if lost:
                a.asked_at = now
                self._ask(a, lost)

    def cancel(self, ids: set[int]) -> None:
        for j in ids:
            self.assembling.pop(j, None)

    def receive(self, i: int) -> list[tuple[str, Any]]:
        """Messages waiting on shard ``i``: ("job", Job with the whole iterates of its ``need``) for
        each job now complete, ("gone", job id) for a job a shard does not know, ("resend", job id)
        for a block sent through slots the shard says it did not lend (a shard process restarted
        on the same endpoint: its block goes to shard ``i`` again, as frames, :meth:`send_block`)."""
        out = []
        sock = self.socks[i]
        for _ in range(64):
            try:
                frames = recv_frames(sock, _NOBLOCK)
            except zmq.Again:
                break
            now = self.clock()
            self.heard[i] = now
            try:
                msg = decode(frames, payload=self.parts[i].take)
                if type(msg) is Part:
                    self.parts[i].add(msg)
                    self.parts_in += 1
                    continue
            except RemoteProtocolError as e:
                log.warning("undecodable message from shard %d: %s", i, e)
                continue
            if type(msg) is Welcome and msg.shm:  # the answer to our hello: the shard's shared memory
                self._open_shm(i, msg)
            elif type(msg) is Welcome:  # the shard's transport (after its first job to us)
                self.shm[i] = None  # the same-host path starts over
                self.parts_ok[i] = msg.parts and self.hello is not None
                if self.parts_ok[i]:
                    try:
                        send_frames(sock, self.hello, _NOBLOCK)
                    except zmq.Again:
                        self.parts_ok[i] = False  # the shard does not know we take parts: none either way
            elif type(msg) is Job:
                a = self.assembling.get(msg.job_id)
                if a is None:
                    continue
                if msg.refs or msg.grad_slots:
                    msg = self._shm_piece(i, a, msg)
                    if msg is None:
                        continue
                elif msg.point_ids != a.need or not self._fits(i, msg):
                    continue  # not the answer to what we asked: the fetch stays open (asked again)
                a.pieces[i] = msg
                self.answered[i] = max(self.answered[i], a.seq)
                self.slowest = max(self.slowest, now - a.asked_at)
                if len(a.pieces) == len(self.socks):
                    del self.assembling[msg.job_id]
                    out.append(("job", self._whole(a)))
            elif type(msg) is Error:
                if msg.code == ErrorCode.UNKNOWN_JOB and msg.job_id in self.assembling:
                    del self.assembling[msg.job_id]
                    out.append(("gone", msg.job_id))
                elif msg.code == ErrorCode.UNKNOWN_JOB and self.shm_jobs.get(msg.job_id, {}).pop(i, None):
                    log.info("shard %d: job %d's block refused from shared memory: sent again as frames", i, msg.job_id)
                    out.append(("resend", msg.job_id))
                else:
                    log.info("shard %d: %s %s (job %s)", i, msg.code.name, msg.message, msg.job_id)
        return out

    def _fits(self, i: int, msg: Job) -> bool:
        """Whether shard ``i``'s slices are what a piece must be: ``hi - lo`` values each, in the
        frame dtype of the run's wire dtype. One that is not is dropped with one line (it would
        fail the job here after it was taken: a job never computed, held in busy for ever)."""
        lo, hi = self.ranges[i]
        want = WIRE_NUMPY.get(self.wire)
        bad = next((p for p in msg.points if p.shape != (hi - lo,) or p.dtype != want), None)
        if bad is None:
            return True
        log.warning("shard %d: job %d's slice of shape %s and dtype %s, expected (%d,) of %s: dropped", i,
                    msg.job_id, bad.shape, bad.dtype.str, hi - lo, want.str if want is not None else self.wire)
        return False

    def _open_shm(self, i: int, w: Welcome) -> None:
        """Shard ``i`` offers its shared memory: probe it, and say whether we take it (ready)."""
        if self.hello is None:
            return  # we never said hello: an offer we did not ask for
        why = None
        try:
            reader = ShmReader(w.shm)
            why = reader.probe(w.server_boot)
        except ValueError as e:
            why = str(e)
        self.shm[i] = reader if why is None else None
        if why is None:
            log.info("shard %d: same-host path through shared memory %s", i, w.shm)
        else:
            log.warning("shard %d: same-host path unavailable (%s): using TCP", i, why)
        try:
            send_frames(self.socks[i], encode(Ready(credit=1, shm=why is None)), _NOBLOCK)
        except zmq.Again:
            self.shm[i] = None  # the shard does not know we opened it: it answers over TCP

    def _shm_piece(self, i: int, a: Assembly, msg: Job) -> Job | None:
        """Shard ``i``'s answer over the same-host path as a piece: views of its slots for the
        iterates we need (in the wire dtype, as a TCP piece), its gradient slots remembered for the
        block. None: not usable (we hold no shared memory of that shard, or the slots do not fit)."""
        reader, j = self.shm[i], a.job
        lo, hi = self.ranges[i]
        want = 1 if j.kind == JobKind.FULL_GRAD else len(j.iterate_ids)
        if reader is None or msg.point_ids or msg.iterate_ids != j.iterate_ids \
                or len(msg.refs) != len(j.iterate_ids) or len(msg.grad_slots) != want:
            log.info("shard %d: a shared-memory answer for job %d that does not fit: ignored", i, j.job_id)
            return None
        try:
            views = {iid: reader.view(s) for iid, s in zip(j.iterate_ids, msg.refs, strict=True)}
            sizes = [reader.view(s).size for s in msg.grad_slots]
        except (OSError, ValueError) as e:
            log.warning("shard %d: shared memory for job %d: %s", i, j.job_id, e)
            return None
        if any(v.size != hi - lo for v in views.values()) or any(n != hi - lo for n in sizes):
            log.warning("shard %d: shared-memory slots of job %d are not of %d values", i, j.job_id, hi - lo)
            return None
        points = tuple(views[iid] if self.wire == "f32" else to_wire(views[iid], self.wire) for iid in a.need)
        self.shm_jobs.setdefault(j.job_id, {})[i] = [reader, msg.grad_slots, False]
        self.shm_jobs.move_to_end(j.job_id)
        while len(self.shm_jobs) > MAX_SHM_JOBS:
            self.shm_jobs.popitem(last=False)
        if self.wire == "f32":
            a.shm.add(i)
        self.shm_in += 1
        return Job(job_id=j.job_id, kind=j.kind, created_at=j.created_at, iterate_ids=j.iterate_ids, seed=j.seed,
                   point_ids=a.need, points=points)

    def _whole(self, a: Assembly) -> Job:
        pieces = [a.pieces[i] for i in range(len(self.socks))]
        points = []
        for k in range(len(a.need)):
            parts = [p.points[k] for p in pieces]
            for (lo, hi), part in zip(self.ranges, parts, strict=True):
                if part.shape != (hi - lo,):
                    raise ValueError(f"shard slice of shape {part.shape}, expected ({hi - lo},)")
            # one piece that is a view of a shard's slot: copied (the slot is the shard's to reuse)
            points.append(np.concatenate(parts) if len(parts) > 1 else parts[0].copy() if a.shm else parts[0])
        j = a.job
        return Job(job_id=j.job_id, kind=j.kind, created_at=j.created_at, iterate_ids=j.iterate_ids, seed=j.seed,
                   batch_size=j.batch_size, shard=j.shard, deadline=j.deadline, point_ids=a.need,
                   points=tuple(points))

    def send_blocks(self, r: Reply) -> bool:
        """The reply's gradient slices to every shard. False: a shard's pipe refused it (retried;
        a shard takes a block it has once)."""
        return all(self.send_block(i, r) for i in range(len(self.socks)))

    def send_block(self, i: int, r: Reply) -> bool:
        """The reply's gradient slice to shard ``i``: through the slots it lent for the job, else
        as frames (in parts when large). False: its pipe refused it."""
        (lo, hi), sock = self.ranges[i], self.socks[i]
        if self._in_shm(r, i, lo, hi):
            try:
                send_frames(sock, encode(Reply(job_id=r.job_id, created_at=r.created_at, grads=(), loss=r.loss,
                                               count=r.count, compute_s=r.compute_s, holds=r.holds,
                                               in_shm=True)), _NOBLOCK)
            except zmq.Again:
                return False
            return True
        block = Reply(job_id=r.job_id, created_at=r.created_at, grads=tuple(g[lo:hi] for g in r.grads),
                      loss=r.loss, count=r.count, compute_s=r.compute_s, holds=r.holds)
        if self.parts_ok[i] and sum(g.nbytes for g in block.grads) > self.chunking.threshold:
            self.next_xfer += 1  # large: parts, then the block with xfer (a new transfer drops one cut short)
            messages = self.chunking.split(block, self.next_xfer)
            self.parts_out += len(messages) - 1
        else:
            messages = [encode(block)]
        try:
            for frames in messages:
                send_frames(sock, frames, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _in_shm(self, r: Reply, i: int, lo: int, hi: int) -> bool:
        """Whether shard ``i`` gets the block of ``r`` through the slots it lent for the job: they
        are of the shared memory we hold of it now, and the gradient slices are written there (once
        per job: a reply sent again must not write a slot lent since to another job of ours)."""
        held = self.shm_jobs.get(r.job_id, {}).get(i)
        if held is None or held[0] is not self.shm[i] or len(held[1]) != len(r.grads):
            return False
        if not held[2]:
            try:
                for g, slot in zip(r.grads, held[1], strict=True):
                    from_wire(g[lo:hi], self.wire, out=held[0].view(slot, writable=True)[:hi - lo])
            except (OSError, ValueError) as e:  # e.g. a gradient not in the wire dtype: frames, checked there
                log.warning("shard %d: job %d's block cannot go through shared memory (%s): frames", i, r.job_id, e)
                del self.shm_jobs[r.job_id][i]
                return False
            held[2] = True
            self.shm_out += 1
        return True


def header_only(r: Reply) -> Reply:
    """What the coordinator gets: the reply with empty gradients (its iterate is empty)."""
    return Reply(job_id=r.job_id, created_at=r.created_at, grads=tuple(np.empty(0, g.dtype) for g in r.grads),
                 loss=r.loss, count=r.count, compute_s=r.compute_s, holds=r.holds)
