"""(b) latecomer: the real ``latecomer serve`` daemon and ``latecomer work`` processes on loopback,
plain async SGD (``asgd``) on the ``synthetic`` problem (the worker's gradient is a constant vector).

Updates are the daemon's ``applied`` events; a round trip is a job's ``issued`` -> ``applied``
time (both stamped by the daemon, monotonic clock). The events file costs the daemon two
``json.dumps`` per update: that is included in its CPU figure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import LR, Row, peak_rss, reap_popen, server_cpu, skipped, sleep_until, summarize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(*args: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "ps", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True)


def _events(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(applied times, their issue->apply round trips)."""
    issued, ts, rt = {}, [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                continue
            if '"ev": "issued"' in line:
                ev = json.loads(line)
                issued[ev["job_id"]] = ev["t"]
            elif '"ev": "applied"' in line:
                ev = json.loads(line)
                t0 = issued.get(ev["job_id"])
                if t0 is not None:
                    ts.append(ev["t"])
                    rt.append(ev["t"] - t0)
    return np.asarray(ts), np.asarray(rt)


def _count_applied(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for line in f if '"ev": "applied"' in line)
    except OSError:
        return 0


def wire_bytes(d: int) -> int:
    """Bytes of one Job carrying x and one Reply carrying g, encoded by the protocol codec."""
    from protocol.codec import encode
    from protocol.messages import Job, JobKind, Reply

    x = np.zeros(d, np.float32)
    job = Job(job_id=123456, kind=JobKind.GRAD, created_at=123456, iterate_ids=(123456,), seed=2**62, batch_size=32,
              point_ids=(123456,), points=(x,))
    rep = Reply(job_id=123456, created_at=123456, grads=(x,), loss=0.0, count=32, compute_s=1e-5, holds=(123456,))
    return sum(len(f) if isinstance(f, bytes) else f.nbytes for f in [*encode(job), *encode(rep)])


def run(d: int, workers: int, seconds: float, warmup: float, *, curve: bool = False,
        start_timeout: float = 90.0) -> Row:
    name = "latecomer-curve" if curve else "latecomer"
    with tempfile.TemporaryDirectory(prefix="latecomer-bench-") as tmp:
        events = os.path.join(tmp, "events.jsonl")
        args = ["serve", "--bind", "tcp://127.0.0.1:0", "--problem", "synthetic", "--problem-opt", f"d={d}",
                "--algorithm", "asgd", "--set", f"lr={LR}", "--max-time", str(start_timeout + warmup + seconds + 30),
                "--min-workers", str(workers), "--eval-every", "0", "--events", events, "--log-level", "error"]
        keys = os.path.join(tmp, "keys")
        if curve:
            subprocess.run([sys.executable, "-m", "ps", "keys", "init", keys], cwd=REPO, check=True,
                           capture_output=True, timeout=60)
            for i in range(workers):
                subprocess.run([sys.executable, "-m", "ps", "keys", "add-worker", f"b{i}", "--keys", keys], cwd=REPO,
                               check=True, capture_output=True, timeout=60)
            args += ["--keys", keys]
        server = _start(*args, stdout=subprocess.PIPE)
        procs = [server]
        try:
            import select

            r, _, _ = select.select([server.stdout], [], [], start_timeout)
            line = server.stdout.readline().decode() if r else ""
            if "listening on" not in line:
                return skipped(name, d, workers, f"daemon did not start: {line.strip()[:100]!r}")
            endpoint = line.split()[-1]
            for i in range(workers):
                w = ["work", "--server", endpoint, "--worker-id", f"b{i}", "--log-level", "error"]
                if curve:
                    w += ["--key", os.path.join(keys, "workers", f"b{i}.key_secret"),
                          "--server-key", os.path.join(keys, "server.key")]
                procs.append(_start(*w))
            deadline = time.monotonic() + start_timeout
            while _count_applied(events) < 3:
                if time.monotonic() > deadline or server.poll() is not None:
                    return skipped(name, d, workers, "no update applied within the start timeout")
                time.sleep(0.1)
            t0 = time.monotonic() + warmup
            t1 = t0 + seconds
            sleep_until(t0)
            cpu0 = server_cpu(server.pid)
            sleep_until(t1)
            cpu1 = server_cpu(server.pid)
            rss = peak_rss(server.pid)
            server.send_signal(signal.SIGTERM)  # graceful: bye to the workers, events flushed
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            ts, rt = _events(events)
            return summarize(name, d, workers, ts, rt, t0, t1, cpu0, cpu1, rss, wire_bytes(d),
                             note="RTT: issue->apply in the daemon")
        except Exception as e:  # noqa: BLE001
            return skipped(name, d, workers, f"{type(e).__name__}: {e}"[:200])
        finally:
            reap_popen(procs[1:], grace=5)
            reap_popen(procs[:1], grace=5)
