"""``latecomer launch``: start (and stop) workers on a list of hosts over ssh.

The hosts file has one line per host, ``HOST COUNT [DEVICE]``::

    # host            workers  device
    gpu-box-1         4        cuda      # cuda:0 .. cuda:3
    cpu-box-1         8                  # cpu
    alice@cpu-box-2   2        cpu

``DEVICE`` is ``cpu`` (default), ``cuda`` (with COUNT > 1 worker i gets ``cuda:i``) or ``cuda:N``
(every worker of that host on GPU N). Worker ids are ``HOST-i`` (i from 0, the user part of
``user@host`` left out), so a host's workers keep their names across launches.

Each worker is started with ``ssh -n -o BatchMode=yes HOST 'setsid nohup latecomer work ... &
echo $!'``: it survives the ssh session, and the remote PID it prints is recorded in a JSON
launch file, which ``latecomer launch --stop`` reads to stop them again (SIGTERM, so they say
bye to the server; SIGKILL for any still alive after the grace period).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Callable

DEFAULT_LAUNCH_FILE = "latecomer-launch.json"
_HOST_RX = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(@[A-Za-z0-9_.\-\[\]:]+)?$")
_DEVICE_RX = re.compile(r"^(cpu|cuda|cuda:\d+)$")
_ID_RX = re.compile(r"[^A-Za-z0-9_.\-]")


class LaunchError(ValueError):
    """A user mistake (hosts file, launch file) or a failed ssh: one line, no traceback."""


@dataclass(frozen=True)
class HostSpec:
    host: str
    count: int
    device: str = "cpu"
    line: int = 0


@dataclass
class Worker:
    host: str
    worker_id: str
    device: str
    log: str
    pid: int | None = None


def parse_hosts(text: str, source: str = "hosts file") -> list[HostSpec]:
    """Parse ``HOST COUNT [DEVICE]`` lines; raise LaunchError naming the line and the reason."""
    out: list[HostSpec] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{source}:{n}"
        if len(parts) not in (2, 3):
            raise LaunchError(f"{where}: expected HOST COUNT [DEVICE], got {line!r}")
        host, count_s = parts[0], parts[1]
        device = parts[2] if len(parts) == 3 else "cpu"
        if not _HOST_RX.match(host):
            raise LaunchError(f"{where}: {host!r} is not a host name (letters, digits, '.', '-', '_', user@host)")
        try:
            count = int(count_s)
        except ValueError:
            raise LaunchError(f"{where}: COUNT must be a whole number, got {count_s!r}") from None
        if not 1 <= count <= 1024:
            raise LaunchError(f"{where}: COUNT must be between 1 and 1024, got {count}")
        if not _DEVICE_RX.match(device):
            raise LaunchError(f"{where}: DEVICE must be cpu, cuda or cuda:N, got {device!r}")
        if host in seen:
            raise LaunchError(f"{where}: host {host!r} already listed on line {seen[host]}")
        seen[host] = n
        out.append(HostSpec(host, count, device, n))
    if not out:
        raise LaunchError(f"{source}: no hosts (one line per host: HOST COUNT [DEVICE])")
    return out


def read_hosts(path: str) -> list[HostSpec]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise LaunchError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise LaunchError(f"{path}: not a UTF-8 text file") from None
    return parse_hosts(text, source=path)


def plan(hosts: list[HostSpec], log_dir: str = "/tmp") -> list[Worker]:
    """The workers to start: ids ``HOST-i`` and their devices."""
    out = []
    for h in hosts:
        name = _ID_RX.sub("_", h.host.rpartition("@")[2])
        for i in range(h.count):
            device = f"cuda:{i}" if h.device == "cuda" and h.count > 1 else h.device
            wid = f"{name}-{i}"
            out.append(Worker(h.host, wid, device, f"{log_dir.rstrip('/') or '/'}/latecomer-{wid}.log"))
    return out


def _quote_path(token: str) -> str:
    """Quote for a POSIX shell, keeping a leading ``~/`` expandable."""
    if token.startswith("~/"):
        return "~/" + shlex.quote(token[2:])
    return shlex.quote(token)


def remote_start_command(w: Worker, server: str, remote_cmd: str = "latecomer",
                         worker_args: tuple[str, ...] = ()) -> str:
    """The shell command run on the host: detach the worker and print its PID."""
    argv = [_quote_path(t) for t in shlex.split(remote_cmd)]
    argv += ["work", "--server", shlex.quote(server), "--worker-id", shlex.quote(w.worker_id)]
    if w.device != "cpu":
        argv += ["--device", shlex.quote(w.device)]
    argv += [shlex.quote(a) for a in worker_args]
    return f"setsid nohup {' '.join(argv)} > {_quote_path(w.log)} 2>&1 < /dev/null & echo $!"


def remote_stop_command(pids: list[int], grace_s: float = 10.0) -> str:
    """SIGTERM each PID that is still a ``latecomer``/``ps`` worker, SIGKILL what outlives the grace period.

    Prints ``stopped PID``, ``killed PID`` or ``gone PID`` per process. A recycled PID (another
    program by now) is left alone."""
    ids = " ".join(str(int(p)) for p in pids)
    ticks = max(1, int(grace_s * 10))
    return (
        "alive() { s=$(ps -o stat= -p \"$1\" 2>/dev/null) && case \"$s\" in Z*) return 1;; esac; }; "
        "sent=''; "
        f"for p in {ids}; do "
        "if alive \"$p\" && ps -o args= -p \"$p\" 2>/dev/null | grep -q ' work '; then "
        "kill -TERM \"$p\" 2>/dev/null; sent=\"$sent $p\"; else echo \"gone $p\"; fi; done; "
        f"i=0; while [ $i -lt {ticks} ]; do left=''; "
        "for p in $sent; do alive \"$p\" && left=\"$left $p\"; done; "
        "[ -z \"$left\" ] && break; sleep 0.1; i=$((i+1)); done; "
        "for p in $sent; do if alive \"$p\"; then kill -KILL \"$p\" 2>/dev/null; echo \"killed $p\"; "
        "else echo \"stopped $p\"; fi; done"
    )


def ssh_argv(ssh: str, host: str, command: str) -> list[str]:
    return [*shlex.split(ssh), "-n", "-o", "BatchMode=yes", host, command]


def _run_ssh(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise LaunchError(f"cannot run {argv[0]!r}: not found (see --ssh)") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{shlex.join(argv[:-1])}: no answer within {timeout:g} s") from None


def _last_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def write_launch_file(path: str, record: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def read_launch_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except OSError as e:
        raise LaunchError(f"cannot read launch file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise LaunchError(f"{path} is not a launch file (invalid JSON: {e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("workers"), list):
        raise LaunchError(f"{path} is not a launch file (no 'workers' list)")
    return record


def launch(hosts: list[HostSpec], server: str, launch_file: str, *, ssh: str = "ssh",
           remote_cmd: str = "latecomer", worker_args: tuple[str, ...] = (), log_dir: str = "/tmp",
           timeout: float = 30.0, echo: Callable[[str], None] = print) -> dict:
    """Start every worker; write the launch file (also after a partial failure). Returns its record."""
    record = {"server": server, "ssh": ssh, "started_at": time.time(), "workers": []}
    failures = []
    for w in plan(hosts, log_dir):
        argv = ssh_argv(ssh, w.host, remote_start_command(w, server, remote_cmd, worker_args))
        r = _run_ssh(argv, timeout)
        last = _last_line(r.stdout)
        if r.returncode != 0 or not last.isdigit():
            why = _last_line(r.stderr) or last or f"exit status {r.returncode}"
            failures.append(f"{w.worker_id} on {w.host}: {why}")
            continue
        w.pid = int(last)
        record["workers"].append(asdict(w))
        write_launch_file(launch_file, record)
        echo(f"started {w.worker_id} on {w.host} ({w.device}): pid {w.pid}, log {w.log}")
    if not record["workers"]:
        raise LaunchError(f"no worker started: {failures[0]}")
    write_launch_file(launch_file, record)
    if failures:
        raise LaunchError(f"started {len(record['workers'])} of {len(record['workers']) + len(failures)} workers "
                          f"({failures[0]}); `latecomer launch --stop --launch-file {launch_file}` stops them")
    return record


def stop(launch_file: str, *, ssh: str | None = None, grace_s: float = 10.0, timeout: float = 60.0,
         echo: Callable[[str], None] = print) -> dict[str, str]:
    """Stop the workers a launch file records; remove the file when every host answered."""
    record = read_launch_file(launch_file)
    ssh = ssh or record.get("ssh") or "ssh"
    by_host: dict[str, list[dict]] = {}
    for w in record["workers"]:
        by_host.setdefault(w["host"], []).append(w)
    outcome: dict[str, str] = {}
    failed = []
    for host, ws in by_host.items():
        names = {int(w["pid"]): w["worker_id"] for w in ws}
        r = _run_ssh(ssh_argv(ssh, host, remote_stop_command(list(names), grace_s)), timeout + grace_s)
        if r.returncode != 0:
            failed.append(f"{host}: {_last_line(r.stderr) or f'exit status {r.returncode}'}")
            continue
        for line in r.stdout.splitlines():
            what, _, pid = line.strip().partition(" ")
            if pid.isdigit() and int(pid) in names:
                outcome[names[int(pid)]] = what
                echo(f"{what} {names[int(pid)]} on {host} (pid {pid})")
    if failed:
        raise LaunchError(f"could not reach {len(failed)} host(s) ({failed[0]}); {launch_file} kept")
    os.remove(launch_file)
    return outcome
