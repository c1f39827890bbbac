"""The sealed data connection (PROTOCOL.md §6.15) between a real supervised server under --keys and
real workers: training and replay are exact, jobs and replies travel sealed (in plaintext-sized
parts when large), and a replayed, tampered or token-less message is refused while training goes on."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zmq

from tests.integration.util import (
    keyed_synthetic_run,
    make_keys,
    read_events,
    synthetic_after,
    wait_events,
    wait_exit,
    wait_line,
)

pytestmark = pytest.mark.slow

LR = 0.5


def keyed_quadratic(procs, tmp_path, names: tuple[str, ...], start: tuple[str, ...], delay: str) -> tuple:
    """``serve --keys`` (allowed keys ``names``) on asgd and ``quadratic`` with an events file and a
    state directory, and a worker (``--delay``) for each of ``start``: (keys, events, state, the
    server, its endpoint, the workers)."""
    keys = make_keys(tmp_path, *names)
    events, state = str(tmp_path / "events.jsonl"), str(tmp_path / "state")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--keys", keys, "--problem", "quadratic",
                         "--algorithm", "asgd", "--set", "lr=0.05", "--events", events, "--max-time", "180",
                         "--eval-every", "0", "--state", state, "--log-level", "info")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    workers = tuple(procs.start("work", "--server", endpoint, "--worker-id", w, "--delay", delay,
                                "--key", f"{keys}/workers/{w}.key_secret", "--server-key", f"{keys}/server.key")
                    for w in start)
    return keys, events, state, server, endpoint, workers


@pytest.mark.parametrize("d, steps, parts, hand_over", [(500_000, 10, False, "auto"), (500_000, 10, False, "off"),
                                                        (4_500_000, 4, True, "auto")],
                         ids=["2MB-handed", "2MB-relayed", "18MB-in-parts-handed"])
def test_sealed_jobs_and_replies_train_and_replay_exactly(procs, tmp_path, d, steps, parts, hand_over):
    """With the hand-over (the default) the daemon reads the data connection itself; with
    ``--hand-over off`` the front relays it to the daemon's data ROUTER. Either way the same."""
    from ps.drivers.replay import replay_run

    keys, state = make_keys(tmp_path, "w"), str(tmp_path / "state")
    summary = keyed_synthetic_run(procs, keys, state, d, steps, LR, "--hand-over", hand_over)
    t = summary["transport"]
    assert summary["version"] == steps
    # the replies (with the heartbeats) came sealed and the jobs went sealed: the first one or two
    # of each may cross over CurveZMQ while the data connection comes up
    assert t["sealed_messages_in"] >= steps and t["sealed_messages_out"] >= steps - 2, t
    assert t["sealed_refused"] == 0, t
    # both ends said seal_segments: every sealed message went in segments (large frames' segments
    # sealed and opened on several threads), the worker's all opened as such
    assert t["sealed_sessions_in_segments"] == 1 and t["sealed_segmented_live_in"] == t["sealed_messages_in"], t
    if hand_over == "auto":  # every sealed message went over the connection handed to the daemon
        assert t["handed_in_all"] == 1 and t["handed_messages_in"] == t["sealed_messages_in"], t
        assert t["handed_messages_out"] == t["sealed_messages_out"], t
        assert t["handed_reads"] >= t["handed_messages_in"], t  # a read or more per message (PROFILE.md)
    else:
        assert "handed_in_all" not in t, t
    # AEGIS (where both ends have it) seals a message below 8 MiB a segment per frame, and the
    # daemon opens each reply's gradient (2 MB; a 4 MiB part) where its handed connection read it;
    # relayed (a ROUTER's frames) or under AES-GCM, into a buffer of its own
    aegis = t.get("sealed_offered_aegis256x4", 0) == 1
    assert aegis or not _aegis_here()
    in_place = t["sealed_in_place_live_in"]
    assert in_place >= (steps - 2) * (5 if parts else 1) if aegis and hand_over == "auto" else in_place == 0, t
    # ... and on its handed connections, AEGIS frames of 1 MiB and more (one segment) go out sealed as
    # they are written, and come in opened as they arrive (protocol/seal.py Streamed, Opener.early)
    streamed, early = t["sealed_streamed_live_out"], t["sealed_early_live_in"]
    if aegis and hand_over == "auto":
        assert streamed >= (steps - 2) * (5 if parts else 1) and early >= (steps - 2) * (5 if parts else 1), t
    else:
        assert streamed == early == 0, t
    if parts:  # 18 MB: plaintext parts of 4 MiB, each sealed as one message
        assert t["parts_in"] >= 5 * steps and t["parts_out"] >= 5 * (steps - 2), t
    else:  # 2 MB: below the plaintext threshold, one message each way sealed; CurveZMQ splits it in 2
        # parts, which only the first reply or two carry if they cross before the data connection is up
        assert t["parts_in"] <= 4, t
    x = np.load(os.path.join(state, "final_x.npy"))
    assert x.shape == (d,) and np.all(x == synthetic_after(steps, LR))
    assert np.array_equal(replay_run(state).final_x, x), "the journal replays exactly"


REQUIRE_AEGIS = os.environ.get("LATECOMER_REQUIRE_AEGIS") == "1"  # CI: pyaegis is installed (make setup)


def _aegis_here() -> bool:
    from protocol.seal import AEGIS, available_ciphers

    if AEGIS in available_ciphers():
        return True
    if REQUIRE_AEGIS:
        pytest.fail("LATECOMER_REQUIRE_AEGIS=1 but AEGIS-256X4 is not available (pyaegis)")
    return False


@pytest.mark.parametrize("choice, worker_env, d, expect", [
    ("auto", "", 200_000, "aegis256x4"),  # both ends can: the faster cipher
    ("auto", "", 1_000, "aes256gcm"),  # ... but for 4 KB arrays AES-GCM's cheaper calls
    ("aes256gcm", "", 200_000, "aes256gcm"),  # the server keeps AES-256-GCM
    ("auto", "aes256gcm", 200_000, "aes256gcm"),  # a worker without AEGIS gets AES-256-GCM
    ("aegis256x4", "aes256gcm", 200_000, ""),  # the server takes AEGIS only: that worker stays on CurveZMQ
])
def test_the_sessions_cipher_is_the_first_both_ends_can_use_and_training_is_exact(procs, tmp_path, choice,
                                                                                  worker_env, d, expect):
    """``serve --seal-cipher`` and the worker's hello.seal_ciphers (PROTOCOL.md §6.15): whichever
    cipher the session gets (or none), the same iterate as a plaintext run, and replay exact."""
    from ps.drivers.replay import replay_run

    if not _aegis_here():
        pytest.skip("AEGIS-256X4 is not available here (pip install 'latecomer[aegis]')")
    keys, state, steps = make_keys(tmp_path, "w"), str(tmp_path / "state"), 12
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--keys", keys, "--problem", "synthetic",
                         "--problem-opt", f"d={d}", "--algorithm", "asgd", "--set", f"lr={LR}", "--max-steps",
                         str(steps), "--eval-every", "0", "--state", state, "--shm", "off", "--seal-cipher", choice)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w", "--shm", "off",
                         "--key", f"{keys}/workers/w.key_secret", "--server-key", f"{keys}/server.key",
                         env={"LATECOMER_SEAL_CIPHERS": worker_env} if worker_env else None)
    assert wait_exit(server, timeout=180) == 0
    assert wait_exit(worker, timeout=20) == 0
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        t = json.load(f)["transport"]
    offered = {k.removeprefix("sealed_offered_"): v for k, v in t.items() if k.startswith("sealed_offered_")}
    if expect:  # one session, of that cipher; every reply after the first one or two came sealed
        assert offered == {expect: 1}, t
        assert t["sealed_messages_in"] >= steps and t["sealed_refused"] == 0, t
        # AEGIS opens each reply's gradient (800 KB: one segment) where the handed connection read it;
        # OpenSSL's AES-GCM cannot (it refuses overlapping buffers): into a buffer of the pool
        in_place = t["sealed_in_place_live_in"]
        assert (in_place >= steps - 2 if expect == "aegis256x4" and d >= 100_000 else in_place == 0), t
    else:  # no session: everything over CurveZMQ
        assert offered == {} and t.get("sealed_messages_in", 0) == 0, t
    x = np.load(os.path.join(state, "final_x.npy"))
    assert np.all(x == synthetic_after(steps, LR))
    assert np.array_equal(replay_run(state).final_x, x), "the journal replays exactly"


def test_a_replayed_tampered_or_tokenless_message_is_refused_and_training_goes_on(procs, tmp_path):
    """A client holding an allowed key (so it gets a session of its own) replays its own sealed
    heartbeat and sends a tampered one; a NULL client without a token sends a message. The server
    refuses the first two (counted), the front cuts the third before the daemon hears of it, and
    a real worker trains throughout."""
    from protocol.codec import decode, encode
    from protocol.messages import Heartbeat, Hello, Welcome
    from protocol.seal import Session, sealer_opener
    from worker.keys import client_keys

    keys, events, state, server, endpoint, (real,) = keyed_quadratic(procs, tmp_path, ("real", "probe"), ("real",),
                                                                     delay="0.01")
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 5, timeout=60)

    ctx = zmq.Context()
    try:
        curve = ctx.socket(zmq.DEALER)
        curve.linger = 0
        curve.curve_publickey, curve.curve_secretkey, curve.curve_serverkey = client_keys(
            f"{keys}/workers/probe.key_secret", f"{keys}/server.key")
        curve.connect(endpoint)
        curve.send_multipart(encode(Hello(worker_id="probe", boot=7, credit=1, seal=True)))
        welcome = None
        while welcome is None:  # the welcome (jobs may follow it)
            assert curve.poll(20_000), "no welcome"
            msg = decode(curve.recv_multipart(copy=False))
            welcome = msg if isinstance(msg, Welcome) else None
        assert welcome.seal, "a hello that asks under CurveZMQ gets a session"
        session = Session.unpack(bytes.fromhex(welcome.seal))
        up, _ = sealer_opener(session, server=False)
        data = ctx.socket(zmq.DEALER)
        data.linger = 0
        data.routing_id = session.token
        data.connect(endpoint)
        good = [bytes(memoryview(f)) for f in up.seal(encode(Heartbeat(boot=7, credit=1)))]
        data.send_multipart(good)
        assert data.poll(20_000), "the server answers on the data connection once a sealed message opened"
        data.send_multipart(good)  # a replay
        bad = [bytes(memoryview(f)) for f in up.seal(encode(Heartbeat(boot=7, credit=1)))]
        bad[1] = bad[1][:-1] + bytes([bad[1][-1] ^ 1])
        data.send_multipart(bad)  # tampered
        stranger = ctx.socket(zmq.DEALER)
        stranger.linger = 0
        stranger.connect(endpoint)  # NULL, no token
        stranger.send(b"hello?")
        n = len(read_events(events))
        wait_events(events, lambda ev: sum(e["ev"] == "applied" and e["worker_id"] == "real"
                                           for e in ev[n:]) >= 5, timeout=30)  # the real worker trains on
        for s in (curve, data, stranger):
            s.close()
    finally:
        ctx.destroy(linger=0)
    server.terminate()
    assert wait_exit(server, timeout=30) == 0
    assert wait_exit(real, timeout=20) == 0
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        t = json.load(f)["transport"]
    assert t["sealed_refused"] == 2, t  # the replay and the tampered copy; the stranger never reached the daemon
    assert t["sealed_messages_in"] > 5, t
    err = server.stderr.read().decode()
    assert "refused a sealed message" in err
    assert "a NULL connection without a token" in err


def test_a_reset_data_connection_reconnects_and_training_goes_on(procs, tmp_path):
    """The kernel resets the worker's sealed data connection mid-run (``ss -K``): the worker's
    socket reconnects with its token, the front passes it (it replaces the old one), the daemon
    hands the token over, and training goes on with the worker never written off."""
    import shutil
    import subprocess
    import time

    import psutil

    if shutil.which("ss") is None:
        pytest.skip("no ss(8)")
    keys = make_keys(tmp_path, "w")
    events, state = str(tmp_path / "events.jsonl"), str(tmp_path / "state")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--keys", keys, "--problem", "synthetic",
                         "--problem-opt", "d=100000", "--algorithm", "asgd", "--set", "lr=1e-9", "--events", events,
                         "--max-time", "120", "--eval-every", "0", "--state", state, "--shm", "off")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    port = int(endpoint.rsplit(":", 1)[1])
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w", "--shm", "off",
                         "--key", f"{keys}/workers/w.key_secret", "--server-key", f"{keys}/server.key")

    def conns() -> list:
        return sorted((c for c in psutil.Process(worker.pid).net_connections(kind="tcp")
                       if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED),
                      key=lambda c: c.fd)

    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 200 and len(conns()) == 2, timeout=60)
    curve, data = conns()  # the data connection is opened after the welcome: the later descriptor
    r = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}", "sport", "=",
                        f":{data.laddr.port}"], capture_output=True, timeout=10)
    deadline = time.monotonic() + 10
    while data.laddr.port in [c.laddr.port for c in conns()]:
        if r.returncode != 0 or time.monotonic() > deadline:
            pytest.skip(f"this kernel does not destroy sockets on request (ss -K: {r.stderr.decode()[:80]})")
        time.sleep(0.05)  # polling interval of a bounded wait
    n = len(read_events(events))
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev[n:]) >= 500, timeout=60)
    after = conns()
    assert len(after) == 2 and after[0].laddr == curve.laddr and after[1].laddr != data.laddr, (curve, data, after)
    server.terminate()
    assert wait_exit(server, timeout=30) == 0
    assert wait_exit(worker, timeout=20) == 0
    ev = read_events(events)
    left = [e for e in ev if e["ev"] == "left" and e.get("worker_id") == "w"]
    assert not left, left  # never written off (the hello after the drop refreshed the same incarnation)
    lost = [e for e in ev if e["ev"] == "lost"]
    assert len(lost) <= 2 and all(e["reason"] == "vanished" for e in lost), lost  # at most what was in flight
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        t = json.load(f)["transport"]
    # a reply sent on the reset connection and read after the worker's new hello (on the CURVE
    # connection) is one of the ended session: late, not refused, and at most what was in flight
    assert t["sealed_refused"] == 0 and t["sealed_stale"] <= 2 and t["sealed_messages_in"] > 700, t


def test_a_restarted_daemon_gives_new_sessions_and_nothing_accepted_is_lost(procs, tmp_path):
    """``kill -9`` of the daemon alone under ``--keys``: the supervisor starts a new one with a new
    token secret (the old sessions die with the old daemon, SECURITY.md). Each worker says hello
    again over CurveZMQ, gets a new session and trains on sealed. Nothing accepted is lost: the
    accounting identity and an exact replay of the journal hold across both incarnations."""
    import signal

    from ps.drivers.replay import replay_run
    from tests.integration.util import daemon_pid

    _, events, state, server, _, workers = keyed_quadratic(procs, tmp_path, ("a", "b"), ("a", "b"), delay="0.005")
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 30, timeout=60)
    old = daemon_pid(server)
    os.kill(old, signal.SIGKILL)
    n = len(read_events(events))
    # both workers have replies applied by the new daemon (its events follow the old one's)
    wait_events(events, lambda ev: min(sum(e["ev"] == "applied" and e["worker_id"] == w for e in ev[n:])
                                       for w in ("a", "b")) >= 30, timeout=90)
    assert daemon_pid(server) != old
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=60) == 0
    for w in workers:
        assert wait_exit(w, timeout=30) == 0
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    t = summary["transport"]  # the new daemon's figures
    # 60 replies applied by the new daemon: all but the first one or two per worker came sealed
    assert t["sealed_messages_in"] >= 56 and t["sealed_refused"] == 0, t
    assert summary["accounted"], summary["counters"]
    assert np.array_equal(replay_run(state).final_x, np.load(os.path.join(state, "final_x.npy"))), \
        "the journal replays exactly across both daemons"
    err = server.stderr.read().decode()
    assert "the server process died of SIGKILL: restarting it" in err, err[-2000:]
