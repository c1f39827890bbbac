"""The gradients of a sharded run that logged its payloads (``serve --shards N --log-payloads``),
for replay: each shard's blocks journal (``<shard state>/blocks/``) holds every gradient block a
worker sent it, and a reply's gradient is its blocks concatenated in shard order. Replay takes
these instead of recomputing the gradients with the problem's oracle, so a run whose workers'
gradients the oracle cannot reproduce (a GPU, another language, another sampler) replays bit for
bit. ``serve --shards N`` keeps its local shards' state in ``<state>/shard-<i>``; remote shards'
directories are named to ``latecomer replay --shard-state``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from protocol.codec import decode
from protocol.messages import Reply
from ps.journal.inputs import CoreInputs
from ps.journal.replies import reply_from_wire
from ps.journal.segments import read_journal
from ps.journal.statedir import StateError


def shard_block_dirs(state_dir: str, n: int, shard_dirs: tuple = ()) -> list[str]:
    """The blocks journal of each of the run's ``n`` shards: ``shard_dirs`` in slot order, else the
    local shards' ``<state>/shard-<i>``. One line of error when one is missing."""
    dirs = list(shard_dirs) or [os.path.join(state_dir, f"shard-{i}") for i in range(n)]
    if len(dirs) != n:
        raise StateError(f"the run has {n} shards and {len(dirs)} shard state directories were named (--shard-state, "
                         f"in slot order)")
    out = [os.path.join(d, "blocks") for d in dirs]
    for i, d in enumerate(out):
        if not os.path.isdir(d):
            raise StateError(f"shard {i}'s blocks journal {d} is missing: a run that logs payloads replays from its "
                             f"shards' blocks (name remote shards' state directories with --shard-state)")
    return out


def read_blocks(block_dirs: list[str]) -> list[dict[tuple[int, int], tuple]]:
    """Per shard, {(job_id, created_at): gradient slices (float32 values of the wire dtype)}."""
    shards = []
    for d in block_dirs:
        blocks: dict[tuple[int, int], tuple] = {}
        for rec in read_journal(d, from_lsn=0):
            if rec.op != "block":
                continue
            msg, why = reply_from_wire(decode(rec.body["frames"]), rec.body.get("wire", "f32"))
            if why is None:
                blocks[(rec.body["job_id"], rec.body["created_at"])] = tuple(np.asarray(g) for g in msg.grads)
        shards.append(blocks)
    return shards


class BlockInputs(CoreInputs):
    """The coordinator's records fed to one unsharded core, each accepted reply's gradient made of
    the blocks its shards journaled (not recomputed)."""

    def __init__(self, core: Any, blocks: list[dict[tuple[int, int], tuple]]) -> None:
        super().__init__(core)
        self.blocks = blocks

    def recompute(self, core: Any, wid: str, fields: dict, problem: Any, wire: str) -> Any:
        jid, created_at = fields["job_id"], fields["created_at"]
        entry = core.ledger.get(jid)
        grads: tuple = ()
        if entry is not None and entry.worker_id == wid and not entry.received and entry.created_at == created_at:
            pieces = [b.get((jid, created_at)) for b in self.blocks]
            missing = [i for i, p in enumerate(pieces) if p is None]
            if missing:
                raise StateError(f"job {jid} was accepted, and the blocks journal of shard(s) "
                                 f"{','.join(map(str, missing))} has no block of it")
            grads = tuple(np.concatenate([p[k] for p in pieces]).astype(np.float32, copy=False)
                          for k in range(len(pieces[0])))
        return Reply(job_id=jid, created_at=created_at, grads=grads, loss=fields["loss"], count=fields["count"],
                     compute_s=fields["compute_s"], holds=tuple(fields["holds"]))
