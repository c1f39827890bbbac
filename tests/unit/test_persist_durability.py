"""Durability of the state directory, observed: every fsync the journal and the checkpoints owe
(counted per policy and per file through a wrapped ``os.fsync``), the group commit of
``--fsync batch`` (a fake clock), recovery from a checkpoint plus a journal tail at exactly the
right LSN, a checkpoint round trip that compares the whole core state, and clock-round runs
that replay bit for bit."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from ps.journal import recovery, repair, runfile, segments
from ps.journal.persistence import Persistence
from ps.journal.segments import read_journal
from ps.journal.wal import BATCH_FSYNC_S, Journal


class FsyncLog:
    """Wraps ``os.fsync`` (and ``os.replace``, for the order) as ps/journal's modules call them: what was
    synced, by path (a directory ends with ``/``)."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, str]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            self.events.append(("fsync", path + "/" if os.path.isdir(path) else path))
            return real_fsync(fd)

        def replace(src, dst):
            self.events.append(("replace", f"{os.path.basename(src)} -> {os.path.basename(dst)}"))
            return real_replace(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def synced(self, path: str) -> int:
        return sum(1 for ev, p in self.events if ev == "fsync" and p == path)

    def clear(self) -> None:
        self.events.clear()


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fsyncs(monkeypatch):
    return FsyncLog(monkeypatch)


# --------------------------------------------------------------------------- the group commit in the daemon's loop

class _Poller:
    """Stands in for the loop's wait in Daemon.run (ps/net/loopwait.py LoopWait): records each
    timeout, lets the fake clock run for it (as if nothing arrived), and stops the daemon at the
    third wait."""

    def __init__(self, daemon, clock, fsyncs, seg, *, dirty):
        self.daemon, self.clock, self.fsyncs, self.seg, self.dirty = daemon, clock, fsyncs, seg, dirty
        self.timeouts: list[int] = []
        self.synced_at_poll: list[int] = []

    def __call__(self, *args):  # LoopWait(busy_poll_s)
        return self

    def add(self, *a):
        pass

    def close(self):
        pass

    def take_quiet(self, sock):
        return False

    def wait(self, timeout_ms):
        self.timeouts.append(timeout_ms)
        self.synced_at_poll.append(self.fsyncs.synced(self.seg))
        if len(self.timeouts) == 1:
            if self.dirty:
                self.daemon.persist.journal.append("tick", now=0.0)  # a record at t = 0.004: due at 0.010
            self.clock.t = 0.004
        elif len(self.timeouts) == 2:
            self.clock.t += timeout_ms / 1000
        else:
            self.daemon.stopping = "test"
        return False


@pytest.mark.parametrize("dirty", [True, False])
def test_batch_fsync_wakes_the_daemon_within_its_window_not_one_poll(tmp_path, monkeypatch, fsyncs, dirty):
    import algorithms
    import ps.drivers.daemon
    from problems.quadratic import make_quadratic
    from ps.core.config import CoreConfig
    from ps.core.server_core import ServerCore
    from ps.drivers.daemon import Daemon

    d = str(tmp_path)
    clock = FakeClock(0.0)
    journal = Journal(d, next_lsn=0, fsync="batch", clock=clock)
    pers = Persistence(d, journal, checkpoint_every=0, checkpoint_interval_s=0)
    core = ServerCore(algorithms.build("asgd", {"lr": 0.1}), np.zeros(4, np.float32), CoreConfig())
    daemon = Daemon(core, make_quadratic(d=4), "tcp://127.0.0.1:0", shm="off", clock=clock, persistence=pers)
    poller = _Poller(daemon, clock, fsyncs, journal.path, dirty=dirty)
    monkeypatch.setattr(ps.drivers.daemon, "LoopWait", poller)
    try:
        daemon.run()
    finally:
        daemon.close()
        pers.close()
    if dirty:
        # 0.010 - 0.004 s left in the window: the poll waits that, not the loop's 100 ms cap
        assert 1 <= poller.timeouts[1] <= math.ceil(BATCH_FSYNC_S * 1000) - 4, poller.timeouts
        assert poller.synced_at_poll[1] == 0, "not synced before its window ends"
        assert poller.synced_at_poll[2] == 1, "synced once the window ended, before the next poll"
    else:
        assert poller.timeouts[1] == 100, "nothing to sync: the poll's usual cap"



# --------------------------------------------------------------------------- fsync, per policy and per file

def _seg(d: str, n: int = 1) -> str:
    return os.path.join(d, f"wal-{n:06d}.log")


def test_fsync_always_syncs_each_record_before_append_returns(tmp_path, fsyncs):
    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="always")
    assert fsyncs.events == [("fsync", d + "/")], "a new segment's directory entry is synced"
    for i in range(5):
        j.append("tick", now=float(i))
        assert fsyncs.synced(j.path) == i + 1, "synced before append returns"
        j.maybe_sync()
    j.close()
    assert fsyncs.synced(j.path) == 5, "one per record, none more"


def test_fsync_batch_syncs_once_per_group_commit_window(tmp_path, fsyncs):
    d = str(tmp_path)
    clock = FakeClock(0.0)
    j = Journal(d, next_lsn=0, fsync="batch", clock=clock)
    appended, synced = [], []
    for i in range(30):  # a record every 4 ms, maybe_sync after each (as after each pass of the loop)
        clock.t = i * 0.004
        j.append("tick", now=clock.t)
        appended.append(clock.t)
        before = fsyncs.synced(j.path)
        j.maybe_sync()
        if fsyncs.synced(j.path) > before:
            synced.append(clock.t)
    # windows of 10 ms from the last sync: at 12, 24, ..., 108 ms: 9 syncs for 30 records
    assert len(synced) == 9 == fsyncs.synced(j.path), synced
    assert all(b - a >= BATCH_FSYNC_S for a, b in zip([0.0] + synced, synced, strict=False))
    waits = [min(s for s in synced if s >= t) - t for t in appended if t <= synced[-1]]
    # maybe_sync runs at each record here (every 4 ms; the daemon's poll wakes at the window's end)
    assert max(waits) <= BATCH_FSYNC_S + 0.004 + 1e-9, "no record waits past its window"
    j.close()
    assert fsyncs.synced(j.path) == 10, "close syncs the last window's records"


def test_fsync_never_syncs_no_record(tmp_path, fsyncs):
    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="never")
    for i in range(20):
        j.append("tick", now=float(i))
        j.maybe_sync()
    j.sync()
    j.close()
    assert fsyncs.synced(j.path) == 0 and fsyncs.synced(d + "/") == 1, fsyncs.events


@pytest.mark.parametrize("policy", ["always", "batch"])
def test_a_checkpoint_syncs_its_record_its_file_then_its_directory(tmp_path, fsyncs, policy):
    factory, _, problem = _core()
    core = factory()
    d = str(tmp_path)
    clock = FakeClock(0.0)
    pers = Persistence(d, Journal(d, next_lsn=0, fsync=policy, clock=clock), checkpoint_every=0,
                       checkpoint_interval_s=0)
    _drive(pers, core, problem, 5)
    fsyncs.clear()
    path = pers.checkpoint(core)
    name = os.path.basename(path)
    seg = pers.journal.path
    expected = [("fsync", path + ".tmp"), ("replace", f"{name}.tmp -> {name}"), ("fsync", d + "/")]
    if policy == "batch":  # the checkpoint record (and the batch before it) durable before the checkpoint
        expected.insert(0, ("fsync", seg))
    else:
        expected.insert(0, ("fsync", seg))  # always: the checkpoint record's own fsync
    assert fsyncs.events == expected
    pers.close()


def test_rotating_syncs_the_old_segment_and_the_new_ones_directory_entry(tmp_path, fsyncs):
    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="batch")
    j.append("tick", now=0.0)
    fsyncs.clear()
    j.rotate()
    assert fsyncs.events == [("fsync", _seg(d, 1)), ("fsync", d + "/")]
    j.close()


def test_pruning_syncs_the_directory_after_removing_segments(tmp_path, fsyncs, monkeypatch):
    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="never")
    for i in range(3):
        j.append("tick", now=float(i), pad="x" * 100)
        j.rotate()
    real_remove = os.remove

    def remove(path):
        fsyncs.events.append(("remove", os.path.basename(path)))
        return real_remove(path)

    monkeypatch.setattr(os, "remove", remove)
    fsyncs.clear()
    assert j.prune(covered_lsn=1, budget=0) == 2
    assert fsyncs.events == [("remove", "wal-000001.log"), ("remove", "wal-000002.log"), ("fsync", d + "/")]
    j.close()


def test_cutting_a_torn_tail_syncs_the_segment(tmp_path, fsyncs):
    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="never")
    for i in range(3):
        j.append("tick", now=float(i))
    j.close()
    with open(j.path, "r+b") as f:
        f.truncate(os.path.getsize(j.path) - 2)
    fsyncs.clear()
    assert segments.cut_torn_tail(d) is not None
    assert fsyncs.events == [("fsync", j.path)]


def test_run_json_is_synced_then_renamed_then_its_directory(tmp_path, fsyncs):
    d = str(tmp_path)
    runfile.write_run(d, {"problem": "quadratic"})
    path = os.path.join(d, "run.json")
    assert fsyncs.events == [("fsync", path + ".tmp"), ("replace", "run.json.tmp -> run.json"), ("fsync", d + "/")]


def test_repair_syncs_what_it_moves_and_cuts(tmp_path, fsyncs):
    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="never")
    for i in range(4):
        j.append("tick", now=float(i))
    j.close()
    data = bytearray(open(j.path, "rb").read())
    data[len(data) // 4 + 20] ^= 0xFF  # the second record's body (four of the same size)
    open(j.path, "wb").write(bytes(data))
    fsyncs.clear()
    report = repair.repair_journal(d)
    copy = os.path.join(report.moved_to, "wal-000001.log")
    assert fsyncs.events == [("fsync", copy), ("fsync", j.path), ("fsync", report.moved_to + "/"), ("fsync", d + "/")]


# --------------------------------------------------------------------------- a core's whole state

def _core(d=8, workers=2, algorithm="asgd", settings=None, round_period=None):
    import algorithms
    from problems import load_problem
    from ps.core.config import CoreConfig
    from ps.core.server_core import ServerCore

    problem = load_problem("quadratic", {"d": d})
    cfg = CoreConfig(problem="quadratic", problem_options={"d": d}, min_workers=workers, liveness_timeout_s=1e9,
                     seed=0, run_id=7, max_bad_replies=2, round_period_s=round_period)
    alg = algorithms.build(algorithm, settings or {"lr": 0.3})
    x0 = problem.init_params(0)
    return (lambda now=0.0: ServerCore(alg, x0, cfg, server_boot=1, now=now)), (
        lambda snap: ServerCore.restore(alg, snap, cfg, server_boot=1)), problem


def _drive(pers, core, problem, steps, *, now0=0.0, bad=(), ticks=False, dt=1.0):
    """Workers w1, w2 (and those in ``bad``, whose replies are NaN) replying in turn, fed through
    ``pers`` as the daemon feeds them (ticks at the core's deadlines with ``ticks``). Returns now."""
    from collections import deque

    from protocol.codec import encode
    from protocol.messages import Hello, Job, Ready, Reply
    from ps.core.commands import Send
    from worker.compute import run_job

    todo: deque = deque()
    now = now0

    def take(cmds):
        todo.extend((c.worker_id, c.msg) for c in cmds if isinstance(c, Send) and isinstance(c.msg, Job))

    def feed(wid, msg):
        if pers.record_message(core, wid, msg, encode(msg), now):
            take(core.handle(wid, msg, now))

    if not core.workers:
        for wid in ("w1", "w2", *bad):
            feed(wid, Hello(worker_id=wid, boot=1, credit=2, run_id=7))
            feed(wid, Ready(credit=2))
    else:
        todo.extend((e.worker_id, core._job_message(e, core.workers[e.worker_id])) for e in core.ledger.values()
                    if not e.received)
    lags = np.random.default_rng(5).uniform(0.01, 2 * dt, steps) if ticks else np.full(steps, dt)
    for lag in lags:  # with ticks: the daemon's loop passes are irregular, a tick at the first past a deadline
        now += float(lag)
        if ticks and now >= core.next_deadline() and pers.append("tick", now=now):
            take(core.on_tick(now))
        if not todo:
            continue
        wid, job = todo.popleft()
        if wid not in core.workers:
            continue
        r = run_job(job, [core.store[i] for i in job.iterate_ids], problem)
        grads = tuple(np.full_like(g, np.nan) for g in r.grads) if wid in bad else r.grads
        feed(wid, Reply(job_id=r.job_id, created_at=r.created_at, grads=grads, loss=r.loss, count=r.count,
                        compute_s=0.0, holds=()))
    return now


_DERIVED = {"alg", "cfg", "events", "layout_text", "_seq", "_next_seq", "_alive", "jobs", "_unref",
            "evicted", "evictions"}


def _same(a, b, where="core") -> None:
    """Assert a == b exactly: arrays by dtype and bits, objects with __slots__ field by field."""
    if isinstance(a, np.ndarray) or isinstance(a, np.generic):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a.keys()) == list(b.keys()), (where, list(a)[:5], list(b)[:5])
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)) or type(a).__name__ == "deque":
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(type(a), "__slots__") and not isinstance(a, (int, float, str)):
        assert type(a) is type(b), where
        for f in type(a).__slots__:
            _same(getattr(a, f), getattr(b, f), f"{where}.{f}")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        _same(vars(a), vars(b), where)
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), (where, a, b)


def assert_same_core(live, restored) -> None:
    """Every field of ServerCore a checkpoint restores, compared: ledger, closed memory,
    quarantine, workers, counters, the algorithm's state, the store and its references, the rng,
    pending specs, the round buffer, flags, clocks; plus the indexes restore rebuilds."""
    fields = set(vars(live)) - _DERIVED
    assert fields == set(vars(restored)) - _DERIVED
    for name in sorted(fields):
        if name == "state":
            _same(live.alg.to_state_dict(live.state), restored.alg.to_state_dict(restored.state), "alg_state")
        elif name == "rng":
            _same(live.rng.bit_generator.state, restored.rng.bit_generator.state, "rng")
        else:
            _same(getattr(live, name), getattr(restored, name), name)
    assert [e.job_id for e in live.jobs] == [e.job_id for e in restored.jobs]
    assert (live._free, live._eligible) == (restored._free, restored._eligible)


@pytest.mark.parametrize("algorithm,settings,round_period", [
    ("asgd", {"lr": 0.3}, None),
    ("storm-vr", {"lr": 0.2, "a": 0.2, "B_init": 4, "tau_lost": 1000}, 2.5),
])
def test_a_checkpoint_round_trip_restores_the_whole_core(tmp_path, algorithm, settings, round_period):
    from ps.journal.checkpoints import read_checkpoint, write_checkpoint

    factory, restore, problem = _core(algorithm=algorithm, settings=settings, round_period=round_period)
    core = factory(now=0.5)
    d = str(tmp_path)
    pers = Persistence(d, Journal(d, next_lsn=0, fsync="never"), checkpoint_every=0, checkpoint_interval_s=0)
    _drive(pers, core, problem, 40, bad=("w3",), ticks=True, dt=0.7)
    pers.close()
    # what the comparison needs to see: the tables non-trivial
    assert core.closed and core.store and core.workers and core.counters.applied
    if round_period:  # one job per clock round: w3 never gets one; a result waits in the buffer for its round
        assert core.buffer and core.ledger and math.isfinite(core.next_round_at)
    else:
        assert core.ledger and core.counters.quarantined == 1 and "w3" in core.quarantine
    path = write_checkpoint(d, 99, core.snapshot())
    lsn, snap = read_checkpoint(path)
    restored = restore(snap)
    assert lsn == 99
    assert_same_core(core, restored)


# --------------------------------------------------------------------------- recovery: checkpoint + tail

def test_recovery_resumes_right_after_the_checkpoints_lsn(tmp_path, monkeypatch):
    from ps.journal.checkpoints import checkpoint_files
    from ps.journal.recovery import recover

    factory, restore, problem = _core()
    core = factory()
    d = str(tmp_path)
    pers = Persistence(d, Journal(d, next_lsn=0, fsync="never"), checkpoint_every=0, checkpoint_interval_s=0)
    now = _drive(pers, core, problem, 12)
    pers.checkpoint(core)
    ckpt_lsn = pers.journal.next_lsn - 1
    _drive(pers, core, problem, 6, now0=now)  # the tail: replies, the first right after the checkpoint
    last_lsn = pers.journal.next_lsn - 1
    pers.close()
    assert [lsn for lsn, _ in checkpoint_files(d)] == [ckpt_lsn]
    assert [r.op for r in read_journal(d, from_lsn=ckpt_lsn)][:2] == ["checkpoint", "reply"]
    applied = []
    real = recovery.apply_checked

    def spy(c, rec, *a, **kw):
        applied.append(rec.lsn)
        return real(c, rec, *a, **kw)

    monkeypatch.setattr(recovery, "apply_checked", spy)
    rec_core, last, n = recover(factory, restore, d, problem)
    assert applied == list(range(ckpt_lsn + 1, last_lsn + 1)), "from the checkpoint's LSN + 1, each once"
    assert (last, n) == (last_lsn, last_lsn - ckpt_lsn)
    assert_same_core(core, rec_core)


# --------------------------------------------------------------------------- clock rounds replay bit for bit

def test_a_clock_round_run_replays_bit_for_bit(tmp_path):
    """A run created the way serve --state creates it (ps/drivers/server.py's open_state: the core created
    at time.monotonic()), storm-vr with --round-period, driven with the daemon's clock inputs;
    replay_run (latecomer replay) and recovery without a checkpoint must give its bits."""
    import time

    from ps.core.spec import TrainingSpec
    from ps.drivers.replay import replay_run
    from ps.drivers.server import StateOptions
    from ps.drivers.server import open_state as _open_state
    from ps.journal.recovery import recover
    from ps.journal.segments import run_start

    d = str(tmp_path / "state")
    spec = TrainingSpec(problem="quadratic", problem_options={"d": 16}, algorithm="storm-vr",
                        settings={"lr": 0.2, "a": 0.2, "B_init": 4, "tau_lost": 1000})
    core, problem, pers, _ = _open_state(StateOptions(d, checkpoint_every=0, checkpoint_interval_s=0, fsync="never"),
                                         spec, boot=1, batch_size=4, liveness_timeout=1e6, heartbeat_interval=0.5,
                                         min_workers=2, round_period=0.25, seed=0)
    created = core.next_round_at - 0.25
    now = time.monotonic()
    _drive(pers, core, problem, 200, ticks=True, dt=0.07, now0=now)
    pers.close()
    assert core.version >= 10, core.version
    result = replay_run(d)
    assert result.version == core.version and np.array_equal(result.final_x, core.params())
    assert result.counters == core.counters.as_dict()
    assert run_start(d)["now"] == created, "the start record holds the core's creation time"
    rec_core, _, _ = recover(lambda now=0.0: _fresh_like(core, problem, now), None, d, problem)
    assert np.array_equal(rec_core.params(), core.params()) and rec_core.next_round_at == core.next_round_at


def _fresh_like(core, problem, now):  # a factory as the CLI's: a fresh core of core's run
    from ps.core.server_core import ServerCore

    return ServerCore(core.alg, problem.init_params(core.cfg.seed), core.cfg, now=now)
