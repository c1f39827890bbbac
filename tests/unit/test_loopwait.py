"""The daemon loop's wait (ps/net/loopwait.py) against real libzmq sockets, its busy poll on a fake
clock and its ``auto`` rule, and the job seeds' cheap draw (ps/core/dispatch.py sample_seed) against numpy's."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest
import zmq

from ps.core.dispatch import sample_seed
from ps.net.loopwait import AUTO_BOUND_US, BusyPoll, LoopWait, usable_cpus


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"up")  # the connection is made and its commands processed before the test begins
    assert router.poll(5000), "no connection within 5 s"
    router.recv_multipart()
    yield router, dealer
    dealer.close()
    router.close()
    ctx.term()


def _wait_for(wait: LoopWait, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if wait.wait(100):
            return True
    return False


def test_a_message_ends_the_wait_and_the_receive_is_told_to_look(pair):
    router, dealer = pair
    wait = LoopWait()
    wait.add(router)
    assert not wait.wait(0)  # nothing yet
    assert wait.take_quiet(router)  # it held nothing and its descriptor did not fire
    assert not wait.take_quiet(router)  # once only
    dealer.send(b"hi")
    assert _wait_for(wait)
    assert not wait.take_quiet(router)  # it fired: the receive must look
    assert router.recv_multipart()[1] == b"hi"
    wait.close()


def test_a_message_queued_before_the_wait_ends_it_at_once(pair):
    """A message libzmq already took in (its descriptor's signal consumed by an earlier call, here
    a send) must not be slept over: the wait asks EVENTS first."""
    router, dealer = pair
    wait = LoopWait()
    wait.add(router)
    dealer.send(b"one")
    end = time.monotonic() + 5
    while not router.get(zmq.EVENTS) & zmq.POLLIN:  # libzmq processes the signal here
        assert time.monotonic() < end
        time.sleep(0.001)
    t0 = time.monotonic()
    assert wait.wait(2000)
    assert time.monotonic() - t0 < 1.0  # not the 2 s timeout: it did not block
    assert not wait.take_quiet(router)
    wait.close()


def test_a_plain_descriptor_wakes_it_and_quiet_is_per_socket():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # no peer: nothing can make its descriptor fire
    router.linger = 0
    router.bind_to_random_port("tcp://127.0.0.1")
    a, b = socket.socketpair()
    try:
        wait = LoopWait()
        wait.add(router)
        wait.add(a)
        b.send(b"x")
        assert wait.wait(2000)
        assert wait.take_quiet(router)  # the descriptor that fired was the plain one
        wait.close()
    finally:
        a.close()
        b.close()
        router.close()
        ctx.term()


def test_sample_seed_is_numpys_draw():
    for seed in (0, 1, 12345, 2**40 + 7):
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        assert [sample_seed(a) for _ in range(2000)] == [int(b.integers(0, 2**63)) for _ in range(2000)]
        assert a.bit_generator.state == b.bit_generator.state  # the same draws consumed
    c = np.random.default_rng(3)
    c.bit_generator.state = np.random.default_rng(99).bit_generator.state  # as a restore sets it
    d = np.random.default_rng(99)
    assert sample_seed(c) == int(d.integers(0, 2**63))


class _Ep:
    """A scripted epoll on a fake clock: a message is ready from ``ready_at``; a poll without
    waiting costs 1 µs, a blocking one sleeps until the message or its timeout."""

    def __init__(self) -> None:
        self.t = 0.0
        self.ready_at = float("inf")
        self.nonblocking = self.blocking = 0

    def now(self) -> float:
        return self.t

    def poll(self, timeout: float = -1) -> list:
        if self.t >= self.ready_at:
            return [(5, 1)]
        if timeout == 0:
            self.nonblocking += 1
            self.t += 1e-6
            return []
        self.blocking += 1
        self.t = min(self.ready_at, self.t + timeout)
        return [(5, 1)] if self.t >= self.ready_at else []

    def close(self) -> None:
        pass


def _serve(wait: LoopWait, ep: _Ep, gap_s: float, n: int) -> None:
    """``n`` lockstep rounds: a message ``gap_s`` after each wait begins, taken at once."""
    for _ in range(n):
        ep.ready_at = ep.t + gap_s
        assert wait.wait(100)
        ep.t = ep.ready_at  # handled; the next round's wait begins now
        ep.ready_at = float("inf")


def _fake(spin_max_s: float) -> tuple[LoopWait, _Ep]:
    ep = _Ep()
    wait = LoopWait(spin_max_s, clock=ep.now)
    wait.ep.close()
    wait.ep = ep
    return wait, ep


def test_busy_poll_grows_to_catch_messages_that_come_within_its_bound():
    wait, ep = _fake(400e-6)
    _serve(wait, ep, 200e-6, 20)
    assert 200e-6 <= wait.spin <= 400e-6  # 10 -> 20 -> ... -> 320 µs: enough, so it stops growing
    blocking = ep.blocking
    _serve(wait, ep, 200e-6, 50)
    assert ep.blocking == blocking  # every message caught while polling: no sleep
    assert wait.spin_hits >= 50


def test_busy_poll_never_starts_for_messages_later_than_its_bound():
    wait, ep = _fake(400e-6)
    _serve(wait, ep, 2e-3, 50)
    assert wait.spin == 0 and wait.spins == 0 and ep.nonblocking == 0  # no CPU spent polling


def test_busy_poll_shrinks_when_messages_slow_down_and_is_off_by_default():
    wait, ep = _fake(400e-6)
    _serve(wait, ep, 200e-6, 20)
    assert wait.spin > 0
    _serve(wait, ep, 5e-3, 8)  # each miss costs at most the window, then halves it
    assert wait.spin == 0
    polled = ep.nonblocking
    _serve(wait, ep, 5e-3, 20)
    assert ep.nonblocking == polled
    off, ep2 = _fake(0.0)
    _serve(off, ep2, 50e-6, 20)
    assert ep2.nonblocking == 0 and off.spins == 0


def test_busy_poll_never_outlasts_the_loops_timeout():
    wait, ep = _fake(400e-6)
    _serve(wait, ep, 200e-6, 20)
    t0 = ep.t
    assert not wait.wait(0)  # a timeout of 0: no polling at all
    assert ep.t == t0 and ep.nonblocking == 0 or ep.t - t0 < 1e-5


def test_busy_poll_setting_auto_polls_only_with_a_cpu_for_each_process_on_the_host():
    auto = BusyPoll.parse("auto")
    assert auto == BusyPoll(AUTO_BOUND_US, True) and str(auto) == "auto" and BusyPoll.parse(" AUTO ").auto
    # the server and one worker on two CPUs: poll; a second worker (or a local shard): not
    assert auto.bound_s(cpus=2, local_processes=0) == auto.bound_s(2, 1) == AUTO_BOUND_US / 1e6
    assert auto.bound_s(2, 2) == auto.bound_s(1, 1) == 0.0
    assert auto.bound_s(16, 15) > 0 and auto.bound_s(16, 16) == 0.0
    fixed = BusyPoll.parse("300")  # a number polls whatever runs beside it
    assert fixed == BusyPoll(300, False) and fixed.bound_s(1, 50) == 300e-6 and str(fixed) == "300"
    assert BusyPoll.parse("0").bound_s(64, 0) == 0.0 and BusyPoll() == BusyPoll.parse("0")
    for bad in ("-1", "100001", "1.5", "abc", ""):
        with pytest.raises(ValueError):
            BusyPoll.parse(bad)


def test_a_bound_set_to_nothing_stops_the_busy_poll_at_once():
    wait, ep = _fake(400e-6)
    _serve(wait, ep, 200e-6, 20)
    assert wait.spin > 0
    wait.set_bound(0.0)  # auto: a second worker joined on this host
    polled = ep.nonblocking
    _serve(wait, ep, 200e-6, 20)
    assert wait.spin == 0 and ep.nonblocking == polled
    wait.set_bound(100e-6)  # the bound back, smaller: the window grows again, never past it
    _serve(wait, ep, 50e-6, 20)
    assert 0 < wait.spin <= 100e-6 and ep.nonblocking > polled


def test_usable_cpus_is_the_affinity_under_the_cgroups_quota(monkeypatch, tmp_path):
    import builtins

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    real_open = builtins.open
    for text, want in (("max 100000\n", 4), ("150000 100000\n", 2), ("50000 100000\n", 1), ("800000 100000", 4),
                       ("garbage", 4), (None, 4)):
        def fake_open(path, *a, _text=text, **k):
            if path == "/sys/fs/cgroup/cpu.max":
                if _text is None:
                    raise FileNotFoundError(path)
                f = tmp_path / "cpu.max"
                f.write_text(_text)
                return real_open(f, *a, **k)
            return real_open(path, *a, **k)
        monkeypatch.setattr(builtins, "open", fake_open)
        assert usable_cpus() == want, text
