"""The daemon loop's wait: one ``epoll`` over the ZeroMQ sockets' signal descriptors and the
plain descriptors (the handed connections' epoll), in place of ``zmq.Poller``.

``zmq_poll`` over a ZeroMQ socket costs, per call, a poll of every descriptor without waiting, a
libzmq EVENTS check of each socket (a poll of its mailbox and a ``getpid``), the waiting poll and
the EVENTS check again: six system calls with one socket, and the receive that follows asked
EVENTS once more (two more). In lockstep that was eight of the daemon's eleven system calls per
update (benchmarks/PROFILE.md). Here a pass costs one EVENTS check per ZeroMQ socket and one
``epoll_wait``, and a socket whose descriptor did not fire is known to hold nothing, so its
receive skips its own check (:meth:`LoopWait.take_quiet`).

The contract of a ZeroMQ socket's descriptor (``ZMQ_FD``, zmq_getsockopt(3)) is that of a
signal, not of the socket's state: it is readable while libzmq has commands for the socket it
has not processed, and any call on the socket may process them. So before each wait every
socket's EVENTS is asked (which processes them): a socket that holds a message ends the wait at
once; one that does not is quiet until its descriptor fires, since nothing else calls it while
the loop waits.
"""

from __future__ import annotations

import select
from typing import Any

import zmq

_EVENTS, _POLLIN, _FD = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.FD)


class LoopWait:
    """Wait for any of the ZeroMQ sockets and descriptors added, up to a timeout."""

    def __init__(self) -> None:
        self.ep = select.epoll()
        self.socks: list[tuple[Any, int]] = []  # (ZeroMQ socket, its signal descriptor)
        self.quiet: set[Any] = set()  # the sockets known to hold nothing now
        self.by_fd: dict[int, Any] = {}  # signal descriptor -> its socket

    def add(self, obj: Any) -> None:
        """A ZeroMQ socket, or anything with ``fileno()`` (readable: ready)."""
        if isinstance(obj, zmq.Socket):
            fd = obj.get(_FD)
            self.socks.append((obj, fd))
            self.by_fd[fd] = obj
        else:
            fd = obj.fileno()
        self.ep.register(fd, select.EPOLLIN)

    def wait(self, timeout_ms: int) -> bool:
        """Whether something may be ready: a socket holds a message now (then no wait), or a
        descriptor fired within ``timeout_ms``."""
        self.quiet.clear()
        for sock, _fd in self.socks:
            if sock.get(_EVENTS) & _POLLIN:
                self.quiet.clear()  # those asked before it stay quiet, but once is enough to be right
                return True
            self.quiet.add(sock)
        events = self.ep.poll(timeout_ms / 1000.0)
        for fd, _ in events:
            sock = self.by_fd.get(fd)
            if sock is not None:
                self.quiet.discard(sock)
        return bool(events)

    def take_quiet(self, sock: Any) -> bool:
        """True (once) if ``sock`` held nothing before the last wait and its descriptor did not
        fire since: its receive may skip asking EVENTS. Any later call is told False."""
        if sock in self.quiet:
            self.quiet.discard(sock)
            return True
        return False

    def close(self) -> None:
        self.ep.close()
        self.quiet.clear()
