"""The coordinator's journal records on their way to its shards.

Owns the tap on the journal (the records written lately, held in memory for the shards that
keep up), reading older records back from the journal's segments for a shard further behind,
the batches and the window of records in flight to each shard, the keepalive that tells a
shard the coordinator lives, and which segments the journal keeps for the shards' oldest
checkpoints. Records go out in LSN order and never past the journal's durable LSN, so a
coordinator that crashes and recovers never finds a shard ahead of its journal (see
ps/sharded/hub.py).
"""

from __future__ import annotations

from typing import Any, Callable

import msgpack

from ps.journal.segments import read_journal
from ps.sharded.control import pack
from ps.sharded.hub_table import Slot

WINDOW = 4096  # records shipped to a shard beyond what it has applied, at most
BATCH_RECORDS = 512  # records per message ...
BATCH_BYTES = 8 << 20  # ... and bytes
KEEPALIVE_S = 0.5  # an empty records message at least this often (the shard's liveness of us)
TAP_MAX = 65536  # records held in memory for live shards; one further behind reads the journal


class RecordStream:
    """Ships the journal of ``persist`` to the shards' slots through ``send(rid, header, frames)``
    (False: not sent; the records are read again from the slot's next LSN)."""

    def __init__(self, persist: Any, send: Callable[..., bool]) -> None:
        self.persist, self.state_dir, self.send = persist, persist.state_dir, send
        self.tap: list[tuple[int, bytes]] = []
        persist.journal.tap = self.tap
        persist.retain_from = 0  # every record is kept until the shards say which they still need

    def ship_to(self, slot: Slot, now: float, durable: int) -> None:
        """Records up to ``durable`` to a joined shard, its window allowing; else a keepalive when due."""
        limit = min(durable, slot.applied + WINDOW)
        frames: list = []
        if slot.next <= limit:
            frames = self._from_tap(slot, limit) or self._from_disk(slot, limit)
        if frames or now - slot.last_sent >= KEEPALIVE_S:
            if self.send(slot.rid, pack("recs", first=slot.next, count=len(frames)), frames):
                slot.next += len(frames)
                slot.last_sent = now
            elif frames:
                slot.reader, slot.peek = None, None  # not sent: read again from slot.next

    def _from_tap(self, slot: Slot, limit: int) -> list:
        tap = self.tap
        if not tap or tap[0][0] > slot.next:
            return []
        i = slot.next - tap[0][0]
        out, size = [], 0
        while i < len(tap) and tap[i][0] <= limit and len(out) < BATCH_RECORDS and size < BATCH_BYTES:
            out.append(tap[i][1])
            size += len(tap[i][1])
            i += 1
        if out:
            slot.reader, slot.peek = None, None
        return out

    def _from_disk(self, slot: Slot, limit: int) -> list:
        out, size = [], 0
        while len(out) < BATCH_RECORDS and size < BATCH_BYTES:
            rec = slot.peek
            slot.peek = None
            if rec is None:
                if slot.reader is None:
                    slot.reader = read_journal(self.state_dir, from_lsn=slot.next + len(out))
                rec = next(slot.reader, None)
                if rec is None:
                    slot.reader = None
                    break
            if rec.lsn < slot.next + len(out):
                continue
            if rec.lsn > limit:
                slot.peek = rec
                break
            data = msgpack.packb(rec.body, use_bin_type=True)
            out.append(data)
            size += len(data)
        return out

    def trim(self, slots: list[Slot]) -> None:
        """Forget the tapped records every live shard has been sent (in cuts of more than 1024)."""
        tap = self.tap
        if not tap:
            return
        live = [s.next for s in slots if s.connected]
        keep_from = min(live) if live else tap[-1][0] + 1
        cut = max(0, min(len(tap), keep_from - tap[0][0]), len(tap) - TAP_MAX)
        if cut > 1024 or (cut and cut == len(tap)):
            del tap[:cut]

    def retain(self, slots: list[Slot]) -> None:
        """The journal keeps the segments the shards' oldest checkpoints still need (all, until every
        shard has one)."""
        ckpts = [s.ckpt for s in slots]
        self.persist.retain_from = max(0, min(ckpts)) if all(c >= 0 for c in ckpts) else 0

    def close(self) -> None:
        self.persist.journal.tap = None
