"""Large messages in parts between a worker and a shard (PROTOCOL.md §6.13, §12.1), over a real
shard data socket and the real worker side (worker/shards.py ``ShardLinks``), with the
threshold and part size patched small so a slice of 10,000 values travels in several parts.

The shard tells a connection it takes parts with a ``welcome`` after the first ``job`` it sends
it; a worker that takes them answers ``hello`` {parts: true}. Then the slices come as parts
and the ``job`` with ``xfer``, and a gradient block goes as parts and the ``reply`` with
``xfer``: the bytes that arrive are the bytes sent (the iterate in the core's store, the block
the shard holds and journals). A worker that never says hello gets every slice in one frame.
Hostile parts at the shard (out of order, from a peer that is no live worker's connection, a
transfer never finished, more than the bounds) are each refused or dropped with one log line,
the memory held by unfinished transfers stays within its bound, and the shard still serves a
good worker afterwards. Every wait is bounded (polls with a deadline); no sleeps."""

from __future__ import annotations

import logging
import os

import msgpack
import numpy as np
import pytest
import zmq

import ps.net.transport as shard_mod
import worker.shards as links_mod
from protocol.chunks import Chunking
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import Error, ErrorCode, Hello, Part, Ready, Reply, Welcome
from ps.core.spec import TrainingSpec
from ps.drivers.server import StateOptions, _new_run
from ps.journal.inputs import CoreInputs
from ps.journal.persistence import Persistence
from ps.journal.segments import read_journal
from ps.sharded.shard import Shard
from tests.unit.shard_links import fetch_whole, pump
from worker.shards import ShardLinks

CORE_KW = {"batch_size": 1, "liveness_timeout": 3.0, "heartbeat_interval": 0.5, "min_workers": 1,
           "round_period": None, "seed": 0}
D = 20_000
THRESHOLD = 4096  # bytes: the slice (10,000 float32 values, 40,000 bytes) is far above it
CHUNK = 8192  # -> 5 parts per slice or block
RID = b"w1/7"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def small_parts(monkeypatch):
    """The threshold and part size every sender and receiver here reads, made small."""
    for mod in (shard_mod, links_mod):  # what the senders read when they are made
        monkeypatch.setattr(mod, "chunking", lambda encrypted: Chunking(THRESHOLD, CHUNK))
    monkeypatch.setattr(shard_mod, "TRANSFER_TOTAL_MIN", 0)  # the total bound: four blocks' worth, no floor


@pytest.fixture
def run(tmp_path, small_parts):
    """A sharded run's coordinator (2 shards of synthetic d=20,000) that issued worker w1 (boot 7)
    two jobs, with workers w2..w6 joined too; shard 1 (values [10,000, 20,000)) fed every record,
    its data socket bound, its blocks journal open, its clock a fake one."""
    spec = TrainingSpec("synthetic", {"d": D, "blocks": 4}, "asgd", {"lr": 0.1})
    (tmp_path / "c").mkdir()
    _run, core, problem, journal = _new_run(StateOptions(str(tmp_path / "c")), spec, 1, "f32", CORE_KW, shards=2)
    inputs = CoreInputs(core, Persistence(str(tmp_path / "c"), journal))
    inputs.message("w1", Hello(worker_id="w1", boot=7, credit=2), 1.0)
    inputs.message("w1", Ready(credit=2), 1.1)
    for k in range(2, 7):
        inputs.message(f"w{k}", Hello(worker_id=f"w{k}", boot=k, credit=1), 1.2)
    journal.sync()
    clock = Clock()
    shard = Shard("tcp://127.0.0.1:9", bind="tcp://127.0.0.1:0", state_dir=str(tmp_path / "s"), clock=clock)
    shard._on_welcome({"index": 1, "shards": 2, "run_id": core.cfg.run_id, "from": 0, "lo": D // 2, "hi": D})
    recs = [msgpack.packb(r.body, use_bin_type=True) for r in read_journal(str(tmp_path / "c"), from_lsn=0)]
    shard._on_records({"first": 0, "count": len(recs)}, recs)
    shard._open_journal()
    assert shard.range == (D // 2, D) and sorted(shard.core.ledger) == [0, 1]
    seen = {"parts_to_shard": 0}
    on_data = shard._on_data

    def counting(frames):  # what the shard's socket actually delivers
        try:
            if type(decode(frames[1:])) is Part:
                seen["parts_to_shard"] += 1
        except RemoteProtocolError:
            pass  # a carrier (its arrays came in parts) or garbage
        on_data(frames)

    shard._on_data = counting
    yield shard, seen, clock
    shard.close()


def hello_seen(shard: Shard, links: ShardLinks) -> None:
    """The worker read the shard's welcome and the shard its hello."""
    def done() -> bool:
        assert links.receive(0) == []
        return RID in shard.parts_peers

    pump(shard, links.socks, done, "the welcome and the worker's hello")


@pytest.fixture
def links_seen(monkeypatch):
    """Parts the worker's shard link actually receives on its socket."""
    seen = {"parts_to_worker": 0, "welcomes": 0}
    recv = links_mod.recv_frames

    def counting(sock, flags=0):
        frames = recv(sock, flags)
        try:
            kind = type(decode(frames))
            seen["parts_to_worker"] += kind is Part
            seen["welcomes"] += kind is Welcome
        except RemoteProtocolError:
            pass
        return frames

    monkeypatch.setattr(links_mod, "recv_frames", counting)
    return seen


def linked(ctx: zmq.Context, shard: Shard, rid: bytes = RID, **kw) -> ShardLinks:
    lo, hi = shard.range
    return ShardLinks(ctx, ((shard.endpoint, lo, hi),), rid, **kw)


def send_block(shard: Shard, links: ShardLinks, jid: int, g: np.ndarray) -> None:
    e = shard.core.ledger[jid]
    lo, hi = shard.range
    full = np.zeros(D, np.float32)
    full[lo:hi] = g
    assert links.send_blocks(Reply(job_id=jid, created_at=e.created_at, grads=(full,), loss=0.5, count=1))
    pump(shard, links.socks, lambda: jid in shard.blocks, f"the block of job {jid}")


def test_slices_and_blocks_travel_in_parts_both_ways_bit_for_bit(run, links_seen):
    shard, seen, _clock = run
    ctx = zmq.Context.instance()
    links = linked(ctx, shard)
    try:
        first = fetch_whole(shard, links, 0)  # one frame: the welcome comes after it, then our hello
        hello_seen(shard, links)
        assert links_seen["welcomes"] == 1 and links.parts_ok == [True] and links_seen["parts_to_worker"] == 0
        job = fetch_whole(shard, links, 1)
        e = shard.core.ledger[1]
        for i, p in zip(e.iterate_ids, job.points, strict=True):
            assert p.dtype == np.float32 and p.tobytes() == shard.core.store[i].tobytes()  # what one frame carries
        for i, p in zip(shard.core.ledger[0].iterate_ids, first.points, strict=True):
            assert p.tobytes() == shard.core.store[i].tobytes()
        assert links_seen["parts_to_worker"] == shard.parts_out == links.parts_in == 5 * len(job.points)

        g = np.random.default_rng(3).standard_normal(D // 2).astype(np.float32)
        send_block(shard, links, 1, g)
        assert seen["parts_to_shard"] == shard.parts_in == links.parts_out == 5
        held, = shard.blocks[1]
        assert held.tobytes() == g.tobytes()
        assert shard.haves and shard.haves[-1][1] == [1, e.created_at, 0, ""]
        assert shard.transfers.xfer_total == 0 and not shard.transfers.xfers
        shard.journal.sync()  # the journal keeps the reassembled block, as one message
        rec, = [r for r in read_journal(os.path.join(shard.state_dir, "blocks")) if r.op == "block"]
        kept = decode(rec.body["frames"])
        assert kept.xfer == 0 and kept.grads[0].tobytes() == g.tobytes()
    finally:
        links.close()


def test_a_worker_that_never_says_hello_gets_one_frame(run, links_seen):
    shard, seen, _clock = run
    links = linked(zmq.Context.instance(), shard, parts=False)
    try:
        fetch_whole(shard, links, 0)
        job = fetch_whole(shard, links, 1)
        assert links_seen["welcomes"] == 1 and links.parts_ok == [False] and RID not in shard.parts_peers
        assert links_seen["parts_to_worker"] == shard.parts_out == 0
        for i, p in zip(shard.core.ledger[1].iterate_ids, job.points, strict=True):
            assert p.tobytes() == shard.core.store[i].tobytes()
        g = np.arange(D // 2, dtype=np.float32)
        send_block(shard, links, 1, g)  # one frame, above the threshold: taken as before
        assert seen["parts_to_shard"] == 0 and shard.blocks[1][0].tobytes() == g.tobytes()
    finally:
        links.close()


class Peer:
    """A raw DEALER on the shard's data socket; what the shard answers it is seen where the shard
    sends it (``answered``, filled by :func:`recording`), so "no answer" is not a race."""

    def __init__(self, shard: Shard, rid: bytes, answered: list) -> None:
        self.shard, self.rid, self.answered = shard, rid, answered
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.routing_id = rid
        self.sock.connect(shard.endpoint)
        self.read = self.markers = 0

    def send(self, msg) -> None:
        self.sock.send_multipart(encode(msg))

    def new(self) -> list:
        mine = [m for r, m in self.answered if r == self.rid]
        out, self.read = mine[self.read:], len(mine)
        return out

    def handled(self) -> list:
        """Everything sent so far has been handled: what the shard answered meanwhile."""
        self.markers += 1  # a reply of no job: handled, never answered; after all we sent (one connection)
        marker = encode(Reply(job_id=10**9 + self.markers, created_at=0, grads=(), loss=0.0, count=1))[0]
        self.sock.send(marker)
        count = {"n": 0}
        on_data = self.shard._on_data

        def spy(frames):
            on_data(frames)
            count["n"] += frames[0].bytes == self.rid and frames[1].bytes == marker
        self.shard._on_data = spy
        try:
            pump(self.shard, [self.sock], lambda: count["n"] > 0, "the shard to handle the marker")
        finally:
            self.shard._on_data = on_data
        return self.new()

    def quiet(self) -> None:
        assert self.handled() == [], "the shard answered"

    def answer(self) -> object:
        """The shard's one answer to what was sent."""
        a, = self.handled()
        return a

    def close(self) -> None:
        self.sock.close(linger=0)


def recording(shard: Shard) -> list:
    """(routing id, message) of everything the shard sends on its data socket (sent as well)."""
    answered: list = []
    send = shard._send_data

    def spy(rid, msg):
        answered.append((rid, msg))
        send(rid, msg)
    shard._send_data = spy
    return answered


def part(xfer: int, index: int, count: int, n: int = CHUNK, fill: int = 1) -> Part:
    return Part(xfer=xfer, index=index, count=count, data=np.full(n, fill, np.uint8))


def lines(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.name == "latecomer.shard")


def test_hostile_parts_are_refused_bounded_and_the_shard_still_serves(run, caplog, links_seen):
    shard, _seen, clock = run
    caplog.set_level(logging.WARNING, logger="latecomer.shard")
    t = shard.transfers
    lim = t.limits
    block_bytes = 2 * (D // 2) * 8  # one transfer: two float64 blocks of the slice
    bound = 4 * block_bytes  # all of them: four transfers' worth (the 64 MiB floor patched away)
    assert lim.transfer_bytes == block_bytes and lim.transfer_total_bytes == bound
    # Live workers w2..w6 (their hellos are in the records) as raw peers; w1 stays the good worker.
    answered = recording(shard)
    peers = {k: Peer(shard, f"w{k}/{k:x}".encode(), answered) for k in range(2, 7)}
    strangers = [Peer(shard, b"w9/1", answered), Peer(shard, b"w1/8", answered)]  # no such worker; w1, another boot
    try:
        # Out of order: refused, the transfer dropped, one line.
        w1 = peers[2]
        w1.send(part(1, 0, 3))
        w1.quiet()
        assert t.xfer_total == CHUNK
        w1.send(part(1, 2, 3))
        a = w1.answer()
        assert type(a) is Error and a.code == ErrorCode.MALFORMED and "out of order" in a.message
        assert t.xfer_total == 0 and lines(caplog, "out of order") == 1

        # From a connection that is not a live worker's: refused, nothing kept, one line.
        for s in strangers:
            s.send(part(1, 0, 2))
            a = s.answer()
            assert type(a) is Error and a.code == ErrorCode.MALFORMED and "live worker" in a.message
        assert t.xfer_total == 0 and len(t) == 1  # the only record is w2's (no transfer)
        assert lines(caplog, "not a live worker") == 1  # the second within 10 s: counted, not logged

        # Never finished: dropped 10 s after its last part; its message then fails, one line each.
        w1.send(part(2, 0, 3))
        w1.send(part(2, 1, 3))
        w1.quiet()
        assert t.xfer_total == 2 * CHUNK
        clock.t += shard_mod.TRANSFER_TIMEOUT_S + 0.1
        shard._timers()
        assert t.xfer_total == 0 and lines(caplog, "unfinished transfers") == 1
        e = shard.core.ledger[0]
        carrier = Reply(job_id=0, created_at=e.created_at, grads=(np.zeros(D // 2, np.float32),), loss=0.0,
                        count=1, xfer=2)
        w1.sock.send_multipart(encode(carrier)[:1])
        a = w1.answer()
        assert type(a) is Error and a.code == ErrorCode.MALFORMED and "transfer 2" in a.message
        assert lines(caplog, "refused a message in parts") == 1 and shard.blocks == {} and shard.haves == []

        # One transfer past its bound (two float64 blocks): refused at the part that passes it.
        big = lim.transfer_bytes // 4 + 1
        for i in range(3):
            w1.send(part(3, i, 64, big))
        w1.quiet()
        w1.send(part(3, 3, 64, big))
        a = w1.answer()
        assert type(a) is Error and a.code == ErrorCode.MALFORMED and "larger than" in a.message
        assert t.xfer_total == 0 and lines(caplog, "larger than") == 1

        # A flood from five live workers, each of nearly a whole transfer: the total stays within
        # four transfers' worth, the least recently fed go first.
        n = lim.transfer_bytes // 4 - 8
        refused = 0
        for i in range(4):
            for p in peers.values():
                p.send(part(4, i, 5, n))
                for a in p.handled():  # the next part of a transfer evicted meanwhile: refused as such
                    assert type(a) is Error and a.code == ErrorCode.MALFORMED and "out of order" in a.message
                    refused += 1
                held = sum(c.xfer_bytes for c in t.by_rid.values())
                assert held == t.xfer_total <= bound
        assert t.xfer_total > bound - block_bytes  # the bound was reached, and held
        assert t.counters.transfers_dropped >= 2 and refused >= 1 and lines(caplog, "evicted") == 1

        # The good worker is still served, in parts both ways.
        links = linked(zmq.Context.instance(), shard)
        try:
            fetch_whole(shard, links, 0)
            hello_seen(shard, links)
            job = fetch_whole(shard, links, 1)
            assert links_seen["parts_to_worker"] == 5 * len(job.points)
            g = np.linspace(-1, 1, D // 2, dtype=np.float32)
            send_block(shard, links, 1, g)
            assert shard.blocks[1][0].tobytes() == g.tobytes() and shard.haves[-1][1][2] == 0
        finally:
            links.close()
    finally:
        for p in [*peers.values(), *strangers]:
            p.close()
