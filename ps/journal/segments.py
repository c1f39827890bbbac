"""The journal's files, read back: segments ``wal-NNNNNN.log`` (a new one per server
incarnation, and after a checkpoint once the current one is big enough; ps/journal/wal.py writes
them), scanned record by record (:func:`scan_segment`) and read in order across segments
(:func:`read_journal`).

A torn tail (the last record of the journal cut short or garbled by a crash) is reported and
ignored, and cut off when a server resumes (:func:`cut_torn_tail`), so it only ever sits at the
end of the last segment (or of a segment followed by a ``restart`` at the LSN it would have had,
in directories written before that rule); a bad record anywhere else, or an LSN gap, is an error
(:class:`JournalDamaged`) naming the file, the byte offset and the LSN, never silently dropped,
and ps/journal/repair.py (``serve --repair``) keeps the valid prefix and moves the rest aside.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack

from ps.journal.records import MAX_RECORD_BYTES, REC_HEADER, Record, check_record
from ps.journal.statedir import StateError

log = logging.getLogger("latecomer.persist")  # one logger for the state directory (its name predates the split)

_SEGMENT_NAME = re.compile(r"wal-(\d+)\.log")


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


def first_record(path: str) -> dict | None:
    """A segment's first record (its decoded body), or None (empty, or its first record is
    unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(REC_HEADER.size)
            if len(head) < REC_HEADER.size:
                return None
            n, crc = REC_HEADER.unpack(head)
            if n > min(MAX_RECORD_BYTES, os.fstat(f.fileno()).st_size - REC_HEADER.size):
                return None  # checked before reading: f.read(n) would allocate all n bytes a crafted header asks for
            body = f.read(n)
        if len(body) != n or zlib.crc32(body) != crc:
            return None
        rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (OSError, ValueError, msgpack.UnpackException):
        return None
    return rec if type(rec) is dict and type(rec.get("lsn")) is int else None


def first_lsn(path: str) -> int | None:
    """The LSN of a segment's first record, or None (empty, or its first record is unreadable)."""
    rec = first_record(path)
    return None if rec is None else rec["lsn"]


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
class ScanStop:
    """Where a segment stops reading: its offset, why, and whether it is a torn tail (the
    segment's last record cut short or garbled, nothing that reads after it)."""

    offset: int
    why: str
    torn: bool
    lsn: int | None = None  # the LSN the bad record carries, when it reads at all


_LSN_KEY = b"\xa3lsn"  # every record's body is a msgpack map whose first key is "lsn"
_UINT = {0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8}  # msgpack's unsigned ints: their first byte -> value bytes
RESYNC_WORK = 4  # resynchronising checksums and decodes at most this many times a segment's size ...
RESYNC_CANDIDATE_COST = 256  # ... charging each candidate record this many bytes besides its body


class ResyncExhausted(Exception):
    """Resynchronising after a bad record spent its :class:`ResyncBudget`: the bytes after it hold
    more record-like candidates than a segment written by a crash could (a torn tail is one record
    cut short), so they are treated as damage, never as a torn tail that may be cut off."""


class ResyncBudget:
    """The work resynchronising over one segment's bytes may do (checksummed and decoded bytes,
    plus :data:`RESYNC_CANDIDATE_COST` per candidate), shared by every resync over those bytes,
    so that it is linear in the segment's size: a crafted segment of overlapping candidates, each
    claiming a length to the end of the file, would otherwise be checksummed in quadratic time."""

    def __init__(self, size: int) -> None:
        self.left = RESYNC_WORK * size + 64 * RESYNC_CANDIDATE_COST

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ResyncExhausted


def _candidate_lsn(data: bytes, i: int) -> int | None:
    """The LSN right after the ``"lsn"`` key at ``i`` (a msgpack unsigned int), read without
    decoding the record: None if it is not one."""
    j = i + len(_LSN_KEY)
    if j >= len(data):
        return None
    b = data[j]
    if b < 0x80:
        return b
    size = _UINT.get(b)
    return int.from_bytes(data[j + 1:j + 1 + size], "big") if size and j + 1 + size <= len(data) else None


def record_at(data: bytes, off: int, budget: ResyncBudget | None = None) -> dict | None:
    """The journal record that starts at ``off`` (checksum, msgpack and fields good), or None.
    With ``budget``, the bytes checksummed and decoded are charged to it (before the work)."""
    if off < 0 or off + REC_HEADER.size > len(data):
        return None
    n, crc = REC_HEADER.unpack_from(data, off)
    end = off + REC_HEADER.size + n
    if n > MAX_RECORD_BYTES or end > len(data):
        return None
    body = memoryview(data)[off + REC_HEADER.size:end]
    if budget is not None:
        budget.spend(n)
    if zlib.crc32(body) != crc:
        return None
    if budget is not None:
        budget.spend(n)
    try:
        rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return rec if check_record(rec) is None else None


def resync(data: bytes, off: int, after_lsn: int, budget: ResyncBudget | None = None) -> int | None:
    """The offset of the first whole journal record after ``off`` whose LSN is above
    ``after_lsn`` (None: none). A cut-short tail is a prefix of one record, so a record that
    reads after it means the bytes at ``off`` are damage, not a torn tail.

    Linear in ``len(data)``: a candidate's header is checked first (its LSN above ``after_lsn``,
    its length within the file), and what is checksummed and decoded is charged to ``budget``
    (default: a new :class:`ResyncBudget`). Raises :class:`ResyncExhausted` when it is spent."""
    budget = budget if budget is not None else ResyncBudget(len(data))
    i = data.find(_LSN_KEY, off + 1 + REC_HEADER.size)
    while i >= 0:
        budget.spend(RESYNC_CANDIDATE_COST)
        p = i - REC_HEADER.size - 1  # the header, then the map's first byte, then "lsn"
        lsn = _candidate_lsn(data, i)
        if p > off and lsn is not None and lsn > after_lsn and 0x80 <= data[p + REC_HEADER.size] <= 0x8f:
            rec = record_at(data, p, budget)
            if rec is not None and rec["lsn"] > after_lsn:
                return p
        i = data.find(_LSN_KEY, i + 1)
    return None


def scan_segment(path: str, data: bytes, start: int = 0, budget: ResyncBudget | None = None
                 ) -> tuple[list[tuple[int, dict]], ScanStop | None]:
    """The records of one segment as (offset, body), from byte ``start``, up to where it stops
    reading (None: it reads to its end). A record cut short or garbled with nothing that reads
    after it is a torn tail; anything else that stops the reading is damage. ``budget``: what
    resynchronising may spend (:func:`resync`; shared by the calls of a repair)."""
    out: list[tuple[int, dict]] = []
    off = start
    while off < len(data):
        last = out[-1][1]["lsn"] if out else -1
        if off + REC_HEADER.size > len(data):
            return out, ScanStop(off, "is cut short (a short header)", True)
        n, crc = REC_HEADER.unpack_from(data, off)
        end = off + REC_HEADER.size + n
        if n > MAX_RECORD_BYTES or end > len(data):
            return out, _overlong(data, off, n, last, budget)
        body = data[off + REC_HEADER.size:end]
        if budget is not None:  # a repair's count: every byte checked is charged (linear in all)
            budget.spend(n)
        if zlib.crc32(body) != crc:
            if end == len(data):
                return out, ScanStop(off, "fails its checksum (the segment's last record)", True)
            return out, ScanStop(off, f"fails its checksum, with {len(data) - end} bytes of records after it", False)
        try:
            rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            return out, ScanStop(off, f"is not msgpack ({type(e).__name__})", False)
        why = check_record(rec)
        if why is not None:
            lsn = rec.get("lsn") if type(rec) is dict and type(rec.get("lsn")) is int else None
            return out, ScanStop(off, f"is not a journal record: {why}", False, lsn)
        out.append((off, rec))
        off = end
    return out, None


def _overlong(data: bytes, off: int, n: int, last: int, budget: ResyncBudget | None) -> ScanStop:
    """Where a record whose length runs past the end of the file stops the reading: a torn tail,
    unless a record reads after it (or more candidates than resynchronising may check follow)."""
    try:
        if resync(data, off, last, budget) is None:
            return ScanStop(off, "is cut short", True)
        after = "with records after it"
    except ResyncExhausted:
        after = "with more record-like bytes after it than a torn record holds"
    return ScanStop(off, f"has a length ({n} bytes) that runs past the end of the file, {after}", False)


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
    torn: tuple[str, ScanStop, int | None] | None = None
    prev: int | None = None
    for number, path in journal_segments(state_dir):
        records, bad = scan_segment(path, _segment_data(path, state_dir))
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
        _, bad = scan_segment(path, data)
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
        first = first_lsn(path)
        if first is not None:
            return first
        if os.path.getsize(path):  # its first record does not read: damaged, or a torn tail alone
            with open(path, "rb") as f:
                records, _ = scan_segment(path, f.read())
            if records:
                return records[0][1]["lsn"]
    return None


def run_start(state_dir: str) -> dict[str, Any] | None:
    """The journal's ``start`` record (LSN 0), or None (none, or the journal's head removed).
    Its ``now`` is the time the run's core was created with (absent in journals written before
    it was recorded)."""
    for _, path in journal_segments(state_dir):
        rec = first_record(path)
        if rec is not None:
            return rec if rec["lsn"] == 0 and rec.get("op") == "start" and check_record(rec) is None else None
        if os.path.getsize(path):
            return None
    return None


def last_lsn(state_dir: str) -> int:
    """The highest LSN in the journal (-1 if empty)."""
    last = -1
    for rec in read_journal(state_dir):
        last = rec.lsn
    return last
