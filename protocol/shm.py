"""Same-host fast path: iterates and gradients through shared memory (PROTOCOL.md §6.11).

A worker on the server's host (same ``host_id``, and it can open the server's probe file)
reads iterates from shared-memory slots that the server writes once per version, and writes
its gradients into slots the server lent it for that job. Only the small msgpack headers
cross the ZeroMQ socket.

Slots are files ``/dev/shm/latecomer-<pid>-<boot>-<n>`` of ``d`` float32, mode 0600, mapped
by both sides. Slot numbers are never reused for another file, so a worker may cache its
mappings. Lifetimes follow the job ledger:

* iterate slots: the server's iterate buffers themselves come from shared memory (the
  :mod:`algorithms._pool` factory), so publishing costs nothing; an iterate that was not
  allocated there (x0, a restored state, small d) is copied once into a slot, released
  when the iterate leaves the core's store. The pool reuses a buffer only when nothing
  references it, and the store references every iterate an outstanding job names, so a
  slot is never rewritten while a job that reads it is live. A job written off while its
  worker still reads may see a newer iterate: its reply is refused anyway.
* gradient slots: lent per job to one worker, returned when the job leaves the ledger
  (applied, dropped, rejected, cancelled, written off) and lent again only to the same
  worker (which computes one job at a time), so a late write of a written-off job can
  only land in that worker's own next slot before it computes the next job. A departed
  worker's slots are unlinked, never lent to anyone else. A worker killed mid-write sends
  no reply, so the server never reads that slot.

The server reads a gradient only after the reply naming its slot arrived, and validates it
like any other (shape by construction, finite values). Files are 0600: only processes of
the server's user, which could ptrace the server anyway, can map them.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import weakref
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np

log = logging.getLogger("latecomer.shm")

SHM_DIR = "/dev/shm"
PREFIX_RE = re.compile(r"^latecomer-[0-9a-f]{1,16}-[0-9a-f]{1,16}$")


def host_id() -> str:
    """An id shared by processes on one host: /etc/machine-id, else the host name."""
    try:
        with open("/etc/machine-id", encoding="ascii") as f:
            mid = f.read().strip()[:64]
            if mid:
                return mid
    except OSError:
        pass
    return os.uname().nodename[:64]  # gethostname(), without the socket module


def shm_dir_usable(directory: str = SHM_DIR) -> bool:
    return os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)


class ShmArena:
    """The server's slots: iterate buffers, published copies and lent gradient buffers."""

    def __init__(self, dim: int, boot: int, directory: str = SHM_DIR) -> None:
        self.dim = dim
        self.nbytes = 4 * dim
        self.dir = directory
        self.prefix = f"latecomer-{os.getpid():x}-{boot & 0xFFFFFFFFFFFFFFFF:x}"
        self.next_slot = 0
        self.by_addr: dict[int, int] = {}  # data address of a pool buffer -> its slot
        self.copies: dict[int, tuple[int, np.ndarray]] = {}  # iterate id -> (slot, array) for copied iterates
        self.free_copy_slots: list[tuple[int, np.ndarray]] = []
        self.lent: dict[int, tuple[str, tuple[int, ...]]] = {}  # job id -> (worker, gradient slots)
        self.free_grad: dict[str, list[int]] = {}
        self.grad_arrays: dict[int, np.ndarray] = {}
        self.closed = False
        self.copies_made = 0
        with open(self._path("probe"), "wb", opener=self._opener) as f:
            f.write(boot.to_bytes(8, "little") + _pid_namespace().to_bytes(8, "little"))

    # ---------------------------------------------------------------- files
    def _path(self, slot: int | str) -> str:
        return os.path.join(self.dir, f"{self.prefix}-{slot}")

    @staticmethod
    def _opener(path: str, flags: int) -> int:
        return os.open(path, flags | os.O_EXCL, 0o600)

    def _new_slot(self) -> tuple[int, np.ndarray]:
        slot = self.next_slot
        self.next_slot += 1
        fd = os.open(self._path(slot), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(self.nbytes, 1))
            m = mmap.mmap(fd, max(self.nbytes, 1))
        finally:
            os.close(fd)
        return slot, np.frombuffer(m, np.float32, count=self.dim)

    def _unlink(self, slot: int) -> None:
        try:
            os.unlink(self._path(slot))
        except FileNotFoundError:
            pass
        # the mapping goes with the last array over it

    # ---------------------------------------------------------------- iterates
    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Pool factory: iterate-sized float32 buffers live in shared memory."""
        if self.closed or tuple(shape) != (self.dim,) or np.dtype(dtype) != np.float32:
            return np.empty(shape, dtype)
        slot, a = self._new_slot()
        addr = a.ctypes.data
        self.by_addr[addr] = slot
        weakref.finalize(a, self._pool_buffer_gone, addr, slot)
        return a

    def _pool_buffer_gone(self, addr: int, slot: int) -> None:
        if self.by_addr.get(addr) == slot:
            del self.by_addr[addr]
        self._unlink(slot)

    def iterate_slot(self, iid: int, x: np.ndarray) -> int:
        """The slot holding iterate ``iid`` (whose array is ``x``), copying it there once."""
        if x.shape == (self.dim,) and x.dtype == np.float32 and x.base is not None:
            slot = self.by_addr.get(x.ctypes.data)
            if slot is not None:
                return slot
        held = self.copies.get(iid)
        if held is not None:
            return held[0]
        slot, a = self.free_copy_slots.pop() if self.free_copy_slots else self._new_slot()
        np.copyto(a, x.reshape(-1), casting="same_kind")
        self.copies[iid] = (slot, a)
        self.copies_made += 1
        return slot

    # ---------------------------------------------------------------- gradients
    def lend(self, worker_id: str, job_id: int, n: int) -> tuple[int, ...]:
        free = self.free_grad.setdefault(worker_id, [])
        slots = []
        for _ in range(n):
            if free:
                slots.append(free.pop())
            else:
                slot, a = self._new_slot()
                self.grad_arrays[slot] = a
                slots.append(slot)
        self.lent[job_id] = (worker_id, tuple(slots))
        return tuple(slots)

    def gradients(self, worker_id: str, job_id: int) -> tuple[np.ndarray, ...] | None:
        """Read-only views of the gradients of a job lent to ``worker_id`` (None: not lent)."""
        held = self.lent.get(job_id)
        if held is None or held[0] != worker_id:
            return None
        out = []
        for s in held[1]:
            v = self.grad_arrays[s].view()
            v.setflags(write=False)
            out.append(v)
        return tuple(out)

    # ---------------------------------------------------------------- lifetimes
    def sweep(self, store: Any, ledger: Any, workers: Any, gone: Iterable[int] | None = None) -> None:
        """Release what the core no longer needs: copies of iterates gone from the store,
        gradient slots of jobs gone from the ledger (back to their worker, or unlinked if
        the worker left). ``gone``: the iterate ids that left the store since the last sweep
        (ps.core.iterates.EvictionCursor), so that only their copies are looked at; None: all of them."""
        for iid in [i for i in (self.copies if gone is None else gone) if i in self.copies and i not in store]:
            self.free_copy_slots.append(self.copies.pop(iid))
        for jid in [j for j in self.lent if j not in ledger]:
            wid, slots = self.lent.pop(jid)
            if wid in workers:
                self.free_grad.setdefault(wid, []).extend(slots)
            else:
                self._drop_grad(slots)
        for wid in [w for w in self.free_grad if w not in workers]:
            self._drop_grad(self.free_grad.pop(wid))

    def forget_worker(self, worker_id: str) -> None:
        """A new incarnation (hello) of ``worker_id``: its old lent slots are never lent again."""
        self._drop_grad(self.free_grad.pop(worker_id, []))

    def retire_worker(self, worker_id: str) -> None:
        """:meth:`forget_worker`, and the slots lent to ``worker_id`` now are lent to nobody: no
        reply reads them, and they are unlinked when their jobs leave the ledger (a shard's
        connection that says hello again, PROTOCOL.md §12.1, never gets any slot it held before)."""
        self.forget_worker(worker_id)
        for jid, (wid, slots) in list(self.lent.items()):
            if wid == worker_id:
                self.lent[jid] = ("", slots)  # "" is no worker's id

    def _drop_grad(self, slots: Iterable[int]) -> None:
        for s in slots:
            self.grad_arrays.pop(s, None)
            self._unlink(s)

    def files(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.dir) if n.startswith(self.prefix + "-"))
        except OSError:
            return []

    def close(self) -> None:
        """Unlink every file (mappings go with their last array)."""
        self.closed = True
        for name in self.files():
            try:
                os.unlink(os.path.join(self.dir, name))
            except FileNotFoundError:
                pass
        self.copies.clear()
        self.free_copy_slots.clear()
        self.lent.clear()
        self.free_grad.clear()
        self.grad_arrays.clear()
        self.by_addr.clear()


def _pid_namespace() -> int:
    """Inode of this process's PID namespace (0 if unknown): pids are only comparable within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFFFFFFFFFF
    except OSError:
        return 0


def remove_stale(directory: str = SHM_DIR) -> int:
    """Unlink slots left by servers that died without cleaning up.

    A server's files are judged only when its probe file says it ran in our PID namespace (a
    container sharing /dev/shm but not our pids may hold live files under a pid we cannot
    see) and its pid no longer exists. Returns the number of files removed."""
    n = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    ours = _pid_namespace()
    verdict: dict[str, bool] = {}  # prefix -> stale
    for name in names:
        m = re.match(r"^(latecomer-([0-9a-f]+)-[0-9a-f]+)-", name)
        if not m:
            continue
        prefix = m.group(1)
        if prefix not in verdict:
            verdict[prefix] = _stale(directory, prefix, int(m.group(2), 16), ours)
        if verdict[prefix]:
            try:
                os.unlink(os.path.join(directory, name))
                n += 1
            except OSError:
                pass
    return n


def _stale(directory: str, prefix: str, pid: int, ours: int) -> bool:
    try:
        with open(os.path.join(directory, f"{prefix}-probe"), "rb") as f:
            probe = f.read(16)
    except OSError:
        return False  # no probe: not ours to judge
    if len(probe) != 16 or not ours or int.from_bytes(probe[8:], "little") != ours:
        return False
    try:
        os.kill(pid, 0)
        return False  # alive
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's


class ShmReader:
    """The worker's side: maps the server's slots by number (a bounded cache of mappings)."""

    MAX_MAPS = 256

    def __init__(self, prefix: str, directory: str = SHM_DIR) -> None:
        if not PREFIX_RE.match(prefix):
            raise ValueError(f"not a latecomer shared-memory prefix: {prefix!r:.80}")
        self.prefix = prefix
        self.dir = directory
        self.maps: OrderedDict[int, np.ndarray] = OrderedDict()

    def probe(self, server_boot: int) -> str | None:
        """None if the server's probe file is readable and names this server; else why not."""
        try:
            with open(os.path.join(self.dir, f"{self.prefix}-probe"), "rb") as f:
                got = f.read(8)
        except OSError as e:
            return f"cannot open the server's shared memory: {e.strerror}"
        if got != server_boot.to_bytes(8, "little"):
            return "the shared memory belongs to another server (host ids match, /dev/shm differs)"
        return None

    def view(self, slot: int, *, writable: bool = False) -> np.ndarray:
        """The float32 array of ``slot``: read-only for iterates, writable for the gradient
        slots the server lent."""
        a = self.maps.get(slot)
        if a is not None:
            self.maps.move_to_end(slot)
        else:
            a = self._map(slot)
        if writable:
            return a
        v = a.view()
        v.setflags(write=False)
        return v

    def _map(self, slot: int) -> np.ndarray:
        fd = os.open(os.path.join(self.dir, f"{self.prefix}-{int(slot)}"), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        a = np.frombuffer(m, np.float32, count=size // 4)
        self.maps[slot] = a
        while len(self.maps) > self.MAX_MAPS:
            self.maps.popitem(last=False)
        return a

    def close(self) -> None:
        self.maps.clear()
