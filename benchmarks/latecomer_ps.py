"""(b) latecomer: the real ``latecomer serve`` daemon and ``latecomer work`` processes on loopback,
plain async SGD (``asgd``) on the ``synthetic`` problem (the worker's gradient is a constant vector).

The variants (bench backend names):

* ``latecomer``: TCP path, ``serve --shm off`` and ``work --shm off`` (arrays in ZeroMQ frames)
* ``latecomer-shm``: the same-host path (``--shm auto``, the default): the worker reads iterates
  from the server's shared memory and writes gradients into shared buffers; only headers cross
  the socket
* ``latecomer-curve``: TCP under ``--keys`` (the default ``--seal auto``: the messages after the
  welcome sealed on a second connection, PROTOCOL.md §6.15, with AEGIS-256X4 where pyaegis is
  installed, else AES-256-GCM: the default ``--seal-cipher auto``), ``--shm off``
* ``latecomer-curve-gcm``: the same with ``--seal-cipher aes256gcm``
* ``latecomer-curvezmq``: the same with ``--seal off`` (everything inside libzmq's CurveZMQ)
* ``latecomer-bf16``: TCP with ``serve --wire-dtype bf16`` (2-byte frames), ``--shm off``
* ``latecomer-c4``: TCP with ``work --credit 4``: each worker holds up to 4 jobs, so the next job
  is already queued when one finishes (pipelined, unlike the lockstep rows; ages grow by ~3)
* ``latecomer-busy`` (not in the default plan): TCP with ``serve --busy-poll-us 400``: the daemon
  polls up to 400 µs before it sleeps, the window adapted to how soon replies come, whatever runs
  beside it (the default, ``auto``, polls so only while the host has a CPU for the server and each
  worker on it)
* ``latecomer-nopoll`` (not in the default plan): TCP with ``serve --busy-poll-us 0``: the daemon
  sleeps as soon as nothing is ready (the default before ``auto``)

Updates are the daemon's ``applied`` events; a round trip is a job's ``issued`` -> ``applied``
time (both stamped by the daemon, monotonic clock, the same clock as the bench's windows). The
events file costs the daemon two events per update, serialized at each flush: that is included in
its CPU figure. Start-up readiness is asked over the protocol (a ``StatusRequest``), so it does
not depend on when the daemon flushes its events file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import LR, Row, peak_rss, reap_popen, server_cpu, skipped, sleep_until, summarize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("latecomer", "latecomer-relay", "latecomer-shm", "latecomer-curve", "latecomer-curvezmq", "latecomer-bf16",
            "latecomer-c4", "latecomer-busy", "latecomer-nopoll", "latecomer-curve-gcm")
BUSY_POLL_US = {"latecomer-busy": 400, "latecomer-nopoll": 0}  # their `serve --busy-poll-us`
_EV = re.compile(r'"ev"\s*:\s*"(issued|applied)"')
_SLOT = 7  # a shared-memory slot number, for the header sizes of the same-host path


def _start(*args: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "ps", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True)


@functools.lru_cache(maxsize=None)
def cli_options(command: str) -> frozenset[str]:
    """The long options ``latecomer COMMAND`` accepts (read from the click command; ``--help`` as a fallback)."""
    try:
        import click

        from ps.cli.main import main

        cmd = main.get_command(click.Context(main), command)
        return frozenset(o for p in cmd.params for o in p.opts if o.startswith("--"))
    except Exception:  # noqa: BLE001 - a CLI being edited may not import; ask a subprocess instead
        p = subprocess.run([sys.executable, "-m", "ps", command, "--help"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", p.stdout))


def missing_flag(variant: str) -> str:
    """Why ``variant`` cannot run with this checkout's CLI ("" when it can)."""
    need = {"latecomer-shm": [("serve", "--shm"), ("work", "--shm")],
            "latecomer-bf16": [("serve", "--wire-dtype")], "latecomer-curvezmq": [("serve", "--seal")],
            "latecomer-curve-gcm": [("serve", "--seal-cipher")],
            "latecomer-relay": [("serve", "--hand-over")],
            "latecomer-busy": [("serve", "--busy-poll-us")],
            "latecomer-nopoll": [("serve", "--busy-poll-us")]}.get(variant, [])
    gone = [f"`latecomer {c} {f}`" for c, f in need if f not in cli_options(c)]
    return f"{' and '.join(gone)} {'do' if len(gone) > 1 else 'does'} not exist yet" if gone else ""


def _events(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(applied times, their issue->apply round trips)."""
    issued, ts, rt = {}, [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                continue
            m = _EV.search(line)
            if m is None:
                continue
            ev = json.loads(line)
            if m.group(1) == "issued":
                issued[ev["job_id"]] = ev["t"]
            else:
                t0 = issued.get(ev["job_id"])
                if t0 is not None:
                    ts.append(ev["t"])
                    rt.append(ev["t"] - t0)
    return np.asarray(ts), np.asarray(rt)


def wire_bytes(d: int, variant: str = "latecomer") -> int:
    """Bytes crossing the socket per update: one Job and one Reply as the protocol codec encodes them.

    TCP (and CurveZMQ, before its own framing): x in the Job, g in the Reply, float32. bf16:
    the same frames at 2 bytes per element. Same-host path: headers only (the Job names the
    shared-memory slots of x and of the gradient, the Reply says the gradient is in shared memory).
    """
    from protocol.codec import encode
    from protocol.messages import Job, JobKind, Reply

    common = dict(job_id=123456, kind=JobKind.GRAD, created_at=123456, iterate_ids=(123456,), seed=2**62,
                  batch_size=32)
    if variant == "latecomer-shm":
        job = Job(**common, refs=(_SLOT,), grad_slots=(_SLOT,))
        rep = Reply(job_id=123456, created_at=123456, grads=(), loss=0.0, count=32, compute_s=1e-5,
                    holds=(123456,), in_shm=True)
    else:
        x = np.zeros(d, np.uint16 if variant == "latecomer-bf16" else np.float32)
        job = Job(**common, point_ids=(123456,), points=(x,))
        rep = Reply(job_id=123456, created_at=123456, grads=(x,), loss=0.0, count=32, compute_s=1e-5,
                    holds=(123456,))
    return sum(len(f) if isinstance(f, bytes) else memoryview(f).nbytes for f in [*encode(job), *encode(rep)])


def _status(endpoint: str, keys: str | None):
    from ps.ops.status import fetch_status

    kw = {}
    if keys:
        kw = {"key_secret": os.path.join(keys, "workers", "bstatus.key_secret"),
              "server_key": os.path.join(keys, "server.key")}
    return fetch_status(endpoint, timeout_s=5.0, **kw)


def _shm_workers(st) -> int | None:
    """How many workers the server's status says use the same-host path (None: it does not say)."""
    v = st.info.get("shm_workers")
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def run(d: int, workers: int, seconds: float, warmup: float, *, variant: str = "latecomer", credit: int = 1,
        start_timeout: float = 90.0) -> Row:
    if variant not in VARIANTS:
        raise ValueError(variant)
    why = missing_flag(variant)
    if why:
        return skipped(variant, d, workers, why)
    shm_flag = "--shm" in cli_options("serve") and "--shm" in cli_options("work")
    if variant == "latecomer-c4":
        credit = max(credit, 4)
    curve = variant in ("latecomer-curve", "latecomer-curvezmq", "latecomer-curve-gcm")
    with tempfile.TemporaryDirectory(prefix="latecomer-bench-") as tmp:
        events = os.path.join(tmp, "events.jsonl")
        args = ["serve", "--bind", "tcp://127.0.0.1:0", "--problem", "synthetic", "--problem-opt", f"d={d}",
                "--algorithm", "asgd", "--set", f"lr={LR}", "--max-time", str(start_timeout + warmup + seconds + 30),
                "--min-workers", str(workers), "--eval-every", "0", "--events", events, "--log-level", "error"]
        wargs = ["--log-level", "error", "--credit", str(credit)]
        if variant == "latecomer-shm":
            args += ["--shm", "auto"]
            wargs += ["--shm", "auto"]
        elif shm_flag:
            args += ["--shm", "off"]
            wargs += ["--shm", "off"]
        if variant == "latecomer-bf16":
            args += ["--wire-dtype", "bf16"]
        if variant == "latecomer-relay":
            args += ["--hand-over", "off"]  # the front relays every byte (as before the hand-over)
        if variant in BUSY_POLL_US:
            args += ["--busy-poll-us", str(BUSY_POLL_US[variant])]
        keys = os.path.join(tmp, "keys") if curve else None
        if keys:
            subprocess.run([sys.executable, "-m", "ps", "keys", "init", keys], cwd=REPO, check=True,
                           capture_output=True, timeout=60)
            for name in [*(f"b{i}" for i in range(workers)), "bstatus"]:
                subprocess.run([sys.executable, "-m", "ps", "keys", "add-worker", name, "--keys", keys], cwd=REPO,
                               check=True, capture_output=True, timeout=60)
            args += ["--keys", keys] + (["--seal", "off"] if variant == "latecomer-curvezmq" else [])
            args += ["--seal-cipher", "aes256gcm"] if variant == "latecomer-curve-gcm" else []
        server = _start(*args, stdout=subprocess.PIPE)
        procs = [server]
        try:
            import select

            r, _, _ = select.select([server.stdout], [], [], start_timeout)
            line = server.stdout.readline().decode() if r else ""
            if "listening on" not in line:
                return skipped(variant, d, workers, f"daemon did not start: {line.strip()[:100]!r}")
            endpoint = line.split()[-1]
            for i in range(workers):
                w = ["work", "--server", endpoint, "--worker-id", f"b{i}", *wargs]
                if keys:
                    w += ["--key", os.path.join(keys, "workers", f"b{i}.key_secret"),
                          "--server-key", os.path.join(keys, "server.key")]
                procs.append(_start(*w))
            deadline = time.monotonic() + start_timeout
            while True:  # ready once a few updates went through (asked over the protocol)
                if time.monotonic() > deadline or server.poll() is not None:
                    return skipped(variant, d, workers, "no update applied within the start timeout")
                try:
                    st = _status(endpoint, keys)
                    if st.info.get("counter.applied", 0) >= 3:
                        break
                except TimeoutError:
                    pass
                time.sleep(0.1)
            t0 = time.monotonic() + warmup
            t1 = t0 + seconds
            sleep_until(t0)
            cpu0 = server_cpu(server.pid)
            sleep_until(t1)
            cpu1 = server_cpu(server.pid)
            rss = peak_rss(server.pid)
            try:
                shm_used = _shm_workers(_status(endpoint, keys))
            except TimeoutError:
                shm_used = None
            server.send_signal(signal.SIGTERM)  # graceful: bye to the workers, events flushed
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            ts, rt = _events(events)
            note = "RTT: issue->apply in the daemon"
            if credit != 1:
                note += f"; credit {credit} (pipelined; the RTT includes the wait in the worker's queue)"
            if variant == "latecomer-shm":
                note += "; bytes: headers only (x and g go through shared memory)"
                if shm_used != workers:
                    note += (f"; status: {shm_used} of {workers} workers on shared memory" if shm_used is not None
                             else "; shm use not confirmed by the status")
            elif variant == "latecomer-bf16":
                note += "; bytes: bf16 frames (2 bytes/element)"
            elif curve:
                note += "; bytes: before sealing"
            if variant != "latecomer-shm" and shm_used:
                note += f"; status: {shm_used} workers on shared memory (expected none)"
            return summarize(variant, d, workers, ts, rt, t0, t1, cpu0, cpu1, rss, wire_bytes(d, variant), note=note)
        except Exception as e:  # noqa: BLE001
            return skipped(variant, d, workers, f"{type(e).__name__}: {e}"[:200])
        finally:
            reap_popen(procs[1:], grace=5)
            reap_popen(procs[:1], grace=5)
