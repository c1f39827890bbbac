"""``latecomer bench --workers-scale``: the server's CPU per message against the number of
connected workers.

Per cell: a real ``latecomer serve`` (``asgd`` on ``synthetic``, d = 1,000, TCP path), N cheap
fake workers (benchmarks/fake_workers.py: one process, raw ZMTP, one TCP connection each) that
said ``hello`` and heartbeat every ``--fake-hb`` seconds, and 2 real ``latecomer work``
processes training. Two kinds of fakes: ``idle`` (hello only: joined, holding no job) and
``hoard`` (hello + ready with credit 1: each holds a job it never answers, so the ledger holds
N jobs). Over a timed interval:

* server CPU per applied update = CPU seconds of the server process / updates applied;
* server CPU per message = CPU seconds / messages the server handled: a reply in and a job out
  per update, the fakes' heartbeats in, the server's heartbeats out to every worker (each
  ``--heartbeat-interval``), the real workers' heartbeats in.

The target (issue 13): CPU per message with 10,000 connected workers within 2x of that with 10.
The heartbeat period and liveness timeout are longer than the defaults so that the fakes'
own traffic (which is proportional to N, and costs what any message costs) stays a modest
share of the messages; the figures say how much it was.

    latecomer bench --workers-scale [--scale-workers 10,1000,10000] [--seconds 4]
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.common import LR, peak_rss, reap_popen, server_cpu, sleep_until
from benchmarks.latecomer_ps import cli_options

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALE_WORKERS = (10, 1000, 10_000)
MODES = ("idle", "hoard")
D = 1000
HEARTBEAT_S, LIVENESS_S, FAKE_HB_S = 5.0, 15.0, 5.0  # the server heartbeats every max(5, 15/3) = 5 s
FILES = 65536  # open files for serve (the front holds two per connection), as deploy/'s systemd unit
SECONDS = 4.0


def _more_files() -> None:
    """In the child, before exec: raise the open-file limit to FILES where allowed (root may
    raise the hard limit; serve raises its soft limit to the hard one itself)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard < FILES:
            resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES))
    except (ValueError, OSError):
        pass  # not permitted: serve runs with what it has, and a cell that runs out says so


def _start(*args: str, stdout=subprocess.DEVNULL, repo: str = REPO) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, *args], cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_more_files if args[:3] == ("-m", "ps", "serve") else None)


def _line(p: subprocess.Popen, timeout: float) -> str:
    r, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline().decode(errors="replace").strip() if r else ""


@functools.lru_cache(maxsize=None)
def serve_options(repo: str = REPO) -> frozenset[str]:
    """The long options of ``latecomer serve`` in the checkout at ``repo``."""
    if repo == REPO:
        return cli_options("serve")
    p = subprocess.run([sys.executable, "-m", "ps", "serve", "--help"], cwd=repo, capture_output=True, text=True,
                       timeout=60)
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", p.stdout))


def _files(pid: int) -> int:
    """The open-file limit of the process ``pid``."""
    try:
        with open(f"/proc/{pid}/limits", encoding="ascii") as f:
            for line in f:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _status(endpoint: str) -> dict:
    from ps.ops.status import fetch_status

    return fetch_status(endpoint, timeout_s=10.0).info


def run_cell(n_fake: int, mode: str, *, seconds: float = 4.0, warmup: float = 1.0, d: int = D,
             heartbeat_s: float = HEARTBEAT_S, liveness_s: float = LIVENESS_S, fake_hb_s: float = FAKE_HB_S,
             repo: str = REPO, start_timeout: float = 180.0, serve_args: tuple[str, ...] = ()) -> dict:
    """One cell; a dict of figures (``skipped`` says why when it could not run)."""
    row = {"fake_workers": n_fake, "mode": mode, "real_workers": 2, "d": d, "seconds": seconds,
           "heartbeat_s": heartbeat_s, "fake_hb_s": fake_hb_s, "serve_args": list(serve_args), "skipped": ""}
    opts = serve_options(repo)
    args = ["-m", "ps", "serve", "--bind", "tcp://127.0.0.1:0", "--problem", "synthetic", "--problem-opt",
            f"d={d}", "--algorithm", "asgd", "--set", f"lr={LR}", "--eval-every", "0", "--log-level", "error",
            "--liveness-timeout", str(liveness_s), "--heartbeat-interval", str(heartbeat_s),
            "--max-time", str(start_timeout + warmup + seconds + 60), *serve_args]
    wargs = ["--log-level", "error"]
    if "--shm" in opts:
        args += ["--shm", "off"]
        wargs += ["--shm", "off"]
    if "--max-workers" in opts:
        args += ["--max-workers", str(n_fake + 16)]
    elif n_fake + 2 > 4096:
        row["skipped"] = "serve has no --max-workers (the core's default cap is 4,096 workers)"
        return row
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="latecomer-scale-"):
        try:
            server = _start(*args, stdout=subprocess.PIPE, repo=repo)
            procs.append(server)
            line = _line(server, 60)
            if "listening on" not in line:
                row["skipped"] = f"daemon did not start: {line[:100]!r}"
                return row
            endpoint = line.split()[-1]
            fakes = _start("-m", "benchmarks.fake_workers", endpoint, str(n_fake), "--hb", str(fake_hb_s),
                           "--credit", "1", *(["--no-ready"] if mode == "idle" else []), stdout=subprocess.PIPE,
                           repo=REPO)
            procs.append(fakes)
            joined = json.loads(_line(fakes, start_timeout) or "{}")
            if joined.get("joined", 0) < n_fake:
                row["skipped"] = f"fakes joined: {joined}"
                return row
            row["join_s"] = joined["join_s"]
            for i in range(2):
                procs.append(_start("-m", "ps", "work", "--server", endpoint, "--worker-id", f"real{i}", *wargs,
                                    repo=repo))
            deadline = time.monotonic() + start_timeout
            while _status(endpoint).get("counter.applied", 0) < 20:
                if time.monotonic() > deadline or server.poll() is not None:
                    row["skipped"] = "the real workers got no update applied"
                    return row
                time.sleep(0.1)  # polling interval of a bounded wait
            sleep_until(time.monotonic() + warmup)
            st0, cpu0, t0 = _status(endpoint), server_cpu(server.pid), time.monotonic()
            row["files"] = _files(server.pid)
            sleep_until(t0 + seconds)
            cpu1, t1, st1 = server_cpu(server.pid), time.monotonic(), _status(endpoint)
            row["peak_rss_mib"] = peak_rss(server.pid) / 2**20
            dt = t1 - t0
            applied = st1["counter.applied"] - st0["counter.applied"]
            workers = st1.get("workers", 0)
            msgs = 2 * applied + dt * (n_fake / fake_hb_s + workers / heartbeat_s + 2 / heartbeat_s)
            cpu = cpu1 - cpu0
            row.update(workers=workers, outstanding=st1.get("outstanding"), updates_per_s=applied / dt,
                       cpu_ms_per_update=cpu / applied * 1e3 if applied else math.nan,
                       cpu_us_per_message=cpu / msgs * 1e6 if msgs else math.nan, messages_per_s=msgs / dt,
                       background_share=dt * (n_fake / fake_hb_s + workers / heartbeat_s) / msgs if msgs else math.nan,
                       server_cpu_share=cpu / dt,
                       hb_repeats_per_s=(st1.get("conn.hb_repeats", 0) - st0.get("conn.hb_repeats", 0)) / dt)
            fakes.send_signal(signal.SIGTERM)
            row["fake_stats"] = json.loads(_line(fakes, 30) or "{}")
            return row
        except Exception as e:  # noqa: BLE001 - a failed cell says why
            row["skipped"] = f"{type(e).__name__}: {e}"[:200]
            return row
        finally:
            reap_popen(procs[1:], grace=5)
            reap_popen(procs[:1], grace=5)


def markdown(rows: list[dict], desc: str, elapsed: float) -> str:
    base = {r["mode"]: r for r in rows if not r["skipped"] and r["fake_workers"] == min(
        x["fake_workers"] for x in rows if x["mode"] == r["mode"] and not x["skipped"])}
    r0 = rows[0] if rows else {}
    lines = [f"# latecomer bench --workers-scale ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {desc}.", "",
             "Server CPU per message against the number of connected workers (issue 13). Per cell: "
             f"`latecomer serve` (asgd on synthetic, d = {r0.get('d', D):,}, TCP, `--heartbeat-interval "
             f"{r0.get('heartbeat_s', HEARTBEAT_S):g}`), N fake workers (benchmarks/fake_workers.py: raw ZMTP, one "
             f"connection each, a heartbeat every {r0.get('fake_hb_s', FAKE_HB_S):g} s) and 2 real `latecomer work` "
             "processes training; *idle* fakes said hello only (joined, no job), *hoard* fakes said ready with "
             "credit 1 and never answer (one job each in the ledger). CPU per message = server CPU / (a reply in "
             "and a job out per update + heartbeats in and out); *background* = the share of those messages that "
             "are heartbeats. Target: CPU per message at 10,000 workers within 2x of 10. "
             + (f"Extra `serve` arguments: `{' '.join(r0['serve_args'])}`. " if r0.get("serve_args") else "")
             + "Server CPU counts the `serve` process and its children (the daemon behind the front). "
             f"Whole run {elapsed:.0f} s; shared, noisy machine.", "",
             "| fakes | mode | workers | outstanding | updates/s | server CPU ms/update | server CPU us/message "
             "| vs fewest | background | server CPU share | peak RSS MiB | fakes joined in s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["skipped"]:
            lines.append(f"| {r['fake_workers']:,} | {r['mode']} | n/a | | | | | | | | | skipped: {r['skipped']} |")
            continue
        b = base.get(r["mode"])
        ratio = r["cpu_us_per_message"] / b["cpu_us_per_message"] if b else math.nan
        lines.append(f"| {r['fake_workers']:,} | {r['mode']} | {r['workers']:,} | {r['outstanding']:,} | "
                     f"{r['updates_per_s']:,.0f} | {r['cpu_ms_per_update']:.3f} | {r['cpu_us_per_message']:.1f} | "
                     f"{ratio:.2f} | {r['background_share']:.0%} | {r['server_cpu_share']:.0%} | "
                     f"{r['peak_rss_mib']:.0f} | {r.get('join_s', math.nan):.1f} |")
    return "\n".join(lines) + "\n"


def run(workers: list[int], seconds: float, warmup: float, out: str, json_out: str, desc: str,
        echo=print, repo: str = REPO, serve_args: tuple[str, ...] = ()) -> list[dict]:
    """Every cell (each mode, each count), then the JSON rows and the Markdown table."""
    rows = []
    t = time.monotonic()
    for mode in MODES:
        for n in workers:
            r = run_cell(n, mode, seconds=seconds, warmup=warmup, repo=repo, serve_args=serve_args)
            echo(f"workers-scale {n:>6,} {mode:5s}: " + (f"skipped ({r['skipped']})" if r["skipped"] else
                 f"{r['updates_per_s']:8.0f} upd/s  cpu {r['cpu_ms_per_update']:.3f} ms/upd  "
                 f"{r['cpu_us_per_message']:.1f} us/msg  rss {r['peak_rss_mib']:.0f} MiB"))
            rows.append(r)
    elapsed = time.monotonic() - t
    with open(json_out, "w", encoding="utf-8") as f:
        json.dump({"machine": desc, "elapsed_s": elapsed, "rows": rows}, f, indent=1)
    with open(out, "w", encoding="utf-8") as f:
        f.write(markdown(rows, desc, elapsed))
    return rows
