"""Issue 13, points 1 and 2: attacks below the protocol, on the ZMTP wire (no hello needed).

1. **The libzmq abort.** A burst of ``status?`` requests on one connection fills the daemon's
   receive pipe (libzmq stops reading that connection); PING commands queued behind the burst
   and a TCP reset then make libzmq 4.3.5 abort the process (``Assertion failed: !_io_error
   (stream_engine_base.cpp:310)``) when it answers the PING, or when its own heartbeat timer
   fires (ps/net/front.py explains; ``python -m tests.integration.repro_libzmq_abort`` reproduces it
   against ``serve --no-supervise``, where it aborts on the first try). Through the front, no
   reset reaches the daemon: the same process serves on, however often it is tried.
   Should the daemon die anyway, the supervisor restarts it from ``--state``: a SIGABRT sent
   to it stands for any such crash, and the gap is measured.
2. **Unfinished multipart messages.** One message of 64 KiB frames flagged MORE forever (the
   issue: 52 -> 1,081 MB in 10 s), and many connections each stalled inside a message: the
   front cuts a connection whose unfinished message passes the largest message a worker
   sends, and all connections' unfinished messages together are bounded by
   ``--max-unfinished-bytes``.

RSS bounds (serve's processes together, against their baseline): 30 MiB where nothing may be
held (the harmless client's bound in test_attack_harness.py); 30 MiB plus the budget where the
budget may be filled on purpose.
"""

from __future__ import annotations

import os
import signal
import struct
import time

import pytest
import zmq

from protocol.codec import encode
from protocol.messages import MAX_HEADER_BYTES, StatusRequest
from ps.ops.status import fetch_status
from tests.integration.attack import Victim
from tests.integration.zmtp_raw import ZmtpClient, command, frame_header

pytestmark = [pytest.mark.slow, pytest.mark.attack]

D = 32  # the victim's problem size: the largest message a worker sends is MAX_HEADER_BYTES + 2 * 8 * D
LARGEST = MAX_HEADER_BYTES + 2 * 8 * D
QUIET_MB = 30  # nothing may be held: the harmless client's bound


def status_burst(n: int = 5000) -> bytes:
    """``n`` status requests as ZMTP frames with a PING command after every 100 (the daemon's
    engine answers a PING at once, even with its input stopped)."""
    req = bytes(encode(StatusRequest(token=1))[0])
    ping = command(b"PING", struct.pack(">H", 0))
    return ((frame_header(len(req)) + req) * 100 + ping) * (n // 100)


def burst_and_reset(endpoint, running, tries: int = 8):
    """The issue's attack, both ways: a raw ZMTP connection that sends a burst and resets
    (SO_LINGER 0), and a plain DEALER that sends a burst and exits without reading its answers
    (its close resets the connection: unread data). Between tries the daemon's pipe drains."""
    blob = status_burst()
    done = {"raw": 0, "dealer": 0}
    for i in range(tries):
        if not running():
            break
        if i % 2 == 0:
            c = ZmtpClient(endpoint)
            c.sock.sendall(blob)
            time.sleep(0.05)  # the daemon's pipe is full by now
            c.reset()
            done["raw"] += 1
        else:
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.HEARTBEAT_IVL, 50)  # it sends PINGs too
            s.sndhwm = 0
            s.connect(endpoint)
            for _ in range(5000):
                s.send_multipart(encode(StatusRequest(token=2)), copy=False)
            time.sleep(0.3)  # its answers arrive and stay unread
            s.close(0)
            ctx.term()
            done["dealer"] += 1
        time.sleep(0.4)  # the aborts came within a second of the reset
    return done


def test_status_burst_and_reset_leave_the_daemon_running(procs, tmp_path):
    victim = Victim(procs, tmp_path, d=D)
    daemon = victim.daemon_pid()
    report = victim.measure(burst_and_reset, seconds=10)
    print(report.summary())
    report.check(rss_bound_mb=QUIET_MB)
    assert victim.daemon_pid() == daemon, "the daemon was restarted: it died"
    assert report.attack == {"raw": 4, "dealer": 4}
    summary = victim.finish()
    assert summary["counters"]["applied"] >= 150


def abort_the_daemon(victim: Victim):
    """Kill the daemon with SIGABRT (what the libzmq assertion does) and time the supervisor's
    restart: until the new daemon answers, and until it applies the real workers' updates."""

    def attack(endpoint, running):
        old = victim.daemon_pid()
        t0 = time.monotonic()
        os.kill(old, signal.SIGABRT)
        figures = {}
        resumed_at = None
        while running() and time.monotonic() - t0 < 30:
            try:
                st = fetch_status(endpoint, timeout_s=0.3)
            except TimeoutError:
                continue
            pid = victim.daemon_pid()
            if pid == old:  # the old daemon answered before it died
                continue
            if resumed_at is None:
                figures["answers_after_s"] = round(time.monotonic() - t0, 3)
                resumed_at = st.info["version"]
            elif st.info["version"] > resumed_at:
                figures["trains_after_s"] = round(time.monotonic() - t0, 3)
                break
            time.sleep(0.02)  # polling interval
        while running():
            time.sleep(0.05)  # the rest of the window: the workers' rate after the restart counts too
        return figures

    return attack


def test_a_dead_daemon_is_restarted_from_its_state(procs, tmp_path):
    victim = Victim(procs, tmp_path, d=D)
    old = victim.daemon_pid()
    report = victim.measure(abort_the_daemon(victim), seconds=6)
    print(report.summary())
    assert victim.daemon_pid() != old
    assert report.attack.get("trains_after_s", 99) < 3.0, report.attack  # the gap
    report.check(rss_bound_mb=QUIET_MB)  # rate over the whole window, gap included
    summary = victim.finish()  # accounting and exact replay across the two incarnations
    assert summary["counters"]["applied"] >= 150
    err = victim.server.stderr.read().decode()
    assert "the server process died of SIGABRT: restarting it" in err, err[-2000:]
    assert "the server process is back" in err, err[-2000:]


def endless_multipart(endpoint, running):
    """One message of 64 KiB frames flagged MORE, forever; a new connection whenever one is cut."""
    body = bytes(64 * 1024)
    figures = {"connections": 0, "sent_mb": 0.0}
    sent = 0
    while running():
        c = ZmtpClient(endpoint)
        figures["connections"] += 1
        try:
            while running():
                c.send_frame(body, more=True)
                sent += len(body)
        except OSError:
            pass  # cut
        finally:
            c.close()
    figures["sent_mb"] = round(sent / 2**20)
    return figures


def stalled_multiparts(n: int):
    """``n`` connections, each inside a message just under the per-connection bound, left open."""

    def attack(endpoint, running):
        conns, cut = [], 0
        for _ in range(n):
            c = ZmtpClient(endpoint)
            c.send_frame(bytes(LARGEST - 1024), more=True)
            conns.append(c)
        while running():
            time.sleep(0.05)  # holding them
        for c in conns:
            try:
                c.sock.setblocking(False)
                if c.sock.recv(1) == b"":
                    cut += 1
            except BlockingIOError:
                pass
            except OSError:
                cut += 1
            c.close()
        return {"connections": n, "cut": cut}

    return attack


BUDGET_MB = 8


def test_unfinished_messages_are_bounded(procs, tmp_path):
    victim = Victim(procs, tmp_path, d=D, extra_serve=("--max-unfinished-bytes", str(BUDGET_MB << 20)))
    report = victim.measure(endless_multipart, seconds=4)
    print("endless multipart:", report.summary())
    assert report.attack["sent_mb"] > 100  # the 1 GB in 10 s, at this machine's pace
    report.check(rss_bound_mb=QUIET_MB)
    n = 2 * (BUDGET_MB << 20) // LARGEST  # twice what the budget holds
    report = victim.measure(stalled_multiparts(n), seconds=3)
    print("stalled multiparts:", report.summary())
    report.check(rss_bound_mb=QUIET_MB + BUDGET_MB)
    assert n // 3 <= report.attack["cut"] <= n - n // 3, report.attack  # about half cut: the budget
    victim.finish()
    err = victim.server.stderr.read().decode()
    assert f"cut a connection: a message of more than {LARGEST} bytes" in err, err[-2000:]
    assert "all connections' unfinished messages passed" in err, err[-2000:]
