"""Many cheap fake workers in one thread: raw ZMTP 3.0 (NULL mechanism) over non-blocking TCP
sockets, one per worker, driven by ``selectors``.

Each fake connects, says ``hello`` (and ``ready`` unless ``ready=False``), then sends a
``hb`` every ``hb_s`` seconds (spread evenly over the pool) so that the server keeps it. It
never answers a job: with ``ready`` it holds up to its credit in jobs (a job hoarder; its
heartbeats say ``seen=-1``, so the server never writes those jobs off), without ``ready`` it is
joined but holds nothing. What the server sends is read and counted (messages, bytes), never
interpreted, except the answer to ``hello`` (a welcome?) and ZMTP ``PING`` commands (answered
with ``PONG``, as libzmq does, when the server sets ``ZMQ_HEARTBEAT_IVL``). One file descriptor
per fake; 10,000 fit in a few tens of MiB.

For ``latecomer bench --workers-scale`` (benchmarks/scale.py) and the attack tests
(tests/integration/test_attack_scale.py)::

    pool = FakePool("tcp://127.0.0.1:5555", 1000, credit=1, hb_s=1.0)
    pool.run(lambda: still_going)        # join all, then heartbeat until told to stop
    pool.stats()                         # joined, messages in/out, ...

``python -m benchmarks.fake_workers ENDPOINT N [--credit C] [--hb S] [--seconds T] [--no-ready]``
runs a pool in its own process and prints its figures as JSON when it ends (SIGTERM ends it).
"""

from __future__ import annotations

import errno
import heapq
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Callable

from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import Heartbeat, Hello, Ready, Welcome

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00"
            + b"\x00" * 31)


def _frame(data: bytes, flags: int = 0) -> bytes:
    n = len(data)
    head = bytes([flags | LONG]) + struct.pack(">Q", n) if n > 255 else bytes([flags, n])
    return head + data


def _ready_command() -> bytes:
    name, value = b"Socket-Type", b"DEALER"
    body = bytes([5]) + b"READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return _frame(body, COMMAND)


def zmtp_message(frames: list) -> bytes:
    """One ZMTP message (MORE on every frame but the last) from the codec's frames."""
    out = bytearray()
    for i, f in enumerate(frames):
        out += _frame(bytes(f), MORE if i < len(frames) - 1 else 0)
    return bytes(out)


class _Fake:
    __slots__ = ("sock", "wid", "inbuf", "outbuf", "greeted", "handshaken", "next_hb", "joined", "first", "after")

    def __init__(self, sock: socket.socket, wid: str, next_hb: float) -> None:
        self.sock, self.wid, self.next_hb = sock, wid, next_hb
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.greeted = False  # the server's 64-byte greeting was read
        self.handshaken = False  # ... and its READY command
        self.joined = False  # the server answered hello with a welcome
        self.first: list[bytes] | None = []  # frames of the server's first message (None once decoded)
        self.after = b""  # hello (and ready), sent once the handshake is done (libzmq drops a peer that
        # pipelines messages behind its greeting)


class FakePool:
    """``n`` fake workers against ``endpoint`` (tcp://127.0.0.1:PORT).

    Args:
        credit: announced in hello/ready/hb (the server may grant less).
        hb_s: each fake sends a heartbeat this often (keep it under the server's liveness timeout).
        ready: send ``ready`` after ``hello`` (then the server hands it jobs, which it never answers).
        connect_batch: connections opened at once (libzmq's listen backlog is 100).
        prefix: worker ids are ``PREFIX-<i>``.
    """

    def __init__(self, endpoint: str, n: int, *, credit: int = 1, hb_s: float = 1.0, ready: bool = True,
                 connect_batch: int = 64, prefix: str = "fake") -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.addr = (host.strip("[]"), int(port))
        self.n, self.credit, self.hb_s, self.ready = n, credit, hb_s, ready
        self.connect_batch = connect_batch
        self.prefix = prefix
        self.boot = secrets.randbits(63)
        self.sel = selectors.DefaultSelector()
        self.fakes: list[_Fake] = []
        self.due: list[tuple[float, int]] = []  # (next heartbeat, index), a heap
        self.hb_bytes = zmtp_message(encode(Heartbeat(boot=self.boot, credit=credit, busy=(), seen=-1)))
        self.msgs_in = self.bytes_in = self.msgs_out = self.hb_out = 0
        self.closed_by_peer = 0
        self.refused = 0  # hellos answered with something else than a welcome (e.g. err REFUSED)
        self.last_refusal = ""
        self.join_s = float("nan")
        self.t_start = time.monotonic()

    # ---- I/O
    def _open(self, i: int, now: float) -> None:
        s = socket.socket(socket.AF_INET6 if ":" in self.addr[0] else socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = s.connect_ex(self.addr)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            raise OSError(err, f"connect to {self.addr}: {os.strerror(err)}")
        wid = f"{self.prefix}-{i}"
        f = _Fake(s, wid, now + self.hb_s * (i % 997) / 997)  # heartbeats spread over the period
        f.outbuf += GREETING + _ready_command()
        f.after = zmtp_message(encode(Hello(worker_id=wid, boot=self.boot, credit=self.credit)))
        self.msgs_out += 1
        if self.ready:
            f.after += zmtp_message(encode(Ready(credit=self.credit)))
            self.msgs_out += 1
        heapq.heappush(self.due, (f.next_hb, len(self.fakes)))
        self.fakes.append(f)
        self.sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, f)

    def _close(self, f: _Fake) -> None:
        try:
            self.sel.unregister(f.sock)
        except (KeyError, ValueError):
            pass
        f.sock.close()

    def _flush(self, f: _Fake) -> None:
        if f.outbuf:
            try:
                sent = f.sock.send(f.outbuf)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.closed_by_peer += 1
                self._close(f)
                return
            del f.outbuf[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if f.outbuf else 0)
        try:
            self.sel.modify(f.sock, events, f)
        except (KeyError, ValueError):
            pass

    def _read(self, f: _Fake) -> None:
        try:
            data = f.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.closed_by_peer += 1
            self._close(f)
            return
        self.bytes_in += len(data)
        buf = f.inbuf
        buf += data
        pos = 0
        if not f.greeted:
            if len(buf) < 64:
                return
            f.greeted, pos = True, 64
        while True:  # frames: flags, size (1 or 8 bytes), body
            if len(buf) - pos < 2:
                break
            flags = buf[pos]
            if flags & LONG:
                if len(buf) - pos < 9:
                    break
                size, head = struct.unpack_from(">Q", buf, pos + 1)[0], 9
            else:
                size, head = buf[pos + 1], 2
            if len(buf) - pos < head + size:
                break
            body = pos + head
            pos = body + size
            if flags & COMMAND:
                n = buf[body]
                if bytes(buf[body + 1:body + 1 + n]) == b"PING":  # ZMTP heartbeat: answer PONG with its context
                    f.outbuf += _frame(bytes([4]) + b"PONG" + bytes(buf[body + 1 + n + 2:pos]), COMMAND)
                    self._flush(f)
                elif not f.handshaken:  # the server's READY: now hello
                    f.handshaken = True
                    f.outbuf += f.after
                    f.after = b""
                    self._flush(f)
                continue
            if f.first is not None:  # the answer to hello: a welcome?
                f.first.append(bytes(buf[body:pos]))
            if not flags & MORE:
                self.msgs_in += 1
                if f.first is not None:
                    try:
                        answer = decode(f.first)
                    except RemoteProtocolError as e:
                        answer = e
                    f.joined = isinstance(answer, Welcome)
                    if not f.joined:
                        self.refused += 1
                        self.last_refusal = repr(answer)[:200]
                    f.first = None
        del buf[:pos]

    def _beat(self) -> float:
        """Send the heartbeats that are due (to fakes whose handshake is done); the next due time."""
        now = time.monotonic()
        due = self.due
        while due and due[0][0] <= now:
            t, i = heapq.heappop(due)
            f = self.fakes[i]
            if f.sock.fileno() < 0:
                continue
            if f.handshaken:
                f.outbuf += self.hb_bytes
                self.hb_out += 1
                self._flush(f)
            heapq.heappush(due, (max(t + self.hb_s, now), i))
        return due[0][0] if due else now + 0.05

    def _poll(self, timeout: float) -> None:
        for key, mask in self.sel.select(timeout):
            f = key.data
            if mask & selectors.EVENT_READ:
                self._read(f)
            if mask & selectors.EVENT_WRITE and f.sock.fileno() >= 0:
                self._flush(f)

    # ---- the pool
    def join(self, running: Callable[[], bool] = lambda: True, timeout: float = 120.0) -> int:
        """Open every connection (``connect_batch`` handshakes in flight at most); returns how
        many got their welcome within ``timeout``."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        i = 0
        while running() and time.monotonic() < deadline:
            pending = sum(1 for f in self.fakes[-self.connect_batch:] if f.first is not None and f.sock.fileno() >= 0)
            while i < self.n and pending < self.connect_batch:
                self._open(i, time.monotonic())
                i += 1
                pending += 1
            if i >= self.n and all(f.first is None or f.sock.fileno() < 0 for f in self.fakes):
                break
            self._beat()  # the first to join must not time out while the last connect
            self._poll(0.01)
        self.join_s = time.monotonic() - t0
        return self.joined()

    def joined(self) -> int:
        return sum(f.joined and f.sock.fileno() >= 0 for f in self.fakes)

    def heartbeat(self, running: Callable[[], bool], until: float = float("inf")) -> None:
        """Heartbeat every ``hb_s`` per fake and read what comes, until ``running()`` is False."""
        while running() and time.monotonic() < until:
            nxt = min(self._beat(), time.monotonic() + 0.05)
            self._poll(max(0.0, nxt - time.monotonic()))

    def run(self, running: Callable[[], bool], join_timeout: float = 120.0) -> dict:
        """Join, then heartbeat until ``running()`` turns False; close everything; the figures."""
        try:
            self.join(running, join_timeout)
            self.heartbeat(running)
        finally:
            self.close()
        return self.stats()

    def close(self) -> None:
        for f in self.fakes:
            if f.sock.fileno() >= 0:
                self._close(f)
        self.sel.close()

    def stats(self) -> dict:
        return {"fakes": self.n, "joined": sum(f.joined for f in self.fakes), "refused": self.refused,
                "last_refusal": self.last_refusal,
                "join_s": round(self.join_s, 2),
                "msgs_out": self.msgs_out + self.hb_out, "hb_out": self.hb_out, "msgs_in": self.msgs_in,
                "bytes_in": self.bytes_in, "closed_by_peer": self.closed_by_peer}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("endpoint")
    ap.add_argument("n", type=int)
    ap.add_argument("--credit", type=int, default=1)
    ap.add_argument("--hb", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--no-ready", action="store_true")
    a = ap.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    pool = FakePool(a.endpoint, a.n, credit=a.credit, hb_s=a.hb, ready=not a.no_ready)
    end = time.monotonic() + a.seconds
    try:
        pool.join(lambda: not stop)
        print(json.dumps(pool.stats()), flush=True)
        pool.heartbeat(lambda: not stop, until=end)
    finally:
        pool.close()
    print(json.dumps(pool.stats()), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
