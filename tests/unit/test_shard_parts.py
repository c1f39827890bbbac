"""The parts of a sharded server, in one process, with a real coordinator core and journal
(issue 17): the shard follows the coordinator's records, answers fetches with its slices,
checks gradient blocks as the core checks replies (and refuses hostile ones changing nothing),
and the coordinator's hub hands a reply to the core only when every shard has its block.
The control channel refuses what does not read."""

from __future__ import annotations

import math
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import zmq

from protocol.codec import encode
from protocol.messages import Error, ErrorCode, Fetch, Hello, Job, Ready, Reply
from ps.core.spec import TrainingSpec
from ps.drivers.server import StateOptions, _new_run
from ps.journal.inputs import CoreInputs
from ps.journal.persistence import Persistence
from ps.journal.segments import read_journal
from ps.sharded.control import ControlError, pack, unpack
from ps.sharded.hub import ShardHub
from ps.sharded.shard import Shard

CORE_KW = {"batch_size": 1, "liveness_timeout": 3.0, "heartbeat_interval": 0.5, "min_workers": 1,
           "round_period": None, "seed": 0}


@pytest.fixture
def run(tmp_path):
    """A sharded run's coordinator (2 shards of synthetic d=12 in 3 blocks) that issued worker
    w1 two jobs, and shard 1 fed every record so far."""
    spec = TrainingSpec("synthetic", {"d": 12, "blocks": 3}, "asgd", {"lr": 0.1})
    (tmp_path / "c").mkdir()
    _run, core, problem, journal = _new_run(StateOptions(str(tmp_path / "c")), spec, 1, "f32", CORE_KW, shards=2)
    inputs = CoreInputs(core, Persistence(str(tmp_path / "c"), journal))
    inputs.message("w1", Hello(worker_id="w1", boot=7, credit=2), 1.0)
    inputs.message("w1", Ready(credit=2), 1.1)
    journal.sync()
    shard = Shard("tcp://127.0.0.1:9", bind="tcp://127.0.0.1:0")
    assert shard.endpoint == ""  # a new shard binds its data socket once it knows its slice
    shard._on_welcome({"index": 1, "shards": 2, "run_id": core.cfg.run_id, "from": 0, "lo": 6, "hi": 12})
    assert shard.welcomed and shard.endpoint.startswith("tcp://127.0.0.1:")
    sent = []
    shard._send_data = lambda rid, msg: sent.append((rid, msg))
    feed(shard, str(tmp_path / "c"))
    yield core, inputs, shard, sent, problem
    shard.close()


def feed(shard: Shard, d: str) -> None:
    recs = [msgpack.packb(r.body, use_bin_type=True) for r in read_journal(d, from_lsn=shard.applied + 1)]
    shard._on_records({"first": shard.applied + 1, "count": len(recs)}, recs)


RID = b"w1/7"


def block(jid: int, created_at: int, g: np.ndarray) -> tuple[Reply, list]:
    r = Reply(job_id=jid, created_at=created_at, grads=(g,), loss=0.0, count=1)
    return r, [zmq.Frame(bytes(f)) if isinstance(f, bytes) else f for f in encode(r)]


def test_the_shard_follows_the_records_and_answers_fetches_with_its_slice(run):
    core, _inputs, shard, sent, problem = run
    assert sorted(shard.core.ledger) == sorted(core.ledger) == [0, 1]
    lo, hi = shard.range
    assert (lo, hi) == (6, 12)  # 3 blocks of 4 values; asgd's work is elementwise: the middle block is cut in halves
    e = shard.core.ledger[0]
    shard._fetch(RID, Fetch(job_id=0, created_at=e.created_at, iterate_ids=e.iterate_ids), 0.0)
    (rid, job), = sent
    assert rid == RID and type(job) is Job and job.point_ids == e.iterate_ids
    np.testing.assert_array_equal(job.points[0], problem.init_params(0)[lo:hi])


def test_fetches_of_settled_other_or_future_jobs(run):
    _core, _inputs, shard, sent, _ = run
    e = shard.core.ledger[0]
    shard._fetch(b"w2/1", Fetch(job_id=0, created_at=e.created_at, iterate_ids=()), 0.0)  # another worker's job
    shard._fetch(RID, Fetch(job_id=0, created_at=e.created_at + 5, iterate_ids=()), 0.0)  # another created_at
    assert [type(m) for _, m in sent] == [Error, Error] and all(m.code == ErrorCode.UNKNOWN_JOB for _, m in sent)
    shard._fetch(RID, Fetch(job_id=99, created_at=0, iterate_ids=()), 0.0)  # not issued here yet: it waits
    assert (RID, 99) in shard.parked and len(sent) == 2


@pytest.mark.parametrize("bad,code", [("nan", ErrorCode.NON_FINITE), ("shape", ErrorCode.BAD_SHAPE)])
def test_a_bad_block_is_refused_and_changes_nothing(run, bad, code):
    _core, _inputs, shard, _sent, _ = run
    e = shard.core.ledger[0]
    g = np.full(6, np.nan, np.float32) if bad == "nan" else np.zeros(5, np.float32)
    r, frames = block(0, e.created_at, g)
    before = {j: (x.received, x.worker_id) for j, x in shard.core.ledger.items()}
    shard._block(RID, r, frames)
    assert shard.blocks == {} and shard.haves == [(-1, [0, e.created_at, int(code), shard.haves[0][1][3]])]
    assert {j: (x.received, x.worker_id) for j, x in shard.core.ledger.items()} == before


def test_a_block_of_another_worker_or_garbage_is_dropped(run):
    _core, _inputs, shard, sent, _ = run
    e = shard.core.ledger[0]
    r, frames = block(0, e.created_at, np.ones(6, np.float32))
    shard._block(b"w2/1", r, frames)
    shard._on_data([zmq.Frame(RID), zmq.Frame(b"\xc1garbage")])
    assert shard.blocks == {} and shard.haves == []
    assert [m.code for _, m in sent] == [ErrorCode.MALFORMED]


def test_a_good_block_is_held_and_applied_when_the_coordinator_accepts_its_reply(run):
    core, inputs, shard, _sent, _ = run
    e = shard.core.ledger[0]
    g = np.arange(12, dtype=np.float32)
    r, frames = block(0, e.created_at, g[6:])
    shard._block(RID, r, frames)
    assert 0 in shard.blocks and shard.haves[0][1][2] == 0
    header = Reply(job_id=0, created_at=e.created_at, grads=(np.empty(0, np.float32),), loss=0.0, count=1)
    inputs.message("w1", header, 2.0)
    inputs.persist.journal.sync()
    feed(shard, inputs.persist.state_dir)
    assert shard.core.version == core.version == 1 and 0 not in shard.blocks
    np.testing.assert_allclose(shard.core.params(), -0.1 * g[6:])  # asgd: x0 = 0, x1 = -lr g (this shard's slice)


def test_a_record_the_shard_has_no_block_for_stops_it_with_one_line(run):
    _core, inputs, shard, _sent, _ = run
    e = shard.core.ledger[1]
    inputs.message("w1", Reply(job_id=1, created_at=e.created_at, grads=(np.empty(0, np.float32),), loss=0.0,
                               count=1), 2.0)
    inputs.persist.journal.sync()
    with pytest.raises(ValueError, match="holds no gradient block for it"):
        feed(shard, inputs.persist.state_dir)


@pytest.mark.parametrize("frame,why", [
    (b"\xc1", "undecodable"),
    (msgpack.packb([1, 2]), "not a control message"),
    (msgpack.packb({"t": "have"}), "jobs missing"),
    (msgpack.packb({"t": "have", "jobs": [[1, 2, 3]]}), "a have is"),
    (msgpack.packb({"t": "have", "jobs": [[1, 2, 300, "x"]]}), "integer in"),
    (msgpack.packb({"t": "have", "jobs": [[0, 0, 0, ""]] * 5000}), "at most 4096"),
    (msgpack.packb({"t": "progress", "applied": 1, "ckpt": 1, "version": 1, "applied_count": 1, "rss": 1,
                    "blocks": 1, "records_s": math.inf}), "finite"),
    (msgpack.packb({"t": "shello", "index": 99, "run_id": 1, "boot": 1, "endpoint": "x", "applied": 1,
                    "ckpt": 1}), "integer in"),
    (msgpack.packb({"t": "recs", "first": 0, "count": 1}), "not a control message of"),  # not shard -> coordinator
])
def test_control_messages_that_do_not_read_are_one_line_errors(frame, why):
    with pytest.raises(ControlError, match=why):
        unpack(frame, ("shello", "have", "progress", "params", "refuse"))


def test_control_messages_round_trip():
    m = unpack(pack("have", jobs=[[3, 1, 0, ""], [4, 2, 6, "gradient holds NaN"]]), ("have",))
    assert m == {"t": "have", "jobs": [(3, 1, 0, ""), (4, 2, 6, "gradient holds NaN")]}
    m = unpack(pack("have", jobs=[[5, 1, 0, "", [1.5, 0.0, 2]]]), ("have",))  # with its blocks' squared norms
    assert m["jobs"] == [(5, 1, 0, "", (1.5, 0.0, 2.0))]
    for bad in ([-1.0], [float("nan")], ["x"], 3, [0.0] * 65537):
        with pytest.raises(ControlError):
            unpack(pack("have", jobs=[[5, 1, 0, "", bad]]), ("have",))


@pytest.fixture
def hub(run):
    """The coordinator's hub of 2 shards over the run's core (its socket bound, no shard joined)."""
    core, inputs, *_ = run
    h = ShardHub(zmq.Context.instance(), "tcp://127.0.0.1:0", 2, core=core, persist=inputs.persist,
                 ranges=((0, 6), (6, 12)), clock=lambda: 0.0)
    yield h
    h.close()


def test_the_hub_hands_a_reply_on_only_when_every_shard_has_its_block(run, hub):
    core, inputs, _shard, _sent, _ = run
    e0, e1 = core.ledger[0], core.ledger[1]
    empty = (np.empty(0, np.float32),)
    item = SimpleNamespace(msg=Reply(job_id=0, created_at=e0.created_at, grads=empty), wid="w1")
    assert not hub.take_reply(SimpleNamespace(msg=Reply(job_id=0, created_at=0, grads=empty), wid="w2"), 10.0)
    assert hub.take_reply(item, 10.0)
    hub._on_haves(hub.slots[0], [(0, e0.created_at, 0, "")], 10.1)
    assert hub.ready_replies(10.2) == [] and hub.pending_for("w1") == [0]  # shard 1 has not said yet
    hub._on_haves(hub.slots[1], [(0, e0.created_at, int(ErrorCode.NON_FINITE), "gradient holds NaN")], 10.3)
    (it, refusal), = hub.ready_replies(10.4)
    assert it is item and refusal == (ErrorCode.NON_FINITE, "shard 1: gradient holds NaN")
    # While the worker lives and every shard is up, a header waits for its blocks however slow the
    # shard's link (long past 2 x liveness); after block_wait_max_s it is dropped.
    for s in hub.slots:
        s.connected = True
    item1 = SimpleNamespace(msg=Reply(job_id=1, created_at=e1.created_at, grads=empty), wid="w1")
    assert hub.take_reply(item1, 20.0)
    hub._on_haves(hub.slots[0], [(1, e1.created_at, 0, "")], 20.1)
    assert hub.block_wait_max_s >= 10 * hub.block_wait_s
    assert hub.ready_replies(20.0 + 5 * hub.block_wait_s) == [] and hub.pending_for("w1") == [1]
    assert hub.ready_replies(20.0 + hub.block_wait_max_s - 0.1) == [] and hub.pending_for("w1") == [1]
    assert hub.ready_replies(20.0 + hub.block_wait_max_s + 0.1) == [] and hub.pending_for("w1") == []
    assert hub.blocks_timed_out == 1
    # A shard whose block is missing restarted after the header came: what it had not journaled
    # is gone, so the header waits block_wait_s after the rejoin, no longer. A rejoin of the
    # shard that has its block changes nothing.
    item2 = SimpleNamespace(msg=Reply(job_id=1, created_at=e1.created_at, grads=empty), wid="w1")  # sent again
    assert hub.take_reply(item2, 300.0)
    hub._on_haves(hub.slots[0], [(1, e1.created_at, 0, "")], 300.1)
    hub._rejoined(hub.slots[0], 301.0)
    assert hub.ready_replies(301.0 + 2 * hub.block_wait_s) == [] and hub.pending_for("w1") == [1]
    hub._rejoined(hub.slots[1], 302.0)
    assert hub.ready_replies(302.0 + hub.block_wait_s - 0.1) == [] and hub.pending_for("w1") == [1]
    assert hub.ready_replies(302.0 + hub.block_wait_s + 0.1) == [] and hub.pending_for("w1") == []
    assert hub.blocks_timed_out == 2
    assert hub.hold_reason() == "shard(s) 0,1 not connected"  # connected, but no core built (applied -1)


def test_metrics_have_one_series_per_shard():
    from prometheus_client import CollectorRegistry, generate_latest

    from ps.observe.metrics import SnapshotCollector

    c = SnapshotCollector()
    shards = [{"index": i, "connected": i == 0, "lag_records": 3 * i, "rss_bytes": 1e6 * (i + 1), "blocks_held": i,
               "joins": 1 + i} for i in range(2)]
    c.publish({"counters": {k: 0 for k in ("applied", "dropped", "lost", "failed", "cancelled", "rejected", "issued",
                                           "late", "unknown", "invalid", "stray", "refused", "worker_errors",
                                           "workers_joined", "workers_lost", "quarantined", "benched")},
               "version": 5, "workers": 1, "outstanding": 0, "step_rate": 0.0, "age_counts": {}, "shards": shards})
    reg = CollectorRegistry()
    reg.register(c)
    text = generate_latest(reg).decode()
    assert 'latecomer_shard_up{shard="0"} 1.0' in text and 'latecomer_shard_up{shard="1"} 0.0' in text
    assert 'latecomer_shard_lag_records{shard="1"} 3.0' in text and 'latecomer_shard_joins{shard="1"} 2.0' in text


def test_status_shows_a_line_per_shard_and_the_hold():
    from protocol.messages import Status
    from ps.ops.status import render_status

    text = render_status(Status(info={"version": 3, "held": "shard(s) 1 not connected",
                                      "shard.0": "up lag 0 rss 80MB blocks 1 joins 1",
                                      "shard.1": "GONE lag 12 rss 79MB blocks 0 joins 2"}))
    assert "shards: 2; HOLDING the issuing of jobs: shard(s) 1 not connected" in text
    assert "  shard.1: GONE lag 12 rss 79MB blocks 0 joins 2" in text


def test_records_go_to_a_shard_only_once_durable_and_in_order(run):
    """The hub ships the coordinator's journal records to a joined shard up to the journal's durable
    LSN (group commit: after its fsync), never past it, and from the journal's segments when the
    shard is further behind than the records held in memory."""
    core, inputs, _shard, _sent, _ = run
    journal = inputs.persist.journal
    ctx = zmq.Context.instance()
    hub = ShardHub(ctx, "tcp://127.0.0.1:0", 2, core=core, persist=inputs.persist, ranges=((0, 6), (6, 12)),
                   clock=lambda: 0.0)
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(hub.endpoint)
        dealer.send(pack("shello", index=1, run_id=0, boot=5, endpoint="tcp://127.0.0.1:7", applied=-1, ckpt=-1,
                         token=hub.token))  # the run's shard token (ps/sharded/hub_admit.py)
        assert hub.sock.poll(5000)
        hub.receive(1.0)
        assert dealer.poll(5000)
        welcome = unpack(dealer.recv(), ("swelcome",))
        assert welcome["index"] == 1 and welcome["from"] == 0
        durable = journal.durable_lsn
        inputs.tick(2.0)  # written, not yet synced (fsync batch)
        assert journal.durable_lsn == durable < journal.next_lsn - 1
        hub.ship(1.0)
        got = []
        while dealer.poll(2000):
            head, *frames = dealer.recv_multipart()
            m = unpack(head, ("recs",))
            got += [msgpack.unpackb(f)["lsn"] for f in frames]
            if m["count"] == 0 or got[-1] == durable:
                break
        assert got == list(range(durable + 1))  # from the journal's segments: the tap began after the start record
        journal.sync()
        hub.ship(1.0)
        assert dealer.poll(2000)
        head, *frames = dealer.recv_multipart()
        assert [msgpack.unpackb(f)["lsn"] for f in frames] == [journal.next_lsn - 1]  # from the tap, once durable
    finally:
        dealer.close(linger=0)
        hub.close()


def test_a_worker_asks_a_shard_again_only_on_evidence_that_it_lost_a_fetch():
    """A shard busy sending earlier slices over a slow link is never asked again (it would send
    the same slices twice); a fetch it lost is: it answered a later one, or it fell silent."""
    from protocol.codec import decode
    from worker.shards import REFETCH_FIRST_S, ShardLinks

    ctx = zmq.Context.instance()
    shard = ctx.socket(zmq.ROUTER)
    shard.linger = 0
    shard.bind("tcp://127.0.0.1:0")
    links = ShardLinks(ctx, ((shard.getsockopt_string(zmq.LAST_ENDPOINT), 0, 4),), b"w1/1")
    t = [100.0]
    links.clock = lambda: t[0]

    def job(j: int, points=()) -> Job:
        return Job(job_id=j, kind=1, created_at=j, iterate_ids=(j,), seed=j, point_ids=(j,) if points else (),
                   points=points)

    def fetched(n: int) -> list[int]:
        got = []
        for _ in range(n):
            assert shard.poll(5000), f"expected {n} fetches, got {got}"
            rid, *frames = shard.recv_multipart()
            got.append(decode(frames).job_id)
        assert not shard.poll(100), "a fetch more than expected"
        return got

    def answer(j: int) -> None:
        shard.send_multipart([b"w1/1", *encode(job(j, (np.zeros(4, np.float32),)))])
        for _ in range(50):
            if links.socks[0].poll(100):
                break
        links.receive(0)

    try:
        for j in (1, 2, 3):
            links.fetch(job(j), (j,), t[0])
        assert fetched(3) == [1, 2, 3]
        # Before any answer: silence for REFETCH_FIRST_S since the asks means lost (a restarted shard).
        t[0] += REFETCH_FIRST_S - 0.5
        links.refetch(t[0])
        assert fetched(0) == []
        # The shard answers job 1 after 9.5 s: it is busy on a slow link. Job 2 and 3 are not asked
        # again while it keeps sending (here: 4 x 9.5 s of wait, after its latest message).
        answer(1)
        for _ in range(3):
            t[0] += 30.0
            links.refetch(t[0])
            answer(99)  # anything from the shard (an unrelated job's slice) is a sign of life
        assert fetched(0) == []
        # It answers job 3, asked after job 2: job 2 was lost there, and is asked again at once.
        answer(3)
        links.refetch(t[0])
        assert fetched(1) == [2]
        # Silent for 4 x the slowest answer since: asked again.
        t[0] += 4 * links.slowest + 0.1
        links.refetch(t[0])
        assert fetched(1) == [2]
        answer(2)
        assert links.assembling == {}
    finally:
        links.close()
        shard.close(linger=0)


def test_a_shard_off_loopback_needs_keys_or_insecure_and_bad_keys_are_one_line(tmp_path):
    from click.testing import CliRunner

    from ps.cli.main import main

    r = CliRunner().invoke(main, ["shard", "--coordinator", "tcp://127.0.0.1:9", "--bind", "tcp://0.0.0.0:0"])
    assert r.exit_code == 2 and "without --keys" in r.output and "--insecure" in r.output, r.output
    (tmp_path / "keys").mkdir()
    r = CliRunner().invoke(main, ["shard", "--coordinator", "tcp://127.0.0.1:9", "--keys", str(tmp_path / "keys")])
    assert r.exit_code == 2 and "cannot read key pair" in r.output, r.output


def test_a_restored_shard_bound_off_loopback_is_refused_before_it_binds_again(tmp_path, monkeypatch):
    """``--state`` remembers the address the shard bound; a restart without --keys or --insecure
    is refused when that address is off loopback, before any Shard (and its bind) exists."""
    import json

    from click.testing import CliRunner

    import ps.sharded.shard
    from ps.cli.main import main

    state = tmp_path / "s"
    state.mkdir()
    (state / ps.sharded.shard.SHARD_FILE).write_text(json.dumps({"run_id": 7, "index": 1, "shards": 2, "endpoint": "",
                                                         "bind": "tcp://0.0.0.0:47001"}))
    built = []
    monkeypatch.setattr(ps.sharded.shard, "Shard",
                        lambda *a, **k: built.append(a) or (_ for _ in ()).throw(AssertionError))
    r = CliRunner().invoke(main, ["shard", "--coordinator", "tcp://127.0.0.1:9", "--state", str(state)])
    assert r.exit_code == 2 and "--state binds tcp://0.0.0.0:47001" in r.output and "--insecure" in r.output, r.output
    assert built == [], "refused before the shard was built"
    (state / ps.sharded.shard.SHARD_FILE).write_text("{not json")
    r = CliRunner().invoke(main, ["shard", "--coordinator", "tcp://127.0.0.1:9", "--state", str(state)])
    assert r.exit_code != 0 and "cannot be read" in r.output and built == [], r.output


def test_the_hub_gives_the_reply_its_blocks_squared_norms_in_shard_order(run, hub):
    """clip_norm: each shard's have carries its blocks' squared norms; the reply the core gets has
    them all, in block (shard) order whatever order the haves came in, and none when a shard sent
    none (the core then has nothing to clip by, and every shard's check of the record fails)."""
    core, inputs, _shard, _sent, _ = run
    e0, e1 = core.ledger[0], core.ledger[1]
    empty = (np.empty(0, np.float32),)
    item = SimpleNamespace(msg=Reply(job_id=0, created_at=e0.created_at, grads=empty), wid="w1")
    assert hub.take_reply(item, 10.0)
    hub._on_haves(hub.slots[1], [(0, e0.created_at, 0, "", (3.0,))], 10.1)
    hub._on_haves(hub.slots[0], [(0, e0.created_at, 0, "", (1.0, 2.0))], 10.2)
    (it, refusal), = hub.ready_replies(10.3)
    assert refusal is None and it.msg.block_sq == (1.0, 2.0, 3.0) and it.wid == "w1"
    assert item.msg.block_sq is None  # the held header itself is not changed
    item1 = SimpleNamespace(msg=Reply(job_id=1, created_at=e1.created_at, grads=empty), wid="w1")
    assert hub.take_reply(item1, 11.0)
    hub._on_haves(hub.slots[0], [(1, e1.created_at, 0, "", (1.0, 2.0))], 11.1)
    hub._on_haves(hub.slots[1], [(1, e1.created_at, 0, "")], 11.2)
    (it, refusal), = hub.ready_replies(11.3)
    assert refusal is None and it.msg.block_sq is None


def test_a_journaled_reply_keeps_its_block_norms_and_a_damaged_bsq_does_not_read():
    from ps.journal.records import check_record as _check_record

    reply = {"job_id": 1, "created_at": 0, "loss": 0.5, "count": 0, "compute_s": 0.1, "holds": []}
    assert _check_record({"lsn": 3, "op": "reply", "wid": "w", "now": 1.0, "reply": {**reply, "bsq": [1.0, 0]}}) is None
    assert _check_record({"lsn": 3, "op": "reply", "wid": "w", "now": 1.0, "reply": reply}) is None
    for bad in ([-1.0], [float("inf")], ["1"], 1.0):
        assert "bsq" in _check_record({"lsn": 3, "op": "reply", "wid": "w", "now": 1.0, "reply": {**reply, "bsq": bad}})
        assert "bsq" in _check_record({"lsn": 3, "op": "msg", "wid": "w", "now": 1.0, "frames": [b"x"], "bsq": bad})


def test_the_hub_gathers_a_steps_norms_one_reply_at_a_time(run, hub):
    """lmo='l2': a reply whose blocks are all in waits for every shard's figures of its step
    (reduce?), one reply at a time, and the next reduction starts only after the core has taken the
    last one's reply (so its record is among those the shards apply first); a job settled
    meanwhile ends the reduction (the core counts the reply late)."""
    core, inputs, _shard, _sent, _ = run
    hub.step_norms = True  # as for a coordinator whose algorithm needs_step_norms
    empty = (np.empty(0, np.float32),)
    items = []
    for jid in (0, 1):
        e = core.ledger[jid]
        items.append(SimpleNamespace(msg=Reply(job_id=jid, created_at=e.created_at, grads=empty), wid="w1"))
        assert hub.take_reply(items[-1], 10.0)
        for slot in hub.slots:
            hub._on_haves(slot, [(jid, e.created_at, 0, "")], 10.1)
    assert hub.ready_replies(10.2) == []
    r = hub.reducing
    assert r["jid"] == 0 and r["after"] == inputs.persist.journal.next_lsn - 1 and list(hub.pending) == [1]
    assert sorted(hub.pending_for("w1")) == [0, 1]  # both still busy for the core's reconciliation
    r["parts"][1] = (4.0,)
    assert hub.ready_replies(10.3) == []  # shard 0 has not answered
    r["parts"][0] = (1.0, 2.0)
    (it, refusal), = hub.ready_replies(10.4)
    assert refusal is None and it.msg.step_sq == (1.0, 2.0, 4.0) and it.msg.job_id == 0
    assert hub.reducing is None and list(hub.pending) == [1]  # not in the same pass as the core takes job 0
    inputs.message("w1", it.msg, 10.5)  # the core applies job 0 (journaled)
    assert hub.ready_replies(10.6) == [] and hub.reducing["jid"] == 1
    assert hub.reducing["after"] == inputs.persist.journal.next_lsn - 1
    inputs.remove("w1", 10.7, "gone")  # job 1 written off meanwhile
    (it, refusal), = hub.ready_replies(10.8)
    assert it is items[1] and refusal is None and hub.reducing is None and hub.reductions == 1
