"""Recovery: the newest usable checkpoint plus the journal after it, fed to the core through
:class:`~ps.journal.inputs.CoreInputs` as the live run fed it (:func:`recover`); a server
resuming and ``latecomer replay`` both start here.

Because :class:`ps.core.server_core.ServerCore` is a deterministic function of its inputs (decoded
messages, ``now`` values and a few driver decisions), the journal records *inputs*, not
effects: replaying it through a fresh core reproduces the run bit for bit. A damaged journal
record or run description is a one-line :class:`~ps.journal.statedir.StateError`.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

from ps.journal.checkpoints import verified_checkpoints
from ps.journal.inputs import CoreInputs
from ps.journal.records import Record
from ps.journal.repair import repair_journal
from ps.journal.runfile import read_run, run_wire_dtype
from ps.journal.segments import JournalDamaged, cut_torn_tail, first_journal_lsn, read_journal, run_start
from ps.journal.statedir import StateError

log = logging.getLogger("latecomer.persist")  # one logger for the state directory (its name predates the split)


def apply_record(core: Any, rec: Record, problem: Any, wire_dtype: str = "f32", inputs: Any = None) -> list:
    """Feed one journal record to the core, exactly as the daemon did (ps/journal/inputs.py: the live
    run and replay call the same methods). Returns its commands. ``inputs``: a :class:`CoreInputs`
    of ``core`` that takes gradients from elsewhere (a sharded run's blocks), else the default."""
    return (inputs or CoreInputs(core)).apply(rec, problem, wire_dtype)


def apply_checked(core: Any, rec: Record, problem: Any, wire_dtype: str = "f32", inputs: Any = None) -> list:
    """:func:`apply_record`, with whatever a damaged but well-formed record makes it raise (a
    message that no longer decodes, a counter that does not exist, ...) turned into a StateError
    naming the record's file and offset."""
    try:
        return apply_record(core, rec, problem, wire_dtype, inputs)
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
