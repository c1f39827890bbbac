"""The conformance kit (``latecomer conformance``, docs/CONFORMANCE.md): a scripted fake server
that starts a worker under test as a child process, plays the cases of
``ps/ops/conformance_cases.py`` and ``ps/ops/conformance_shards.py`` against it over real ZeroMQ
sockets on loopback, and says per case PASS, or FAIL with what PROTOCOL.md expected and what came.

The problem is the built-in ``logreg`` at a small size; the expected gradients come from the
problem's own code in this process (the oracle), compared with a tolerance. Every wait is bounded;
the worker is reaped (SIGKILL if needed) after every session and after every failed case.
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from problems.loader import load_problem
from protocol.errors import RemoteProtocolError
from protocol.messages import Error, ErrorCode, Heartbeat, Hello, Job, JobKind, Part, Ready, Reply, Welcome
from ps.ops import conformance_net as net
from ps.ops.children import reap

PROBLEM = "logreg"
PROBLEM_OPTIONS = {"n": 64, "p": 8}
# The parts case (§6.13): a vector past CHUNK_THRESHOLD (16 MiB) as float32, cheap to compute.
BIG_PROBLEM = "quadratic"
BIG_OPTIONS = {"d": 4_500_000}
HEARTBEAT_S = 0.2
LIVENESS_S = 5.0
SERVER_HB_S = 1.0


class CaseFailed(Exception):
    """A case's check failed: the PROTOCOL.md section, what it expects, what came."""

    def __init__(self, section: str, expected: str, got: str) -> None:
        super().__init__(f"{section}: expected {expected}; got {got}")
        self.section, self.expected, self.got = section, expected, got


@dataclass
class Result:
    case: str
    ok: bool
    section: str = ""
    expected: str = ""
    got: str = ""
    seconds: float = 0.0
    note: str = ""  # e.g. why a case that depends on an optional feature was not played

    def line(self) -> str:
        if self.ok:
            return f"PASS {self.case} ({self.seconds:.1f} s{'; ' + self.note if self.note else ''})"
        return f"FAIL {self.case} [PROTOCOL.md {self.section}]: expected {self.expected}; got {self.got}"


def check(ok: bool, section: str, expected: str, got: Any) -> None:
    if not ok:
        raise CaseFailed(section, expected, str(got))


def brief(msg: Any) -> str:
    """A message in one short line, for FAIL lines."""
    if isinstance(msg, RemoteProtocolError):
        return f"undecodable ({msg})"
    text = repr(msg)
    return text if len(text) <= 300 else text[:297] + "..."


class Oracle:
    """The problem's own code: what a conforming worker computes."""

    def __init__(self, problem: str = PROBLEM, options: dict | None = None) -> None:
        self.name, self.options = problem, dict(PROBLEM_OPTIONS if options is None else options)
        self.problem = load_problem(problem, dict(self.options))
        self.dim = int(self.problem.init_params(0).shape[0])

    def grads(self, job: Job, points: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
        p = self.problem
        if job.kind == JobKind.GRAD:
            return [p.grad(points[0], job.seed, job.batch_size).grad], job.batch_size
        if job.kind == JobKind.GRAD_PAIR:
            a, b = p.grad_pair(points[0], points[1], job.seed, job.batch_size)
            return [a.grad, b.grad], job.batch_size
        g, count, _ = p.full_grad(points[0], job.shard[0], job.shard[1])
        return [g], count


class Kit:
    """One worker process under test and the fake server (and shards) it talks to."""

    def __init__(self, command: str, timeout_s: float, oracle: Oracle, n_shards: int = 0) -> None:
        self.command, self.timeout_s, self.oracle = command, timeout_s, oracle
        self.ctx = net.context()
        self.router = net.Router(self.ctx, net.free_endpoint())
        self.shards = [net.Router(self.ctx, net.free_endpoint()) for _ in range(n_shards)]
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()
        self.server_boot = random.getrandbits(63)
        self.run_id = random.getrandbits(63) or 1
        self.next_job = 0
        self.next_iterate = 0
        self.iterates: dict[int, np.ndarray] = {}
        self.hello: Hello | None = None
        self.last_hb: Heartbeat | None = None
        self.last_from: Any = None  # the router the last message came on
        self.next_server_hb = 0.0
        self.rng = np.random.default_rng(0)
        self.note = ""  # what a case says beside PASS
        self.next_xfer = 0  # the kit's transfers in parts (§6.13)
        self.session = (n_shards > 0, False)  # (sharded, big): which cases this worker can serve

    # ------------------------------------------------------------------ process
    def start(self) -> None:
        argv = shlex.split(self.command.replace("{endpoint}", self.router.endpoint))
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def proc_wait(self, seconds: float) -> None:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    def stderr_tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(lines[-3:])

    def close(self) -> None:
        if self.proc is not None:
            reap([self.proc], grace_s=3.0)
        for r in [self.router, *self.shards]:
            r.close()
        self.ctx.term()
        self.log.close()

    # ------------------------------------------------------------------ waiting
    def _tick(self) -> None:
        """The fake server's own heartbeats, so that the worker does not find it silent."""
        now = time.monotonic()
        if self.hello is not None and now >= self.next_server_hb:
            self.router.send(Heartbeat(boot=self.server_boot))
            self.next_server_hb = now + SERVER_HB_S

    def next(self, deadline: float, routers: list | None = None, section: str = "8.1") -> tuple[Any, Any] | None:
        """The next message from the worker on any of ``routers`` (default: the server's) before
        ``deadline``: (router, message); heartbeats are remembered in ``last_hb`` and returned too."""
        routers = routers or [self.router]
        while True:
            self._tick()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r = net.wait_any(routers, min(left, 0.1))
            if r is None:
                if not self.alive():
                    raise CaseFailed(section, "the worker to keep running",
                                     f"it exited with status {self.proc.returncode} ({self.stderr_tail()})")
                continue
            got = r.receive()
            if got is None:
                continue
            msg = got[0]
            if type(msg) is Part:
                continue
            if type(msg) is Heartbeat and r is self.router:
                self.last_hb = msg
            self.last_from = r
            return r, msg

    def expect(self, what: str, section: str, pred: Callable[[Any], bool], *, timeout_s: float | None = None,
               routers: list | None = None, answer_unknown: bool = False) -> Any:
        """Wait for a message ``pred`` accepts; others are noted (the last few go in the FAIL line).
        ``answer_unknown``: answer every other message to the server with ``err UNKNOWN_WORKER``
        (a server that restarted and has no routing id bound)."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        others: list[str] = []
        hbs = 0
        while True:
            got = self.next(deadline, routers, section)
            if got is None:
                seen = [f"{hbs} hb (the last {brief(self.last_hb)})"] if hbs else []
                seen = "; ".join(others[-3:] + seen) or "nothing"
                raise CaseFailed(section, what, f"within {wait:g} s: {seen}")
            r, msg = got
            if pred(msg):
                return msg
            if type(msg) is Heartbeat:
                hbs += 1
            else:
                others.append(brief(msg))
            if answer_unknown and r is self.router and type(msg) is not Hello:
                r.send(Error(ErrorCode.UNKNOWN_WORKER, "conformance: who are you?"))

    def expect_type(self, cls: type, section: str, *, timeout_s: float | None = None, routers: list | None = None,
                    answer_unknown: bool = False, where: Callable[[Any], bool] = lambda m: True) -> Any:
        name = cls.__name__.lower()
        return self.expect(f"a {name}", section, lambda m: type(m) is cls and where(m), timeout_s=timeout_s,
                           routers=routers, answer_unknown=answer_unknown)

    def expect_hb(self, section: str, what: str, pred: Callable[[Heartbeat], bool],
                  timeout_s: float = 3.0) -> Heartbeat:
        """An hb that ``pred`` accepts (the worker's heartbeats come every HEARTBEAT_S)."""
        return self.expect(f"an hb with {what}", section, lambda m: type(m) is Heartbeat and pred(m),
                           timeout_s=timeout_s)

    def answer(self, job: Job, section: str, routers: list | None = None, timeout_s: float | None = None) -> Any:
        """The worker's answer to ``job``: its reply (checked against the oracle), else a FAIL that
        shows the ``err`` that came instead."""
        got = self.expect(f"a reply to job {job.job_id}", section,
                          lambda m: type(m) in (Reply, Error) and m.job_id == job.job_id, routers=routers,
                          timeout_s=timeout_s)
        check(type(got) is Reply, section, f"a reply to job {job.job_id}", brief(got))
        self.check_reply(job, got, section)
        return got

    def quiet(self, seconds: float, routers: list | None = None) -> list:
        """Everything the worker sends in the next ``seconds`` (heartbeats left out)."""
        deadline = time.monotonic() + seconds
        out = []
        while (got := self.next(deadline, routers)) is not None:
            if type(got[1]) is not Heartbeat:
                out.append(got[1])
        return out

    # ------------------------------------------------------------------ the server's side
    def welcome(self, **fields: Any) -> None:
        self.router.send(Welcome(server_boot=self.server_boot, version=1, problem=self.oracle.name,
                                 problem_options=dict(self.oracle.options), run_id=self.run_id,
                                 heartbeat_interval_s=HEARTBEAT_S, liveness_timeout_s=LIVENESS_S, **fields))
        self.next_server_hb = time.monotonic() + SERVER_HB_S

    def shard_map(self) -> tuple:
        """Welcome.shards: the fake shards' endpoints and their contiguous ranges of the vector."""
        n, dim = len(self.shards), self.oracle.dim
        cuts = [dim * i // n for i in range(n + 1)] if n else []
        return tuple((r.endpoint, cuts[i], cuts[i + 1]) for i, r in enumerate(self.shards))

    def iterate(self) -> int:
        iid = self.next_iterate
        self.next_iterate += 1
        self.iterates[iid] = self.rng.standard_normal(self.oracle.dim).astype(np.float32)
        return iid

    def job(self, kind: JobKind, iterate_ids: tuple, send: tuple | None = None, **fields: Any) -> Job:
        """A job naming ``iterate_ids``, carrying the points of ``send`` (default: all of them)."""
        send = iterate_ids if send is None else send
        jid = self.next_job
        self.next_job += 1
        if kind == JobKind.FULL_GRAD:
            fields.setdefault("shard", (8, 40))
        return Job(job_id=jid, kind=kind, created_at=1000 + jid, iterate_ids=tuple(iterate_ids),
                   seed=random.getrandbits(32), batch_size=fields.pop("batch_size", 4), point_ids=tuple(send),
                   points=tuple(self.iterates[i] for i in send), **fields)

    def join(self) -> Hello:
        """Hello, welcome, ready: a worker ready for jobs (the handshake case checks the details)."""
        hello = self.expect_type(Hello, "8.1", timeout_s=max(self.timeout_s, 20.0))
        self.hello = hello
        self.welcome(shards=self.shard_map(), parts=hello.parts)
        self.expect_type(Ready, "8.1")
        return hello

    # ------------------------------------------------------------------ checks
    def check_reply(self, job: Job, reply: Any, section: str = "6.5", grads_of: Callable | None = None) -> None:
        check(reply.job_id == job.job_id, section, f"job_id {job.job_id} echoed", reply.job_id)
        check(reply.created_at == job.created_at, section, f"created_at {job.created_at} echoed", reply.created_at)
        want, count = self.oracle.grads(job, [self.iterates[i] for i in job.iterate_ids])
        got = reply.grads if grads_of is None else grads_of(reply)
        check(len(got) == len(want), section, f"{len(want)} gradient(s) for a {job.kind.name} job", len(got))
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            check(g.shape == w.shape, "8.2", f"gradient {k} of shape {w.shape}", g.shape)
            check(g.dtype.str in ("<f2", "<f4", "<f8"), "8.2", f"gradient {k} of a floating dtype", g.dtype.str)
            err = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) if g.size else 0.0
            check(np.allclose(g, w, rtol=1e-4, atol=1e-5), section,
                  f"gradient {k} equal to the problem's own (the oracle)", f"max abs difference {err:.3g}")
        if job.kind == JobKind.FULL_GRAD:
            check(reply.count == count, section, f"count {count} (the shard size)", reply.count)


def crash_and_hello(kit: Kit) -> Hello:
    """The server crashes (its socket closed, what was in flight lost) and comes back on the same
    endpoint: whatever comes first is answered err UNKNOWN_WORKER until the worker says hello."""
    kit.router.restart()
    kit.server_boot += 1
    kit.hello = None  # no server heartbeats until the hello: the new process does not know the worker
    h = kit.expect_type(Hello, "8.11", answer_unknown=True, timeout_s=max(kit.timeout_s, 15.0))
    kit.hello = h
    return h


@dataclass(frozen=True)
class Case:
    name: str
    section: str  # the PROTOCOL.md section it checks
    what: str
    run: Callable[[Kit], None]
    sharded: bool = False
    big: bool = False  # plays on the large problem (BIG_PROBLEM): a session of its own
    fresh: bool = False  # needs a worker that has not said hello yet (its own process)
    last: bool = False  # ends the worker


def run_cases(command: str, cases: list[Case], timeout_s: float = 10.0,
              echo: Callable[[str], None] | None = None) -> list[Result]:
    """Play ``cases`` in order against workers started with ``command``; one Result per case.
    A worker serves several cases in a row; after a failure (or a case that ends it) the next
    case gets a new one."""
    oracles: dict[bool, Oracle] = {}
    results: list[Result] = []
    kit: Kit | None = None
    try:
        for case in cases:
            if kit is None or case.fresh or kit.session != (case.sharded, case.big) or not kit.alive():
                if kit is not None:
                    kit.close()
                if case.big not in oracles:
                    oracles[case.big] = Oracle(BIG_PROBLEM, BIG_OPTIONS) if case.big else Oracle()
                kit = Kit(command, timeout_s, oracles[case.big], n_shards=2 if case.sharded else 0)
                kit.session = (case.sharded, case.big)
                try:
                    kit.start()
                except OSError as e:  # the command cannot be started at all
                    results.append(Result(case.name, False, "8.1", "a worker process", f"{type(e).__name__}: {e}"))
                    if echo is not None:
                        echo(results[-1].line())
                    kit.close()
                    kit = None
                    continue
            res = _play(kit, case)
            results.append(res)
            if echo is not None:
                echo(res.line())
            if not res.ok or case.last:
                kit.close()
                kit = None
    finally:
        if kit is not None:
            kit.close()
    return results


def _play(kit: Kit, case: Case) -> Result:
    t0 = time.monotonic()
    try:
        if kit.hello is None and not case.fresh:
            try:
                kit.join()
            except CaseFailed as e:
                raise CaseFailed(e.section, "a worker that joins (setup: " + e.expected + ")", e.got) from None
        kit.note = ""
        case.run(kit)
        return Result(case.name, True, case.section, seconds=time.monotonic() - t0, note=kit.note)
    except CaseFailed as e:
        return Result(case.name, False, e.section, e.expected, e.got, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the kit's own trouble is a FAIL line, not a traceback
        return Result(case.name, False, case.section, "the case to run", f"{type(e).__name__}: {e}",
                      time.monotonic() - t0)


def select(all_cases: list[Case], names: tuple[str, ...], sharded: bool | None) -> list[Case]:
    """The cases named (all if none), of the modes asked (None: both), in the kit's order."""
    unknown = set(names) - {c.name for c in all_cases}
    if unknown:
        raise ValueError(f"unknown case(s): {', '.join(sorted(unknown))}; the cases: "
                         f"{', '.join(c.name for c in all_cases)}")
    return [c for c in all_cases if (not names or c.name in names) and (sharded is None or c.sharded == sharded)]


def write_json(path: str, results: list[Result]) -> None:
    import json
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump([asdict(r) for r in results], f, indent=1)
    os.replace(tmp, path)
