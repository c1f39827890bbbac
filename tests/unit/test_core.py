"""ServerCore: ledger, credit, validation, liveness, and a stateful hypothesis machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import algorithms
from protocol.messages import Bye, Cancel, Error, ErrorCode, Heartbeat, Hello, Job, Ready, Reply, Welcome
from ps.core.columns import _untable
from ps.core.commands import Disconnect, Send
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore

D = 4


def make_core(name="asgd", settings_=None, **cfg) -> ServerCore:
    alg = algorithms.build(name, settings_ or {"lr": 0.1})
    cfg.setdefault("liveness_timeout_s", 3.0)
    return ServerCore(alg, np.ones(D, np.float32), CoreConfig(**cfg))


def join(core: ServerCore, wid: str, credit: int = 1, now: float = 0.0, boot: int = 1) -> list:
    """Hello then Ready, as a real worker does once its problem is loaded."""
    cmds = core.handle(wid, Hello(worker_id=wid, boot=boot, credit=credit), now)
    return cmds + core.handle(wid, Ready(credit=credit), now)


def jobs_in(cmds) -> list[tuple[str, Job]]:
    return [(c.worker_id, c.msg) for c in cmds if isinstance(c, Send) and isinstance(c.msg, Job)]


def reply_for(job: Job, value=0.5, n=None) -> Reply:
    n = len(job.iterate_ids) if n is None else n
    return Reply(job_id=job.job_id, created_at=job.created_at,
                 grads=tuple(np.full(D, value, np.float32) for _ in range(n)))


def snapshot(core: ServerCore):
    return (core.version, core.params().copy(), core.alg.to_state_dict(core.state))


def same(a, b) -> bool:
    from algorithms.base import state_arrays_equal
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and state_arrays_equal(a[2], b[2])


def test_core_hello_gets_welcome_and_as_many_jobs_as_credit():
    core = make_core(problem="quadratic", problem_options={"d": D})
    cmds = join(core, "w1", 2, 0.0, boot=1)
    assert isinstance(cmds[0].msg, Welcome) and cmds[0].msg.problem == "quadratic"
    assert cmds[0].msg.problem_options == {"d": D}
    jobs = jobs_in(cmds)
    assert [j.job_id for _, j in jobs] == [0, 1]
    assert jobs[0][1].point_ids == (0,) and len(jobs[0][1].points) == 1
    assert jobs[1][1].point_ids == ()  # the worker already got iterate 0 with the first job
    cmds = core.handle("w1", reply_for(jobs[0][1]), now=0.1)
    assert core.version == 1 and [j.job_id for _, j in jobs_in(cmds)] == [2]
    assert core.accounted() and core.outstanding == 2


def test_core_waits_for_min_workers():
    core = make_core(min_workers=2)
    assert jobs_in(join(core, "w1", 1, 0.0, boot=1)) == []
    cmds = join(core, "w2", 1, 0.1, boot=1)
    assert [w for w, _ in jobs_in(cmds)] == ["w1", "w2"]


@pytest.mark.parametrize("case", ["unknown", "other_worker", "duplicate", "wrong_count", "wrong_shape",
                                  "nan", "inf_loss", "int_dtype"])
def test_core_bad_reply_leaves_state_unchanged(case):
    core = make_core()
    j1 = jobs_in(join(core, "w1", 1, 0.0, boot=1))[0][1]
    j2 = jobs_in(join(core, "w2", 1, 0.0, boot=1))[0][1]
    core.handle("w2", reply_for(j2), 0.05)  # one real update first
    before = snapshot(core)
    counters = core.counters.as_dict()
    if case == "unknown":
        r = Reply(job_id=999, created_at=0, grads=(np.zeros(D, np.float32),))
    elif case == "other_worker":
        r = reply_for(j1)
        cmds = core.handle("w2", r, 0.1)
        assert any(isinstance(c.msg, Error) and c.msg.code == ErrorCode.UNKNOWN_JOB for c in cmds)
        assert same(before, snapshot(core)) and core.counters.unknown == counters["unknown"] + 1
        assert j1.job_id in core.ledger  # still w1's
        return
    elif case == "duplicate":
        r = reply_for(j2)
    elif case == "wrong_count":
        r = reply_for(j1, n=2)
    elif case == "wrong_shape":
        r = Reply(job_id=j1.job_id, created_at=0, grads=(np.zeros(D + 1, np.float32),))
    elif case == "nan":
        g = np.zeros(D, np.float32)
        g[2] = np.nan
        r = Reply(job_id=j1.job_id, created_at=0, grads=(g,))
    elif case == "inf_loss":
        r = Reply(job_id=j1.job_id, created_at=0, grads=(np.zeros(D, np.float32),), loss=float("inf"))
    else:
        r = Reply(job_id=j1.job_id, created_at=0, grads=(np.zeros(D, np.uint16),))
    sender = "w2" if case == "duplicate" else "w1"
    cmds = core.handle(sender, r, 0.1)
    assert same(before, snapshot(core)), "state changed on a bad reply"
    errors = [c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, Error)]
    if case == "duplicate":
        assert core.counters.late == counters["late"] + 1
    elif case == "unknown":
        assert errors and errors[0].code == ErrorCode.UNKNOWN_JOB
        assert core.counters.unknown == counters["unknown"] + 1
    else:
        assert errors and errors[0].code in (ErrorCode.BAD_SHAPE, ErrorCode.NON_FINITE)
        assert core.counters.rejected == counters["rejected"] + 1
        assert j1.job_id not in core.ledger  # written off: its credit is free again
    assert core.accounted()


def test_core_quarantines_after_k_bad_replies_in_a_row():
    core = make_core(max_bad_replies=3)
    cmds = join(core, "w1", 1, 0.0, boot=1)
    bad = np.full(D, np.nan, np.float32)
    for k in range(3):
        job = jobs_in(cmds)[0][1]
        cmds = core.handle("w1", Reply(job_id=job.job_id, created_at=0, grads=(bad,)), 0.1 * k)
    assert "w1" not in core.workers and core.counters.quarantined == 1
    assert any(isinstance(c, Disconnect) for c in cmds)
    assert any(isinstance(c, Send) and isinstance(c.msg, Bye) for c in cmds)
    assert core.version == 0 and core.accounted()


def test_core_liveness_timeout_writes_off_jobs_as_lost():
    core = make_core(liveness_timeout_s=2.0)
    join(core, "w1", 2, 0.0, boot=1)
    join(core, "w2", 1, 0.0, boot=1)
    core.handle("w2", Heartbeat(boot=1, busy=(2,), seen=2), 1.5)
    assert core.next_deadline() == pytest.approx(2.0)
    core.on_tick(2.1)
    assert "w1" not in core.workers and "w2" in core.workers
    assert core.counters.lost == 2 and core.counters.workers_lost == 1 and core.accounted()
    # the dead worker's late reply is counted as late and changes nothing
    before = snapshot(core)
    join(core, "w1", 1, 2.2, boot=2)  # comes back: a new join
    core.handle("w1", Reply(job_id=0, created_at=0, grads=(np.zeros(D, np.float32),)), 2.3)
    assert core.counters.late == 1 and same(before, snapshot(core))


def test_core_new_boot_is_a_new_join():
    core = make_core()
    join(core, "w1", 1, 0.0, boot=1)
    join(core, "w1", 1, 0.5, boot=2)
    assert core.counters.lost == 1 and core.counters.workers_joined == 2 and core.accounted()


def test_core_missing_iterate_resends_points():
    core = make_core()
    cmds = join(core, "w1", 1, 0.0, boot=1)
    job = jobs_in(cmds)[0][1]
    core.handle("w1", Ready(credit=1, holds=()), 0.1)  # the worker says its cache is empty
    cmds = core.handle("w1", Error(ErrorCode.MISSING_ITERATE, "miss", job_id=job.job_id, iterate_ids=(0,)), 0.2)
    again = jobs_in(cmds)
    assert len(again) == 1 and again[0][1].job_id == job.job_id and again[0][1].point_ids == (0,)
    np.testing.assert_array_equal(again[0][1].points[0], np.ones(D, np.float32))
    assert core.counters.issued == 1


def test_core_heartbeat_reveals_vanished_job():
    core = make_core()
    cmds = join(core, "w1", 1, 0.0, boot=1)
    job = jobs_in(cmds)[0][1]
    core.handle("w1", Heartbeat(boot=1, credit=1, busy=(job.job_id,), seen=job.job_id), 0.5)
    assert core.counters.lost == 0
    cmds = core.handle("w1", Heartbeat(boot=1, credit=1, busy=(), seen=job.job_id), 1.0)
    assert core.counters.lost == 1 and jobs_in(cmds), "the lost job is written off and a new one issued"
    assert core.accounted()


def test_core_hello_again_writes_off_a_job_it_never_saw():
    """A worker that reconnects (same incarnation) says hello on the new connection: a job sent on
    the old one that it had not seen died with it. It is written off and a new job goes out; the
    job it holds stays."""
    core = make_core()
    cmds = join(core, "w1", 1, 0.0, boot=1)
    job = jobs_in(cmds)[0][1]
    cmds = core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, seen=job.job_id - 1), 1.0)
    assert core.counters.lost == 1 and job.job_id not in core.workers["w1"].outstanding
    fresh = jobs_in(cmds)
    assert fresh and fresh[0][1].job_id > job.job_id, "a new job for the worker's free credit"
    held = fresh[0][1].job_id
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, busy=(held,), seen=held), 2.0)
    assert core.workers["w1"].outstanding == {held} and core.counters.lost == 1, "a job it holds survives"
    assert core.accounted()


def test_core_bye_writes_off_and_forgets():
    core = make_core()
    join(core, "w1", 1, 0.0, boot=1)
    core.handle("w1", Bye("sigterm"), 0.2)
    assert core.workers == {} and core.counters.lost == 1 and core.accounted()
    assert core.store == {}, "no outstanding job refers to iterate 0 any more"


def test_core_message_before_hello_is_refused():
    core = make_core()
    cmds = core.handle("ghost", Heartbeat(boot=1), 0.0)
    assert cmds[0].msg.code == ErrorCode.UNKNOWN_WORKER and core.workers == {}


class CoreMachine(RuleBasedStateMachine):
    """Random joins, replies (good, duplicate, bad), heartbeats, crashes and ticks."""

    def __init__(self):
        super().__init__()
        self.core = make_core("ordered-momentum", {"lr": 0.05, "beta": 0.5}, liveness_timeout_s=1.0,
                              max_bad_replies=0)
        self.now = 0.0
        self.held: dict[str, list[Job]] = {}
        self.applied: set[int] = set()
        self.boots: dict[str, int] = {}
        self.last_version = 0

    def _absorb(self, cmds):
        for wid, job in jobs_in(cmds):
            self.held.setdefault(wid, []).append(job)
        for c in cmds:
            if isinstance(c, Send) and isinstance(c.msg, Cancel):
                self.held[c.worker_id] = [j for j in self.held.get(c.worker_id, []) if j.job_id not in c.msg.job_ids]
        for ev in self.core.drain_events():
            if ev["ev"] == "applied":
                assert ev["job_id"] not in self.applied, "a reply was applied twice"
                self.applied.add(ev["job_id"])

    @rule(w=st.sampled_from(["a", "b", "c"]), credit=st.integers(1, 3))
    def join(self, w, credit):
        self.boots[w] = self.boots.get(w, 0) + 1
        self.held[w] = []
        self._absorb(join(self.core, w, credit, self.now, boot=self.boots[w]))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), value=st.floats(-1, 1))
    def reply(self, data, value):
        w = data.draw(st.sampled_from(sorted(w for w, js in self.held.items() if js)))
        job = self.held[w].pop(data.draw(st.integers(0, len(self.held[w]) - 1)))
        self.now += 0.01
        self._absorb(self.core.handle(w, reply_for(job, value), self.now))

    @precondition(lambda self: self.applied)
    @rule(data=st.data())
    def duplicate(self, data):
        jid = data.draw(st.sampled_from(sorted(self.applied)))
        before = snapshot(self.core)
        w = next(iter(self.core.workers), "a")
        self._absorb(self.core.handle(w, Reply(job_id=jid, created_at=0, grads=(np.zeros(D, np.float32),)),
                                      self.now))
        assert same(before, snapshot(self.core))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def bad_reply(self, data):
        w = data.draw(st.sampled_from(sorted(w for w, js in self.held.items() if js)))
        job = self.held[w].pop(0)
        before = snapshot(self.core)
        self._absorb(self.core.handle(w, Reply(job_id=job.job_id, created_at=0,
                                               grads=(np.full(D, np.inf, np.float32),)), self.now))
        assert same(before, snapshot(self.core))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def compute_failed(self, data):
        w = data.draw(st.sampled_from(sorted(w for w, js in self.held.items() if js)))
        job = self.held[w].pop(0)
        before = snapshot(self.core)
        failed = self.core.counters.failed
        mine = job.job_id in self.core.ledger and self.core.ledger[job.job_id].worker_id == w
        self._absorb(self.core.handle(w, Error(ErrorCode.COMPUTE_FAILED, "boom", job_id=job.job_id), self.now))
        assert same(before, snapshot(self.core))
        assert self.core.counters.failed == failed + (mine and w in self.core.workers)

    @rule(w=st.sampled_from(["a", "b", "c"]))
    def heartbeat(self, w):
        if w in self.core.workers:
            self._absorb(self.core.handle(w, Heartbeat(boot=self.boots[w], busy=tuple(j.job_id for j in
                                                                                    self.held.get(w, [])),
                                                       seen=max([j.job_id for j in self.held.get(w, [])],
                                                                default=-1)), self.now))

    @rule(dt=st.floats(0.1, 2.0))
    def tick(self, dt):
        self.now += dt
        self._absorb(self.core.on_tick(self.now))
        for w in list(self.held):
            if w not in self.core.workers:
                self.held[w] = []

    @invariant()
    def accounting_holds(self):
        assert self.core.accounted()

    @invariant()
    def indexes_agree_with_a_scan(self):
        from tests.unit.test_core_indexes import check_indexes

        check_indexes(self.core)

    @invariant()
    def version_never_decreases(self):
        assert self.core.version >= self.last_version
        self.last_version = self.core.version

    @invariant()
    def each_job_outstanding_once_and_store_bounded(self):
        ids = [j for w in self.core.workers.values() for j in w.outstanding]
        assert len(ids) == len(set(ids))
        assert set(ids) <= set(self.core.ledger)
        referenced = {i for e in self.core.ledger.values() for i in e.iterate_ids}
        assert set(self.core.store) <= referenced | self.core.alg.live_iterate_ids(self.core.state)
        for w in self.core.workers.values():
            assert len(w.outstanding) <= w.credit


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_core_sends_no_job_before_ready():
    core = make_core()
    cmds = core.handle("w1", Hello(worker_id="w1", boot=1, credit=2), 0.0)
    assert jobs_in(cmds) == [] and isinstance(cmds[0].msg, Welcome)
    assert len(jobs_in(core.handle("w1", Ready(credit=2), 0.5))) == 2


def test_core_hello_after_restart_keeps_held_jobs_and_writes_off_the_rest():
    core = make_core(run_id=77, liveness_timeout_s=2.0)
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=2, run_id=77), 0.0)
    jobs = jobs_in(core.handle("w1", Ready(credit=2), 0.0))
    assert len(jobs) == 2
    core.rebase_clock(100.0)  # what a restored server does
    cmds = core.handle("w1", Hello(worker_id="w1", boot=1, credit=2, busy=(jobs[1][1].job_id,), seen=-1, run_id=77,
                                   holds=(0,)), 100.1)
    assert core.counters.lost == 1 and jobs[1][1].job_id in core.ledger and jobs[0][1].job_id not in core.ledger
    assert len(jobs_in(cmds)) == 1, "the freed credit gets a new job at once"
    assert core.accounted()


def test_core_hello_from_another_run_trusts_nothing_it_claims():
    core = make_core(run_id=5)
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, run_id=5), 0.0)
    core.handle("w1", Ready(credit=1), 0.0)
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, run_id=99, busy=(0,), holds=(0,)), 0.5)
    assert core.counters.lost == 1 and core.outstanding == 1  # written off, then a fresh job
    job = next(iter(core.ledger.values()))
    assert job.job_id == 1
    assert core.workers["w1"].holds == {0}, "only what we sent since: the new job's point"


def test_core_rejects_reply_with_wrong_created_at():
    core = make_core()
    job = jobs_in(join(core, "w1"))[0][1]
    before = snapshot(core)
    cmds = core.handle("w1", Reply(job_id=job.job_id, created_at=job.created_at + 1,
                                   grads=(np.zeros(D, np.float32),)), 0.1)
    assert cmds[0].msg.code == ErrorCode.UNKNOWN_JOB and same(before, snapshot(core))
    assert core.counters.unknown == 1 and job.job_id in core.ledger


# --------------------------------------------------------------------------- failed jobs and benching

class SpyAlgorithm:
    """Delegates to a real algorithm and records what ``on_lost`` was told."""

    def __init__(self, alg) -> None:
        self._alg = alg
        self.told_lost: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._alg, name)

    def on_lost(self, state, job_ids):
        self.told_lost.append(list(job_ids))
        return self._alg.on_lost(state, job_ids)


def spy_core(name="asgd", settings_=None, **cfg) -> tuple[ServerCore, SpyAlgorithm]:
    alg = SpyAlgorithm(algorithms.build(name, settings_ or {"lr": 0.1}))
    return ServerCore(alg, np.ones(D, np.float32), CoreConfig(**cfg)), alg


def fail(core: ServerCore, wid: str, job: Job, now: float, text: str = "ValueError: boom") -> list:
    return core.handle(wid, Error(ErrorCode.COMPUTE_FAILED, text, job_id=job.job_id), now)


def test_core_compute_failed_is_its_own_outcome_told_to_the_algorithm():
    core, alg = spy_core()
    job = jobs_in(join(core, "w1"))[0][1]
    before = snapshot(core)
    cmds = fail(core, "w1", job, 0.1)
    c = core.counters
    assert (c.failed, c.lost, c.rejected, c.worker_errors) == (1, 0, 0, 1)
    assert core.accounted() and job.job_id not in core.ledger and core.closed[job.job_id] == "failed"
    assert alg.told_lost == [[job.job_id]], "the algorithm is told as for any write-off"
    assert same(before, snapshot(core)), "a failed job moves nothing"
    assert [j.job_id for _, j in jobs_in(cmds)] == [1], "its credit slot is free: the next job goes out"
    ev = [e for e in core.drain_events() if e["ev"] == "failed"]
    assert len(ev) == 1 and ev[0]["worker_id"] == "w1" and ev[0]["job_id"] == job.job_id
    assert ev[0]["message"] == "ValueError: boom" and ev[0]["seed"] == job.seed
    w = core.workers["w1"]
    assert (w.failed, w.failed_in_a_row, w.last_error, w.benched) == (1, 1, "ValueError: boom", False)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_core_benches_a_worker_after_k_failures_in_a_row(k):
    core = make_core(max_failed_jobs=k)
    cmds = join(core, "w1")
    for i in range(k):
        job = jobs_in(cmds)
        assert len(job) == 1, f"failure {i}: the worker is still given jobs"
        assert "benched" not in {e["ev"] for e in core.drain_events()}
        cmds = fail(core, "w1", job[0][1], 0.1 * (i + 1), f"ValueError: boom {i}")
    assert jobs_in(cmds) == [], f"benched after exactly {k} failures"
    refused = [c.msg for c in cmds if isinstance(c.msg, Error)]
    assert len(refused) == 1 and refused[0].code == ErrorCode.REFUSED and "benched" in refused[0].message
    benched = [e for e in core.drain_events() if e["ev"] == "benched"]
    assert len(benched) == 1 and benched[0]["in_a_row"] == k and benched[0]["message"] == f"ValueError: boom {k - 1}"
    w = core.workers["w1"]
    assert w.benched and core.counters.failed == k and core.counters.benched == 1 and core.accounted()
    # it stays in the table (it is alive) but gets nothing: heartbeats, ready, ticks
    assert jobs_in(core.handle("w1", Heartbeat(boot=1, credit=1), 1.0)) == []
    assert jobs_in(core.handle("w1", Ready(credit=1), 1.1)) == []
    assert jobs_in(core.on_tick(1.2)) == [] and "w1" in core.workers
    # others are still served
    assert len(jobs_in(join(core, "w2", now=1.3))) == 1


def test_core_benching_one_short_of_k_or_with_a_success_between_does_not_happen():
    core = make_core(max_failed_jobs=3)
    cmds = join(core, "w1")
    for ok in (False, False, True, False, False):
        job = jobs_in(cmds)[0][1]
        cmds = core.handle("w1", reply_for(job), 0.1) if ok else fail(core, "w1", job, 0.1)
    w = core.workers["w1"]
    assert not w.benched and w.failed == 4 and w.failed_in_a_row == 2 and len(jobs_in(cmds)) == 1


def test_core_never_benches_when_max_failed_jobs_is_zero():
    core = make_core(max_failed_jobs=0)
    cmds = join(core, "w1")
    for _ in range(20):
        cmds = fail(core, "w1", jobs_in(cmds)[0][1], 0.1)
    assert not core.workers["w1"].benched and core.counters.failed == 20 and core.accounted()


def test_core_hello_brings_a_benched_worker_back():
    core = make_core(max_failed_jobs=2)
    cmds = join(core, "w1")
    for _ in range(2):
        cmds = fail(core, "w1", jobs_in(cmds)[0][1], 0.1)
    assert core.workers["w1"].benched and jobs_in(cmds) == []
    core.drain_events()
    cmds = core.handle("w1", Hello(worker_id="w1", boot=1, credit=1), 0.5)  # the same process, reconnected
    assert not core.workers["w1"].benched and core.workers["w1"].failed_in_a_row == 0
    assert len(jobs_in(cmds)) == 1
    assert [e["reason"] for e in core.drain_events() if e["ev"] == "unbenched"] == ["hello"]
    for _ in range(2):  # and is benched again if it still fails
        cmds = fail(core, "w1", jobs_in(cmds)[0][1], 0.6)
    assert core.workers["w1"].benched and core.counters.benched == 2
    cmds = join(core, "w1", now=0.7, boot=2)  # a restarted process is a new join, with a clean slate
    w = core.workers["w1"]
    assert not w.benched and w.failed == 0 and len(jobs_in(cmds)) == 1 and core.accounted()


def test_core_benched_worker_answering_a_job_it_still_holds_gets_jobs_again():
    core = make_core(max_failed_jobs=2)
    held = [j for _, j in jobs_in(join(core, "w1", credit=3))]
    assert len(held) == 3
    fail(core, "w1", held[0], 0.1)
    cmds = fail(core, "w1", held[1], 0.2)
    assert core.workers["w1"].benched and jobs_in(cmds) == []
    assert len(core.workers["w1"].outstanding) == 2, "held[2] and the job that replaced held[0]"
    cmds = core.handle("w1", reply_for(held[2]), 0.3)
    assert not core.workers["w1"].benched and len(jobs_in(cmds)) == 2 and core.version == 1
    assert len(core.workers["w1"].outstanding) == 3


def test_core_compute_failed_for_a_job_not_its_own_settles_nothing():
    core = make_core()
    j1 = jobs_in(join(core, "w1"))[0][1]
    join(core, "w2")
    fail(core, "w2", j1, 0.1)  # w1's job
    core.handle("w2", Error(ErrorCode.COMPUTE_FAILED, "x", job_id=999), 0.2)  # never issued
    core.handle("w2", Error(ErrorCode.COMPUTE_FAILED, "x"), 0.3)  # no job id
    c = core.counters
    assert c.failed == 0 and c.lost == 0 and c.worker_errors == 3 and j1.job_id in core.ledger
    assert core.workers["w2"].failed == 0 and core.accounted()


def test_core_refused_from_a_worker_is_still_written_off_as_lost():
    """What an older worker sends for a failed job (REFUSED "worker failed: ...")."""
    core, alg = spy_core()
    job = jobs_in(join(core, "w1"))[0][1]
    core.handle("w1", Error(ErrorCode.REFUSED, "worker failed: ValueError: boom", job_id=job.job_id), 0.1)
    assert core.counters.lost == 1 and core.counters.failed == 0 and alg.told_lost == [[job.job_id]]


def test_core_problem_unavailable_is_recorded_and_the_bye_that_follows_removes_the_worker():
    core = make_core(problem="mymod:make")
    core.handle("w3", Hello(worker_id="w3", boot=1, credit=1), 0.0)  # never ready: it cannot load the problem
    core.drain_events()
    cmds = core.handle("w3", Error(ErrorCode.PROBLEM_UNAVAILABLE, "cannot import module 'mymod'"), 0.1)
    assert jobs_in(cmds) == [] and core.counters.worker_errors == 1 and core.accounted()
    ev = core.drain_events()
    assert ev == [{"ev": "problem_unavailable", "worker_id": "w3", "problem": "mymod:make",
                   "message": "cannot import module 'mymod'", "t": 0.1}]
    assert core.workers["w3"].last_error == "cannot load problem mymod:make: cannot import module 'mymod'"
    core.handle("w3", Bye("cannot load problem mymod:make: cannot import module 'mymod'"), 0.2)
    assert "w3" not in core.workers and core.counters.workers_lost == 0


def test_core_failed_jobs_in_round_mode_let_the_round_go_on():
    core, alg = spy_core("rennala", {"lr": 0.1, "B": 2}, max_failed_jobs=0)
    cmds = join(core, "w1", credit=2)
    for step in range(6):  # every other job fails; the batches still fill and the model moves
        jobs = jobs_in(cmds)
        assert jobs, f"step {step}: no job issued"
        job = jobs[0][1]
        cmds = fail(core, "w1", job, 0.1 * step) if step % 2 else core.handle("w1", reply_for(job), 0.1 * step)
        cmds += core.on_tick(0.1 * step + 0.05)
    assert core.counters.failed == 3 and core.version >= 1 and core.accounted()
    assert sum(alg.told_lost, []) == [e for e in range(100) if core.closed.get(e) == "failed"]


def test_core_snapshot_keeps_failures_and_benching_and_reads_older_snapshots():
    core = make_core(max_failed_jobs=2)
    cmds = join(core, "w1")
    for _ in range(2):
        cmds = fail(core, "w1", jobs_in(cmds)[0][1], 0.1)
    snap = core.snapshot()
    again = ServerCore.restore(core.alg, snap, core.cfg)
    w = again.workers["w1"]
    assert (w.benched, w.failed, w.failed_in_a_row, w.last_error) == (True, 2, 2, "ValueError: boom")
    assert again.counters.failed == 2 and again.accounted()
    old = dict(snap, counters={k: v for k, v in snap["counters"].items() if k not in ("failed", "benched")},
               workers=[{k: v for k, v in w.items() if k not in ("failed", "failed_in_a_row", "last_error",
                                                                  "benched")} for w in _untable(snap["workers"])])
    old["counters"]["lost"] += 2  # an older server counted failed jobs as lost
    older = ServerCore.restore(core.alg, old, core.cfg)
    assert not older.workers["w1"].benched and older.counters.failed == 0 and older.accounted()


def test_core_bad_shape_names_the_expected_shape_and_layout():
    core = make_core()
    core.layout_text = "w (2, 2)"
    job = jobs_in(join(core, "w1"))[0][1]
    cmds = core.handle("w1", Reply(job_id=job.job_id, created_at=0, grads=(np.zeros(D + 1, np.float32),)), 0.1)
    err = [c.msg for c in cmds if isinstance(c.msg, Error)][0]
    assert err.code == ErrorCode.BAD_SHAPE and err.message == "gradient 0: expected shape (4,) (w (2, 2)), got (5,)"


def test_issued_events_only_when_recorded_and_nothing_else_changes():
    """record_issued off (the daemon without an events file) leaves out the "issued" events and
    nothing else: the same jobs, seeds, other events and counters."""
    runs = []
    for record in (True, False):
        core = make_core()
        core.record_issued = record
        cmds = join(core, "w1")
        events, jobs = [], []
        for step in range(5):
            (_, job), = jobs_in(cmds)
            jobs.append((job.job_id, job.seed))
            cmds = core.handle("w1", reply_for(job), float(step + 1))
            events += core.drain_events()
        runs.append((jobs, events, core.counters.as_dict()))
    (jobs_on, ev_on, c_on), (jobs_off, ev_off, c_off) = runs
    assert jobs_on == jobs_off and c_on == c_off
    assert sum(e["ev"] == "issued" for e in ev_on) == len(jobs_on) + 1 and not any(e["ev"] == "issued" for e in ev_off)
    assert [e for e in ev_on if e["ev"] != "issued"] == ev_off
