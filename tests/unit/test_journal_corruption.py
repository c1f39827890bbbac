"""A journal that fails loudly (issue 14): a bad record anywhere but at the torn tail of the
last segment, or an LSN gap (between segments, or between a checkpoint and the journal after
it), stops recovery with one line naming the file, the byte offset and the LSN; ``repair_journal``
(``serve --repair``) keeps the valid prefix, moves the rest aside without deleting anything, and
says what it dropped."""

from __future__ import annotations

import os
import zlib

import msgpack
import numpy as np
import pytest

from ps.journal.checkpoints import write_checkpoint
from ps.journal.records import REC_HEADER
from ps.journal.recovery import recover
from ps.journal.repair import repair_journal
from ps.journal.segments import JournalDamaged, cut_torn_tail, read_journal
from ps.journal.statedir import StateError
from ps.journal.wal import Journal


def rec(lsn: int, op: str = "tick", **body) -> bytes:
    data = msgpack.packb({"lsn": lsn, "op": op, **({"now": float(lsn)} if op == "tick" else {}), **body},
                         use_bin_type=True)
    return REC_HEADER.pack(len(data), zlib.crc32(data)) + data


def segments(d: str, *spans: range, pad: int = 0) -> list[tuple[str, bytes, list[int]]]:
    """Segments wal-000001.log... holding tick records with the LSNs of each span: (path, bytes,
    record offsets)."""
    out = []
    for i, span in enumerate(spans, start=1):
        data, offs = b"", []
        for lsn in span:
            offs.append(len(data))
            data += rec(lsn, pad="x" * pad)
        path = os.path.join(d, f"wal-{i:06d}.log")
        with open(path, "wb") as f:
            f.write(data)
        out.append((path, data, offs))
    return out


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def flip(data: bytes, at: int) -> bytes:
    raw = bytearray(data)
    raw[at] ^= 0xFF
    return bytes(raw)


def damage_of(d: str) -> JournalDamaged:
    with pytest.raises(JournalDamaged) as info:
        list(read_journal(d))
    text = str(info.value)
    assert "\n" not in text and "--repair" in text
    return info.value


def files_bytes(d: str) -> dict[str, bytes]:
    """Every file under d (recursively) by its name -> bytes: what a repair must keep somewhere."""
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), d)] = f.read()
    return out


def _factory():
    import algorithms
    from ps.core.config import CoreConfig
    from ps.core.server_core import ServerCore

    alg = algorithms.build("asgd", {"lr": 0.1})
    cfg = CoreConfig()
    return (lambda now=0.0: ServerCore(alg, np.zeros(4, np.float32), cfg, now=now)), \
        (lambda snap: ServerCore.restore(alg, snap, cfg))


def _recover(d: str, **kw):
    factory, restore = _factory()
    return recover(factory, restore, d, None, wire_dtype="f32", **kw)


# --------------------------------------------------------------------------- loud: file, offset, LSN

def test_a_checksum_failure_mid_segment_names_file_offset_and_lsn(tmp_path):
    d = str(tmp_path)
    [(path, data, offs)] = segments(d, range(5))
    write(path, flip(data, offs[2] + 12))  # record 2 of 5
    e = damage_of(d)
    assert (e.path, e.offset, e.lsn, e.prev) == (path, offs[2], 2, 1)
    assert f"wal-000001.log: record at byte {offs[2]} fails its checksum" in str(e) and "(LSN 2)" in str(e)
    with pytest.raises(JournalDamaged, match=r"\(LSN 2\)"):
        _recover(d)
    assert cut_torn_tail(d) is None and open(path, "rb").read() == flip(data, offs[2] + 12), "nothing cut off"


def test_a_bad_record_in_a_segment_before_the_last_is_damage(tmp_path):
    d = str(tmp_path)
    (p1, d1, o1), (p2, _, _) = segments(d, range(4), range(4, 8))
    write(p1, flip(d1, o1[1] + 12))  # mid-segment
    e = damage_of(d)
    assert (e.path, e.offset, e.lsn) == (p1, o1[1], 1)
    write(p1, flip(d1, o1[3] + 12))  # the last record of a segment the journal goes on after
    e = damage_of(d)
    assert (e.path, e.offset, e.lsn) == (p1, o1[3], 3) and "goes on in wal-000002.log" in str(e)


def test_a_cut_segment_before_the_last_is_damage(tmp_path):
    d = str(tmp_path)
    (p1, d1, o1), (p2, _, o2) = segments(d, range(4), range(4, 8))
    write(p1, d1[:o1[3] + 5])  # cut inside record 3, and the journal goes on in wal-2
    e = damage_of(d)
    assert (e.path, e.offset, e.lsn) == (p1, o1[3], 3) and "cut short" in str(e)
    write(p1, d1[:o1[3]])  # cut at a record's boundary: LSN 3 is missing
    e = damage_of(d)
    assert (e.path, e.offset, e.lsn, e.prev) == (p2, 0, 3, 2) and "has LSN 4 after LSN 2" in str(e)


def test_a_missing_segment_is_an_lsn_gap(tmp_path):
    d = str(tmp_path)
    _, (p2, _, _), (p3, _, _) = segments(d, range(3), range(3, 6), range(6, 9))
    os.remove(p2)
    e = damage_of(d)
    assert (e.path, e.offset, e.lsn) == (p3, 0, 3) and "has LSN 6 after LSN 2" in str(e)
    with pytest.raises(JournalDamaged, match="wal-000003.log: record at byte 0 has LSN 6 after LSN 2"):
        _recover(d)


def test_a_garbled_length_mid_segment_is_damage_not_a_torn_tail(tmp_path):
    """A length field that runs past the end looks like a record cut short; the records that read
    after it say it is not."""
    d = str(tmp_path)
    [(path, data, offs)] = segments(d, range(5), pad=40)
    raw = bytearray(data)
    raw[offs[2] + 3] = 0x7F  # record 2's length: ~2 GB
    write(path, bytes(raw))
    e = damage_of(d)
    assert (e.path, e.offset, e.lsn) == (path, offs[2], 2) and "runs past the end" in str(e)
    assert cut_torn_tail(d) is None and os.path.getsize(path) == len(data), "records 2-4 are not cut off"


def test_a_torn_tail_of_the_last_segment_is_still_only_a_warning(tmp_path, caplog):
    d = str(tmp_path)
    _, (p2, d2, o2) = segments(d, range(3), range(3, 6), pad=40)
    for cut in (1, 10, len(d2) - o2[2] - 3):  # inside the last record's body, header, or just after it
        write(p2, d2[:len(d2) - cut])
        assert [r.lsn for r in read_journal(d)] == [0, 1, 2, 3, 4]
    write(p2, flip(d2, len(d2) - 2))  # the last record garbled in place
    assert [r.lsn for r in read_journal(d)] == [0, 1, 2, 3, 4]
    assert cut_torn_tail(d) == o2[2]


# --------------------------------------------------------------------------- from a checkpoint: contiguity

def _run_with_checkpoint(d: str, n: int = 8, at: int = 4):
    """A journal of n ticks with a checkpoint of the core at LSN ``at`` (its record journaled)."""
    factory, _ = _factory()
    core = factory()
    j = Journal(d, next_lsn=0, fsync="never")
    j.append("start", run={}, now=0.0)
    for lsn in range(1, n):
        if lsn == at:
            j.append("checkpoint", version=core.version)
            write_checkpoint(d, lsn, core.snapshot())
        else:
            j.append("tick", now=float(lsn))
    j.close()
    return j


def test_recovery_checks_the_lsns_from_the_checkpoint_on(tmp_path):
    d = str(tmp_path)
    _run_with_checkpoint(d, n=8, at=4)
    core, last, n = _recover(d)
    assert (last, n) == (7, 3)
    # the journal ends before the checkpoint's own record: the records after it cannot be known
    path = os.path.join(d, "wal-000001.log")
    data = open(path, "rb").read()
    cut = [off for off, _ in _offsets(data)][3]
    write(path, data[:cut])  # LSN 0..2 left, the checkpoint is at 4
    with pytest.raises(StateError, match=r"the journal ends at LSN 2, before ckpt-000000000004.bin \(LSN 4"):
        _recover(d)


def test_recovery_refuses_a_journal_that_starts_past_the_checkpoint(tmp_path):
    d = str(tmp_path)
    segments(d, range(0, 5), range(7, 9))
    write_checkpoint(d, 4, _factory()[0]().snapshot())
    with pytest.raises(JournalDamaged, match="has LSN 7 after LSN 4"):
        _recover(d)
    os.remove(os.path.join(d, "wal-000001.log"))  # the head removed: the journal starts at 7, the checkpoint is at 4
    with pytest.raises(StateError, match=r"records 5\.\.6 are missing"):
        _recover(d)


def _offsets(data: bytes):
    off = 0
    while off < len(data):
        n, _ = REC_HEADER.unpack_from(data, off)
        yield off, n
        off += REC_HEADER.size + n


# --------------------------------------------------------------------------- repair

@pytest.mark.parametrize("kind", ["crc-mid", "crc-earlier-segment", "cut-earlier-segment", "missing-segment",
                                  "garbled-length"])
def test_repair_keeps_the_valid_prefix_and_moves_the_rest_aside(tmp_path, kind):
    d = str(tmp_path)
    (p1, d1, o1), (p2, d2, o2), (p3, d3, o3) = segments(d, range(0, 4), range(4, 8), range(8, 12), pad=30)
    write_checkpoint(d, 1, _factory()[0]().snapshot(), keep=10)
    write_checkpoint(d, 6, _factory()[0]().snapshot(), keep=10)
    if kind == "crc-mid":
        write(p2, flip(d2, o2[1] + 12))
        kept, readable, files = 4, 6, {"wal-000002.log", "wal-000003.log", "ckpt-000000000006.bin"}
    elif kind == "crc-earlier-segment":
        write(p1, flip(d1, o1[2] + 12))
        kept, readable, files = 1, 9, {"wal-000001.log", "wal-000002.log", "wal-000003.log", "ckpt-000000000006.bin"}
    elif kind == "cut-earlier-segment":
        write(p2, d2[:o2[2] + 5])
        kept, readable, files = 5, 4, {"wal-000002.log", "wal-000003.log", "ckpt-000000000006.bin"}  # 7 cut off
    elif kind == "missing-segment":
        os.rename(p2, os.path.join(str(tmp_path.parent), "elsewhere.log"))
        kept, readable, files = 3, 4, {"wal-000003.log", "ckpt-000000000006.bin"}  # 4..7 not on disk
    else:
        raw = bytearray(d3)
        raw[o3[1] + 3] = 0x7F
        write(p3, bytes(raw))
        kept, readable, files = 8, 2, {"wal-000003.log"}
    before = files_bytes(d)
    damage = damage_of(d)
    report = repair_journal(d)
    assert report is not None and report.kept_last == kept
    moved = os.path.relpath(report.moved_to, d)
    assert moved.startswith("damaged-") and {f.split(" ")[0] for f in report.files} == files
    assert report.dropped_lsns == (kept + 1, 11)
    assert report.dropped_records == readable, report.text()
    text = report.text()
    assert "\n" not in text and f"kept the journal up to LSN {kept}" in text and f"LSN {kept + 1}..11" in text
    assert str(damage) in text
    # nothing deleted: every byte that was there is still under d (the cut segment's copy whole)
    after = files_bytes(d)
    for name, data in before.items():
        assert after.get(os.path.join(moved, name)) == data or after.get(name) == data, name
    # the prefix reads, and recovery resumes at its end, from the checkpoint it still has
    assert [r.lsn for r in read_journal(d)] == list(range(kept + 1))
    _, last, n = _recover(d)
    ckpt = 6 if kept >= 6 else 1  # the newest checkpoint kept
    assert last == kept and n == kept - ckpt, f"from ckpt-{ckpt}: LSN {ckpt + 1}.. replayed"
    assert repair_journal(d) is None, "repaired once is enough"


def test_repair_of_a_checkpoint_past_the_journals_end(tmp_path):
    d = str(tmp_path)
    _run_with_checkpoint(d, n=8, at=4)
    path = os.path.join(d, "wal-000001.log")
    data = open(path, "rb").read()
    write(path, data[:[off for off, _ in _offsets(data)][3]])
    report = repair_journal(d)
    assert report.kept_last == 2 and [f.split(" ")[0] for f in report.files] == ["ckpt-000000000004.bin"]
    assert report.dropped_lsns == (3, 4)
    core, last, n = _recover(d)
    assert (last, n) == (2, 3), "from the start: LSN 0..2"


def test_repair_moves_nothing_when_what_it_would_keep_cannot_recover(tmp_path):
    d = str(tmp_path)
    (p1, d1, o1), _ = segments(d, range(10, 14), range(14, 18))  # the journal's head was removed
    write_checkpoint(d, 12, _factory()[0]().snapshot())
    write(p1, flip(d1, o1[1] + 12))  # the damage at LSN 11: the prefix (LSN 10) has no checkpoint
    before = files_bytes(d)
    with pytest.raises(StateError, match="cannot repair"):
        repair_journal(d)
    assert files_bytes(d) == before


def test_recover_with_repair_resumes_and_logs_what_it_dropped(tmp_path, caplog):
    import logging

    d = str(tmp_path)
    (p1, d1, o1), = segments(d, range(6))
    write(p1, flip(d1, o1[3] + 12))
    with caplog.at_level(logging.WARNING, logger="latecomer.persist"):
        _, last, n = _recover(d, repair=True)
    assert (last, n) == (2, 3)
    assert "repaired" in caplog.text and "LSN 3..5" in caplog.text and "damaged-" in caplog.text
