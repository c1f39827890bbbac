"""The live server's claim on its state directory (:class:`StateLock`, an ``flock`` on
``server.pid``), and finding that server again, verified, for ``latecomer stop``
(:func:`locked_server`, :func:`wait_unlocked`)."""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any

from ps.journal.statedir import StateError

PID_FILE = "server.pid"


def _pid_file_text(text: str) -> tuple[int, float] | None:
    """(pid, start time) from a ``server.pid`` line ``PID START_TIME``; None if it is not one."""
    parts = text.split()
    try:
        pid, started = int(parts[0]), float(parts[1]) if len(parts) > 1 else float("nan")
    except (IndexError, ValueError):
        return None
    return (pid, started) if pid >= 2 and len(parts) <= 2 else None


class StateLock:
    """The live server's claim on its state directory: an exclusive ``flock`` on
    ``DIR/server.pid``, held for the process's lifetime, the file holding ``PID START_TIME``
    (the process's start time as psutil gives it). A second server on the directory is refused;
    ``latecomer stop`` signals only the process the lock and the start time both name
    (:func:`locked_server`). The kernel drops the lock when the process dies, so a
    ``server.pid`` left by a crash names nobody.

    Raises:
        StateError: another live process holds the lock.
    """

    def __init__(self, state_dir: str) -> None:
        import psutil

        self.path = os.path.join(state_dir, PID_FILE)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = _pid_file_text(os.pread(fd, 100, 0).decode(errors="replace"))
                os.close(fd)
                who = f" (pid {held[0]})" if held else ""
                raise StateError(f"{state_dir} is in use by another server{who}: stop it first (latecomer stop "
                                 f"--state {state_dir}) or give another --state") from None
            try:  # the file we locked must still be the one at the path (not unlinked by an exiting server)
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {psutil.Process().create_time()!r}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Remove ``server.pid`` and drop the lock (a clean exit)."""
        if self.fd < 0:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def _lock_holders(fd: int) -> set[int] | None:
    """The pids /proc/locks lists for the file open at ``fd`` (None: not listed, or no /proc)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        parts = line.split()
        if "FLOCK" in parts and key in parts:
            try:
                pids.add(int(parts[parts.index(key) - 1]))
            except (ValueError, IndexError):
                pass
    return pids or None


def locked_server(state_dir: str) -> tuple[Any, int]:
    """The live server of ``state_dir``, verified: a process holds the lock on its
    ``server.pid``, the file names that process's pid and start time, and (where /proc/locks
    lists the lock) the kernel agrees who holds it. Returns (psutil.Process, an fd open on the
    locked file: :func:`wait_unlocked` watches it; close it after).

    Raises:
        StateError: no such server (no ``server.pid``, or one nobody holds: left by a crash), or
            the file does not name the process that holds it (e.g. ``-1``, garbage, a reused pid).
            Nothing has been signalled.
    """
    import psutil

    path = os.path.join(state_dir, PID_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StateError(f"no server.pid in {state_dir}: is a server running with --state there?") from None
    except OSError as e:
        raise StateError(f"cannot open {path}: {e.strerror}") from None
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            raise StateError(f"no server is running with --state {state_dir} ({PID_FILE} {text.strip()!r:.40} is "
                             f"left from one that did not exit cleanly; nothing was signalled)")
        held = _pid_file_text(text)
        if held is None:
            raise StateError(f"{path} does not name a process ({text.strip()!r:.40}): nothing was signalled")
        pid, started = held
        holders = _lock_holders(fd)
        if holders is not None and pid not in holders:
            raise StateError(f"{path} names pid {pid}, but the lock is held by {', '.join(map(str, sorted(holders)))}: "
                             f"nothing was signalled")
        try:
            proc = psutil.Process(pid)
            ours = abs(proc.create_time() - started) < 0.05
        except psutil.NoSuchProcess:
            raise StateError(f"{path} names pid {pid}, which is not running: nothing was signalled") from None
        except psutil.AccessDenied:
            raise StateError(f"not permitted to inspect pid {pid} (named by {path})") from None
        if not ours:
            raise StateError(f"pid {pid} is not the server that holds {path} (another start time): nothing was "
                             f"signalled")
        return proc, fd
    except BaseException:
        os.close(fd)
        raise


def wait_unlocked(fd: int, proc: Any, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until the server holding the lock on ``fd``'s file lets go
    of it (it exited, or closed its state) or ``proc`` is gone. True if it did."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)  # polling interval of a bounded wait
