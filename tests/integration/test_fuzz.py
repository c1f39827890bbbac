"""Fuzz the running daemon with 100,000 random and mutated messages while real workers train.

At the end: the daemon is up, its memory stayed bounded, every bad message was counted, and the
run's journal replays exactly to the final iterate (the fuzzer changes the event order, so the
like-for-like check is the exact replay of what happened)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import msgpack
import numpy as np
import pytest
import zmq

from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import (
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    JobKind,
    Ready,
    Reply,
    Status,
    StatusRequest,
)
from ps.drivers.replay import replay_run
from tests.integration.util import read_events, tree_rss, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

N_MESSAGES = 100_000
D = 32


def valid_templates(rng: random.Random) -> list[list[bytes]]:
    g = np.ones(D, np.float32)
    msgs = [Reply(job_id=rng.randrange(10**6), created_at=rng.randrange(100), grads=(g,)),
            Reply(job_id=1, created_at=0, grads=(g, g)), Heartbeat(boot=1, credit=1, busy=(1, 2), seen=3),
            Hello(worker_id="tmpl", boot=7, credit=1), Ready(credit=1),
            Job(job_id=1, kind=JobKind.GRAD, created_at=0, iterate_ids=(0,), seed=1, point_ids=(0,), points=(g,)),
            Cancel((1, 2)), Error(ErrorCode.REFUSED, "x", job_id=3)]
    return [[bytes(f) if not isinstance(f, bytes) else f for f in encode(m)] for m in msgs]


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """One bad message built from a valid one."""
    frames = list(frames)
    kind = rng.randrange(10)
    if kind == 0:  # flipped bytes in the header
        h = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            h[rng.randrange(len(h))] ^= 1 << rng.randrange(8)
        frames[0] = bytes(h)
    elif kind == 1:  # truncated frame
        i = rng.randrange(len(frames))
        frames[i] = frames[i][: rng.randrange(max(1, len(frames[i])))]
    elif kind == 2:  # extra frames
        frames += [os.urandom(rng.randint(0, 64)) for _ in range(rng.randint(1, 3))]
    elif kind == 3:  # dropped array frame
        frames = frames[:1] if len(frames) > 1 else frames + [b"xx"]
    elif kind == 4:  # random bytes
        frames = [os.urandom(rng.randint(0, 200)) for _ in range(rng.randint(1, 3))]
    else:  # a header rewritten: wrong dtype, huge shapes, wrong version, wrong types
        try:
            h = msgpack.unpackb(frames[0], raw=False)
        except Exception:
            h = {"v": 1, "t": "reply"}
        choice = rng.randrange(6)
        if choice == 0:
            h["arrays"] = [{"dtype": rng.choice([">f4", "O", "|V8", "<i8", "<c8", "float32"]), "shape": [D]}]
        elif choice == 1:
            h["arrays"] = [{"dtype": "<f4", "shape": rng.choice([[2**40], [2**31, 2**31], [-1], [D, 0, 2**62]])}]
        elif choice == 2:
            h["v"] = rng.choice([0, 2, 255, "1", None])
        elif choice == 3:
            h["job_id"] = rng.choice(["1", -5, 2**64 - 1, 1.5, None, [1]])
        elif choice == 4:
            h["t"] = rng.choice(["replay", "", "HELLO", 3])
        else:
            h["credit"] = rng.choice([0, -1, 10**6, "2"])
            h["t"] = "hello"
            h["worker_id"] = rng.choice(["", "é" * 3, "w" * 65, 5])
        frames[0] = msgpack.packb(h, use_bin_type=True)
    return frames


def rss(pid: int) -> int:
    return tree_rss(pid)  # serve and its daemon (ps/net/supervise.py)


def test_fuzz_daemon_with_100k_bad_messages_while_workers_train(procs, tmp_path):
    state = str(tmp_path / "state")
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "quadratic",
                         "--problem-opt", f"d={D}", "--algorithm", "ordered-momentum", "--set", "lr=0.1",
                         "--set", "beta=0.3", "--max-time", "300", "--liveness-timeout", "3", "--eval-every", "0",
                         "--checkpoint-every", "2000", "--log-level", "warning")
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    events = f"{state}/events.jsonl"
    workers = [procs.start("work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", d)
               for i, d in ((1, "0.004"), (2, "0.01"))]
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 50, timeout=60)
    rss0 = rss(server.pid)
    applied0 = sum(e["ev"] == "applied" for e in read_events(events))

    rng = random.Random(1234)
    templates = valid_templates(rng)
    ctx = zmq.Context()
    socks = []
    for i in range(4):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.sndhwm = 1000
        s.rcvhwm = 0  # the server answers most bad messages with an error: never let them back up
        s.routing_id = f"fuzz-{i}".encode()
        s.connect(endpoint)
        socks.append(s)
    named = ctx.socket(zmq.DEALER)  # a hello'd fuzz worker: replies for others' jobs, NaN gradients
    named.linger = 0
    named.rcvhwm = 0
    named.routing_id = b"fuzz-named/1"
    named.connect(endpoint)
    named.send_multipart(encode(Hello(worker_id="fuzz-named", boot=1, credit=1)))
    named.send_multipart(encode(Ready(credit=1)))

    sent = bad_lower_bound = malformed = decodable = others = 0
    peak = rss0
    real_jobs: list[int] = [0]  # refreshed from the events every 5,000 messages (a job may come first)
    t0 = time.monotonic()
    try:
        while sent < N_MESSAGES and time.monotonic() - t0 < 240:
            for s in socks + [named]:  # keep the fuzzer's own queues short
                while s.poll(0):
                    frames = s.recv_multipart()
                    if s is named:
                        try:
                            h = msgpack.unpackb(frames[0], raw=False)
                        except Exception:
                            continue
                        if h.get("t") == "job":  # answer our own jobs with NaN gradients
                            bad = np.full(D, np.nan, np.float32)
                            named.send_multipart(encode(Reply(job_id=h["job_id"], created_at=h["created_at"],
                                                              grads=(bad,))))
                            sent += 1
                            bad_lower_bound += 1
            if sent % 5000 == 0:
                peak = max(peak, rss(server.pid))
                real_jobs = [e["job_id"] for e in read_events(events)[-200:] if e["ev"] == "issued"] or [0]
                assert server.poll() is None, "the daemon died"
            if rng.random() < 0.05:  # a well-formed reply to a job that belongs to someone else
                msg = [bytes(f) for f in encode(Reply(job_id=rng.choice(real_jobs), created_at=0,
                                                      grads=(np.zeros(D, np.float32),)))]
                s = named
                others += 1
            else:
                msg = mutate(rng.choice(templates), rng)
                s = rng.choice(socks)
                try:  # a mutation can still be a well-formed message (a hello that joins, say)
                    decode(msg)
                    decodable += 1
                except RemoteProtocolError:
                    malformed += 1
            try:
                s.send_multipart(msg, flags=zmq.NOBLOCK)
            except zmq.Again:
                s.poll(100, zmq.POLLOUT)
                continue
            sent += 1
        elapsed = time.monotonic() - t0
        # A status request is answered in order: once each connection's answer is back, every
        # message the fuzzer sent before it has been handled.
        status = {}
        for i, s in enumerate(socks + [named]):
            s.send_multipart(encode(StatusRequest(token=1000 + i)))
            deadline = time.monotonic() + 120
            while 1000 + i not in status:
                assert s.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no status answer"
                frames = s.recv_multipart()
                try:
                    m = decode(frames)
                except RemoteProtocolError:
                    continue
                if isinstance(m, Status):
                    status[m.token] = m.info
    finally:
        for s in socks + [named]:
            s.close(linger=0)
        ctx.term()
    last = status[1000 + len(socks)]
    assert last["counter.invalid"] >= malformed, "every malformed message is counted as invalid"
    counted_live = sum(last[f"counter.{k}"] for k in ("invalid", "unknown", "late", "rejected", "stray", "refused",
                                                       "worker_errors"))
    assert counted_live >= malformed + bad_lower_bound
    assert sent >= N_MESSAGES, f"sent only {sent} in {elapsed:.0f} s"
    peak = max(peak, rss(server.pid))
    wait_events(events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= applied0 + 200, timeout=60)
    assert server.poll() is None, "the daemon is up after the fuzzing"
    server.send_signal(signal.SIGTERM)
    rc = wait_exit(server, timeout=60)
    assert rc == 0, server.stderr.read()[-3000:].decode(errors="replace")
    for w in workers:
        assert wait_exit(w, timeout=20) == 0
    summary = json.loads(open(f"{state}/summary.json").read())
    c = summary["counters"]
    counted = sum(c[k] for k in ("invalid", "unknown", "late", "rejected", "stray", "refused", "worker_errors"))
    print(f"\nfuzz: {sent} messages in {elapsed:.1f} s ({sent / elapsed:.0f}/s); server RSS {rss0 / 2**20:.0f} MiB "
          f"-> peak {peak / 2**20:.0f} MiB; counted bad {counted} (invalid {c['invalid']}, unknown {c['unknown']}, "
          f"rejected {c['rejected']}, refused {c['refused']}, stray {c['stray']}, late {c['late']}); "
          f"quarantined {c['quarantined']}; applied {c['applied']}; malformed sent {malformed}, well-formed "
          f"mutations {decodable}, replies for others' jobs {others}, NaN replies {bad_lower_bound}")
    assert counted <= sent + 100  # nothing else was counted as bad (a little slack for real late replies)
    assert peak - rss0 < 100 * 2**20, "memory stayed bounded"
    assert c["quarantined"] >= 1, "the NaN-sending worker was quarantined"
    assert summary["accounted"]
    replayed = replay_run(state)
    assert np.array_equal(replayed.final_x, np.load(f"{state}/final_x.npy")), "the journal replays exactly"
    assert replayed.counters == c
