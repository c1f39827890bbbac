"""A sharded server with real processes (issue 17): ``serve --shards 2``, shard processes, 3
workers, digits. What each test observes:

* kill -9 of a shard mid-run: the coordinator holds the issuing of jobs, the shard started again
  resumes from its newest checkpoint at exactly that checkpoint's LSN (the coordinator sends the
  records after it), training finishes at the accuracy of the unsharded run of the same
  settings (the independent expectation), and ``latecomer replay`` of the journal through one
  unsharded core gives the shards' final iterate bit for bit: no accepted reply was lost on the
  shard that died; ``latecomer report`` has the shards' table;
* kill -9 of the coordinator (its supervisor starts it again, its local shards die with it and
  are started again): the same, from the journal, with the wire dtype bf16 per shard.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ps.ops.children import reap
from tests.integration.util import daemon_pid, read_events, wait_events, wait_exit, wait_line

pytestmark = pytest.mark.slow

STEPS = 900
WORKERS = ("w1", "w2", "w3")


def spawn(*args: str, log: str | None = None) -> subprocess.Popen:
    out = open(log, "ab") if log else subprocess.PIPE  # noqa: SIM115 - the child's stdout for its life
    return subprocess.Popen([sys.executable, "-m", "ps", *args], stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def serve_args(state: str, *extra: str) -> list[str]:
    return ["serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "digits", "--algorithm", "asgd",
            "--set", "lr=0.1", "--batch-size", "32", "--max-steps", str(STEPS), "--eval-every", "300",
            "--min-workers", "3", "--log-level", "info", *extra]


def start_workers(endpoint: str, tmp) -> list[subprocess.Popen]:
    return [spawn("work", "--server", endpoint, "--worker-id", w, "--give-up", "60", "--log-level", "info",
                  log=str(tmp / f"{w}.log")) for w in WORKERS]


def applied(events: list[dict]) -> int:
    return sum(e["ev"] == "applied" for e in events)


def finish(server: subprocess.Popen, workers: list, timeout: float = 120) -> dict:
    rc = wait_exit(server, timeout)
    assert rc == 0, rc
    reap(workers, grace_s=10)
    return rc


def summary(state: str) -> dict:
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def replay_identical(state: str) -> None:
    r = subprocess.run([sys.executable, "-m", "ps", "replay", state], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout


def run_to_end(tmp, name: str, *extra: str) -> dict:
    state = str(tmp / name)
    server = spawn(*serve_args(state, *extra))
    procs = [server]
    try:
        endpoint = wait_line(server, r"listening on (\S+)", 60).group(1)
        procs += start_workers(endpoint, tmp)
        finish(server, procs[1:], 180)
    finally:
        reap(procs, grace_s=10)
    return summary(state)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The unsharded run of the same settings: the accuracy a sharded run must reach."""
    s = run_to_end(tmp_path_factory.mktemp("plain"), "plain")
    assert s["version"] == STEPS and s["evaluations"][-1]["accuracy"] > 0.85, s["evaluations"][-1]
    return s


def same_training(sharded: dict, plain: dict, state: str) -> None:
    """Trained as the unsharded server trains, evaluated on the iterate the shards hold at the end,
    and a shard table whose ranges cover the vector."""
    a_plain, a_sharded = plain["evaluations"][-1]["accuracy"], sharded["evaluations"][-1]["accuracy"]
    assert sharded["version"] == STEPS and sharded["evaluations"][-1]["version"] == STEPS
    assert abs(a_sharded - a_plain) <= 0.04, (a_plain, a_sharded)
    shards = sharded["shards"]
    x = np.load(os.path.join(state, "final_x.npy"))
    assert [s["index"] for s in shards] == [0, 1]
    assert shards[0]["range"][0] == 0 and shards[0]["range"][1] == shards[1]["range"][0]
    assert shards[1]["range"][1] == x.size
    assert sharded["counters"]["applied"] == STEPS


def log_waiter(log):
    """``logged(pattern, timeout)``: the first match of ``pattern`` in the log file ``log`` (a
    Path), waited for at most ``timeout`` seconds."""
    def logged(pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, log.read_text(errors="replace"))
            if m:
                return m
            time.sleep(0.05)  # polling interval of a bounded wait
        raise TimeoutError(f"no {pattern!r} in the server's log: {log.read_text()[-2000:]}")
    return logged


def newest_checkpoint_lsn(d: str) -> int:
    lsns = [int(m.group(1)) for f in os.listdir(d) if (m := re.fullmatch(r"ckpt-(\d+)\.bin", f))]
    return max(lsns)


def test_kill9_of_a_shard_mid_run_resumes_at_its_checkpoint_and_loses_nothing(tmp_path, plain):
    """serve --shards 2 (one local shard, one `latecomer shard` started here) with 3 workers trains
    digits to the unsharded accuracy, through a kill -9 of a shard."""
    state, shard_dir = str(tmp_path / "run"), str(tmp_path / "shard1")
    server = spawn(*serve_args(state, "--shards", "2", "--local-shards", "1"), log=str(tmp_path / "serve.log"))
    procs = [server]
    try:
        logged = log_waiter(tmp_path / "serve.log")

        endpoint = logged(r"listening on (\S+)").group(1)
        coordinator = logged(r"shards connect to (\S+)").group(1)
        shard_args = ["shard", "--coordinator", coordinator, "--slot", "1", "--state", shard_dir,
                      "--token-file", os.path.join(state, "shard.token"), "--checkpoint-records", "100",
                      "--log-level", "info"]
        shard = spawn(*shard_args, log=str(tmp_path / "shard1.log"))
        procs.append(shard)
        procs += start_workers(endpoint, tmp_path)
        events = os.path.join(state, "events.jsonl")
        wait_events(events, lambda ev: applied(ev) >= 250, 120)
        os.kill(shard.pid, signal.SIGKILL)
        shard.wait(timeout=10)
        logged(r"holding the issuing of jobs: shard\(s\) 1 not connected")
        ckpt = newest_checkpoint_lsn(shard_dir)
        held_at = applied(read_events(events))
        shard = spawn(*shard_args, log=str(tmp_path / "shard1.log"))
        procs.append(shard)
        m = logged(r"shard 1 joined from \S+ \(after record (\d+)\): records from (\d+)")
        assert (int(m.group(1)), int(m.group(2))) == (ckpt, ckpt + 1)  # exactly its checkpoint's LSN
        assert held_at < STEPS
        finish(server, procs[1:], 180)
        wait_exit(shard, 30)  # the run is over: the coordinator told it to stop
    finally:
        reap(procs, grace_s=10)
    s = summary(state)
    same_training(s, plain, state)
    assert s["shards"][1]["joins"] == 2
    replay_identical(state)
    from ps.ops.report import make_report

    make_report(state, str(tmp_path / "report"))
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Shards" in text and f"| 1 | [{s['shards'][1]['range'][0]}, {s['shards'][1]['range'][1]}) |" in text


def test_kill9_of_the_coordinator_mid_run_recovers_with_its_shards_in_bf16(tmp_path, plain):
    """Also --wire-dtype bf16: each shard sends its slices and takes its blocks in bf16; replay
    (which quantizes the whole iterate and gradient as they travelled) agrees bit for bit, so each
    shard rounded exactly its part."""
    state = str(tmp_path / "run")
    server = spawn(*serve_args(state, "--shards", "2", "--wire-dtype", "bf16"), log=str(tmp_path / "serve.log"))
    procs = [server]
    try:
        log = tmp_path / "serve.log"
        deadline = time.monotonic() + 60
        while not re.search(r"listening on (\S+)", log.read_text(errors="replace")):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)  # polling interval of a bounded wait
        endpoint = re.search(r"listening on (\S+)", log.read_text()).group(1)
        procs += start_workers(endpoint, tmp_path)
        events = os.path.join(state, "events.jsonl")
        wait_events(events, lambda ev: applied(ev) >= 250, 120)
        os.kill(daemon_pid(server), signal.SIGKILL)  # the supervisor starts it again from --state
        wait_events(events, lambda ev: any(e["ev"] == "resumed" for e in ev), 60)
        finish(server, procs[1:], 240)
    finally:
        reap(procs, grace_s=10)
    s = summary(state)
    assert s["version"] >= STEPS and s["counters"]["applied"] == s["version"], s["counters"]
    assert s["counters"]["rejected"] == 0
    assert abs(s["evaluations"][-1]["accuracy"] - plain["evaluations"][-1]["accuracy"]) <= 0.04
    assert "died of SIGKILL" in (tmp_path / "serve.log").read_text()
    replay_identical(state)



def test_slices_larger_than_a_header_reach_the_shards(tmp_path):
    """Blocks of 100,000 float32 (400 KB, past the 64 KB a shard's data socket takes before its core
    is built): the shards take them, the run reaches its steps with every reply applied."""
    state, s = synthetic_to_end(tmp_path / "big", 200000, 2, "asgd", 40)
    assert s["version"] == 40 and s["counters"]["applied"] == 40 and s["blocks_timed_out"] == 0, s["counters"]


def synthetic_to_end(state: os.PathLike, d: int, blocks: int, algorithm: str, steps: int,
                     *settings: str) -> tuple[str, dict]:
    """``serve --shards 2`` of ``synthetic`` (d values in ``blocks`` blocks) with one worker of
    credit 2, to ``steps``: the state directory and its summary."""
    state = str(state)
    server = spawn("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "synthetic",
                   "--problem-opt", f"d={d}", "--problem-opt", f"blocks={blocks}", "--algorithm", algorithm,
                   *[a for kv in settings for a in ("--set", kv)], "--max-steps", str(steps), "--eval-every", "0",
                   "--shards", "2", "--log-level", "info")
    procs = [server]
    try:
        endpoint = wait_line(server, r"listening on (\S+)", 60).group(1)
        procs.append(spawn("work", "--server", endpoint, "--credit", "2", "--give-up", "60",
                           log=f"{state}-w.log"))
        finish(server, procs[1:], 120)
    finally:
        reap(procs, grace_s=10)
    return state, summary(state)


def test_clip_norm_on_two_shards_clips_by_the_whole_gradients_norm_and_replays_bit_for_bit(tmp_path):
    """``clip_norm`` is a norm over every block: each shard says its blocks' squared norms in its
    ``have``, the coordinator journals them with the reply (``bsq``), every shard checks its own
    against the record, and ``latecomer replay`` through one unsharded core, which measures the
    norm on the whole recomputed gradient, gives the shards' final iterate bit for bit. The clip
    acts on every step (grad_norm above clip_norm)."""
    state, s = synthetic_to_end(tmp_path / "clip", 30000, 3, "ordered-momentum", 60, "clip_norm=0.001")
    assert s["version"] == 60 and s["counters"]["applied"] == 60 and s["blocks_timed_out"] == 0, s["counters"]
    from ps.journal.segments import read_journal

    measured = [r.body["reply"]["bsq"] for r in read_journal(state) if r.op == "reply" and "bsq" in r.body["reply"]]
    assert len(measured) >= s["counters"]["applied"] == 60 and all(len(f) == 3 for f in measured)
    assert min(math.sqrt(math.fsum(f)) for f in measured) > 0.001, "the clip acts on every reply"
    replay_identical(state)


def test_adamw_on_two_shards_corrects_by_one_count_and_replays_bit_for_bit(tmp_path):
    """``adamw`` on 2 shards of 3 blocks (the middle one cut between them): each shard keeps its
    slices of m and v and corrects by 1 − β^t with the run's one update count; ``latecomer
    replay`` through one unsharded core gives the shards' final iterate bit for bit."""
    state, s = synthetic_to_end(tmp_path / "adamw", 30001, 3, "adamw", 60, "lr=0.01", "weight_decay=0.1")
    assert s["version"] == 60 and s["counters"]["applied"] == 60 and s["blocks_timed_out"] == 0, s["counters"]
    assert len(s["shards"]) == 2
    replay_identical(state)


def test_lmo_l2_on_two_shards_divides_by_the_whole_momentums_norm_through_a_kill9_of_a_shard(tmp_path):
    """``ringmaster-lmo`` with ``lmo=l2`` steps by u/‖u‖, the norm of the whole momentum: for each
    reply the coordinator asks every shard for its blocks' ‖u_b‖² (``reduce?``) once the records
    before it are applied there, journals the figures with the reply (``ssq``), and every shard
    checks its own against the record. A shard killed with -9 mid-run and started again (from its
    checkpoint: its momentum restored) is asked again and the run goes on; ``latecomer replay``
    through one unsharded core, which measures ‖u‖ on the whole momentum itself, gives the
    shards' final iterate bit for bit."""
    steps = 300
    state, shard_dir, log = str(tmp_path / "l2"), str(tmp_path / "shard1"), tmp_path / "serve.log"
    server = spawn("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "synthetic",
                   "--problem-opt", "d=30000", "--problem-opt", "blocks=3", "--algorithm", "ringmaster-lmo",
                   "--set", "lmo=l2", "--set", "lr=0.01", "--set", "R=4", "--max-steps", str(steps),
                   "--eval-every", "0", "--shards", "2", "--local-shards", "1", "--log-level", "info", log=str(log))
    procs = [server]
    logged = log_waiter(log)

    try:
        endpoint = logged(r"listening on (\S+)").group(1)
        shard_args = ["shard", "--coordinator", logged(r"shards connect to (\S+)").group(1), "--slot", "1",
                      "--state", shard_dir, "--token-file", os.path.join(state, "shard.token"),
                      "--checkpoint-records", "50", "--log-level", "info"]
        shard = spawn(*shard_args, log=str(tmp_path / "shard1.log"))
        procs.append(shard)
        procs += [spawn("work", "--server", endpoint, "--worker-id", w, "--credit", "2", "--give-up", "60",
                        log=str(tmp_path / f"{w}.log")) for w in ("w1", "w2")]
        events = os.path.join(state, "events.jsonl")
        wait_events(events, lambda ev: applied(ev) >= 100, 120)
        os.kill(shard.pid, signal.SIGKILL)
        shard.wait(timeout=10)
        logged(r"holding the issuing of jobs: shard\(s\) 1 not connected")
        assert applied(read_events(events)) < steps
        procs.append(spawn(*shard_args, log=str(tmp_path / "shard1.log")))
        finish(server, procs[1:], 120)
    finally:
        reap(procs, grace_s=10)
    s = summary(state)
    assert s["version"] == steps and s["shards"][1]["joins"] == 2, s["counters"]
    from ps.journal.segments import read_journal

    # every reply that counted has its figures (a reply to a job cancelled meanwhile counts late, without)
    reduced = [r.body["reply"]["ssq"] for r in read_journal(state) if r.op == "reply" and "ssq" in r.body["reply"]]
    assert len(reduced) >= s["counters"]["applied"] >= steps and all(len(f) == 3 and min(f) > 0 for f in reduced)
    replay_identical(state)
