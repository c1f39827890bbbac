"""Persistence pieces: exact trees, atomic checkpoints with fallback, a journal with a torn tail."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from ps.journal.checkpoints import latest_checkpoint, pack_tree, read_checkpoint, unpack_tree, write_checkpoint
from ps.journal.segments import read_journal
from ps.journal.wal import Journal


def tricky():
    rng = np.random.default_rng(3)
    return {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "t": (1, 2.5, "x"), "s": {3, 1},
            "ints": {5: "five", -1: [np.float64(0.1), np.int64(7)]}, "big": 1 << 100, "none": None,
            "rng": rng.bit_generator.state, "nested": [[np.zeros(0, np.int8)], {"__odd": True}], "b": b"\x00\x01"}


def same(x, y):
    if isinstance(x, np.ndarray) or isinstance(x, np.generic):
        return type(x) is type(y) and x.dtype == y.dtype and np.array_equal(x, y)
    if isinstance(x, dict):
        return type(y) is dict and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))
    return type(x) is type(y) and x == y


def test_pack_tree_round_trip_is_exact():
    tree, arrays = pack_tree(tricky())
    assert same(unpack_tree(tree, arrays), tricky())
    with pytest.raises(TypeError):
        pack_tree({"f": lambda: 0})


def test_checkpoint_round_trip_and_fallback_to_previous(tmp_path, caplog):
    d = str(tmp_path)
    write_checkpoint(d, 10, {"v": 1, "x": np.ones(4)})
    write_checkpoint(d, 20, {"v": 2, "x": np.full(4, 2.0)})
    lsn, snap = read_checkpoint(os.path.join(d, "ckpt-000000000020.bin"))
    assert lsn == 20 and snap["v"] == 2 and np.array_equal(snap["x"], np.full(4, 2.0))
    assert not any(n.endswith(".tmp") for n in os.listdir(d)), "no temp file is left behind"
    path = os.path.join(d, "ckpt-000000000020.bin")
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF  # one flipped bit in the middle
    open(path, "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        read_checkpoint(path)
    with caplog.at_level(logging.WARNING):
        lsn, snap = latest_checkpoint(d)
    assert lsn == 10 and snap["v"] == 1 and "corrupt checkpoint" in caplog.text


def test_checkpoint_keeps_the_newest_three(tmp_path):
    for lsn in range(5):
        write_checkpoint(str(tmp_path), lsn, {"v": lsn})
    assert sorted(os.listdir(tmp_path)) == [f"ckpt-{i:012d}.bin" for i in (2, 3, 4)]


@pytest.mark.parametrize("cut", [1, 5, 9, 30])
def test_journal_torn_tail_is_ignored_with_a_warning(tmp_path, caplog, cut):
    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="always")
    for i in range(5):
        j.append("tick", now=float(i), pad="x" * 20)
    j.close()
    path = j.path
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - cut)  # the last record is torn
    with caplog.at_level(logging.WARNING):
        recs = list(read_journal(d))
    assert [r.lsn for r in recs] == [0, 1, 2, 3]
    assert "torn" in caplog.text
    # the next incarnation writes a new segment; reading goes on past the torn tail
    j2 = Journal(d, next_lsn=4, fsync="batch")
    j2.append("restart", now=9.0)
    j2.close()
    assert [r.lsn for r in read_journal(d)] == [0, 1, 2, 3, 4]
    assert [r.lsn for r in read_journal(d, from_lsn=3)] == [3, 4]


def test_journal_rejects_a_bad_fsync_policy(tmp_path):
    with pytest.raises(ValueError):
        Journal(str(tmp_path), next_lsn=0, fsync="sometimes")


# --------------------------------------------------------------------------- wire dtype (PROTOCOL.md §6.12)

def test_run_json_records_the_wire_dtype_and_defaults_to_f32(tmp_path):
    import json

    from ps.journal.runfile import read_run, run_wire_dtype, write_run

    d = str(tmp_path)
    write_run(d, {"problem": "quadratic"})
    assert read_run(d)["wire_dtype"] == "f32"
    assert json.loads((tmp_path / "run.json").read_text())["wire_dtype"] == "f32", "stored, not only defaulted"
    write_run(d, {"problem": "quadratic", "wire_dtype": "bf16"})
    assert read_run(d)["wire_dtype"] == "bf16"
    (tmp_path / "run.json").write_text(json.dumps({"problem": "quadratic"}))  # a state dir from before the option
    assert read_run(d)["wire_dtype"] == "f32"
    assert run_wire_dtype(None) == "f32" and run_wire_dtype({"core": {"wire_dtype": "f16"}}) == "f16"
    with pytest.raises(ValueError, match="unknown wire dtype"):
        write_run(d, {"wire_dtype": "f8"})


def _core(d=16, workers=2):
    import algorithms
    from problems import load_problem
    from ps.core.config import CoreConfig
    from ps.core.server_core import ServerCore

    problem = load_problem("quadratic", {"d": d})
    cfg = CoreConfig(problem="quadratic", problem_options={"d": d}, min_workers=workers, liveness_timeout_s=1e9,
                     seed=0, run_id=7)
    alg = algorithms.build("asgd", {"lr": 0.3})
    x0 = problem.init_params(0) + np.linspace(-0.3, 0.3, d, dtype=np.float32)  # low bits set: bf16 rounds them
    return (lambda: ServerCore(alg, x0, cfg, server_boot=1, now=0.0)), (
        lambda snap: ServerCore.restore(alg, snap, cfg, server_boot=1)), problem


def test_recomputed_reply_under_bf16_is_the_roundtrip_of_the_float32_gradient():
    from protocol.messages import Hello, Job, Ready
    from protocol.wire import roundtrip
    from ps.journal.replies import recompute_reply
    from worker.compute import run_job

    factory, _, problem = _core(workers=1)
    core = factory()
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1), 0.0)
    jobs = [c.msg for c in core.handle("w1", Ready(credit=1), 0.0) if isinstance(c.msg, Job)]
    assert len(jobs) == 1
    job = jobs[0]
    fields = {"job_id": job.job_id, "created_at": job.created_at, "loss": 0.0, "count": 1, "compute_s": 0.0,
              "holds": []}
    x = core.store[job.iterate_ids[0]]
    assert not np.array_equal(roundtrip(x, "bf16"), x), "the iterate has bits bf16 drops"
    want = roundtrip(run_job(job, [roundtrip(x, "bf16")], problem).grads[0], "bf16")
    got = recompute_reply(core, "w1", fields, problem, "bf16").grads[0]
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(roundtrip(got, "bf16"), got)
    plain = recompute_reply(core, "w1", fields, problem).grads[0]  # default f32: unchanged behaviour
    assert np.array_equal(plain, run_job(job, [x], problem).grads[0])
    assert not np.array_equal(plain, got)


@pytest.mark.parametrize("wire, payloads", [("bf16", False), ("bf16", True), ("f16", False)])
def test_recovery_of_a_reduced_precision_run_is_bit_exact(tmp_path, wire, payloads):
    """Drive a core the way the daemon does under --wire-dtype (points quantized on the way out,
    reply frames in the wire dtype converted on the way in), then recover it from the journal."""
    import dataclasses
    from collections import deque

    from protocol.codec import encode
    from protocol.messages import Hello, Job, Ready, Reply
    from protocol.wire import from_wire, to_wire
    from ps.core.commands import Send
    from ps.journal.persistence import Persistence
    from ps.journal.recovery import recover
    from ps.journal.runfile import read_run, write_run
    from worker.compute import run_job

    d = str(tmp_path)
    write_run(d, {"problem": "quadratic", "wire_dtype": wire})
    assert read_run(d)["wire_dtype"] == wire
    factory, restore, problem = _core()
    core = factory()
    pers = Persistence(d, Journal(d, next_lsn=0, fsync="never"), checkpoint_every=0, checkpoint_interval_s=0,
                       log_payloads=payloads)
    caches: dict[str, dict[int, np.ndarray]] = {"w1": {}, "w2": {}}
    todo: deque = deque()
    now = 0.0

    def feed(wid, wire_msg):
        msg = wire_msg
        if isinstance(wire_msg, Reply):  # the daemon converts the frames before the core sees them
            msg = dataclasses.replace(wire_msg, grads=tuple(from_wire(g, wire) for g in wire_msg.grads))
        pers.record_message(core, wid, msg, encode(wire_msg), now)
        for c in core.handle(wid, msg, now):
            if isinstance(c, Send) and isinstance(c.msg, Job):
                for iid, p in zip(c.msg.point_ids, c.msg.points, strict=True):  # quantized in transit
                    caches[c.worker_id][iid] = from_wire(to_wire(p, wire), wire)
                todo.append((c.worker_id, c.msg))

    for wid in caches:
        feed(wid, Hello(worker_id=wid, boot=1, credit=1, run_id=7))
        feed(wid, Ready(credit=1))
    while todo and core.version < 40:
        now += 1.0
        wid, job = todo.popleft()
        r = run_job(job, [caches[wid][i] for i in job.iterate_ids], problem)
        feed(wid, Reply(job_id=r.job_id, created_at=r.created_at, grads=tuple(to_wire(g, wire) for g in r.grads),
                        loss=r.loss, count=r.count, compute_s=0.0, holds=tuple(caches[wid])))
    pers.close()
    assert core.version == 40
    live = np.array(core.params(), copy=True)
    ops = {r.op for r in read_journal(d)}
    assert ("msg" if payloads else "reply") in ops
    rec, _, n = recover(factory, restore, d, problem)  # the wire dtype comes from run.json
    assert n == 44 and rec.version == 40  # 2 hellos, 2 readies, 40 replies
    assert np.array_equal(rec.params(), live), "bit-exact"
    if not payloads:  # recomputed as f32, the replay would drift: the wire dtype matters
        plain, _, _ = recover(factory, restore, d, problem, wire_dtype="f32")
        assert not np.array_equal(plain.params(), live)


# --------------------------------------------------------------------------- hostile input (issue 13, 8 and 11)

def _drive(pers, core, problem, steps, *, after_batch=False, now0=0.0):
    """Two workers replying in turn, fed through ``pers`` as the daemon feeds them. Returns now."""
    from collections import deque

    from protocol.codec import encode
    from protocol.messages import Hello, Job, Ready, Reply
    from ps.core.commands import Send
    from worker.compute import run_job

    todo: deque = deque()
    now = now0

    def feed(wid, msg):
        if pers.record_message(core, wid, msg, encode(msg), now):
            todo.extend((c.worker_id, c.msg) for c in core.handle(wid, msg, now)
                        if isinstance(c, Send) and isinstance(c.msg, Job))
        if after_batch:
            pers.after_batch(core, now)

    if not core.workers:
        for wid in ("w1", "w2"):
            feed(wid, Hello(worker_id=wid, boot=1, credit=1, run_id=7))
            feed(wid, Ready(credit=1))
    else:
        todo.extend((e.worker_id, core._job_message(e, core.workers[e.worker_id])) for e in core.ledger.values())
    target = core.version + steps
    while todo and core.version < target:
        now += 1.0
        wid, job = todo.popleft()
        r = run_job(job, [core.store[i] for i in job.iterate_ids], problem)
        feed(wid, Reply(job_id=r.job_id, created_at=r.created_at, grads=r.grads, loss=r.loss, count=r.count,
                        compute_s=0.0, holds=()))
    return now


def test_messages_are_journaled_as_decoded_not_with_their_padding(tmp_path):
    import msgpack

    from protocol.codec import decode, encode
    from protocol.messages import Heartbeat, Hello
    from ps.journal.persistence import Persistence
    from ps.journal.recovery import apply_record

    factory, _, problem = _core()
    core = factory()
    d = str(tmp_path)
    pers = Persistence(d, Journal(d, next_lsn=0, fsync="never"), checkpoint_every=0, checkpoint_interval_s=0)
    hello = Hello(worker_id="w1", boot=1, credit=1)
    pers.record_message(core, "w1", hello, encode(hello), 0.0)
    core.handle("w1", hello, 0.0)
    hb = Heartbeat(boot=1, credit=1, busy=(3, 4), seen=4)
    header = msgpack.unpackb(encode(hb)[0])
    header.update({f"pad{i}": "x" * 4000 for i in range(15)})
    header["arrays"] = []
    frames = [msgpack.packb(header, use_bin_type=True)]
    assert len(frames[0]) > 60_000 and decode(frames) == hb
    assert pers.record_message(core, "w1", decode(frames), frames, 1.0)
    pers.close()
    recs = list(read_journal(d))
    assert len(msgpack.packb(recs[-1].body, use_bin_type=True)) < 150, "the padding is not journaled"
    assert decode(recs[-1].body["frames"]) == hb
    fresh = factory()
    for r in recs:
        apply_record(fresh, r, problem)
    assert fresh.workers["w1"].credit == 1


def test_a_write_the_disk_refuses_leaves_no_partial_record(tmp_path, monkeypatch):
    import errno


    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="never")
    j.append("tick", now=0.0)
    size = os.path.getsize(j.path)
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 4:
            return real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match="No space"):
        j.append("tick", now=1.0, pad="x" * 100)
    assert os.path.getsize(j.path) == size, "cut back to the record's start"
    monkeypatch.setattr(os, "write", real_write)
    j.append("tick", now=2.0)
    j.close()
    assert [(r.lsn, r.body["now"]) for r in read_journal(d)] == [(0, 0.0), (1, 2.0)]


def test_a_full_disk_pauses_persistence_and_it_resumes_exactly(tmp_path, monkeypatch, caplog):
    import errno

    from ps.journal.persistence import Persistence
    from ps.journal.recovery import recover

    d = str(tmp_path)
    factory, restore, problem = _core()
    core = factory()
    pers = Persistence(d, Journal(d, next_lsn=0, fsync="never"), checkpoint_every=0, checkpoint_interval_s=0)
    now = _drive(pers, core, problem, 10)
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    version = core.version
    with caplog.at_level(logging.ERROR, logger="latecomer.persist"):
        now = _drive(pers, core, problem, 5, after_batch=True, now0=now)
    assert pers.paused and "No space left on device" in pers.paused and "issuing no jobs" in caplog.text
    assert core.version == version, "nothing reached the core while paused"
    assert pers.status()["paused"] == pers.paused and not pers.append("tick", now=now)
    monkeypatch.setattr(os, "write", real_write)
    pers.next_probe = 0.0
    pers.after_batch(core, now)  # the probe: space is back
    assert pers.paused is None and any(r.op == "resume" for r in read_journal(d))
    _drive(pers, core, problem, 10, now0=now + 10)
    pers.close()
    assert core.version >= version + 10
    rec, _, _ = recover(factory, restore, d, problem)
    assert np.array_equal(rec.params(), core.params()) and rec.counters.as_dict() == core.counters.as_dict()


def test_the_journal_stays_within_its_bound_and_recovery_and_replay_still_work(tmp_path):
    from ps.journal.persistence import Persistence
    from ps.journal.recovery import recover
    from ps.journal.segments import first_journal_lsn

    d = str(tmp_path)
    factory, restore, problem = _core()
    core = factory()
    bound = 16 << 10
    pers = Persistence(d, Journal(d, next_lsn=0, fsync="never"), checkpoint_every=0, checkpoint_interval_s=0,
                       max_journal_bytes=bound)
    sizes = []
    now = 0.0
    for _ in range(20):
        now = _drive(pers, core, problem, 50, after_batch=True, now0=now)
        sizes.append(pers.journal.total_bytes())
    pers.close()
    assert core.version >= 1000 and pers.segments_removed > 0 and first_journal_lsn(d) > 0
    assert max(sizes) <= bound, sizes
    assert sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.startswith("wal-")) <= bound
    rec, _, _ = recover(factory, restore, d, problem)
    assert np.array_equal(rec.params(), core.params())
    # the newest checkpoint damaged: recovery falls back to an older one, the journal still covers it
    newest = sorted(n for n in os.listdir(d) if n.startswith("ckpt-"))[-1]
    raw = bytearray(open(os.path.join(d, newest), "rb").read())
    raw[40] ^= 0xFF
    open(os.path.join(d, newest), "wb").write(bytes(raw))
    rec, _, _ = recover(factory, restore, d, problem)
    assert np.array_equal(rec.params(), core.params())


def _segment(d, number, records):
    import zlib

    import msgpack

    from ps.journal.records import REC_HEADER

    out = b""
    for body in records:
        data = msgpack.packb(body, use_bin_type=True)
        out += REC_HEADER.pack(len(data), zlib.crc32(data)) + data
    path = os.path.join(d, f"wal-{number:06d}.log")
    with open(path, "wb") as f:
        f.write(out)
    return path, out


def test_damaged_journals_are_errors_naming_file_and_offset(tmp_path, caplog):
    from ps.journal.segments import cut_torn_tail
    from ps.journal.statedir import StateError

    d = str(tmp_path)
    ticks = [{"lsn": i, "op": "tick", "now": float(i)} for i in range(4)]
    path, data = _segment(d, 1, ticks)
    # a CRC failure followed by more records: not a torn tail
    raw = bytearray(data)
    raw[12] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    with pytest.raises(StateError, match=r"wal-000001.log: record at byte 0 fails its checksum"):
        list(read_journal(d))
    # a record without lsn, with a valid checksum
    _segment(d, 1, ticks[:2] + [{"op": "tick", "now": 2.0}])
    with pytest.raises(StateError, match=r"record at byte \d+ is not a journal record: no valid 'lsn'"):
        list(read_journal(d))
    for bad, why in (({"lsn": 2, "op": "tick"}, "'now'"), ({"lsn": 2, "op": "launch"}, "unknown op"),
                     ({"lsn": 5, "op": "tick", "now": 1.0}, "LSN 5 after LSN 1"),
                     ({"lsn": 2, "op": "msg", "wid": "w", "now": 1.0, "frames": ["x"]}, "byte strings")):
        _segment(d, 1, ticks[:2] + [bad])
        with pytest.raises(StateError, match=why):
            list(read_journal(d))
    # a torn tail ending an earlier segment: accepted only if the next incarnation's restart follows
    path, data = _segment(d, 1, ticks)
    open(path, "wb").write(data[:-3])
    _segment(d, 2, [{"lsn": 3, "op": "tick", "now": 9.0}])
    with pytest.raises(StateError, match="cut short or garbled, and the journal goes on"):
        list(read_journal(d))
    _segment(d, 2, [{"lsn": 3, "op": "restart", "now": 9.0}])
    with caplog.at_level(logging.WARNING):
        assert [r.lsn for r in read_journal(d)] == [0, 1, 2, 3]
    assert "torn" in caplog.text
    # the torn tail of the last segment is cut off when a server resumes
    os.remove(os.path.join(d, "wal-000002.log"))
    assert cut_torn_tail(d) is not None and [r.lsn for r in read_journal(d)] == [0, 1, 2]
    assert cut_torn_tail(d) is None
    open(os.path.join(d, "wal-abc.log"), "wb").close()
    with pytest.raises(StateError, match="wal-abc.log: unexpected file"):
        list(read_journal(d))


def test_damaged_checkpoints_are_refused_or_skipped(tmp_path, caplog):
    from ps.journal.recovery import recover

    d = str(tmp_path)
    path = write_checkpoint(d, 5, {"x": np.ones(3)})
    os.rename(path, os.path.join(d, "ckpt-000000000007.bin"))
    with pytest.raises(ValueError, match="holds LSN 5, its name says 7"):
        read_checkpoint(os.path.join(d, "ckpt-000000000007.bin"))
    os.remove(os.path.join(d, "ckpt-000000000007.bin"))
    # a checkpoint whose snapshot verifies but does not restore is skipped for the previous one
    factory, restore, problem = _core()
    core = factory()
    from ps.journal.persistence import Persistence

    pers = Persistence(d, Journal(d, next_lsn=0, fsync="never"), checkpoint_every=0, checkpoint_interval_s=0)
    now = _drive(pers, core, problem, 10)
    pers.checkpoint(core)
    now = _drive(pers, core, problem, 10, now0=now)
    pers.journal.append("checkpoint", version=core.version)
    write_checkpoint(d, pers.journal.next_lsn - 1, {"format": 1, "algorithm": "asgd"})  # no "dim", no "ledger"...
    pers.close()
    with caplog.at_level(logging.WARNING):
        rec, _, _ = recover(factory, restore, d, problem)
    assert "does not restore (KeyError" in caplog.text
    assert np.array_equal(rec.params(), core.params())


def test_run_json_that_does_not_read_is_one_line(tmp_path):
    from ps.journal.runfile import read_run
    from ps.journal.statedir import StateError

    d = str(tmp_path)
    (tmp_path / "run.json").write_text("{nope")
    with pytest.raises(StateError, match="run.json: cannot be read"):
        read_run(d)
    (tmp_path / "run.json").write_text("[1, 2]")
    with pytest.raises(StateError, match="not a run description"):
        read_run(d)
    (tmp_path / "run.json").write_text('{"problem": 3}')
    with pytest.raises(StateError, match="'problem' must be a str"):
        read_run(d)
    (tmp_path / "run.json").write_text('{"problem": "quadratic"}')
    assert read_run(d)["problem"] == "quadratic"
    with pytest.raises(StateError, match="no 'problem_options'"):
        read_run(d, complete=True)
    (tmp_path / "wal-000001.log").write_bytes(b"x")
    with pytest.raises(StateError, match="no run description"):
        Journal(d, next_lsn=0)


# --------------------------------------------------------------------------- the lock (issue 13, 10)

def test_the_state_lock_refuses_a_second_server_and_names_only_its_holder(tmp_path):
    import psutil

    from ps.journal.lock import StateLock, locked_server
    from ps.journal.statedir import StateError

    d = str(tmp_path)
    with pytest.raises(StateError, match="no server.pid"):
        locked_server(d)
    lock = StateLock(d)
    with pytest.raises(StateError, match=rf"in use by another server \(pid {os.getpid()}\)"):
        StateLock(d)
    proc, fd = locked_server(d)  # verified: this process holds it, with its start time
    os.close(fd)
    assert proc.pid == os.getpid() and proc.create_time() == psutil.Process().create_time()
    pid_file = tmp_path / "server.pid"
    for text, why in (("-1", "does not name a process"), ("garbage", "does not name a process"),
                      (f"{os.getppid()} {psutil.Process(os.getppid()).create_time()!r}", "the lock is held by"),
                      (f"{os.getpid()} 1.5", "another start time")):
        os.pwrite(lock.fd, text.ljust(60).encode(), 0)
        with pytest.raises(StateError, match=why):
            locked_server(d)
    lock.release()
    assert not pid_file.exists()
    pid_file.write_text(f"{os.getpid()} {psutil.Process().create_time()!r}\n")  # left by a crash: nobody holds it
    with pytest.raises(StateError, match="no server is running .* nothing was signalled"):
        locked_server(d)
    StateLock(d).release()  # a new server takes a stale file over


def test_the_event_log_drops_what_the_disk_refuses_and_goes_on(tmp_path, monkeypatch, caplog):
    import errno

    from ps.journal.events import EventLog

    path = str(tmp_path / "events.jsonl")
    ev = EventLog(path)
    ev.write('{"ev": 1}\n')
    ev.flush()
    real_write = os.write
    calls = []

    def partial_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:3]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", partial_then_full)
    ev.write('{"ev": 2}\n{"ev": 3}\n')
    with caplog.at_level(logging.WARNING, logger="latecomer.persist"):
        ev.flush()
        monkeypatch.setattr(os, "write", real_write)
        ev.write('{"ev": 4}\n')
        ev.close()
    assert open(path).read() == '{"ev": 1}\n{"ev": 4}\n' and ev.dropped == 2
    assert "cannot write the event log" in caplog.text and "written again (2 events were dropped)" in caplog.text


def test_the_event_log_writes_each_event_as_a_json_line_that_reads_back_to_it_in_the_order_given(tmp_path,
                                                                                                  monkeypatch):
    """Events are serialized at the flush (ps/journal/events.py): a batch of plain events by
    msgspec in one call, compact; a batch holding NaN, an infinity, None, a non-ASCII string or a
    value msgspec refuses by the json module, as ``json.dumps(ev, separators=(",", ":"))``, so
    that NaN stays NaN and no line holds a byte other than ASCII (a raw U+2028 would break
    ``str.splitlines``). Either way each line reads back to its event; text and batches keep the
    order they were written in."""
    import json
    import math

    import ps.journal.events as events_mod
    from ps.journal.events import EventLog, event_line, event_lines

    plain = [{"ev": "issued", "job_id": 19291, "worker_id": "b2", "kind": 1, "created_at": 19290,
              "seed": 366194951714635779, "t": 24916.63440611},
             {"ev": "applied", "job_id": 19290, "worker_id": "b2", "age": 1, "seed": 8812420083799099457,
              "t": 24916.63440611, "key": "", "flag": True, "ids": [1, 2], "tiny": 1e-300, "big": 1e22}, {}]
    odd = [{"ev": "failed", "worker_id": "wé\n\"x\u2028", "message": "line\nbreak", "loss": math.nan,
            "inf": -math.inf, "none": None, "t": 1e-300},
           {"ev": "evaluated", "loss": math.nan}, {"ev": "x", "none": None}, {"ev": "x", "s": "\udc80"},
           {"ev": "x", "v": np.float64(0.5)}, {"ev": "x", "w": "é"}]

    def same(a, b):  # == with NaN equal to NaN
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)

    calls = []
    monkeypatch.setattr(events_mod, "event_line", lambda ev: calls.append(ev) or event_line(ev))
    data = event_lines(plain)
    assert not calls, "plain events: msgspec, in one call"
    assert data.isascii() and data.count(b"\n") == 3 and b": " not in data
    assert [json.loads(x) for x in data.splitlines()] == plain
    for ev in odd:  # each alone, and beside the plain ones: the whole batch through json
        for batch in ([ev], [*plain, ev]):
            calls.clear()
            data = event_lines(batch)
            assert calls == batch and data.isascii(), ev
            assert data == "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in batch).encode()
            back = [json.loads(x) for x in data.decode().splitlines()]
            assert len(back) == len(batch) and all(same(a, b) for a, b in zip(back, batch, strict=True))
    assert b"NaN" in event_lines([odd[1]]) and b"Infinity" in event_lines([odd[0]])
    monkeypatch.undo()
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path)
    log.write_events(plain[:1])
    log.write_events(plain[1:])
    log.write('{"ev": "text"}\n')
    log.write_events(odd[:1])
    log.write_events(plain)
    log.close()
    lines = open(path, encoding="ascii").read().splitlines()
    got = [json.loads(x) for x in lines]
    want = [*plain, {"ev": "text"}, odd[0], *plain]
    assert len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))


def test_export_of_a_checkpoint_that_does_not_restore_is_one_line(tmp_path):
    from ps.journal.runfile import write_run
    from ps.ops.export import locate

    d = str(tmp_path)
    write_run(d, {"problem": "quadratic", "problem_options": {"d": 4}, "algorithm": "asgd", "settings": {"lr": 0.1},
                  "core": {"problem": "quadratic", "problem_options": {"d": 4}, "seed": 0}})
    write_checkpoint(d, 3, {"format": 1, "algorithm": "asgd"})  # verifies, but lacks everything else
    with pytest.raises(ValueError, match=r"ckpt-000000000003.bin does not restore \(KeyError"):
        locate(d)
