"""Busy polling before a blocking wait, with a window that adapts as KVM's halt polling does.

A process that sleeps between the messages of a fast lockstep peer pays, per message, the
wake-up of an idle CPU (on a VM, a halted vCPU) and caches the other processes used meanwhile
(benchmarks/PROFILE.md, "Busy polling"). :class:`SpinWindow` polls without blocking for up to
a window first. The window adapts to how soon the waits end: a wait that ended within the bound
(counted from the start of a poll that missed) doubles it, so the next such wait ends in the
poll; one that lasted longer halves it, down to none. Messages that come within the bound are
then taken without sleeping; messages that come later cost no polling once the window is gone.

The price is CPU time, and a CPU the other processes on the host do not get meanwhile: who may
poll is decided by :func:`spare_cpu` (the daemon's loop, ps/net/loopwait.py, for itself; the
daemon again for each worker, which it tells in its jobs' ``spin_us``, PROTOCOL.md §6.4).

No clock and no socket here: the caller gives both (``clock``; ``poll`` and ``wait`` callables).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

SPIN_MIN_S = 10e-6  # the smallest busy-poll window; below it, none
AUTO_BOUND_US = 400  # ``--busy-poll-us auto``'s bound, where the host has a CPU to spare for it
MAX_BOUND_US = 100_000  # the largest bound a command line or a job may name


class SpinWindow:
    """The busy poll's bound (``bound``, seconds; 0: never poll) and its window now (``window``).

    ``spin(poll, timeout_s)`` calls ``poll()`` (which must not block) until it returns something
    true or the window (never past ``timeout_s``) has passed; ``block(wait)`` runs the blocking
    wait that follows and adapts the window to how long it took."""

    __slots__ = ("bound", "window", "clock", "spins", "hits", "spun_from")

    def __init__(self, bound_s: float, clock: Callable[[], float]) -> None:
        self.bound = bound_s
        self.window = 0.0  # grows from none once waits are seen to end within the bound
        self.clock = clock
        self.spins = self.hits = 0  # busy polls, and those that ended with something ready
        self.spun_from = -1.0  # when the busy poll that just missed began (-1: none)

    def spin(self, poll: Callable[[], Any], timeout_s: float) -> Any:
        """Poll for up to the window: what ``poll`` returned when true, else a false value."""
        if not self.window:
            return None
        self.spins += 1
        clock = self.clock
        t0 = clock()
        end = t0 + min(self.window, timeout_s)
        self.spun_from = t0
        while True:
            got = poll()
            if got:
                self.hits += 1
                self.spun_from = -1.0
                return got
            if clock() >= end:  # missed: the blocking wait that follows decides the window
                return got

    def block(self, wait: Callable[[], Any]) -> Any:
        """``wait()``, the blocking wait; with a bound, the window adapts to it: a wait that ended
        within the bound (from the start of a busy poll that just missed) with something doubles
        the window, a longer one halves it."""
        if not self.bound:
            return wait()
        t0 = self.clock()
        start = self.spun_from if 0.0 <= self.spun_from <= t0 else t0
        got = wait()
        waited = self.clock() - start
        if got and waited <= self.bound:
            self.window = min(max(2 * self.window, SPIN_MIN_S), self.bound)
        elif waited > self.bound:
            self.window = self.window / 2 if self.window >= 2 * SPIN_MIN_S else 0.0
        self.spun_from = -1.0
        return got

    def set_bound(self, bound_s: float) -> None:
        """A new bound (0: no polling from now on, and no window)."""
        if bound_s == self.bound:
            return
        self.bound = bound_s
        if not bound_s:
            self.window, self.spun_from = 0.0, -1.0
        else:
            self.window = min(self.window, bound_s)


def spare_cpu(cpus: int, processes: int) -> bool:
    """Whether a host with ``cpus`` usable CPUs has one for each of ``processes`` processes of
    the run on it (the daemon, its local shards, the workers there). 0 CPUs: not known, no."""
    return 0 < processes <= cpus


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
