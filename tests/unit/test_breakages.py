"""Tests that catch a wrong change (issue 14): each deliberate breakage named in a docstring
passed the suite before this file. Real objects throughout (ServerCore, the codec, Persistence
on a tmp directory), no mocks."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import algorithms
import ps.core.ledger
from algorithms.base import Result
from algorithms.ordered import OrderedMomentum
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import (
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    JobKind,
    Ready,
    Reply,
)
from ps.core.commands import Send
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore

D = 4


def make_core(name="asgd", settings=None, **cfg) -> ServerCore:
    cfg.setdefault("liveness_timeout_s", 3.0)
    return ServerCore(algorithms.build(name, settings or {"lr": 0.1}), np.ones(D, np.float32), CoreConfig(**cfg))


def join(core: ServerCore, wid: str, credit: int = 1, now: float = 0.0, run_id: int = 0) -> list:
    cmds = core.handle(wid, Hello(worker_id=wid, boot=1, credit=credit, run_id=run_id), now)
    return cmds + core.handle(wid, Ready(credit=credit), now)


def jobs_in(cmds) -> list[Job]:
    return [c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, Job)]


def errors_in(cmds) -> list[Error]:
    return [c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, Error)]


def good(job: Job, value: float = 0.5, **kw) -> Reply:
    n = 1 if job.kind == JobKind.FULL_GRAD else len(job.iterate_ids)
    return Reply(job_id=job.job_id, created_at=job.created_at,
                 grads=tuple(np.full(D, value, np.float32) for _ in range(n)), **kw)


def nan_reply(job: Job) -> Reply:
    return Reply(job_id=job.job_id, created_at=job.created_at, grads=(np.full(D, np.nan, np.float32),))


# --------------------------------------------------------------------------- 1. batched ordered momentum

def _result(job_id: int, created_at: int, g) -> Result:
    return Result(job_id=job_id, worker_id="w", created_at=created_at, kind=JobKind.GRAD, iterate_ids=(created_at,),
                  grads=(np.asarray(g, np.float64),))


def test_batched_ordered_momentum_matches_a_hand_computation():
    """Catches: ``batched=True`` without the (1-β) decay of m, or with the weight
    β(1-β)^(δ+1) instead of β(1-β)^δ (docs/ALGORITHMS.md §4.2: m ← (1-β) m + β Σ_j (1-β)^δ_j g_j,
    one update per apply call, x ← x - lr·m).

    Hand computation with β = 0.5, lr = 0.5, x0 = (1, 1), m0 = 0 (all exact in binary):
      k=0, batch {g_a = (1, 0), g_b = (0, 2)}, both δ = 0 (weight 0.5 each):
        m1 = 0.5·0 + 0.5·(1, 0) + 0.5·(0, 2) = (0.5, 1);        x1 = (1, 1) - 0.5·m1 = (0.75, 0.5)
      k=1, batch {g_c = (4, 0) made at 0: δ = 1 (weight 0.25), g_d = (0, 4) made at 1: δ = 0 (0.5)}:
        m2 = 0.5·(0.5, 1) + 0.25·(4, 0) + 0.5·(0, 4) = (1.25, 2.5); x2 = (0.75, 0.5) - 0.5·m2 = (0.125, -0.75)
      k=2, batch {g_e = (8, -8) made at 0: δ = 2 (weight 0.125)}:
        m3 = 0.5·(1.25, 2.5) + 0.125·(8, -8) = (1.625, 0.25);  x3 = (0.125, -0.75) - 0.5·m3 = (-0.6875, -0.875)
    """
    alg = OrderedMomentum(lr=0.5, beta=0.5, batched=True)
    state, _ = alg.init(np.array([1.0, 1.0]), seed=0)
    batches = [[_result(0, 0, (1, 0)), _result(1, 0, (0, 2))],
               [_result(2, 0, (4, 0)), _result(3, 1, (0, 4))],
               [_result(4, 0, (8, -8))]]
    want_m = [(0.5, 1.0), (1.25, 2.5), (1.625, 0.25)]
    want_x = [(0.75, 0.5), (0.125, -0.75), (-0.6875, -0.875)]
    want_ages = [(0, 0), (1, 0), (2,)]
    for k, batch in enumerate(batches):
        state, out = alg.apply(state, batch)
        assert state.version == k + 1, "one update per apply call, however many results"
        assert out.applied == tuple(r.job_id for r in batch) and out.ages == want_ages[k] and out.updated
        np.testing.assert_array_equal(state.m, want_m[k])
        np.testing.assert_array_equal(state.x, want_x[k])


# --------------------------------------------------------------------------- 2. bad-reply streak

def test_a_good_reply_resets_the_bad_reply_streak():
    """Catches: the bad-reply streak (``bad_in_a_row``) never reset by an accepted reply, so a
    worker with occasional bad replies is quarantined although it never sent
    ``max_bad_replies`` in a row."""
    core = make_core(max_bad_replies=3)
    job = jobs_in(join(core, "w1"))[0]
    for i, kind in enumerate(("bad", "bad", "good", "bad", "bad")):
        cmds = core.handle("w1", nan_reply(job) if kind == "bad" else good(job), 0.1)
        assert "w1" in core.workers and core.counters.quarantined == 0, \
            f"quarantined at reply {i + 1}, with at most two bad replies in a row since the good one"
        job = jobs_in(cmds)[0]
    assert core.workers["w1"].bad_in_a_row == 2
    core.handle("w1", nan_reply(job), 0.2)  # the third in a row
    assert "w1" not in core.workers and core.counters.quarantined == 1
    assert core.accounted()


# --------------------------------------------------------------------------- 3. FULL_GRAD shard count

def test_a_full_grad_reply_with_the_wrong_count_is_refused_by_the_core():
    """Catches: the core's FULL_GRAD check ``count == hi - lo`` removed (PROTOCOL.md §8.2 step 5).
    The snapshot algorithm would drop such a shard on its own, so the test looks at the core's
    answer: err BAD_SHAPE naming the count, the job rejected (not buffered), the counter."""
    core = make_core("snapshot-vr", {"lr": 0.1, "num_samples": 8, "shards": 2})
    full = jobs_in(join(core, "w1", credit=2))
    assert [(j.kind, j.shard) for j in full] == [(JobKind.FULL_GRAD, (0, 4)), (JobKind.FULL_GRAD, (4, 8))]
    cmds = core.handle("w1", good(full[0], count=3), 0.1)  # the shard holds 4 samples
    errs = errors_in(cmds)
    assert errs and errs[0].code == ErrorCode.BAD_SHAPE and errs[0].job_id == full[0].job_id
    assert "count 3" in errs[0].message
    assert core.counters.rejected == 1 and full[0].job_id not in core.ledger and not core.buffer
    cmds = core.handle("w1", good(full[1], count=4), 0.2)  # the right count is taken
    assert not errors_in(cmds) and core.counters.rejected == 1
    assert core.closed.get(full[1].job_id) != "rejected"
    assert core.accounted()


# --------------------------------------------------------------------------- 4. closed-job memory

def test_the_closed_job_memory_forgets_its_oldest_entries(monkeypatch):
    """Catches: the closed-job memory (``ServerCore.closed``, bounded by MAX_CLOSED_REMEMBERED)
    evicting its newest entries instead of its oldest: then a reply to a job settled a moment
    ago is answered UNKNOWN_JOB instead of being dropped as late."""
    monkeypatch.setattr(ps.core.ledger, "MAX_CLOSED_REMEMBERED", 3)
    core = make_core()
    job = jobs_in(join(core, "w1"))[0]
    answered = []
    for _ in range(6):
        answered.append(job)
        job = jobs_in(core.handle("w1", good(job), 0.1))[0]
    assert list(core.closed) == [j.job_id for j in answered[-3:]], "the three most recently settled"
    cmds = core.handle("w1", good(answered[-1]), 0.2)  # a duplicate of the newest: late, silently
    assert not errors_in(cmds) and core.counters.late == 1 and core.counters.unknown == 0
    cmds = core.handle("w1", good(answered[0]), 0.3)  # the oldest was forgotten: unknown
    errs = errors_in(cmds)
    assert errs and errs[0].code == ErrorCode.UNKNOWN_JOB and core.counters.unknown == 1
    assert core.accounted()


# --------------------------------------------------------------------------- 5. hello from another run

def test_a_hello_from_another_run_does_not_keep_its_holds():
    """Catches: a hello whose run_id is not the server's keeping the iterate ids it claims to
    hold (they name another run's iterates). The existing test's ``holds == {0}`` holds either
    way (the new job's point is iterate 0 too); here the next job must carry iterate 0 as a
    point, and an id the worker claims but was never sent must not be believed."""
    core = make_core(run_id=5)
    first = jobs_in(join(core, "w1", run_id=5))[0]
    assert first.point_ids == (0,)
    cmds = core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, run_id=99, busy=(first.job_id,),
                                   holds=(0, 3)), 0.5)
    assert core.counters.lost == 1
    nxt = jobs_in(cmds)
    assert len(nxt) == 1 and nxt[0].iterate_ids == (0,)
    assert nxt[0].point_ids == (0,) and len(nxt[0].points) == 1, "another run's iterate 0 is not ours: sent again"
    assert core.workers["w1"].holds == {0}, "not the claimed 3"
    assert core.accounted()


# --------------------------------------------------------------------------- 6. codec id lists

def _with(msg, **fields) -> list:
    frames = encode(msg)
    header = msgpack.unpackb(frames[0], raw=False)
    header.update(fields)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


POINT = np.zeros(D, np.float32)
ID_LISTS = [
    (Hello(worker_id="w", boot=1, credit=1), "holds"),
    (Hello(worker_id="w", boot=1, credit=1), "busy"),
    (Ready(credit=1), "holds"),
    (Reply(job_id=1, created_at=0, grads=(POINT,)), "holds"),
    (Heartbeat(boot=1, credit=1), "busy"),
    (Cancel(job_ids=(1,)), "job_ids"),
    (Error(ErrorCode.MISSING_ITERATE, "x", job_id=1, iterate_ids=(1,)), "iterate_ids"),
    (Job(job_id=1, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=1, point_ids=(0,), points=(POINT,)),
     "iterate_ids"),
    (Job(job_id=1, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=1, point_ids=(0,), points=(POINT,)),
     "point_ids"),
    (Job(job_id=1, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=1), "refs"),
    (Job(job_id=1, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=1), "grad_slots"),
]


@pytest.mark.parametrize("msg, name", ID_LISTS, ids=[f"{type(m).__name__}.{n}" for m, n in ID_LISTS])
def test_codec_id_lists_refuse_negative_ids(msg, name):
    """Catches: the codec's id lists (holds, busy, job_ids, iterate_ids, point_ids, refs,
    grad_slots) accepting negative values (PROTOCOL.md: ``list[nat, ...]``)."""
    ok = decode(_with(msg, **{name: [0]}))
    assert tuple(getattr(ok, name)) == (0,), "the same message with a valid id decodes"
    for bad in ([-1], [-(1 << 63)]):
        with pytest.raises(RemoteProtocolError, match=rf"\.{name}: expected an integer in \[0, "):
            decode(_with(msg, **{name: bad}))


# --------------------------------------------------------------------------- persistence: a live run

def _persisted_run(tmp_path):
    """A live core and its Persistence on ``tmp_path``, with run.json and the start record as the
    server writes them; returns (core, pers, feed, tick, factory, restore, problem)."""
    from problems import load_problem
    from ps.journal.persistence import Persistence
    from ps.journal.runfile import write_run
    from ps.journal.wal import Journal

    d = str(tmp_path)
    core_cfg = {"problem": "quadratic", "problem_options": {"d": D}, "batch_size": 1, "heartbeat_interval_s": 0.5,
                "liveness_timeout_s": 2.0, "min_workers": 1, "round_period_s": None, "seed": 3, "run_id": 7}
    run = {"problem": "quadratic", "problem_options": {"d": D}, "algorithm": "asgd", "settings": {"lr": 0.3},
           "format": 1, "wire_dtype": "f32", "core": core_cfg}
    write_run(d, run)
    problem = load_problem("quadratic", {"d": D})
    alg = algorithms.build("asgd", {"lr": 0.3})
    cfg = CoreConfig(**core_cfg)

    def factory():
        return ServerCore(alg, problem.init_params(cfg.seed), cfg, server_boot=1, now=0.0)

    def restore(snap):
        return ServerCore.restore(alg, snap, cfg, server_boot=1)

    core = factory()
    journal = Journal(d, next_lsn=0, fsync="never")
    journal.append("start", run=run)
    pers = Persistence(d, journal, checkpoint_every=0, checkpoint_interval_s=0)
    held: dict[str, list[Job]] = {}

    def feed(wid, msg, now):
        """Journal, then hand to the core, as the daemon does; returns the commands."""
        assert pers.record_message(core, wid, msg, encode(msg), now)
        cmds = core.handle(wid, msg, now)
        for c in cmds:
            if isinstance(c, Send) and isinstance(c.msg, Job):
                held.setdefault(c.worker_id, []).append(c.msg)
        return cmds

    def tick(now):
        assert pers.append("tick", now=now)
        return core.on_tick(now)

    return core, pers, feed, tick, held, factory, restore, problem


def _computed(job: Job, core: ServerCore, problem) -> Reply:
    from worker.compute import run_job

    sent = dict(zip(job.point_ids, job.points, strict=True))  # what the worker got with the job
    r = run_job(job, [sent[i] if i in sent else core.store[i] for i in job.iterate_ids], problem)
    return Reply(job_id=r.job_id, created_at=r.created_at, grads=r.grads, loss=r.loss, count=r.count)


def _same_core(a: ServerCore, b: ServerCore) -> None:
    assert a.version == b.version
    assert np.array_equal(a.params(), b.params())
    assert a.counters.as_dict() == b.counters.as_dict()
    assert sorted(a.workers) == sorted(b.workers) and sorted(a.ledger) == sorted(b.ledger)


# --------------------------------------------------------------------------- 7. replay and ticks

def test_recovery_and_replay_apply_the_journaled_ticks(tmp_path):
    """Catches: replay (``ps/drivers/replay.py``) or the journal's apply path (``ps/journal/recovery.py``,
    ``apply_record``) ignoring ``tick`` records. Here a tick expires a silent worker, whose late
    reply is then dropped; without the tick on replay that reply would be applied."""
    from ps.drivers.replay import replay_run
    from ps.journal.recovery import recover
    from ps.journal.segments import read_journal

    core, pers, feed, tick, held, factory, restore, problem = _persisted_run(tmp_path)
    for wid in ("w1", "w2"):
        feed(wid, Hello(worker_id=wid, boot=1, credit=1, run_id=7), 0.0)
        feed(wid, Ready(credit=1), 0.0)
    j1, j2 = held["w1"][0], held["w2"][0]
    feed("w2", _computed(j2, core, problem), 1.0)
    feed("w2", Heartbeat(boot=1, credit=1, busy=(held["w2"][-1].job_id,), seen=held["w2"][-1].job_id), 1.5)
    tick(2.5)  # w1 silent for 2.5 s > 2.0: expired, its job written off
    assert "w1" not in core.workers and core.counters.lost == 1
    cmds = feed("w1", _computed(j1, core, problem), 2.6)  # too late
    assert errors_in(cmds)[0].code == ErrorCode.UNKNOWN_WORKER and core.counters.late == 1
    feed("w2", _computed(held["w2"][-1], core, problem), 2.7)
    pers.close()
    assert core.version == 2
    assert any(r.op == "tick" for r in read_journal(str(tmp_path)))

    recovered, _, _ = recover(factory, restore, str(tmp_path), problem)
    _same_core(recovered, core)
    replayed = replay_run(str(tmp_path))
    assert replayed.version == core.version and np.array_equal(replayed.final_x, core.params())
    assert replayed.counters == core.counters.as_dict()


# --------------------------------------------------------------------------- 8. bad replies journaled whole

@pytest.mark.parametrize("bad", ["nan", "shape"])
def test_a_bad_reply_is_journaled_with_its_gradients(tmp_path, bad):
    """Catches: a reply the core would judge "bad" journaled without its gradients (ps/journal/persistence.py
    ``record_message``): recovery would then recompute a good gradient from the seed and apply a
    reply the live server rejected."""
    from ps.journal.recovery import recover
    from ps.journal.segments import read_journal

    core, pers, feed, tick, held, factory, restore, problem = _persisted_run(tmp_path)
    feed("w1", Hello(worker_id="w1", boot=1, credit=1, run_id=7), 0.0)
    feed("w1", Ready(credit=1), 0.0)
    job = held["w1"][0]
    grad = np.full(D, np.nan, np.float32) if bad == "nan" else np.zeros(D + 1, np.float32)
    reply = Reply(job_id=job.job_id, created_at=job.created_at, grads=(grad,), loss=0.0, count=1)
    assert core.reply_verdict("w1", reply) == "bad"
    cmds = feed("w1", reply, 1.0)
    assert errors_in(cmds)[0].code in (ErrorCode.NON_FINITE, ErrorCode.BAD_SHAPE) and core.counters.rejected == 1
    feed("w1", _computed(held["w1"][-1], core, problem), 2.0)  # a good one after it
    pers.close()
    assert core.version == 1
    recs = [r for r in read_journal(str(tmp_path)) if r.op in ("msg", "reply")]
    replies = [r for r in recs if r.op == "reply" or decode(r.body["frames"]).__class__ is Reply]
    assert replies[0].op == "msg", "the bad reply is journaled whole"
    kept = decode(replies[0].body["frames"]).grads[0]
    assert kept.shape == grad.shape and np.array_equal(kept, grad, equal_nan=True)
    assert replies[1].op == "reply", "the good one goes without its gradients (recomputed from its seed)"

    recovered, _, _ = recover(factory, restore, str(tmp_path), problem)
    _same_core(recovered, core)
    assert recovered.counters.rejected == 1
