"""Prometheus endpoint and JSON log lines for the daemon.

The daemon's loop owns all state; every ~0.5 s it publishes an immutable snapshot (a plain dict)
that the metrics thread reads at scrape time (STYLE.md §4: other threads get immutable
snapshots, never the live tables).

The endpoint is :class:`MetricsServer`, one thread around a selector rather than
``prometheus_client``'s ThreadingHTTPServer (a thread per connection, held as long as the peer
keeps it idle): a connection costs a file descriptor and a buffer of at most
``MAX_REQUEST_BYTES``; at most ``MAX_CONNECTIONS`` are kept (a new one closes the one idle the
longest) and each is closed after ``IDLE_TIMEOUT_S`` without progress or once answered.
"""

from __future__ import annotations

import collections
import gzip
import json
import logging
import selectors
import socket
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder, gzip_accepted

log = logging.getLogger("latecomer.metrics")

AGE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
OUTCOMES = ("applied", "dropped", "lost", "failed", "cancelled", "rejected")
MESSAGES = ("late", "unknown", "invalid", "stray", "refused", "worker_errors")


class SnapshotCollector:
    """Renders the latest published snapshot as Prometheus metric families."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}
        self.server: MetricsServer | None = None  # set by serve_metrics

    @property
    def port(self) -> int:
        """The TCP port the endpoint is bound to (the OS's choice for port 0)."""
        return self.server.port if self.server is not None else 0

    def publish(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot  # one reference swap: atomic for the reading thread

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def collect(self):
        s = self.snapshot
        if not s:
            return
        c = s["counters"]
        jobs = CounterMetricFamily("latecomer_jobs", "Jobs settled, by outcome", labels=["outcome"])
        for o in OUTCOMES:
            jobs.add_metric([o], c[o])
        yield jobs
        yield CounterMetricFamily("latecomer_jobs_issued", "Jobs issued", value=c["issued"])
        msgs = CounterMetricFamily("latecomer_bad_messages", "Messages refused or ignored, by kind", labels=["kind"])
        for k in MESSAGES:
            msgs.add_metric([k], c[k])
        yield msgs
        yield CounterMetricFamily("latecomer_workers_joined", "Worker joins", value=c["workers_joined"])
        yield CounterMetricFamily("latecomer_workers_lost", "Workers declared dead", value=c["workers_lost"])
        yield CounterMetricFamily("latecomer_quarantined", "Workers quarantined", value=c["quarantined"])
        yield CounterMetricFamily("latecomer_benched", "Workers benched (their jobs kept failing)", value=c["benched"])
        yield GaugeMetricFamily("latecomer_version", "Server step (model updates applied)", value=s["version"])
        yield GaugeMetricFamily("latecomer_workers_alive", "Workers in the table", value=s["workers"])
        yield GaugeMetricFamily("latecomer_workers_benched", "Workers benched now (given no jobs)",
                                value=s.get("benched", 0))
        yield GaugeMetricFamily("latecomer_jobs_outstanding", "Jobs issued and not settled", value=s["outstanding"])
        yield GaugeMetricFamily("latecomer_step_rate", "Updates per second (last 10 s)", value=s["step_rate"])
        yield GaugeMetricFamily("latecomer_paused", "1 while the state directory cannot be written (disk full): no "
                                "job is issued, no message accepted", value=s.get("paused", 0))
        for name, value in sorted(s.get("figures", {}).items()):
            yield GaugeMetricFamily(f"latecomer_{name}", f"Latest {name}", value=value)
        shards = s.get("shards") or ()  # a sharded server: one series per shard (ps/sharded/hub.py)
        for name, key, doc in (("up", "connected", "1 while the shard is connected"),
                               ("lag_records", "lag_records", "Journal records the shard has not applied yet"),
                               ("rss_bytes", "rss_bytes", "The shard process's resident memory"),
                               ("blocks", "blocks_held", "Gradient blocks the shard holds, not yet applied"),
                               ("joins", "joins", "Times the shard joined (a restart joins again)")):
            if shards:
                g = GaugeMetricFamily(f"latecomer_shard_{name}", doc, labels=["shard"])
                for sh in shards:
                    g.add_metric([str(sh["index"])], float(sh[key]))
                yield g
        counts = s["age_counts"]
        buckets = [(str(b), sum(n for a, n in counts.items() if a <= b)) for b in AGE_BUCKETS]
        buckets.append(("+Inf", sum(counts.values())))
        yield HistogramMetricFamily("latecomer_staleness", "Age (steps) of applied replies", buckets=buckets,
                                    sum_value=float(sum(a * n for a, n in counts.items())))


MAX_CONNECTIONS = 64  # metrics connections kept open at once; a new one closes the one idle the longest
IDLE_TIMEOUT_S = 10.0  # a connection that sends nothing for this long is closed
MAX_REQUEST_BYTES = 8192  # request line and headers; more is answered 431 and closed


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "last")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock, self.inbuf, self.outbuf, self.last = sock, b"", b"", now


class MetricsServer:
    """A minimal HTTP/1.0 server for Prometheus scrapes on one thread (see the module docstring).

    Any ``GET`` (or ``HEAD``) path is answered with the registry's exposition (the format the
    ``Accept`` header picks, gzip if accepted), then the connection is closed.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, registry: Any, port: int, addr: str = "127.0.0.1", *,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.registry = registry
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        self.listener = socket.socket(family, kind, proto)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(sockaddr)
            self.listener.listen(128)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.port = self.listener.getsockname()[1]
        self.conns: collections.OrderedDict[socket.socket, _Conn] = collections.OrderedDict()  # oldest first
        self.evicted = 0  # connections closed to make room for a new one
        self.answered = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = False
        self.accept_paused_until = 0.0
        self.thread = threading.Thread(target=self._loop, name="latecomer-metrics", daemon=True)
        self.thread.start()

    @property
    def open_connections(self) -> int:
        return len(self.conns)

    def close(self) -> None:
        """Stop the thread and close every socket (waits at most 2 s for the thread)."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(2.0)

    # ---- the thread
    def _loop(self) -> None:
        try:
            while not self._stop:
                for key, mask in self._sel.select(timeout=1.0):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    elif mask & selectors.EVENT_READ:
                        self._read(key.fileobj)
                    else:
                        self._write(key.fileobj)
                self._expire(time.monotonic())
        finally:
            for sock in list(self.conns):
                self._drop(sock)
            for s in (self.listener, self._wake_r, self._wake_w):
                s.close()
            self._sel.close()

    def _accept(self) -> None:
        for _ in range(self.max_connections):  # a burst of connections: at most this many per wake-up
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: stop accepting a while (no busy loop)
                log.warning("metrics endpoint: cannot accept a connection (%s): pausing accepts for 1 s", e)
                self._sel.unregister(self.listener)
                self.accept_paused_until = time.monotonic() + 1.0
                return
            while len(self.conns) >= self.max_connections:
                self.evicted += 1
                self._drop(next(iter(self.conns)))  # the one idle the longest
            sock.setblocking(False)
            self.conns[sock] = _Conn(sock, time.monotonic())
            self._sel.register(sock, selectors.EVENT_READ)

    def _drop(self, sock: socket.socket) -> None:
        self.conns.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _touch(self, conn: _Conn) -> None:
        conn.last = time.monotonic()
        self.conns.move_to_end(conn.sock)

    def _expire(self, now: float) -> None:
        if self.accept_paused_until and now >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            self._sel.register(self.listener, selectors.EVENT_READ, "accept")
        while self.conns:
            sock, conn = next(iter(self.conns.items()))
            if now - conn.last < self.idle_timeout_s:
                return
            self._drop(sock)

    def _read(self, sock: socket.socket) -> None:
        conn = self.conns.get(sock)
        if conn is None:
            return
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        conn.inbuf += data
        self._touch(conn)
        end = conn.inbuf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.inbuf) > MAX_REQUEST_BYTES:
                self._respond(conn, "431 Request Header Fields Too Large", b"request too large\n")
            return
        self._respond_to(conn, conn.inbuf[:end].decode("latin-1"))

    def _respond_to(self, conn: _Conn, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split()
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
            self._respond(conn, "405 Method Not Allowed", b"only GET\n", extra=[("Allow", "GET, HEAD")])
            return
        try:
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            body = encoder(self.registry)
        except Exception as e:  # noqa: BLE001 - a collector failing must not end the thread
            log.warning("metrics: cannot render the figures: %s", e)
            self._respond(conn, "500 Internal Server Error", b"cannot render the metrics\n")
            return
        extra = []
        if gzip_accepted(headers.get("accept-encoding", "")):
            body = gzip.compress(body)
            extra.append(("Content-Encoding", "gzip"))
        self._respond(conn, "200 OK", body, content_type=content_type, extra=extra, head_only=parts[0] == "HEAD")
        self.answered += 1

    def _respond(self, conn: _Conn, status: str, body: bytes, *, content_type: str = "text/plain; charset=utf-8",
                 extra: list | None = None, head_only: bool = False) -> None:
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), ("Connection", "close"),
                   *(extra or [])]
        out = f"HTTP/1.0 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
        conn.outbuf = out.encode("latin-1") + (b"" if head_only else body)
        conn.inbuf = b""
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn.sock)

    def _write(self, sock: socket.socket) -> None:
        conn = self.conns.get(sock)
        if conn is None:
            return
        try:
            n = sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(sock)
            return
        conn.outbuf = conn.outbuf[n:]
        self._touch(conn)
        if not conn.outbuf:
            self._drop(sock)  # HTTP/1.0: one answer per connection


def serve_metrics(port: int, addr: str = "127.0.0.1") -> SnapshotCollector:
    """Start the HTTP endpoint (:class:`MetricsServer`); returns the collector to publish
    snapshots to, whose ``port`` is the port bound (the OS's choice for ``port`` 0).

    Raises:
        OSError: the address cannot be bound.
    """
    registry = CollectorRegistry()
    collector = SnapshotCollector()
    registry.register(collector)
    collector.server = MetricsServer(registry, port, addr)
    return collector


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the event's fields if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": record.created, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            out.update({k: v for k, v in event.items() if k not in out})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)
