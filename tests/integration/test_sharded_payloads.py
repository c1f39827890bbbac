"""``serve --shards 2 --log-payloads`` (issue 28): a sharded run of workers whose gradients the
problem's code cannot reproduce replays bit for bit from its shards' blocks journals, and the same
run without payloads does not, with a line that says why.

The deviant worker is the reference worker with its gradients shifted (a wrapper that replaces
``worker.runner.compute_grads`` in that process only): what a GPU, another language or another
sampler does to the figures, as far as replay is concerned.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ps.journal.segments import read_journal
from ps.ops.children import reap
from tests.integration.util import gradient_wrapper, wait_exit, wait_line

pytestmark = pytest.mark.slow

STEPS = 60

DEVIANT = gradient_wrapper("g + np.float32(0.001) * (np.arange(g.size) % 3).astype(np.float32)")


def spawn(argv: list[str], log: str) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - the child's stdout for its life
    return subprocess.Popen(argv, stdout=out if "work" in argv else subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def deviant_run(state: str, *extra: str) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "ps", "serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem",
         "synthetic", "--problem-opt", "d=30000", "--problem-opt", "blocks=3", "--algorithm", "ordered-momentum",
         "--set", "clip_norm=0.001", "--max-steps", str(STEPS), "--eval-every", "0", "--shards", "2",
         "--log-level", "info", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    procs = [server]
    try:
        endpoint = wait_line(server, r"listening on (\S+)", 60).group(1)
        procs.append(spawn([sys.executable, "-c", DEVIANT, "work", "--server", endpoint, "--credit", "2",
                            "--give-up", "60"], f"{state}-w.log"))
        assert wait_exit(server, 120) == 0
    finally:
        reap(procs, grace_s=10)


def replay(state: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ps", "replay", state], capture_output=True, text=True, timeout=300)


def test_a_sharded_run_that_logs_payloads_replays_a_deviant_workers_run_bit_for_bit(tmp_path):
    state = str(tmp_path / "logged")
    deviant_run(state, "--log-payloads")
    for i in (0, 1):  # every block a worker sent is kept (none pruned at the shards' checkpoints)
        blocks = [r for r in read_journal(os.path.join(state, f"shard-{i}", "blocks")) if r.op == "block"]
        assert len(blocks) >= STEPS, (i, len(blocks))
    r = replay(state)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout


def test_without_payloads_the_same_deviant_run_does_not_replay_and_says_why(tmp_path):
    """The control: the shifted gradients are visible to replay (it recomputes them), so the test
    above observes the blocks being used."""
    state = str(tmp_path / "plain")
    deviant_run(state)
    r = replay(state)
    assert r.returncode != 0, r.stdout
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "replay differs" in err[0] and "--log-payloads" in err[0], r.stderr
