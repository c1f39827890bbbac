"""err MISSING_ITERATE re-sends are bounded per job and per worker (CoreConfig.max_resends_per_job,
max_resends): past them the job is written off and the err counts as an invalid reply."""

from __future__ import annotations

import numpy as np

from protocol.messages import Bye, Cancel, Error, ErrorCode, Job, Ready
from ps.core.commands import Send
from tests.unit.test_core import jobs_in, join, make_core, reply_for


def miss(job: Job) -> Error:
    return Error(ErrorCode.MISSING_ITERATE, "miss", job_id=job.job_id, iterate_ids=job.iterate_ids)


def points_sent(cmds) -> int:
    return sum(len(j.points) for _, j in jobs_in(cmds))


def test_a_job_is_resent_twice_then_written_off_and_the_err_counts_as_invalid():
    core = make_core()
    job = jobs_in(join(core, "w1"))[0][1]
    assert [points_sent(core.handle("w1", miss(job), 0.1 + i / 10)) for i in range(2)] == [1, 1]
    cmds = core.handle("w1", miss(job), 0.3)
    assert Send("w1", Cancel((job.job_id,))) in cmds
    assert core.counters.lost == 1 and core.workers["w1"].bad_in_a_row == 1 and core.accounted()
    new = jobs_in(cmds)
    assert len(new) == 1 and new[0][1].job_id != job.job_id, "its credit slot is free again"
    assert points_sent(cmds) == 0, "the worker was just sent that iterate: no third copy"


def test_a_worker_gets_four_resends_between_accepted_replies_then_is_quarantined():
    core = make_core()
    job = jobs_in(join(core, "w1"))[0][1]
    sent, now, bye = 1, 0.0, None
    for _ in range(100):
        now += 0.01
        cmds = core.handle("w1", miss(job), now)
        sent += points_sent(cmds)
        bye = next((c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, Bye)), None)
        if bye:
            break
        job = next((j for _, j in jobs_in(cmds)), job)
    assert bye is not None and "quarantined" in bye.reason
    assert sent <= 1 + 4 + 5, "the job, 4 re-sends, at most one new iterate per write-off"
    assert core.counters.quarantined == 1 and "w1" not in core.workers and core.accounted()


def test_an_accepted_reply_resets_the_workers_count():
    core = make_core()
    job = jobs_in(join(core, "w1"))[0][1]
    for _ in range(20):  # a worker whose cache keeps missing, but that answers every job
        assert points_sent(core.handle("w1", miss(job), 0.1)) == 1
        cmds = core.handle("w1", reply_for(job), 0.2)
        job = jobs_in(cmds)[0][1]
    assert core.counters.applied == 20 and core.counters.lost == 0
    assert core.workers["w1"].bad_in_a_row == 0 and core.workers["w1"].resends_in_a_row == 0


def test_resend_counts_survive_a_snapshot():
    from ps.core.server_core import ServerCore

    core = make_core()
    job = jobs_in(join(core, "w1"))[0][1]
    core.handle("w1", Ready(credit=1), 0.05)
    core.handle("w1", miss(job), 0.1)
    again = ServerCore.restore(core.alg, core.snapshot(), core.cfg)
    assert again.ledger[job.job_id].resends == 1 and again.workers["w1"].resends_in_a_row == 1
    assert np.array_equal(again.params(), core.params())
