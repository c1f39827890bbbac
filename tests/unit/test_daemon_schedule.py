"""The daemon's scheduling of what it receives (Daemon._receive_batch): messages of workers
that answer jobs first, the rest from a bounded backlog, each connection's messages in the
order it sent them, heartbeat repeats dropped before they are queued."""

from __future__ import annotations

import numpy as np

import algorithms
from problems import load_problem
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore
from ps.drivers.daemon import Daemon


class F:
    """A stand-in for a zmq.Frame: its bytes and length."""

    def __init__(self, b: bytes) -> None:
        self.bytes = b

    def __len__(self) -> int:
        return len(self.bytes)


def daemon_with(messages):
    problem = load_problem("quadratic", {"d": 4})
    core = ServerCore(algorithms.build("asgd", {"lr": 0.1}), np.zeros(4, np.float32), CoreConfig())
    d = Daemon(core, problem, "tcp://127.0.0.1:0", shm="off")
    handled = []
    d._on_frames = lambda frames: handled.append((frames[0].bytes, frames[1].bytes))
    it = iter(messages)  # what the socket holds: received once
    d.transport.pending = lambda: it
    return d, core, handled


def bind(d, core, rid: bytes, wid: str, jobs_done: int) -> None:
    """Make ``rid`` the live connection of a joined worker that has answered ``jobs_done`` jobs."""
    from protocol.messages import Hello

    core.handle(wid, Hello(worker_id=wid, boot=1, credit=1), 0.0)
    c = d.conns.get(rid, 0.0)
    d.conns.bind(c, wid, "")
    d.conns.set_live(c, True, 0.0)
    core.workers[wid].jobs_done = jobs_done


def test_workers_that_answer_jobs_go_first_and_each_connection_keeps_its_order():
    msgs = [[F(b"new"), F(b"hello")], [F(b"idle"), F(b"hb1")], [F(b"real"), F(b"reply1")],
            [F(b"new"), F(b"ready")], [F(b"real"), F(b"reply2")], [F(b"idle"), F(b"hb2")]]
    d, core, handled = daemon_with(msgs)
    try:
        bind(d, core, b"real", "real", jobs_done=3)
        bind(d, core, b"idle", "idle", jobs_done=0)
        d._receive_batch()
        assert handled[:2] == [(b"real", b"reply1"), (b"real", b"reply2")], "the training worker first"
        rest = handled[2:]
        assert [m for r, m in rest if r == b"new"] == [b"hello", b"ready"]
        assert [m for r, m in rest if r == b"idle"] == [b"hb1", b"hb2"]
        assert not d.backlog and not d.backlogged and d.backlog_bytes == 0
    finally:
        d.close()


def test_a_connection_with_backlogged_messages_stays_behind_them():
    """A worker that became urgent while its earlier messages wait keeps its order: the new
    message joins the backlog behind them."""
    d, core, handled = daemon_with([])
    try:
        bind(d, core, b"w", "w", jobs_done=1)
        d.backlog.append([F(b"w"), F(b"old")])
        d.backlogged[b"w"] = 1
        it = iter([[F(b"w"), F(b"new")]])
        d.transport.pending = lambda: it
        d._receive_batch()
        assert handled == [(b"w", b"old"), (b"w", b"new")]
    finally:
        d.close()


def test_a_message_that_issues_a_burst_of_jobs_pauses_the_backlog_for_the_training_workers():
    """A job hoarder's ready sends 64 jobs (here: 5 ms of the daemon's clock). Right after one,
    while a worker that trains was just served, the backlog waits for half that cost: the next
    pass handles the training worker's reply and nothing of the backlog, and the loop's poll
    waits for the pause's end, not 0. Cheap messages (a heartbeat: no burst) never pause it,
    and with no training worker active a burst does not either."""
    now = [0.0]
    d, core, handled = daemon_with([])
    d.clock = lambda: now[0]
    d.next_hb = d.next_progress = 100.0  # no other deadline of the loop's

    def on_frames(frames):
        handled.append((frames[0].bytes, frames[1].bytes))
        if frames[1].bytes.startswith(b"ready"):  # a hoarder's ready: 64 jobs, 5 ms
            d.sends += 64
            now[0] += 0.005
        else:
            d.sends += 1
            now[0] += 0.0001

    d._on_frames = on_frames

    def feed(*msgs):
        it = iter([[F(r), F(m)] for r, m in msgs])
        d.transport.pending = lambda: it

    try:
        bind(d, core, b"real", "real", jobs_done=3)
        feed((b"real", b"reply1"), (b"h1", b"ready1"), (b"h2", b"ready2"))
        d._receive_batch()
        assert handled == [(b"real", b"reply1"), (b"h1", b"ready1")], "one costly message, then the pause"
        assert d.backlog_paused_until == now[0] + 0.0025
        assert d._timeout_ms(now[0]) >= 2, "the loop waits for the training workers' messages"
        handled.clear()
        feed((b"real", b"reply2"))
        d._receive_batch()
        assert handled == [(b"real", b"reply2")], "during the pause only the training worker is served"
        now[0] += 0.003  # the pause is over
        handled.clear()
        feed()
        d._receive_batch()
        assert handled == [(b"h2", b"ready2")]

        # No training worker served within TRAINING_RECENT_S: bursts do not pause the backlog.
        now[0] += 1.0
        handled.clear()
        paused = d.backlog_paused_until
        feed((b"h3", b"ready3"), (b"h4", b"ready4"))
        d._receive_batch()
        assert handled == [(b"h3", b"ready3")], "a slice ends after BACKLOG_SLICE_S"
        assert d.backlog_paused_until == paused and d._timeout_ms(now[0]) == 0, "no pause"
        feed()
        d._receive_batch()
        assert handled[1:] == [(b"h4", b"ready4")]
    finally:
        d.close()


def test_identical_heartbeats_queued_in_a_row_are_one():
    """A connection with messages in the backlog: a heartbeat byte for byte the one it queued
    last, with nothing in between, is dropped unread and counted as a repeat (the queued one
    refreshes the worker's liveness when it is handed on). A heartbeat that says something else,
    or one after another message, is queued: the connection's order and content are kept.
    Without this a server that fell behind queued every repeat (tests/integration/
    test_attack_scale.py: a backlog full of them, the real workers at a quarter of their rate)."""
    from protocol.codec import encode
    from protocol.messages import Heartbeat

    def hb(seen: int) -> bytes:
        return bytes(encode(Heartbeat(boot=7, credit=1, busy=(), seen=seen))[0])

    x, y = hb(-1), hb(3)
    sent = [b"hello", x, x, x, y, y, b"reply", y, x, x]
    d, core, handled = daemon_with([[F(b"idle"), F(m)] for m in sent])
    try:
        bind(d, core, b"idle", "idle", jobs_done=0)  # not urgent: everything goes to the backlog
        repeats = d.conns.counters.hb_repeats
        while True:
            d._receive_batch()
            if not d.backlog:
                break
        assert [m for _, m in handled] == [b"hello", x, y, b"reply", y, x]
        assert d.conns.counters.hb_repeats - repeats == 4
        assert not d.backlog_hb and not d.backlogged, "nothing kept once the connection's backlog is empty"
    finally:
        d.close()


def _hb(busy: int) -> bytes:
    from protocol.codec import encode
    from protocol.messages import Heartbeat

    return bytes(encode(Heartbeat(boot=7, credit=1, busy=(busy,), seen=-1))[0])


def test_one_connections_heartbeat_flood_costs_its_sender_not_the_real_workers():
    """Issue 29, point 3: one connection (a worker that answered jobs: its messages go ahead of
    the backlog) floods heartbeats whose bytes all differ (no repeat to drop). Within one pass
    of the clock only its connection's heartbeat budget (hb_burst) is handed on, the rest
    dropped unread and counted (``conn.hb_flood``), and of what it sent only URGENT_PER_PASS go
    ahead of the real worker's replies read in the same pass; its order is kept."""
    from ps.drivers.schedule import MAX_READS, URGENT_PER_PASS

    flood = [[F(b"flood"), F(_hb(i))] for i in range(1000)]
    msgs = flood[:100] + [[F(b"real"), F(b"reply1")]] + flood[100:200] + [[F(b"real"), F(b"reply2")]] + flood[200:]
    d, core, handled = daemon_with(msgs)
    d.clock = lambda: 5.0  # one instant: no token refills
    try:
        bind(d, core, b"real", "real", jobs_done=3)
        bind(d, core, b"flood", "flood", jobs_done=3)
        budget = int(d.conns.limits.hb_burst)
        assert URGENT_PER_PASS < budget < 100
        for _ in range(len(msgs) // MAX_READS + 2):  # a pass reads at most MAX_READS
            d._receive_batch()
        while d.backlog:
            d._receive_batch()
        from_flood = [m for r, m in handled if r == b"flood"]
        assert from_flood == [_hb(i) for i in range(budget)], "its budget, in its order"
        assert d.conns.counters.hb_flood == 1000 - budget
        ahead = handled.index((b"real", b"reply2"))
        assert handled.index((b"real", b"reply1")) <= URGENT_PER_PASS and ahead <= URGENT_PER_PASS + 1
    finally:
        d.close()


def test_a_connections_heartbeats_get_its_rate_over_time():
    """The budget refills at ``hb_rate``: a worker heartbeating as told (every 0.5 s) is never
    touched; a flood gets hb_rate per second handed on."""
    now = [0.0]
    d, core, handled = daemon_with([])
    d.clock = lambda: now[0]
    try:
        bind(d, core, b"w", "w", jobs_done=1)
        rate = d.conns.limits.hb_rate
        for k in range(40):  # a polite worker: 20 s, a heartbeat each 0.5 s
            now[0] = k * 0.5
            it = iter([[F(b"w"), F(_hb(k))]])  # what the socket holds: received once
            d.transport.pending = lambda it=it: it
            d._receive_batch()
        assert len(handled) == 40 and d.conns.counters.hb_flood == 0
        handled.clear()
        for k in range(2000):  # a flood: 1,000/s for 2 s
            now[0] = 20.0 + k * 0.001
            it = iter([[F(b"w"), F(_hb(10_000 + k))]])
            d.transport.pending = lambda it=it: it
            d._receive_batch()
        assert len(handled) <= d.conns.limits.hb_burst + 2.0 * rate + 1
    finally:
        d.close()


def test_the_stop_check_reads_each_limit_it_has():
    """_check_stop reads the version and the last loss only where the condition limits them:
    each limit still stops the run, and a condition without limits never does."""
    from types import SimpleNamespace

    from ps.drivers.daemon import StopCondition

    d, core, _ = daemon_with([])
    try:
        d.evals.evaluations.append({"loss": 0.5})
        d.core = SimpleNamespace(version=7)
        for stop, why in [(StopCondition(), None), (StopCondition(max_time_s=1e9), None),
                          (StopCondition(max_steps=8, target_loss=0.1), None),
                          (StopCondition(max_steps=7), "reached 7 steps"), (StopCondition(max_time_s=1e-9), "ran for"),
                          (StopCondition(target_loss=0.5), "loss 0.5 <= target")]:
            d.stop, d.stopping = stop, None
            assert d._check_stop() is (why is not None) and (why is None or why in d.stopping), stop
    finally:
        d.core = core
        d.transport.close()


def test_a_repeat_of_the_heartbeat_handed_on_is_dropped_before_it_is_queued():
    """A connection with nothing in the backlog whose last message handed on was a heartbeat:
    the same bytes again (within hb_refresh_s) are dropped unread and counted; other bytes, or
    the same after another message was handed on, are taken."""
    x, y = _hb(1), _hb(2)
    d, core, handled = daemon_with([[F(b"real"), F(m)] for m in (x, y, b"reply", x)])
    try:
        bind(d, core, b"real", "real", jobs_done=3)
        c = d.conns.by_rid[b"real"]
        d.conns.handed_on(c, x, 0.0)
        repeats = d.conns.counters.hb_repeats
        schedule = d.schedule
        assert schedule._admit(b"real", [F(b"real"), F(x)], False, 0.1) is False
        assert d.conns.counters.hb_repeats - repeats == 1
        assert schedule._admit(b"real", [F(b"real"), F(y)], False, 0.1) is c
        d.conns.handed_on(c, None, 0.2)  # a reply handed on: the next heartbeat is taken whatever it says
        assert schedule._admit(b"real", [F(b"real"), F(x)], False, 0.3) is c
        assert d.conns.counters.hb_repeats - repeats == 1
    finally:
        d.close()
