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
polls without blocking for up to a window (protocol/spin.py SpinWindow, which the worker's wait
uses too), adapted as KVM's halt polling adapts its own: a wait
that ended within the bound (counted from the start of a poll that missed) doubles the window,
one that lasted longer halves it, down to none. Messages that come within the bound are then
taken without sleeping; messages that come later cost no polling once the window is gone. The
price is that CPU time, and a CPU the workers on the same host do not get meanwhile. So by
default (:class:`BusyPoll` ``auto``) the bound is 400 µs while the host has a CPU for the server
and for each process of the run on it (its workers, its local shards), and 0 otherwise: one
worker beside the server on two cores gains 1.3x at d = 10^3, two lose 10 % (benchmarks/PROFILE.md).
The same rule, per worker host, is the advice the daemon's jobs give each worker (``Job.spin_us``,
PROTOCOL.md §6.4; ``ps/drivers/daemon.py`` ``_adapt_busy_poll``).
"""

from __future__ import annotations

import select
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from protocol.spin import AUTO_BOUND_US, MAX_BOUND_US, SPIN_MIN_S, SpinWindow, spare_cpu, usable_cpus

_EVENTS, _POLLIN, _FD = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.FD)
# A job's arrays up to this size cost libzmq's I/O thread little to move; a worker that receives
# larger ones through libzmq (the plaintext path) keeps that thread busy while it would poll: at
# d = 10^5 (400 KB) on two CPUs its polling cost 0.69x (benchmarks/PROFILE.md, the worker's wait).
SMALL_JOB_BYTES = 64 << 10
__all__ = ["AUTO_BOUND_US", "SMALL_JOB_BYTES", "SPIN_MIN_S", "BusyPoll", "LoopWait", "usable_cpus"]


@dataclass(frozen=True, slots=True)
class BusyPoll:
    """``serve --busy-poll-us``: a bound in microseconds (0: never poll), or ``auto``: the bound
    :data:`AUTO_BOUND_US` where the host has a CPU for each process of the run on it, else none
    (:meth:`bound_s`). The daemon applies it to itself and advises each worker with it (its
    jobs' ``spin_us``, PROTOCOL.md §6.4)."""

    bound_us: int = 0
    auto: bool = False

    @classmethod
    def parse(cls, text: str) -> "BusyPoll":
        """``auto`` or a whole number of microseconds, 0 to 100,000; ValueError otherwise."""
        if text.strip().lower() == "auto":
            return cls(AUTO_BOUND_US, True)
        us = int(text)  # ValueError: not a number
        if not 0 <= us <= MAX_BOUND_US:
            raise ValueError(f"{us} is not in 0..{MAX_BOUND_US}")
        return cls(us, False)

    def bound_s(self, cpus: int, local_processes: int) -> float:
        """The daemon's bound now, in seconds: ``auto`` polls while ``1 + local_processes <= cpus``
        (the server, and the run's workers and shards on its host, one CPU each)."""
        return self.bound_us_for(cpus, 1 + local_processes) / 1e6

    def bound_us_for(self, cpus: int, processes: int) -> int:
        """The bound in microseconds for a process on a host with ``cpus`` usable CPUs (0: not
        known) and ``processes`` processes of the run on it: ``auto`` polls only where each has
        a CPU (protocol/spin.py spare_cpu)."""
        if self.auto and not spare_cpu(cpus, processes):
            return 0
        return self.bound_us

    def advice_us(self, cpus: int, processes: int, io_thread: bool) -> int:
        """The bound a worker's jobs advise (Job.spin_us), for a worker whose hello said ``cpus``
        on a host where the run has ``processes`` processes. ``io_thread``: its jobs reach it
        through libzmq with arrays larger than :data:`SMALL_JOB_BYTES`, which libzmq's I/O thread
        moves while the worker would poll: ``auto`` counts that thread as one more process."""
        return self.bound_us_for(cpus, processes + io_thread)

    def __str__(self) -> str:
        return "auto" if self.auto else str(self.bound_us)


class LoopWait:
    """Wait for any of the ZeroMQ sockets and descriptors added, up to a timeout."""

    def __init__(self, spin_max_s: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.window = SpinWindow(spin_max_s, clock)  # the busy poll before a blocking wait (protocol/spin.py)
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
        w = self.window
        timeout_s = timeout_ms / 1000.0
        events = w.spin(self._poll0, timeout_s) if w.bound and timeout_ms else None
        if not events:  # without a bound, block() would only call the wait
            events = w.block(lambda: self.ep.poll(timeout_s)) if w.bound else self.ep.poll(timeout_s)
        for fd, _ in events:
            sock = self.by_fd.get(fd)
            if sock is not None:
                self.quiet.discard(sock)
        return bool(events)

    def _poll0(self) -> list:
        return self.ep.poll(0)

    # the busy poll's figures, as the daemon's status reports them
    @property
    def spin_max(self) -> float:
        """The longest busy poll before a blocking wait, in seconds (0: never)."""
        return self.window.bound

    @property
    def spin(self) -> float:
        """The busy poll's window now, adapted to how soon the waits end."""
        return self.window.window

    @property
    def spins(self) -> int:
        return self.window.spins

    @property
    def spin_hits(self) -> int:
        return self.window.hits

    def take_quiet(self, sock: Any) -> bool:
        """True (once) if ``sock`` held nothing before the last wait and its descriptor did not
        fire since: its receive may skip asking EVENTS. Any later call is told False."""
        if sock in self.quiet:
            self.quiet.discard(sock)
            return True
        return False

    def set_bound(self, spin_max_s: float) -> None:
        """A new bound for the busy poll (0: none from now on, and the window with it)."""
        self.window.set_bound(spin_max_s)

    def close(self) -> None:
        self.ep.close()
        self.quiet.clear()
