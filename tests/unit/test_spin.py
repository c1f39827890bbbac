"""Busy polling's window (protocol/spin.py) on a fake clock, the rule of who may poll, and the
worker's data connection polling with it (worker/plainsock.py) on a real socket."""

from __future__ import annotations

import threading

import pytest

from protocol import zmtp
from protocol.spin import AUTO_BOUND_US, SPIN_MIN_S, SpinWindow, spare_cpu
from ps.net.loopwait import BusyPoll


class _Peer:
    """A fake clock and a message due at ``ready_at``: ``poll`` (non-blocking, 1 µs a call) says
    whether it came; ``wait`` (blocking) sleeps until it comes or ``timeout`` passes."""

    def __init__(self) -> None:
        self.t = 100.0
        self.ready_at = 0.0
        self.polls = self.waits = 0

    def now(self) -> float:
        return self.t

    def poll(self) -> str | None:
        self.polls += 1
        self.t += 1e-6
        return "msg" if self.t >= self.ready_at else None

    def wait(self, timeout: float = 1.0) -> str | None:
        self.waits += 1
        if self.ready_at <= self.t + timeout:
            self.t = max(self.t, self.ready_at)
            return "msg"
        self.t += timeout
        return None


def _turns(w: SpinWindow, p: _Peer, gap: float, n: int) -> int:
    """``n`` messages, each ``gap`` seconds after the last was taken; how many the busy poll took."""
    hits = w.hits
    for _ in range(n):
        p.ready_at = p.t + gap
        assert (w.spin(p.poll, 1.0) or w.block(p.wait)) == "msg"
    return w.hits - hits


def test_the_window_grows_to_catch_messages_within_the_bound_and_never_past_it():
    p = _Peer()
    w = SpinWindow(400e-6, p.now)
    assert w.window == 0 and w.spin(p.poll, 1.0) is None and p.polls == 0  # no window yet: no poll
    caught = _turns(w, p, 150e-6, 40)
    assert 150e-6 <= w.window <= 400e-6  # 10, 20, ..., 160 µs: enough to catch them, so it stops there
    assert caught >= 30 and p.waits <= 10
    w2 = SpinWindow(400e-6, p.now)
    _turns(w2, p, 390e-6, 20)  # just within the bound: 10, 20, ..., 320 µs miss, then the bound itself
    assert w2.window == 400e-6 and w2.hits > 0


def test_the_window_shrinks_to_nothing_when_messages_come_later_than_the_bound():
    p = _Peer()
    w = SpinWindow(400e-6, p.now)
    _turns(w, p, 100e-6, 20)
    assert w.window > 0
    _turns(w, p, 5e-3, 20)  # each wait lasts longer than the bound: halved, down to none
    assert w.window == 0
    polls = p.polls
    _turns(w, p, 5e-3, 5)
    assert p.polls == polls  # no CPU spent polling for late messages


def test_no_bound_no_poll_and_a_bound_set_to_nothing_stops_at_once():
    p = _Peer()
    off = SpinWindow(0.0, p.now)
    _turns(off, p, 50e-6, 20)
    assert off.window == 0 and off.spins == 0 and p.polls == 0
    w = SpinWindow(400e-6, p.now)
    _turns(w, p, 50e-6, 20)
    w.set_bound(0.0)  # a second worker joined this host: the server's next job says 0
    polls = p.polls
    _turns(w, p, 50e-6, 20)
    assert w.window == 0 and p.polls == polls
    w.set_bound(30e-6)  # back, smaller: grows again, never past it
    _turns(w, p, 20e-6, 20)
    assert SPIN_MIN_S <= w.window <= 30e-6 and p.polls > polls


def test_the_poll_never_outlasts_the_callers_timeout():
    p = _Peer()
    w = SpinWindow(400e-6, p.now)
    _turns(w, p, 100e-6, 20)
    assert w.window >= 100e-6
    p.ready_at, t0 = p.t + 1.0, p.t
    assert not w.spin(p.poll, 20e-6)
    assert p.t - t0 < 22e-6


def test_who_may_poll_a_cpu_for_each_process_of_the_run_on_its_host():
    assert spare_cpu(2, 2) and spare_cpu(16, 1) and not spare_cpu(2, 3)
    assert not spare_cpu(0, 1) and not spare_cpu(8, 0)  # CPUs not said / host not known: no
    auto, fixed, off = BusyPoll.parse("auto"), BusyPoll.parse("250"), BusyPoll.parse("0")
    # a worker alone on a 2-CPU host of its own, or beside the server: poll; a second one there: not
    assert auto.bound_us_for(2, 1) == auto.bound_us_for(2, 2) == AUTO_BOUND_US
    assert auto.bound_us_for(2, 3) == auto.bound_us_for(0, 1) == auto.bound_us_for(64, 0) == 0
    assert fixed.bound_us_for(1, 50) == fixed.bound_us_for(0, 0) == 250  # a number: whatever runs beside
    assert off.bound_us_for(64, 1) == 0
    # a worker whose large jobs libzmq's I/O thread moves: that thread counts as one more process
    assert auto.advice_us(2, 1, io_thread=False) == auto.advice_us(2, 1, io_thread=True) == AUTO_BOUND_US
    assert auto.advice_us(2, 2, io_thread=False) == AUTO_BOUND_US and auto.advice_us(2, 2, io_thread=True) == 0
    assert auto.advice_us(3, 2, io_thread=True) == AUTO_BOUND_US and fixed.advice_us(1, 9, io_thread=True) == 250


# ---------------------------------------------------------------- the worker's data connection

def _dealer_pair():
    """A ZmtpDealer connected to a plain socket that plays the server's side of ZMTP."""
    from tests.unit.test_plainsock import dealer_and_its_peer, until

    lst, d, srv = dealer_and_its_peer()
    lst.close()
    srv.sendall(zmtp.greeting(as_server=True) + zmtp.ready(b"ROUTER"))
    until(lambda: d.up, d, "handshake")
    return d, srv


def _frames(*parts: bytes) -> bytes:
    return b"".join(bytes(b) for b in zmtp.frames_out(list(parts)))


def test_the_data_connection_takes_a_message_in_its_busy_poll_without_a_blocking_wait():
    import time

    d, srv = _dealer_pair()
    try:
        w = SpinWindow(0.5, time.perf_counter)
        w.window = 0.5  # as if grown: a message within half a second is read without sleeping
        blocking = []
        real = d._wait
        d._wait = lambda left: blocking.append(left) or real(left)
        t = threading.Timer(0.02, srv.sendall, (_frames(b"job", b"x" * 5000),))
        t.start()
        got = d.recv(5000, w)
        t.join()
        assert [bytes(f) for f in got] == [b"job", b"x" * 5000]
        assert w.hits == 1 and blocking == []
        w.set_bound(0.0)  # off: the same wait blocks
        t = threading.Timer(0.02, srv.sendall, (_frames(b"job2"),))
        t.start()
        assert [bytes(f) for f in d.recv(5000, w)] == [b"job2"]
        t.join()
        assert w.spins == 1 and len(blocking) >= 1
    finally:
        d.close()
        srv.close()


@pytest.mark.parametrize("bound", [0.0, 0.2])
def test_the_data_connection_reports_a_drop_during_a_busy_poll(bound):
    import time

    d, srv = _dealer_pair()
    try:
        w = SpinWindow(bound, time.perf_counter)
        w.window = bound
        t = threading.Timer(0.02, srv.close)
        t.start()
        assert d.recv(5000, w) is None
        t.join()
        assert d.lost in ("closed by the peer", "receive: Connection reset by peer")  # it had unread bytes
    finally:
        d.close()


def test_the_advice_is_set_on_a_job_with_every_other_field_kept():
    import dataclasses

    import numpy as np

    from protocol.messages import Job, JobKind
    from ps.net.transport import with_spin

    job = Job(job_id=7, kind=JobKind.FULL_GRAD, created_at=3, iterate_ids=(4,), seed=5, batch_size=8, shard=(0, 9),
              deadline=6, point_ids=(4,), points=(np.ones(3, np.float32),), refs=(1,), grad_slots=(2,), xfer=11)
    advised = with_spin(job, 400)
    assert advised.spin_us == 400 and dataclasses.replace(advised, spin_us=0) == job
