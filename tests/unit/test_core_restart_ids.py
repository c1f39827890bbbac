"""After a restart, what a rejoining worker claims from the old server process's lost tail
(iterates and job ids this process never journaled, and will make again with other values)
is not trusted: its cached iterates above our version are dropped from its holds, and job ids
skip past what it saw. Both cases came from a resumed server whose journal lags the old process."""

from __future__ import annotations

import numpy as np

import algorithms
from protocol.messages import Heartbeat, Hello, Ready
from ps.core.config import CoreConfig
from ps.core.ledger import MAX_JOB_ID_SKIP
from ps.core.server_core import ServerCore
from tests.unit.test_core import D, jobs_in, reply_for


def resumed_at_version_0(run_id=7) -> ServerCore:
    core = ServerCore(algorithms.build("asgd", {"lr": 0.1}), np.ones(D, np.float32), CoreConfig(run_id=run_id))
    core.rebase_clock(100.0)
    return core


def test_cached_iterates_above_our_version_are_not_trusted():
    """The old process reached version 5 and the worker cached iterates 0..5; this one resumed
    at version 0. Iterate 1 is made again here with another value, so a job at iterate 1 must
    carry its point (before the fix: point_ids == (), the worker computed on the stale one)."""
    core = resumed_at_version_0()
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, run_id=7, holds=(0, 1, 2, 3, 4, 5)), 100.0)
    assert core.workers["w1"].holds == {0}, "only iterate 0 is one this process has made"
    job = jobs_in(core.handle("w1", Ready(credit=1, holds=(0, 1, 2, 3, 4, 5)), 100.0))[0][1]
    assert job.iterate_ids == (0,) and job.point_ids == (), "iterate 0 it holds"


    cmds = core.handle("w1", reply_for(job), 100.1)
    nxt = jobs_in(cmds)[0][1]
    assert nxt.iterate_ids == (1,) and nxt.point_ids == (1,), "iterate 1 travels: the cached one was stale"


def test_job_ids_skip_past_what_a_rejoining_worker_saw():
    """The worker saw job ids up to 50 from the old process; this one would issue 0, 1, ... A
    heartbeat with seen=50 crossing job 1 on its way would write job 1 off as vanished (before
    the fix: lost). Job ids now start at 51 for everyone."""
    core = resumed_at_version_0()
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, run_id=7, seen=50, busy=(49,)), 100.0)
    job = jobs_in(core.handle("w1", Ready(credit=1), 100.0))[0][1]
    assert job.job_id == 51
    core.handle("w1", Heartbeat(boot=1, credit=1, busy=(49,), seen=50), 100.2)  # sent before job 51 arrived
    assert core.counters.lost == 0 and job.job_id in core.ledger


def test_a_far_fetched_seen_does_not_move_the_job_ids():
    """A worker's claim can move the counter at most MAX_JOB_ID_SKIP ahead (ids stay small), and
    a hello from another run moves nothing."""
    core = resumed_at_version_0()
    core.handle("w1", Hello(worker_id="w1", boot=1, credit=1, run_id=7, seen=MAX_JOB_ID_SKIP + 5), 100.0)
    core.handle("w2", Hello(worker_id="w2", boot=1, credit=1, run_id=8, seen=40), 100.0)
    assert core.next_job_id == 0


def test_a_new_state_directory_pins_its_restart_grace(tmp_path):
    """run.json records the grace the run was created with (liveness 2 s: 2 + 5 + 4 = 11 s), so
    that a later change of the protocol's backoff constants cannot change how the run replays."""
    from ps.core.spec import TrainingSpec
    from ps.drivers.server import StateOptions
    from ps.drivers.server import open_state as _open_state
    from ps.journal.runfile import read_run

    d = str(tmp_path / "state")
    spec = TrainingSpec(problem="quadratic", problem_options={"d": 8}, algorithm="asgd", settings={"lr": 0.1})
    core, _, pers, _ = _open_state(StateOptions(d, checkpoint_every=0, checkpoint_interval_s=0, fsync="never"),
                                   spec, boot=1, batch_size=4, liveness_timeout=2.0, heartbeat_interval=0.5,
                                   min_workers=1, round_period=0.0, seed=0)
    pers.close()
    assert read_run(d)["core"]["restart_grace_s"] == 11.0 == core.cfg.restart_grace
