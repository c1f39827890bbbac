"""The core's indexes (free workers, join order, liveness heap, outstanding jobs by created_at and
by class, iterates to sweep) agree with a brute-force scan of its tables after every step; the
per-worker credit cap; cancel() through the index returns what a scan of the ledger returns.

``check_indexes`` is also an invariant of ``tests/unit/test_core.py::CoreMachine``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import algorithms
from protocol.messages import Cancel, Error, ErrorCode, Heartbeat, Hello, Job, JobKind, Ready, Reply
from ps.core.commands import Send
from ps.core.config import MAX_CREDIT, CoreConfig
from ps.core.iterates import EVICTED_KEPT, EvictionCursor
from ps.core.ledger import LedgerEntry, Outstanding
from ps.core.server_core import ServerCore

D = 4


def check_indexes(core: ServerCore) -> None:
    """Every index of ``core`` against the tables it indexes (a brute-force scan)."""
    workers = core.workers
    assert core._free == {wid for wid, w in workers.items()
                          if w.ready and not w.benched and len(w.outstanding) < w.credit}
    assert core._eligible == {wid for wid, w in workers.items() if w.ready and not w.benched}
    assert set(core._seq) == set(workers)
    assert sorted(workers, key=core._seq.__getitem__) == list(workers), "seq order is join order"
    # liveness: every worker has an entry no later than its last_seen; next_deadline is the scan's
    for wid, w in workers.items():
        assert any(e[2] == wid and e[1] == core._seq[wid] and e[0] <= w.last_seen for e in core._alive), wid
    want = core.next_round_at
    if workers:
        want = min(want, min(w.last_seen for w in workers.values()) + core.cfg.liveness_timeout_s)
    assert core.next_deadline() == want
    # outstanding jobs
    pending = [e for e in core.ledger.values() if not e.received]
    view = core.jobs
    assert list(view) == pending and len(view) == len(pending)
    assert [view[i] for i in range(len(view))] == pending
    assert view.created_at_sum == sum(e.created_at for e in pending)
    assert view.oldest_created_at() == min((e.created_at for e in pending), default=None)
    for c in {e.created_at for e in pending} | {-1, core.version, core.version + 1}:
        for probe in (c - 1, c, c + 1):
            assert view.created_at_most(probe) == [e.job_id for e in pending if e.created_at <= probe]
    for e in pending:
        assert view.count_like(e.created_at, e.kind, e.iterate_ids) == sum(
            (o.created_at, o.kind, tuple(o.iterate_ids)) == (e.created_at, e.kind, tuple(e.iterate_ids))
            for o in pending)
    assert len(view._heap) <= 2 * len(view._groups) + 33, "emptied groups do not pile up in the heap"
    ages = core.outstanding_ages()  # what status answers, buffered results included
    if core.ledger:
        created = [e.created_at for e in core.ledger.values()]
        assert ages[0] == core.version - min(created)
        assert ages[1] == pytest.approx(core.version - sum(created) / len(created))
    else:
        assert ages is None
    # the store's sweep candidates cover every unreferenced iterate
    assert {i for i, n in core.refs.items() if n <= 0} <= core._unref


def make_core(name="asgd", hp=None, **cfg) -> ServerCore:
    cfg.setdefault("liveness_timeout_s", 1.0)
    return ServerCore(algorithms.build(name, hp or {"lr": 0.1}), np.ones(D, np.float32), CoreConfig(**cfg))


def jobs_in(cmds) -> list[tuple[str, Job]]:
    return [(c.worker_id, c.msg) for c in cmds if isinstance(c, Send) and isinstance(c.msg, Job)]


class IndexMachine(RuleBasedStateMachine):
    """Random joins (credit up to 5), replies, failures, heartbeats changing credit, readies,
    byes, ticks and clock steps back, for one algorithm; the indexes are checked after every
    step, and cancel() through the index against cancel() over a plain list of the same jobs."""

    ALG = ("ringmaster", {"lr": 0.05, "R": 2, "stops": True})
    PURE_CANCEL = True  # cancel() has no side effect: it can be asked twice

    def __init__(self):
        super().__init__()
        self.core = make_core(*self.ALG, max_bad_replies=3, max_failed_jobs=2)
        self.now = 0.0
        self.held: dict[str, list[Job]] = {}
        self.boots: dict[str, int] = {}
        self.cursor = EvictionCursor()  # a driver's copies of the store's iterates, kept by evictions
        self.copies: set[int] = set()

    def _absorb(self, cmds):
        for wid, job in jobs_in(cmds):
            self.held.setdefault(wid, []).append(job)
        for c in cmds:
            if isinstance(c, Send) and isinstance(c.msg, Cancel):
                self.held[c.worker_id] = [j for j in self.held.get(c.worker_id, []) if j.job_id not in c.msg.job_ids]
        self.core.drain_events()
        for w in list(self.held):
            if w not in self.core.workers:
                self.held[w] = []

    def _holders(self):
        return sorted(w for w, js in self.held.items() if js and w in self.core.workers)

    @rule(w=st.sampled_from("abcde"), credit=st.integers(1, 5), new_boot=st.booleans())
    def join(self, w, credit, new_boot):
        self.boots[w] = self.boots.get(w, 0) + (new_boot or w not in self.boots)
        self._absorb(self.core.handle(w, Hello(worker_id=w, boot=self.boots[w], credit=credit,
                                               busy=tuple(j.job_id for j in self.held.get(w, [])),
                                               seen=max((j.job_id for j in self.held.get(w, [])), default=-1)),
                                      self.now))
        self._absorb(self.core.handle(w, Ready(credit=credit), self.now))

    @precondition(lambda self: self._holders())
    @rule(data=st.data(), n=st.integers(1, 6))
    def answer(self, data, n):
        """Up to ``n`` answers, mostly good ones (some invalid, some failed)."""
        for _ in range(n):
            if not self._holders():
                return
            w = data.draw(st.sampled_from(self._holders()))
            job = self.held[w].pop(data.draw(st.integers(0, len(self.held[w]) - 1)))
            how = data.draw(st.sampled_from(["ok"] * 6 + ["bad", "failed"]))
            self.now += 0.01
            k = 1 if job.kind == JobKind.FULL_GRAD else len(job.iterate_ids)
            if how == "failed":
                msg = Error(ErrorCode.COMPUTE_FAILED, "boom", job_id=job.job_id)
            else:
                g = np.full(D, 0.5 if how == "ok" else np.nan, np.float32)
                msg = Reply(job_id=job.job_id, created_at=job.created_at, grads=(g,) * k)
            self._absorb(self.core.handle(w, msg, self.now))

    @rule(w=st.sampled_from("abcde"), credit=st.integers(0, 5), keep=st.booleans())
    def heartbeat(self, w, credit, keep):
        if w in self.core.workers:
            held = self.held.get(w, [])
            busy = tuple(j.job_id for j in held) if keep else tuple(j.job_id for j in held[1:])
            self._absorb(self.core.handle(w, Heartbeat(boot=self.boots[w], credit=credit, busy=busy,
                                                       seen=max((j.job_id for j in held), default=-1)), self.now))

    @rule(w=st.sampled_from("abcde"), credit=st.integers(1, 5))
    def ready(self, w, credit):
        if w in self.core.workers:
            self._absorb(self.core.handle(w, Ready(credit=credit), self.now))

    @rule(dt=st.floats(0.0, 1.5))
    def tick(self, dt):
        self.now += dt
        self._absorb(self.core.on_tick(self.now))

    @rule(dt=st.floats(0.01, 0.5), w=st.sampled_from("abcde"))
    def clock_step_back(self, dt, w):
        """A driver whose clock goes back (the core must not rely on monotonic ``now``)."""
        self.now = max(0.0, self.now - dt)
        if w in self.core.workers:
            self._absorb(self.core.handle(w, Heartbeat(boot=self.boots[w]), self.now))

    @invariant()
    def indexes_agree_with_a_scan(self):
        check_indexes(self.core)
        assert self.core.accounted()

    @invariant()
    def a_driver_told_the_evictions_holds_what_the_store_holds(self):
        """Copies kept beside the store (shared memory, wire dtype) and released by what the
        EvictionCursor says left it, never by a scan, are exactly the store's iterates."""
        gone = self.cursor.take(self.core)
        if gone is None:
            self.copies = set(self.core.store)  # not known: look at all
        else:
            self.copies.difference_update(gone)
        self.copies |= set(self.core.store)
        assert self.copies == set(self.core.store)

    @invariant()
    def cancel_through_the_index_is_cancel_over_a_list(self):
        if self.PURE_CANCEL:
            core = self.core
            plain = [e for e in core.ledger.values() if not e.received]
            assert core.alg.cancel(core.state, core.jobs) == core.alg.cancel(core.state, plain)


TestRingmasterIndexes = IndexMachine.TestCase
TestRingmasterIndexes.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)


class RennalaIndexMachine(IndexMachine):
    ALG = ("rennala", {"lr": 0.1, "B": 3})


TestRennalaIndexes = RennalaIndexMachine.TestCase
TestRennalaIndexes.settings = settings(max_examples=30, stateful_step_count=50, deadline=None)


class StormIndexMachine(IndexMachine):
    """A round-mode algorithm: results are buffered (received), so the view excludes them."""

    ALG = ("storm-vr", {"lr": 0.1, "a": 0.2, "B_init": 2})
    PURE_CANCEL = False  # it learns job ids in cancel()


TestStormIndexes = StormIndexMachine.TestCase
TestStormIndexes.settings = settings(max_examples=30, stateful_step_count=50, deadline=None)


def entry(job_id, created_at, kind=JobKind.GRAD, ids=None):
    return LedgerEntry(job_id=job_id, worker_id="w", kind=kind, created_at=created_at,
                       iterate_ids=(created_at,) if ids is None else ids, seed=0, batch_size=1, shard=None,
                       deadline=None, issued_at=0.0)


def test_outstanding_queries_cost_what_they_return_and_heap_stays_compact():
    ledger: dict[int, LedgerEntry] = {}
    view = Outstanding(ledger)
    hoarded = entry(0, 0)  # one job that never comes back, many versions ago
    ledger[0] = hoarded
    view._add(hoarded)
    for v in range(1, 5000):  # a job per version, settled soon after
        e = entry(v, v)
        ledger[v] = e
        view._add(e)
        if v > 3:
            old = ledger.pop(v - 3)
            view._drop(old)
    assert view.oldest_created_at() == 0 and len(view) == 4
    assert view.created_at_most(4000) == [0]
    assert len(view._heap) <= 2 * len(view._groups) + 33
    assert view.count_like(4999, JobKind.GRAD, (4999,)) == 1 and view.count_like(4999, JobKind.GRAD, (0,)) == 0
    assert view.created_at_sum == 0 + 4997 + 4998 + 4999


def test_a_worker_gets_at_most_max_credit_jobs_whatever_it_asks():
    core = make_core(liveness_timeout_s=3.0)
    core.handle("hoarder", Hello(worker_id="hoarder", boot=1, credit=256), 0.0)
    assert len(jobs_in(core.handle("hoarder", Ready(credit=256), 0.0))) == MAX_CREDIT == 64
    assert jobs_in(core.handle("hoarder", Heartbeat(boot=1, credit=256, busy=tuple(range(64)), seen=63), 0.1)) == []
    assert core.workers["hoarder"].credit == MAX_CREDIT and core.outstanding == MAX_CREDIT
    small = make_core(max_credit=3)
    small.handle("w", Hello(worker_id="w", boot=1, credit=10), 0.0)
    assert len(jobs_in(small.handle("w", Ready(credit=10), 0.0))) == 3
    check_indexes(core)
    check_indexes(small)


def test_mass_timeout_removes_in_join_order_and_leaves_indexes_consistent():
    core = make_core(liveness_timeout_s=1.0)
    for i in range(300):
        # later joiners seen earlier: heap order is not join order
        core.handle(f"w{i}", Hello(worker_id=f"w{i}", boot=1, credit=2), 0.001 * (300 - i))
        core.handle(f"w{i}", Ready(credit=2), 0.001 * (300 - i))
    core.handle("w7", Heartbeat(boot=1, busy=(14, 15), seen=15), 5.0)  # w7 alive, the rest silent
    core.drain_events()
    core.on_tick(5.5)
    left = [ev["worker_id"] for ev in core.drain_events() if ev["ev"] == "left"]
    assert left == [f"w{i}" for i in range(300) if i != 7], "written off in join order"
    assert list(core.workers) == ["w7"] and core.counters.lost == 598 and core.accounted()
    assert core.next_deadline() == 6.0
    check_indexes(core)


@pytest.mark.parametrize("name,hp", [("ringmaster", {"lr": 0.1, "R": 2, "stops": True}),
                                     ("ringmaster-lmo", {"lr": 0.05, "R": 2, "stops": True}),
                                     ("rennala", {"lr": 0.1, "B": 2})])
def test_cancel_with_many_hoarded_jobs_matches_a_scan(name, hp, monkeypatch):
    """Hoarders hold jobs of many versions; at every update cancel() through the core's index
    returns exactly the ids (same order) that it returns over a plain list of the same jobs."""
    core = make_core(name, hp, liveness_timeout_s=math.inf)
    original = type(core.alg).cancel
    calls = []

    def spy(alg, state, outstanding):
        assert isinstance(outstanding, Outstanding)
        got = original(alg, state, outstanding)
        assert got == original(alg, state, list(outstanding))
        calls.append(len(got))
        return got

    monkeypatch.setattr(type(core.alg), "cancel", spy)
    for i in range(5):
        core.handle(f"h{i}", Hello(worker_id=f"h{i}", boot=1, credit=8), 0.0)
        core.handle(f"h{i}", Ready(credit=8), 0.0)
    held = [j for _, j in jobs_in(core.handle("r", Hello(worker_id="r", boot=1, credit=1), 0.0)
                                  + core.handle("r", Ready(credit=1), 0.0))]
    for step in range(30):
        job = held.pop()
        cmds = core.handle("r", Reply(job_id=job.job_id, created_at=job.created_at,
                                      grads=(np.full(D, 0.1, np.float32),) * len(job.iterate_ids)), 0.01 * step)
        gone = {j for c in cmds if isinstance(c, Send) and c.worker_id == "r" and isinstance(c.msg, Cancel)
                for j in c.msg.job_ids}
        held = [j for j in held if j.job_id not in gone] + [j for w, j in jobs_in(cmds) if w == "r"]
        check_indexes(core)
    assert len(calls) == 30 and sum(calls) >= 40, "the hoarders' jobs went stale: cancel() had work to do"


def _hoarded_core() -> ServerCore:
    core = make_core(liveness_timeout_s=math.inf)
    for i in range(40):
        core.handle(f"h{i}", Hello(worker_id=f"h{i}", boot=1, credit=256), 0.5 * i)
        core.handle(f"h{i}", Ready(credit=256, holds=(0,)), 0.5 * i + 0.25)
    core.handle("r", Hello(worker_id="r", boot=1, credit=1), 30.0)
    job = jobs_in(core.handle("r", Ready(credit=1), 30.0))[0][1]
    for step in range(50):  # settled jobs: the closed table fills too
        cmds = core.handle("r", Reply(job_id=job.job_id, created_at=job.created_at,
                                      grads=(np.full(D, 0.1, np.float32),)), 31.0 + step)
        job = jobs_in(cmds)[0][1]
    return core


def test_checkpoint_columns_restore_bit_for_bit_and_read_format_1():
    """The ledger, worker table and closed ids go into a checkpoint as columns (arrays) and
    come back exactly; a format-1 snapshot (lists of rows) still restores to the same core."""
    from ps.core.columns import _column, _uncolumn, _untable
    from ps.journal.checkpoints import pack_tree, unpack_tree

    core = _hoarded_core()
    assert core.outstanding == 40 * MAX_CREDIT + 1
    snap = core.snapshot()
    tree, arrays = pack_tree(snap)
    assert len(str(tree)) < 20_000, "the tables are arrays, not one dict per row"
    again = ServerCore.restore(core.alg, unpack_tree(tree, arrays), core.cfg)
    old = dict(snap, format=1, workers=_untable(snap["workers"]), ledger=_untable(snap["ledger"]),
               closed=[[k, v] for k, v in core.closed.items()])
    older = ServerCore.restore(core.alg, unpack_tree(*pack_tree(old)), core.cfg)
    for other in (again, older):
        assert {w: vars_of(x) for w, x in other.workers.items()} == {w: vars_of(x) for w, x in core.workers.items()}
        assert {j: vars_of(e) for j, e in other.ledger.items()} == {j: vars_of(e) for j, e in core.ledger.items()}
        assert list(other.closed.items()) == list(core.closed.items())
        check_indexes(other)
    # the same messages give the same answers
    job = next(e for e in core.ledger.values() if e.worker_id == "r")
    msg = Reply(job_id=job.job_id, created_at=job.created_at, grads=(np.full(D, 0.3, np.float32),))
    want = [repr(c) for c in core.handle("r", msg, 99.0)]
    for other in (again, older):
        assert [repr(c) for c in other.handle("r", msg, 99.0)] == want
    for values in ([], [1, 2**62], [True, False], [0.5, 1.0], [1, 0.5], ["a", "b", "a"], [(1, 2), ()], [{3, 1}, set()],
                   [None, (1, 2)], [None, None], [2**63, 1], [1, True]):
        back = _uncolumn(unpack_tree(*pack_tree(_column(values))))
        assert back == values and [type(v) for v in back] == [type(v) for v in values], values


def vars_of(x) -> dict:
    return {f: getattr(x, f) for f in type(x).__slots__}


def test_the_eviction_cursor_says_unknown_past_its_window_and_for_another_core():
    """``take`` lists what was swept since its last call, and None (look at all) at its first
    call, for another core object, or once more were swept than the core keeps (EVICTED_KEPT)."""
    core, cursor = make_core(), EvictionCursor()
    assert cursor.take(core) is None
    assert cursor.take(core) == []
    for iid in range(3):
        core.evicted.append(iid)
        core.evictions += 1
    assert sorted(cursor.take(core)) == [0, 1, 2] and cursor.take(core) == []
    for iid in range(EVICTED_KEPT + 1):
        core.evicted.append(100 + iid)
        core.evictions += 1
    assert cursor.take(core) is None and cursor.take(core) == []
    assert cursor.take(make_core()) is None
