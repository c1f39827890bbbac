"""Server persistence: a write-ahead journal of the core's inputs and atomic checkpoints.

Because :class:`ps.core.ServerCore` is a deterministic function of its inputs (decoded
messages, ``now`` values and a few driver decisions), the journal records *inputs*, not
effects: replaying it through a fresh core reproduces the run bit for bit. A checkpoint is a
snapshot of the core at a log sequence number (LSN); recovery = newest valid checkpoint +
the journal after it.

Journal record framing (one append-only file per server incarnation, ``wal-NNNNNN.log``)::

    u32 length | u32 crc32(body) | body = msgpack map {"lsn", "op", ...}

A torn or truncated tail is detected (short read or CRC mismatch in the last record), reported
and ignored. Checkpoint file (``ckpt-<lsn>.bin``, written to a temp file, fsynced, renamed,
directory fsynced)::

    b"LATECKPT1\\n" | u64 tree length | msgpack tree | array bytes ... | sha256 of all before

No pickle: trees are msgpack with arrays referenced by index.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack
import numpy as np

log = logging.getLogger("latecomer.persist")

CKPT_MAGIC = b"LATECKPT1\n"
REC_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 31
FSYNC_POLICIES = ("always", "batch", "never")
BATCH_FSYNC_S = 0.01  # group commit: at most this long between fsyncs under "batch"


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

def write_checkpoint(state_dir: str, lsn: int, snapshot: dict[str, Any], *, keep: int = 3) -> str:
    """Atomically write ``snapshot`` as ``ckpt-<lsn>.bin``; keep the newest ``keep``."""
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
    _fsync_dir(state_dir)
    for old in sorted(glob.glob(os.path.join(state_dir, "ckpt-*.bin")))[:-keep]:
        os.remove(old)
    return final


def read_checkpoint(path: str) -> tuple[int, dict[str, Any]]:
    """Read and verify one checkpoint file. Raises ValueError if it is corrupt."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < len(CKPT_MAGIC) + 8 + 32 or not data.startswith(CKPT_MAGIC):
        raise ValueError(f"{path}: not a checkpoint")
    if hashlib.sha256(data[:-32]).digest() != data[-32:]:
        raise ValueError(f"{path}: checksum mismatch")
    (n,) = struct.unpack_from("<Q", data, len(CKPT_MAGIC))
    start = len(CKPT_MAGIC) + 8
    try:
        head = msgpack.unpackb(data[start:start + n], raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"{path}: bad header ({e})") from None
    base = start + n
    arrays = []
    for dtype, shape, off, nbytes in head["arrays"]:
        a = np.frombuffer(data, dtype=np.dtype(dtype), count=nbytes // max(1, np.dtype(dtype).itemsize),
                          offset=base + off).reshape(shape).copy()
        arrays.append(a)
    return int(head["lsn"]), unpack_tree(head["tree"], arrays)


def latest_checkpoint(state_dir: str) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint that verifies; corrupt ones are skipped with a warning."""
    for path in sorted(glob.glob(os.path.join(state_dir, "ckpt-*.bin")), reverse=True):
        try:
            return read_checkpoint(path)
        except (ValueError, OSError) as e:
            log.warning("skipping corrupt checkpoint %s: %s", os.path.basename(path), e)
    return None


# --------------------------------------------------------------------------- journal

@dataclass
class Record:
    lsn: int
    op: str
    body: dict[str, Any]


class Journal:
    """Append-only journal of one server incarnation (``wal-NNNNNN.log``)."""

    def __init__(self, state_dir: str, *, next_lsn: int, fsync: str = "batch") -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.fsync = fsync
        segments = sorted(glob.glob(os.path.join(state_dir, "wal-*.log")))
        n = int(os.path.basename(segments[-1])[4:10]) + 1 if segments else 1
        self.path = os.path.join(state_dir, f"wal-{n:06d}.log")
        # Unbuffered: every record reaches the OS before the core acts on it, so a killed process
        # never leaves effects (events, messages) that its journal lacks; fsync is the policy's.
        self.f = open(self.path, "ab", buffering=0)
        _fsync_dir(state_dir)
        self.next_lsn = next_lsn
        self.dirty = False
        self.last_sync = time.monotonic()
        self.bytes_written = 0

    def append(self, op: str, **body: Any) -> int:
        lsn = self.next_lsn
        data = msgpack.packb({"lsn": lsn, "op": op, **body}, use_bin_type=True)
        self.f.write(REC_HEADER.pack(len(data), zlib.crc32(data)) + data)
        self.bytes_written += len(data) + REC_HEADER.size
        self.next_lsn += 1
        self.dirty = True
        if self.fsync == "always":
            self.sync()
        return lsn

    def sync(self) -> None:
        if self.dirty:
            if self.fsync != "never":
                os.fsync(self.f.fileno())
            self.dirty = False
        self.last_sync = time.monotonic()

    def maybe_sync(self) -> None:
        """Group commit: flush and fsync if the batch window has passed."""
        if self.dirty and (self.fsync != "batch" or time.monotonic() - self.last_sync >= BATCH_FSYNC_S):
            self.sync()

    def close(self) -> None:
        self.sync()
        self.f.close()


def read_journal(state_dir: str, *, from_lsn: int = 0) -> Iterator[Record]:
    """Records of every segment in order, from ``from_lsn``. A torn tail of a segment (short
    or corrupt last bytes) is reported once and skipped; reading continues with the next
    segment (the next incarnation started after the crash)."""
    for path in sorted(glob.glob(os.path.join(state_dir, "wal-*.log"))):
        with open(path, "rb") as f:
            data = f.read()
        off = 0
        while off < len(data):
            if off + REC_HEADER.size > len(data):
                log.warning("%s: torn record at byte %d (short header): ignored", os.path.basename(path), off)
                break
            n, crc = REC_HEADER.unpack_from(data, off)
            body = data[off + REC_HEADER.size: off + REC_HEADER.size + n]
            if n > MAX_RECORD_BYTES or len(body) != n or zlib.crc32(body) != crc:
                log.warning("%s: torn or corrupt record at byte %d: ignored with the rest of the segment",
                            os.path.basename(path), off)
                break
            rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
            off += REC_HEADER.size + n
            if rec["lsn"] >= from_lsn:
                yield Record(rec["lsn"], rec["op"], rec)


def last_lsn(state_dir: str) -> int:
    """The highest LSN in the journal (-1 if empty)."""
    last = -1
    for rec in read_journal(state_dir):
        last = rec.lsn
    return last


# --------------------------------------------------------------------------- run description

DEFAULT_WIRE_DTYPE = "f32"  # state directories written before --wire-dtype existed


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


def read_run(state_dir: str) -> dict[str, Any] | None:
    """The run description of ``state_dir`` (None if there is none); ``wire_dtype`` is filled in
    with ``"f32"`` when the file predates it."""
    path = os.path.join(state_dir, "run.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    run["wire_dtype"] = run_wire_dtype(run)
    return run


# --------------------------------------------------------------------------- the daemon's side

def _frame_bytes(f: Any) -> bytes:
    b = getattr(f, "bytes", None)  # zmq.Frame
    return b if b is not None else bytes(f)


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
    """

    def __init__(self, state_dir: str, journal: Journal, *, checkpoint_every: int = 1000,
                 checkpoint_interval_s: float = 30.0, log_payloads: bool = False, keep: int = 3) -> None:
        self.state_dir = state_dir
        self.journal = journal
        self.every = checkpoint_every
        self.interval_s = checkpoint_interval_s
        self.log_payloads = log_payloads
        self.keep = keep
        self.wire_dtype = "f32"  # the run's --wire-dtype (from run.json)
        self.ckpt_version = -1
        self.ckpt_time = time.monotonic()
        self.checkpoints = 0
        self.checkpoint_s = 0.0

    def record_message(self, core: Any, wid: str, msg: Any, frames: list, now: float, key: str = "",
                       wire: str | None = None, refused: bool = False) -> None:
        """Journal one message before the core sees it.

        ``wire``: for a reply that did not travel in the run's wire dtype (the same-host path
        exchanges float32 whatever the run's ``--wire-dtype``), the dtype it did travel in; then
        ``frames`` are float32. ``refused``: the transport refuses the reply (always journaled
        whole, so that recovery refuses it again)."""
        from protocol.messages import Reply

        extra = {} if wire is None else {"wire": wire}
        if isinstance(msg, Reply) and not self.log_payloads and not refused and core.reply_verdict(wid, msg) != "bad":
            # Accepted (or ignored) replies travel without their gradients: recomputed from the seed.
            fields = {"job_id": msg.job_id, "created_at": msg.created_at, "loss": msg.loss, "count": msg.count,
                      "compute_s": msg.compute_s, "holds": list(msg.holds), **extra}
            self.journal.append("reply", wid=wid, now=now, reply=fields)
        else:
            self.journal.append("msg", wid=wid, now=now, frames=[_frame_bytes(f) for f in frames], key=key, **extra)

    def after_batch(self, core: Any, now: float) -> None:
        self.journal.maybe_sync()
        due_count = self.every and core.version - self.ckpt_version >= self.every
        due_time = self.interval_s and time.monotonic() - self.ckpt_time >= self.interval_s
        if due_count or (due_time and core.version != self.ckpt_version):
            self.checkpoint(core)

    def checkpoint(self, core: Any) -> str:
        t0 = time.monotonic()
        self.journal.append("checkpoint", version=core.version)
        self.journal.sync()
        path = write_checkpoint(self.state_dir, self.journal.next_lsn - 1, core.snapshot(), keep=self.keep)
        self.ckpt_version = core.version
        self.ckpt_time = time.monotonic()
        self.checkpoints += 1
        self.checkpoint_s += self.ckpt_time - t0
        return path

    def close(self) -> None:
        self.journal.close()


# --------------------------------------------------------------------------- replay

def recompute_reply(core: Any, wid: str, fields: dict[str, Any], problem: Any, wire_dtype: str = "f32") -> Any:
    """Rebuild a journaled reply whose gradients were not logged, from the job's seed.

    Under a reduced-precision ``wire_dtype`` (PROTOCOL.md §6.12) the worker computed on the
    iterate as it travelled, ``roundtrip(x, wire)``, and the core applied its gradients as they
    travelled back, ``roundtrip(g, wire)``; both are reproduced here, bit for bit.
    """
    from protocol.messages import Job, Reply
    from protocol.wire import check_wire, roundtrip
    from worker.compute import run_job

    check_wire(wire_dtype)
    entry = core.ledger.get(fields["job_id"])
    grads: tuple = ()
    if entry is not None and entry.worker_id == wid and not entry.received:
        job = Job(job_id=entry.job_id, kind=entry.kind, created_at=entry.created_at, iterate_ids=entry.iterate_ids,
                  seed=entry.seed, batch_size=entry.batch_size, shard=entry.shard, deadline=entry.deadline)
        points = tuple(roundtrip(core.store[i], wire_dtype) for i in entry.iterate_ids)
        grads = tuple(roundtrip(g, wire_dtype) for g in run_job(job, points, problem).grads)
    return Reply(job_id=fields["job_id"], created_at=fields["created_at"], grads=grads, loss=fields["loss"],
                 count=fields["count"], compute_s=fields["compute_s"], holds=tuple(fields["holds"]))


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
    """Feed one journal record to the core, exactly as the daemon did. Returns its commands.

    ``wire_dtype``: the run's (:func:`run_wire_dtype`); journaled reply frames are converted
    from it and recomputed gradients are quantized to it, as on the live run.
    """
    from protocol.codec import decode

    b = rec.body
    op = rec.op
    if op == "msg":
        msg, refusal = reply_from_wire(decode(b["frames"]), b.get("wire", wire_dtype))
        return core.handle(b["wid"], msg, b["now"], b.get("key", ""), refusal)
    if op == "reply":
        wire = b["reply"].get("wire", wire_dtype)
        return core.handle(b["wid"], recompute_reply(core, b["wid"], b["reply"], problem, wire), b["now"])
    if op == "tick":
        return core.on_tick(b["now"])
    if op == "remove":
        return core.remove_worker(b["wid"], b["now"], reason=b["reason"])
    if op == "count":
        setattr(core.counters, b["kind"], getattr(core.counters, b["kind"]) + 1)
    elif op == "invalid":  # older journals
        core.counters.invalid += 1
    elif op == "stop_issuing":
        core.issuing = False
    elif op == "restart":
        core.issuing = True
        core.rebase_clock(b["now"])
    elif op not in ("start", "checkpoint"):
        raise ValueError(f"unknown journal record {op!r} at LSN {rec.lsn}")
    return []


def recover(core_factory: Any, restore: Any, state_dir: str, problem: Any,
            wire_dtype: str | None = None) -> tuple[Any, int, int]:
    """Newest valid checkpoint plus the journal after it.

    Args:
        core_factory: () -> a fresh core (used when there is no checkpoint).
        restore: snapshot -> core.
        wire_dtype: the run's wire dtype; None: read it from ``run.json`` (``"f32"`` if absent).
    Returns:
        (core, LSN of the last record applied, number of records replayed).
    """
    wire_dtype = run_wire_dtype(read_run(state_dir)) if wire_dtype is None else wire_dtype
    ck = latest_checkpoint(state_dir)
    if ck is None:
        core, start = core_factory(), 0
    else:
        lsn, snap = ck
        core, start = restore(snap), lsn + 1
    last, n = start - 1, 0
    for rec in read_journal(state_dir, from_lsn=start):
        apply_record(core, rec, problem, wire_dtype)
        core.drain_events()
        last, n = rec.lsn, n + 1
    return core, last, n
