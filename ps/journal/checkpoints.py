"""Checkpoints: a snapshot of the core at a log sequence number (LSN), written atomically and
verified when read back. Recovery = newest valid checkpoint + the journal after it
(ps/journal/recovery.py).

Checkpoint file (``ckpt-<lsn>.bin``, written to a temp file, fsynced, renamed, directory
fsynced)::

    b"LATECKPT1\\n" | u64 tree length | msgpack tree | array bytes ... | sha256 of all before

No pickle: trees are msgpack with arrays referenced by index (:func:`pack_tree`), array dtypes
from an allow-list. A damaged checkpoint is skipped for the previous one.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import math
import os
import re
import struct
from typing import Any, Iterator

import msgpack
import numpy as np

from ps.journal.statedir import fsync_dir
from ps.journal.statefiles import check_tree_depth

log = logging.getLogger("latecomer.persist")  # one logger for the state directory (its name predates the split)

CKPT_MAGIC = b"LATECKPT1\n"
KEEP_CHECKPOINTS = 3
_CKPT_NAME = re.compile(r"ckpt-(\d+)\.bin")


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
    """The structure :func:`pack_tree` packed. Its depth is checked first (iteratively, up to
    ``MAX_TREE_DEPTH``) so that the recursive decoding below cannot be made to overflow the stack
    by a crafted checkpoint: ValueError, like any other malformed tree."""
    check_tree_depth(tree)

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
    fsync_dir(state_dir)
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
