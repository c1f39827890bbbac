"""worker/sockio.py: a multipart message sent and received with the compiled calls arrives
whole, frame for frame, small frames copied and large ones not; a full pipe raises zmq.Again
before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from worker import sockio


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://sockio")
    b.connect("inproc://sockio")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


def test_frames_arrive_whole_and_in_order(pair) -> None:
    a, b = pair
    big = np.arange(sockio.COPY_BELOW // 4 + 3, dtype=np.float32)  # past the copy threshold: zero-copy
    small = np.arange(7, dtype=np.float64)
    frames = [b"rid", b"", small, memoryview(b"view"), big]
    sockio.send_frames(a, frames)
    assert b.poll(5000)
    got = sockio.recv_frames(b)
    assert [type(f) for f in got] == [zmq.Frame] * 5
    assert [f.bytes for f in got] == [b"rid", b"", small.tobytes(), b"view", big.tobytes()]
    assert [f.more for f in got] == [True] * 4 + [False]


def test_single_frame_and_plain_recv_interoperate(pair) -> None:
    a, b = pair
    sockio.send_frames(a, [b"one"])
    a.send_multipart([b"x", b"y"])
    assert b.poll(5000)
    assert [f.bytes for f in sockio.recv_frames(b)] == [b"one"]
    assert b.poll(5000)
    assert [f.bytes for f in sockio.recv_frames(b)] == [b"x", b"y"]


def test_a_full_pipe_raises_again_and_sends_nothing(pair) -> None:
    a, b = pair
    a.setsockopt(zmq.SNDHWM, 1)
    b.setsockopt(zmq.RCVHWM, 1)
    sent = 0
    with pytest.raises(zmq.Again):
        for _ in range(10_000):
            sockio.send_frames(a, [b"h", b"body"], zmq.NOBLOCK)
            sent += 1
    got = 0
    while b.poll(200):
        frames = sockio.recv_frames(b)
        assert [f.bytes for f in frames] == [b"h", b"body"]  # no message cut in two
        got += 1
    assert got == sent


def test_copy_threshold_decides_zero_copy(monkeypatch, pair) -> None:
    a, _ = pair
    calls = []
    monkeypatch.setattr(sockio, "_SEND", lambda s, f, flags, copy, track: calls.append((sockio._nbytes(f), copy)))
    sockio.send_frames(a, [b"ab", np.zeros(sockio.COPY_BELOW // 8, np.float64), np.zeros(10, np.float32)])
    assert calls == [(2, True), (sockio.COPY_BELOW, False), (40, True)]
