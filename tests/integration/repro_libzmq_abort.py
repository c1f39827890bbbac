"""Reproduce the libzmq 4.3.5 abort (issue 13, point 1) against a real ``latecomer serve``.

    python -m tests.integration.repro_libzmq_abort [--tries 8] [--no-supervise] [--bare]

Each try opens a raw ZMTP connection, sends a burst of ``status?`` requests with a PING command
after every 100 (``test_attack_zmtp.status_burst``), waits 50 ms (the daemon's receive pipe for
the connection is full by then: libzmq has stopped reading it) and resets the connection
(SO_LINGER 0). libzmq's ``in_event`` sees the reset with the input stopped and marks the engine
``_io_error``; once the application drains the pipe, ``restart_input`` decodes the queued PING
and answers it through ``out_event``, whose first line is ``zmq_assert (!_io_error)``: SIGABRT.
(The daemon's old ``ZMQ_HEARTBEAT_IVL`` timer reached ``out_event`` the same way, which is how a
plain DEALER exiting with its answers unread triggered it.)

``--no-supervise`` runs the daemon alone on the port (it aborts, here at the first try);
without it the front relays the connection and the daemon never sees the reset. ``--bare``
skips latecomer altogether: a pyzmq ROUTER with RCVHWM 10 that reads nothing for a while, which
shows the abort is libzmq's alone.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from tests.integration.test_attack_zmtp import status_burst
from tests.integration.zmtp_raw import ZmtpClient, command, frame_header


def bare() -> int:
    """libzmq alone: burst + PING + reset while the ROUTER's pipe is full; then read."""
    import zmq

    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.rcvhwm = 10
    port = r.bind_to_random_port("tcp://127.0.0.1")
    c = ZmtpClient(f"tcp://127.0.0.1:{port}")
    c.sock.sendall(((frame_header(5) + b"hello") * 50 + command(b"PING", b"\x00\x00")) * 20)
    time.sleep(0.2)  # the pipe is full
    c.reset()
    time.sleep(0.5)  # the reset is seen with the input stopped
    print("reset sent with the pipe full; reading now (libzmq aborts here)", flush=True)
    n = 0
    while r.poll(200):
        r.recv_multipart()
        n += 1
    print(f"alive: read {n} messages")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tries", type=int, default=8)
    ap.add_argument("--no-supervise", action="store_true")
    ap.add_argument("--bare", action="store_true")
    a = ap.parse_args()
    if a.bare:
        return bare()
    server = subprocess.Popen(
        [sys.executable, "-m", "ps", "serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic",
         "--problem-opt", "d=32", "--algorithm", "asgd", "--eval-every", "0", "--log-level", "warning",
         "--max-time", "300", *(["--no-supervise"] if a.no_supervise else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        endpoint = re.search(r"(tcp://\S+)", server.stdout.readline().decode()).group(1)
        blob = status_burst()
        t0 = time.monotonic()
        for i in range(a.tries):
            c = ZmtpClient(endpoint)
            c.sock.sendall(blob)
            time.sleep(0.05)  # the daemon's receive pipe is full by now
            c.reset()
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline and server.poll() is None:
                time.sleep(0.01)  # polling interval
            if server.poll() is not None:
                err = server.stderr.read().decode(errors="replace").strip().splitlines()
                print(f"try {i + 1}: the server died (exit {server.returncode}) "
                      f"{time.monotonic() - t0:.1f} s after the first: {err[-1] if err else ''}")
                return 1
            print(f"try {i + 1}: alive")
        print(f"alive after {a.tries} tries")
        return 0
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
