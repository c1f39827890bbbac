"""The busy-poll advice of a real `latecomer serve` (PROTOCOL.md §6.4, `job.spin_us`), read off
the jobs by workers that are raw DEALERs in this process, each saying its host and CPUs; and the
reference worker following it."""

from __future__ import annotations

import contextlib
import json
import re
import time

import numpy as np
import pytest
import zmq

from protocol.codec import decode, encode
from protocol.messages import Bye, Hello, Job, Ready, Reply, Welcome
from protocol.shm import host_id
from tests.integration.util import wait_exit, wait_line

pytestmark = pytest.mark.slow
DEADLINE_S = 30.0
D = 4


class Fake:
    """A worker that answers every job with a zero gradient and keeps each job's ``spin_us``."""

    def __init__(self, ctx: zmq.Context, endpoint: str, wid: str, host: str, cpus: int, d: int = D) -> None:
        self.d = d
        self.s = ctx.socket(zmq.DEALER)
        self.s.linger = 0
        self.s.connect(endpoint)
        self.s.send_multipart(encode(Hello(worker_id=wid, boot=1, credit=1, host_id=host, cpus=cpus)))
        self.advised: list[int] = []

    def turn(self) -> int:
        """Handle messages until one job is answered; its advice."""
        end = time.monotonic() + DEADLINE_S
        while True:
            assert self.s.poll(max(1, int((end - time.monotonic()) * 1000))), "no job in time"
            msg = decode(self.s.recv_multipart())
            if isinstance(msg, Welcome):
                self.s.send_multipart(encode(Ready(credit=1)))
            elif isinstance(msg, Job):
                self.s.send_multipart(encode(Reply(job_id=msg.job_id, created_at=msg.created_at,
                                                   grads=tuple(np.zeros(self.d, np.float32) for _ in msg.iterate_ids))))
                self.advised.append(msg.spin_us)
                return msg.spin_us

    def settles_at(self, want: int) -> None:
        """Its jobs advise ``want`` within the deadline (the server counts again at each join
        and leave, and each second), and the next five say the same."""
        end = time.monotonic() + DEADLINE_S
        while self.turn() != want:
            assert time.monotonic() < end, f"advised {self.advised[-10:]}, never {want}"
        assert [self.turn() for _ in range(5)] == [want] * 5

    def leave(self) -> None:
        self.s.send_multipart(encode(Bye("done")))
        self.s.close()


@contextlib.contextmanager
def served(procs, *args: str, d: int = D):
    """A `latecomer serve` of the quadratic (d values) and a ZeroMQ context for the fake workers;
    on the way out the context goes and the server is stopped with SIGINT, which must end it cleanly."""
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", f"d={d}",
                         "--algorithm", "asgd", "--set", "lr=0.001", "--max-time", "120", "--eval-every", "0",
                         "--shm", "off", *args)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    ctx = zmq.Context()
    try:
        yield endpoint, ctx
    finally:
        ctx.destroy(linger=0)
    server.send_signal(2)
    assert wait_exit(server, timeout=60) == 0


def test_each_worker_is_advised_to_poll_where_its_host_has_a_cpu_for_each_process_of_the_run(procs):
    with served(procs) as (endpoint, ctx):  # --busy-poll-us auto, the default
        a = Fake(ctx, endpoint, "a", "host-a", cpus=2)
        a.settles_at(400)  # alone on a 2-CPU host
        b = Fake(ctx, endpoint, "b", "host-b", cpus=0)
        b.settles_at(0)  # its CPUs not said: no advice
        c = Fake(ctx, endpoint, "c", "host-a", cpus=1)
        c.settles_at(0)  # two of the run's processes on host-a, and c may use one CPU
        a.settles_at(400)  # a may use two
        d = Fake(ctx, endpoint, "d", "host-a", cpus=2)
        d.settles_at(0)
        a.settles_at(0)  # three on host-a now: nobody there polls
        d.leave()
        a.settles_at(400)  # back to two
        here = Fake(ctx, endpoint, "here", host_id(), cpus=1)
        here.settles_at(0)  # on the server's host the server counts too: two processes, one CPU
        for f in (a, b, c, here):
            f.leave()


def test_a_worker_that_takes_large_jobs_through_libzmq_counts_its_io_thread(procs):
    """d = 20,000: a job's array is 80 KB, past SMALL_JOB_BYTES (64 KiB), and moves through the
    plaintext worker's libzmq I/O thread, which needs a CPU of its own while the worker polls."""
    with served(procs, d=20_000) as (endpoint, ctx):
        two = Fake(ctx, endpoint, "two", "host-2", cpus=2, d=20_000)
        two.settles_at(400)  # the worker and its I/O thread: two CPUs are enough
        one = Fake(ctx, endpoint, "one", "host-1", cpus=1, d=20_000)
        one.settles_at(0)  # alone on its host, but not with its I/O thread
        two.leave()
        one.leave()


def test_a_number_advises_every_worker_and_zero_none(procs):
    for setting, want in (("250", 250), ("0", 0)):
        with served(procs, "--busy-poll-us", setting) as (endpoint, ctx):
            crowded = Fake(ctx, endpoint, "crowded", "", cpus=0)  # no host, no CPUs said: a number ignores both
            crowded.settles_at(want)
            roomy = Fake(ctx, endpoint, "roomy", "host-r", cpus=64)
            roomy.settles_at(want)
            crowded.leave()
            roomy.leave()


def test_the_reference_worker_follows_the_advice_and_computes_the_same(procs, tmp_path):
    """One worker beside the server: advised 400 µs where this machine has two CPUs for them (the
    worker logs it, and how many of its polls took a message), nothing with `--busy-poll-us 0`
    or `work --busy-poll off`; the run ends at the same iterate bit for bit either way."""
    from protocol.spin import usable_cpus

    finals = {}
    for name, serve_args, work_args in (("auto", (), ()), ("off", ("--busy-poll-us", "0"), ()),
                                        ("refused", (), ("--busy-poll", "off"))):
        out = tmp_path / name
        server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt",
                             "d=16", "--algorithm", "asgd", "--set", "lr=0.05", "--max-steps", "300",
                             "--eval-every", "0", "--out", str(out), "--shm", "off", *serve_args)
        endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
        worker = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--shm", "off", "--log-level", "info",
                             *work_args)
        assert wait_exit(server, timeout=120) == 0
        assert wait_exit(worker, timeout=60) == 0
        log = worker.stderr.read().decode()
        advised = "busy polling up to 400 µs, as the server advises" in log
        assert advised is (name == "auto" and usable_cpus() >= 2), log
        polls = re.search(r"busy polls: (\d+), (\d+) of them took a message", log)
        assert (polls is not None) is advised, log  # how many took a message depends on this machine's speed
        if polls:
            assert 0 <= int(polls.group(2)) <= int(polls.group(1)), log
        finals[name] = np.load(out / "final_x.npy")
        assert json.loads((out / "summary.json").read_text())["version"] == 300
    assert np.array_equal(finals["auto"], finals["off"]) and np.array_equal(finals["auto"], finals["refused"])
