"""Settlement: how an outstanding job ends, and what follows. A job is applied or dropped by the
algorithm's step (a reply, or a round of buffered results), cancelled by the algorithm, written
off as lost (its worker left, fell silent or lost it), failed or rejected; each settles its ledger
entry, frees its worker's credit, releases its iterates and counts in the accounting identity.

The ``core`` argument below is a :class:`ps.core.server_core.ServerCore`, whose tables,
algorithm state, counters and events these functions update."""

from __future__ import annotations

from typing import Any

from algorithms.base import Algorithm, Result
from protocol.messages import Cancel
from ps.core.commands import Command, Send
from ps.core.iterates import release
from ps.core.ledger import LedgerEntry, close_entry
from ps.core.workers import WorkerInfo, reindex

_DROPPED = object()  # apply_results: no age, the result was not applied
_NO_CANCEL = Algorithm.cancel  # cancels nothing


def settle(core: Any, entry: LedgerEntry, how: str) -> None:
    """Remove a job from the ledger (and its worker's set); release iterate references."""
    close_entry(core, entry, how)
    w = core.workers.get(entry.worker_id)
    if w is not None:
        w.outstanding.discard(entry.job_id)
        reindex(core, w)
    release(core, entry.iterate_ids)


def apply_results(core: Any, results: list[Result], now: float, pre: tuple | None = None) -> list[Command]:
    """The algorithm applies ``results`` (or did already: ``pre`` = (the version before,
    what its apply returned)), then the ledger, events and cancellations follow."""
    if pre is None:
        v_before = core.version
        core.state, outcome = core.alg.apply(core.state, results)
    else:
        v_before, (core.state, outcome) = pre
    v = core.version  # nothing below changes it before the cancellations
    ages = dict(zip(outcome.applied, outcome.ages, strict=True))
    ledger, counters, events = core.ledger, core.counters, core.events
    for r in results:  # each settled, then its event (a settlement emits none, reads no event)
        jid = r.job_id
        entry = ledger.get(jid)
        age = ages.get(jid, _DROPPED)
        if age is not _DROPPED:
            if entry is not None:
                settle(core, entry, "applied")
                counters.applied += 1
            w = core.workers.get(r.worker_id)
            events.append({"ev": "applied", "job_id": jid, "worker_id": r.worker_id, "created_at": r.created_at,
                           "age": age, "seed": r.seed, "version": v, "t": now, "key": w.key if w else ""})
        else:
            if entry is not None:
                settle(core, entry, "dropped")
                counters.dropped += 1
            events.append({"ev": "dropped", "job_id": jid, "worker_id": r.worker_id,
                           "created_at": r.created_at, "age": v_before - r.created_at, "t": now})
    if v != v_before:
        counters.updates += v - v_before
    if outcome.metrics:
        core.last_metrics = dict(outcome.metrics)
        if v != v_before:  # per-step algorithm figures (M_k, batch fill, ...)
            events.append({"ev": "metrics", "version": v, "t": now, **core.last_metrics})
    out = cancel_jobs(core, now)
    core._sweep_store()
    return out


def cancel_jobs(core: Any, now: float) -> list[Command]:
    """The jobs the algorithm cancels now (``Algorithm.cancel`` of the outstanding view)."""
    alg = core.alg
    if getattr(type(alg), "cancel", None) is _NO_CANCEL:  # Algorithm.cancel: nothing, ever
        return []
    ids = alg.cancel(core.state, core.jobs)
    if not ids:
        return []
    by_worker: dict[str, list[int]] = {}
    for jid in ids:
        entry = core.ledger.get(jid)
        if entry is None or entry.received:
            continue
        settle(core, entry, "cancelled")
        core.counters.cancelled += 1
        by_worker.setdefault(entry.worker_id, []).append(jid)
        core.events.append({"ev": "cancelled", "job_id": jid, "worker_id": entry.worker_id,
                            "created_at": entry.created_at, "t": now})
    return [Send(wid, Cancel(tuple(jids))) for wid, jids in by_worker.items()
            if wid in core.workers and not (core.workers[wid].awaiting_hello and core.cfg.await_hello)]


def run_round(core: Any, now: float) -> list[Command]:
    """One round of a round-mode algorithm: apply everything buffered (maybe nothing)."""
    results, core.buffer = core.buffer, []
    return apply_results(core, results, now)


def clock_round(core: Any, now: float) -> list[Command]:
    """A round on the driver's clock (``round_period_s``); the algorithm's next job is queued."""
    out = run_round(core, now)
    core.state, spec = core.alg.make_job(core.state, "")
    if spec is not None:
        core.pending_specs.append(spec)
    return out


def write_off(core: Any, w: WorkerInfo, job_ids: list[int], reason: str, now: float) -> None:
    """These outstanding jobs of ``w`` will never be answered: lost; the algorithm is told."""
    for jid in job_ids:
        settle(core, core.ledger[jid], "lost")
        core.counters.lost += 1
        core.events.append({"ev": "lost", "job_id": jid, "worker_id": w.worker_id, "reason": reason, "t": now})
    if job_ids:
        core.state = core.alg.on_lost(core.state, job_ids)
        core.round_blocked = False
        core._sweep_store()
