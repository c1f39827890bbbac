"""The same-host path to the shards of a sharded server, with real processes: ``serve --shards 2``
(local shards) and one worker on this host, synthetic d=20,000 in two blocks, asgd, one job at a
time (credit 1, so the run is a function of its seed).

The worker takes every slice but the first per shard from the shard's shared memory and writes
every block there (each shard's log counts the fetches it answered and the blocks it read through
shared memory; the worker logs the handshake), the shards unlink their files when they stop, the
final iterate is bit for bit the one of the same run with the worker on TCP (``--shm off``), and
``latecomer replay`` of the journal through one unsharded core gives it bit for bit, here in bf16
(the slots hold the values as the wire dtype carries them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from protocol.shm import shm_dir_usable
from ps.ops.children import reap
from tests.integration.util import wait_exit, wait_line

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not shm_dir_usable(), reason="no usable /dev/shm")]

STEPS = 40


def spawn(*args: str, log: str | None = None) -> subprocess.Popen:
    out = open(log, "ab") if log else subprocess.PIPE  # noqa: SIM115 - the child's stdout for its life
    return subprocess.Popen([sys.executable, "-m", "ps", *args], stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def run(tmp, name: str, wire: str, shm: str) -> str:
    state = str(tmp / name)
    server = spawn("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "synthetic",
                   "--problem-opt", "d=20000", "--problem-opt", "blocks=2", "--algorithm", "asgd",
                   "--max-steps", str(STEPS), "--eval-every", "0", "--shards", "2", "--wire-dtype", wire,
                   "--log-level", "info")
    procs = [server]
    try:
        endpoint = wait_line(server, r"listening on (\S+)", 60).group(1)
        procs.append(spawn("work", "--server", endpoint, "--worker-id", "w1", "--credit", "1", "--shm", shm,
                           "--give-up", "30", "--log-level", "info", log=str(tmp / f"{name}-w.log")))
        assert wait_exit(server, 60) == 0
    finally:
        reap(procs, grace_s=10)
    return state


def shard_logs(state: str) -> list[str]:
    return [open(os.path.join(state, f"shard-{i}", "shard.log"), encoding="utf-8").read() for i in range(2)]


# bf16 (f32: tests/unit/test_shard_shm.py, and test_sharded_serve.py, whose workers are on the shards' host)
@pytest.mark.parametrize("wire", ["bf16"])
def test_a_worker_on_the_shards_host_uses_their_shared_memory_bit_for_bit(tmp_path, wire):
    shm = run(tmp_path, "shm", wire, "auto")
    tcp = run(tmp_path, "tcp", wire, "off")

    for text in shard_logs(shm):
        prefix = re.search(r"slices and blocks through shared memory (latecomer-\S+)", text).group(1)
        fetches, blocks = map(int, re.search(r"(\d+) fetches answered through shared memory, (\d+) blocks read",
                                             text).groups())
        assert fetches >= STEPS - 1 and blocks >= STEPS - 1, (fetches, blocks)  # all but the first job's
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-")]  # unlinked when it stopped
    assert (tmp_path / "shm-w.log").read_text().count("same-host path through shared memory") == 2
    for text in shard_logs(tcp):
        assert "shared memory" not in text

    x_shm, x_tcp = np.load(os.path.join(shm, "final_x.npy")), np.load(os.path.join(tcp, "final_x.npy"))
    assert x_shm.tobytes() == x_tcp.tobytes()
    r = subprocess.run([sys.executable, "-m", "ps", "replay", shm], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout + r.stderr
