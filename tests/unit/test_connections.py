"""The daemon's connection table (ps/net/connections.py), driven by a fake clock: records expire,
stay bounded in number and in memory, and the rates hold."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from protocol.errors import RemoteProtocolError
from protocol.messages import Part
from ps.net.connections import ConnectionLimits, Connections, RateLimitedLog, TokenBucket

MiB = 1 << 20


def table(**kw) -> Connections:
    return Connections(ConnectionLimits(**kw), now=0.0)


def part(xfer: int, index: int, count: int, nbytes: int) -> Part:
    return Part(xfer=xfer, index=index, count=count, data=np.zeros(nbytes, np.uint8))


def test_a_record_per_routing_id_created_on_first_message_and_forgotten_when_idle():
    t = table(idle_s=5.0)
    a = t.get(b"a", 0.0)
    assert t.get(b"a", 1.0) is a and len(t) == 1 and t.live == 0
    t.get(b"b", 2.0)
    t.expire(5.5)  # a was last heard at 1.0
    assert list(t.by_rid) == [b"a", b"b"]
    t.expire(6.0)
    assert list(t.by_rid) == [b"b"] and t.counters.expired == 1
    assert t.next_deadline() == 7.0
    t.expire(7.0)
    assert len(t) == 0 and t.next_deadline() == float("inf")


def test_a_live_worker_never_expires_its_record_idles_once_written_off_and_keeps_its_binding_a_while():
    t = table(idle_s=5.0)
    c = t.get(b"r", 0.0)
    t.bind(c, "w1", "K")
    t.set_live(c, True, 0.0)
    t.expire(100.0)
    assert t.by_wid["w1"] is c and t.live == 1 and t.workers_of_key("K") == 1
    t.release("w1", 100.0)  # timed out in the core: still recognised, now idle
    assert t.by_wid["w1"] is c and t.live == 0 and t.workers_of_key("K") == 0
    t.expire(104.0)
    assert t.by_wid["w1"] is c
    t.expire(105.0)
    assert "w1" not in t.by_wid and len(t) == 0


def test_idle_records_are_capped_least_recently_heard_first():
    t = table(max_idle=3, idle_s=1e9)
    for i in range(3):
        t.get(bytes([i]), float(i))
    t.get(b"\x00", 10.0)  # heard again: now the most recent
    live = t.get(b"L", 11.0)
    t.bind(live, "w", "")
    t.set_live(live, True, 11.0)
    for i in range(10, 20):
        t.get(bytes([i]), float(i + 20))
    assert len(t.idle) == 3 and t.counters.evicted == 10
    assert b"L" in t.by_rid, "a live worker's record is never evicted"
    assert set(t.idle) == {bytes([17]), bytes([18]), bytes([19])}
    assert len(t) == 4


def test_ten_thousand_hellos_then_write_offs_leave_nothing_behind():
    t = table(idle_s=6.0, max_idle=4096)
    for i in range(10_000):
        c = t.get(f"r{i}".encode(), i * 1e-4)
        t.bind(c, f"fake{i}", "")
        t.set_live(c, True, i * 1e-4)
    assert t.live == 10_000 and len(t.idle) == 0
    for i in range(10_000):
        t.release(f"fake{i}", 4.0)
    assert len(t.idle) == 4096 and len(t) == 4096, "idle records are capped"
    t.expire(10.0)
    assert len(t) == 0 and not t.by_wid and not t.key_live


def test_bind_moves_a_worker_to_its_new_routing_id_and_forget_frees_the_record():
    t = table()
    old, new = t.get(b"old", 0.0), t.get(b"new", 1.0)
    t.bind(old, "w", "K")
    t.set_live(old, True, 0.0)
    t.add_part(old, part(1, 0, 2, 100), 0.5)
    t.bind(new, "w", "K")  # the worker reconnected under another routing id
    t.set_live(new, True, 1.0)
    assert old.wid is None and old.xfer is None and t.xfer_total == 0
    assert t.by_wid["w"] is new and t.workers_of_key("K") == 1 and b"old" in t.idle
    t.forget("w")
    assert b"new" not in t.by_rid and "w" not in t.by_wid and t.workers_of_key("K") == 0


def test_workers_of_a_key_count_live_ones_only():
    t = table()
    for i in range(3):
        c = t.get(bytes([i]), 0.0)
        t.bind(c, f"w{i}", "K")
        t.set_live(c, True, 0.0)
    t.release("w1", 1.0)
    t.forget("w2")
    assert t.workers_of_key("K") == 1


def test_a_transfer_is_bounded_per_connection_and_freed_when_it_completes():
    t = table(transfer_bytes=4 * MiB)
    c = t.get(b"c", 0.0)
    t.add_part(c, part(1, 0, 2, 2 * MiB), 0.0)
    assert t.xfer_total == 2 * MiB and c.xfer_bytes == 2 * MiB
    t.add_part(c, part(1, 1, 2, 2 * MiB), 0.1)
    buf = t.take_transfer(c, 1, 4 * MiB)
    assert buf.nbytes == 4 * MiB and t.xfer_total == 0 and not t.xfers
    with pytest.raises(RemoteProtocolError, match="larger than"):
        for i in range(3):
            t.add_part(c, part(2, i, 3, 2 * MiB), 1.0)
    assert t.xfer_total == 0 and not t.xfers
    with pytest.raises(RemoteProtocolError, match="no parts"):
        t.take_transfer(c, 2, 10)


def test_a_new_transfer_replaces_the_unfinished_one_and_out_of_order_parts_drop_it():
    t = table()
    c = t.get(b"c", 0.0)
    t.add_part(c, part(1, 0, 3, 1000), 0.0)
    t.add_part(c, part(2, 0, 3, 300), 0.0)
    assert t.xfer_total == 300 and t.counters.transfers_dropped == 1
    with pytest.raises(RemoteProtocolError, match="out of order"):
        t.add_part(c, part(2, 2, 3, 300), 0.0)
    assert t.xfer_total == 0 and not t.xfers


def test_all_unfinished_transfers_together_are_bounded_the_least_recently_fed_go_first():
    t = table(transfer_bytes=4 * MiB, transfer_total_bytes=10 * MiB)
    conns = [t.get(bytes([i]), 0.0) for i in range(100)]
    for i, c in enumerate(conns):  # 100 connections, two 2 MiB parts each: 400 MiB asked
        t.add_part(c, part(1, 0, 3, 2 * MiB), i * 0.01)
        t.add_part(c, part(1, 1, 3, 2 * MiB), i * 0.01)
        assert t.xfer_total <= 10 * MiB
    assert t.xfer_total == 8 * MiB and set(t.xfers) == {bytes([98]), bytes([99])}
    assert t.counters.transfers_dropped == 98


def test_a_part_larger_than_the_whole_budget_is_refused():
    t = table(transfer_bytes=64 * MiB, transfer_total_bytes=3 * MiB)
    a, b = t.get(b"a", 0.0), t.get(b"b", 0.0)
    t.add_part(a, part(1, 0, 2, 2 * MiB), 0.0)
    with pytest.raises(RemoteProtocolError, match="more than"):
        t.add_part(b, part(1, 0, 2, 4 * MiB), 0.1)
    assert b.xfer is None and t.xfer_total == 2 * MiB, "nothing else was evicted for it"


def test_an_unfinished_transfer_times_out_and_goes_with_its_worker():
    t = table(transfer_timeout_s=10.0)
    a, b = t.get(b"a", 0.0), t.get(b"b", 0.0)
    t.bind(b, "wb", "")
    t.set_live(b, True, 0.0)
    t.add_part(a, part(1, 0, 2, 1000), 0.0)
    t.add_part(b, part(1, 0, 2, 1000), 5.0)
    assert t.next_deadline() == 10.0
    t.expire(10.0)
    assert a.xfer is None and b.xfer is not None and t.xfer_total == 1000
    t.release("wb", 6.0)
    assert b.xfer is None and t.xfer_total == 0 and t.counters.transfers_dropped == 2


def test_status_answers_are_rate_limited_per_connection_and_in_all_and_wait_their_turn():
    t = table(status_rate=1.0, status_burst=2.0, status_global_rate=10.0, status_global_burst=3.0)
    flood, person = t.get(b"flood", 0.0), t.get(b"person", 0.0)
    assert t.status_ask(flood, 1, 0.0) and t.status_ask(flood, 2, 0.0)  # the connection's burst
    assert not t.status_ask(flood, 3, 0.0)  # waits for the connection's next token (at 1.0)
    assert not t.status_ask(flood, 4, 0.0) and t.counters.status_dropped == 1  # one waits per connection
    assert t.status_ask(person, 9, 0.0)  # another connection: answered at once (global burst 3)
    assert not t.status_ask(person, 10, 0.0)  # global tokens gone: waits in line
    assert t.status_due(0.05) == []  # half a global token so far
    assert t.status_due(0.5) == [(b"person", 10)]
    assert t.status_due(0.9) == []
    assert t.status_due(1.0) == [(b"flood", 3)]
    assert t.counters.status_answered == 5


def test_a_flood_from_many_connections_gets_the_global_rate_and_a_newcomer_is_answered_in_turn():
    t = table(status_rate=5.0, status_burst=10.0, status_global_rate=50.0, status_global_burst=50.0)
    answered, now = 0, 0.0
    flooders = [t.get(bytes([i]), 0.0) for i in range(100)]
    person_answered_at = None
    person = None
    while now < 10.0:
        for i, c in enumerate(flooders):
            answered += t.status_ask(c, i, now)
        if now >= 5.0 and person is None:
            person = t.get(b"person", now)
            if t.status_ask(person, 42, now):
                person_answered_at = now
        due = t.status_due(now)
        answered += len(due)
        if (b"person", 42) in due:
            person_answered_at = now
        now += 0.01
    assert answered <= 50 + 50 * 10.0 + 1
    assert person_answered_at is not None and person_answered_at - 5.0 < 100 / 50 + 0.1


def test_error_answers_one_per_interval_per_connection_and_a_global_rate():
    t = table(error_interval_s=0.2, error_global_rate=1.0, error_global_burst=5.0)
    a = t.get(b"a", 0.0)
    assert t.may_answer_error(a, 0.0) and not t.may_answer_error(a, 0.1) and t.may_answer_error(a, 0.2)
    others = [t.get(bytes([i]), 0.3) for i in range(10)]
    assert sum(t.may_answer_error(c, 0.3) for c in others) == 3  # the global bucket: 5 - 2 used
    assert t.counters.errors_suppressed == 8


def test_token_bucket():
    b = TokenBucket(2.0, 3.0, 0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.ready_at(0.0) == 0.5 and not b.take(0.4) and b.take(0.5)
    assert b.ready_at(100.0) == 100.0 and b.tokens == 3.0


def test_rate_limited_log_says_how_many_lines_it_left_out(caplog):
    lg = RateLimitedLog(logging.getLogger("test.connections"), interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger="test.connections"):
        assert lg.warning("cap", 0.0, "refused %s", "a")
        assert not any(lg.warning("cap", 1.0 + i * 0.01, "refused %s", "b") for i in range(50))
        assert lg.warning("other", 2.0, "other")
        assert lg.warning("cap", 10.0, "refused %s", "c")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused a", "other", "refused c (50 more like it in the last 10 s not logged)"]


def test_a_repeated_heartbeat_is_dropped_only_while_it_says_nothing_new():
    """Connections.repeat_heartbeat: byte for byte the last heartbeat handed on, within
    hb_refresh_s of it, with nothing else from the connection in between."""
    t = table(hb_refresh_s=1.0)
    c = t.get(b"a", 0.0)
    hb, other = b"\x84hb-seen-5", b"\x84hb-seen-6"
    assert not t.repeat_heartbeat(c, hb, 0.0), "nothing handed on yet"
    t.handed_on(c, hb, 0.0)
    assert t.repeat_heartbeat(c, hb, 0.4) and t.repeat_heartbeat(c, hb, 0.99)
    assert not t.repeat_heartbeat(c, other, 0.5), "a different heartbeat (new seen, busy or credit) goes on"
    assert not t.repeat_heartbeat(c, hb, 1.0), "liveness is refreshed at least every hb_refresh_s"
    t.handed_on(c, hb, 1.0)
    t.handed_on(c, None, 1.2)  # a reply (or anything else) reached the core
    assert not t.repeat_heartbeat(c, hb, 1.3), "after another message the next heartbeat goes on"
    t.handed_on(c, b"x" * 513, 2.0)
    assert not t.repeat_heartbeat(c, b"x" * 513, 2.1), "large messages are not kept"
    assert not t.repeat_heartbeat(t.get(b"b", 2.0), hb, 2.1), "per connection"
    assert t.counters.hb_repeats == 2 and t.figures()["conn.hb_repeats"] == 2
    off = table()  # hb_refresh_s=0: never
    d = off.get(b"a", 0.0)
    off.handed_on(d, hb, 0.0)
    assert not off.repeat_heartbeat(d, hb, 0.1)


def test_the_server_heartbeats_three_times_per_liveness_timeout_at_most():
    from ps.core.config import CoreConfig
    from ps.drivers.daemon import server_heartbeat_period

    assert server_heartbeat_period(CoreConfig(heartbeat_interval_s=0.5, liveness_timeout_s=3.0)) == 1.0
    assert server_heartbeat_period(CoreConfig(heartbeat_interval_s=2.0, liveness_timeout_s=3.0)) == 2.0


def _flood(t: Connections, flooders: list, now: float, source=lambda i: "") -> int:
    """Every flooder asks again (one waits per connection); the answers given at once."""
    return sum(t.status_ask(c, i, now, source(i)) for i, c in enumerate(flooders))


@pytest.mark.parametrize("same_source", [False, True])
def test_the_operators_status_is_answered_first_during_a_flood_of_200_connections(same_source):
    """The issue's flood: 200 connections ask as fast as they can (their waiting requests fill the
    line at once); the operator's one request, from a connection never answered, is the next one
    answered, within one global token (0.02 s), whether the flooders come from one source (one
    host behind the front) as the operator or each from its own. Before, the line was ordered by
    when each connection's bucket filled, and the operator waited behind all 200 (4 s at 50/s)."""
    t = table()
    src = (lambda i: "ip:127.0.0.1") if same_source else (lambda i: f"ip:10.0.0.{i}")
    flooders = [t.get(i.to_bytes(2, "big"), 0.0) for i in range(200)]
    now, answered = 0.0, 0
    while now < 3.0:  # the flood settles into its pace: every flooder waits in line
        answered += _flood(t, flooders, now, src) + len(t.status_due(now))
        now += 0.01
    person = t.get(b"person", now)
    assert not t.status_ask(person, 42, now, "ip:127.0.0.1")  # the line is full: it takes its place
    waited = 0.0
    while True:
        _flood(t, flooders, now + waited, src)
        due = t.status_due(now + waited)
        if (b"person", 42) in due:
            break
        waited += 0.005
        assert waited < 1.0, "the operator's request was not answered"
    assert waited <= 1 / t.limits.status_global_rate + 0.01
    assert answered <= t.limits.status_global_burst + t.limits.status_global_rate * 3.0 + 1


def test_a_source_shares_one_bucket_and_authenticated_requests_go_first():
    """One source with 50 connections gets its source's rate, not 50 connections' worth; a
    request with a key of the allow-list is answered before every anonymous one waiting."""
    t = table(status_source_rate=10.0, status_source_burst=20.0)
    many = [t.get(bytes([i]), 0.0) for i in range(50)]
    answered = 0
    for k in range(100):  # one second at 0.01 s steps
        now = k * 0.01
        answered += _flood(t, many, now, lambda i: "ip:10.0.0.1") + len(t.status_due(now))
    assert answered <= 20 + 10 * 1.0 + 1  # the source's burst and rate, though the global allows 50/s
    t2 = table(status_global_rate=10.0, status_global_burst=1.0)
    anon = [t2.get(bytes([i]), 0.0) for i in range(20)]
    _flood(t2, anon, 0.0)
    keyed = t2.get(b"keyed", 0.0)
    assert not t2.status_ask(keyed, 7, 0.0, "key:abc", auth=True)
    assert t2.status_due(0.1) == [(b"keyed", 7)]


def test_waiting_requests_of_connections_that_went_do_not_pile_up():
    """100,000 connections ask once and go (idle records evicted): the line holds about one
    entry per record, however many asked."""
    t = table(max_idle=100, status_global_rate=1.0, status_global_burst=1.0)
    for i in range(100_000):
        c = t.get(i.to_bytes(4, "big"), 0.0)
        t.status_ask(c, i, 0.0, f"ip:{i}")
    assert len(t.status_ready) + len(t.status_wait) <= 2 * len(t) + 64 + 1
    assert len(t.sources) <= len(t)
