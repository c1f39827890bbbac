"""Repairing a damaged journal (``serve --state DIR --repair``): keep its valid prefix and move
the rest aside into ``DIR/damaged-<UTC time>/``, deleting nothing (:func:`repair_journal`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ps.journal.checkpoints import checkpoint_files, verified_checkpoints
from ps.journal.segments import (
    JournalDamaged,
    ResyncBudget,
    ResyncExhausted,
    first_journal_lsn,
    journal_segments,
    read_journal,
    record_at,
    resync,
    scan_segment,
)
from ps.journal.statedir import StateError, fsync_dir


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
    that do not read; in linear time (one :class:`ResyncBudget` for all of ``data``: once it is
    spent, the count stops there)."""
    lsns: list[int] = []
    budget = ResyncBudget(len(data))
    p: int | None = off
    try:
        while p is not None and p < len(data):
            records, bad = scan_segment("", data, p, budget)
            lsns += [r["lsn"] for _, r in records]
            if bad is None:
                break
            p = resync(data, bad.offset, lsns[-1] if lsns else after_lsn, budget)
    except ResyncExhausted:
        pass  # what was counted so far: the report says "as far as they read"
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
    fsync_dir(dest)
    fsync_dir(state_dir)
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
        head = record_at(data, damage.offset)  # the damaged record itself may read (a gap, a bad field)
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
