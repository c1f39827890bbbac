"""`latecomer report` reads a state directory it cannot trust to be intact (issue 13, 11): damaged
event lines are skipped (counted, and the lines after them still read), a damaged summary.json
is left out with a warning; the report is written either way, never a traceback."""

from __future__ import annotations

import json
import logging

from ps.ops.report import make_report, read_events


def good_events():
    return [{"ev": "joined", "worker_id": "w1", "device": "cpu", "t": 0.0},
            {"ev": "issued", "worker_id": "w1", "job_id": 0, "t": 0.1},
            {"ev": "applied", "worker_id": "w1", "job_id": 0, "created_at": 0, "age": 0, "t": 0.2},
            {"ev": "issued", "worker_id": "w1", "job_id": 1, "t": 0.3},
            {"ev": "applied", "worker_id": "w1", "job_id": 1, "created_at": 1, "age": 2, "t": 0.4}]


def test_damaged_event_lines_are_skipped_and_the_rest_read(tmp_path, caplog):
    ev = good_events()
    lines = [json.dumps(ev[0]), "{not json", json.dumps([1, 2]), json.dumps({"ev": "applied", "age": "x"}),
             json.dumps({"ev": "applied", "worker_id": "w1", "job_id": 9}),  # no age
             json.dumps({"ev": "issued", "worker_id": "w1", "job_id": 5, "t": "soon"}),
             *map(json.dumps, ev[1:]), '{"ev": "appl']  # a torn last line
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="latecomer.report"):
        got = read_events(str(path))
    assert got == ev, "every good line, those after the damage too"
    assert "5 damaged lines skipped" in caplog.text


def test_a_report_of_a_damaged_state_directory_is_still_written(tmp_path, caplog):
    (tmp_path / "events.jsonl").write_text("\n".join(map(json.dumps, good_events())) + "\nxx\n")
    (tmp_path / "summary.json").write_text(json.dumps({"counters": "lots", "evaluations": [{"t": "a"}]}))
    with caplog.at_level(logging.WARNING, logger="latecomer.report"):
        result = make_report(str(tmp_path), str(tmp_path / "report"))
    assert result["events"] == 5 and result["workers"]["w1"]["applied"] == 2
    assert "summary.json is not a run summary" in caplog.text
    (tmp_path / "summary.json").write_text("{")
    make_report(str(tmp_path), str(tmp_path / "report"))
    assert "cannot be read" in caplog.text
