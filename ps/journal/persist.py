"""Server persistence: a write-ahead journal of the core's inputs and atomic checkpoints.

Because :class:`ps.core.server_core.ServerCore` is a deterministic function of its inputs (decoded
messages, ``now`` values and a few driver decisions), the journal records *inputs*, not
effects: replaying it through a fresh core reproduces the run bit for bit. A message is
journaled as the core consumed it: re-encoded from its decoded fields, so header keys the
decoder ignores (padding, a later version's extensions) never reach the disk. A checkpoint is a
snapshot of the core at a log sequence number (LSN); recovery = newest valid checkpoint + the
journal after it.

Journal: append-only segments ``wal-NNNNNN.log`` (a new one per server incarnation, and after a
checkpoint once the current one holds ``max_journal_bytes / 16``); records::

    u32 length | u32 crc32(body) | body = msgpack map {"lsn", "op", ...}

LSNs are consecutive across segments. A torn tail (the last record of the journal cut short or
garbled by a crash) is reported and ignored, and cut off when a server resumes, so it only ever
sits at the end of the last segment (or of a segment followed by a ``restart`` at the LSN it
would have had, in directories written before that rule); a bad record anywhere else, or an LSN
gap, is an error (:class:`JournalDamaged`) naming the file, the byte offset and the LSN, never
silently dropped, and :func:`repair_journal` (``serve --repair``) keeps the valid prefix and
moves the rest aside. The ``start`` record carries the time the run's core was created at, so
replay and recovery create theirs at it (clock-driven rounds fall where they fell).

``max_journal_bytes`` bounds the journal: a checkpoint is forced when the current segment
reaches a quarter of it, and once the journal holds more than three quarters, segments whose
records are all covered by the oldest checkpoint kept are removed; ``latecomer replay`` then
starts from the oldest kept checkpoint.

Durability: ``--fsync always`` fsyncs each record before it counts; ``batch`` fsyncs at most
``BATCH_FSYNC_S`` (10 ms) after the last sync (group commit; the daemon's poll wakes for it:
:meth:`Persistence.sync_due_in`); ``never`` leaves records to the OS. A new segment, a removed
one and a checkpoint's rename are made durable by fsyncing the directory.

Checkpoint file (``ckpt-<lsn>.bin``, written to a temp file, fsynced, renamed, directory
fsynced)::

    b"LATECKPT1\\n" | u64 tree length | msgpack tree | array bytes ... | sha256 of all before

No pickle: trees are msgpack with arrays referenced by index, array dtypes from an allow-list.
Whatever is read back is validated: a damaged checkpoint is skipped for the previous one, a
damaged journal record or run description is a one-line :class:`StateError`.

When the state directory cannot be written (disk full), :class:`Persistence` pauses: nothing
more reaches the core (so no job is issued and no message is accepted), the daemon says so in
its log and ``latecomer status``, and it resumes by itself once a probe write succeeds.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import math
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgpack
import numpy as np

from ps.journal.inputs import CoreInputs

log = logging.getLogger("latecomer.persist")

CKPT_MAGIC = b"LATECKPT1\n"
REC_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 31
FSYNC_POLICIES = ("always", "batch", "never")
BATCH_FSYNC_S = 0.01  # group commit: at most this long between fsyncs under "batch"
DEFAULT_MAX_JOURNAL_BYTES = 1 << 30  # serve --max-journal-bytes
KEEP_CHECKPOINTS = 3
RESUME_PROBE_S = 0.5  # while paused (disk full), how often the state directory is probed
RESUME_FREE_BYTES = 1 << 20  # ... and the free space a probe wants (at least 2 checkpoints' worth)
PID_FILE = "server.pid"
_SEGMENT_NAME = re.compile(r"wal-(\d+)\.log")
_CKPT_NAME = re.compile(r"ckpt-(\d+)\.bin")


class StateError(ValueError):
    """A state directory that cannot be used as it is: damaged, unexpected, or in use. The text
    is one line naming the file (and the byte offset, for a journal record) and what to do."""


# --------------------------------------------------------------------------- trees with arrays

def pack_tree(obj: Any) -> tuple[Any, list[np.ndarray]]:
    """Turn a nested structure of dicts/lists/tuples/sets/numbers/strings/arrays into a
    msgpack-able tree plus a list of arrays. Exact: tuples, sets, int-keyed dicts, numpy
    scalars (with their dtype) and integers beyond 64 bits survive the round trip."""
    arrays: list[np.ndarray] = []

    def enc(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            arrays.append(o)
            return {"__nd__": len(arrays) - 1}
        if isinstance(o, np.generic):
            arrays.append(np.asarray(o))
            return {"__np__": len(arrays) - 1}
        if isinstance(o, bool) or o is None or isinstance(o, (float, str, bytes)):
            return o
        if isinstance(o, int):
            return o if -(1 << 63) <= o < (1 << 64) else {"__big__": str(o)}
        if isinstance(o, tuple):
            return {"__tuple__": [enc(v) for v in o]}
        if isinstance(o, (set, frozenset)):
            return {"__set__": [enc(v) for v in sorted(o)]}
        if isinstance(o, list):
            return [enc(v) for v in o]
        if isinstance(o, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in o):
                return {k: enc(v) for k, v in o.items()}
            return {"__dict__": [[enc(k), enc(v)] for k, v in o.items()]}
        raise TypeError(f"cannot persist a {type(o).__name__}")

    return enc(obj), arrays


def unpack_tree(tree: Any, arrays: list[np.ndarray]) -> Any:
    def dec(o: Any) -> Any:
        if isinstance(o, list):
            return [dec(v) for v in o]
        if isinstance(o, dict):
            if len(o) == 1:
                (k, v), = o.items()
                if k == "__nd__":
                    return arrays[v]
                if k == "__np__":
                    return arrays[v][()]
                if k == "__big__":
                    return int(v)
                if k == "__tuple__":
                    return tuple(dec(x) for x in v)
                if k == "__set__":
                    return {dec(x) for x in v}
                if k == "__dict__":
                    return {dec(a): dec(b) for a, b in v}
            return {k: dec(v) for k, v in o.items()}
        return o

    return dec(tree)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- checkpoints

# The dtypes a checkpoint's arrays may have (looked up, never passed to np.dtype() from the file).
_CKPT_DTYPES: dict[str, np.dtype] = {}
for _t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
           np.float16, np.float32, np.float64, np.complex64, np.complex128):
    for _order in "<>":
        _dt = np.dtype(_t).newbyteorder(_order)
        _CKPT_DTYPES[_dt.str] = _dt


def write_checkpoint(state_dir: str, lsn: int, snapshot: dict[str, Any], *, keep: int = KEEP_CHECKPOINTS) -> str:
    """Atomically write ``snapshot`` as ``ckpt-<lsn>.bin``; keep the newest ``keep``. On an
    OSError (e.g. the disk is full) the temp file is removed and the error raised."""
    tree, arrays = pack_tree(snapshot)
    table = []
    offset = 0
    for a in arrays:
        a = np.ascontiguousarray(a)
        table.append([a.dtype.str, list(a.shape), offset, a.nbytes])
        offset += a.nbytes
    head = msgpack.packb({"lsn": lsn, "tree": tree, "arrays": table}, use_bin_type=True)
    final = os.path.join(state_dir, f"ckpt-{lsn:012d}.bin")
    tmp = final + ".tmp"
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for chunk in (CKPT_MAGIC, struct.pack("<Q", len(head)), head):
                f.write(chunk)
                h.update(chunk)
            for a in arrays:
                buf = memoryview(np.ascontiguousarray(a)).cast("B")
                f.write(buf)
                h.update(buf)
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(state_dir)
    for _, old in checkpoint_files(state_dir)[:-keep]:
        os.remove(old)
    return final


def checkpoint_files(state_dir: str) -> list[tuple[int, str]]:
    """(LSN, path) of the checkpoint files, oldest first. A ``ckpt-*.bin`` whose name is not
    ``ckpt-<digits>.bin`` is skipped with a warning."""
    out = []
    for path in glob.glob(os.path.join(glob.escape(state_dir), "ckpt-*.bin")):
        m = _CKPT_NAME.fullmatch(os.path.basename(path))
        if m is None:
            log.warning("ignoring %s: not a checkpoint name (ckpt-<LSN>.bin)", path)
            continue
        out.append((int(m.group(1)), path))
    return sorted(out)


def read_checkpoint(path: str) -> tuple[int, dict[str, Any]]:
    """Read and verify one checkpoint file: its checksum, then its structure (the header's
    fields, every array's dtype, shape and extent, the LSN its name gives). Raises ValueError
    (one line naming the file) if it is damaged."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < len(CKPT_MAGIC) + 8 + 32 or not data.startswith(CKPT_MAGIC):
        raise ValueError(f"{path}: not a checkpoint")
    if hashlib.sha256(data[:-32]).digest() != data[-32:]:
        raise ValueError(f"{path}: checksum mismatch")
    (n,) = struct.unpack_from("<Q", data, len(CKPT_MAGIC))
    start = len(CKPT_MAGIC) + 8
    end = len(data) - 32
    if n > end - start:
        raise ValueError(f"{path}: bad header (length {n} beyond the file)")
    try:
        head = msgpack.unpackb(data[start:start + n], raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"{path}: bad header ({type(e).__name__}: {e})") from None
    if type(head) is not dict or type(head.get("lsn")) is not int or head["lsn"] < 0 or "tree" not in head \
            or type(head.get("arrays")) is not list:
        raise ValueError(f"{path}: bad header (expected a map with lsn, tree and arrays)")
    lsn = head["lsn"]
    m = _CKPT_NAME.fullmatch(os.path.basename(path))
    if m is not None and int(m.group(1)) != lsn:
        raise ValueError(f"{path}: holds LSN {lsn}, its name says {int(m.group(1))}")
    base = start + n
    arrays = []
    for i, entry in enumerate(head["arrays"]):
        dt = None
        if type(entry) is list and len(entry) == 4 and type(entry[0]) is str:
            dt = _CKPT_DTYPES.get(entry[0])
        shape, off, nbytes = (entry[1], entry[2], entry[3]) if dt is not None else (None, None, None)
        if dt is None or type(shape) is not list or any(type(s) is not int or s < 0 for s in shape) \
                or type(off) is not int or type(nbytes) is not int or off < 0 \
                or nbytes != dt.itemsize * math.prod(shape) or base + off + nbytes > end:
            raise ValueError(f"{path}: array {i} has a bad descriptor {entry!r:.80}")
        a = np.frombuffer(data, dtype=dt, count=nbytes // dt.itemsize, offset=base + off).reshape(shape).copy()
        arrays.append(a)
    try:
        tree = unpack_tree(head["tree"], arrays)
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad tree ({type(e).__name__}: {e})") from None
    if type(tree) is not dict:
        raise ValueError(f"{path}: bad tree (not a map)")
    return lsn, tree


def verified_checkpoints(state_dir: str, *, newest_first: bool = True) -> Iterator[tuple[int, dict[str, Any], str]]:
    """(LSN, snapshot, path) of every checkpoint that verifies; damaged ones are skipped with a
    warning."""
    files = checkpoint_files(state_dir)
    for _, path in reversed(files) if newest_first else files:
        try:
            lsn, snap = read_checkpoint(path)
        except (ValueError, OSError) as e:
            log.warning("skipping corrupt checkpoint %s: %s", os.path.basename(path), e)
            continue
        yield lsn, snap, path


def latest_checkpoint(state_dir: str) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint that verifies; corrupt ones are skipped with a warning."""
    for lsn, snap, _ in verified_checkpoints(state_dir):
        return lsn, snap
    return None


# --------------------------------------------------------------------------- journal

@dataclass
class Record:
    lsn: int
    op: str
    body: dict[str, Any]
    path: str = ""  # the segment it was read from
    offset: int = 0  # its byte offset there

    def where(self) -> str:
        return f"{self.path}: record at byte {self.offset} (LSN {self.lsn}, {self.op})"


@dataclass
class Segment:
    """One journal file: its number, the LSN of its first record (None: empty, or unreadable
    from the start) and its size in bytes."""

    path: str
    number: int
    first_lsn: int | None
    size: int


def journal_segments(state_dir: str) -> list[tuple[int, str]]:
    """(number, path) of the journal segments in order. Raises StateError for a ``wal-*.log``
    whose name is not ``wal-<digits>.log``."""
    out = []
    for path in glob.glob(os.path.join(glob.escape(state_dir), "wal-*.log")):
        m = _SEGMENT_NAME.fullmatch(os.path.basename(path))
        if m is None:
            raise StateError(f"{path}: unexpected file in a state directory (journal segments are named "
                             f"wal-<number>.log): move it away")
        out.append((int(m.group(1)), path))
    return sorted(out)


def _first_record(path: str) -> dict | None:
    """A segment's first record (its decoded body), or None (empty, or its first record is
    unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(REC_HEADER.size)
            if len(head) < REC_HEADER.size:
                return None
            n, crc = REC_HEADER.unpack(head)
            if n > MAX_RECORD_BYTES:
                return None
            body = f.read(n)
        if len(body) != n or zlib.crc32(body) != crc:
            return None
        rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (OSError, ValueError, msgpack.UnpackException):
        return None
    return rec if type(rec) is dict and type(rec.get("lsn")) is int else None


def _first_lsn(path: str) -> int | None:
    """The LSN of a segment's first record, or None (empty, or its first record is unreadable)."""
    rec = _first_record(path)
    return None if rec is None else rec["lsn"]


class Journal:
    """Append-only journal: a new segment per server incarnation (``wal-NNNNNN.log``), and a
    new one after a checkpoint when :meth:`rotate` is called.

    A record is written whole or not at all: a write the OS refuses part-way (disk full) is cut
    back to the record's start and the OSError raised, so the segment never holds a partial
    record followed by good ones.
    """

    def __init__(self, state_dir: str, *, next_lsn: int, fsync: str = "batch",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.fsync = fsync
        self.clock = clock  # the group commit's clock (tests may substitute one)
        self.state_dir = state_dir
        self.closed = [Segment(path, number, _first_lsn(path), os.path.getsize(path))
                       for number, path in journal_segments(state_dir)]
        if next_lsn == 0 and any(s.size for s in self.closed):
            raise StateError(f"{state_dir} holds journal segments but no run description (run.json): a new run "
                             f"cannot start there; give an empty --state directory")
        self.next_lsn = next_lsn
        self.dirty = False
        self.last_sync = clock()
        self.bytes_written = 0
        self.cut_to: int | None = None  # a refused write could not be cut back yet: do it first
        # The last LSN as durable as the fsync policy makes it (written; under "batch", synced).
        # A sharded server ships records to its shards up to here, never past (ps/sharded/hub.py).
        self.durable_lsn = next_lsn - 1
        self.tap: list | None = None  # when a list: (lsn, record body bytes) of each record written
        self.fd = -1
        self._open((self.closed[-1].number + 1) if self.closed else 1)

    def _open(self, number: int) -> None:
        path = os.path.join(self.state_dir, f"wal-{number:06d}.log")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if self.fd >= 0:
            os.close(self.fd)
            self.closed.append(Segment(self.path, self.number, self.start_lsn, self.size))
        self.fd, self.path, self.number = fd, path, number
        self.start_lsn = self.next_lsn  # every record before this segment has a smaller LSN
        self.size = os.fstat(fd).st_size
        _fsync_dir(self.state_dir)

    def append(self, op: str, **body: Any) -> int:
        """Write one record; returns its LSN. Raises OSError (the record not written) if the OS
        refuses the write (or, under ``--fsync always``, its fsync)."""
        lsn = self.next_lsn
        data = msgpack.packb({"lsn": lsn, "op": op, **body}, use_bin_type=True)
        rec = REC_HEADER.pack(len(data), zlib.crc32(data)) + data
        if self.cut_to is not None:
            os.ftruncate(self.fd, self.cut_to)
            self.size, self.cut_to = self.cut_to, None
        start = self.size
        view = memoryview(rec)
        try:
            while view:
                view = view[os.write(self.fd, view):]
            if self.fsync == "always":
                os.fsync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                self.cut_to = start
            raise
        self.size += len(rec)
        self.bytes_written += len(rec)
        self.next_lsn += 1
        self.dirty = self.fsync != "always"
        if self.fsync != "batch":
            self.durable_lsn = lsn
        if self.tap is not None:
            self.tap.append((lsn, data))
        return lsn

    def sync(self) -> None:
        if self.dirty:
            if self.fsync != "never":
                os.fsync(self.fd)
            self.dirty = False
        self.durable_lsn = self.next_lsn - 1
        self.last_sync = self.clock()

    def maybe_sync(self) -> None:
        """Group commit: flush and fsync if the batch window has passed."""
        if self.dirty and (self.fsync != "batch" or self.clock() - self.last_sync >= BATCH_FSYNC_S):
            self.sync()

    def sync_due_in(self) -> float:
        """Seconds until :meth:`maybe_sync` has a group commit to do (0: now; inf: nothing to
        sync, or not ``--fsync batch``). The daemon's poll waits no longer than this."""
        if not self.dirty or self.fsync != "batch":
            return math.inf
        return max(0.0, self.last_sync + BATCH_FSYNC_S - self.clock())

    def rotate(self) -> None:
        """Continue in a new segment (after a checkpoint, so that the old one can be removed once
        the checkpoints kept cover it). Raises OSError if the new file cannot be created."""
        if self.size:
            self.sync()
            self._open(self.number + 1)

    def total_bytes(self) -> int:
        return sum(s.size for s in self.closed) + self.size

    def prune(self, covered_lsn: int, budget: int) -> int:
        """Remove the oldest segments whose records all have an LSN <= ``covered_lsn`` (the
        oldest checkpoint kept), while the journal holds more than ``budget`` bytes. Returns how
        many were removed."""
        starts = [s.first_lsn for s in self.closed] + [self.start_lsn]
        cut = 0  # segments [0, cut) are covered: the LSNs of segment `cut` start at <= covered + 1
        for j, first in enumerate(starts):
            if first is not None and first <= covered_lsn + 1:
                cut = j
        removed = 0
        while removed < cut and self.total_bytes() > budget:
            seg = self.closed.pop(0)
            try:
                os.remove(seg.path)
            except FileNotFoundError:
                pass
            removed += 1
        if removed:
            _fsync_dir(self.state_dir)
        return removed

    def close(self) -> None:
        try:
            self.sync()
        finally:
            os.close(self.fd)


_NUMBER = (int, float)
# Per journal op: the fields its records must carry, and their types.
_RECORD_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "start": {"run": (dict,)},  # and "now": the core's creation time (since issue 14)
    "msg": {"wid": (str,), "now": _NUMBER, "frames": (list,)},
    "reply": {"wid": (str,), "now": _NUMBER, "reply": (dict,)},
    "tick": {"now": _NUMBER},
    "remove": {"wid": (str,), "now": _NUMBER, "reason": (str,)},
    "count": {"kind": (str,)},
    "invalid": {},
    "stop_issuing": {},
    "restart": {"now": _NUMBER},
    "resume": {"now": _NUMBER},
    "checkpoint": {"version": (int,)},
    "hold": {"now": _NUMBER, "reason": (str,)},  # a sharded server holds the issuing (ps/sharded/hub.py)
    "release": {"now": _NUMBER},
    "block": {"job_id": (int,), "created_at": (int,), "frames": (list,)},  # a shard's journal (ps/sharded/shard.py)
}
_REPLY_FIELDS: dict[str, tuple[type, ...]] = {"job_id": (int,), "created_at": (int,), "loss": (*_NUMBER, type(None)),
                                              "count": (int,), "compute_s": _NUMBER, "holds": (list,)}


def _check_record(rec: Any) -> str | None:
    """Why a decoded record body is not a journal record (None: it is one)."""
    if type(rec) is not dict:
        return "not a map"
    if type(rec.get("lsn")) is not int or rec["lsn"] < 0:
        return "no valid 'lsn'"
    op = rec.get("op")
    if type(op) is not str or op not in _RECORD_FIELDS:
        return f"unknown op {op!r:.40}"
    for name, types in _RECORD_FIELDS[op].items():
        if type(rec.get(name)) not in types:
            return f"field {name!r} missing or not a {'/'.join(t.__name__ for t in types)}"
    if op == "msg":
        if not rec["frames"] or any(type(f) is not bytes for f in rec["frames"]):
            return "'frames' must be a non-empty list of byte strings"
        if type(rec.get("key", "")) is not str or type(rec.get("wire", "")) is not str:
            return "'key' and 'wire' must be strings"
        kept = rec.get("refusal")
        if kept is not None and (type(kept) is not list or len(kept) != 2 or type(kept[0]) is not int
                                 or not 1 <= kept[0] <= 10 or type(kept[1]) is not str):
            return "'refusal' must be [an error code, its text]"
        if not (_block_sq_ok(rec.get("bsq")) and _block_sq_ok(rec.get("ssq"))):
            return "'bsq' and 'ssq' must be lists of finite numbers >= 0"
    elif op == "start" and type(rec.get("now", 0.0)) not in _NUMBER:
        return "'now' must be a number"
    elif op == "reply":
        fields = rec["reply"]
        for name, types in _REPLY_FIELDS.items():
            if type(fields.get(name)) not in types:
                return f"reply field {name!r} missing or not a {'/'.join(t.__name__ for t in types)}"
        if any(type(h) is not int for h in fields["holds"]) or type(fields.get("wire", "")) is not str:
            return "reply 'holds' must be integers and 'wire' a string"
        if not (_block_sq_ok(fields.get("bsq")) and _block_sq_ok(fields.get("ssq"))):
            return "reply 'bsq' and 'ssq' must be lists of finite numbers >= 0"
    return None


def journaled_norms(fields: dict) -> tuple[tuple | None, tuple | None]:
    """(block_sq, step_sq) of a journaled reply (``bsq``, ``ssq``: a sharded coordinator's figures
    from its shards), None where absent."""
    block_sq, step_sq = (None if fields.get(k) is None else tuple(fields[k]) for k in ("bsq", "ssq"))
    return block_sq, step_sq


def _block_sq_ok(v: Any) -> bool:
    """An absent ``bsq`` (per-block squared norms of a sharded reply), or a list of finite numbers >= 0."""
    return v is None or (type(v) is list and all(type(x) in _NUMBER and 0.0 <= x < math.inf for x in v))


class JournalDamaged(StateError):
    """A journal record that does not read and is not the torn tail of the journal's last
    segment (a crash cuts only the record being written), or records missing (an LSN gap: a
    segment removed or cut short). The text names the file, the byte offset and the LSN there,
    and ``serve --repair``; the attributes say where, for :func:`repair_journal`.

    Attributes:
        path: the segment; offset: the damaged record's byte offset there (the journal's valid
        prefix ends there); lsn: the LSN expected there (None: unknown, the journal's first
        record); prev: the LSN of the last good record before it (None: none).
    """

    def __init__(self, path: str, offset: int, lsn: int | None, prev: int | None, why: str) -> None:
        self.path, self.offset, self.lsn, self.prev, self.why = path, offset, lsn, prev, why
        where = f"LSN {lsn}" if lsn is not None else "the journal's first record"
        state_dir = os.path.dirname(path) or "."
        super().__init__(f"{path}: record at byte {offset} {why} ({where}): the journal is damaged there, it is not "
                         f"a torn end; `latecomer serve --state {state_dir} --repair` keeps the records before it and "
                         f"moves the rest aside (or restore the state directory from a backup)")


@dataclass
class _Bad:
    """Where a segment stops reading: its offset, why, and whether it is a torn tail (the
    segment's last record cut short or garbled, nothing that reads after it)."""

    offset: int
    why: str
    torn: bool
    lsn: int | None = None  # the LSN the bad record carries, when it reads at all


_LSN_KEY = b"\xa3lsn"  # every record's body is a msgpack map whose first key is "lsn"


def _record_at(data: bytes, off: int) -> dict | None:
    """The journal record that starts at ``off`` (checksum, msgpack and fields good), or None."""
    if off < 0 or off + REC_HEADER.size > len(data):
        return None
    n, crc = REC_HEADER.unpack_from(data, off)
    end = off + REC_HEADER.size + n
    if n > MAX_RECORD_BYTES or end > len(data):
        return None
    body = data[off + REC_HEADER.size:end]
    if zlib.crc32(body) != crc:
        return None
    try:
        rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return rec if _check_record(rec) is None else None


def _resync(data: bytes, off: int, after_lsn: int) -> int | None:
    """The offset of the first whole journal record after ``off`` whose LSN is above
    ``after_lsn`` (None: none). A cut-short tail is a prefix of one record, so a record that
    reads after it means the bytes at ``off`` are damage, not a torn tail."""
    i = data.find(_LSN_KEY, off + 1 + REC_HEADER.size)
    while i >= 0:
        p = i - REC_HEADER.size - 1  # the header, then the map's first byte, then "lsn"
        rec = _record_at(data, p) if p > off else None
        if rec is not None and rec["lsn"] > after_lsn:
            return p
        i = data.find(_LSN_KEY, i + 1)
    return None


def _scan(path: str, data: bytes) -> tuple[list[tuple[int, dict]], _Bad | None]:
    """The records of one segment as (offset, body), up to where it stops reading (None: it
    reads to its end). A record cut short or garbled with nothing that reads after it is a torn
    tail; anything else that stops the reading is damage."""
    out: list[tuple[int, dict]] = []
    off = 0
    while off < len(data):
        last = out[-1][1]["lsn"] if out else -1
        if off + REC_HEADER.size > len(data):
            return out, _Bad(off, "is cut short (a short header)", True)
        n, crc = REC_HEADER.unpack_from(data, off)
        end = off + REC_HEADER.size + n
        if n > MAX_RECORD_BYTES or end > len(data):
            if _resync(data, off, last) is not None:
                return out, _Bad(off, f"has a length ({n} bytes) that runs past the end of the file, with records "
                                      f"after it", False)
            return out, _Bad(off, "is cut short", True)
        body = data[off + REC_HEADER.size:end]
        if zlib.crc32(body) != crc:
            if end == len(data):
                return out, _Bad(off, "fails its checksum (the segment's last record)", True)
            return out, _Bad(off, f"fails its checksum, with {len(data) - end} bytes of records after it", False)
        try:
            rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            return out, _Bad(off, f"is not msgpack ({type(e).__name__})", False)
        why = _check_record(rec)
        if why is not None:
            lsn = rec.get("lsn") if type(rec) is dict and type(rec.get("lsn")) is int else None
            return out, _Bad(off, f"is not a journal record: {why}", False, lsn)
        out.append((off, rec))
        off = end
    return out, None


def _segment_data(path: str, state_dir: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise StateError(f"{path} was removed while it was read (a server running on {state_dir} removes "
                         f"segments its checkpoints cover): try again") from None


def read_journal(state_dir: str, *, from_lsn: int = 0) -> Iterator[Record]:
    """Records of every segment in order, from ``from_lsn``, each validated (its fields and
    their types, consecutive LSNs across segments).

    A torn tail (the last record cut short or garbled by a crash, nothing that reads after it)
    is reported once and skipped if it ends the journal, or ends a segment the next
    incarnation's ``restart`` follows at the LSN it would have had (state directories written
    before torn tails were cut off on resume). Anything else that does not read, and any LSN
    gap, is a :class:`JournalDamaged` naming the file, byte offset and LSN: a damaged record is
    never dropped silently.
    """
    torn: tuple[str, _Bad, int | None] | None = None
    prev: int | None = None
    for number, path in journal_segments(state_dir):
        records, bad = _scan(path, _segment_data(path, state_dir))
        for off, rec in records:
            lsn = rec["lsn"]
            if torn is not None:
                if rec["op"] != "restart":
                    raise JournalDamaged(torn[0], torn[1].offset, torn[2], prev,
                                         f"is cut short or garbled, and the journal goes on in "
                                         f"{os.path.basename(path)}")
                log.warning("%s: torn record at byte %d (a crash): ignored", os.path.basename(torn[0]),
                            torn[1].offset)
                torn = None
            if prev is not None and lsn != prev + 1:
                raise JournalDamaged(path, off, prev + 1, prev, f"has LSN {lsn} after LSN {prev} (records are missing "
                                                                f"or out of order)")
            prev = lsn
            if lsn >= from_lsn:
                yield Record(lsn, rec["op"], rec, path, off)
        if bad is not None:
            expected = prev + 1 if prev is not None else (0 if number == 1 and bad.offset == 0 else bad.lsn)
            if not bad.torn:
                raise JournalDamaged(path, bad.offset, expected, prev, bad.why)
            if torn is not None:
                raise JournalDamaged(torn[0], torn[1].offset, torn[2], prev,
                                     f"is cut short or garbled, and the journal goes on in "
                                     f"{os.path.basename(path)}")
            torn = (path, bad, expected)
    if torn is not None:
        log.warning("%s: torn or corrupt record at byte %d: ignored (the end of the journal, cut short by a crash)",
                    os.path.basename(torn[0]), torn[1].offset)


def cut_torn_tail(state_dir: str) -> int | None:
    """Cut a torn tail off the journal's last non-empty segment (before a server resumes and
    appends a new segment, so that a torn record is only ever the journal's last). Returns the
    offset it was cut at, or None. Damage (not a torn tail) is left for :func:`read_journal` to
    report."""
    for _, path in reversed(journal_segments(state_dir)):
        with open(path, "rb") as f:
            data = f.read()
        if not data:
            continue
        _, bad = _scan(path, data)
        if bad is None or not bad.torn:
            return None
        with open(path, "r+b") as f:
            f.truncate(bad.offset)
            f.flush()
            os.fsync(f.fileno())
        log.warning("%s: torn record at byte %d (%d bytes, a crash): cut off", os.path.basename(path), bad.offset,
                    len(data) - bad.offset)
        return bad.offset
    return None


def first_journal_lsn(state_dir: str) -> int | None:
    """The LSN of the journal's first record (None: no record). Greater than 0 once segments
    covered by the checkpoints kept have been removed."""
    for _, path in journal_segments(state_dir):
        first = _first_lsn(path)
        if first is not None:
            return first
        if os.path.getsize(path):  # its first record does not read: damaged, or a torn tail alone
            with open(path, "rb") as f:
                records, _ = _scan(path, f.read())
            if records:
                return records[0][1]["lsn"]
    return None


def run_start(state_dir: str) -> dict[str, Any] | None:
    """The journal's ``start`` record (LSN 0), or None (none, or the journal's head removed).
    Its ``now`` is the time the run's core was created with (absent in journals written before
    it was recorded)."""
    for _, path in journal_segments(state_dir):
        rec = _first_record(path)
        if rec is not None:
            return rec if rec["lsn"] == 0 and rec.get("op") == "start" and _check_record(rec) is None else None
        if os.path.getsize(path):
            return None
    return None


@dataclass
class RepairReport:
    """What :func:`repair_journal` moved aside."""

    state_dir: str
    moved_to: str  # the directory it went to
    files: list[str]  # names moved (a segment cut at the damage: "NAME (from byte N)", its original copied)
    kept_last: int  # the last LSN kept (-1: none)
    dropped_records: int  # records that read in what was moved aside (the damaged one not counted)
    dropped_lsns: tuple[int, int] | None  # (first, last) LSN moved aside, as far as they read
    damage: str  # the error that called for the repair

    def text(self) -> str:
        span = f"LSN {self.dropped_lsns[0]}..{self.dropped_lsns[1]}" if self.dropped_lsns else "no LSN that reads"
        return (f"repaired {self.state_dir}: kept the journal up to LSN {self.kept_last}; dropped {span} "
                f"({self.dropped_records} records that read, besides the damaged one); moved to {self.moved_to}: "
                f"{', '.join(self.files)} (nothing deleted). The damage: {self.damage}")


def _count_records(data: bytes, off: int, after_lsn: int) -> list[int]:
    """The LSNs of the records that read in ``data`` from ``off``, resynchronising past bytes
    that do not read."""
    lsns: list[int] = []
    p: int | None = off
    while p is not None and p < len(data):
        records, bad = _scan("", data[p:])
        lsns += [r["lsn"] for _, r in records]
        if bad is None:
            break
        p = _resync(data, p + bad.offset, lsns[-1] if lsns else after_lsn)
    return lsns


def repair_journal(state_dir: str) -> RepairReport | None:
    """Keep the journal's valid prefix and move the rest aside (``serve --state DIR --repair``).

    The prefix ends where :func:`read_journal` finds damage (a bad record that is not the torn
    tail of the last segment, or an LSN gap). Into ``DIR/damaged-<UTC time>/`` go: the damaged
    segment (copied whole; the original is then cut at the damage, or moved if the damage is at
    its start), every later segment, and the checkpoints past the prefix's last LSN (they hold a
    state the journal kept no longer reaches). Nothing is deleted. With no journal damage, a
    checkpoint past the journal's end (its segment missing) is moved aside the same way.

    Returns None when there is nothing to repair.

    Raises:
        StateError: what would be kept could not be recovered (the journal's head was removed and
            no checkpoint kept covers the prefix); nothing has been moved.
    """
    damage: JournalDamaged | None = None
    last = -1
    try:
        for rec in read_journal(state_dir):
            last = rec.lsn
    except JournalDamaged as e:
        damage = e
    if damage is not None:
        kept_last = damage.prev if damage.prev is not None else -1
        number = next(num for num, path in journal_segments(state_dir) if path == damage.path)
        later = [path for num, path in journal_segments(state_dir) if num > number]
    else:
        kept_last, later = last, []
    ckpts = [(lsn, path) for lsn, path in checkpoint_files(state_dir) if lsn > kept_last]
    if damage is None and (last < 0 or not ckpts):
        return None  # the journal reads whole (a checkpoint with no journal at all is left to recover)
    _check_repairable(state_dir, damage, kept_last)
    dest = _damaged_dir(state_dir)
    files, dropped = _move_aside(dest, damage, kept_last, later, [path for _, path in ckpts])
    _fsync_dir(dest)
    _fsync_dir(state_dir)
    hi = max(dropped + [c for c, _ in ckpts], default=None)
    span = (kept_last + 1, hi) if hi is not None and hi > kept_last else None
    if damage is not None and damage.lsn is not None and span is None:
        span = (damage.lsn, damage.lsn)
    text = str(damage) if damage is not None else \
        f"the journal ends at LSN {last}, before the checkpoints {', '.join(os.path.basename(p) for _, p in ckpts)}"
    return RepairReport(state_dir, dest, files, kept_last, len([x for x in dropped if x > kept_last]), span, text)


def _check_repairable(state_dir: str, damage: JournalDamaged | None, kept_last: int) -> None:
    """What a repair keeps must still recover: from LSN 0, or from a checkpoint it keeps that
    covers where the kept records start. Raises StateError if not."""
    kept_first = first_journal_lsn(state_dir) if damage is None or damage.prev is not None else None
    if kept_first is None and damage is not None and damage.lsn == 0:
        kept_first = 0
    if kept_first == 0:
        return
    covering = (lsn for lsn, _, _ in verified_checkpoints(state_dir) if kept_first is not None
                and kept_first - 1 <= lsn <= kept_last)
    if next(covering, None) is not None:
        return
    what = f"LSN {kept_first}..{kept_last}" if kept_first is not None else "nothing"
    raise StateError(f"{state_dir}: cannot repair: the journal's valid prefix ({what}) does not start the run and no "
                     f"checkpoint kept covers it; nothing was moved. {damage if damage is not None else ''}".rstrip())


def _damaged_dir(state_dir: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = os.path.join(state_dir, f"damaged-{stamp}")
    k = 1
    while os.path.exists(dest):
        k += 1
        dest = os.path.join(state_dir, f"damaged-{stamp}-{k}")
    os.makedirs(dest)
    return dest


def _move_aside(dest: str, damage: JournalDamaged | None, kept_last: int, later: list[str],
                ckpts: list[str]) -> tuple[list[str], list[int]]:
    """Move what follows the valid prefix into ``dest`` (the damaged segment copied whole, then
    cut); returns (what was moved, the LSNs of the records that read in it)."""
    import shutil

    files: list[str] = []
    dropped: list[int] = []
    if damage is not None:
        with open(damage.path, "rb") as f:
            data = f.read()
        name = os.path.basename(damage.path)
        head = _record_at(data, damage.offset)  # the damaged record itself may read (a gap, a bad field)
        dropped += ([head["lsn"]] if head is not None else []) + _count_records(data, damage.offset + 1, kept_last)
        if damage.offset == 0:
            os.rename(damage.path, os.path.join(dest, name))
            files.append(name)
        else:
            shutil.copy2(damage.path, os.path.join(dest, name))
            with open(os.path.join(dest, name), "rb") as f:
                os.fsync(f.fileno())
            with open(damage.path, "r+b") as f:
                f.truncate(damage.offset)
                f.flush()
                os.fsync(f.fileno())
            files.append(f"{name} (from byte {damage.offset}; copied whole, the original cut there)")
    for path in later:
        with open(path, "rb") as f:
            dropped += _count_records(f.read(), 0, kept_last)
        os.rename(path, os.path.join(dest, os.path.basename(path)))
        files.append(os.path.basename(path))
    for path in ckpts:
        os.rename(path, os.path.join(dest, os.path.basename(path)))
        files.append(os.path.basename(path))
    return files, dropped


def last_lsn(state_dir: str) -> int:
    """The highest LSN in the journal (-1 if empty)."""
    last = -1
    for rec in read_journal(state_dir):
        last = rec.lsn
    return last


# --------------------------------------------------------------------------- run description

DEFAULT_WIRE_DTYPE = "f32"  # state directories written before --wire-dtype existed
# What a complete run.json holds (serve --state writes it): key -> type.
RUN_FIELDS: dict[str, type] = {"problem": str, "problem_options": dict, "algorithm": str, "settings": dict,
                               "core": dict}


def run_wire_dtype(run: dict[str, Any] | None) -> str:
    """The wire dtype a recorded run used (PROTOCOL.md §6.12): ``run["wire_dtype"]`` (else
    ``run["core"]["wire_dtype"]``), or ``"f32"`` when absent (older state directories, or no run).

    Raises:
        ValueError: the recorded value is not a wire dtype.
    """
    from protocol.wire import check_wire

    run = run or {}
    core = run.get("core")
    fallback = core.get("wire_dtype", DEFAULT_WIRE_DTYPE) if isinstance(core, dict) else DEFAULT_WIRE_DTYPE
    return check_wire(run.get("wire_dtype", fallback))


def write_run(state_dir: str, run: dict[str, Any]) -> None:
    """Atomically write the run description ``run.json``. It always carries ``wire_dtype``
    (``"f32"`` unless ``run`` says otherwise): recovery needs it to recompute the gradients the
    core applied."""
    run = {**run, "wire_dtype": run_wire_dtype(run)}
    path = os.path.join(state_dir, "run.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(run, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(state_dir)


def read_run(state_dir: str, *, complete: bool = False) -> dict[str, Any] | None:
    """The run description of ``state_dir`` (None if there is none); ``wire_dtype`` is filled in
    with ``"f32"`` when the file predates it.

    Args:
        complete: require every field a resume or a replay reads (``RUN_FIELDS``, and
            ``core.problem_options`` a map).
    Raises:
        StateError: ``run.json`` does not read as JSON, is not a map, has a field of the wrong
            type, or (``complete``) lacks one.
    """
    path = os.path.join(state_dir, "run.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if type(run) is not dict:
        raise StateError(f"{path}: not a run description (a JSON map)")
    for key, typ in RUN_FIELDS.items():
        if key in run and type(run[key]) is not typ:
            raise StateError(f"{path}: {key!r} must be a {typ.__name__}, got {type(run[key]).__name__}")
        if complete and key not in run:
            raise StateError(f"{path}: no {key!r} (it is not a complete run description)")
    if complete and type(run["core"].get("problem_options")) is not dict:
        raise StateError(f"{path}: core.problem_options must be a map")
    try:
        run["wire_dtype"] = run_wire_dtype(run)
    except ValueError as e:
        raise StateError(f"{path}: {e}") from None
    return run


# --------------------------------------------------------------------------- the live server's lock

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


# --------------------------------------------------------------------------- the event log

class EventLog:
    """The daemon's event log (JSON lines), appended a batch of whole lines at a time. A write the
    OS refuses (disk full) is cut back to the last whole line and its events dropped: counted, one
    warning when it starts and one when the log is written again. Never raises on a write."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.pending: list[str] = []
        self.dropped = 0
        self.failing = False

    def write(self, text: str) -> None:
        self.pending.append(text)

    def flush(self) -> None:
        if not self.pending or self.fd < 0:
            return
        data = "".join(self.pending).encode()
        self.pending = []
        start = -1
        try:
            start = os.fstat(self.fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            if start >= 0:
                try:
                    os.ftruncate(self.fd, start)
                except OSError:
                    pass
            self.dropped += data.count(b"\n")
            if not self.failing:
                self.failing = True
                log.error("cannot write the event log %s (%s): events are dropped until it can be written",
                          self.path, e.strerror or e)
            return
        if self.failing:
            self.failing = False
            log.warning("the event log %s is written again (%d events were dropped)", self.path, self.dropped)

    def close(self) -> None:
        self.flush()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# --------------------------------------------------------------------------- the daemon's side

def _frame_bytes(f: Any) -> bytes:
    b = getattr(f, "bytes", None)  # zmq.Frame
    return b if b is not None else bytes(f)


def canonical_frames(frames: list) -> list[bytes]:
    """A message's frames as the core consumes it: decoded, then encoded again, so that what the
    decoder ignores (unknown header keys, unknown keys in array descriptors, padding) is not
    kept. ``frames`` already decoded once (the daemon's check), with the same result."""
    from protocol.codec import decode, encode

    return [_frame_bytes(f) for f in encode(decode(frames, max_array_bytes=MAX_RECORD_BYTES))]


def _why(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


class Persistence:
    """Journal and checkpoints for one daemon incarnation.

    Args:
        state_dir: the server's state directory.
        journal: the open journal of this incarnation.
        checkpoint_every: checkpoint after this many new versions (0: never by count).
        checkpoint_interval_s: checkpoint at least this often (0: never by time).
        log_payloads: journal every reply's gradients. Off (the default), accepted gradients
            are recomputed from their recorded seeds on recovery and replay, which requires a
            deterministic oracle (CPU); on, replay needs no oracle at the cost of writing every
            accepted gradient to disk (4·d bytes per reply, per gradient).
        max_journal_bytes: bound on the journal's segments on disk (0: none). A checkpoint is
            forced when the current segment reaches a quarter of it; once the journal holds more
            than three quarters, the oldest segments the kept checkpoints cover are removed. With
            ``keep`` = 3 the segments the checkpoints need hold at most three quarters, so the
            journal stays within the bound, give or take one loop pass of records (MAX_BATCH).
        lock: the server's :class:`StateLock`, released by :meth:`close`.

    Disk full: when a record or a checkpoint cannot be written, the persistence *pauses*
    (:attr:`paused` holds why): :meth:`append` and :meth:`record_message` return False without
    writing, so the daemon feeds nothing more to the core (no job is issued, no message
    accepted: what is not journaled never happened). Every ``RESUME_PROBE_S`` :meth:`after_batch`
    probes: with enough free space and a ``resume`` record written, it resumes (the core's
    clock is rebased, as after a restart, so no worker is written off for the pause).
    """

    def __init__(self, state_dir: str, journal: Journal, *, checkpoint_every: int = 1000,
                 checkpoint_interval_s: float = 30.0, log_payloads: bool = False, keep: int = KEEP_CHECKPOINTS,
                 max_journal_bytes: int = DEFAULT_MAX_JOURNAL_BYTES, lock: StateLock | None = None) -> None:
        self.state_dir = state_dir
        self.journal = journal
        self.every = checkpoint_every
        self.interval_s = checkpoint_interval_s
        self.log_payloads = log_payloads
        self.keep = keep
        self.max_journal_bytes = max_journal_bytes
        self.lock = lock
        self.wire_dtype = "f32"  # the run's --wire-dtype (from run.json)
        self.ckpt_version = -1
        self.ckpt_time = time.monotonic()
        self.ckpt_bytes = 0
        self.checkpoints = 0
        self.checkpoint_s = 0.0
        self.segments_removed = 0
        self.paused: str | None = None  # why the state directory cannot be written (None: it can)
        self.paused_at = 0.0
        self.pauses = 0
        self.not_accepted = 0  # core inputs refused while paused
        self.next_probe = 0.0
        # A sharded server's shards still need the records from this LSN on (the oldest of
        # their checkpoints): segments holding them are kept (None: no shards).
        self.retain_from: int | None = None

    # ---- writing, and pausing when it fails
    def _pause(self, why: str) -> None:
        if self.paused is None:
            self.paused, self.paused_at = why, time.monotonic()
            self.pauses += 1
            self.next_probe = self.paused_at + RESUME_PROBE_S
            log.error("%s: issuing no jobs and accepting no messages until the state directory %s can be written "
                      "again (probed every %g s)", why, self.state_dir, RESUME_PROBE_S)

    def append(self, op: str, **body: Any) -> bool:
        """Journal one core input. False (nothing written, the input must not reach the core)
        while paused or if the write fails, which pauses."""
        if self.paused is not None:
            self.not_accepted += 1
            return False
        try:
            self.journal.append(op, **body)
            return True
        except OSError as e:
            self._pause(f"cannot write the journal {self.journal.path}: {_why(e)}")
            self.not_accepted += 1
            return False

    def record_message(self, core: Any, wid: str, msg: Any, frames: list, now: float, key: str = "",
                       wire: str | None = None, refused: bool = False, refusal: Any = None) -> bool:
        """Journal one message before the core sees it. Returns False if it could not be
        journaled (paused: the disk is full): then the core must not see it.

        ``wire``: for a reply that did not travel in the run's wire dtype (the same-host path
        exchanges float32 whatever the run's ``--wire-dtype``), the dtype it did travel in; then
        ``frames`` are float32. ``refused``: the transport refuses the reply (always journaled
        whole, so that recovery refuses it again; ``refusal``, when given, is kept in the record:
        a sharded server's shards refused the reply's gradient blocks, which the record does not
        hold). Messages are journaled re-encoded from their
        decoded fields (:func:`canonical_frames`): a heartbeat padded with 60 KB of unknown keys
        takes as little room as a plain one."""
        from protocol.messages import Reply

        if self.paused is not None:
            self.not_accepted += 1
            return False
        extra: dict[str, Any] = {} if wire is None else {"wire": wire}
        if refusal is not None:
            extra["refusal"] = [int(refusal[0]), str(refusal[1])]
        if isinstance(msg, Reply) and msg.block_sq is not None:  # a sharded coordinator's, from its shards
            extra["bsq"] = [float(v) for v in msg.block_sq]
        if isinstance(msg, Reply) and msg.step_sq is not None:  # likewise (lmo='l2')
            extra["ssq"] = [float(v) for v in msg.step_sq]
        if isinstance(msg, Reply) and not self.log_payloads and not refused and core.reply_verdict(wid, msg) != "bad":
            # Accepted (or ignored) replies travel without their gradients: recomputed from the seed.
            fields = {"job_id": msg.job_id, "created_at": msg.created_at, "loss": msg.loss, "count": msg.count,
                      "compute_s": msg.compute_s, "holds": list(msg.holds), **extra}
            return self.append("reply", wid=wid, now=now, reply=fields)
        if isinstance(msg, Reply) and msg.grads:  # its gradients may have been converted from the wire dtype
            kept = canonical_frames(frames)
        else:  # the daemon hands other messages to the core as decoded
            from protocol.codec import encode

            kept = [_frame_bytes(f) for f in encode(msg)]
        return self.append("msg", wid=wid, now=now, frames=kept, key=key, **extra)

    # ---- after each batch of messages: sync, checkpoints, the journal's bound, the probe
    @property
    def forced_checkpoint_bytes(self) -> int:
        """A checkpoint is forced once the current segment holds this many bytes (0: never)."""
        return self.max_journal_bytes // (self.keep + 1) if self.max_journal_bytes else 0

    def sync_due_in(self) -> float:
        """Seconds until :meth:`after_batch` has the journal's group commit to do (inf: none, or
        paused): the daemon's poll timeout is at most this, so ``--fsync batch`` syncs within
        ``BATCH_FSYNC_S`` of a record, not within one poll."""
        return math.inf if self.paused is not None else self.journal.sync_due_in()

    def after_batch(self, core: Any, now: float) -> None:
        if self.paused is not None:
            self._probe(core, now)
            return
        try:
            self.journal.maybe_sync()
        except OSError as e:
            self._pause(f"cannot sync the journal {self.journal.path}: {_why(e)}")
            return
        due_count = self.every and core.version - self.ckpt_version >= self.every
        due_time = self.interval_s and time.monotonic() - self.ckpt_time >= self.interval_s
        due_bytes = self.forced_checkpoint_bytes and self.journal.size >= self.forced_checkpoint_bytes
        if due_count or due_bytes or (due_time and core.version != self.ckpt_version):
            self.checkpoint(core)

    def checkpoint(self, core: Any) -> str | None:
        """Write a checkpoint of ``core`` (then rotate and trim the journal as its bound asks).
        Returns its path, or None if it could not be written (which pauses)."""
        t0 = time.monotonic()
        if not self.append("checkpoint", version=core.version):
            return None
        try:
            self.journal.sync()
            path = write_checkpoint(self.state_dir, self.journal.next_lsn - 1, core.snapshot(), keep=self.keep)
            self.ckpt_bytes = os.path.getsize(path)
        except OSError as e:
            self._pause(f"cannot write a checkpoint in {self.state_dir}: {_why(e)}")
            return None
        self.ckpt_version = core.version
        self.ckpt_time = time.monotonic()
        self.checkpoints += 1
        self._trim()
        self.checkpoint_s += time.monotonic() - t0
        return path

    def _trim(self) -> None:
        """Right after a checkpoint: start a new segment once the current one is big enough to be
        worth removing later, and remove covered segments while the journal is over its bound."""
        if not self.max_journal_bytes:
            return
        j = self.journal
        try:
            if j.size >= self.max_journal_bytes // (4 * (self.keep + 1)):
                j.rotate()
            # Room for the current segment to grow to a forced checkpoint's size without passing the bound.
            budget = self.max_journal_bytes - self.forced_checkpoint_bytes
            if j.total_bytes() > budget:
                kept = checkpoint_files(self.state_dir)
                if kept:
                    covered = kept[0][0] if self.retain_from is None else min(kept[0][0], self.retain_from - 1)
                    self.segments_removed += j.prune(covered, budget)
        except OSError as e:
            log.warning("cannot rotate or trim the journal in %s: %s", self.state_dir, _why(e))

    def _probe(self, core: Any, now: float) -> None:
        """While paused: resume once there is room again (free space for two checkpoints, and a
        ``resume`` record written)."""
        t = time.monotonic()
        if t < self.next_probe:
            return
        self.next_probe = t + RESUME_PROBE_S
        try:
            st = os.statvfs(self.state_dir)
            if st.f_bavail * st.f_frsize < max(RESUME_FREE_BYTES, 2 * self.ckpt_bytes):
                return
            self.journal.append("resume", now=now)  # synced by the next after_batch
        except OSError:
            return
        paused_s, why = t - self.paused_at, self.paused
        self.paused = None
        CoreInputs(core).resumed(now)  # what replaying the "resume" record does
        log.warning("the state directory %s is writable again after %.1f s paused (%s; %d messages were not "
                    "accepted meanwhile): training resumes", self.state_dir, paused_s, why, self.not_accepted)

    def status(self) -> dict[str, Any]:
        """Figures for ``latecomer status`` and the metrics: paused (and why), journal bytes."""
        out: dict[str, Any] = {"journal_bytes": self.journal.total_bytes()}
        if self.paused is not None:
            out.update({"paused": self.paused[:200], "paused_s": time.monotonic() - self.paused_at})
        return out

    def close(self) -> None:
        try:
            self.journal.close()
        except OSError as e:
            log.error("cannot sync the journal %s at exit: %s", self.journal.path, _why(e))
        finally:
            if self.lock is not None:
                self.lock.release()


# --------------------------------------------------------------------------- replay

def recompute_reply(core: Any, wid: str, fields: dict[str, Any], problem: Any, wire_dtype: str = "f32") -> Any:
    """Rebuild a journaled reply whose gradients were not logged, from the job's seed.

    Under a reduced-precision ``wire_dtype`` (PROTOCOL.md §6.12) the worker computed on the
    iterate as it travelled, ``roundtrip(x, wire)``, and the core applied its gradients as they
    travelled back, ``roundtrip(g, wire)``; both are reproduced here, bit for bit.
    """
    from protocol.messages import Job, JobKind, Reply
    from protocol.wire import check_wire, roundtrip
    from worker.compute import run_job

    check_wire(wire_dtype)
    entry = core.ledger.get(fields["job_id"])
    grads: tuple = ()
    block_sq = step_sq = None
    if entry is not None and entry.worker_id == wid and not entry.received and core.dim == 0:
        # A sharded server's coordinator holds no vector: the gradient of its empty iterate is empty
        # (the shards apply the blocks; ps/sharded/shard.py), and a norm over the blocks is the one its shards
        # measured, journaled with the reply. (A core with the whole vector measures it again.)
        n = 1 if entry.kind == JobKind.FULL_GRAD else len(entry.iterate_ids)
        grads = tuple(np.empty(0, core.dtype) for _ in range(n))
        block_sq, step_sq = journaled_norms(fields)
    elif entry is not None and entry.worker_id == wid and not entry.received:
        job = Job(job_id=entry.job_id, kind=entry.kind, created_at=entry.created_at, iterate_ids=entry.iterate_ids,
                  seed=entry.seed, batch_size=entry.batch_size, shard=entry.shard, deadline=entry.deadline)
        points = tuple(roundtrip(core.store[i], wire_dtype) for i in entry.iterate_ids)
        grads = tuple(roundtrip(g, wire_dtype) for g in run_job(job, points, problem).grads)
    return Reply(job_id=fields["job_id"], created_at=fields["created_at"], grads=grads, loss=fields["loss"],
                 count=fields["count"], compute_s=fields["compute_s"], holds=tuple(fields["holds"]),
                 block_sq=block_sq, step_sq=step_sq)


def reply_from_wire(msg: Any, wire_dtype: str) -> tuple[Any, Any]:
    """A decoded Reply's gradients back to float32, as the core must see them, and the refusal
    (code, text) when a frame is not in the wire dtype (PROTOCOL.md §6.12: BAD_SHAPE). The daemon
    and recovery both call this, so they refuse the same replies."""
    import dataclasses

    from protocol.messages import ErrorCode, Reply
    from protocol.wire import grads_from_wire

    if wire_dtype == "f32" or not isinstance(msg, Reply) or not msg.grads:
        return msg, None
    grads, why = grads_from_wire(msg.grads, wire_dtype)
    if why is not None:
        return msg, (ErrorCode.BAD_SHAPE, why[:1000])
    return dataclasses.replace(msg, grads=grads), None


def apply_record(core: Any, rec: Record, problem: Any, wire_dtype: str = "f32") -> list:
    """Feed one journal record to the core, exactly as the daemon did (ps/journal/inputs.py: the live
    run and replay call the same methods). Returns its commands."""
    return CoreInputs(core).apply(rec, problem, wire_dtype)


def apply_checked(core: Any, rec: Record, problem: Any, wire_dtype: str = "f32") -> list:
    """:func:`apply_record`, with whatever a damaged but well-formed record makes it raise (a
    message that no longer decodes, a counter that does not exist, ...) turned into a StateError
    naming the record's file and offset."""
    try:
        return apply_record(core, rec, problem, wire_dtype)
    except StateError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here is the record's: name it, one line
        log.debug("applying %s", rec.where(), exc_info=True)
        raise StateError(f"{rec.where()} cannot be applied: {type(e).__name__}: {e}") from None


def restore_checkpoint(restore: Any, state_dir: str, *, newest_first: bool = True,
                       min_lsn: int = -1) -> tuple[Any, int, str] | None:
    """The first checkpoint (newest first, or oldest first) with LSN >= ``min_lsn`` that
    verifies and restores: (core, its LSN, its path). A checkpoint that verifies but does not
    restore (a missing key, a wrong type, another algorithm) is skipped with a warning, like a
    corrupt one."""
    for lsn, snap, path in verified_checkpoints(state_dir, newest_first=newest_first):
        if lsn < min_lsn:
            continue
        try:
            return restore(snap), lsn, path
        except Exception as e:  # noqa: BLE001 - the snapshot's content is the file's, not ours
            log.warning("skipping checkpoint %s: it does not restore (%s: %s)", os.path.basename(path),
                        type(e).__name__, e)
    return None


def recover(core_factory: Any, restore: Any, state_dir: str, problem: Any,
            wire_dtype: str | None = None, *, repair: bool = False) -> tuple[Any, int, int]:
    """Newest usable checkpoint plus the journal after it (a server resuming). A torn tail is
    cut off the journal first, and leftover checkpoint temp files removed.

    Args:
        core_factory: (now=...) -> a fresh core (used when there is no usable checkpoint and the
            journal starts at LSN 0); called with the creation time the journal's ``start``
            record holds, when it holds one (clock-driven rounds start from it), else with no
            argument.
        restore: snapshot -> core.
        wire_dtype: the run's wire dtype; None: read it from ``run.json`` (``"f32"`` if absent).
        repair: first :func:`repair_journal`: keep the journal's valid prefix, move the rest
            aside (``serve --repair``); what it dropped is logged.
    Returns:
        (core, LSN of the last record applied, number of records replayed).
    Raises:
        StateError: a damaged journal (:class:`JournalDamaged`: a bad record that is not the
            journal's torn tail, or an LSN gap, between segments or between the checkpoint and
            the journal after it), or no checkpoint that covers where the journal starts.
    """
    wire_dtype = run_wire_dtype(read_run(state_dir)) if wire_dtype is None else wire_dtype
    for tmp in glob.glob(os.path.join(glob.escape(state_dir), "ckpt-*.bin.tmp")):
        os.remove(tmp)  # a crash while writing a checkpoint
    if repair:
        report = repair_journal(state_dir)
        if report is None:
            log.info("%s: the journal reads whole: nothing to repair", state_dir)
        else:
            log.warning("%s", report.text())
    cut_torn_tail(state_dir)
    first = first_journal_lsn(state_dir)
    found = restore_checkpoint(restore, state_dir)
    if found is None:
        if first not in (None, 0):
            raise StateError(f"{state_dir}: no usable checkpoint, and the journal starts at LSN {first} (the segments "
                             f"before it were removed): the run cannot be recovered")
        start_rec = run_start(state_dir)
        core = core_factory(now=start_rec["now"]) if start_rec is not None and "now" in start_rec \
            else core_factory()
        start, ckpt = 0, None
    else:
        core, lsn, path = found
        start, ckpt = lsn + 1, os.path.basename(path)
        if first is not None and first > start:
            raise StateError(f"{state_dir}: the journal starts at LSN {first}, after {ckpt} (LSN "
                             f"{lsn}): records {start}..{first - 1} are missing")
    last, n = _apply_tail(core, state_dir, start, ckpt, problem, wire_dtype)
    return core, last, n


def _apply_tail(core: Any, state_dir: str, start: int, ckpt: str | None, problem: Any,
                wire_dtype: str) -> tuple[int, int]:
    """Apply the journal's records from LSN ``start`` (right after checkpoint ``ckpt``, None: from
    the run's start), checking the journal reaches the checkpoint's own record and goes on at
    exactly ``start``. Returns (the last LSN applied, how many were)."""
    last, n, seen = start - 1, 0, -1
    for rec in read_journal(state_dir):
        seen = rec.lsn
        if rec.lsn < start:
            continue
        if rec.lsn != last + 1:  # read_journal's LSNs are consecutive: only the first one after a checkpoint
            raise JournalDamaged(rec.path, rec.offset, last + 1, last, f"has LSN {rec.lsn}, and {ckpt} is at LSN "
                                 f"{start - 1} (records are missing)")
        apply_checked(core, rec, problem, wire_dtype)
        core.drain_events()
        last, n = rec.lsn, n + 1
    if ckpt is not None and 0 <= seen < start - 1:
        raise StateError(f"{state_dir}: the journal ends at LSN {seen}, before {ckpt} (LSN {start - 1}, whose own "
                         f"record the journal must hold): records {seen + 1}..{start - 1} and any after them are "
                         f"missing (a segment removed?); `latecomer serve --state {state_dir} --repair` keeps the "
                         f"journal and moves the checkpoints past its end aside")
    return last, n
