"""Dispatch: free credit becomes jobs. Every worker with credit left, in join order, gets the
jobs the algorithm makes (``Algorithm.make_job``, or the specs queued: init jobs, clock-made round
jobs); each job gets a ledger entry, references to its iterates in the store and a sample seed,
and goes out as a :class:`protocol.messages.Job` with the points its worker does not hold yet.

The ``core`` argument below is a :class:`ps.core.server_core.ServerCore`, whose tables,
algorithm state, seed generator, counters and events these functions update."""

from __future__ import annotations

from typing import Any

from algorithms.base import Algorithm, JobSpec
from protocol.messages import Job
from ps.core.commands import Command, Send
from ps.core.iterates import reference
from ps.core.ledger import LedgerEntry, add_entry, new_job_id
from ps.core.settlement import run_round
from ps.core.workers import WorkerInfo, free_in_join_order, reindex

_NO_ON_ISSUED = Algorithm.on_issued  # does nothing


def dispatch_jobs(core: Any, now: float) -> list[Command]:
    """Give jobs to every worker with free credit, in join order (the free workers are an
    index: a pass costs the workers served, not the workers connected)."""
    if not core.issuing or core.held:
        return []
    if not core.started:
        if len(core._eligible) < core.cfg.min_workers:
            return []
        core.started = True
    out: list[Command] = []
    free = core._free
    alg = core.alg
    round_mode = alg.mode == "round"
    clock_rounds = round_mode and bool(core.cfg.round_period_s)
    if not free or (round_mode and _idle(core, clock_rounds)):
        return out
    workers, pending = core.workers, core.pending_specs
    for wid in (list(free) if len(free) == 1 else free_in_join_order(core)):
        if round_mode and _idle(core, clock_rounds):
            break
        w = workers[wid]
        while len(w.outstanding) < w.credit and w.worker_id in workers:
            if pending:
                spec = pending.popleft()
            elif clock_rounds:
                break
            else:
                if round_mode:
                    if core.round_blocked:
                        break
                    out += run_round(core, now)
                core.state, spec = alg.make_job(core.state, w.worker_id)
                if spec is None:
                    core.round_blocked = round_mode
                    break
            out.append(Send(w.worker_id, issue_job(core, spec, w, now)))
    return out


def _idle(core: Any, clock_rounds: bool) -> bool:
    """Round mode: nothing queued and no round to run, so no worker gets a job in this pass
    (neither condition changes within it): stop rather than look at every free worker. A
    per-reply algorithm is never idle."""
    return not core.pending_specs and (clock_rounds or core.round_blocked)


def sample_seed(rng: Any) -> int:
    """A job's sample seed: exactly ``int(rng.integers(0, 2**63))`` of the core's PCG64 generator
    (numpy draws a bound of 2^63 as the top 63 bits of one 64-bit output, Lemire's method with
    nothing to reject), at a tenth of its cost (0.2 against 2 µs a job)."""
    return rng.bit_generator.random_raw() >> 1


def issue_job(core: Any, spec: JobSpec, w: WorkerInfo, now: float) -> Job:
    """Give ``spec`` to ``w``: a new ledger entry, and the job message for it."""
    ids = spec.iterate_ids
    if len(ids) != len(spec.points):
        raise ValueError(f"{core.alg.name}: JobSpec has {len(ids)} ids and {len(spec.points)} points")
    reference(core, ids, spec.points)
    jid = new_job_id(core)
    entry = LedgerEntry(job_id=jid, worker_id=w.worker_id, kind=spec.kind, created_at=spec.created_at,
                        iterate_ids=ids if type(ids) is tuple else tuple(ids), seed=sample_seed(core.rng),
                        batch_size=spec.batch_size or core.cfg.batch_size, shard=spec.shard,
                        deadline=spec.deadline, issued_at=now)
    add_entry(core, entry)
    alg = core.alg
    if getattr(type(alg), "on_issued", None) is not _NO_ON_ISSUED:  # Algorithm.on_issued returns the state
        core.state = alg.on_issued(core.state, jid, spec)  # the algorithm learns the job's id
    w.outstanding.add(jid)
    reindex(core, w)
    core.counters.issued += 1
    if core.record_issued:
        core.events.append({"ev": "issued", "job_id": jid, "worker_id": w.worker_id, "kind": int(spec.kind),
                            "created_at": spec.created_at, "seed": entry.seed, "t": now})
    return job_message(core, entry, w)


def job_message(core: Any, entry: LedgerEntry, w: WorkerInfo) -> Job:
    """The job of ``entry`` as sent to ``w``: with the points of the iterates it does not hold."""
    ids, holds = entry.iterate_ids, w.holds
    if len(ids) == 1:  # the common case, as the general form below has it
        i = ids[0]
        if i in holds:
            missing: tuple = ()
            points: tuple = ()
        else:
            holds.add(i)
            missing, points = (i,), (core.store[i],)
    else:
        missing = tuple(dict.fromkeys(i for i in ids if i not in holds))
        holds.update(missing)
        points = tuple(core.store[i] for i in missing)
    return Job(job_id=entry.job_id, kind=entry.kind, created_at=entry.created_at,
               iterate_ids=ids, seed=entry.seed, batch_size=entry.batch_size,
               shard=entry.shard, deadline=entry.deadline, point_ids=missing, points=points)
