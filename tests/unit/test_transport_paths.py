"""The measuring instrument of benchmarks/transport_paths.py: one real round trip with a libzmq DEALER,
so that the figures it writes come from a server that speaks the protocol and does raw pyzmq's update."""

from __future__ import annotations

import socket
import threading

import msgpack
import numpy as np
import pytest
import zmq

from benchmarks.common import LR
from benchmarks.transport_paths import serve_zmtp


@pytest.mark.parametrize("d", [10, 100_000])
def test_a_libzmq_dealer_gets_the_updated_iterate_back(d):
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    stop = threading.Event()
    server = threading.Thread(target=serve_zmtp, args=(ls, d, stop), daemon=True)
    server.start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.rcvtimeo = 10_000
    try:
        s.connect("tcp://127.0.0.1:%d" % ls.getsockname()[1])
        g = np.arange(d, dtype=np.float32)
        expect = np.zeros(d, np.float32)
        for v in (1, 2):
            s.send_multipart([msgpack.packb({"w": 0}), g])
            head, x = s.recv_multipart()
            expect = expect - np.float32(LR) * g
            assert msgpack.unpackb(head) == {"v": v, "dtype": "<f4", "shape": [d]}
            np.testing.assert_array_equal(np.frombuffer(x, "<f4"), expect)
    finally:
        s.close()
        ctx.term()
        stop.set()
        server.join(10)
        ls.close()
    assert not server.is_alive()


def test_the_handover_path_serves_workers_through_descriptors_passed_after_the_handshake():
    """The hand-over prototype end to end (spawned front, forked ZMTP server, two libzmq workers):
    every update in the cell went through a connection the front passed on after READY."""
    from benchmarks.transport_paths import run

    r = run("handover", 1000, 2, 0.5, 0.2)
    assert not r.skipped, r.skipped
    assert r.updates > 20 and r.updates_per_s > 0
