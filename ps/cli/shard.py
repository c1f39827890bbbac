"""``latecomer shard`` (a shard process for a sharded server), and the local shards that
``serve --shards N`` starts and restarts (ps/sharded/shard.py, ps/sharded/hub.py)."""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any

import click

from ps.cli.options import allow_patterns, allowed_from
from ps.net.endpoints import bind_endpoint, server_endpoint
from ps.observe.log_setup import setup_logging

log = logging.getLogger("latecomer.shards")

RESTART_AFTER_S = 0.5  # a local shard that died is started again this long after
COORDINATOR_TIMEOUT_S = 600.0  # a shard gives up after this long without its coordinator (--coordinator-timeout)


@click.command("shard")
@click.option("--coordinator", "-c", required=True, callback=server_endpoint,
              help="The coordinator's shard endpoint (serve logs it; serve --shard-bind), e.g. tcp://HOST:5556.")
@click.option("--bind", default="tcp://127.0.0.1:0", show_default=True, callback=bind_endpoint,
              help="This shard's endpoint for the workers' data (port 0: any free port; a restarted shard binds "
                   "the endpoint its --state recorded).")
@click.option("--advertise", default=None, help="The endpoint workers are told (default: the bound one; give it "
                                                "when binding 0.0.0.0).")
@click.option("--state", "state_dir", type=click.Path(file_okay=False), default=None,
              help="Journal and checkpoints of this shard (without it nothing survives the process, and the run "
                   "cannot recover this shard).")
@click.option("--slot", type=click.IntRange(0, 63), default=None,
              help="Take this shard slot (default: the first free one; a --state that holds a slot keeps it).")
@click.option("--fsync", type=click.Choice(["always", "batch", "never"]), default="batch", show_default=True,
              help="When journaled gradient blocks reach the disk; the coordinator counts a reply once they have.")
@click.option("--checkpoint-records", type=click.IntRange(min=1), default=5000, show_default=True,
              help="Checkpoint after this many of the coordinator's records.")
@click.option("--allow-problem", "allow_problem", multiple=True, metavar="PATTERN", callback=allow_patterns,
              help="Trust this problem of your own where the coordinator's run names it (repeatable).")
@click.option("--allow-algorithm", "allow_algorithm", multiple=True, metavar="PATTERN", callback=allow_patterns,
              help="Trust this algorithm of your own where the coordinator's run names it (repeatable).")
@click.option("--keys", "keys_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="CurveZMQ, as the coordinator's --keys: the server's key pair (server.key_secret) and the workers' "
                   "allow-list (authorized/; SIGHUP re-reads it). A coordinator with --keys admits only shards "
                   "holding its key pair.")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None,
              help="The run's shard token: a copy of the coordinator's <state>/shard.token (serve prints where); "
                   "else the LATECOMER_SHARD_TOKEN environment variable. Needed unless the coordinator has --keys.")
@click.option("--insecure", is_flag=True, default=False,
              help="Allow binding a non-loopback address without --keys (no authentication, no encryption).")
@click.option("--exit-with-parent", is_flag=True, default=False, hidden=True,
              help="Die with the process that started this one (serve's local shards).")
@click.option("--parent-pid", type=click.IntRange(min=1), default=None, hidden=True,
              help="With --exit-with-parent: the pid that started this one (default: the parent at start).")
@click.option("--coordinator-timeout", type=click.FloatRange(min=0), default=COORDINATOR_TIMEOUT_S,
              show_default=True, metavar="SECONDS",
              help="Give up (exit status 1) after this long without a word from the coordinator, which says "
                   "something at least every 0.5 s while it lives; 0: wait for ever.")
@click.option("--shm", type=click.Choice(["auto", "any", "off"]), default="auto", show_default=True,
              help="Offer workers on this host its shared memory for slices and blocks (PROTOCOL.md 6.11, 12.1), as "
                   "serve --shm: auto when the worker's host id is this host's; any: to every worker whose probe "
                   "succeeds; off: never.")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def shard(coordinator, bind, advertise, state_dir, slot, fsync, checkpoint_records, allow_problem, allow_algorithm,
          keys_dir, token_file, insecure, exit_with_parent, parent_pid, coordinator_timeout, shm, log_level) -> None:
    """Serve a shard of a sharded server: a contiguous range of the parameter vector.

    Start it before training starts (a new shard gets the run's journal from its first record);
    a shard with --state may be restarted at any time and catches up. It exits when the
    coordinator's run is over, and with status 1 after --coordinator-timeout seconds without
    the coordinator.
    """
    from ps.net.security import is_loopback_endpoint
    from ps.sharded.shard import Lifeline, Shard, saved_shard

    setup_logging(log_level)
    if not keys_dir and not insecure and not is_loopback_endpoint(bind):
        raise click.UsageError(f"binding {bind} without --keys would let anyone on the network connect and "
                               "read the traffic: give --keys DIR (the server's) or --insecure")
    saved = saved_shard(state_dir) if state_dir and os.path.isdir(state_dir) else None
    if saved and saved.get("bind") and not keys_dir and not insecure and not is_loopback_endpoint(saved["bind"]):
        # checked before the Shard binds it again
        raise click.UsageError(f"this shard's --state binds {saved['bind']}: without --keys give --insecure")
    token = _shard_token(token_file)
    parent = _exit_with_parent(parent_pid) if exit_with_parent else None
    if state_dir:
        os.makedirs(state_dir, exist_ok=True)
    try:
        s = Shard(coordinator, bind=bind, advertise=advertise, state_dir=state_dir,
                  allowed=allowed_from(allow_problem, allow_algorithm), fsync=fsync,
                  checkpoint_records=checkpoint_records, keys_dir=keys_dir, shm=shm,
                  lifeline=Lifeline(parent, coordinator_timeout), token=token)
    except OSError as e:  # a bind in use, an unwritable directory
        raise click.ClickException(f"cannot start the shard: {e}") from None
    except ValueError as e:  # an unreadable key pair or allow-list
        raise click.BadParameter(str(e), param_hint="--keys") from None
    if slot is not None and s.index < 0:
        s.index = slot
    elif slot is not None and s.index != slot:
        raise click.BadParameter(f"{state_dir} holds slot {s.index}", param_hint="--slot")
    s.install_signal_handlers()
    click.echo(f"latecomer shard: coordinator {coordinator}" + (f", data on {s.endpoint}" if s.endpoint else ""))
    reason = s.run()
    click.echo(f"latecomer shard: stopped ({reason})")
    if s.lifeline.gave_up:
        raise SystemExit(1)


def _shard_token(token_file: str | None) -> str:
    """The shard token from --token-file, else from the environment ("" if neither: a coordinator
    with --keys needs none)."""
    from ps.journal.statedir import StateError
    from ps.sharded.hub_admit import TOKEN_ENV, read_token

    if token_file:
        try:
            return read_token(token_file)
        except StateError as e:
            raise click.BadParameter(str(e), param_hint="--token-file") from None
    return os.environ.get(TOKEN_ENV, "").strip()[:128]


def _exit_with_parent(parent: int | None) -> int:
    """A coordinator killed with -9 takes its local shards along (they recover from --state): the
    kernel kills this process when the thread that started it ends (PR_SET_PDEATHSIG), and the
    shard's loop stops it should its parent no longer be ``parent`` (the backstop, for a prctl that
    failed: :class:`~ps.sharded.shard.Lifeline`). Returns the pid watched. ``parent`` is the
    spawner's pid (LocalShards gives it): read here, after the imports, a parent that died
    meanwhile would be init's pid already, and nothing would ever notice."""
    import signal

    from ps.net.supervise import set_pdeathsig

    parent = parent or os.getppid()
    why = set_pdeathsig(signal.SIGKILL)
    if why:
        log.warning("%s: this shard stops within 0.5 s of its parent instead", why)
    if os.getppid() != parent:  # the parent died before the prctl
        click.echo(f"latecomer shard: the process that started it (pid {parent}) is gone", err=True)
        raise SystemExit(1)
    return parent


def start_local_shards(daemon: Any, state_dir: str, count: int | None, spec: Any, allow_problem: tuple,
                       allow_algorithm: tuple, shm: str = "auto") -> LocalShards:
    """``serve --shards N``: its local shards started (each trusting what the command line trusts),
    and kept running by the daemon's loop."""
    import sys

    from ps.sharded.hub_admit import TOKEN_FILE

    click.echo(f"latecomer: shards connect to {daemon.hub.endpoint} (shard token: "
               f"{os.path.join(state_dir, TOKEN_FILE)}, for latecomer shard --token-file)")
    sys.stdout.flush()
    extra = [f"--allow-problem={p}" for p in allow_problem] + [f"--allow-algorithm={a}" for a in allow_algorithm]
    if spec.problem and ":" in spec.problem:  # the command line names the user's problem: its shards trust it
        extra.append(f"--allow-problem={spec.problem}")
    if spec.algorithm and ":" in spec.algorithm:
        extra.append(f"--allow-algorithm={spec.algorithm}")
    if daemon.security is not None:  # CurveZMQ: the local shards hold the server's key pair too
        extra.append(f"--keys={daemon.security.keys_dir}")
    extra.append(f"--shm={shm}")  # serve's --shm: the same-host path to its local shards
    local = LocalShards(daemon.hub.endpoint, state_dir, daemon.hub.n if count is None else count,
                        extra=tuple(extra), log_level="info", token=daemon.hub.token)
    local.start()
    daemon.hooks.append(local.poll)
    daemon.local_shards = local.count  # processes of the run on this host (serve --busy-poll-us auto)
    return local


class LocalShards:
    """The shard processes ``serve --shards N`` starts on this host (slots 0..K-1, each with its
    own state directory ``<state>/shard-<i>``), started again when one dies (kill -9 included)
    while the run goes on. They are started from the daemon's loop, the main thread: the kernel's
    kill of a shard follows the death of the *thread* that started it (PR_SET_PDEATHSIG), so a
    thread that ends before the run must never start one."""

    def __init__(self, coordinator: str, state_dir: str, count: int, *, extra: tuple = (), log_level: str = "warning",
                 clock: Any = None, token: str = "") -> None:
        import time

        self.coordinator, self.state_dir, self.count = coordinator, state_dir, count
        self.extra, self.log_level = tuple(extra), log_level
        self.token = token  # given through the environment, never on the command line (ps shows it)
        self.clock = clock or time.monotonic
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.died_at: list[float | None] = [None] * count
        self.restarts = 0
        self.stopping = False
        self.logs: list = []

    def _start(self, i: int) -> None:
        from ps.ops.children import spawn

        d = os.path.join(self.state_dir, f"shard-{i}")
        os.makedirs(d, exist_ok=True)
        out = open(os.path.join(d, "shard.log"), "ab")  # noqa: SIM115 - closed by close()
        self.logs.append(out)
        # It lives as long as this process: killed with it (--exit-with-parent, watching this pid), never
        # giving up on a coordinator that is alive but slow (--coordinator-timeout 0).
        from ps.sharded.hub_admit import TOKEN_ENV

        env = {**os.environ, TOKEN_ENV: self.token} if self.token else None
        self.procs[i] = spawn("shard", "--coordinator", self.coordinator, "--state", d, "--slot", str(i),
                              "--exit-with-parent", f"--parent-pid={os.getpid()}", "--coordinator-timeout=0",
                              "--log-level", self.log_level, *self.extra, stdout=out, stderr=out, env=env)
        self.died_at[i] = None

    def start(self) -> None:
        for i in range(self.count):
            self._start(i)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def poll(self, now: float) -> None:
        if self.stopping:
            return
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is None:
                continue
            if self.died_at[i] is None:
                self.died_at[i] = now
                log.warning("local shard %d (pid %d) exited with status %s: starting it again", i, p.pid,
                            p.returncode)
            elif now - self.died_at[i] >= RESTART_AFTER_S:
                self.restarts += 1
                self._start(i)

    def close(self, grace_s: float = 30.0) -> None:
        """The run is over (the coordinator told the shards to stop): wait for them, ``grace_s`` in
        all; then SIGTERM (a shard stops on it as on ``stop``: the one that missed the coordinator's
        ``stop``, or every one when the daemon failed), and SIGKILL 5 s later."""
        import time

        from ps.ops.children import reap

        self.stopping = True
        procs = [p for p in self.procs if p is not None]
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        reap(procs, grace_s=5.0)
        for f in self.logs:
            f.close()
