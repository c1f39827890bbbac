"""Where a small message's time goes between a worker and the server: five server paths, one window.

The raw-pyzmq workload (benchmarks/raw_zmq.py: a msgpack header and one float32 frame each way,
lockstep, the same libzmq DEALER workers in every row) against five servers:

* ``raw``: raw pyzmq's ROUTER on TCP (the bench's baseline);
* ``zmtp``: a single-threaded server that speaks ZMTP 3.1 (NULL mechanism, rfc.zeromq.org/spec/23)
  on the accepted TCP sockets itself, with no libzmq: epoll, protocol/zmtp.py's sans-I/O codec
  (``recv_into`` its buffer; a large frame straight into a buffer of its own), ``sendmsg`` of the
  frame headers and the array's own memory;
* ``front+raw``: the front (ps/net/front.py) relaying to raw pyzmq's ROUTER on a Unix socket, which
  is latecomer's path today (front, then a libzmq ROUTER in the daemon);
* ``front+zmtp``: the front relaying to the ZMTP server on a Unix socket;
* ``handover``: a front process that only accepts, runs the NULL handshake and passes the
  connection's descriptor to the ZMTP server in another process (``SCM_RIGHTS``): the design
  benchmarks/PROFILE.md arrives at, without the front's bounds (the ZMTP server's codec has them).

The server's work is the raw row's in all five (x <- x - lr*g, a new array, sent back), so the
rows differ only in the path: which processes and threads a message wakes and what copies it.
``python -m benchmarks.transport_paths`` writes benchmarks/RESULTS-transport.md; the findings are
in benchmarks/PROFILE.md ("Small messages over TCP"). The ZMTP server here is a measuring
instrument, not the daemon's transport: it takes DEALER peers only and bounds what one peer
sends (the codec's limits), not how many connect or how fast.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import socket
import sys
import tempfile
import time

VARIANTS = ("raw", "zmtp", "front+raw", "front+zmtp", "handover")


class _Conn:
    __slots__ = ("s", "z", "out", "writing")

    def __init__(self, s: socket.socket, z) -> None:
        self.s, self.z = s, z  # the socket, its protocol.zmtp.Connection
        self.out: collections.deque = collections.deque()  # buffers still to send
        self.writing = False  # registered for EPOLLOUT (what it sends waits for room)


def serve_zmtp(listener: socket.socket, d: int, stop=None, handover: bool = False) -> None:
    """The ZMTP server's loop on ``listener`` (TCP or Unix): the raw row's update per message.
    ``stop``: a threading.Event that ends it (looked at every 0.1 s; None: it runs until killed).
    ``handover``: ``listener`` is instead a Unix datagram socket on which :func:`hand_over` passes
    connections whose handshake is done (their descriptor, and the bytes read from them so far)."""
    import msgpack
    import numpy as np

    from benchmarks.common import LR
    from protocol.zmtp import Connection, ZmtpError, ZmtpLimits, frames_out, greeting, pong, ready

    limits = ZmtpLimits(max_frame_bytes=8 * d + 4096, max_message_bytes=8 * d + 8192)
    hello = greeting(as_server=True) + ready(b"ROUTER")
    ep = select.epoll()
    ep.register(listener.fileno(), select.EPOLLIN)
    conns: dict[int, _Conn] = {}
    x, version = np.zeros(d, np.float32), 0

    def flush(c: _Conn) -> None:
        while c.out:
            try:
                sent = c.s.sendmsg(list(c.out)[:64])
            except BlockingIOError:
                break
            while sent and sent >= len(c.out[0]):
                sent -= len(c.out.popleft())
            if sent:
                c.out[0] = c.out[0][sent:]
        if c.writing != bool(c.out):
            c.writing = bool(c.out)
            ep.modify(c.s.fileno(), select.EPOLLIN | (select.EPOLLOUT if c.writing else 0))

    while stop is None or not stop.is_set():
        for fd, ev in ep.poll(-1 if stop is None else 0.1):
            if fd == listener.fileno():
                if handover:  # the front's greeting and READY went out; the client's came in ``seen``
                    seen, fds, _, _ = socket.recv_fds(listener, 1 << 17, 1)
                    if not fds:
                        continue
                    s = socket.socket(fileno=fds[0])
                else:
                    s, _ = listener.accept()
                    seen = b""
                s.setblocking(False)
                if s.family != socket.AF_UNIX:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c = conns[s.fileno()] = _Conn(s, Connection(limits, alloc=lambda n: np.empty(n, np.uint8)))
                ep.register(s.fileno(), select.EPOLLIN)
                if not seen:
                    c.out.append(memoryview(hello))
                    flush(c)
                    continue
                c.z.buffer()[:len(seen)] = seen  # (at most 4 KiB: the front reads no more at once)
                try:
                    msgs = c.z.advance(len(seen))
                except ZmtpError:
                    msgs = None
            else:
                c = conns[fd]
                if ev & select.EPOLLOUT:
                    flush(c)
                if not ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                    continue
                try:
                    n = c.s.recv_into(c.z.buffer())
                    msgs = c.z.advance(n) if n else None
                except BlockingIOError:
                    continue
                except (OSError, ZmtpError):
                    msgs = None
            if msgs is None:
                fd = c.s.fileno()
                ep.unregister(fd)
                c.s.close()
                del conns[fd]
                continue
            for p in c.z.pings:
                c.out.append(memoryview(pong(p)))
            c.z.pings.clear()
            for head, g in msgs:
                msgpack.unpackb(head)
                x = x - np.float32(LR) * np.frombuffer(g, dtype="<f4")
                version += 1
                c.out.extend(memoryview(b) for b in frames_out(
                    [msgpack.packb({"v": version, "dtype": "<f4", "shape": [d]}), x]))
            if c.out:
                flush(c)
    for c in conns.values():
        c.s.close()
    ep.close()


def zmtp_server(d: int, q_srv) -> None:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    q_srv.put(("up", os.getpid(), "tcp://127.0.0.1:%d" % ls.getsockname()[1]))
    serve_zmtp(ls, d)


def _raw_backend(path: str, d: int) -> None:
    import msgpack
    import numpy as np
    import zmq

    from benchmarks.common import LR

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    s.sndhwm = s.rcvhwm = 0
    s.bind("ipc://" + path)
    x, version = np.zeros(d, np.float32), 0
    while True:
        ident, head, frame = s.recv_multipart(copy=False)
        msgpack.unpackb(head.bytes)
        x = x - np.float32(LR) * np.frombuffer(frame.buffer, dtype="<f4")
        version += 1
        s.send_multipart([ident, msgpack.packb({"v": version, "dtype": "<f4", "shape": [d]}), x], copy=False)


def front_server(backend: str, d: int, q_srv) -> None:
    """The front in this process, the backend server in a forked child that dies with it."""
    from ps.net.front import Front, Limits, endpoint_of, listen

    path = os.path.join(tempfile.mkdtemp(prefix="latecomer-paths-"), "s")
    pid = os.fork()
    if pid == 0:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: reaped with the front
        if backend == "raw":
            _raw_backend(path, d)
        else:
            ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ls.bind(path)
            ls.listen(64)
            serve_zmtp(ls, d)
        os._exit(0)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    pub = listen("tcp://127.0.0.1:0")
    limits = Limits(mechanism=b"NULL", max_frame_bytes=d * 8 + 8192, max_message_bytes=d * 16 + 65536,
                    max_frames=16, max_pending_bytes=1 << 30)
    front = Front(pub, limits)
    front.set_backend(path)
    q_srv.put(("up", os.getpid(), endpoint_of(pub, "tcp://127.0.0.1:0")))
    while True:
        front.run_once(1.0)


def hand_over(d: int, q_srv) -> None:
    """A front that hands connections over: it accepts, sends the server's greeting and READY,
    reads the client's (protocol/zmtp.py), then passes the descriptor and the bytes it read to
    the ZMTP server in a forked child (``SCM_RIGHTS`` on a Unix datagram socket) and closes its
    own copy. Nothing of a message passes through it: the prototype of the hand-over
    (benchmarks/PROFILE.md), without the front's other duties."""
    from protocol.zmtp import Connection, ZmtpError, ZmtpLimits, greeting, ready

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    pid = os.fork()
    if pid == 0:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: reaped with the front
        mine.close()
        serve_zmtp(theirs, d, handover=True)
        os._exit(0)
    theirs.close()
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    q_srv.put(("up", os.getpid(), "tcp://127.0.0.1:%d" % ls.getsockname()[1]))
    hello = greeting(as_server=True) + ready(b"ROUTER")
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    waiting: dict[int, tuple[socket.socket, Connection, bytearray]] = {}
    while True:
        for fd, _ in ep.poll():
            if fd == ls.fileno():
                c, _ = ls.accept()
                c.sendall(hello)
                c.setblocking(False)
                waiting[c.fileno()] = (c, Connection(ZmtpLimits(8 * d + 4096, 8 * d + 8192)), bytearray())
                ep.register(c.fileno(), select.EPOLLIN)
                continue
            c, z, seen = waiting[fd]
            try:
                room = z.buffer()
                n = c.recv_into(room, 4096)
                if n:
                    seen += room[:n]
                    z.advance(n)
            except BlockingIOError:
                continue
            except (OSError, ZmtpError):
                n = 0
            if n and z.peer is None:
                continue
            ep.unregister(fd)
            del waiting[fd]
            if n:
                socket.send_fds(mine, [bytes(seen)], [c.fileno()])
            c.close()


def run(variant: str, d: int, workers: int, seconds: float, warmup: float):
    from benchmarks import raw_zmq
    from benchmarks.common import run_mp_cell

    if variant == "raw":
        return raw_zmq.run(d, workers, seconds, warmup)
    if variant == "zmtp":
        server, args = zmtp_server, (d,)
    elif variant == "handover":
        server, args = hand_over, (d,)
    else:
        server, args = front_server, (variant.split("+")[1], d)
    return run_mp_cell(variant, server, args, raw_zmq.worker, (d,), d, workers, seconds, warmup, server_grace=0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,100000")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2, help="each cell this many times, variants alternating")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "RESULTS-transport.md"))
    a = ap.parse_args(argv)
    from benchmarks.common import machine

    rows = []
    for d in map(int, a.sizes.split(",")):
        for w in map(int, a.workers.split(",")):
            got: dict[str, list] = {v: [] for v in VARIANTS}
            for _ in range(a.rounds):
                for v in VARIANTS:
                    r = run(v, d, w, a.seconds, 0.5)
                    got[v].append(r)
                    print(f"{v:11s} d={d:<8d} workers={w} {r.updates_per_s:9.1f} upd/s "
                          f"{r.cpu_s_per_update * 1e3:6.3f} ms CPU/upd {r.skipped}", flush=True)
            rows.append((d, w, got))
    lines = ["# Five server paths for one small-message workload", "",
             f"{time.strftime('%Y-%m-%d')}. Machine: {machine()}", "",
             "`python -m benchmarks.transport_paths` (module docstring: what each path is). Updates/s per round "
             "(variants alternating within a round), and the ratio of each round's figure to raw pyzmq's in the "
             "same round. Server CPU: the server's process tree (the front and its backend together), ms per update.",
             "", "| d | workers | path | updates/s | / raw | server CPU ms/upd |", "|---|---|---|---|---|---|"]
    for d, w, got in rows:
        for v in VARIANTS:
            ups = [r.updates_per_s for r in got[v]]
            ratio = [r.updates_per_s / b.updates_per_s for r, b in zip(got[v], got["raw"], strict=True)]
            cpu = [r.cpu_s_per_update * 1e3 for r in got[v]]
            lines.append(f"| {d:,} | {w} | {v} | {' / '.join(f'{u:,.0f}' for u in ups)} | "
                         f"{' / '.join(f'{x:.2f}' for x in ratio)} | {' / '.join(f'{x:.3f}' for x in cpu)} |")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
