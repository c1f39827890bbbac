"""The conformance kit's cases against a sharded server (PROTOCOL.md §12, docs/CONFORMANCE.md):
the kit is the coordinator and two shards (a ROUTER each), and plays what ``ps/sharded/shard.py``
sends: a ``job`` with the slices a ``fetch`` asked for, or ``err UNKNOWN_JOB``.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from protocol.messages import Error, ErrorCode, Fetch, Job, JobKind, Reply
from ps.ops.conformance import Case, Kit, brief, check, crash_and_hello

REFETCH_BOUND_S = 12.0  # §12.1: 4x the slowest answer, at least 2 s; 10 s before any answer


def shard_handshake(kit: Kit) -> None:
    """§12.1: a worker that takes a sharded server's welcome says so in its hello (``shards: true``)."""
    h = kit.hello
    said = getattr(h, "shards", None)
    check(said is True, "12.1", "hello.shards true from a worker that can work for a sharded server",
          "no shards field in hello" if said is None else f"shards {said!r}")


def _header(kit: Kit, kind: JobKind, ids: tuple, new: tuple) -> Job:
    """A coordinator's job: as an unsharded server's, its iterates empty (PROTOCOL.md §12.1): the
    ids it has not sent this worker before in ``point_ids``, each with an empty array."""
    job = kit.job(kind, ids, send=())
    return dataclasses.replace(job, point_ids=tuple(new), points=tuple(np.zeros(0, np.float32) for _ in new))


def _fetches(kit: Kit, job: Job, shards: list[int], need: tuple) -> dict[int, Fetch]:
    """The fetch of ``job`` on each shard of ``shards``, checked."""
    got: dict[int, Fetch] = {}
    routers = [kit.shards[i] for i in shards]
    deadline = time.monotonic() + kit.timeout_s
    while len(got) < len(shards):
        f = kit.expect(f"a fetch of job {job.job_id} on shards {shards}", "12.1",
                       lambda m: type(m) is Fetch and m.job_id == job.job_id,
                       timeout_s=max(0.1, deadline - time.monotonic()), routers=routers)
        got[kit.shards.index(kit.last_from)] = f
        check(f.created_at == job.created_at, "12.1", f"fetch.created_at {job.created_at}", f.created_at)
        check(tuple(f.iterate_ids) == need, "12.1", f"fetch.iterate_ids {list(need)} (the ids it does not cache)",
              list(f.iterate_ids))
    return got


def _answer(kit: Kit, job: Job, i: int, need: tuple) -> None:
    lo, hi = kit.shard_map()[i][1:]
    kit.shards[i].send(Job(job_id=job.job_id, kind=job.kind, created_at=job.created_at, iterate_ids=job.iterate_ids,
                           seed=job.seed, batch_size=job.batch_size, shard=job.shard, point_ids=need,
                           points=tuple(kit.iterates[k][lo:hi] for k in need)))


def _blocks(kit: Kit, job: Job) -> None:
    """Each shard's gradient slice as a reply, then the coordinator's header with empty gradients."""
    full, _ = kit.oracle.grads(job, [kit.iterates[k] for k in job.iterate_ids])
    for i, (_, lo, hi) in enumerate(kit.shard_map()):
        b = kit.expect_type(Reply, "12.1", routers=[kit.shards[i]], where=lambda m: m.job_id == job.job_id)
        check(len(b.grads) == len(full) and all(g.shape == (hi - lo,) for g in b.grads), "12.1",
              f"shard {i}'s block: {len(full)} slice(s) [{lo}, {hi}) of shape ({hi - lo},)",
              [g.shape for g in b.grads])
        kit.check_reply(job, b, "12.1", grads_of=lambda r, lo=lo, hi=hi: _widen(r, full, lo, hi))
    h = kit.expect_type(Reply, "12.1", where=lambda m: m.job_id == job.job_id)
    check(len(h.grads) == len(full) and all(g.size == 0 for g in h.grads), "12.1",
          f"the coordinator's reply with {len(full)} empty gradient(s)", [g.shape for g in h.grads])
    check(h.created_at == job.created_at, "12.1", f"created_at {job.created_at}", h.created_at)


def _widen(r: Reply, full: list, lo: int, hi: int) -> tuple:
    """A block's slices put into the oracle's full gradients (so the oracle check compares the slice)."""
    if len(r.grads) != len(full) or any(g.shape != (hi - lo,) for g in r.grads):
        return r.grads  # the count and shape checks name it
    out = []
    for g, w in zip(r.grads, full, strict=True):
        x = w.astype(g.dtype)
        x[lo:hi] = g
        out.append(x)
    return tuple(out)


def _play_job(kit: Kit, kind: JobKind, ids: tuple, need: tuple) -> Job:
    job = _header(kit, kind, ids, need)
    kit.router.send(job)
    _fetches(kit, job, list(range(len(kit.shards))), need)
    for i in range(len(kit.shards)):
        _answer(kit, job, i, need)
    _blocks(kit, job)
    return job


def shard_fetch(kit: Kit) -> None:
    """§12.1: fetch from every shard, compute on the concatenated slices, each shard its block and
    the coordinator a header; a pair naming a cached iterate fetches only the other one."""
    a = kit.iterate()
    _play_job(kit, JobKind.GRAD, (a,), (a,))
    b = kit.iterate()
    _play_job(kit, JobKind.GRAD_PAIR, (b, a), (b,))


def shard_unknown_job(kit: Kit) -> None:
    """§12.1: a shard answering err UNKNOWN_JOB: the worker drops the job (no reply, out of busy)."""
    a = kit.iterate()
    job = _header(kit, JobKind.GRAD, (a,), (a,))
    kit.router.send(job)
    _fetches(kit, job, [0, 1], (a,))
    kit.shards[0].send(Error(ErrorCode.UNKNOWN_JOB, "conformance: settled here", job_id=job.job_id))
    _answer(kit, job, 1, (a,))
    t0 = time.monotonic()
    kit.expect_hb("12.1", f"job {job.job_id} dropped from busy",
                  lambda m: job.job_id not in m.busy and time.monotonic() - t0 > 0.3)
    late = [m for m in kit.quiet(0.5, [kit.router, *kit.shards]) if type(m) is Reply and m.job_id == job.job_id]
    check(not late, "12.1", f"no reply to job {job.job_id} after err UNKNOWN_JOB", brief(late[:1]))


def shard_refetch(kit: Kit) -> None:
    """§12.1: a shard that restarts before answering gets the unanswered fetch again (bounded)."""
    a = kit.iterate()
    _play_job(kit, JobKind.GRAD, (a,), (a,))  # an answer first: the refetch timer is then 4x the slowest
    b = kit.iterate()
    job = _header(kit, JobKind.GRAD, (b,), (b,))
    kit.router.send(job)
    _fetches(kit, job, [0, 1], (b,))
    kit.shards[1].restart()
    _answer(kit, job, 0, (b,))
    _fetches_again = kit.expect(f"the fetch of job {job.job_id} again on the restarted shard", "12.1",
                                lambda m: type(m) is Fetch and m.job_id == job.job_id, timeout_s=REFETCH_BOUND_S,
                                routers=[kit.shards[1]])
    check(tuple(_fetches_again.iterate_ids) == (b,), "12.1", f"iterate_ids [{b}]", list(_fetches_again.iterate_ids))
    _answer(kit, job, 1, (b,))
    _blocks(kit, job)


def _shard_restart(kind: JobKind, kit: Kit) -> None:
    """§8.11 and §12.1 with a sharded server: the coordinator crashes with replies in flight;
    after the welcome of the same run the worker sends each again: blocks to the shards, then the header."""
    ids = (kit.iterate(), kit.iterate()) if kind == JobKind.GRAD_PAIR else (kit.iterate(),)
    job = _play_job(kit, kind, ids, ids)
    h = crash_and_hello(kit)
    check(job.job_id in h.busy, "8.6", f"hello.busy listing job {job.job_id}, its reply sent before the crash",
          f"busy {list(h.busy)}")
    kit.welcome(shards=kit.shard_map(), parts=h.parts)
    _blocks(kit, job)


def shard_restart_grad(kit: Kit) -> None:
    _shard_restart(JobKind.GRAD, kit)


def shard_restart_pair(kit: Kit) -> None:
    _shard_restart(JobKind.GRAD_PAIR, kit)


CASES = [
    Case("shard-handshake", "12.1", "hello.shards true", shard_handshake, sharded=True),
    Case("shard-fetch", "12.1", "fetch from every shard, blocks to them, a header to the coordinator", shard_fetch,
         sharded=True),
    Case("shard-unknown-job", "12.1", "err UNKNOWN_JOB from a shard: the job dropped", shard_unknown_job,
         sharded=True),
    Case("shard-refetch", "12.1", "a restarted shard asked again", shard_refetch, sharded=True),
    Case("shard-restart-grad", "8.11, 12.1", "GRAD blocks and header in flight at a coordinator crash sent again",
         shard_restart_grad, sharded=True),
    Case("shard-restart-pair", "8.11, 12.1", "GRAD_PAIR blocks and header in flight at a coordinator crash sent again",
         shard_restart_pair, sharded=True),
]
