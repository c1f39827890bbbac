"""The conformance kit's cases against an unsharded server (docs/CONFORMANCE.md): each a function
of a :class:`ps.ops.conformance.Kit` whose worker has joined (except ``handshake``, which checks
the join itself), raising :class:`ps.ops.conformance.CaseFailed` on the first thing wrong.
"""

from __future__ import annotations

import time

import msgpack
import numpy as np

from protocol.chunks import split
from protocol.messages import (
    Bye,
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    JobKind,
    Ready,
    Reply,
)
from ps.ops.conformance import HEARTBEAT_S, LIVENESS_S, Case, CaseFailed, Kit, brief, check, crash_and_hello

U64 = (1 << 64) - 1


def handshake(kit: Kit) -> None:
    """§6.1 hello fields, §8.1 ready before any job, §8.5/§8.6 heartbeats with busy and seen."""
    h = kit.expect_type(Hello, "8.1", timeout_s=max(kit.timeout_s, 20.0))
    kit.hello = h
    check(h.vmin <= 1 <= h.vmax, "6.1", "vmin <= 1 <= vmax", f"vmin {h.vmin}, vmax {h.vmax}")
    check(1 <= len(h.worker_id) <= 64 and h.worker_id.isascii() and h.worker_id.isprintable(), "6.1",
          "a worker_id of 1-64 printable ASCII characters", repr(h.worker_id))
    check(0 <= h.boot <= U64, "6.1", "boot a u64", h.boot)
    check(h.credit >= 1, "6.1", "credit >= 1", h.credit)
    check((h.busy, h.seen, h.run_id) == ((), -1, 0), "6.1", "a first hello with busy [], seen -1, run_id 0",
          f"busy {list(h.busy)}, seen {h.seen}, run_id {h.run_id}")
    kit.welcome()
    t0 = time.monotonic()
    first = kit.expect("a ready before anything but hb", "8.1", lambda m: type(m) is not Heartbeat)
    check(type(first) is Ready, "8.1", "ready as the first message after welcome (hb aside)", brief(first))
    hb = kit.expect_hb("8.5", "busy [] and seen -1 within the liveness timeout", lambda m: True, timeout_s=LIVENESS_S)
    check(time.monotonic() - t0 < LIVENESS_S, "8.5", f"an hb within {LIVENESS_S:g} s", "none")
    check(hb.busy == () and hb.seen == -1, "8.6", "busy [] and seen -1 before any job",
          f"busy {list(hb.busy)}, seen {hb.seen}")
    check(hb.boot == h.boot, "6.6", f"hb.boot = hello.boot {h.boot}", hb.boot)
    job = kit.job(JobKind.GRAD, (kit.iterate(),))
    kit.router.send(job)
    kit.answer(job, "8.2")
    hb = kit.expect_hb("8.6", f"seen {job.job_id} after job {job.job_id}", lambda m: m.seen == job.job_id)
    check(job.job_id not in hb.busy, "8.6", f"job {job.job_id} out of busy once answered", list(hb.busy))


def _one_job(kind: JobKind, kit: Kit) -> None:
    ids = (kit.iterate(), kit.iterate()) if kind == JobKind.GRAD_PAIR else (kit.iterate(),)
    job = kit.job(kind, ids)
    kit.router.send(job)
    kit.answer(job, "6.5")


def job_grad(kit: Kit) -> None:
    """§6.4/§6.5: one point, one gradient, equal to the oracle's."""
    _one_job(JobKind.GRAD, kit)


def job_pair(kit: Kit) -> None:
    """§6.5: two points on one minibatch, two gradients in the order (new, old)."""
    _one_job(JobKind.GRAD_PAIR, kit)


def job_full(kit: Kit) -> None:
    """§6.5: FULL_GRAD, the sum over the shard [lo, hi) and its count."""
    _one_job(JobKind.FULL_GRAD, kit)


def _missing(kit: Kit, job: Job) -> None:
    kit.router.send(job)
    e = kit.expect_type(Error, "8.3", where=lambda m: m.job_id == job.job_id)
    check(e.code == ErrorCode.MISSING_ITERATE, "8.3", "err MISSING_ITERATE", e.code.name)
    want = tuple(i for i in job.iterate_ids if i not in job.point_ids)
    check(tuple(e.iterate_ids) == want, "7", f"iterate_ids {list(want)} named", list(e.iterate_ids))


def iterate_cache(kit: Kit) -> None:
    """§8.3: a job naming a cached iterate without its point is computed on it; one naming an
    iterate the worker does not hold gets err MISSING_ITERATE, and the job sent again with it works."""
    a = kit.iterate()
    first = kit.job(JobKind.GRAD, (a,))
    kit.router.send(first)
    kit.answer(first, "8.3")
    cached = kit.job(JobKind.GRAD, (a,), send=())
    kit.router.send(cached)
    kit.answer(cached, "8.3")
    missing = kit.job(JobKind.GRAD, (kit.iterate(),), send=())
    _missing(kit, missing)
    again = Job(**{**{f: getattr(missing, f) for f in Job.__slots__}, "point_ids": missing.iterate_ids,
                   "points": tuple(kit.iterates[i] for i in missing.iterate_ids)})
    kit.router.send(again)
    kit.answer(again, "8.3")


def cancel(kit: Kit) -> None:
    """§8.7: a cancelled job (here one waiting for its iterate) leaves busy in the next hb."""
    job = kit.job(JobKind.GRAD, (kit.iterate(),), send=())
    _missing(kit, job)
    kit.expect_hb("8.6", f"job {job.job_id} in busy while it waits for its iterate", lambda m: job.job_id in m.busy)
    kit.router.send(Cancel(job_ids=(job.job_id,)))
    t0 = time.monotonic()
    kit.expect_hb("8.7", f"job {job.job_id} out of busy after its cancel",
                  lambda m: job.job_id not in m.busy and time.monotonic() - t0 > HEARTBEAT_S, timeout_s=3.0)


def _resumed(kind: JobKind, kit: Kit) -> None:
    """§8.6/§8.11: replies handed to the socket before a crash are listed in hello.busy and sent
    again after a welcome of the same run_id."""
    jobs = []
    for _ in range(2):
        ids = (kit.iterate(), kit.iterate()) if kind == JobKind.GRAD_PAIR else (kit.iterate(),)
        job = kit.job(kind, ids)
        kit.router.send(job)
        kit.answer(job, "6.5")
        jobs.append(job)
    h = crash_and_hello(kit)
    want = [j.job_id for j in jobs]
    check(set(want) <= set(h.busy), "8.6", f"hello.busy listing the replies sent before the crash {want}",
          f"busy {list(h.busy)}")
    check(h.run_id == kit.run_id and h.seen >= max(want), "8.10", f"run_id {kit.run_id} and seen >= {max(want)}",
          f"run_id {h.run_id}, seen {h.seen}")
    kit.welcome()
    got: dict[int, Reply] = {}
    deadline = time.monotonic() + kit.timeout_s
    while len(got) < len(jobs):
        r = kit.expect(f"the replies to jobs {want} sent again after the welcome", "8.11",
                       lambda m: type(m) is Reply and m.job_id in want, timeout_s=max(0.1, deadline - time.monotonic()))
        got[r.job_id] = r
    for job in jobs:
        kit.check_reply(job, got[job.job_id], "8.11")


def restart_grad(kit: Kit) -> None:
    _resumed(JobKind.GRAD, kit)


def restart_pair(kit: Kit) -> None:
    _resumed(JobKind.GRAD_PAIR, kit)


def restart_full(kit: Kit) -> None:
    _resumed(JobKind.FULL_GRAD, kit)


def restart_fresh(kit: Kit) -> None:
    """§8.11 fresh server: a new run_id; the worker drops its jobs, seen -1, ready again."""
    job = kit.job(JobKind.GRAD, (kit.iterate(),), send=())
    _missing(kit, job)  # the job now waits at the worker (busy)
    h = crash_and_hello(kit)
    check(job.job_id in h.busy, "6.1", f"hello.busy listing job {job.job_id} it holds", list(h.busy))
    kit.run_id += 1
    kit.welcome()
    r = kit.expect_type(Ready, "8.11")
    check(r.holds == (), "8.3", "ready.holds [] (the cache emptied in a new run)", list(r.holds))
    kit.expect_hb("8.11", "seen -1 and busy [] in the new run", lambda m: m.seen == -1 and m.busy == ())
    kit.next_job = 0
    kit.iterates.clear()
    kit.next_iterate = 0
    _one_job(JobKind.GRAD, kit)


def unknown_worker(kit: Kit) -> None:
    """§8.10: err UNKNOWN_WORKER to an hb: the worker says hello again (same boot)."""
    hb = kit.expect_hb("8.5", "any", lambda m: True)
    kit.router.send(Error(ErrorCode.UNKNOWN_WORKER, "conformance: who are you?"))
    h = kit.expect_type(Hello, "8.10", timeout_s=3.0)
    check(h.boot == hb.boot, "8.10", f"the same boot {hb.boot}", h.boot)
    kit.welcome()
    kit.expect_type(Ready, "8.10")
    _one_job(JobKind.GRAD, kit)


def new_boot(kit: Kit) -> None:
    """§8.10: a server hb with another boot (the server restarted): the worker says hello again."""
    boot = kit.hello.boot
    kit.server_boot += 1
    kit.router.send(Heartbeat(boot=kit.server_boot))
    h = kit.expect_type(Hello, "8.10", timeout_s=3.0)
    check(h.boot == boot, "8.10", f"the same boot {boot}", h.boot)
    kit.welcome()
    kit.expect_type(Ready, "8.10")
    _one_job(JobKind.GRAD, kit)


def _garbage(kit: Kit, job: Job) -> list[list]:
    """Frames §10 rejects: not msgpack, v 2, an unknown type, an array past the 2 GiB cap (§5), an
    array whose frame is shorter than its descriptor says."""
    iid = job.iterate_ids[0]
    header = {"v": 1, "t": "job", "job_id": job.job_id + 1000, "kind": 1, "created_at": 0, "iterate_ids": [iid],
              "seed": 1, "point_ids": [iid], "arrays": [{"dtype": "<f4", "shape": [1 << 30]}]}
    short = {**header, "arrays": [{"dtype": "<f4", "shape": [kit.oracle.dim]}]}
    return [[b"\xc1\xff not msgpack"], [msgpack.packb({"v": 2, "t": "hb", "boot": 1})],
            [msgpack.packb({"v": 1, "t": "frobnicate"})], [msgpack.packb(header), np.zeros(2, "<f4").tobytes()],
            [msgpack.packb(short), np.zeros(kit.oracle.dim - 1, "<f4").tobytes()]]


def bad_input(kit: Kit) -> None:
    """§10: garbage, a header of v 2, an unknown type, an oversized array: dropped; the worker
    stays up and answers the next job correctly."""
    job = kit.job(JobKind.GRAD, (kit.iterate(),))
    for frames in _garbage(kit, job):
        kit.router.send_frames(frames)
    kit.router.send(job)
    kit.answer(job, "10")


def parts(kit: Kit) -> None:
    """§6.13: with hello.parts (and welcome.parts), a job past 16 MiB sent in parts is reassembled,
    and its reply, as large, comes in parts (a reply with xfer)."""
    if not kit.hello.parts:
        kit.note = "not played: the worker's hello says no parts"
        return
    job = kit.job(JobKind.GRAD, (kit.iterate(),))
    kit.next_xfer += 1
    messages = split(job, kit.next_xfer)
    for frames in messages:
        kit.router.send_frames(frames)
    before = kit.router.parts_in
    r = kit.answer(job, "6.13", timeout_s=max(kit.timeout_s, 30.0))
    n = kit.router.parts_in - before
    check(r.xfer != 0 and n > 1, "6.13", f"the reply of {4 * kit.oracle.dim >> 20} MiB in parts (a reply with xfer)",
          f"xfer {r.xfer} after {n} part(s)")


def bye(kit: Kit) -> None:
    """§8.9: bye from the server: the worker stops (without a bye of its own)."""
    kit.router.send(Bye("conformance: the end"))
    deadline = time.monotonic() + kit.timeout_s
    while kit.alive() and time.monotonic() < deadline:
        got = kit.router.receive() if kit.router.sock else None
        if got is not None and type(got[0]) is Bye:
            raise CaseFailed("8.9", "no bye from a worker the server said bye to", brief(got[0]))
        kit.proc_wait(0.1)
    check(not kit.alive(), "8.9", f"the worker to exit within {kit.timeout_s:g} s of the server's bye",
          "it still runs")


CASES = [
    Case("handshake", "6.1, 8.1, 8.5, 8.6", "hello's fields, ready first, heartbeats", handshake, fresh=True),
    Case("job-grad", "6.4, 6.5", "a GRAD job answered with the oracle's gradient", job_grad),
    Case("job-pair", "6.5", "a GRAD_PAIR job: two gradients on one minibatch", job_pair),
    Case("job-full", "6.5", "a FULL_GRAD job: the shard's sum and count", job_full),
    Case("iterate-cache", "7, 8.3", "cached iterates used; a missing one asked for", iterate_cache),
    Case("cancel", "8.7", "a cancelled job leaves busy", cancel),
    Case("unknown-worker", "8.10", "err UNKNOWN_WORKER to an hb: hello again", unknown_worker),
    Case("new-boot", "8.10", "a server hb with a new boot: hello again", new_boot),
    Case("bad-input", "10", "garbage dropped, the worker still right", bad_input),
    Case("restart-grad", "8.6, 8.11", "GRAD replies in flight at a server crash sent again", restart_grad),
    Case("restart-pair", "8.6, 8.11", "GRAD_PAIR replies in flight at a server crash sent again", restart_pair),
    Case("restart-full", "8.6, 8.11", "FULL_GRAD replies in flight at a server crash sent again", restart_full),
    Case("restart-fresh", "8.11", "a fresh server: jobs dropped, seen -1, ready again", restart_fresh),
    Case("parts", "6.13", "a job and its reply past 16 MiB in parts", parts, big=True),
    Case("bye", "8.9", "bye from the server: the worker exits", bye, last=True),
]
