"""Helpers of the tests that drive a real shard's data socket with the real ``ShardLinks``
(tests/unit/test_shard_parts_transfer.py, tests/unit/test_shard_shm.py)."""

from __future__ import annotations

import time

import zmq

from protocol.messages import Job
from ps.sharded.shard import Shard
from worker.shards import ShardLinks

WAIT_S = 30.0  # the longest a helper waits for the shard or the links (a bound, not a pace: a loaded CI machine)


def pump(shard: Shard, socks: list, done, what: str) -> None:
    """Let the shard handle what its socket holds, until ``done()`` (at most WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    poller = zmq.Poller()
    poller.register(shard.data, zmq.POLLIN)
    for s in socks:
        poller.register(s, zmq.POLLIN)
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        poller.poll(20)
        shard._drain(shard.data, shard._on_data)


def job_header(shard: Shard, jid: int) -> Job:
    e = shard.core.ledger[jid]
    return Job(job_id=e.job_id, kind=e.kind, created_at=e.created_at, iterate_ids=e.iterate_ids, seed=e.seed,
               batch_size=e.batch_size, shard=e.shard, deadline=e.deadline)


def fetch_whole(shard: Shard, links: ShardLinks, jid: int) -> Job:
    links.fetch(job_header(shard, jid), shard.core.ledger[jid].iterate_ids, time.monotonic())
    got: list = []

    def done() -> bool:
        if links.socks[0].poll(0):
            got.extend(links.receive(0))
        return bool(got)

    pump(shard, links.socks, done, f"job {jid}")
    (kind, job), = got
    assert kind == "job"
    return job
