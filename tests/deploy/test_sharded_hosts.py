"""deploy/README.md, "A sharded server over several hosts", started for real on four "hosts" made
of network namespaces (test_netns.py's ``Lab``: veth pairs to a bridge in a namespace of its own,
10.231.0.0/24, no default route): the coordinator on 10.231.0.1, shard slot 0 on .2, slot 1 on .3,
two workers on .4.

The commands are the README's own, parsed from its fenced bash blocks ("Keys first" for the keys,
then the sharded section), with only these substituted: the README's addresses (the coordinator's
and each slot's, read from the block's comments) by the namespaces' addresses, absolute paths
(``/var/lib/latecomer/...``) placed under the host's own directory, ``--max-steps`` lowered
(and ``--min-workers 2`` added to the coordinator's command there, so that both workers are in
before the first job); each host runs them from its own directory holding the keys the README
gives it (the coordinator and the shards the whole ``keys/``, the workers the two files their
command names). ``latecomer`` is
this checkout's (its venv first on PATH).

Each namespace gets a machine id of its own (``/etc/netns/NS/machine-id``, which ``ip netns exec``
mounts over ``/etc/machine-id``), as separate hosts would: otherwise the workers, sharing this
box's machine id and ``/dev/shm``, would take the same-host path to the shards around the network.
The directory is removed at teardown, with the namespaces, whatever happens.

What is checked: both shards join the coordinator from the address they advertise, the run
reaches its ``--max-steps`` with nothing lost, every reply was applied on both shards (each
shard's final checkpoint counts them, and each shard's link carried at least their gradient
blocks), and every process exits 0 by itself at the end (the shards included: the coordinator
tells them the run is over). Then the same commands again with a higher ``--max-steps``: the
coordinator resumes from its state at the step it stopped at, the shards from their checkpoints,
and the run goes on to the new end. Then a third time with the README's own ``--max-steps``,
the coordinator stopped by SIGTERM (as ``systemctl stop`` does): every process exits 0 too. A
test without namespaces checks that the shard and server units run the section's flags.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import time

import pytest

from ps.journal.checkpoints import verified_checkpoints
from tests.deploy.conftest import REPO, VENV_BIN
from tests.integration.test_netns import Lab, netns_unusable, run_ok
from tests.integration.util import read_events, readme_block, wait_events
from tests.unit.test_deploy import exec_start, read_unit

pytestmark = [pytest.mark.slow, pytest.mark.netns]

README = "deploy/README.md"
SECTION = "A sharded server over several hosts"
STEPS = 100  # the README's --max-steps 20000, lowered (the README says so)
RESUMED_STEPS = 160  # the second start's --max-steps
HOSTS = ["coordinator", "shard0", "shard1", "workers"]  # 10.231.0.1 .. .4, in this order (Lab.build)
WORKERS = 2  # the README's worker command, twice on the workers' host
START_S = 60  # a process's readiness line, shards joined
RUN_S = 120  # a run from the workers' start to every process's exit


# --------------------------------------------------------------------------- the README's commands

def _commands(block: str) -> list[list[str]]:
    return [argv for line in block.splitlines() if (argv := shlex.split(line, comments=True))]


def recipe() -> dict:
    """The README's commands by host: ``keys`` (run on a trusted machine), ``coordinator``,
    ``shards`` (by slot), ``work``; and ``addresses``: the README's address of each host, read from
    the block's comments (``coordinator host (A)``, ``slot N on A``)."""
    keys = _commands(readme_block("Keys first (CurveZMQ)", "bash", README))
    block = readme_block(SECTION, "bash", README)
    coord = re.search(r"#.*coordinator host \((\d+\.\d+\.\d+\.\d+)\)", block)
    slots = {int(n): a for n, a in re.findall(r"slot (\d+) on (\d+\.\d+\.\d+\.\d+)", block)}
    assert coord and sorted(slots) == [0, 1], f"the block's comments no longer name the hosts' addresses: {block}"
    cmds = _commands(block)
    assert all(argv[0] == "latecomer" for argv in cmds + keys), cmds + keys
    (serve,) = [a for a in cmds if a[1] == "serve"]
    shards = {int(a[a.index("--slot") + 1]): a for a in cmds if a[1] == "shard"}
    (work,) = [a for a in cmds if a[1] == "work"]
    assert sorted(shards) == [0, 1], cmds
    return {"keys": keys, "coordinator": serve, "shards": shards, "work": work,
            "addresses": {"coordinator": coord.group(1), **{f"shard{n}": a for n, a in slots.items()}}}


def substituted(argv: list[str], lab: HostsLab, host: str, readme_addresses: dict[str, str]) -> list[str]:
    """``argv`` with the README's addresses replaced by the namespaces' and absolute paths placed
    under ``host``'s directory."""
    out = []
    for a in argv:
        for h, addr in readme_addresses.items():
            a = re.sub(rf"(?<![\d.]){re.escape(addr)}(?![\d.])", lab.hosts[h][2], a)
        if a.startswith("/"):
            a = str(lab.root(host)) + a
        out.append(a)
    return out


def with_max_steps(argv: list[str], steps: int) -> list[str]:
    """The coordinator's command with ``--max-steps steps`` and ``--min-workers`` the test's worker
    count: no job is issued before both workers joined, so that on a loaded machine one worker's
    slow start cannot leave the other to take every step of a short run (and every worker hears
    the end of the run it joined)."""
    assert "--max-steps" in argv, f"the README's coordinator command has no --max-steps: {shlex.join(argv)}"
    assert "--min-workers" not in argv, f"the README's coordinator command has a --min-workers: {shlex.join(argv)}"
    i = argv.index("--max-steps") + 1
    return [*argv[:i], str(steps), *argv[i + 1:], "--min-workers", str(WORKERS)]


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"no {name} in {shlex.join(argv)}"
    return argv[argv.index(name) + 1]


# --------------------------------------------------------------------------- hosts

class HostsLab(Lab):
    """A Lab whose hosts run arbitrary commands (``latecomer`` from this checkout's venv) from a
    directory of their own, each with a machine id of its own."""

    def __init__(self, tmp_path) -> None:
        super().__init__(tmp_path)
        self.etc: list[str] = []  # /etc/netns/NS directories made, removed at teardown
        self.made_etc_netns = False
        self.logs: dict[str, str] = {}  # process name -> log file
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))

    def build(self, hosts: list[str]) -> None:
        if not os.path.isdir("/etc/netns"):
            os.makedirs("/etc/netns")
            self.made_etc_netns = True
        super().build(hosts)
        for host in hosts:
            d = os.path.join("/etc/netns", self.hosts[host][0])
            os.makedirs(d)
            self.etc.append(d)
            with open(os.path.join(d, "machine-id"), "w", encoding="ascii") as f:
                f.write(secrets.token_hex(16) + "\n")
            self.root(host).mkdir(parents=True)

    def root(self, host: str):
        return self.tmp / "hosts" / host

    def run(self, host: str, name: str, argv: list[str]) -> subprocess.Popen:
        """``argv`` on ``host`` (its namespace, its directory), output to the log ``name``."""
        log = str(self.tmp / "logs" / f"{name}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        self.logs[name] = log
        with open(log, "ab") as out:
            p = subprocess.Popen(["ip", "netns", "exec", self.hosts[host][0], *argv], cwd=self.root(host),
                                 env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.children.append(p)
        return p

    def log(self, name: str) -> str:
        try:
            with open(self.logs[name], encoding="utf-8", errors="replace") as f:
                return f.read()
        except (KeyError, OSError):
            return ""

    def tails(self, n: int = 1200) -> str:
        return "\n".join(f"--- {name}:\n{self.log(name)[-n:]}" for name in self.logs)

    def link_bytes(self, host: str) -> tuple[int, int]:
        """(received, sent) bytes on the host's eth0."""
        (link,) = json.loads(run_ok("ip", "-n", self.hosts[host][0], "-s", "-j", "link", "show", "eth0"))
        return link["stats64"]["rx"]["bytes"], link["stats64"]["tx"]["bytes"]

    def teardown(self) -> list[str]:
        problems = []
        for d in self.etc:
            try:
                shutil.rmtree(d)
            except OSError as e:
                problems.append(f"rm {d}: {e}")
        if self.made_etc_netns:
            try:
                os.rmdir("/etc/netns")
            except OSError:
                pass  # another user's namespace files arrived meanwhile: theirs
        return problems + super().teardown()


@pytest.fixture
def lab(tmp_path):
    why = netns_unusable()
    if why:
        pytest.fail(f"this test runs the recipe on network namespaces: {why}", pytrace=False)
    if not shutil.which("latecomer", path=VENV_BIN):
        pytest.fail(f"no latecomer in {VENV_BIN}: run `make setup`", pytrace=False)
    lab = HostsLab(tmp_path)
    try:
        yield lab
    finally:
        try:
            lab.reap()
        finally:
            problems = lab.teardown()
        assert not problems, problems


# --------------------------------------------------------------------------- waits

def wait_log(lab: HostsLab, name: str, pattern: str, timeout: float, proc: subprocess.Popen | None = None) -> re.Match:
    """Poll the log ``name`` until ``pattern`` matches; fail at the deadline, or at once if ``proc``
    exited."""
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, lab.log(name))
        if m:
            return m
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{name} exited with status {proc.returncode} before {pattern!r}:\n{lab.tails()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in {name}'s log within {timeout} s:\n{lab.tails()}")
        time.sleep(0.05)  # polling interval of a bounded wait


def wait_all_exit(lab: HostsLab, procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, int]:
    """Every process's exit status; fail at the deadline naming those still running, or as soon as
    one exits with a status other than 0."""
    deadline = time.monotonic() + timeout
    while True:
        codes = {name: p.poll() for name, p in procs.items()}
        bad = {name: rc for name, rc in codes.items() if rc not in (None, 0)}
        if bad:
            raise AssertionError(f"exited with status {bad}:\n{lab.tails()}")
        if all(rc == 0 for rc in codes.values()):
            return codes
        if time.monotonic() > deadline:
            running = sorted(name for name, rc in codes.items() if rc is None)
            raise AssertionError(f"still running {timeout} s after the workers started: {running}:\n{lab.tails()}")
        time.sleep(0.1)  # polling interval of a bounded wait


# --------------------------------------------------------------------------- one start of the recipe

def start_recipe(lab: HostsLab, r: dict, steps: int | None, run: str, until=None) -> dict:
    """The README's order: the coordinator, then the shards once it listens, then the workers once
    both shards joined (``steps``: the coordinator's --max-steps, None: the README's); then every
    process to its exit (``until``: called once the workers are
    started, e.g. to stop the coordinator). Returns the shards' join lines and the seconds from the
    workers' start to the last exit."""
    addrs = r["addresses"]
    argv = r["coordinator"] if steps is None else with_max_steps(r["coordinator"], steps)
    coordinator = lab.run("coordinator", f"{run}-coordinator", substituted(argv, lab, "coordinator", addrs))
    procs = {"coordinator": coordinator}
    wait_log(lab, f"{run}-coordinator", r"shards connect to \S+", START_S, coordinator)
    wait_log(lab, f"{run}-coordinator", r"listening on \S+", START_S, coordinator)
    for n, argv in r["shards"].items():
        procs[f"shard{n}"] = lab.run(f"shard{n}", f"{run}-shard{n}", substituted(argv, lab, f"shard{n}", addrs))
    joined = {}
    for n in r["shards"]:
        try:
            m = wait_log(lab, f"{run}-coordinator", rf"shard {n} joined from (\S+) \(([^)]*)\)", START_S, coordinator)
        except AssertionError as e:
            raise AssertionError(f"shard {n} did not join (a shard without the coordinator's key pair fails the CURVE "
                                 f"handshake silently on both sides: are its keys the server's?): {e}") from None
        want = f"tcp://{lab.hosts[f'shard{n}'][2]}:"
        assert m.group(1).startswith(want), \
            f"shard {n} joined advertising {m.group(1)}, not an endpoint on its own host ({want}...): the workers " \
            f"would be sent there for slot {n}'s data (the README's --advertise of slot {n})\n{lab.tails()}"
        joined[n] = m.group(2)
    for w in range(WORKERS):
        procs[f"worker{w}"] = lab.run("workers", f"{run}-worker{w}", substituted(r["work"], lab, "workers", addrs))
    started = time.monotonic()
    if until is not None:
        until(coordinator)
    wait_all_exit(lab, procs, RUN_S)
    return {"joined": joined, "run_s": time.monotonic() - started}


def summary(state: str) -> dict:
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def shard_checkpoint(state: str) -> tuple[int, dict]:
    lsn, snap, _ = next(verified_checkpoints(state))
    return lsn, snap


# --------------------------------------------------------------------------- tests

def _options(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of an argv (every option of these commands takes a value)."""
    return {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--")}


def _port(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[1]


def test_the_units_run_the_readmes_commands():
    """The services the section names run its commands: the shard unit (instance N, the defaults of
    its environment) the same flags and values as slot N's command, but for the host names and
    /etc/latecomer/keys; the server unit with the section's LATECOMER_SERVE_ARGS the coordinator's,
    but for the problem (in server.toml)."""
    r = recipe()
    units = os.path.join(REPO, "deploy", "systemd")
    shard_unit = os.path.join(units, "latecomer-shard@.service")
    env = dict(v.split("=", 1) for s, k, v in read_unit(shard_unit) if (s, k) == ("Service", "Environment"))
    for n, argv in r["shards"].items():
        readme = _options(argv)
        unit = _options(exec_start(shard_unit, instance=str(n), host="shardhost", **env))
        assert list(unit) == list(readme), (unit, readme)
        assert {k: v for k, v in unit.items() if k not in ("--coordinator", "--advertise", "--keys")} == \
            {k: v for k, v in readme.items() if k not in ("--coordinator", "--advertise", "--keys")}, (unit, readme)
        for flag in ("--coordinator", "--advertise"):
            assert _port(unit[flag]) == _port(readme[flag]), (flag, unit, readme)
        assert unit["--keys"] == "/etc/latecomer/keys"
    with open(os.path.join(REPO, README), encoding="utf-8") as f:
        section = f.read().split(f"## {SECTION}", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"`LATECOMER_SERVE_ARGS=([^`]*)`", section)
    assert m, "the section no longer gives the server unit's LATECOMER_SERVE_ARGS"
    server = exec_start(os.path.join(units, "latecomer-server.service"))
    unit, readme = _options([*server, *m.group(1).split()]), _options(r["coordinator"])
    assert set(unit) - {"--config"} == set(readme) - {"--problem"}, (unit, readme)
    assert {k: v for k, v in unit.items() if k in readme and k != "--keys"} == \
        {k: v for k, v in readme.items() if k in unit and k != "--keys"}, (unit, readme)


def test_the_readmes_sharded_recipe_on_four_hosts_trains_stops_and_resumes(lab, tmp_path):
    r = recipe()
    lab.build(HOSTS)
    # Keys first, on a trusted machine (here: this one, no network needed), as the README says.
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    for argv in r["keys"]:
        k = subprocess.run(argv, cwd=trusted, env=lab.env, capture_output=True, text=True, timeout=60)
        assert k.returncode == 0, f"{shlex.join(argv)}: {k.stdout}{k.stderr}"
    for host in ("coordinator", "shard0", "shard1"):  # every process of the server: the whole keys/
        shutil.copytree(trusted / "keys", lab.root(host) / "keys")
    for flag in ("--key", "--server-key"):  # a worker: its key and the server's public key
        path = option(r["work"], flag)
        os.makedirs(lab.root("workers") / os.path.dirname(path), exist_ok=True)
        shutil.copy(trusted / path, lab.root("workers") / path)

    state = str(lab.root("coordinator")) + option(r["coordinator"], "--state")
    shard_states = {n: str(lab.root(f"shard{n}")) + option(argv, "--state") for n, argv in r["shards"].items()}
    events = os.path.join(state, "events.jsonl")

    # ---- the first start: to --max-steps
    first = start_recipe(lab, r, STEPS, "first")
    assert first["joined"] == {0: "afresh", 1: "afresh"}, first["joined"]
    s = summary(state)
    c = s["counters"]
    assert s["version"] == STEPS and s["stopped"] == f"reached {STEPS} steps", (s["version"], s["stopped"])
    assert c["applied"] == STEPS and c["lost"] == 0 and c["workers_lost"] == 0, c
    ev = read_events(events)
    assert not [e for e in ev if e["ev"] in ("lost", "left", "rejected")], [e for e in ev if e["ev"] != "applied"][:20]
    ids = {e["worker_id"] for e in ev if e["ev"] == "applied"}
    assert len(ids) == WORKERS, ids  # both workers contributed
    ckpts, shard_rx = {}, {}
    for n, d in shard_states.items():
        lsn, snap = shard_checkpoint(d)
        ckpts[n] = lsn
        # the shard's own core applied every reply the coordinator accepted
        assert snap["counters"]["applied"] == STEPS, (n, snap["counters"])
        log = lab.log(f"first-shard{n}")
        assert f"stopped (the coordinator stopped: the run is over: reached {STEPS} steps)" in log, log[-1500:]
        assert "through shared memory" not in log, f"shard {n} took the same-host path: {log[-1500:]}"
        lo, hi = s["shards"][n]["range"]
        rx, tx = shard_rx[n] = lab.link_bytes(f"shard{n}")
        # the workers' gradient blocks for this slice came over the shard's link, and the iterate's slice went out
        assert rx >= STEPS * (hi - lo) * 4 and tx >= STEPS * (hi - lo) * 4, (n, rx, tx, hi - lo)
    for w in range(WORKERS):
        assert f"stopped (server said bye: server stopping: reached {STEPS} steps)" in lab.log(f"first-worker{w}")
    outstanding = s["outstanding"]
    # "its socket carries headers only": the coordinator's link carried less than half of either shard's
    coord_rx, coord_tx = lab.link_bytes("coordinator")
    assert coord_rx + coord_tx < min(rx + tx for rx, tx in shard_rx.values()) / 2, (coord_rx, coord_tx, shard_rx)

    # ---- the same commands again, a higher --max-steps: the run resumes where it stopped
    second = start_recipe(lab, r, RESUMED_STEPS, "second")
    log = lab.log("second-coordinator")
    m = re.search(r"resumed \S+ at step (\d+)", log)
    assert m and int(m.group(1)) == STEPS, log[-2000:]
    ev = read_events(events)
    (resumed,) = [e for e in ev if e["ev"] == "resumed"]
    assert resumed["version"] == STEPS, resumed
    # each shard came back from its final checkpoint, at the record it had applied
    assert second["joined"] == {n: f"after record {lsn}" for n, lsn in ckpts.items()}, (second["joined"], ckpts)
    s2 = summary(state)
    c2 = s2["counters"]
    assert s2["version"] == RESUMED_STEPS and c2["applied"] == RESUMED_STEPS, (s2["version"], c2)
    # Only the jobs in flight when the first run stopped: written off when their workers came back as new processes.
    lost = [e for e in ev if e["ev"] == "lost"]
    assert c2["lost"] == len(lost) == outstanding and {e["reason"] for e in lost} <= {"restarted"}, (c2, lost)
    for n, d in shard_states.items():
        _, snap = shard_checkpoint(d)
        assert snap["counters"]["applied"] == RESUMED_STEPS, (n, snap["counters"])
        assert f"reached {RESUMED_STEPS} steps)" in lab.log(f"second-shard{n}")
    evals = [e["version"] for e in s2["evaluations"]]

    # ---- the README's commands unchanged (--max-steps 20000), the coordinator stopped with SIGTERM (as
    # `systemctl stop` does): it tells the shards and the workers the run is over, and every process exits 0
    def stop_after_some_steps(coordinator: subprocess.Popen) -> None:
        # the README's command issues jobs to the first worker in: stop once both are in this start
        # (each then hears the bye) and the run went on 20 steps
        n = len(read_events(events))

        def both_in_and_trained(ev: list[dict]) -> bool:
            return len({e["worker_id"] for e in ev[n:] if e["ev"] == "joined"}) == WORKERS and \
                sum(e["ev"] == "applied" for e in ev) >= RESUMED_STEPS + 20
        try:
            wait_events(events, both_in_and_trained, RUN_S)
        except TimeoutError as e:
            raise AssertionError(f"the third start did not train: {e}\n{lab.tails()}") from e
        coordinator.send_signal(signal.SIGTERM)

    third = start_recipe(lab, r, None, "third", until=stop_after_some_steps)
    s3 = summary(state)
    assert s3["stopped"] == "signal SIGTERM" and s3["version"] >= RESUMED_STEPS + 20, (s3["stopped"], s3["version"])
    assert re.search(rf"resumed \S+ at step {RESUMED_STEPS}\b", lab.log("third-coordinator"))
    lost3 = [e for e in read_events(events) if e["ev"] == "lost"]
    assert s3["counters"]["lost"] == len(lost3) == outstanding + s2["outstanding"], (s3["counters"], lost3)
    assert {e["reason"] for e in lost3} <= {"restarted"}, lost3
    for n, d in shard_states.items():
        assert "stopped (the coordinator stopped: the run is over: signal SIGTERM)" in lab.log(f"third-shard{n}")
        assert shard_checkpoint(d)[1]["counters"]["applied"] == s3["version"], n
    for w in range(WORKERS):
        assert "stopped (server said bye: server stopping: signal SIGTERM)" in lab.log(f"third-worker{w}")
    print(f"\nsharded recipe on {len(HOSTS)} namespaces: first start {first['run_s']:.1f} s to {STEPS} steps "
          f"(lost {c['lost']}, {outstanding} in flight at the end), resumed at step {resumed['version']} with the "
          f"shards after records {ckpts}, {second['run_s']:.1f} s to {RESUMED_STEPS} (lost {c2['lost']}: "
          f"{[e['reason'] for e in lost]}); evaluations at {evals}; a third start stopped with SIGTERM at step "
          f"{s3['version']}, every process exited 0 {third['run_s']:.1f} s after the workers started; final accuracy "
          f"{s3['evaluations'][-1]['accuracy']:.3f}; bytes in+out in the first start: coordinator "
          f"{coord_rx + coord_tx}, shards {[rx + tx for rx, tx in shard_rx.values()]}")
