"""``latecomer serve`` as two processes: a supervisor that holds the public endpoint, and the
daemon that owns the ZeroMQ socket.

The supervisor (this module, pure Python, no libzmq) spawns ``latecomer serve ...
--supervised-by PID:FD:ipc://PRIVATE`` and relays every connection to the daemon through the
front (ps/net/front.py), which bounds what a connection can make the daemon hold and keeps the
connection errors that abort libzmq 4.3.5 away from it. The daemon binds a Unix socket in a
private directory (mode 0700), tells the supervisor over an inherited pipe that it is ready
(and the frame and message bounds the front enforces), and then serves as it always has.

Should the daemon process still die of a signal (an abort inside libzmq, the OOM killer, a
``kill -9``), the supervisor starts it again: with ``--state`` it resumes from its checkpoint
and journal (every accepted reply is journaled before the core applies it) while the public
port stays bound, and the workers reconnect and say hello again by themselves. Without
``--state`` there is nothing to resume from: the supervisor then ends with a one-line error
(the port, the front's bounds and the clean shutdown are all it can keep). A daemon that exits
by itself (a stop condition, ``SIGTERM``, ``latecomer stop``, a start-up error) is never
restarted; the supervisor exits with its status. ``SIGTERM``, ``SIGINT`` and ``SIGHUP`` are
passed on to the daemon.

``serve --no-supervise`` runs the daemon alone on the public endpoint, as before (for
debugging; it gives up both bounds and the restart).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import json
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import click

log = logging.getLogger("latecomer.supervisor")

RESTARTS_WINDOW_S = 60.0  # at most MAX_RESTARTS restarts in this window, then give up
MAX_RESTARTS = 5
STOP_FLUSH_S = 2.0  # after the daemon exited: how long the front may still pass its last bytes on
PR_SET_PDEATHSIG = 1
TRIM_INTERVAL_S = 1.0  # the daemon hands freed memory back to the OS this often
META = "latecomer.supervise"
DEFAULT_FRAME_RATE = 20_000.0  # frames/s one connection may send through the front (Front._throttle)


# --------------------------------------------------------------------------- the serve command

def _store(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    ctx.meta.setdefault(META, {})[param.name] = value
    return value


class ServeCommand(click.Command):
    """``serve`` with the supervision options (kept out of the command's own signature) and
    its raw arguments recorded, so that the supervisor can start the daemon with them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params += [
            click.Option(["--supervise/--no-supervise"], default=True, show_default=True, expose_value=False,
                         callback=_store, is_eager=True,
                         help="Serve through the front (bounds on what one connection can make the server hold; "
                              "no connection error reaches libzmq) and restart the server process from --state "
                              "should it die (see SECURITY.md). --no-supervise: one process on the endpoint."),
            click.Option(["--max-unfinished-bytes"], type=click.IntRange(min=1), default=None, expose_value=False,
                         callback=_store, is_eager=True,
                         help="Bytes all connections' unfinished messages may hold in the server together "
                              "[default: max(256 MiB, 8 x the largest message a worker sends)]."),
            click.Option(["--max-connections"], type=click.IntRange(min=1), default=None, expose_value=False,
                         callback=_store, is_eager=True,
                         help="Connections the front holds at once; past it, a new one sheds the connection "
                              "silent longest, from the address holding the most (never an authenticated one) "
                              "[default: (the hard limit on open files - 64) / 2]."),
            click.Option(["--max-connections-per-source"], type=click.IntRange(min=0), default=0, show_default=True,
                         expose_value=False, callback=_store, is_eager=True,
                         help="Connections one source address may hold (0: no cap; workers behind one NAT "
                              "share an address). Past it, new connections from it are closed at once."),
            click.Option(["--max-frame-rate"], type=click.FloatRange(min=0), default=DEFAULT_FRAME_RATE,
                         show_default=True, expose_value=False, callback=_store, is_eager=True,
                         help="Frames per second one connection may send (a burst of one second's worth); "
                              "past it the front stops reading that connection until its budget is back: a "
                              "flood slows its sender, nothing is dropped (0: no bound)."),
            click.Option(["--seal"], type=click.Choice(["auto", "off"]), default="auto", show_default=True,
                         expose_value=False, callback=_store, is_eager=True,
                         help="Under --keys: auto moves what workers that ask send and receive after their "
                              "welcome to a second connection, each frame sealed (--seal-cipher) under keys "
                              "sent inside CurveZMQ (PROTOCOL.md 6.15; 2-3x CurveZMQ's speed on large "
                              "vectors); off: everything over CurveZMQ."),
            click.Option(["--seal-cipher"], type=click.Choice(["auto", "aes256gcm", "aegis256x4"]), default="auto",
                         show_default=True, expose_value=False, callback=_store_cipher, is_eager=True,
                         help="The sealed data connection's cipher. auto: AEGIS-256X4 with each worker that can "
                              "use it too (both ends with `pip install 'latecomer[aegis]'`; about 3x AES-GCM's "
                              "speed) when the iterate is at least 64 KiB on the wire, else AES-256-GCM; "
                              "aes256gcm: AES-256-GCM only; aegis256x4: only it, whatever the size (a worker "
                              "without it stays on CurveZMQ). PROTOCOL.md 6.15."),
            click.Option(["--hand-over"], type=click.Choice(["auto", "off"]), default="auto", show_default=True,
                         expose_value=False, callback=_store, is_eager=True,
                         help="auto has the front pass each plaintext connection (under --keys: each "
                              "sealed data connection), once its ZMTP handshake is done, to the server "
                              "process, which then reads and writes it itself with the front's bounds "
                              "(PROTOCOL.md 1, the front; without the relay's hop: 1.2-2.2x its updates per "
                              "second, benchmarks/RESULTS-handover.md); off: the front relays every byte."),
            click.Option(["--supervised-by"], hidden=True, default=None, expose_value=False, callback=_store,
                         is_eager=True),
        ]

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta.setdefault(META, {})["argv"] = list(args)
        return super().parse_args(ctx, args)


def _store_cipher(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """``--seal-cipher``: one this process can use (AEGIS-256X4 needs ``pyaegis``), else a one-line error."""
    if value == "aegis256x4":
        from protocol.seal import AEGIS, available_ciphers

        try:
            here = available_ciphers()
        except ValueError as e:  # LATECOMER_SEAL_CIPHERS
            raise click.UsageError(str(e)) from None
        if AEGIS not in here:
            raise click.BadParameter("AEGIS-256X4 is not available here: pip install 'latecomer[aegis]' (pyaegis, "
                                     "built from source: it needs a C compiler)")
    return _store(ctx, param, value)


def seal_ciphers(choice: str) -> tuple[str, ...]:
    """``--seal-cipher``'s ciphers, the first a worker can use taken (protocol/seal.py choose_cipher)."""
    from protocol.seal import available_ciphers

    return available_ciphers() if choice == "auto" else (choice,)


def _meta() -> dict[str, Any]:
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(META, {}) if ctx is not None else {}


def is_supervisor() -> bool:
    """True in ``serve`` (supervised, the default) before any daemon exists: this process then
    becomes the supervisor and never builds the daemon itself."""
    m = _meta()
    return bool(m.get("supervise", False)) and not m.get("supervised_by")


def set_pdeathsig(sig: int) -> str | None:
    """Have the kernel send ``sig`` to this process when the *thread* that started it ends (Linux
    ``prctl(PR_SET_PDEATHSIG)``; the thread, not the process: a parent that starts children from a
    thread that may end first must not rely on it). Returns None once set, else why not (not
    Linux, or the call's error: ctypes returns -1 without raising, so it is checked here)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return "prctl(PR_SET_PDEATHSIG) is not available here"
    ctypes.set_errno(0)
    if prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(int(sig)), ctypes.c_ulong(0), ctypes.c_ulong(0),
             ctypes.c_ulong(0)) != 0:
        return f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno() or 0)}"
    return None


def daemon_bind(bind: str) -> str:
    """The endpoint the daemon binds: the private one in a supervised child, else ``bind``.
    A supervised child dies with its supervisor (PR_SET_PDEATHSIG); should the prctl fail, its
    loop stops it once the supervisor is gone (:func:`watch_supervisor`)."""
    spec = _meta().get("supervised_by")
    if not spec:
        return bind
    ppid, _fd, endpoint = spec.split(":", 2)
    why = set_pdeathsig(signal.SIGKILL)
    if why:
        log.warning("%s: this server process stops within 0.5 s of its supervisor instead", why)
    if os.getppid() != int(ppid):  # the supervisor died before the prctl
        raise SystemExit(1)
    return endpoint


def watch_supervisor(daemon: Any) -> None:
    """A supervised daemon whose supervisor is gone (its parent is no longer the supervisor's pid:
    the kill of the supervisor that PR_SET_PDEATHSIG did not pass on) stops as on ``SIGTERM``,
    its local shards with it: nobody can reach it any more (the supervisor held the endpoint).
    Checked at most every 0.1 s, on a pass of the daemon's loop (at most 100 ms apart)."""
    spec = _meta().get("supervised_by")
    if not spec:
        return
    ppid = int(spec.split(":", 1)[0])

    due = [0.0]

    def check(now: float) -> None:  # at most every 0.1 s, not every pass (a pass is one update in lockstep)
        if now >= due[0]:
            due[0] = now + 0.1
            if daemon.stopping is None and os.getppid() != ppid:
                daemon.stopping = f"the supervisor (pid {ppid}) is gone"
    daemon.hooks.append(check)


def _start_trimmer() -> None:
    """Give memory that was freed back to the OS every TRIM_INTERVAL_S (``malloc_trim``): what a
    connection made libzmq's I/O thread hold (its unfinished message, rolled back when the
    connection goes) would otherwise stay in glibc's arenas, counted in the RSS for good."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return  # not glibc

    def loop() -> None:
        while True:
            time.sleep(TRIM_INTERVAL_S)  # a period, not a wait for anything
            trim(0)

    threading.Thread(target=loop, name="malloc-trim", daemon=True).start()


def _hb_repeat_s(daemon: Any) -> float:
    """The front's window for heartbeat repeats (Front._repeat): half the daemon's own (0: none)."""
    limits = getattr(getattr(daemon, "conns", None), "limits", None)
    return float(getattr(limits, "hb_refresh_s", 0.0)) / 2


def announce(daemon: Any) -> None:
    """Say the daemon is ready: print the endpoint (alone), or tell the supervisor the private
    endpoint and the bounds its front enforces. Either way memory the daemon frees goes back to
    the OS from now on (:func:`_start_trimmer`)."""
    _start_trimmer()
    spec = _meta().get("supervised_by")
    if not spec:
        click.echo(f"latecomer: listening on {daemon.endpoint}")
        sys.stdout.flush()
        return
    import zmq

    from protocol.messages import MAX_ARRAYS, MAX_HEADER_BYTES

    _ppid, fd, _endpoint = spec.split(":", 2)
    largest = MAX_HEADER_BYTES + 2 * daemon.max_array_bytes  # a header and a pair of float64 gradients
    info = {"endpoint": daemon.endpoint, "mechanism": "CURVE" if daemon.security is not None else "NULL",
            "max_frame_bytes": daemon.sock.getsockopt(zmq.MAXMSGSIZE), "max_message_bytes": largest,
            "max_frames": 1 + MAX_ARRAYS, "pid": os.getpid(),
            "hb_repeat_s": _hb_repeat_s(daemon)}
    if daemon.security is not None:  # the sealed data path (PROTOCOL.md §6.15), if the supervisor made a secret
        from ps.net.sealed import attach, secret_path

        try:
            with open(secret_path(_endpoint), "rb") as f:
                secret = f.read()
        except OSError:
            secret = b""
        if secret:
            seal = _endpoint.removesuffix(".sock") + "-seal.sock"
            attach(daemon.transport, seal, secret, seal_ciphers(_meta().get("seal_cipher", "auto")))
            info["seal_endpoint"] = seal.removeprefix("ipc://")
            if _meta().get("hand_over", "auto") != "off":  # the front hands the sealed data connections over
                info["hand_endpoint"] = _accept_hand_overs(daemon, _endpoint, info, sealed=True)
    elif _meta().get("hand_over", "auto") != "off":  # plaintext: the front hands connections over
        info["hand_endpoint"] = _accept_hand_overs(daemon, _endpoint, info)
    with os.fdopen(int(fd), "w", encoding="utf-8") as f:
        f.write(json.dumps(info) + "\n")


def _accept_hand_overs(daemon: Any, endpoint: str, info: dict[str, Any], sealed: bool = False) -> str:
    """Bind the daemon's hand-over socket beside its private endpoint, with the bounds the front
    would enforce on a relayed connection (ps/net/handover.py; ``sealed``: on a sealed data
    connection, :func:`_data_limits`); returns its path."""
    from protocol.zmtp import ZmtpLimits
    from ps.net.front import MAX_COMMAND_BYTES, PROGRESS_FLOOR_BYTES, PROGRESS_WINDOW_S
    from ps.net.handover import HAND_SOCKET, HandLimits, attach

    m = _meta()
    front = _limits(info, m.get("max_unfinished_bytes"), m.get("max_frame_rate", DEFAULT_FRAME_RATE))
    if sealed:
        front = _data_limits(info, front)
    zl = ZmtpLimits(max_frame_bytes=front.max_frame_bytes, max_message_bytes=front.max_message_bytes,
                    max_frames=front.max_frames, max_command_bytes=MAX_COMMAND_BYTES)
    budget = _budget(m.get("max_connections"), m.get("max_connections_per_source") or 0)
    limits = HandLimits(zmtp=zl, max_pending_bytes=front.max_pending_bytes, max_frame_rate=front.max_frame_rate,
                        max_connections=budget.max_clients, max_out_messages=daemon.sock.sndhwm,
                        window_s=PROGRESS_WINDOW_S, floor_bytes=PROGRESS_FLOOR_BYTES)
    path = os.path.join(os.path.dirname(endpoint.removeprefix("ipc://")), HAND_SOCKET)
    attach(daemon.transport, path, limits)
    return path


# --------------------------------------------------------------------------- the supervisor

def _limits(info: dict[str, Any], max_unfinished: int | None, max_frame_rate: float = DEFAULT_FRAME_RATE):
    from ps.net.front import Limits

    largest = int(info["max_message_bytes"])
    return Limits(mechanism=info["mechanism"].encode(), max_frame_bytes=int(info["max_frame_bytes"]),
                  max_message_bytes=largest, max_frames=int(info["max_frames"]),
                  max_pending_bytes=max_unfinished or max(256 << 20, 8 * largest),
                  hb_repeat_s=float(info.get("hb_repeat_s", 0.0)), max_frame_rate=max_frame_rate)


def _data_limits(info: dict[str, Any], limits: Any):
    """The front's bounds on sealed data connections (NULL): frames and messages as the daemon's,
    each frame with its 16-byte tags (one per segment, protocol/seal.py), a message with its prefix
    frame; no heartbeat repeats (a sealed heartbeat never repeats its bytes)."""
    from protocol.seal import TAG_BYTES, sealed_frame_bytes

    frames = int(info["max_frames"]) + 1
    return dataclasses.replace(limits, mechanism=b"NULL", max_frame_bytes=sealed_frame_bytes(limits.max_frame_bytes),
                               max_message_bytes=sealed_frame_bytes(limits.max_message_bytes) + frames * TAG_BYTES + 64,
                               max_frames=frames, hb_repeat_s=0.0)


def _budget(max_connections: int | None, per_source: int):
    """The front's connection budget (SECURITY.md, "Limits and rates"): two descriptors per client
    within the soft limit (raised to the hard one) less FD_RESERVE. The daemon, started after the
    raise, has the same limit and holds one descriptor per client and per client draining, at
    most ``max_fds`` in all: its own baseline (libzmq, the journal, logs) fits in the reserve."""
    from ps.net.front import Budget

    b = Budget.from_rlimit(per_source=per_source)
    if max_connections is not None and 2 * max_connections < b.max_fds:
        b = Budget(max_fds=2 * max_connections, per_source=per_source)
    return b


def _raise_nofile() -> None:
    """Two descriptors per connection: take the hard limit on open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        except (ValueError, OSError):
            pass


def _stream_fd(stream: Any) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None  # not a real file (click's test runner): the child's output is relayed


class Supervisor:
    """Runs the daemon as a child process behind the front, restarting it as the module says.

    Args:
        bind: the public endpoint (validated).
        argv: the ``serve`` arguments the daemon is started with.
        state_dir: the run's ``--state`` (None: a dead daemon cannot be resumed).
        max_unfinished: ``--max-unfinished-bytes`` (None: the default).
    """

    def __init__(self, bind: str, argv: list[str], state_dir: str | None, max_unfinished: int | None,
                 max_connections: int | None = None, per_source: int = 0,
                 max_frame_rate: float = DEFAULT_FRAME_RATE, seal: bool = True) -> None:
        from ps.net.front import Front

        self.max_connections, self.per_source = max_connections, per_source
        self.max_frame_rate = max_frame_rate
        self.bind = bind
        self.argv = argv
        self.state_dir = state_dir
        self.max_unfinished = max_unfinished
        self.listener: socket.socket | None = None
        self.front: Front | None = None
        self.private = tempfile.mkdtemp(prefix="latecomer-front-")  # mode 0700: only this user
        self.backend = os.path.join(self.private, "daemon.sock")
        self.seal = seal  # offer the sealed data path under CurveZMQ (serve --seal)
        self.seal_secret = b""  # the tokens' secret the front shares with the daemon (ps/net/sealed.py)
        self.child: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.ready_r: int | None = None
        self.ready_buf = b""
        self.ready_at: float | None = None
        self.child_ready = False
        self.stopping = False
        self.done: int | None = None  # the exit status once decided
        self.restarts: list[float] = []
        self.relays: dict[int, Any] = {}  # child's stdout/stderr pipe -> our stream (test runners only)
        self.sig_r, self.sig_w = socket.socketpair()
        self.pending_signals: collections.deque[int] = collections.deque()  # appended by the handler

    # ---------------------------------------------------------------- child
    def _spawn(self) -> None:
        r, w = os.pipe()
        os.set_inheritable(w, True)
        args = [sys.executable, "-m", "ps", "serve", *self.argv,
                "--supervised-by", f"{os.getpid()}:{w}:ipc://{self.backend}"]
        out = {}
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            out[name] = None if _stream_fd(stream) is not None else subprocess.PIPE
        from ps.net.sealed import write_secret

        # a new secret per daemon (its tokens die with it); none: the daemon offers no sealed path
        self.seal_secret = write_secret(self.private) if self.seal else b""
        for stale in (self.backend.removesuffix(".sock") + "-seal.sock",):
            try:
                os.unlink(stale)
            except OSError:
                pass
        try:
            os.unlink(self.backend)
        except FileNotFoundError:
            pass
        self.child = subprocess.Popen(args, pass_fds=(w,), stdin=subprocess.DEVNULL, **out)
        os.close(w)
        self.ready_r, self.ready_buf, self.child_ready = r, b"", False
        self.front.watch(r, self._on_ready)
        for pipe, stream in ((self.child.stdout, sys.stdout), (self.child.stderr, sys.stderr)):
            if pipe is not None:
                fd = pipe.fileno()
                self.relays[fd] = (pipe, stream)
                self.front.watch(fd, functools.partial(self._relay, fd))
        try:
            self.pidfd = os.pidfd_open(self.child.pid)
            self.front.watch(self.pidfd, self._on_exit)
        except (AttributeError, OSError):
            self.pidfd = None  # polled by the loop instead

    def _relay(self, fd: int) -> None:
        pipe, stream = self.relays[fd]
        data = os.read(fd, 65536)
        if not data:
            self.front.unwatch(fd)
            del self.relays[fd]
            return
        stream.write(data.decode(errors="replace"))
        stream.flush()

    def _on_ready(self) -> None:
        data = os.read(self.ready_r, 4096)
        self.ready_buf += data
        if b"\n" not in self.ready_buf and data:
            return
        self.front.unwatch(self.ready_r)
        os.close(self.ready_r)
        self.ready_r = None
        if not self.ready_buf.strip():
            return  # the child closed it without a word: its exit tells the rest
        info = json.loads(self.ready_buf.split(b"\n")[0])
        if self.listener is None:  # the first start: the public endpoint now
            if not self._listen():
                return
        self.child_ready = True
        limits = _limits(info, self.max_unfinished, self.max_frame_rate)
        data = None
        if info.get("seal_endpoint") and self.seal_secret:
            data = (info["seal_endpoint"], _data_limits(info, limits), self.seal_secret)
        self.front.set_backend(self.backend, limits, data, info.get("hand_endpoint"))
        if self.ready_at is not None:
            log.warning("the server process is back (pid %d) %.2f s after the last one died", info["pid"],
                        time.monotonic() - self.ready_at)
            self.ready_at = None

    def _listen(self) -> bool:
        from ps.net.front import endpoint_of, listen

        try:
            self.listener = listen(self.bind)
        except OSError as e:
            click.echo(f"Error: cannot bind {self.bind}: {e.strerror or e}", err=True)
            self._stop_child()
            self.done = 1
            return False
        self.front.listener = self.listener
        self.listener.setblocking(False)
        click.echo(f"latecomer: listening on {endpoint_of(self.listener, self.bind)}")
        sys.stdout.flush()
        return True

    def _on_exit(self) -> None:
        rc = self.child.wait()
        if self.pidfd is not None:
            self.front.unwatch(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        for fd in list(self.relays):  # what the child wrote last
            while fd in self.relays:
                self._relay(fd)
        if self.ready_r is not None:
            self.front.unwatch(self.ready_r)
            os.close(self.ready_r)
            self.ready_r = None
        was_ready, self.child, self.child_ready = self.child_ready, None, False
        self._flush_front()
        self.front.set_backend(None)
        if rc >= 0 or self.stopping:
            self.done = rc if rc >= 0 else 128 - rc
            return
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        if not was_ready and not self.restarts:
            click.echo(f"Error: the server process died of {name} while starting", err=True)
            self.done = 1
            return
        if self.state_dir is None:
            click.echo(f"Error: the server process died of {name}; without --state there is nothing to resume "
                       "from, so the run ends here (serve --state DIR restarts it where it was)", err=True)
            self.done = 1
            return
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTARTS_WINDOW_S] + [now]
        if len(self.restarts) > MAX_RESTARTS:
            click.echo(f"Error: the server process died of {name}, the {MAX_RESTARTS + 1}th time within "
                       f"{RESTARTS_WINDOW_S:.0f} s: giving up (its log above says why)", err=True)
            self.done = 1
            return
        log.warning("the server process died of %s: restarting it from %s (restart %d)", name, self.state_dir,
                    len(self.restarts))
        self.ready_at = now
        self._spawn()

    def _flush_front(self) -> None:
        """Let the front pass on what the daemon sent last (its bye) before the connections go."""
        deadline = time.monotonic() + STOP_FLUSH_S
        while self.front.pairs and time.monotonic() < deadline:
            self.front.run_once(0.05)

    def _stop_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    # ---------------------------------------------------------------- signals
    def _on_signal_fd(self) -> None:
        try:
            self.sig_r.recv(4096)
        except BlockingIOError:
            pass
        while self.pending_signals:
            signum = self.pending_signals.popleft()
            if signum in (signal.SIGTERM, signal.SIGINT):
                self.stopping = True
            if self.child is not None and self.child.poll() is None:
                self.child.send_signal(signum)
            elif self.stopping:
                self.done = 0 if self.done is None else self.done

    def _handler(self, signum: int, frame: Any) -> None:
        self.pending_signals.append(signum)

    # ---------------------------------------------------------------- main
    def run(self) -> int:
        from ps.net.front import Front

        _raise_nofile()
        self.sig_r.setblocking(False)
        self.sig_w.setblocking(False)
        signal.set_wakeup_fd(self.sig_w.fileno(), warn_on_full_buffer=False)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._handler)
        placeholder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # until the public one is bound
        self.front = Front(placeholder, budget=_budget(self.max_connections, self.per_source))
        self.front.watch(self.sig_r.fileno(), self._on_signal_fd)
        try:
            self._spawn()
            while self.done is None:
                self.front.run_once(0.2)
                if self.pending_signals:
                    self._on_signal_fd()
                if self.pidfd is None and self.child is not None and self.child.poll() is not None:
                    self._on_exit()
            return self.done
        finally:
            signal.set_wakeup_fd(-1)
            if self.child is not None and self.child.poll() is None:
                self.child.kill()
                self.child.wait()
            self.front.close()
            if self.listener is not None and self.listener.family == socket.AF_UNIX:
                try:  # an ipc:// endpoint goes with the server, as libzmq's does
                    os.unlink(self.listener.getsockname())
                except OSError:
                    pass
            for s in (self.listener, placeholder, self.sig_r, self.sig_w):
                if s is not None:
                    s.close()
            shutil.rmtree(self.private, ignore_errors=True)


def supervise(bind: str, state_dir: str | None) -> int:
    """Run ``serve`` supervised (the command line's own arguments); returns the exit status."""
    m = _meta()
    return Supervisor(bind, list(m.get("argv", [])), state_dir, m.get("max_unfinished_bytes"),
                      m.get("max_connections"), m.get("max_connections_per_source") or 0,
                      m.get("max_frame_rate", DEFAULT_FRAME_RATE), m.get("seal", "auto") != "off").run()
