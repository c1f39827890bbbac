"""What PROTOCOL.md §12.1 ("a sharded worker, step by step") and §10 say a worker and a shard do,
statement by statement, against the real worker side (worker/shards.py ``ShardLinks``, the
worker's welcome) over fake shards (a ROUTER each), and against a real shard's handlers fed a
real coordinator's records. Every wait is a bounded poll; no sleeps."""

from __future__ import annotations

import logging
import time

import msgpack
import numpy as np
import pytest
import zmq

import worker.shards as links_mod
from protocol.codec import decode, encode
from protocol.messages import (
    Bye,
    Error,
    ErrorCode,
    Fetch,
    Heartbeat,
    Hello,
    Job,
    Ready,
    Reply,
    StatusRequest,
    Welcome,
)
from ps.core.spec import TrainingSpec
from ps.drivers.server import StateOptions, _new_run
from ps.journal.inputs import CoreInputs
from ps.journal.persistence import Persistence
from ps.journal.segments import read_journal
from ps.sharded.shard import Shard
from worker.shards import REFETCH_MIN_S, ShardLinks

RID = b"w1/1"
WAIT_S = 10.0  # the longest a poll here waits (a bound, not a pace)
CORE_KW = {"batch_size": 1, "liveness_timeout": 3.0, "heartbeat_interval": 0.5, "min_workers": 1,
           "round_period": None, "seed": 0}


class FakeShard:
    """A shard's data socket, driven by hand."""

    def __init__(self, ctx: zmq.Context, endpoint: str = "tcp://127.0.0.1:0") -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.router_mandatory = 1  # a send to a worker not connected raises, never vanishes
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def take(self, n: int) -> list:
        """The next ``n`` messages the worker sent, decoded; then nothing more for 0.1 s."""
        got = []
        for _ in range(n):
            assert self.sock.poll(WAIT_S * 1000), f"expected {n} messages, got {got}"
            rid, *frames = self.sock.recv_multipart()
            assert rid == RID
            got.append(decode(frames))
        assert not self.sock.poll(100), "a message more than expected"
        return got

    def send(self, msg, raw: list | None = None) -> None:
        self.sock.send_multipart([RID, *(raw if raw is not None else encode(msg))])

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def two():
    """Two fake shards, of the values [0, 4) and [4, 10), and the worker's links to them."""
    ctx = zmq.Context.instance()
    shards = [FakeShard(ctx), FakeShard(ctx)]
    links = ShardLinks(ctx, ((shards[0].endpoint, 0, 4), (shards[1].endpoint, 4, 10)), RID)
    yield shards, links
    links.close()
    for s in shards:
        s.close()


def coordinators_job(j: int, ids=(0,), seed=5) -> Job:
    return Job(job_id=j, kind=1, created_at=3, iterate_ids=ids, seed=seed, batch_size=2)


def piece(job: Job, n: int, ids=None, dtype="<f4", value=1.0, seed=None) -> Job:
    """A shard's answer to a fetch of ``job``: ``n`` values of each iterate asked for."""
    ids = job.iterate_ids if ids is None else ids
    return Job(job_id=job.job_id, kind=job.kind, created_at=job.created_at, iterate_ids=job.iterate_ids,
               seed=job.seed if seed is None else seed, point_ids=ids,
               points=tuple(np.full(n, value, dtype) for _ in ids))


def until(links: ShardLinks, i: int, done, what: str) -> list:
    """What ``links.receive(i)`` returns until ``done(everything so far)``, at most WAIT_S."""
    out: list = []
    deadline = time.monotonic() + WAIT_S
    while not done(out):
        assert time.monotonic() < deadline, f"timed out waiting for {what}; got {out}"
        if links.socks[i].poll(20):
            out += links.receive(i)
    return out


def test_every_shard_gets_the_same_fetch_and_the_header_fields_are_the_coordinators(two):
    """§12.1 steps 4 and 5: one fetch per shard, with the coordinator's created_at and the ids the
    worker lacks; the slices in shard order are the iterate, under the coordinator's header."""
    shards, links = two
    job = coordinators_job(7, ids=(0, 1))
    links.fetch(job, (1,), 0.0)
    for s in shards:
        assert s.take(1) == [Fetch(job_id=7, created_at=3, iterate_ids=(1,))]
    shards[0].send(piece(job, 4, ids=(1,), value=1.0, seed=99))  # a shard's own seed is not used
    assert until(links, 0, lambda out: 0 in links.assembling[7].pieces, "shard 0's piece") == []
    shards[1].send(piece(job, 6, ids=(1,), value=2.0))
    got = until(links, 1, lambda out: out, "the whole job")
    ((kind, whole),) = got
    assert kind == "job" and whole.point_ids == (1,) and whole.seed == 5 and whole.batch_size == 2
    np.testing.assert_array_equal(whole.points[0], [1.0] * 4 + [2.0] * 6)
    assert links.assembling == {}


def test_what_a_worker_drops_from_a_shard_and_that_it_never_answers(two, caplog):
    """§10, a worker from a shard: garbage, another job's or other ids' answers, a slice of the
    wrong length or dtype are dropped (the fetch stays open), hb and bye are ignored, an err other
    than UNKNOWN_JOB is logged; UNKNOWN_JOB ends the job. Nothing goes back to the shard."""
    shards, links = two
    job = coordinators_job(1)
    links.fetch(job, (0,), 0.0)
    links.fetch(coordinators_job(2), (0,), 0.0)
    assert len(shards[0].take(2)) == 2 and len(shards[1].take(2)) == 2
    s = shards[0]
    caplog.set_level(logging.INFO, "latecomer.worker")
    s.send(None, raw=[b"\xc1"])
    s.send(piece(coordinators_job(9), 4))  # no fetch open for job 9
    s.send(piece(job, 4, ids=()))  # not the ids asked for
    s.send(piece(job, 5))  # 5 values for a shard of 4
    s.send(piece(job, 4, dtype="<f8"))  # not the wire dtype's frame dtype (f32: <f4)
    s.send(Heartbeat(boot=1))
    s.send(Bye("x"))
    s.send(Error(ErrorCode.MALFORMED, "what", job_id=1))
    s.send(Error(ErrorCode.UNKNOWN_JOB, "job id not outstanding", job_id=2))
    got = until(links, 0, lambda out: out, "the UNKNOWN_JOB")
    assert got == [("gone", 2)]
    assert set(links.assembling) == {1} and links.assembling[1].pieces == {}
    text = caplog.text
    assert "undecodable message from shard 0" in text and "MALFORMED what" in text
    assert "slice of shape (5,)" in text and "dtype <f8" in text
    assert not s.sock.poll(100)  # the worker answered none of it
    s.send(piece(job, 4))  # the right answer still completes the fetch
    until(links, 0, lambda out: 0 in links.assembling[1].pieces, "shard 0's piece")
    shards[1].send(piece(job, 6))
    assert [k for k, _ in until(links, 1, lambda out: out, "job 1")] == ["job"]


def test_a_fetch_is_asked_again_only_of_the_shards_that_lost_it_after_one_wait_for_all(two):
    """§12.1 step 6: the wait is one figure for every shard (the slowest answer of any); the
    clock runs per fetch and per shard; a re-ask goes only to the shards that lost the fetch."""
    shards, links = two
    t = [100.0]
    links.clock = lambda: t[0]
    first = coordinators_job(1)
    links.fetch(first, (0,), t[0])
    [s.take(1) for s in shards]
    t[0] += 3.0  # shard 0 took 3 s: the wait is now 4 x 3 s for every shard
    shards[0].send(piece(first, 4))
    until(links, 0, lambda out: links.assembling[1].pieces, "shard 0's piece")
    shards[1].send(piece(first, 6))
    until(links, 1, lambda out: out, "job 1")
    assert links.refetch_after() == max(REFETCH_MIN_S, 12.0)
    job = coordinators_job(2)
    links.fetch(job, (0,), t[0])
    [s.take(1) for s in shards]
    shards[0].send(piece(job, 4))  # shard 0 answers at once; shard 1 stays silent
    until(links, 0, lambda out: links.assembling[2].pieces, "shard 0's piece")
    t[0] += 11.9
    links.refetch(t[0])
    assert shards[1].take(0) == []  # not yet 4 x 3 s
    t[0] += 0.2
    links.refetch(t[0])
    assert shards[1].take(1) == [Fetch(job_id=2, created_at=3, iterate_ids=(0,))]
    assert shards[0].take(0) == []  # it answered: never asked again


def test_blocks_carry_the_whole_replys_figures_and_go_again_all_when_one_send_fails(two, monkeypatch):
    """§12.1 step 7 and 9: each block has the reply's loss, count, compute_s and holds and the
    gradient's slice; a send that fails at once fails the reply (kept unsent), and the next
    attempt sends every block again."""
    shards, links = two
    g = np.arange(10, dtype=np.float32)
    r = Reply(job_id=4, created_at=3, grads=(g,), loss=0.5, count=2, compute_s=0.25, holds=(0, 1))
    assert links.send_blocks(r)
    for s, (lo, hi) in zip(shards, ((0, 4), (4, 10)), strict=True):
        (b,) = s.take(1)
        assert (b.job_id, b.created_at, b.loss, b.count, b.compute_s, b.holds) == (4, 3, 0.5, 2, 0.25, (0, 1))
        np.testing.assert_array_equal(b.grads[0], g[lo:hi])
    real = links_mod.send_frames

    def full(sock, frames, flags=0):
        if sock is links.socks[1]:
            raise zmq.Again()
        return real(sock, frames, flags)

    monkeypatch.setattr(links_mod, "send_frames", full)
    assert not links.send_blocks(r)
    monkeypatch.setattr(links_mod, "send_frames", real)
    assert links.send_blocks(r)
    assert len(shards[0].take(2)) == 2 and len(shards[1].take(1)) == 1  # shard 0's block twice: taken once there


def test_shard_links_queue_while_a_shard_is_unreachable_and_say_hello_with_no_holds(tmp_path):
    """§12.1 step 2: no IMMEDIATE on a shard connection: a fetch to a shard that is not there yet
    waits in the queue and arrives once it is; step 9/10: the hello carries holds [] and is sent
    again at every welcome (a restarted shard), which also drops that shard's shared memory."""
    ctx = zmq.Context.instance()
    ep = f"ipc://{tmp_path}/shard"
    links = ShardLinks(ctx, ((ep, 0, 4),), RID)
    shard = None
    try:
        assert links.socks[0].getsockopt(zmq.IMMEDIATE) == 0 and links.socks[0].sndhwm == 1000
        links.fetch(coordinators_job(1), (), 0.0)  # nobody bound yet: queued, not failed
        shard = FakeShard(ctx, ep)
        assert shard.take(1) == [Fetch(job_id=1, created_at=3, iterate_ids=())]
        for boot in (11, 12):  # the shard's welcome after its first job, then after its restart
            links.shm[0] = object()  # as if the shard process before had lent its shared memory
            shard.send(Welcome(server_boot=boot, version=1, problem="quadratic", parts=True))
            until(links, 0, lambda out: links.shm[0] is None, "the welcome")
            (h,) = shard.take(1)
            assert type(h) is Hello and (h.worker_id, h.boot, h.parts, h.holds, h.busy) == ("w1", 1, True, (), ())
        assert set(links.assembling) == {1}  # nothing else changes: the fetch is still open
    finally:
        links.close()
        if shard is not None:
            shard.close()


def test_a_later_welcome_keeps_the_links_for_the_same_shards_and_replaces_them_for_others():
    """§12.1 step 2 (worker/session.py ``_link_shards``): the same list keeps the connections and
    the fetches in progress; another list closes them, connects anew and asks the new shards for the
    fetches of the jobs still held; a fetch of a job no longer held is forgotten; [] closes them."""
    from worker.link import Worker, WorkerConfig

    w = Worker(WorkerConfig(server="tcp://127.0.0.1:9", worker_id="w1"), context=zmq.Context.instance())
    try:
        a = (("tcp://127.0.0.1:9", 0, 4), ("tcp://127.0.0.1:9", 4, 10))
        w._link_shards(a)
        links = w.shards
        links.fetch(coordinators_job(1), (), 0.0)
        w.jobs[1] = coordinators_job(1)
        w.wire = "bf16"
        w._link_shards(a)
        assert w.shards is links and set(links.assembling) == {1} and links.wire == "bf16"
        w._link_shards(a[:1] + (("tcp://127.0.0.1:8", 4, 10),))
        assert w.shards is not links and links.socks == [] and set(w.shards.assembling) == {1}
        assert w.shards.assembling[1].pieces == {}  # asked of the new shards afresh
        del w.jobs[1]  # dropped (a welcome of another run): its fetch is forgotten
        w._link_shards(a[:1] + (("tcp://127.0.0.1:8", 4, 10),))
        assert w.shards.assembling == {}
        w._link_shards(())
        assert w.shards is None
    finally:
        if w.shards is not None:
            w.shards.close()


def test_the_coordinators_jobs_carry_empty_points_for_the_ids_it_believes_missing(tmp_path):
    """§12.1 step 3: point_ids as in §8.3, each a descriptor of shape [0] and a 0-byte frame."""
    spec = TrainingSpec("synthetic", {"d": 12, "blocks": 3}, "asgd", {"lr": 0.1})
    _run, core, _problem, journal = _new_run(StateOptions(str(tmp_path)), spec, 1, "f32", CORE_KW, shards=2)
    inputs = CoreInputs(core, Persistence(str(tmp_path), journal))
    inputs.message("w1", Hello(worker_id="w1", boot=1, credit=2), 1.0)
    jobs = [c.msg for c in inputs.message("w1", Ready(credit=2), 1.1) if type(getattr(c, "msg", None)) is Job]
    first, second = (encode(j) for j in jobs)
    header = msgpack.unpackb(first[0])
    assert header["point_ids"] == [0] and header["arrays"] == [{"dtype": "<f4", "shape": [0]}]
    assert [len(memoryview(f)) for f in first[1:]] == [0]
    assert msgpack.unpackb(second[0])["point_ids"] == [] and len(second) == 1


@pytest.fixture
def shard(tmp_path):
    """Shard 1 of 2 of a run whose coordinator issued worker w1 (boot 1) two jobs, fed every record;
    what it sends a worker is kept in ``sent``."""
    spec = TrainingSpec("synthetic", {"d": 12, "blocks": 3}, "asgd", {"lr": 0.1})
    _run, core, _problem, journal = _new_run(StateOptions(str(tmp_path)), spec, 1, "f32", CORE_KW, shards=2)
    inputs = CoreInputs(core, Persistence(str(tmp_path), journal))
    inputs.message("w1", Hello(worker_id="w1", boot=1, credit=2), 1.0)
    inputs.message("w1", Ready(credit=2), 1.1)
    journal.sync()
    s = Shard("tcp://127.0.0.1:9", bind="tcp://127.0.0.1:0")
    sent: list = []
    s._send_data = lambda rid, msg: sent.append(msg)
    s._on_welcome({"index": 1, "shards": 2, "run_id": core.cfg.run_id, "from": 0, "lo": 6, "hi": 12})
    before = list(sent)
    recs = [msgpack.packb(r.body, use_bin_type=True) for r in read_journal(str(tmp_path), from_lsn=0)]
    s._on_records({"first": 0, "count": len(recs)}, recs)
    yield s, sent, core, before
    s.close()


def data(s: Shard, msg=None, raw: bytes | None = None) -> None:
    frames = [raw] if raw is not None else encode(msg)
    s._on_data([zmq.Frame(RID), *(zmq.Frame(bytes(f)) if isinstance(f, bytes) else f for f in frames)])


def test_what_a_shard_answers_that_is_not_for_it(tmp_path):
    """§10, a shard: before its run starts every message is REFUSED; after, hb, bye, status? and a
    wrong v are MALFORMED (a shard never answers UNSUPPORTED_VERSION); it sends no hb itself."""
    s = Shard("tcp://127.0.0.1:9", bind="tcp://127.0.0.1:0")
    sent: list = []
    s._send_data = lambda rid, msg: sent.append(msg)
    try:
        data(s, Fetch(job_id=0, created_at=0))
        assert [(m.code, m.message) for m in sent] == [(ErrorCode.REFUSED, "this shard has not started")]
    finally:
        s.close()


def test_a_started_shard_refuses_what_is_not_for_it_and_fetches_of_other_iterates(shard):
    s, sent, core, before = shard
    assert before == []  # nothing to a worker from the coordinator's welcome and records
    for msg in (Heartbeat(boot=1), Bye("x"), StatusRequest(token=1)):
        data(s, msg)
    data(s, raw=msgpack.packb({"v": 2, "t": "hb", "boot": 1}))
    assert [m.code for m in sent] == [ErrorCode.MALFORMED] * 4
    assert sent[0].message == "Heartbeat is not for a shard" and "version" in sent[3].message
    sent.clear()
    e = core.ledger[0]
    data(s, Fetch(job_id=0, created_at=e.created_at, iterate_ids=(e.iterate_ids[0] + 1,)))  # not the job's
    data(s, Fetch(job_id=0, created_at=e.created_at, iterate_ids=e.iterate_ids))
    assert [(type(m), getattr(m, "code", None)) for m in sent[:2]] == [(Error, ErrorCode.UNKNOWN_JOB), (Job, None)]
    job = sent[1]
    assert (job.created_at, job.seed, job.iterate_ids, job.point_ids) == (e.created_at, e.seed, e.iterate_ids,
                                                                          e.iterate_ids)
    assert job.points[0].shape == (6,)


def test_a_shard_sends_a_worker_no_heartbeat_and_no_bye(shard):
    """§12.1 step 8: a shard's timers and its close send its workers nothing (the worker's
    liveness is the coordinator's)."""
    s, _sent, _core, _ = shard
    del s._send_data  # the shard's own send again
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.linger = 0
    d.routing_id = RID
    d.connect(s.endpoint)
    try:
        d.send_multipart(encode(Heartbeat(boot=1)))
        deadline = time.monotonic() + WAIT_S
        while not d.poll(20):  # the shard's answer: the connection is up both ways
            assert time.monotonic() < deadline, "no answer from the shard"
            s._drain(s.data, s._on_data)
        assert decode(d.recv_multipart()).code == ErrorCode.MALFORMED
        now = time.monotonic()
        for dt in (1.0, 10.0, 100.0):  # its heartbeat periods, liveness and parked fetches: nothing to us
            s.clock = lambda dt=dt: now + dt
            s._timers()
        s.close()
        s.close = lambda: None  # closed here
        assert not d.poll(200)
    finally:
        d.close(linger=0)


def test_a_shard_checks_a_blocks_loss_as_the_whole_replys(shard):
    """§12.1 step 7: the shard refuses a block whose loss is not finite (the reply's own figure),
    reported to the coordinator, never answered to the worker."""
    s, sent, core, _ = shard
    e = core.ledger[0]
    data(s, Reply(job_id=0, created_at=e.created_at, grads=(np.ones(6, np.float32),), loss=float("nan"), count=1))
    assert sent == [] and s.blocks == {}
    assert s.haves == [(-1, [0, e.created_at, int(ErrorCode.NON_FINITE), "loss is not finite"])]


def test_a_block_a_shard_refused_from_its_slots_goes_again_from_the_reply_the_worker_keeps():
    """worker/intake.py ``_resend_block``: the links said ("resend", job) for shard i (a restarted
    shard never lent the slots the block named, tests/unit/test_shard_shm.py): the block goes to
    that shard again from the reply kept for a resend; a reply no longer kept is not sent."""
    from worker.link import Worker, WorkerConfig

    w = Worker(WorkerConfig(server="tcp://127.0.0.1:9", worker_id="w1"), context=zmq.Context.instance())
    sent = []

    class Links:
        def send_block(self, i: int, r: Reply) -> bool:
            sent.append((i, r.job_id))
            return True

    w.shards = Links()
    w.recent.append((0.0, Reply(job_id=4, created_at=1, grads=(np.ones(3, np.float32),))))
    w._resend_block(1, 4)
    w._resend_block(1, 5)  # no reply kept for job 5
    assert sent == [(1, 4)]
    w.shards = None
