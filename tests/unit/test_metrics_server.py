"""The metrics endpoint (ps/observe/metrics.py MetricsServer): the bound port for port 0, scrapes, and
idle connections that cost no thread and are bounded in number and in time (issue 13, 11)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from ps.observe.metrics import MESSAGES, OUTCOMES, MetricsServer, serve_metrics

SNAPSHOT = {"counters": {k: 0 for k in (*OUTCOMES, *MESSAGES, "issued", "workers_joined", "workers_lost",
                                        "quarantined", "benched")},
            "version": 7, "workers": 2, "outstanding": 1, "step_rate": 3.5, "age_counts": {0: 2, 3: 1},
            "figures": {"eval_loss": 0.25}, "paused": 1}


def scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


@pytest.fixture
def collector():
    c = serve_metrics(0)
    c.publish(SNAPSHOT)
    yield c
    c.close()


def test_port_zero_binds_a_real_port_and_scrapes_work(collector):
    assert collector.port > 0
    text = scrape(collector.port)
    assert "latecomer_version 7.0" in text and "latecomer_paused 1.0" in text and "latecomer_eval_loss 0.25" in text
    assert 'latecomer_staleness_bucket{le="2"} 2.0' in text
    with socket.create_connection(("127.0.0.1", collector.port), timeout=5) as s:
        s.sendall(b"POST /metrics HTTP/1.0\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 405")


def test_idle_connections_hold_no_thread_and_are_bounded(collector):
    server = collector.server
    threads = threading.active_count()
    socks = [socket.create_connection(("127.0.0.1", collector.port), timeout=5) for _ in range(500)]
    try:
        deadline = time.monotonic() + 5
        while server.evicted < 500 - server.max_connections and time.monotonic() < deadline:
            time.sleep(0.02)  # polling interval of a bounded wait
        assert threading.active_count() == threads, "no thread per connection"
        assert server.open_connections <= server.max_connections
        assert server.evicted >= 500 - server.max_connections, "the oldest idle ones were closed for new ones"
        assert "latecomer_version" in scrape(collector.port), "a scrape is served meanwhile"
    finally:
        for s in socks:
            s.close()


def test_an_idle_connection_is_closed_after_the_timeout():
    from prometheus_client import CollectorRegistry

    server = MetricsServer(CollectorRegistry(), 0, idle_timeout_s=0.3)
    try:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(b"GET /metr")  # a request never finished
        s.settimeout(5)
        t0 = time.monotonic()
        assert s.recv(10) == b"", "closed by the server"
        assert 0.2 <= time.monotonic() - t0 < 3
        s.close()
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(b"GET /" + b"x" * 10_000)  # a request line larger than the bound
        assert s.recv(100).startswith(b"HTTP/1.0 431")
        s.close()
    finally:
        server.close()
    assert not server.thread.is_alive()
