"""The state directory against a full disk, a stale or forged server.pid, a second server, and
damage (issue 13, points 8, 10 and 11), with real processes.

- A full disk (a small tmpfs mounted here, as root) pauses the server: it stays up, says so in
  ``latecomer status`` and its log, issues no job; once space is back it resumes by itself and
  nothing it accepted is lost (accounting identity, exact replay).
- ``latecomer stop`` signals only the server that holds the state directory's lock: never a
  process a stale or forged ``server.pid`` names; ``-1`` or garbage is one line.
- A second ``serve`` on a state directory in use is refused with one line.
- A damaged or unexpected state directory stops ``serve --state`` and ``replay`` with one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest

from ps.journal.checkpoints import write_checkpoint
from ps.journal.records import REC_HEADER
from ps.ops.status import fetch_status
from tests.integration.attack import Victim
from tests.integration.util import wait_exit, wait_line

pytestmark = pytest.mark.slow


def latecomer(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ps", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The command failed with exactly one line on stderr (no traceback); returns it."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    return lines[0]


# --------------------------------------------------------------------------- a full disk

def status_info(endpoint: str) -> dict:
    return dict(fetch_status(endpoint, timeout_s=10).info)


def wait_status(endpoint: str, cond, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = status_info(endpoint)
        if cond(info):
            return info
        assert time.monotonic() < deadline, f"status never met the condition: {info}"
        time.sleep(0.1)  # polling interval of a bounded wait


def fill(directory: str) -> str:
    """Write a file in ``directory`` until the filesystem refuses (ENOSPC); returns its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
            block = b"\0" * chunk
            try:
                while True:
                    os.write(fd, block)
            except OSError as e:
                assert e.errno == 28, e  # ENOSPC
    finally:
        os.close(fd)
    return path


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs mounted under tmp_path (skipped where mounting is not permitted)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_pauses_the_server_and_it_resumes_when_space_is_back(procs, small_disk):
    """Before the fix the server exited on ENOSPC. Now: alive, paused in status and the log, no
    job issued while paused; then training resumes and the run replays exactly."""
    victim = Victim(procs, small_disk, extra_serve=("--max-journal-bytes", str(2 << 20)))
    filler = fill(str(small_disk))
    info = wait_status(victim.endpoint, lambda i: "paused" in i, timeout=15)
    assert "No space left on device" in info["paused"], info["paused"]
    issued = info["counter.issued"]
    time.sleep(1.5)  # the window over which no job may be issued
    info = status_info(victim.endpoint)
    assert victim.alive() and "paused" in info and info["paused_s"] >= 1.0
    assert info["counter.issued"] == issued, "no job is issued while the disk is full"
    paused = f"{info['paused_s']:.1f} s: {info['paused']}"
    os.remove(filler)
    t_free = time.monotonic()
    info = wait_status(victim.endpoint, lambda i: "paused" not in i, timeout=15)
    victim.wait_applied(victim.events.applied + 100, timeout=60)  # training resumed
    resumed_s = time.monotonic() - t_free
    summary = victim.finish()  # accounting identity; the journal replays exactly to final_x
    assert summary["counters"]["issued"] > issued
    print(f"paused ({paused}), {issued} jobs issued throughout; 100 more updates applied {resumed_s:.1f} s after "
          f"the space was freed; {summary['counters']['issued']} issued in all, accounted, replayed exactly")
    err = victim.server.stderr.read().decode(errors="replace")
    assert "issuing no jobs and accepting no messages" in err and "training resumes" in err, err[-2000:]
    assert "Traceback" not in err


# --------------------------------------------------------------------------- latecomer stop and the lock

def start_server(procs, state: str, *extra: str):
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "quadratic",
                         "--algorithm", "asgd", "--set", "lr=0.1", "--eval-every", "0", *extra)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    return server, endpoint


def test_stop_never_signals_a_process_a_stale_or_forged_server_pid_names(procs, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        # a server.pid left by a crash, its pid since reused by an unrelated process
        (state / "server.pid").write_text(f"{sleeper.pid}\n")
        line = one_line_error(latecomer("stop", "--state", str(state)))
        assert "no server is running" in line and "nothing was signalled" in line
        for garbage in ("-1", "garbage", "0", f"{sleeper.pid} {time.time()}"):
            (state / "server.pid").write_text(garbage + "\n")
            line = one_line_error(latecomer("stop", "--state", str(state)))
            assert "nothing was signalled" in line, line
        # a file that is locked (as by a live server) but names the sleeper: its start time differs
        import fcntl

        fd = os.open(state / "server.pid", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            for text in (f"{sleeper.pid} 12345.5", "-1", "not a pid"):
                os.ftruncate(fd, 0)
                os.pwrite(fd, text.encode(), 0)
                line = one_line_error(latecomer("stop", "--state", str(state)))
                assert "nothing was signalled" in line, line
        finally:
            os.close(fd)
        assert sleeper.poll() is None, "the unrelated process was not signalled"
    finally:
        sleeper.kill()
        sleeper.wait(5)


def test_one_server_per_state_dir_and_stop_stops_the_real_one(procs, tmp_path):
    state = str(tmp_path / "state")
    server, endpoint = start_server(procs, state)
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1", "--delay", "0.01")
    second = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "quadratic",
                         "--algorithm", "asgd", "--set", "lr=0.1")
    assert wait_exit(second, timeout=60) == 1
    err = second.stderr.read().decode()
    assert "is in use by another server" in err and "Traceback" not in err, err
    assert server.poll() is None, "the first server runs on"
    r = latecomer("stop", "--state", state, timeout=90)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
    assert wait_exit(server, timeout=10) == 0
    assert wait_exit(worker, timeout=20) == 0
    assert not os.path.exists(os.path.join(state, "server.pid")), "a clean exit removes it"
    # killed -9, the lock goes with the process: stop refuses, and a new server resumes there
    server, endpoint = start_server(procs, state)
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(10)
    assert os.path.exists(os.path.join(state, "server.pid"))
    assert "no server is running" in one_line_error(latecomer("stop", "--state", state))
    server, endpoint = start_server(procs, state)
    assert fetch_status(endpoint).info["version"] >= 0
    assert latecomer("stop", "--state", state, timeout=90).returncode == 0
    assert wait_exit(server, timeout=10) == 0


# --------------------------------------------------------------------------- damage: one line

def record(body: dict) -> bytes:
    import zlib

    data = msgpack.packb(body, use_bin_type=True)
    return REC_HEADER.pack(len(data), zlib.crc32(data)) + data


def recorded_run(procs, state: str) -> None:
    server, endpoint = start_server(procs, state, "--max-steps", "60", "--checkpoint-every", "20")
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1")
    assert wait_exit(server, timeout=90) == 0
    wait_exit(worker, timeout=20)


def serve_again(state: str) -> subprocess.CompletedProcess:
    return latecomer("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "quadratic", "--algorithm",
                     "asgd", "--set", "lr=0.1", "--max-time", "0.5")


def test_a_damaged_state_directory_is_one_line(procs, tmp_path):
    state = str(tmp_path / "state")
    recorded_run(procs, state)
    names = sorted(os.listdir(state))
    wal = os.path.join(state, [n for n in names if n.startswith("wal-")][-1])
    ckpts = sorted(n for n in names if n.startswith("ckpt-"))
    good = open(wal, "rb").read()

    # a journal record with a valid checksum but no lsn, appended: serve and replay say where
    with open(wal, "ab") as f:
        f.write(record({"op": "tick", "now": 1.0}) + record({"lsn": 10**6, "op": "tick", "now": 2.0}))
    for r in (serve_again(state), latecomer("replay", state)):
        line = one_line_error(r)
        assert os.path.basename(wal) in line and f"byte {len(good)}" in line and "'lsn'" in line, line
    # a checksum failure mid-segment is not a torn tail
    raw = bytearray(good)
    raw[len(raw) // 2] ^= 0xFF
    open(wal, "wb").write(bytes(raw) + record({"lsn": 0, "op": "tick", "now": 1.0}))
    line = one_line_error(latecomer("replay", state))
    assert "fails its checksum" in line and os.path.basename(wal) in line, line
    open(wal, "wb").write(good)

    # a checkpoint with a valid checksum but a missing key: skipped for the previous one (warning)
    newest = os.path.join(state, ckpts[-1])
    lsn = int(ckpts[-1][5:-4])
    os.remove(newest)
    write_checkpoint(state, lsn, {"format": 1, "algorithm": "asgd"}, keep=10)
    r = serve_again(state)
    assert r.returncode == 0 and "does not restore" in r.stderr and "Traceback" not in r.stderr, r.stderr

    # run.json that is not JSON, or lacks a field
    run_json = os.path.join(state, "run.json")
    run = json.load(open(run_json))
    open(run_json, "w").write("{not json")
    for r in (serve_again(state), latecomer("replay", state)):
        assert "run.json" in one_line_error(r)
    open(run_json, "w").write(json.dumps({k: v for k, v in run.items() if k != "core"}))
    assert "'core'" in one_line_error(serve_again(state))
    open(run_json, "w").write(json.dumps({**run, "core": {**run["core"], "bogus": 1}}))
    assert "core settings" in one_line_error(serve_again(state))
    json.dump(run, open(run_json, "w"))

    # an unexpected file that looks like a segment
    open(os.path.join(state, "wal-x.log"), "wb").write(b"junk")
    assert "wal-x.log" in one_line_error(serve_again(state))


def test_replay_starts_from_the_oldest_kept_checkpoint_once_the_journal_head_is_removed(procs, tmp_path):
    state = str(tmp_path / "state")
    server, endpoint = start_server(procs, state, "--max-steps", "1500", "--checkpoint-every", "100",
                                    "--max-journal-bytes", str(64 << 10))
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1")
    assert wait_exit(server, timeout=120) == 0
    wait_exit(worker, timeout=20)
    assert not os.path.exists(os.path.join(state, "wal-000001.log")), "the journal's head was removed"
    total = sum(os.path.getsize(os.path.join(state, n)) for n in os.listdir(state) if n.startswith("wal-"))
    assert total <= 64 << 10
    r = latecomer("replay", state, timeout=120)
    assert r.returncode == 0 and "replaying from ckpt-" in r.stdout, r.stdout + r.stderr
    assert "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout
