"""The daemon loop's wait (ps/net/loopwait.py) against real libzmq sockets, and the job seeds'
cheap draw (ps/core/dispatch.py sample_seed) against numpy's."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import zmq

from ps.core.dispatch import sample_seed
from ps.net.loopwait import LoopWait


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")
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


def test_a_plain_descriptor_wakes_it_and_quiet_is_per_socket(pair):
    router, dealer = pair
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


def test_sample_seed_is_numpys_draw():
    for seed in (0, 1, 12345, 2**40 + 7):
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        assert [sample_seed(a) for _ in range(2000)] == [int(b.integers(0, 2**63)) for _ in range(2000)]
        assert a.bit_generator.state == b.bit_generator.state  # the same draws consumed
    c = np.random.default_rng(3)
    c.bit_generator.state = np.random.default_rng(99).bit_generator.state  # as a restore sets it
    d = np.random.default_rng(99)
    assert sample_seed(c) == int(d.integers(0, 2**63))
