"""When a shard gives up by itself (issue 28): a local shard whose parent is gone (the backstop of
PR_SET_PDEATHSIG), a shard that heard nothing from its coordinator for --coordinator-timeout
seconds; and the prctl's result checked (ctypes returns -1 without raising). In process, with an
injected parent pid and clock: the real processes are tests/integration/test_shard_lifetime.py."""

from __future__ import annotations

import os
import signal

import pytest
from click.testing import CliRunner

import ps.cli.shard
import ps.net.supervise
from ps.sharded.shard import Lifeline, Shard

NOBODY = "tcp://127.0.0.1:9"  # the discard port: no coordinator there


def test_the_lifeline_follows_the_parent_and_the_coordinator():
    ppid = [100]
    life = Lifeline(parent=100, coordinator_timeout=0, getppid=lambda: ppid[0])
    assert life.check(1e9, 0.0) is None  # no timeout: the coordinator may be silent for ever
    ppid[0] = 1  # the parent died: this process was handed to init
    assert life.check(0.0, 0.0) == "the process that started this shard (pid 100) is gone"
    ppid[0] = 100
    assert life.gave_up and life.check(0.0, 0.0) == life.gave_up  # once given up, for good

    life = Lifeline(coordinator_timeout=2.0)  # a remote shard: no parent watched
    assert life.check(11.9, 10.0) is None and life.check(12.0, 10.0) is None
    assert life.check(12.001, 10.0) == "no coordinator for 2 s"
    assert Lifeline().check(1e12, 0.0) is None  # the default: never


class Clock:
    """Every reading ``step`` later than the last."""

    def __init__(self, step: float = 0.05) -> None:
        self.t, self.step = 1000.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


@pytest.mark.parametrize("case", ["parent", "coordinator"])
def test_a_shard_that_gives_up_stops_its_loop_and_closes(tmp_path, case):
    """The loop ends by itself with the reason, and closes as on ``stop``: the state lock released
    (a shard started again takes the directory), the journal closed."""
    if case == "parent":  # the timeout only bounds the test should the parent check fail
        life = Lifeline(parent=os.getpid(), coordinator_timeout=1.0, getppid=lambda: 1)
    else:
        life = Lifeline(coordinator_timeout=0.3)  # a few passes of the loop (each waits up to 100 ms)
    s = Shard(NOBODY, state_dir=str(tmp_path / "s"), clock=Clock(), lifeline=life)
    why = s.run()
    assert why == life.gave_up and why.startswith("the process that started" if case == "parent" else
                                                  "no coordinator for 0.3 s")
    again = Shard(NOBODY, state_dir=str(tmp_path / "s"), clock=Clock(),
                  lifeline=Lifeline(parent=os.getpid(), coordinator_timeout=1.0, getppid=lambda: 1))
    assert again.run().startswith("the process that started")  # the lock was free


def test_a_message_from_the_coordinator_restarts_the_count(tmp_path):
    clock = Clock(step=0.0)
    s = Shard(NOBODY, state_dir=str(tmp_path / "s"), clock=clock, lifeline=Lifeline(coordinator_timeout=2.0))
    try:
        clock.t += 1.9
        s._on_control([b"\x80"])  # not a control message: dropped, and not a word from the coordinator
        s._timers()
        assert s.stopping is None
        clock.t += 1.9
        s._on_control([ps.sharded.shard.pack("stop", reason="over")])  # a word (here: stop)
        s.stopping = None
        clock.t += 1.9
        s._timers()
        assert s.stopping is None  # 1.9 s since that word
        clock.t += 0.2
        s._timers()
        assert s.stopping == "no coordinator for 2 s"
    finally:
        s.close()


def test_the_shard_command_exits_1_when_it_gives_up_and_0_when_stopped(monkeypatch, tmp_path):
    monkeypatch.setattr(Shard, "install_signal_handlers", lambda self: None)  # not this process's handlers
    r = CliRunner().invoke(ps.cli.shard.shard, ["--coordinator", NOBODY, "--coordinator-timeout", "0.3"])
    assert r.exit_code == 1, r.output
    assert "latecomer shard: stopped (no coordinator for 0.3 s)" in r.output
    r = CliRunner().invoke(ps.cli.shard.shard, ["--coordinator", NOBODY, "--coordinator-timeout", "-1"])
    assert r.exit_code == 2 and "--coordinator-timeout" in r.output

    def stopped(self):
        self.close()
        return "the coordinator stopped: the run is over"
    monkeypatch.setattr(Shard, "run", stopped)
    r = CliRunner().invoke(ps.cli.shard.shard, ["--coordinator", NOBODY])
    assert r.exit_code == 0 and "stopped (the coordinator stopped" in r.output


def test_exit_with_parent_checks_the_prctl_and_the_parent_it_was_given(monkeypatch):
    warned = []
    monkeypatch.setattr(ps.cli.shard.log, "warning", lambda fmt, *a: warned.append(fmt % a))
    asked = []
    monkeypatch.setattr(ps.net.supervise, "set_pdeathsig", lambda sig: asked.append(sig) or None)
    assert ps.cli.shard._exit_with_parent(None) == os.getppid() and asked == [signal.SIGKILL]
    assert ps.cli.shard._exit_with_parent(os.getppid()) == os.getppid()
    with pytest.raises(SystemExit) as e:  # the spawner died before the prctl: init is the parent now
        ps.cli.shard._exit_with_parent(os.getppid() + 1)
    assert e.value.code == 1
    monkeypatch.setattr(ps.net.supervise, "set_pdeathsig", lambda sig: "prctl(PR_SET_PDEATHSIG) failed: EPERM")
    assert ps.cli.shard._exit_with_parent(None) == os.getppid()  # the lifeline watches instead
    assert warned == ["prctl(PR_SET_PDEATHSIG) failed: EPERM: this shard stops within 0.5 s of its parent instead"]


def test_set_pdeathsig_reports_the_call_that_fails():
    """The prctl's -1 is seen (here: an invalid signal, EINVAL); a valid one in a child process
    (setting it on the test process itself would tie it to its parent's thread). The child is a
    fresh interpreter, not a fork: a forked pool of this multi-threaded process (pyzmq's and
    tqdm's threads) hung once on a fresh clone until the 300 s timeout."""
    import subprocess
    import sys

    assert "failed: Invalid argument" in ps.net.supervise.set_pdeathsig(1000)
    child = subprocess.run([sys.executable, "-c", "import signal, ps.net.supervise as s; "
                            "print(s.set_pdeathsig(signal.SIGKILL))"], cwd=os.path.dirname(os.path.dirname(
                               os.path.dirname(os.path.abspath(__file__)))), capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0 and child.stdout.strip() == "None", child.stderr


def test_local_shards_are_started_watching_this_process_and_never_time_out(monkeypatch, tmp_path):
    got = []
    monkeypatch.setattr("ps.ops.children.spawn", lambda *args, **kw: got.append(args))
    local = ps.cli.shard.LocalShards(NOBODY, str(tmp_path), 1)
    local._start(0)
    local.logs[0].close()
    args = got[0]
    assert "--exit-with-parent" in args and f"--parent-pid={os.getpid()}" in args
    assert "--coordinator-timeout=0" in args


def test_a_supervised_daemon_stops_once_its_supervisor_is_gone():
    """The daemon's backstop for a prctl that failed (ps/net/supervise.py ``watch_supervisor``):
    its loop's hook stops it as SIGTERM would (its local shards told to stop), once its parent is
    no longer the supervisor; an unsupervised daemon gets no hook."""
    from types import SimpleNamespace

    import click

    daemon = SimpleNamespace(stopping=None, hooks=[])
    with click.Context(click.Command("serve")) as ctx:
        ps.net.supervise.watch_supervisor(daemon)
        assert daemon.hooks == []
        ctx.meta[ps.net.supervise.META] = {"supervised_by": f"{os.getppid()}:9:ipc:///nowhere"}
        ps.net.supervise.watch_supervisor(daemon)
        ctx.meta[ps.net.supervise.META] = {"supervised_by": f"{os.getppid() + 1}:9:ipc:///nowhere"}
        ps.net.supervise.watch_supervisor(daemon)
    mine, gone = daemon.hooks
    mine(0.0)
    assert daemon.stopping is None  # its parent is the supervisor it names
    gone(0.0)
    assert daemon.stopping == f"the supervisor (pid {os.getppid() + 1}) is gone"
