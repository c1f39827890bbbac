"""Persistence pieces: exact trees, atomic checkpoints with fallback, a journal with a torn tail."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from ps.persist import (
    Journal,
    latest_checkpoint,
    pack_tree,
    read_checkpoint,
    read_journal,
    unpack_tree,
    write_checkpoint,
)


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

    from ps.persist import read_run, run_wire_dtype, write_run

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
    from ps.core import CoreConfig, ServerCore

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
    from ps.persist import recompute_reply
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
    from ps.core import Send
    from ps.persist import Persistence, read_run, recover, write_run
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
