"""A journaled reply turned back into the :class:`~protocol.messages.Reply` the core saw: its
gradients converted from the wire dtype (:func:`reply_from_wire`, which the transport calls on
live replies too, so the two refuse the same ones), or recomputed from the job's seed when the
journal kept none (:func:`recompute_reply`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ps.journal.records import journaled_norms


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
