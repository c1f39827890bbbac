"""``latecomer serve --state DIR`` on a damaged journal, with real processes (issue 14): a record
damaged mid-segment stops it with one line naming the file, the byte offset and the LSN; ``serve
--repair`` keeps the records before the damage, moves the rest into DIR/damaged-<time>/ (nothing
deleted), says what it dropped and resumes; the repaired directory then serves and replays."""

from __future__ import annotations

import os
import re

import pytest

from ps.journal.records import REC_HEADER
from tests.integration.test_state_dir import latecomer, one_line_error, start_server
from tests.integration.util import wait_exit

pytestmark = pytest.mark.slow


def serve_again(state: str, *extra: str):
    return latecomer("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--problem", "quadratic", "--algorithm",
                     "asgd", "--set", "lr=0.1", "--max-time", "0.5", *extra)


def test_a_damaged_journal_refuses_to_serve_and_repair_keeps_its_valid_prefix(procs, tmp_path):
    state = str(tmp_path / "state")
    server, endpoint = start_server(procs, state, "--max-steps", "60", "--checkpoint-every", "20")
    worker = procs.start("work", "--server", endpoint, "--worker-id", "w1")
    assert wait_exit(server, timeout=90) == 0
    wait_exit(worker, timeout=20)
    wal = os.path.join(state, "wal-000001.log")
    data = open(wal, "rb").read()
    offsets, off = [], 0
    while off < len(data):
        offsets.append(off)
        off += REC_HEADER.size + REC_HEADER.unpack_from(data, off)[0]
    bad = len(offsets) // 2  # the LSN of this record: the journal's first segment starts at LSN 0
    raw = bytearray(data)
    raw[offsets[bad] + REC_HEADER.size + 2] ^= 0xFF
    open(wal, "wb").write(bytes(raw))

    line = one_line_error(serve_again(state))
    assert f"wal-000001.log: record at byte {offsets[bad]} fails its checksum" in line and f"(LSN {bad})" in line, line
    assert "--repair" in line
    assert "fails its checksum" in one_line_error(latecomer("replay", state))

    r = serve_again(state, "--repair")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    m = re.search(r"repaired .*kept the journal up to LSN (\d+); dropped LSN (\d+)\.\.(\d+) \((\d+) records", r.stderr)
    assert m, r.stderr
    assert int(m.group(1)) == bad - 1 and int(m.group(2)) == bad and int(m.group(4)) == len(offsets) - bad - 1
    [moved] = [n for n in os.listdir(state) if n.startswith("damaged-")]
    assert open(os.path.join(state, moved, "wal-000001.log"), "rb").read() == bytes(raw), "the original, whole"
    assert open(wal, "rb").read() == data[:offsets[bad]], "the prefix kept"
    # repaired: it resumes (the run goes on from the prefix), and its journal replays
    r = serve_again(state)
    assert r.returncode == 0 and "resumed" in r.stderr, r.stderr
    r = latecomer("replay", state, timeout=120)
    assert r.returncode == 0 and "bit-identical to the recorded final iterate: yes" in r.stdout, r.stdout + r.stderr
