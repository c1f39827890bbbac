"""Issue 13 point 9: a worker loads only what it trusts, whatever a server names.

A fake server (a ROUTER this test binds on 127.0.0.1, as a local user could while the real
server restarts, or anyone on the path under ``--insecure``) answers the real worker's hello with
a ``welcome`` naming a callable of its choice. The worker must not import or call it unless its
own command line allows it (``--allow-problem``): it says why in one line on stderr, tells the
server (``err PROBLEM_UNAVAILABLE``, then ``bye``) and exits with status 3. The markers are files
the hostile callables would write; their absence is what shows nothing ran.

These are not load tests: no RSS bound applies (the server here is the attacker's; the victim is
the worker, and what is measured is whether it runs the attacker's code).
"""

from __future__ import annotations

import time

import pytest
import zmq

from protocol.codec import decode, encode
from protocol.messages import PROTOCOL_VERSION, Bye, Error, ErrorCode, Hello, Ready, Welcome

pytestmark = pytest.mark.slow

HOSTILE = '''
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "{name}.imported"), "w").close()

def make(**options):
    open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "{name}.called"), "w").close()
    raise SystemExit("ran")
'''

BENIGN = '''
import os
from problems.quadratic import make_quadratic

def make(d: int = 4):
    open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "benignmod.called"), "w").close()
    return make_quadratic(d=d)
'''


@pytest.fixture
def modules(tmp_path):
    """A folder (on the worker's PYTHONPATH) with a hostile and a benign problem module."""
    d = tmp_path / "mods"
    d.mkdir()
    (d / "evilmod.py").write_text(HOSTILE.format(name="evilmod"))
    (d / "benignmod.py").write_text(BENIGN)
    return d


class FakeServer:
    """A ROUTER on 127.0.0.1 that answers every hello with a welcome of its choosing and records
    what the worker sends back."""

    def __init__(self, problem: str, options: dict | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.welcome = Welcome(server_boot=12345, version=PROTOCOL_VERSION, problem=problem, run_id=777,
                               problem_options=dict(options or {}))
        self.received: list = []

    def serve_until(self, done, timeout: float) -> None:
        """Answer hellos and record messages until ``done(received)`` or ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not done(self.received):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"fake server: condition not met in {timeout} s; got {self.received}")
            if not self.sock.poll(int(min(left, 0.2) * 1000)):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            self.received.append(msg)
            if isinstance(msg, Hello):
                self.sock.send_multipart([ident, *encode(self.welcome)])
            self.ident = ident

    def say_bye(self) -> None:
        self.sock.send_multipart([self.ident, *encode(Bye("fake server done"))])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake():
    servers = []

    def make(problem, options=None):
        servers.append(FakeServer(problem, options))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def start_worker(procs, modules, endpoint, *extra):
    return procs.start("work", "--server", endpoint, "--worker-id", "victim", "--give-up", "20", *extra,
                       env={"PYTHONPATH": str(modules)})


def refused(procs, modules, server, *extra) -> str:
    """Run the worker against ``server``: it must send PROBLEM_UNAVAILABLE and bye and exit 3
    with one line on stderr; returns that line."""
    worker = start_worker(procs, modules, server.endpoint, *extra)
    server.serve_until(lambda got: any(isinstance(m, Bye) for m in got), timeout=30)
    assert worker.wait(timeout=20) == 3
    errors = [m for m in server.received if isinstance(m, Error)]
    assert [e.code for e in errors] == [ErrorCode.PROBLEM_UNAVAILABLE], server.received
    assert "--allow-problem" in errors[0].message
    assert not any(isinstance(m, Ready) for m in server.received)
    lines = worker.stderr.read().decode().strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_fake_server_naming_os_system_runs_nothing(procs, modules, fake, tmp_path):
    marker = tmp_path / "os-system-ran"
    server = fake("os:system", {"command": f"touch {marker}"})
    line = refused(procs, modules, server)
    print(line)
    assert not marker.exists(), "the worker ran the fake server's shell command"
    assert line.startswith("latecomer worker: cannot load problem os:system: ")
    assert "--allow-problem os:system " in line


def test_a_fake_server_naming_a_module_on_the_path_imports_nothing(procs, modules, fake):
    server = fake("evilmod:make")
    line = refused(procs, modules, server, "--allow-problem", "benignmod:*")  # allowing another changes nothing
    print(line)
    assert not (modules / "evilmod.imported").exists(), "the worker imported the module a server named"
    assert not (modules / "evilmod.called").exists()
    assert "--allow-problem evilmod:make " in line


def test_an_allowed_user_problem_is_loaded(procs, modules, fake):
    server = fake("benignmod:make", {"d": 6})
    worker = start_worker(procs, modules, server.endpoint, "--allow-problem", "benign*")
    server.serve_until(lambda got: any(isinstance(m, Ready) for m in got), timeout=60)
    assert (modules / "benignmod.called").exists()
    server.say_bye()
    assert worker.wait(timeout=20) == 0
    assert not any(isinstance(m, Error) for m in server.received), server.received


def test_the_allow_list_comes_from_the_environment_too(procs, modules, fake):
    server = fake("benignmod:make", {"d": 3})
    worker = procs.start("work", "--server", server.endpoint, "--worker-id", "victim", "--give-up", "20",
                         env={"PYTHONPATH": str(modules), "LATECOMER_ALLOW_PROBLEM": "other.* benignmod"})
    server.serve_until(lambda got: any(isinstance(m, Ready) for m in got), timeout=60)
    server.say_bye()
    assert worker.wait(timeout=20) == 0


def test_a_builtin_needs_no_flag_and_a_worker_local_option_stays_the_workers(procs, modules, fake, tmp_path):
    """mnist's paths are worker-local: a worker that set them never takes the server's (a hostile
    server naming /etc/shadow is ignored); the files it does read must be idx files."""
    server = fake("mnist", {"images": "/etc/shadow", "labels": "/etc/shadow", "test_images": "/etc/shadow",
                            "test_labels": "/etc/shadow"})
    mine = {k: str(tmp_path / "nope" / k) for k in ("images", "labels", "test_images", "test_labels")}
    worker = start_worker(procs, modules, server.endpoint, *[a for k, v in mine.items()
                                                             for a in ("--problem-opt", f"{k}={v}")])
    server.serve_until(lambda got: any(isinstance(m, Bye) for m in got), timeout=60)
    assert worker.wait(timeout=20) == 3
    (err,) = [m for m in server.received if isinstance(m, Error)]
    assert str(tmp_path / "nope") in err.message and "/etc/shadow" not in err.message, err.message


def test_latecomer_run_starts_its_workers_allowing_the_problem_it_names(procs, modules, tmp_path):
    """`latecomer run` spawns its own workers: they trust the problem its command line names."""
    p = procs.start("run", "--problem", "benignmod:make", "--problem-opt", "d=4", "--algorithm", "asgd", "--set",
                    "lr=0.1", "--workers", "2", "--delays", "0", "--steps", "30", "--eval-every", "10",
                    "--no-progress", "--out", str(tmp_path / "out"), env={"PYTHONPATH": str(modules)})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-2000:]
    assert "steps:     30" in out.decode(), out.decode()
