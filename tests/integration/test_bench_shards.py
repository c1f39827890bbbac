"""benchmarks/shards.py end to end, small: the unsharded server and S = 1, 2 shards, each in
namespaces whose server-side links are rate-limited (benchmarks/netns.py ``Hosts`` with a rate
per host), the workers' host unshaped.

What is checked is what the driver claims to measure, not speed: the table and the JSON come out
with their fields; every run applied updates in its window (so every shard was started and
served, as a reply counts only once every shard has its block); the shaping was where it should
be (tbf on every server-side link, none on the workers'); the bytes each data link carried per
update are its share of the transfers (an iterate slice down, a gradient slice up: 2 x 4 d / S,
within a loose factor, as cached iterates carry nothing and headers add a little); the shards'
links carried equal shares; the coordinator's link carried headers only; the workers' link
carried the sum of the shards'.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from benchmarks.netns import why_unusable
from tests.integration.test_netns import REPO, netns_unusable

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.bench]

D = 200_000  # 800 KB float32 vectors: 4 blocks of 200 KB
RATE = "100mbit"  # ~65 ms per whole vector each way on a data link


@pytest.fixture(autouse=True)
def _needs_netns():
    why = netns_unusable() or why_unusable()
    if why:
        pytest.skip(why)


def test_bench_shards_end_to_end(tmp_path):
    out = tmp_path / "shards.md"
    png = tmp_path / "shards.png"
    cmd = [sys.executable, "-m", "benchmarks.shards", "--d", str(D), "--rate", RATE, "--shards", "1,2",
           "--workers", "2", "--credit", "2", "--seconds", "4", "--warmup", "2", "--start-timeout", "120",
           "--quiet-wait", "0", "--tag", "t", "--out", str(out), "--plot", str(png)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    run = data["runs"]["t"]
    assert run["meta"]["d"] == D and run["meta"]["rate"] == RATE and run["meta"]["algorithm"] == "asgd"
    assert run["meta"]["workers"] == 2 and run["meta"]["credit"] == 2
    rows = {row["config"]: row for row in run["rows"]}
    assert sorted(rows) == ["S=1", "S=2", "unsharded"], list(rows)

    for name, row in rows.items():
        assert not row["error"], (name, row["error"], row.get("log_tails"))
        assert row["updates_in_window"] >= 2 and row["updates_per_s"] > 0, (name, row["updates_in_window"])
        assert row["summary"]["version"] >= row["updates_in_window"], name  # the server's own count agrees
        links, s = row["links"], row["shards"]
        data_hosts = ["server"] if s == 0 else [f"shard{i}" for i in range(s)]
        server_side = data_hosts if s == 0 else ["coord", *data_hosts]
        assert all(row["tbf"][h] for h in server_side) and not row["tbf"]["workers"], (name, row["tbf"])
        expected = 2 * 4 * D / max(1, s)
        assert row["expected_bytes_per_update_per_data_link"] == expected
        per = [links[h]["bytes_per_update"] for h in data_hosts]
        for h, b in zip(data_hosts, per, strict=True):
            assert 0.6 * expected <= b <= 1.5 * expected, (name, h, b, expected)
            assert links[h]["tx_util"] <= 1.1 and links[h]["rx_util"] <= 1.1, (name, h, links[h])  # the cap holds
        if s == 2:
            assert max(per) <= 1.25 * min(per), (name, per)  # equal blocks, equal shares
        if s:
            # the coordinator's socket carries headers only: far below one shard's share
            assert links["coord"]["bytes_per_update"] < 0.05 * expected, (name, links["coord"])
            assert [sh["range"] for sh in row["summary"]["shards"]] == \
                [[i * D // s, (i + 1) * D // s] for i in range(s)], row["summary"]["shards"]
            assert all(row["mem"][f"shard{i}"]["hwm_bytes"] > 0 for i in range(s))
        # everything the data links carried went through the workers' link
        total = sum(links[h]["rx_bytes"] + links[h]["tx_bytes"] for h in server_side)
        w = links["workers"]["rx_bytes"] + links["workers"]["tx_bytes"]
        assert 0.9 * total <= w <= 1.1 * total, (name, total, w)
        assert row["mem"]["server"]["hwm_bytes"] > 0
        assert not math.isnan(row["box_busy"])
    assert rows["S=1"]["speedup_vs_s1"] == pytest.approx(1.0)
    assert rows["unsharded"]["speedup_vs_unsharded"] == pytest.approx(1.0)
    assert rows["S=2"]["speedup_vs_s1"] == pytest.approx(rows["S=2"]["updates_per_s"] / rows["S=1"]["updates_per_s"])

    md = out.read_text()
    assert "<!-- table:t -->" in md and "<!-- /table:t -->" in md
    for row in ("| unsharded |", "| S=1 |", "| S=2 |", "Targets (issue 17)"):
        assert row in md, md
    assert png.stat().st_size > 1000
