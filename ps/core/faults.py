"""Worker faults: what the core does about a worker that errs. A failed job (``err
COMPUTE_FAILED``) is settled as failed, and a worker that fails ``max_failed_jobs`` in a row is
benched (no jobs until a hello or a success); a missing iterate (``err MISSING_ITERATE``) makes
the job be sent again, within bounds; other errs are recorded, writing off the job they name; a
worker with ``max_bad_replies`` invalid replies in a row is quarantined.

The ``core`` argument below is a :class:`ps.core.server_core.ServerCore`."""

from __future__ import annotations

from typing import Any

from protocol.messages import Bye, Cancel, Error, ErrorCode
from ps.core.commands import Command, Disconnect, Send
from ps.core.dispatch import job_message
from ps.core.ledger import LedgerEntry
from ps.core.settlement import settle, write_off
from ps.core.workers import WorkerInfo, reindex


def on_error(core: Any, w: WorkerInfo, err: Error, now: float) -> list[Command]:
    """An ``err`` from a joined worker (other than MISSING_ITERATE). COMPUTE_FAILED for a job
    outstanding at it: the job is settled as failed (:func:`fail_job`). PROBLEM_UNAVAILABLE: the
    worker cannot load the problem (it is leaving; an event carries its reason). Any other
    code naming a job outstanding at it: the job is written off as lost, and it counts toward
    the worker's failures in a row like a failed job (so an err per job cannot make the server
    send a job, with its iterate, per 50-byte err without bound: benched after
    ``max_failed_jobs``). Either way its credit slot frees up and the algorithm is told; an err
    naming no such job settles nothing."""
    entry = core.ledger.get(err.job_id) if err.job_id is not None else None
    mine = entry is not None and entry.worker_id == w.worker_id and not entry.received
    if err.code == ErrorCode.COMPUTE_FAILED and mine:
        return fail_job(core, w, entry, err.message, now) + core.dispatch(now)
    if err.code == ErrorCode.PROBLEM_UNAVAILABLE:
        w.last_error = f"cannot load problem {core.cfg.problem}: {err.message}"
        core.events.append({"ev": "problem_unavailable", "worker_id": w.worker_id, "problem": core.cfg.problem,
                            "message": err.message, "t": now})
    else:
        core.events.append({"ev": "worker_error", "worker_id": w.worker_id, "code": int(err.code),
                            "message": err.message, "job_id": err.job_id})
    if not mine:
        return core.dispatch(now)
    write_off(core, w, [entry.job_id], "worker_error", now)  # frees its credit
    w.failed_in_a_row += 1
    w.last_error = f"{err.code.name}: {err.message}"
    return maybe_bench(core, w, w.last_error, now) + core.dispatch(now)


def fail_job(core: Any, w: WorkerInfo, entry: LedgerEntry, message: str, now: float) -> list[Command]:
    """``w`` could not compute this job: settled as failed, the algorithm told (on_lost, as for
    any write-off). After ``max_failed_jobs`` failures in a row the worker is benched: it keeps
    its place in the table but gets no job until it says hello again or answers a job it
    still holds (it is told with ``err REFUSED``)."""
    settle(core, entry, "failed")
    core.counters.failed += 1
    w.failed += 1
    w.failed_in_a_row += 1
    w.last_error = message
    core.state = core.alg.on_lost(core.state, [entry.job_id])
    core.round_blocked = False
    core._sweep_store()
    core.events.append({"ev": "failed", "job_id": entry.job_id, "worker_id": w.worker_id,
                        "created_at": entry.created_at, "seed": entry.seed, "message": message,
                        "worker_failed": w.failed, "in_a_row": w.failed_in_a_row, "t": now})
    return maybe_bench(core, w, message, now)


def maybe_bench(core: Any, w: WorkerInfo, message: str, now: float) -> list[Command]:
    """Bench ``w`` if it has failed ``max_failed_jobs`` jobs in a row (see :func:`fail_job`)."""
    k = core.cfg.max_failed_jobs
    if not k or w.benched or w.failed_in_a_row < k:
        return []
    w.benched = True
    reindex(core, w)
    core.counters.benched += 1
    core.events.append({"ev": "benched", "worker_id": w.worker_id, "in_a_row": w.failed_in_a_row,
                        "message": message, "t": now})
    return [Send(w.worker_id, Error(ErrorCode.REFUSED, f"benched: {w.failed_in_a_row} jobs in a row failed; "
                                    "no more jobs until this worker says hello again (restart it)"))]


def unbench(core: Any, w: WorkerInfo, why: str, now: float) -> None:
    w.benched = False
    w.failed_in_a_row = 0
    reindex(core, w)
    core.round_blocked = False
    core.events.append({"ev": "unbenched", "worker_id": w.worker_id, "reason": why, "t": now})


def on_missing(core: Any, w: WorkerInfo, err: Error, now: float) -> list[Command]:
    """The worker lacks iterates a job references: send the job again with those points,
    within ``max_resends_per_job`` and ``max_resends`` (see :class:`ps.core.config.CoreConfig`);
    past them the job is written off and the err counts as an invalid reply."""
    entry = core.ledger.get(err.job_id) if err.job_id is not None else None
    if entry is None or entry.worker_id != w.worker_id or entry.received:
        return []
    core.counters.missing_iterates += 1
    if entry.resends >= core.cfg.max_resends_per_job or w.resends_in_a_row >= core.cfg.max_resends:
        write_off(core, w, [entry.job_id], "resends", now)
        out: list[Command] = [Send(w.worker_id, Cancel((entry.job_id,)))]
        w.bad_in_a_row += 1
        if core.cfg.max_bad_replies and w.bad_in_a_row >= core.cfg.max_bad_replies:
            out += quarantine_worker(core, w, now)
        return out + core.dispatch(now)
    entry.resends += 1
    w.resends_in_a_row += 1
    w.holds.difference_update(err.iterate_ids)
    return [Send(w.worker_id, job_message(core, entry, w))]


def quarantine_worker(core: Any, w: WorkerInfo, now: float) -> list[Command]:
    """``w`` sent ``max_bad_replies`` invalid replies in a row: refused for ``quarantine_s``."""
    core.counters.quarantined += 1
    core.quarantine[w.worker_id] = now + core.cfg.quarantine_s
    core.events.append({"ev": "quarantined", "worker_id": w.worker_id, "bad_in_a_row": w.bad_in_a_row,
                        "key": w.key, "t": now})
    out: list[Command] = [Send(w.worker_id, Bye("quarantined: too many invalid replies"))]
    out += core.remove_worker(w.worker_id, now, reason="quarantined")
    out.append(Disconnect(w.worker_id, "quarantined"))
    return out
