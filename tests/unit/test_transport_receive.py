"""ServerTransport's receive and send paths: the common case (a float32 reply or job on the run's
wire, no parts, no shared memory) skips the conversions, and every other case still gets them
(a reply in another wire dtype is converted and a wrong one refused; a job goes out in the wire
dtype; a reply that came in parts has its frames re-encoded for the journal)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import algorithms
from problems import load_problem
from protocol.codec import decode, encode
from protocol.messages import Hello, Job, Reply
from protocol.wire import to_wire
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore
from ps.drivers.daemon import Daemon


class F:
    """A stand-in for a zmq.Frame: its bytes and length."""

    def __init__(self, b: bytes) -> None:
        self.bytes = b

    def __len__(self) -> int:
        return len(self.bytes)


@pytest.fixture
def make():
    made = []

    def daemon(wire: str, journaled: bool = False):
        problem = load_problem("quadratic", {"d": 4})
        core = ServerCore(algorithms.build("asgd", {"lr": 0.1}), np.zeros(4, np.float32), CoreConfig())
        d = Daemon(core, problem, "tcp://127.0.0.1:0", shm="off", wire_dtype=wire)
        d.transport.journaled = journaled
        made.append(d)
        core.handle("w", Hello(worker_id="w", boot=1, credit=1), 0.0)
        c = d.conns.get(b"r", 0.0)
        d.conns.bind(c, "w", "")
        d.conns.set_live(c, True, 0.0)
        return d

    yield daemon
    for d in made:
        d.transport.close()


def _reply(grads) -> Reply:
    return Reply(job_id=1, created_at=5, grads=(grads,), loss=1.0, count=1, compute_s=0.01)


def test_a_float32_reply_on_a_float32_wire_is_taken_as_it_came(make):
    d = make("f32")
    g = np.arange(4, dtype=np.float32)
    inb = d.transport.receive([F(b"r"), *encode(_reply(g))], 0.1, lambda t: [])
    assert inb.wid == "w" and inb.wire is None and inb.refusal is None and inb.key == ""
    assert inb.msg.grads[0].dtype == np.float32 and np.array_equal(inb.msg.grads[0], g)


@pytest.mark.parametrize("wire", ["bf16", "f16"])
def test_a_reply_in_another_wire_dtype_is_converted_and_a_float32_one_refused(make, wire):
    d = make(wire)
    g = np.arange(4, dtype=np.float32)
    inb = d.transport.receive([F(b"r"), *encode(_reply(to_wire(g, wire)))], 0.1, lambda t: [])
    assert inb.refusal is None and inb.msg.grads[0].dtype == np.float32
    np.testing.assert_allclose(inb.msg.grads[0], g)
    refused = d.transport.receive([F(b"r"), *encode(_reply(g))], 0.2, lambda t: [])
    assert refused.refusal is not None  # the fast path would have let it through


def test_a_reply_that_came_in_parts_is_journaled_as_one_message(make):
    d = make("f32", journaled=True)
    msg = _reply(np.arange(4, dtype=np.float32))
    frames = encode(msg)
    got = d.transport._reply_arrays(d.transport.receive([F(b"r"), *frames], 0.1, lambda t: []))
    assert got.msg.xfer == 0
    inb = d.transport.receive([F(b"r"), *frames], 0.1, lambda t: [])
    inb.msg = dataclasses.replace(inb.msg, xfer=7)  # as the reference decoder gives one from parts
    out = d.transport._reply_arrays(inb)
    assert out.msg.xfer == 0 and decode(out.frames).xfer == 0


@pytest.mark.parametrize("wire", ["f32", "f16"])
def test_a_job_goes_out_in_the_wire_dtype(make, wire):
    d = make(wire)
    sent = []
    d.transport.send_frames = lambda rid, frames: sent.append((rid, frames)) or True
    x = np.arange(4, dtype=np.float32)
    job = Job(job_id=1, kind=1, created_at=0, iterate_ids=(0,), seed=1, batch_size=1, shard=None,
              deadline=10, point_ids=(0,), points=(x,))
    assert d.transport.send("w", job)
    (rid, frames), = sent
    assert rid == b"r" and decode(frames).points[0].dtype == (np.float32 if wire == "f32" else np.float16)
