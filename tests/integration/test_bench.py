"""`latecomer bench --quick`: every backend's row holds finite positive figures, or says why it was skipped."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.bench import BACKENDS, BF16

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIGURES = ("updates_per_s", "bytes_per_update", "cpu_s_per_update", "rtt_p50_s", "rtt_p99_s", "peak_rss_bytes")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_quick(tmp_path):
    out, js = tmp_path / "RESULTS.md", tmp_path / "rows.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--quick", "--out", str(out), "--json", str(js)],
                       cwd=REPO, capture_output=True, text=True, timeout=840)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = json.loads(js.read_text())["rows"]
    cells = {(r["backend"], r["d"], r["workers"]) for r in rows}
    assert cells == {(b, d, 1) for b in (*BACKENDS, BF16) for d in (1000, 100_000)}
    for r in rows:
        if r["skipped"]:  # only the bf16 row (flag not there yet) and ray where it is not installed may be skipped
            assert r["backend"] == BF16 or (r["backend"] == "ray" and "not installed" in r["skipped"]), r
            continue
        for k in FIGURES:
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
        assert r["rtt_p99_s"] >= r["rtt_p50_s"]
        assert r["bytes_per_update"] >= 8 * r["d"]  # x one way, g the other
    md = out.read_text()
    assert "| latecomer | 1,000 | 1 |" in md and "Machine:" in md and "n/a" in md
