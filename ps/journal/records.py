"""The journal's records: their framing on disk, the :class:`Record` read back, and what each
op's record must hold (:func:`check_record`: whatever is read back is validated field by field).

A record, in a segment ``wal-NNNNNN.log`` (ps/journal/segments.py)::

    u32 length | u32 crc32(body) | body = msgpack map {"lsn", "op", ...}

LSNs are consecutive across segments. A message is journaled as the core consumed it:
re-encoded from its decoded fields, so header keys the decoder ignores (padding, a later
version's extensions) never reach the disk (ps/journal/persistence.py). The ``start`` record
carries the time the run's core was created at, so replay and recovery create theirs at it
(clock-driven rounds fall where they fell).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

REC_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 31


@dataclass
class Record:
    lsn: int
    op: str
    body: dict[str, Any]
    path: str = ""  # the segment it was read from
    offset: int = 0  # its byte offset there

    def where(self) -> str:
        return f"{self.path}: record at byte {self.offset} (LSN {self.lsn}, {self.op})"


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


def check_record(rec: Any) -> str | None:
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
