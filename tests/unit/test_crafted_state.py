"""Issue 29 point 5: crafted state files against the readers (ps/journal/statefiles.py and the
journal's): each gets a one-line StateError/ValueError naming the file, with bounded work and
no big allocation, never a RecursionError, a tokenize error or a MemoryError.

Work is checked against a control measured in the same test (a good segment of the same size
scanned) or with tracemalloc, not against a fixed number of seconds.
"""

from __future__ import annotations

import os
import time
import tracemalloc

import numpy as np
import pytest

from ps.journal.checkpoints import pack_tree, read_checkpoint, unpack_tree, verified_checkpoints, write_checkpoint
from ps.journal.records import REC_HEADER
from ps.journal.repair import _count_records
from ps.journal.runfile import read_run
from ps.journal.segments import JournalDamaged, read_journal, scan_segment
from ps.journal.statedir import StateError
from ps.journal.statefiles import (
    MAX_JSON_DEPTH,
    MAX_TREE_DEPTH,
    json_depth,
    loads_bounded,
    read_json,
    read_npy,
    read_problem_json,
)
from tests import crafted_state as crafted


def one_line(e: pytest.ExceptionInfo, name: str) -> str:
    text = str(e.value)
    assert "\n" not in text and name in text, text
    return text


def test_a_checkpoint_nested_600_deep_is_refused_and_skipped_for_the_previous_one(tmp_path):
    d = str(tmp_path)
    write_checkpoint(d, 5, {"x": [1, 2]})
    path = crafted.deep_checkpoint(os.path.join(d, "ckpt-000000000009.bin"), 9)
    with pytest.raises(ValueError) as e:
        read_checkpoint(path)
    assert "nested more than" in one_line(e, "ckpt-000000000009.bin")
    assert [lsn for lsn, _, _ in verified_checkpoints(d)] == [5]


def test_tree_depth_bound_leaves_room_for_real_trees():
    tree: list = [7]
    for _ in range(MAX_TREE_DEPTH - 2):
        tree = [tree]
    packed, arrays = pack_tree({"t": tree})
    assert unpack_tree(packed, arrays) == {"t": tree}
    with pytest.raises(ValueError, match="nested more than"):
        unpack_tree({"t": [packed]}, arrays)


def test_json_depth_is_counted_outside_strings_in_linear_time():
    assert json_depth(b'{"a": "[[[{{", "b": [1, {"c": "\\"]]["}]}') == 3
    assert json_depth(b"[]" * 1000) == 1
    assert json_depth(b"[" * 200_000) == 200_000
    with pytest.raises(StateError, match="nested 65 deep"):
        loads_bounded(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "x.json")
    assert json_depth(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) == MAX_JSON_DEPTH
    assert loads_bounded(b'{"a": [[1]]}', "x.json") == {"a": [[1]]}


@pytest.mark.parametrize("name", ["run.json", "problem.json", "summary.json"])
def test_json_nested_200000_deep_is_one_line(tmp_path, name):
    path = crafted.deep_json(str(tmp_path / name))
    with pytest.raises(StateError) as e:
        read_json(path, "a run description")
    assert "nested 200001 deep" in one_line(e, name)  # the map, then the lists


def test_run_json_nested_200000_deep_is_one_line_from_read_run(tmp_path):
    crafted.deep_json(str(tmp_path / "run.json"))
    with pytest.raises(StateError) as e:
        read_run(str(tmp_path))
    one_line(e, "run.json")


def test_oversized_json_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "run.json"
    path.write_bytes(b'{"pad": "' + b"x" * 2000 + b'"}')
    with pytest.raises(StateError) as e:
        read_json(str(path), "a run description", max_bytes=1000)
    assert "more than this file ever holds" in one_line(e, "run.json")


@pytest.mark.parametrize("text, why", [("[]", "not a problem description"), ('{"problem": 3}', "must be a string"),
                                       ('{"problem": "q", "problem_options": []}', "must be a map"),
                                       ("{", "cannot be read")])
def test_problem_json_of_the_wrong_shape_is_one_line(tmp_path, text, why):
    path = tmp_path / "problem.json"
    path.write_text(text)
    with pytest.raises(StateError) as e:
        read_problem_json(str(path))
    assert why in one_line(e, "problem.json")


@pytest.mark.parametrize("kind", sorted(crafted.BAD_NPY))
def test_a_damaged_final_x_is_one_line_without_a_big_allocation(tmp_path, kind):
    path = crafted.BAD_NPY[kind](str(tmp_path / "final_x.npy"))
    tracemalloc.start()
    try:
        with pytest.raises(StateError) as e:
            read_npy(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one_line(e, "final_x.npy")
    assert peak < 1 << 20, f"{kind}: {peak} bytes allocated reading a {os.path.getsize(path)}-byte file"


def test_a_good_final_x_reads_back_exactly(tmp_path):
    for x in (np.arange(5, dtype=np.float32), np.linspace(0, 1, 7), np.zeros(0, np.float16)):
        np.save(tmp_path / "final_x.npy", x)
        y = read_npy(str(tmp_path / "final_x.npy"))
        assert y.dtype == x.dtype and np.array_equal(x, y)


def scan_time(path: str) -> float:
    data = open(path, "rb").read()
    t = time.perf_counter()
    scan_segment(path, data)
    return time.perf_counter() - t


def test_resync_after_an_overlong_record_is_linear(tmp_path):
    """6 MB: one over-long record, then 6,000 candidates each claiming a length to the end of the
    file with a bad checksum. Before: every candidate checksummed whole (about 18 GB, 45 s with
    the commands' repeated scans). Now: damage, not a torn tail (it is not cut off on resume), in
    at most a few times the time a good segment of the same size takes to scan."""
    pad = crafted.SEGMENT_BYTES // crafted.CANDIDATES
    good = crafted.write_bytes(str(tmp_path / "good" / "wal-000001.log"),
                               crafted.tick_records(0, crafted.CANDIDATES, pad))
    control = min(scan_time(good) for _ in range(3))
    state = tmp_path / "state"
    state.mkdir()
    path = crafted.overlong_segment(str(state / "wal-000001.log"), 0)
    t = time.perf_counter()
    with pytest.raises(JournalDamaged) as e:
        list(read_journal(str(state)))
    took = time.perf_counter() - t
    assert "runs past the end of the file" in one_line(e, "wal-000001.log") and e.value.offset == 0
    data = open(path, "rb").read()
    t = time.perf_counter()
    assert _count_records(data, 1, -1) == []  # a repair's count of what it moves aside: linear too
    took_count = time.perf_counter() - t
    print(f"good segment scanned in {control:.3f} s; crafted: read_journal {took:.3f} s, repair count "
          f"{took_count:.3f} s")
    assert took < 3 * control + 0.5 and took_count < 3 * control + 0.5, (control, took, took_count)


def test_resync_still_finds_the_records_after_damage(tmp_path):
    """The linear resync keeps its meaning: an over-long record with good records after it is
    damage (not a torn tail), and a repair counts the records after it."""
    overlong = REC_HEADER.pack(1 << 20, 0) + b"\x83\xa3lsn\x05" + b"\0" * 20
    data = crafted.tick_records(0, 5) + overlong + crafted.tick_records(6, 50)
    records, bad = scan_segment("w", data)
    assert [r["lsn"] for _, r in records] == [0, 1, 2, 3, 4]
    assert not bad.torn and "with records after it" in bad.why
    assert _count_records(data, bad.offset + 1, 4) == list(range(6, 56))
    records, bad = scan_segment("w", crafted.tick_records(0, 5) + overlong)
    assert bad.torn, "nothing reads after it: a torn tail"


def test_an_event_line_nested_200000_deep_is_skipped_and_counted(tmp_path, caplog):
    from ps.ops.report import read_events

    path = crafted.deep_event_line(str(tmp_path / "events.jsonl"))
    assert read_events(path) == [{"ev": "note", "t": 1.0}]
    assert "1 damaged lines skipped" in caplog.text


def test_a_segment_whose_first_header_claims_gigabytes_is_not_read_that_far(tmp_path):
    from ps.journal.segments import first_record

    path = crafted.write_bytes(str(tmp_path / "wal-000001.log"), REC_HEADER.pack((1 << 31) - 1, 0) + b"\0" * 64)
    tracemalloc.start()
    try:
        assert first_record(path) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
