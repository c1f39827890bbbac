"""Persistence pieces: exact trees, atomic checkpoints with fallback, a journal with a torn tail."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from ps.persist import (
    Journal,
    latest_checkpoint,
    pack_tree,
    read_checkpoint,
    read_journal,
    unpack_tree,
    write_checkpoint,
)


def tricky():
    rng = np.random.default_rng(3)
    return {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "t": (1, 2.5, "x"), "s": {3, 1},
            "ints": {5: "five", -1: [np.float64(0.1), np.int64(7)]}, "big": 1 << 100, "none": None,
            "rng": rng.bit_generator.state, "nested": [[np.zeros(0, np.int8)], {"__odd": True}], "b": b"\x00\x01"}


def same(x, y):
    if isinstance(x, np.ndarray) or isinstance(x, np.generic):
        return type(x) is type(y) and x.dtype == y.dtype and np.array_equal(x, y)
    if isinstance(x, dict):
        return type(y) is dict and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))
    return type(x) is type(y) and x == y


def test_pack_tree_round_trip_is_exact():
    tree, arrays = pack_tree(tricky())
    assert same(unpack_tree(tree, arrays), tricky())
    with pytest.raises(TypeError):
        pack_tree({"f": lambda: 0})


def test_checkpoint_round_trip_and_fallback_to_previous(tmp_path, caplog):
    d = str(tmp_path)
    write_checkpoint(d, 10, {"v": 1, "x": np.ones(4)})
    write_checkpoint(d, 20, {"v": 2, "x": np.full(4, 2.0)})
    lsn, snap = read_checkpoint(os.path.join(d, "ckpt-000000000020.bin"))
    assert lsn == 20 and snap["v"] == 2 and np.array_equal(snap["x"], np.full(4, 2.0))
    assert not any(n.endswith(".tmp") for n in os.listdir(d)), "no temp file is left behind"
    path = os.path.join(d, "ckpt-000000000020.bin")
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF  # one flipped bit in the middle
    open(path, "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        read_checkpoint(path)
    with caplog.at_level(logging.WARNING):
        lsn, snap = latest_checkpoint(d)
    assert lsn == 10 and snap["v"] == 1 and "corrupt checkpoint" in caplog.text


def test_checkpoint_keeps_the_newest_three(tmp_path):
    for lsn in range(5):
        write_checkpoint(str(tmp_path), lsn, {"v": lsn})
    assert sorted(os.listdir(tmp_path)) == [f"ckpt-{i:012d}.bin" for i in (2, 3, 4)]


@pytest.mark.parametrize("cut", [1, 5, 9, 30])
def test_journal_torn_tail_is_ignored_with_a_warning(tmp_path, caplog, cut):
    d = str(tmp_path)
    j = Journal(d, next_lsn=0, fsync="always")
    for i in range(5):
        j.append("tick", now=float(i), pad="x" * 20)
    j.close()
    path = j.path
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - cut)  # the last record is torn
    with caplog.at_level(logging.WARNING):
        recs = list(read_journal(d))
    assert [r.lsn for r in recs] == [0, 1, 2, 3]
    assert "torn" in caplog.text
    # the next incarnation writes a new segment; reading goes on past the torn tail
    j2 = Journal(d, next_lsn=4, fsync="batch")
    j2.append("restart", now=9.0)
    j2.close()
    assert [r.lsn for r in read_journal(d)] == [0, 1, 2, 3, 4]
    assert [r.lsn for r in read_journal(d, from_lsn=3)] == [3, 4]


def test_journal_rejects_a_bad_fsync_policy(tmp_path):
    with pytest.raises(ValueError):
        Journal(str(tmp_path), next_lsn=0, fsync="sometimes")
