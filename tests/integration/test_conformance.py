"""The conformance kit (``latecomer conformance``, docs/CONFORMANCE.md) against the reference
worker: every case passes; and the worker broken on purpose for one case (conformance_broken.py)
fails exactly that case, with a FAIL line naming it and a non-zero exit."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = f"{sys.executable} -m ps work --server {{endpoint}} --give-up 60"
BROKEN = f"{sys.executable} {HERE / 'conformance_broken.py'} {{name}} work --server {{{{endpoint}}}} --give-up 60"


def kit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ps", "conformance", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_conformance_kit_passes_against_the_reference_worker(tmp_path):
    out = tmp_path / "results.json"
    p = kit("--worker", WORKER, "--json", str(out))
    results = {r["case"]: r for r in json.loads(out.read_text())}
    listed = [line.split()[0] for line in kit("--list").stdout.splitlines()]
    assert list(results) == listed and set(results) == set(CASES), p.stdout
    failed = {name for name, r in results.items() if not r["ok"]}
    assert failed == set(), p.stdout + p.stderr
    assert (p.returncode == 0) == (not failed), p.stdout
    for name in results:
        assert (f"PASS {name} " in p.stdout) == (name not in failed), p.stdout


CASES = ["handshake", "job-grad", "job-pair", "job-full", "iterate-cache", "cancel", "unknown-worker", "new-boot",
         "bad-input", "restart-grad", "restart-pair", "restart-full", "restart-fresh", "parts", "bye",
         "shard-handshake", "shard-fetch", "shard-unknown-job", "shard-refetch", "shard-restart-grad",
         "shard-restart-pair"]


@pytest.mark.parametrize("name", CASES)
def test_conformance_kit_fails_a_worker_broken_for_that_case(name):
    p = kit("--worker", BROKEN.format(name=name), "--case", name, "--timeout", "4")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"FAIL {name} [PROTOCOL.md" in p.stdout, p.stdout + p.stderr
    assert "0 passed, 1 failed" in p.stdout, p.stdout
