"""The same-host path between a worker and a shard (PROTOCOL.md §6.11, §12.1), over a real shard
data socket and the real worker side (worker/shards.py ``ShardLinks``), its files in /dev/shm.

Handshake: the shard's first ``job`` to a connection travels over TCP, followed by its
``welcome`` {parts}; the worker answers ``hello`` {parts, shm, host_id}; a shard on its host
answers with a ``welcome`` {shm: its prefix}; the worker probes the shard's probe file and says
``ready`` {shm: true}. Then a fetch is answered with ``refs`` and ``grad_slots`` and no array
frame, and the block goes back as ``reply`` {in_shm: true} without frames: what the shard's
socket and the worker's sockets actually carry is counted. The values are those of the TCP path
bit for bit (the iterate slices as the worker sees them, the block the shard holds and the
frames it journals), in f32 and in bf16. Hostile or stale ``in_shm`` replies are refused and
change nothing; a hello again never gets the old slots; lent slots come back when the job is
settled, and the files go with the shard. Every wait is bounded (polls with a deadline)."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import zmq

import worker.shards as links_mod
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import Error, ErrorCode, Hello, Job, Ready, Reply, Welcome
from protocol.shm import SHM_DIR, host_id, shm_dir_usable
from protocol.wire import roundtrip, to_wire
from ps.core.spec import TrainingSpec
from ps.drivers.server import StateOptions, _new_run
from ps.journal.inputs import CoreInputs
from ps.journal.persistence import Persistence
from ps.journal.segments import read_journal
from ps.sharded.shard import Shard
from tests.unit.shard_links import WAIT_S, fetch_whole, pump
from worker.shards import ShardLinks

pytestmark = pytest.mark.skipif(not shm_dir_usable(), reason="no usable /dev/shm")

CORE_KW = {"batch_size": 1, "liveness_timeout": 3.0, "heartbeat_interval": 0.5, "min_workers": 1,
           "round_period": None, "seed": 0}
D = 20_000
HALF = D // 2
RID = b"w1/7"


class Run:
    """A sharded run's coordinator (2 shards of synthetic d=20,000) that issued worker w1 (boot 7)
    two jobs, with w2 joined too; shard 1 (values [10,000, 20,000)) fed every record, its data
    socket bound, its blocks journal open."""

    def __init__(self, tmp_path, wire: str, shm: str = "auto") -> None:
        spec = TrainingSpec("synthetic", {"d": D, "blocks": 4}, "asgd", {"lr": 0.1})
        (tmp_path / "c").mkdir()
        self.cdir = str(tmp_path / "c")
        _run, self.core, _problem, self.journal = _new_run(StateOptions(self.cdir), spec, 1, wire, CORE_KW, shards=2)
        self.inputs = CoreInputs(self.core, Persistence(self.cdir, self.journal))
        self.inputs.message("w1", Hello(worker_id="w1", boot=7, credit=2), 1.0)
        self.inputs.message("w1", Ready(credit=2), 1.1)
        self.inputs.message("w2", Hello(worker_id="w2", boot=2, credit=1), 1.2)
        self.shard = Shard("tcp://127.0.0.1:9", bind="tcp://127.0.0.1:0", state_dir=str(tmp_path / "s"), shm=shm)
        self.shard._on_welcome({"index": 1, "shards": 2, "run_id": self.core.cfg.run_id, "from": 0, "lo": HALF,
                                "hi": D})
        self.feed()
        self.shard._open_journal()
        assert self.shard.range == (HALF, D) and sorted(self.shard.core.ledger) == [0, 1]
        self.frames_in: list[list[int]] = []  # per message the shard's socket delivered: its frames' sizes
        on_data = self.shard._on_data

        def counting(frames):
            self.frames_in.append([len(f.bytes) for f in frames[1:]])
            on_data(frames)
        self.shard._on_data = counting
        self.sent: list = []  # (rid, message) of everything the shard sends through _send_data
        send = self.shard._send_data

        def spy(rid, msg):
            self.sent.append((rid, msg))
            send(rid, msg)
        self.shard._send_data = spy

    def feed(self) -> None:
        """The coordinator's records the shard has not applied, as its control channel ships them."""
        self.journal.sync()
        recs = [msgpack.packb(r.body, use_bin_type=True)
                for r in read_journal(self.cdir, from_lsn=self.shard.applied + 1)]
        self.shard._on_records({"first": self.shard.applied + 1, "count": len(recs)}, recs)

    def settle(self, jid: int, t: float) -> None:
        """The coordinator takes job ``jid``'s reply header (as its hub does once every block is in)."""
        e = self.core.ledger[jid]
        self.inputs.message("w1", Reply(job_id=jid, created_at=e.created_at, grads=(np.empty(0, np.float32),),
                                        loss=0.5, count=1), t)
        self.feed()
        assert jid not in self.shard.core.ledger

    def close(self) -> None:
        self.shard.close()


@pytest.fixture(params=["f32", "bf16"])
def run(tmp_path, request):
    r = Run(tmp_path, request.param)
    yield r
    r.close()


@pytest.fixture
def worker_seen(monkeypatch):
    """What the worker's shard links actually receive: per message its type, whether it names
    slots, and the sizes of its frames."""
    seen: list = []
    recv = links_mod.recv_frames

    def counting(sock, flags=0):
        frames = recv(sock, flags)
        try:
            msg = decode(frames)
            seen.append((type(msg), bool(getattr(msg, "refs", ())), [len(bytes(f)) for f in frames]))
        except RemoteProtocolError:
            pass
        return frames

    monkeypatch.setattr(links_mod, "recv_frames", counting)
    return seen


def linked(r: Run, rid: bytes = RID, wire: str | None = None, **kw) -> ShardLinks:
    lo, hi = r.shard.range
    return ShardLinks(zmq.Context.instance(), ((r.shard.endpoint, lo, hi),), rid,
                      wire=wire or r.shard.wire, **kw)


def handshake(r: Run, links: ShardLinks) -> None:
    """The first job over TCP, then welcome, hello {shm}, welcome {shm}, ready {shm}."""
    fetch_whole(r.shard, links, 0)

    def done() -> bool:
        assert links.receive(0) == []
        return RID in r.shard.shm_ready

    pump(r.shard, links.socks, done, "the shared-memory handshake")
    assert links.shm[0] is not None and links.shm[0].prefix == r.shard.arena.prefix


@pytest.fixture
def shm_links(run):
    """The real ShardLinks of a worker on the shard's host, past the shared-memory handshake (a test
    that counts what the worker receives asks for ``worker_seen`` before this)."""
    links = linked(run, shm=True)
    try:
        handshake(run, links)
        yield links
    finally:
        links.close()


def block(r: Run, jid: int, seed: int) -> tuple[Reply, np.ndarray]:
    """A reply of job ``jid`` as the worker's compute side hands it over (gradients in the wire
    dtype), and the float32 values of this shard's slice as they travel."""
    g = np.random.default_rng(seed).standard_normal(D).astype(np.float32)
    e = r.shard.core.ledger[jid]
    wire = r.shard.wire
    return Reply(job_id=jid, created_at=e.created_at, grads=(to_wire(g, wire),), loss=0.5, count=1), \
        roundtrip(g, wire)[HALF:]


def send_block(r: Run, links: ShardLinks, reply: Reply) -> None:
    assert links.send_blocks(reply)
    pump(r.shard, links.socks, lambda: reply.job_id in r.shard.blocks, f"the block of job {reply.job_id}")


def journaled_block(r: Run, jid: int) -> Reply:
    r.shard.journal.sync()
    rec, = [x for x in read_journal(os.path.join(r.shard.state_dir, "blocks"))
            if x.op == "block" and x.body["job_id"] == jid]
    assert rec.body["wire"] == r.shard.wire
    return decode(rec.body["frames"])


def test_slices_and_blocks_go_through_the_shards_shared_memory_bit_for_bit(run, worker_seen, shm_links):
    r = run
    shard = r.shard
    links = shm_links
    kinds = [(k, refs) for k, refs, _ in worker_seen]
    assert kinds == [(Job, False), (Welcome, False), (Welcome, False)], kinds  # job 0 over TCP, both welcomes
    assert shard.shm_jobs_out == 0 and shard.arena.files() == [f"{shard.arena.prefix}-probe"]
    before_w, before_s = len(worker_seen), len(r.frames_in)

    job = fetch_whole(shard, links, 1)  # over shared memory
    e = shard.core.ledger[1]
    for i, p in zip(e.iterate_ids, job.points, strict=True):  # what the TCP path gives, bit for bit
        assert p.tobytes() == to_wire(shard.core.store[i], shard.wire).tobytes()
    reply, g = block(r, 1, 3)
    send_block(r, links, reply)
    held, = shard.blocks[1]
    assert held.dtype == np.float32 and held.tobytes() == g.tobytes()
    assert shard.haves[-1][1] == [1, e.created_at, 0, ""]

    # What travelled: one header each way, no array frame.
    got = worker_seen[before_w:]
    assert [(k, refs) for k, refs, _ in got] == [(Job, True)] and len(got[0][2]) == 1, got
    assert r.frames_in[before_s:] == [[n] for n, in r.frames_in[before_s:]] and len(r.frames_in) - before_s == 2
    assert sum(n for m in r.frames_in[before_s:] for n in m) < 1000  # the fetch and the reply: headers only
    assert shard.shm_jobs_out == 1 and shard.shm_blocks_in == 1 and links.shm_in == 1 and links.shm_out == 1

    # The journal keeps the block as the frames a TCP worker sends: recovery and replay unchanged.
    kept = journaled_block(r, 1)
    assert not kept.in_shm and kept.grads[0].tobytes() == to_wire(g, shard.wire).tobytes()

    # The same job asked again once the shard no longer takes this connection's shared memory:
    # over TCP, the same bytes.
    shard.shm_ready.pop(RID)
    again = fetch_whole(shard, links, 1)
    assert worker_seen[-1][1] is False and len(worker_seen[-1][2]) == 1 + len(again.points)
    for a, b in zip(job.points, again.points, strict=True):
        assert a.tobytes() == b.tobytes()


def test_lent_slots_come_back_when_the_job_is_settled_and_go_with_the_shard(run, shm_links):
    r = run
    shard = r.shard
    links = shm_links
    fetch_whole(shard, links, 1)
    arena = shard.arena
    lent = arena.lent[1][1]
    files = arena.files()
    assert len(files) == 1 + 1 + len(lent)  # the probe, job 1's iterate slice, its gradient slot
    send_block(r, links, block(r, 1, 4)[0])
    r.settle(1, 2.0)  # applied: the coordinator issued job 2 to w1
    assert 1 not in arena.lent and arena.free_grad["w1/7"] == list(lent)
    fetch_whole(shard, links, 2)
    assert arena.lent[2][1] == lent  # the same worker's next job reuses the slot: no new file for it
    assert len(arena.files()) <= len(files) + 1  # at most the new iterate's slice
    reply, g = block(r, 2, 5)
    send_block(r, links, reply)
    assert shard.blocks[2][0].tobytes() == g.tobytes()
    r.settle(2, 3.0)
    prefix = arena.prefix
    r.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-")]  # the shard unlinked its files
    r.close = lambda: None


def test_in_shm_replies_of_slots_not_lent_are_refused_and_change_nothing(run, shm_links):
    r = run
    shard = r.shard
    links = shm_links
    e0, e1 = shard.core.ledger[0], shard.core.ledger[1]
    refused = []

    def refuse(rid: bytes, reply: Reply, code: ErrorCode) -> None:
        n, sent = len(r.frames_in), len(r.sent)
        own = rid == RID  # the worker's own connection (a ROUTER takes one connection per routing id)
        sock = links.socks[0] if own else zmq.Context.instance().socket(zmq.DEALER)
        if not own:
            sock.linger = 0
            sock.routing_id = rid
            sock.connect(shard.endpoint)
        try:
            sock.send_multipart(encode(reply))
            pump(shard, [sock], lambda: len(r.frames_in) > n, "the shard to take the reply")
        finally:
            if not own:
                sock.close()
        (to, err), = r.sent[sent:]
        assert to == rid and type(err) is Error and err.code == code and err.job_id == reply.job_id, err
        refused.append(reply.job_id)

    # Job 0 went over TCP: no slots lent for it.
    refuse(RID, Reply(job_id=0, created_at=e0.created_at, grads=(), loss=0.5, count=1, in_shm=True),
           ErrorCode.UNKNOWN_JOB)
    fetch_whole(shard, links, 1)
    slots = shard.arena.lent[1]
    stale = Reply(job_id=1, created_at=e1.created_at, grads=(), loss=0.5, count=1, in_shm=True)
    # Another live worker, and another incarnation of w1: not theirs.
    refuse(b"w2/2", stale, ErrorCode.UNKNOWN_JOB)
    refuse(b"w1/8", stale, ErrorCode.UNKNOWN_JOB)
    # Frames as well as slots.
    refuse(RID, Reply(job_id=1, created_at=e1.created_at, grads=(np.zeros(HALF, np.float32),), loss=0.5,
                      count=1, in_shm=True), ErrorCode.BAD_SHAPE)
    assert refused == [0, 1, 1, 1]
    assert shard.blocks == {} and shard.haves == [] and shard.arena.lent[1] == slots
    shard.journal.sync()
    assert not [x for x in read_journal(os.path.join(shard.state_dir, "blocks")) if x.op == "block"]

    # The good reply still goes through.
    reply, g = block(r, 1, 6)
    send_block(r, links, reply)
    assert shard.blocks[1][0].tobytes() == g.tobytes()


def test_a_block_refused_from_slots_a_restarted_shard_never_lent_goes_again_as_frames(run, shm_links):
    """A shard process that restarted on the same endpoint (with its coordinator, after a kill -9)
    did not lend the slots a worker's block names: it refuses the block (err UNKNOWN_JOB), and the
    worker sends that block to that shard again as frames, once; the shard takes it, the same
    values. Before, the worker only logged the refusal and the coordinator waited for the block
    until its timeout (120 s) wrote the job off."""
    r, links = run, shm_links
    fetch_whole(r.shard, links, 1)  # over shared memory: slots lent for job 1's block
    reply, g = block(r, 1, 3)
    r.shard.arena.lent.pop(1)  # the restarted process never lent them
    assert links.send_blocks(reply)  # through the slots, as before the restart
    got: list = []

    def answered() -> bool:
        if links.socks[0].poll(0):
            got.extend(links.receive(0))
        return bool(got)

    pump(r.shard, links.socks, answered, "the refusal")
    assert got == [("resend", 1)] and 1 not in r.shard.blocks
    assert links.send_block(0, reply)  # what the worker's intake does with it (worker/intake.py)
    pump(r.shard, links.socks, lambda: 1 in r.shard.blocks, "the block as frames")
    held, = r.shard.blocks[1]
    assert held.tobytes() == g.tobytes() and len(r.frames_in[-1]) == 2  # a header and the slice: frames
    assert links.receive(0) == [] and 1 not in links.shm_jobs.get(1, {})  # one resend, no more


def test_a_hello_again_never_gets_the_old_slots(run, shm_links):
    r = run
    shard = r.shard
    links = shm_links
    fetch_whole(shard, links, 1)
    old = shard.arena.lent[1][1]
    send_block(r, links, block(r, 1, 7)[0])
    r.settle(1, 2.0)
    assert shard.arena.free_grad["w1/7"] == list(old)
    n = len(shard.arena.files())
    # The shard forgot this connection (restart, eviction): its next job (over shared memory,
    # the worker still ready) is followed by a welcome, and the worker says hello again.
    shard.told.clear()
    before = links.shm[0]
    fetch_whole(shard, links, 2)
    assert shard.arena.lent[2] == ("w1/7", old)

    def done() -> bool:  # the shard answered the hello (a new offer opened here), then took the ready
        assert links.receive(0) == []
        return links.shm[0] is not None and links.shm[0] is not before and RID in shard.shm_ready

    pump(shard, links.socks, done, "the handshake again")
    assert shard.arena.free_grad.get("w1/7", []) == [] and shard.arena.lent[2] == ("", old)  # lent to nobody
    reply, g = block(r, 2, 8)
    send_block(r, links, reply)  # its slots are of the handshake before: the block goes as frames
    assert shard.shm_blocks_in == 1 and links.shm_out == 1 and shard.blocks[2][0].tobytes() == g.tobytes()
    assert shard.arena.gradients("w1/7", 2) is None
    r.settle(2, 3.0)
    assert len(shard.arena.files()) <= n - len(old) + 1  # unlinked (at most the new iterate's slice more)
    assert not {f"{shard.arena.prefix}-{s}" for s in old} & set(shard.arena.files())
    fetch_whole(shard, links, 3)
    assert not set(shard.arena.lent[3][1]) & set(old)  # never lent again


def test_no_offer_to_another_host_nor_from_a_shard_with_shm_off(tmp_path, worker_seen):
    r = Run(tmp_path, "f32", shm="off")
    links = linked(r, shm=True)
    try:
        fetch_whole(r.shard, links, 0)

        def hello_in() -> bool:  # the links must read the shard's welcome (it may come after the job) to say hello
            assert links.receive(0) == []
            return RID in r.shard.parts_peers

        pump(r.shard, links.socks, hello_in, "the worker's hello")
        job = fetch_whole(r.shard, links, 1)
        assert r.shard.arena is None and links.shm == [None] and job.points
        assert [k for k, _, _ in worker_seen].count(Welcome) == 1
    finally:
        links.close()
        r.close()
    # auto: a hello from another host is not offered anything; one from this host is
    (tmp_path / "b").mkdir()
    r = Run(tmp_path / "b", "f32")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.routing_id = RID
    sock.connect(r.shard.endpoint)
    try:
        def say(hid: str) -> None:
            n = len(r.frames_in)
            sock.send_multipart(encode(Hello(worker_id="w1", boot=7, credit=1, parts=True, shm=True, host_id=hid)))
            pump(r.shard, [sock], lambda: len(r.frames_in) > n, "the hello")

        say(host_id() + "x")
        assert r.shard.arena is None and not r.shard.shm_capable and not sock.poll(100)
        say(host_id())
        assert sock.poll(WAIT_S * 1000)
        w = decode(sock.recv_multipart())
        assert type(w) is Welcome and w.shm == r.shard.arena.prefix and w.parts and w.server_boot == r.shard.boot
        assert RID in r.shard.shm_capable and RID not in r.shard.shm_ready  # not before its ready
    finally:
        sock.close()
        r.close()


def test_the_shard_command_takes_shm_and_serve_passes_its_own_to_local_shards(monkeypatch, tmp_path):
    """`latecomer shard --shm off|auto|any` reaches the Shard; `serve --shm X --shards N` starts its
    local shards with --shm=X; a bad choice is a one-line usage error."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    import ps.cli.shard
    import ps.sharded.shard
    from ps.cli.shard import shard as shard_cmd
    from ps.cli.shard import start_local_shards

    got = {}

    class Stop(Exception):
        pass

    def fake_shard(*args, **kw):
        got.update(kw)
        raise Stop

    monkeypatch.setattr(ps.sharded.shard, "Shard", fake_shard)
    r = CliRunner().invoke(shard_cmd, ["--coordinator", "tcp://127.0.0.1:9", "--shm", "off"])
    assert isinstance(r.exception, Stop) and got["shm"] == "off"
    r = CliRunner().invoke(shard_cmd, ["--coordinator", "tcp://127.0.0.1:9", "--shm", "sometimes"])
    assert r.exit_code == 2 and "--shm" in r.output
    monkeypatch.setattr(ps.cli.shard.LocalShards, "start", lambda self: None)
    daemon = SimpleNamespace(security=None, hub=SimpleNamespace(endpoint="tcp://127.0.0.1:9", n=2, token="ab" * 32),
                             hooks=[])
    spec = SimpleNamespace(problem="synthetic", algorithm="asgd")
    local = start_local_shards(daemon, str(tmp_path), None, spec, (), (), "off")
    assert "--shm=off" in local.extra and local.count == 2
    assert local.token == "ab" * 32 and not any("ab" * 32 in a for a in local.extra)  # environment, not argv
