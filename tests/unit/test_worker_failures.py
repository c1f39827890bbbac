"""Worker failures without processes: the worker's texts and logs, and how the server shows them
(status table and JSON rows, report, Prometheus). The real-process tests are in
tests/integration/test_worker_failures.py."""

from __future__ import annotations

import logging
import select

import numpy as np
import pytest

import algorithms
from problems.base import GradResult
from protocol.codec import decode
from protocol.messages import Error, ErrorCode, Hello, Job, JobKind, Ready, Status
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore
from ps.observe.metrics import SnapshotCollector
from ps.ops.report import render_markdown, worker_table
from ps.ops.status import render_status
from worker.compute import BadGradient, describe_layout, run_job
from worker.runner import ComputeThread, DelaySpec, FailureLog

LAYOUT = (("w", (5, 6)), ("b", (1,)))


class Toy:
    """A 31-parameter problem whose grad returns whatever ``make`` builds."""

    layout = LAYOUT

    def __init__(self, make) -> None:
        self.make = make

    def grad(self, x, seed, batch_size):
        return GradResult(self.make(seed), 0.0)

    def grad_pair(self, x_new, x_old, seed, batch_size):
        return self.grad(x_new, seed, batch_size), self.grad(x_old, seed, batch_size)

    def full_grad(self, x, lo, hi):
        return self.make(lo), hi - lo, 0.0

    def sample_cost(self, seed, batch_size):
        return 1.0


def job(kind=JobKind.GRAD, job_id=0) -> Job:
    ids = (0, 1) if kind == JobKind.GRAD_PAIR else (0,)
    return Job(job_id=job_id, kind=kind, created_at=0, iterate_ids=ids, seed=job_id, shard=(0, 4)
               if kind == JobKind.FULL_GRAD else None)


def points(kind=JobKind.GRAD):
    return (np.zeros(31, np.float32),) * (2 if kind == JobKind.GRAD_PAIR else 1)


# --------------------------------------------------------------------------- the worker's side

def test_describe_layout_names_blocks_and_abbreviates_long_layouts():
    assert describe_layout(LAYOUT) == "w (5, 6), b (1,)"
    many = [(f"l{i}", (i + 1,)) for i in range(11)]
    assert describe_layout(many) == ("l0 (1,), l1 (2,), l2 (3,), l3 (4,), l4 (5,), l5 (6,), l6 (7,), l7 (8,), "
                                     "\u2026 3 more")
    assert describe_layout([]) == ""


@pytest.mark.parametrize("kind,method", [(JobKind.GRAD, "grad"), (JobKind.GRAD_PAIR, "grad_pair"),
                                         (JobKind.FULL_GRAD, "full_grad")])
def test_run_job_names_the_layout_when_a_gradient_has_the_wrong_size(kind, method):
    with pytest.raises(BadGradient) as e:
        run_job(job(kind), points(kind), Toy(lambda s: np.zeros(5)))
    assert str(e.value) == f"{method}: expected 31 values (w (5, 6), b (1,)), got 5"
    with pytest.raises(BadGradient) as e:
        run_job(job(kind), points(kind), Toy(lambda s: np.zeros((31, 1))))
    assert str(e.value) == f"{method}: expected 31 values (w (5, 6), b (1,)) as a flat vector, got shape (31, 1)"
    reply = run_job(job(kind), points(kind), Toy(lambda s: np.ones(31)))  # the right size passes, as float32
    assert all(g.shape == (31,) and g.dtype == np.float32 for g in reply.grads)


def test_failure_log_logs_each_kind_of_failure_once_with_its_traceback_then_counts(caplog):
    flog = FailureLog(every=100)

    def boom(i):
        raise ValueError(f"boom {i}")  # the same place whatever the text

    def other():
        raise KeyError("k")

    caplog.set_level(logging.ERROR, logger="latecomer.worker")
    texts = []
    for i in range(250):
        try:
            boom(i)
        except ValueError as e:
            texts.append(flog.record(i, e))
    assert texts[7] == "ValueError: boom 7"
    records = caplog.records
    assert [r.exc_info is not None for r in records] == [True, False, False], "one traceback, then counts"
    assert records[0].getMessage() == "job 0 failed: ValueError: boom 0"
    assert "(100 jobs failed so far" in records[1].getMessage() and "(200 jobs" in records[2].getMessage()
    caplog.clear()
    try:
        other()
    except KeyError as e:
        assert flog.record(250, e) == "KeyError: 'k'"
    try:
        run_job(job(), points(), Toy(lambda s: np.zeros(5)))
    except BadGradient as e:
        assert flog.record(251, e) == "grad: expected 31 values (w (5, 6), b (1,)), got 5"
    assert [r.exc_info is not None for r in caplog.records] == [True, False], \
        "a new place gets its traceback; a wrong-size gradient is one line"


def wait_outbox(ct: ComputeThread, n: int, timeout: float = 30.0) -> list:
    """The compute thread's results, waiting on its wake-up pipe (no sleeps)."""
    while len(ct.outbox) < n:
        assert select.select([ct.wake_r], [], [], timeout)[0], f"{len(ct.outbox)} of {n} results"
        ct.drain_wakeups()
    return [ct.outbox.popleft() for _ in range(n)]


def test_compute_thread_turns_a_raising_grad_into_a_failed_job_and_goes_on():
    def grad_of(seed):
        if seed % 2:
            raise RuntimeError(f"bad seed {seed}")
        return np.ones(31)

    ct = ComputeThread(lambda: Toy(grad_of), DelaySpec())
    try:
        assert wait_outbox(ct, 1)[0][0] == ComputeThread.LOADED
        for i in range(4):
            ct.submit(job(job_id=i), points())
        out = wait_outbox(ct, 4)
        assert [(jid, r is None, err) for jid, r, err in out] == [
            (0, False, None), (1, True, "RuntimeError: bad seed 1"),
            (2, False, None), (3, True, "RuntimeError: bad seed 3")]
        assert ct.failures.count == 2
    finally:
        ct.close()


@pytest.mark.parametrize("exc,text", [(ValueError("problem 'm:f': cannot import module 'm' (No module named 'm')"),
                                       "problem 'm:f': cannot import module 'm' (No module named 'm')"),
                                      (RuntimeError("no GPU"), "RuntimeError: no GPU")])
def test_compute_thread_reports_why_the_problem_cannot_be_loaded(exc, text):
    def load():
        raise exc

    ct = ComputeThread(load, DelaySpec())
    try:
        assert wait_outbox(ct, 1) == [(ComputeThread.LOAD_FAILED, None, text)]
    finally:
        ct.close()


# --------------------------------------------------------------------------- the server's side

def failing_core(k: int = 2) -> ServerCore:
    """w1 benched after k failures, w2 one failure then fine, w3 unable to load the problem."""
    core = ServerCore(algorithms.build("asgd", {"lr": 0.1}), np.zeros(4, np.float32),
                      CoreConfig(problem="mymod:make", max_failed_jobs=k))
    for wid in ("w1", "w2", "w3"):
        core.handle(wid, Hello(worker_id=wid, boot=1, credit=1), 0.0)
    for wid in ("w1", "w2"):
        core.handle(wid, Ready(credit=1), 0.0)
    for _ in range(k):
        jid = next(iter(core.workers["w1"].outstanding))
        core.handle("w1", Error(ErrorCode.COMPUTE_FAILED, "ValueError: boom", job_id=jid), 0.1)
    jid = next(iter(core.workers["w2"].outstanding))
    core.handle("w2", Error(ErrorCode.COMPUTE_FAILED, "KeyError: 'k'", job_id=jid), 0.2)
    core.handle("w3", Error(ErrorCode.PROBLEM_UNAVAILABLE, "cannot import module 'mymod'"), 0.3)
    return core


@pytest.fixture
def daemon():
    from problems.quadratic import make_quadratic
    from ps.drivers.daemon import Daemon

    problem = make_quadratic(d=4)
    d = Daemon(failing_core(), problem, "tcp://127.0.0.1:0", shm="off")
    try:
        yield d
    finally:
        d.close()


def test_status_rows_show_state_failed_jobs_and_last_error(daemon):
    st = decode(daemon.status_frames(7))
    rows = {r[0]: dict(zip(st.columns, r, strict=True)) for r in st.rows}
    assert (rows["w1"]["state"], rows["w1"]["failed"], rows["w1"]["last_error"]) == ("benched", 2, "ValueError: boom")
    assert (rows["w2"]["state"], rows["w2"]["failed"], rows["w2"]["last_error"]) == ("failing", 1, "KeyError: 'k'")
    assert rows["w3"]["state"] == "loading"
    assert rows["w3"]["last_error"] == "cannot load problem mymod:make: cannot import module 'mymod'"
    assert st.info["counter.failed"] == 3 and st.info["workers_benched"] == 1 and st.info["counter.benched"] == 1
    text = render_status(st)
    assert "failed 3," in text
    assert "  w1 (benched, 2 failed jobs): ValueError: boom" in text.splitlines()
    assert "  w3 (loading, 0 failed jobs): cannot load problem mymod:make: cannot import module 'mymod'" in text
    header = next(line for line in text.splitlines() if line.startswith("worker "))
    assert "last_error" not in header and "state" in header and "failed" in header


def test_status_of_256_failing_workers_with_the_longest_ids_still_fits(daemon):
    core = daemon.core
    for i in range(256):
        wid = f"{i:03d}" + "w" * 61
        core.handle(wid, Hello(worker_id=wid, boot=1, credit=1, device="d" * 64), 1.0)
        core.workers[wid].last_error = "E" * 1000
    st = decode(daemon.status_frames(1))
    assert isinstance(st, Status)
    assert len(st.rows) == 256 and {len(r[-1]) for r in st.rows if len(r[0]) == 64} == {40}, \
        "errors cut shorter to fit the header cap"


def test_daemon_bad_shape_names_the_problems_layout(daemon):
    assert daemon.core.layout_text == "x (4,)"


def test_prometheus_counts_failed_jobs_and_benched_workers():
    core = failing_core()
    col = SnapshotCollector()
    col.publish({"counters": core.counters.as_dict(), "version": 0, "workers": 3, "outstanding": 2, "benched": 1,
                 "step_rate": 0.0, "age_counts": {}, "figures": {}})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in col.collect() for s in fam.samples}
    assert samples[("latecomer_jobs_total", (("outcome", "failed"),))] == 3
    assert samples[("latecomer_workers_benched", ())] == 1 and samples[("latecomer_benched_total", ())] == 1


def test_report_counts_failed_jobs_and_shows_each_workers_last_error():
    core = failing_core()
    events = core.drain_events()
    table = worker_table(events)
    assert (table["w1"]["failed"], table["w1"]["benched"], table["w1"]["last_error"]) == (2, 1, "ValueError: boom")
    summary = {"counters": core.counters.as_dict(), "outstanding": core.outstanding, "accounted": core.accounted(),
               "version": 0, "stopped": "test", "elapsed_s": 1.0}
    md = render_markdown(events, summary, [], "runs/x")
    assert "issued = applied + dropped + lost + failed + cancelled + rejected + outstanding): True" in md
    assert "| failed | 3 |" in md
    assert "| w1 | 2 | 1 | ValueError: boom |" in md
    assert "| w3 | 0 | 0 | cannot load problem mymod:make: cannot import module 'mymod' |" in md
