"""`latecomer bench --repeat N`: the interleaved order, the median rows, the paired ratios and the
report, with the cells faked (no processes; speed is never checked)."""

from __future__ import annotations

import json

from click.testing import CliRunner

import benchmarks.bench as bench
from benchmarks.common import Row
from ps.cli.main import main


def _row(b, d, w, ups, rep, cpu=1e-4):
    return Row(b, d, w, updates_per_s=ups, cpu_s_per_update=cpu, bytes_per_update=8e3, rep=rep, windows=[ups])


def test_interleaved_runs_each_cells_backends_back_to_back_and_repeats_the_round():
    the_plan = bench.plan(["raw-zmq", "latecomer", "ray", "simulator"], [1000, 100000], [1, 2], quick=False)
    order = bench.interleaved(the_plan, 2)
    assert order[:4] == [(1, "raw-zmq", 1000, 1), (1, "latecomer", 1000, 1),
                         (1, "raw-zmq", 1000, 2), (1, "latecomer", 1000, 2)]
    assert len(order) == 2 * 2 * 4 and {k for k, *_ in order} == {1, 2}
    assert order[8:] == [(2, b, d, w) for _, b, d, w in order[:8]]  # the same round again
    assert not {b for _, b, _, _ in order} & {"ray", "simulator"}  # those run once, after


def test_interleaved_keeps_a_backend_out_of_cells_it_does_not_run():
    the_plan = [("raw-zmq", [(1000, 1), (1000, 4)]), ("latecomer-curve", [(1000, 1)])]
    assert bench.interleaved(the_plan, 1) == [(1, "raw-zmq", 1000, 1), (1, "latecomer-curve", 1000, 1),
                                              (1, "raw-zmq", 1000, 4)]


def test_median_rows_take_the_middle_repetition_and_skip_failed_ones():
    rows = [_row("latecomer", 1000, 1, v, k) for k, v in enumerate((300.0, 100.0, 200.0), 1)]
    rows.append(Row("latecomer", 1000, 1, skipped="boom", rep=4))
    (m,) = bench.median_rows(rows)
    assert m.updates_per_s == 200.0 and m.rep == 3
    even = bench.median_rows([_row("raw-zmq", 1000, 1, v, k) for k, v in enumerate((4.0, 1.0, 3.0, 2.0), 1)])
    assert even[0].updates_per_s == 2.0  # the lower middle one


def test_paired_table_divides_within_each_repetition():
    rows = []
    for k, (raw, lc) in enumerate(((1000.0, 800.0), (2000.0, 1000.0), (500.0, 450.0)), 1):
        rows += [_row("raw-zmq", 1000, 1, raw, k), _row("latecomer", 1000, 1, lc, k, cpu=2e-4)]
    text = "\n".join(bench.paired_table(rows))
    assert "| 1,000 | 1 | latecomer / raw-zmq | 0.80 0.50 0.90 | 0.80 | 0.200 0.200 0.200 |" in text
    # the ratio of the medians (800 / 1000) agrees here; a drift makes them differ, which is the point
    assert bench.paired_table([_row("raw-zmq", 1000, 1, 1.0, 0)]) == []  # not repeated: no table


def test_bench_repeat_end_to_end_with_the_cells_faked(tmp_path, monkeypatch):
    calls = []
    speed = iter([1000, 700, 2000, 1500, 1000, 600])  # raw, latecomer; three rounds

    def fake(backend, d, w, seconds, warmup, credit=1):
        calls.append((backend, d, w))
        return Row(backend, d, w, updates_per_s=float(next(speed)), cpu_s_per_update=1e-4, windows=[1.0])

    monkeypatch.setattr(bench, "run_cell", fake)
    monkeypatch.setattr("benchmarks.reference.vector_passes", lambda ds: {d: 1e-6 for d in ds})
    monkeypatch.setattr("benchmarks.reference.ceiling_s", lambda d: 1e-5)
    out = tmp_path / "r.md"
    res = CliRunner().invoke(main, ["bench", "--sizes", "1000", "--workers", "1", "--backends", "raw-zmq,latecomer",
                                    "--repeat", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert calls == [("raw-zmq", 1000, 1), ("latecomer", 1000, 1)] * 3
    md = out.read_text()
    assert "| 1,000 | 1 | latecomer / raw-zmq | 0.70 0.75 0.60 | 0.70 |" in md
    assert "| 1,000 | 1 | 0.70 |" in md  # the ratio table compares the median rows: 700 / 1000
    assert "repetition 2." in md and "--repeat 3: each cell's backends back to back" in md
    targets = md[md.index("## The targets"):]  # the report ends with the targets, from every repetition
    assert "| plaintext TCP / raw pyzmq >= 0.8 (issues 16, 32) | 1,000 | 1 | 0.70 0.75 0.60 | 0.70 | **not met** |" \
        in targets
    assert "| server CPU per update <= 0.2 ms (issue 32) | 1,000 | 1 | 0.100 0.100 0.100 | 0.100 | met |" in targets
    assert "**1 of 2 cells meet their target.**" in targets and "## The targets" in res.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["repeat"] == 3 and [r["rep"] for r in data["rows"]] == [1, 1, 2, 2, 3, 3]


def test_bench_repeat_out_of_range_is_a_usage_error():
    res = CliRunner().invoke(main, ["bench", "--repeat", "0"])
    assert res.exit_code == 2 and "--repeat" in res.output
