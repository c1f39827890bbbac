"""Who may be a shard (issue 28): the coordinator's hub admits a ``shello`` only with the run's
shard token, never hands a slot whose holder lives to another peer (a probe tells a holder that
is gone at once), and drops a shard that disagrees, holding the run until a holder of its slot
agrees. The token file: made 0600 once, read back, a damaged or lost one a one-line error."""

from __future__ import annotations

import logging
import os
import stat
import time

import pytest
import zmq

from ps.core.spec import TrainingSpec
from ps.drivers.server import StateOptions, _new_run
from ps.journal.inputs import CoreInputs
from ps.journal.persistence import Persistence
from ps.journal.statedir import StateError
from ps.sharded.control import pack, unpack
from ps.sharded.hub import ShardHub
from ps.sharded.hub_admit import TOKEN_FILE, run_token

CORE_KW = {"batch_size": 1, "liveness_timeout": 3.0, "heartbeat_interval": 0.5, "min_workers": 1,
           "round_period": None, "seed": 0}


@pytest.fixture
def hub(tmp_path):
    spec = TrainingSpec("synthetic", {"d": 12, "blocks": 3}, "asgd", {"lr": 0.1})
    d = tmp_path / "c"
    d.mkdir()
    _run, core, _problem, journal = _new_run(StateOptions(str(d)), spec, 1, "f32", CORE_KW, shards=2)
    inputs = CoreInputs(core, Persistence(str(d), journal))
    journal.sync()
    h = ShardHub(zmq.Context.instance(), "tcp://127.0.0.1:0", 2, core=core, persist=inputs.persist,
                 ranges=((0, 6), (6, 12)), clock=time.monotonic)
    socks = []

    def peer() -> zmq.Socket:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.linger = 0
        s.connect(h.endpoint)
        socks.append(s)
        return s

    yield h, peer
    for s in socks:
        s.close(linger=0)
    h.close()


def shello(sock: zmq.Socket, hub: ShardHub, index: int, token: str, now: float) -> dict | None:
    """``shello`` for ``index`` from ``sock``: the hub's first answer (recs probes skipped), None if none."""
    sock.send(pack("shello", index=index, run_id=hub.core.cfg.run_id, boot=1, endpoint="tcp://127.0.0.1:7",
                   applied=-1, ckpt=-1, token=token))
    assert hub.sock.poll(5000)
    hub.receive(now)
    while sock.poll(300):
        m = unpack(sock.recv(), ("swelcome", "refuse", "recs"))
        if m["t"] != "recs":
            return m
    return None


def progress(sock: zmq.Socket, hub: ShardHub, version: int, applied_count: int, now: float) -> None:
    sock.send(pack("progress", applied=hub.persist.journal.next_lsn - 1, ckpt=-1, version=version,
                   applied_count=applied_count, rss=0, blocks=0, records_s=0.0, endpoint=""))
    assert hub.sock.poll(5000)
    hub.receive(now)


def test_a_shello_needs_the_runs_token_and_a_flood_of_wrong_ones_is_one_line(hub, caplog):
    h, peer = hub
    assert len(h.token) == 64
    fake = peer()
    caplog.set_level(logging.WARNING, "latecomer.shards")
    for token in ("", "0" * 64, h.token[:-1]):
        m = shello(fake, h, 0, token, 1.0)
        assert m is not None and m["t"] == "refuse" and "shard token" in m["message"], m
    for _ in range(50):
        assert shello(fake, h, 0, "x", 2.0)["t"] == "refuse"
    assert all(s.rid is None and not s.connected and not s.endpoint for s in h.slots)  # nothing changed
    lines = [r.getMessage() for r in caplog.records if "shard token" in r.getMessage()]
    assert len(lines) == 1 and "b'" in lines[0] and "tcp://127.0.0.1:7" in lines[0], lines  # the peer, once per 10 s
    assert h.gate.counts["bad_token"] == 53
    m = shello(fake, h, 0, h.token, 3.0)
    assert m["t"] == "swelcome" and m["index"] == 0


def test_a_live_slot_is_never_handed_over_and_a_dead_holders_is_at_once(hub):
    h, peer = hub
    real, fake = peer(), peer()
    assert shello(real, h, 0, h.token, 1.0)["t"] == "swelcome"
    held = h.slots[0].rid
    for now in (1.5, 2.0, 3.9):  # the token leaked, the run id is public: still not while the holder lives
        assert shello(fake, h, 0, h.token, now) is None
        assert h.slots[0].rid == held and h.slots[0].endpoint == "tcp://127.0.0.1:7"
    assert h.gate.counts["slot_live"] == 3
    real.close(linger=0)  # the holder is gone (kill -9): a shello takes the slot at once, within the liveness
    deadline, now, m = time.monotonic() + 5, 4.0, None
    while m is None and time.monotonic() < deadline:
        now += 0.3
        h.slots[0].last_seen = now - 0.1  # heard from just now: only the probe can tell it is gone
        m = shello(fake, h, 0, h.token, now)
    assert m is not None and m["t"] == "swelcome" and h.slots[0].rid != held


def test_a_disagreeing_shard_is_dropped_and_the_run_held_until_its_slot_agrees(hub, caplog):
    h, peer = hub
    bad, good = peer(), peer()
    assert shello(bad, h, 0, h.token, 1.0)["t"] == "swelcome"
    caplog.set_level(logging.ERROR, "latecomer.shards")
    core = h.core
    progress(bad, h, core.version + 7, core.counters.applied, 1.1)
    assert bad.poll(2000)
    m = unpack(bad.recv(), ("refuse",))
    assert "shard 0 disagrees" in m["message"]
    assert not h.slots[0].connected and h.slots[0].rid is None and h.slots[0].disagrees
    assert [r.getMessage() for r in caplog.records if "shard 0 disagrees" in r.getMessage()]
    assert h.hold_reason().startswith("shard 0 disagrees with the coordinator")
    assert "DISAGREES" in h.figures()["shard.0"] and h.summary()[0]["disagrees"]
    progress(bad, h, core.version, core.counters.applied, 1.2)  # its rid is no longer bound: ignored
    assert h.slots[0].disagrees
    assert shello(good, h, 0, h.token, 1.3)["t"] == "swelcome"  # a new holder: held until it agrees
    assert "disagrees" in h.hold_reason()
    progress(good, h, core.version, core.counters.applied, 1.4)
    assert not h.slots[0].disagrees and "disagrees" not in h.hold_reason()
    # The shard's own refuse (it cannot go on) drops it the same way
    good.send(pack("refuse", message="out of memory"))
    assert h.sock.poll(5000)
    h.receive(1.5)
    assert h.hold_reason().startswith("shard 0 cannot go on: out of memory") and not h.slots[0].connected


def test_the_token_file_is_made_once_private_and_a_damaged_or_lost_one_is_one_line(tmp_path):
    d = str(tmp_path)
    token = run_token(d, "shards.json")
    path = os.path.join(d, TOKEN_FILE)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(token) == 64
    assert run_token(d, "shards.json") == token  # stable across restarts
    with open(path, "w") as f:
        f.write("not a\ttoken\n")
    with pytest.raises(StateError, match="not a shard token"):
        run_token(d, "shards.json")
    os.remove(path)
    (tmp_path / "shards.json").write_text("{}")
    with pytest.raises(StateError, match="missing and shards of this run have joined"):
        run_token(d, "shards.json")
