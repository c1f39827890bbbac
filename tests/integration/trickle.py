"""An attacker process for tests/integration/test_attack_descriptors.py: N raw TCP clients that
finish the ZMTP NULL handshake (greeting and READY) and then hold their connections, sending one
byte every ``--every`` seconds of a frame that never ends (the issue's trickle).

    python -m tests.integration.trickle tcp://127.0.0.1:5555 --count 10000 --source 127.0.0.2

It prints ``held K closed C failed F answered A`` once every client has connected, sent its
handshake and been answered by the server (K: those still open; C: those the server closed;
A: those answered, which the front accepted rather than left in the listen backlog), then
``closed K`` whenever the number the server closed changes, and exits when its stdin closes
(the test's end) or after ``--max-s``. It runs in a process of its own: 10,000 sockets need a
limit on open files that the test process shares with its other work.
"""

from __future__ import annotations

import argparse
import errno
import resource
import select
import socket
import sys
import time

from tests.integration.zmtp_raw import greeting, ready, tcp_address

BATCH = 200  # connections opened before their handshakes are sent


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class Attacker:
    def __init__(self, endpoint: str, source: str) -> None:
        self.addr = tcp_address(endpoint)
        self.source = source
        self.ep = select.epoll()
        self.open: dict[int, socket.socket] = {}
        self.closed = 0
        self.failed = 0
        self.hello = greeting() + ready()
        self.greeted: set[int] = set()  # connections the server answered (accepted by the front, not backlogged)

    def connect_batch(self, n: int, timeout: float = 30.0) -> None:
        """Open ``n`` connections and send each its greeting and READY once it is writable."""
        waiting = {}
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.bind((self.source, 0))
            err = s.connect_ex(self.addr)
            if err not in (0, errno.EINPROGRESS):
                s.close()
                self.failed += 1
                continue
            waiting[s.fileno()] = s
            self.ep.register(s.fileno(), select.EPOLLOUT)
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            for fd, ev in self.ep.poll(1.0):
                s = waiting.pop(fd, None)
                if s is None:
                    self._event(fd, ev)
                    continue
                if ev & (select.EPOLLERR | select.EPOLLHUP) or s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    self.ep.unregister(fd)
                    s.close()
                    self.failed += 1
                    continue
                s.send(self.hello)
                self.ep.modify(fd, select.EPOLLIN | select.EPOLLRDHUP)
                self.open[fd] = s
        for fd, s in waiting.items():
            self.ep.unregister(fd)
            s.close()
            self.failed += 1

    def _event(self, fd: int, ev: int) -> None:
        s = self.open.get(fd)
        if s is None:
            return
        try:
            data = s.recv(65536)  # the server's greeting and READY: read and dropped
        except OSError:
            data = b""
        if data:
            self.greeted.add(fd)
        if not data or ev & (select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP):
            self.greeted.discard(fd)
            self.ep.unregister(fd)
            del self.open[fd]
            s.close()
            self.closed += 1

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            for fd, ev in self.ep.poll(min(left, 0.5)):
                self._event(fd, ev)

    def trickle(self, byte: bytes) -> None:
        for s in list(self.open.values()):
            try:
                s.send(byte)
            except OSError:
                pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--source", default="127.0.0.2")
    ap.add_argument("--every", type=float, default=10.0)
    ap.add_argument("--max-s", type=float, default=300.0)
    a = ap.parse_args()
    hard = _raise_nofile()
    count = min(a.count, hard - 100)
    att = Attacker(a.endpoint, a.source)
    t0 = time.monotonic()
    while len(att.open) + att.closed + att.failed < count and time.monotonic() - t0 < a.max_s:
        att.connect_batch(min(BATCH, count - len(att.open) - att.closed - att.failed))
        att.pump(0)
    settle = time.monotonic() + 120  # until the server has answered every connection still open
    while len(att.greeted) < len(att.open) and time.monotonic() < settle:
        att.pump(0.2)
    print(f"held {len(att.open)} closed {att.closed} failed {att.failed} answered {len(att.greeted)} "
          f"in {time.monotonic() - t0:.1f} s", flush=True)
    # a frame header that never ends: LONG flags, then its 8 size bytes one by one, then the body
    stream = bytes([0x02]) + (1 << 40).to_bytes(8, "big") + bytes(1 << 16)
    i, last, next_byte = 0, -1, time.monotonic() + a.every
    while time.monotonic() - t0 < a.max_s:
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.buffer.read1(1):
            break
        att.pump(0.5)
        if time.monotonic() >= next_byte:
            att.trickle(stream[i:i + 1])
            i, next_byte = i + 1, next_byte + a.every
        if att.closed != last:
            last = att.closed
            print(f"closed {att.closed} open {len(att.open)}", flush=True)


if __name__ == "__main__":
    main()
