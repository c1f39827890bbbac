"""The worker's DEALER sends no ZMTP PINGs (a PING queued behind a full receive pipe on a reset
connection aborts libzmq 4.3.5, SECURITY.md) and keeps TCP keepalive in their place."""

from __future__ import annotations

import zmq

from worker.link import Worker, WorkerConfig


def test_the_worker_socket_sets_no_zmtp_heartbeat_and_keeps_tcp_keepalive():
    w = Worker(WorkerConfig(server="tcp://127.0.0.1:1"))
    try:
        w._connect()
        s = w.sock
        assert s.getsockopt(zmq.HEARTBEAT_IVL) == 0
        assert s.getsockopt(zmq.TCP_KEEPALIVE) == 1 and s.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == 10
    finally:
        w.sock.close(linger=0)
        w.ctx.term()
