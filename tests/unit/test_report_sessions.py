"""`latecomer report` covers every server session of a restarted run (issue 14): a server resumed
from its state directory appends to the same events.jsonl, starting with a `resumed` event that
names its boot; the report has a row per session and the totals over all of them."""

from __future__ import annotations

import json

from ps.ops.report import make_report, session_table, split_sessions


def md_table(md: str, header: str) -> list[list[str]]:
    lines = md.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def job(jid, wid, t, *, version=None, how="applied", reason=None):
    out = [{"ev": "issued", "worker_id": wid, "job_id": jid, "t": t}]
    if how == "applied":
        out.append({"ev": "applied", "worker_id": wid, "job_id": jid, "created_at": 0, "age": 0,
                    "version": version, "t": t + 0.1})
    elif how == "lost":
        out.append({"ev": "lost", "worker_id": wid, "job_id": jid, "reason": reason, "t": t + 0.1})
    return out


def restarted_run():
    """Session 1 (boot unknown): 3 jobs applied, jobs 3 (w1) and 4 (w2) held at a kill -9.
    Session 2 (boot 0xa1): w1 comes back and its job 3 is applied; w2 never comes back (timed
    out: job 4 lost); then a disk-full pause ends (same boot: no new session) and job 5 is applied.
    Session 3 (boot 0xb2): a hello writes off w1's job 6 (server_restart), job 7 applied."""
    ev = [{"ev": "joined", "worker_id": "w1", "device": "cpu", "t": 0.0},
          {"ev": "joined", "worker_id": "w2", "device": "cpu", "t": 0.0}]
    ev += job(0, "w1", 0.1, version=1) + job(1, "w2", 0.2, version=2) + job(2, "w1", 0.3, version=3)
    ev += [{"ev": "issued", "worker_id": "w1", "job_id": 3, "t": 0.5},
           {"ev": "issued", "worker_id": "w2", "job_id": 4, "t": 0.5}]
    ev += [{"ev": "resumed", "boot": 0xA1, "version": 3, "workers": 2, "outstanding": 2, "grace_s": 12.0, "t": 10.0},
           {"ev": "ready", "worker_id": "w1", "credit": 1},
           {"ev": "applied", "worker_id": "w1", "job_id": 3, "created_at": 3, "age": 0, "version": 4, "t": 12.0},
           {"ev": "lost", "worker_id": "w2", "job_id": 4, "reason": "timeout", "t": 22.0},
           {"ev": "left", "worker_id": "w2", "reason": "timeout", "lost": 1, "t": 22.0},
           {"ev": "resumed", "boot": 0xA1, "version": 4, "workers": 1, "outstanding": 0, "grace_s": 12.0, "t": 30.0}]
    ev += job(5, "w1", 31.0, version=5)
    ev += [{"ev": "issued", "worker_id": "w1", "job_id": 6, "t": 32.0},
           {"ev": "resumed", "boot": 0xB2, "version": 5, "workers": 1, "outstanding": 1, "grace_s": 12.0, "t": 50.0},
           {"ev": "lost", "worker_id": "w1", "job_id": 6, "reason": "server_restart", "t": 51.0}]
    ev += job(7, "w1", 51.5, version=6)
    ev += job(8, "w1", 52.0, how="lost", reason="timeout")  # later in the session: not because of the restart
    return ev


def test_sessions_are_cut_at_each_new_boot():
    ev = restarted_run()
    parts = split_sessions(ev)
    assert [len(p) for p in parts] == [10, 9, 6]
    assert [p[0]["ev"] for p in parts] == ["joined", "resumed", "resumed"]
    rows = session_table(ev)
    assert [(r["session"], r["boot"], r["from_step"], r["to_step"]) for r in rows] == \
        [(1, None, 0, 3), (2, 0xA1, 3, 5), (3, 0xB2, 5, 6)]
    assert [(r["issued"], r["applied"], r["lost"], r["lost_at_resume"]) for r in rows] == \
        [(5, 3, 0, 0), (2, 2, 1, 1), (2, 1, 2, 1)]
    assert [(r["restored_workers"], r["restored_outstanding"]) for r in rows] == [(None, None), (2, 2), (1, 1)]
    assert [r["t0"] for r in rows] == [0.0, 10.0, 50.0]


def test_a_run_never_restarted_is_one_session():
    ev = restarted_run()[:10]
    assert len(split_sessions(ev)) == 1
    (row,) = session_table(ev)
    assert (row["from_step"], row["to_step"], row["applied"], row["lost_at_resume"]) == (0, 3, 3, 0)


def test_the_report_has_a_row_per_session_and_the_totals(tmp_path):
    ev = restarted_run()
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (tmp_path / "summary.json").write_text(json.dumps({
        "stopped": "max_steps", "version": 6, "elapsed_s": 3.0, "outstanding": 0, "accounted": True,
        "counters": {"issued": 9, "applied": 6, "lost": 3}, "evaluations": [{"t": 0.0, "version": 5.0, "loss": 2.0},
                                                                             {"t": 3.0, "version": 6.0, "loss": 1.0}]}))
    result = make_report(str(tmp_path), str(tmp_path / "report"))
    assert len(result["sessions"]) == 3
    md = (tmp_path / "report" / "report.md").read_text()
    header = next(ln for ln in md.splitlines() if ln.startswith("| session |"))
    col = {name.strip(): j for j, name in enumerate(header.strip("|").split("|"))}
    rows = {r[0]: r for r in md_table(md, "| session |")}
    assert list(rows) == ["1", "2", "3", "all"]
    assert [rows[k][col["boot"]] for k in ("1", "2", "3")] == ["-", "a1", "b2"]
    assert [rows[k][col["steps"]] for k in rows] == ["0 -> 3", "3 -> 5", "5 -> 6", "0 -> 6"]
    assert [rows[k][col["applied"]] for k in rows] == ["3", "2", "1", "6"]
    assert [rows[k][col["lost"]] for k in rows] == ["0", "1", "2", "3"]
    assert [rows[k][col["lost at resume"]] for k in rows] == ["0", "1", "1", "2"]
    assert [rows[k][col["issued"]] for k in rows] == ["5", "2", "2", "9"]
    assert [rows[k][col["start (s)"]] for k in rows] == ["0.0", "10.0", "50.0", "0.0"]
    assert "after 3.0 s (the last of 3 server sessions)" in md
    assert "- loss: 2 -> 1 (the last of 3 server sessions)" in md
