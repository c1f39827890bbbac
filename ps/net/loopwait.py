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

**Busy polling** (``serve --busy-poll-us``, ``auto`` by default). A daemon that sleeps between the
messages of a fast lockstep worker pays, per message, the wake-up of an idle CPU (on a VM, a
halted vCPU) and caches the other processes have used meanwhile: in place its Python ran at a
third of its hot-loop speed (benchmarks/PROFILE.md). With a bound ``spin_max`` the wait first
polls without blocking for up to a window, adapted as KVM's halt polling adapts its own: a wait
that ended within the bound (counted from the start of a poll that missed) doubles the window,
one that lasted longer halves it, down to none. Messages that come within the bound are then
taken without sleeping; messages that come later cost no polling once the window is gone. The
price is that CPU time, and a CPU the workers on the same host do not get meanwhile. So by
default (:class:`BusyPoll` ``auto``) the bound is 400 µs while the host has a CPU for the server
and for each process of the run on it (its workers, its local shards), and 0 otherwise: one
worker beside the server on two cores gains 1.3x at d = 10^3, two lose 10 % (benchmarks/PROFILE.md).
"""

from __future__ import annotations

import math
import os
import select
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

_EVENTS, _POLLIN, _FD = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.FD)
SPIN_MIN_S = 10e-6  # the smallest busy-poll window; below it, none
AUTO_BOUND_US = 400  # ``--busy-poll-us auto``'s bound, while the host has a CPU to spare for it


@dataclass(frozen=True, slots=True)
class BusyPoll:
    """``serve --busy-poll-us``: a bound in microseconds (0: never poll), or ``auto``: the bound
    :data:`AUTO_BOUND_US` while the host has a CPU for the server and each process of the run on
    it, else none (:meth:`bound_s`)."""

    bound_us: int = 0
    auto: bool = False

    @classmethod
    def parse(cls, text: str) -> "BusyPoll":
        """``auto`` or a whole number of microseconds, 0 to 100,000; ValueError otherwise."""
        if text.strip().lower() == "auto":
            return cls(AUTO_BOUND_US, True)
        us = int(text)  # ValueError: not a number
        if not 0 <= us <= 100_000:
            raise ValueError(f"{us} is not in 0..100000")
        return cls(us, False)

    def bound_s(self, cpus: int, local_processes: int) -> float:
        """The bound now, in seconds: ``auto`` polls while ``1 + local_processes <= cpus`` (the
        server, and the run's workers and shards on its host, one CPU each)."""
        if self.auto and 1 + local_processes > cpus:
            return 0.0
        return self.bound_us / 1e6

    def __str__(self) -> str:
        return "auto" if self.auto else str(self.bound_us)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, and its cgroup's CPU quota where one is set
    (a container's ``--cpus``: cgroup v2 ``cpu.max``)."""
    n = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


class LoopWait:
    """Wait for any of the ZeroMQ sockets and descriptors added, up to a timeout."""

    def __init__(self, spin_max_s: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.spin_max = spin_max_s  # the longest busy poll before a blocking wait (0: never; see :meth:`wait`)
        self.spin = 0.0  # the busy poll's window now, adapted to how soon the waits end
        self.clock = clock
        self.spins = self.spin_hits = 0  # busy polls, and those that ended with something ready
        self.spun_from = -1.0  # when the busy poll that just missed began (-1: none)
        self.ep = select.epoll()
        self.socks: list[Any] = []  # the ZeroMQ sockets
        self.quiet: set[Any] = set()  # the sockets known to hold nothing now
        self.by_fd: dict[int, Any] = {}  # signal descriptor -> its socket

    def add(self, obj: Any) -> None:
        """A ZeroMQ socket, or anything with ``fileno()`` (readable: ready)."""
        if isinstance(obj, zmq.Socket):
            fd = obj.get(_FD)
            self.socks.append(obj)
            self.by_fd[fd] = obj
        else:
            fd = obj.fileno()
        self.ep.register(fd, select.EPOLLIN)

    def wait(self, timeout_ms: int) -> bool:
        """Whether something may be ready: a socket holds a message now (then no wait), or a
        descriptor fired within ``timeout_ms``."""
        self.quiet.clear()
        for sock in self.socks:
            if sock.get(_EVENTS) & _POLLIN:
                self.quiet.clear()  # no wait: every receive asks for itself
                return True
            self.quiet.add(sock)
        events = self._spin(timeout_ms) if self.spin_max and timeout_ms else None
        if not events:
            events = self._block(timeout_ms)
        for fd, _ in events:
            sock = self.by_fd.get(fd)
            if sock is not None:
                self.quiet.discard(sock)
        return bool(events)

    def _spin(self, timeout_ms: int) -> list:
        """Poll without blocking for up to the window (never past ``timeout_ms``): what is ready, or []."""
        if not self.spin:
            return []
        self.spins += 1
        clock, poll = self.clock, self.ep.poll
        t0 = clock()
        end = t0 + min(self.spin, timeout_ms / 1000.0)
        self.spun_from = t0
        while True:
            events = poll(0)
            if events:
                self.spin_hits += 1
                self.spun_from = -1.0
                return events
            if clock() >= end:  # missed: the blocking wait that follows decides the window (_block)
                return []

    def _block(self, timeout_ms: int) -> list:
        """The blocking wait; with busy polling on, the window adapts to it as KVM's halt polling
        does: a wait that ended within ``spin_max`` (counted from the start of a busy poll that
        just missed) doubles the window, so that the next one ends in the poll; a longer one halves it."""
        if not self.spin_max:
            return self.ep.poll(timeout_ms / 1000.0)
        t0 = self.clock()
        start = self.spun_from if 0.0 <= self.spun_from <= t0 else t0
        events = self.ep.poll(timeout_ms / 1000.0)
        waited = self.clock() - start
        if events and waited <= self.spin_max:
            self.spin = min(max(2 * self.spin, SPIN_MIN_S), self.spin_max)
        elif waited > self.spin_max:
            self.spin = self.spin / 2 if self.spin >= 2 * SPIN_MIN_S else 0.0
        self.spun_from = -1.0
        return events

    def take_quiet(self, sock: Any) -> bool:
        """True (once) if ``sock`` held nothing before the last wait and its descriptor did not
        fire since: its receive may skip asking EVENTS. Any later call is told False."""
        if sock in self.quiet:
            self.quiet.discard(sock)
            return True
        return False

    def set_bound(self, spin_max_s: float) -> None:
        """A new bound for the busy poll (0: none from now on, and the window with it)."""
        self.spin_max = spin_max_s
        if not spin_max_s:
            self.spin, self.spun_from = 0.0, -1.0
        else:
            self.spin = min(self.spin, spin_max_s)

    def close(self) -> None:
        self.ep.close()
        self.quiet.clear()
