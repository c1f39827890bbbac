"""Same-host path on real processes: workers use shared memory by themselves, a worker killed
(-9) half-way through writing its gradient and one that writes NaN change nothing, TCP workers
train alongside, and no shared-memory file outlives the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.conftest import REPO
from tests.integration.util import daemon_pid, read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

D = 70_000  # above the pool's threshold: iterates are born in shared memory

# A worker that follows the protocol up to its first shared-memory job, then misbehaves:
# MODE=half: writes garbage into half of its gradient slot and kills itself (-9) without replying;
# MODE=nan: writes a NaN gradient and replies in_shm.
HOSTILE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np, zmq
    from protocol.codec import decode, encode
    from protocol.messages import Hello, Job, Ready, Reply, Welcome
    from protocol.shm import ShmReader, host_id
    endpoint, mode = sys.argv[1], sys.argv[2]
    ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.linger = 1000; s.connect(endpoint)
    s.send_multipart(encode(Hello(worker_id="hostile-" + mode, boot=7, credit=1, host_id=host_id(), shm=True)))
    reader = None
    while True:
        if not s.poll(30000):
            sys.exit("no message from the server")
        msg = decode(s.recv_multipart())
        if isinstance(msg, Welcome):
            assert msg.shm, "the server offered no shared memory"
            reader = ShmReader(msg.shm)
            assert reader.probe(msg.server_boot) is None
            s.send_multipart(encode(Ready(credit=1, shm=True)))
        elif isinstance(msg, Job):
            assert msg.refs and msg.grad_slots and not msg.points
            g = reader.view(msg.grad_slots[0], writable=True)
            if mode == "half":
                g[: g.size // 2] = 1e30
                print("wrote half", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            g[:] = np.nan
            s.send_multipart(encode(Reply(job_id=msg.job_id, created_at=msg.created_at, grads=(), in_shm=True)))
            print("sent nan", flush=True)
            while s.poll(10000):
                print("answer", type(decode(s.recv_multipart())).__name__, flush=True)
            break
""")


def shm_files(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"latecomer-{pid:x}-")]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_same_host_path_with_a_killed_writer_a_nan_writer_and_a_tcp_worker(procs, tmp_path):
    events = str(tmp_path / "events.jsonl")
    out = str(tmp_path / "out")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt",
                         f"d={D}", "--algorithm", "asgd", "--set", "lr=0.5", "--batch-size", "1",
                         "--max-time", "120", "--liveness-timeout", "2", "--heartbeat-interval", "0.25",
                         "--min-workers", "2", "--events", events, "--out", out, "--eval-every", "20")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    procs.start("work", "--server", endpoint, "--worker-id", "near", "--delay", "0.005")
    procs.start("work", "--server", endpoint, "--worker-id", "far", "--shm", "off", "--delay", "0.005")
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 30, timeout=90)
    daemon = daemon_pid(server)  # the shared memory is named after the process that owns the socket
    assert len(shm_files(daemon)) >= 2  # probe + slots

    env = dict(os.environ, PYTHONPATH=REPO)
    half = subprocess.Popen([sys.executable, "-c", HOSTILE, endpoint, "half"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=REPO)
    procs.children.append(half)
    assert wait_exit(half, timeout=60) == -signal.SIGKILL, half.stderr.read()[-2000:]
    assert b"wrote half" in half.stdout.read()
    nan = subprocess.Popen([sys.executable, "-c", HOSTILE, endpoint, "nan"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=env, cwd=REPO)
    procs.children.append(nan)
    assert wait_exit(nan, timeout=60) == 0, nan.stderr.read()[-2000:]
    assert b"answer Error" in nan.stdout.read()

    wait_events(events, lambda ev: [e for e in ev if e["ev"] == "lost" and e["worker_id"] == "hostile-half"],
                timeout=30)
    n = len(read_events(events))
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev[n:]) >= 20, timeout=60)
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    assert shm_files(daemon) == []  # nothing outlives the server

    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    c = summary["counters"]
    t = summary["transport"]
    assert "near" in t["shm_workers"] and "far" not in t["shm_workers"]
    assert {"hostile-half", "hostile-nan"} <= set(t["shm_workers"])
    ev = read_events(events)
    rejected = [e for e in ev if e["ev"] == "rejected"]
    assert [e["worker_id"] for e in rejected] == ["hostile-nan"] and "NaN" in rejected[0]["message"]
    assert not [e for e in ev if e["ev"] == "applied" and e["worker_id"].startswith("hostile")]
    for w in ("near", "far"):
        assert sum(e["ev"] == "applied" and e["worker_id"] == w for e in ev) >= 5
    assert c["issued"] == c["applied"] + c["dropped"] + c["lost"] + c["failed"] + c["cancelled"] + c["rejected"] \
        + summary["outstanding"]
    x = np.load(os.path.join(out, "final_x.npy"))
    assert x.shape == (D,) and np.isfinite(x).all() and np.abs(x).max() < 1e6  # no 1e30, no NaN got in
    evals = summary["evaluations"]
    assert evals[-1]["loss"] < evals[0]["loss"]


def _private_shm_ok() -> bool:
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True,
                           timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not _private_shm_ok(),
                    reason="needs root for a mount namespace with its own /dev/shm")
def test_a_worker_that_cannot_see_the_shared_memory_falls_back_to_tcp(procs, tmp_path):
    """Same host id, but the worker lives in a mount namespace with its own /dev/shm (as in a
    container): the server offers the path, the worker's probe fails, and it trains over TCP."""
    events, out = str(tmp_path / "events.jsonl"), str(tmp_path / "out")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt",
                         "d=64", "--algorithm", "asgd", "--set", "lr=0.2", "--max-time", "120", "--min-workers", "2",
                         "--events", events, "--out", out, "--eval-every", "20")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    procs.start("work", "--server", endpoint, "--worker-id", "host", "--delay", "0.002")
    boxed = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" -m ps work --server "$1" '
         '--worker-id boxed --delay 0.002 --log-level info', sys.executable, endpoint],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    procs.children.append(boxed)
    wait_events(events, lambda ev: sum(e["ev"] == "applied" and e["worker_id"] == "boxed" for e in ev) >= 20
                and sum(e["ev"] == "applied" and e["worker_id"] == "host" for e in ev) >= 20, timeout=90)
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    assert wait_exit(boxed, timeout=20) == 0
    err = boxed.stderr.read().decode()
    assert "same-host path unavailable (cannot open the server's shared memory" in err, err[-2000:]
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        t = json.load(f)["transport"]
    assert t["shm_workers"] == ["host"]  # the boxed worker never got a shared-memory job


def _fake_machine_id_ok(tmp) -> bool:
    fake = os.path.join(tmp, "machine-id")
    with open(fake, "w", encoding="ascii") as f:
        f.write("another-host\n")
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {fake} /etc/machine-id"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and os.path.exists("/etc/machine-id")


@pytest.mark.parametrize("mode", ["auto", "any"])
def test_a_worker_with_another_host_id_gets_the_path_only_with_shm_any(procs, tmp_path, mode):
    """The worker sees this /dev/shm but reports another machine id (as a container would):
    `--shm auto` does not offer it the path, `--shm any` does and its probe succeeds."""
    if not os.path.isdir("/dev/shm") or not _fake_machine_id_ok(str(tmp_path)):
        pytest.skip("needs root for a mount namespace with another /etc/machine-id")
    events, out = str(tmp_path / "events.jsonl"), str(tmp_path / "out")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt",
                         "d=64", "--algorithm", "asgd", "--set", "lr=0.2", "--max-time", "120", "--events", events,
                         "--out", out, "--eval-every", "20", "--shm", mode)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    fake = os.path.join(str(tmp_path), "machine-id")
    other = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", f'mount --bind {fake} /etc/machine-id && exec "$0" -m ps work --server "$1" '
         '--worker-id other --delay 0.002', sys.executable, endpoint],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    procs.children.append(other)
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 20, timeout=90)
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, timeout=30) == 0
    assert wait_exit(other, timeout=20) == 0
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        t = json.load(f)["transport"]
    assert t["shm_workers"] == (["other"] if mode == "any" else [])
