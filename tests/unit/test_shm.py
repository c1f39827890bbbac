"""The same-host path's slots: lifetimes tied to the store and the ledger, no reuse across workers."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from algorithms._pool import MIN_POOLED_BYTES, ArrayPool, step_into
from protocol.shm import ShmArena, ShmReader, remove_stale

D = MIN_POOLED_BYTES // 4 + 3


@pytest.fixture
def arena(tmp_path):
    a = ShmArena(D, boot=0xABCDEF, directory=str(tmp_path))
    yield a
    a.close()


def test_probe_names_the_server_and_refuses_others(arena, tmp_path):
    r = ShmReader(arena.prefix, directory=str(tmp_path))
    assert r.probe(0xABCDEF) is None
    assert "another server" in r.probe(0x123)
    assert "cannot open" in ShmReader("latecomer-1-2", directory=str(tmp_path)).probe(0xABCDEF)
    for bad in ("../etc/passwd", "latecomer-1-2/../x", "other-1-2", ""):
        with pytest.raises(ValueError):
            ShmReader(bad, directory=str(tmp_path))


def test_files_are_private_to_the_user(arena, tmp_path):
    arena.lend("w", 1, 1)
    for name in arena.files():
        assert os.stat(tmp_path / name).st_mode & 0o077 == 0


def test_a_copied_iterate_is_shared_and_released_with_the_store(arena, tmp_path):
    x = np.arange(D, dtype=np.float32)
    slot = arena.iterate_slot(7, x)
    assert arena.iterate_slot(7, x) == slot and arena.copies_made == 1  # once per version
    r = ShmReader(arena.prefix, directory=str(tmp_path))
    v = r.view(slot)
    assert np.array_equal(v, x) and not v.flags.writeable  # the worker cannot write an iterate
    arena.sweep(store={7: x}, ledger={}, workers={})
    assert 7 in arena.copies
    arena.sweep(store={}, ledger={}, workers={})
    assert 7 not in arena.copies
    y = x + 1
    assert arena.iterate_slot(8, y) == slot  # the freed slot is reused for the next version
    assert np.array_equal(r.view(slot), y)


def test_a_sweep_told_what_left_the_store_looks_at_those_copies_only(arena):
    """``gone`` (ps.core.iterates.EvictionCursor): the copies of those iterates are released, where they
    are gone from the store; the others are not looked at."""
    for iid in (1, 2, 3):
        arena.iterate_slot(iid, np.full(D, iid, np.float32))
    arena.sweep(store={3: 0}, ledger={}, workers={}, gone=[1, 3, 99])
    assert set(arena.copies) == {2, 3}, "1 released; 3 is still in the store; 2 not looked at"
    arena.sweep(store={3: 0}, ledger={}, workers={})
    assert set(arena.copies) == {3}


def test_pool_buffers_live_in_shared_memory_and_publish_without_a_copy(arena, tmp_path):
    pool = ArrayPool(factory=arena.allocate)
    a = pool.empty((D,), np.float32)
    a[:] = 3.0
    slot = arena.iterate_slot(1, a)
    assert arena.copies_made == 0
    assert np.all(ShmReader(arena.prefix, directory=str(tmp_path)).view(slot) == 3.0)
    assert pool.empty((10,), np.float32).base is None  # other shapes: plain memory
    n_files = len(arena.files())
    del a
    pool.clear()  # the pool lets go: the slot file goes with the buffer
    gc.collect()
    assert len(arena.files()) == n_files - 1


def test_gradient_slots_go_back_to_their_worker_only(arena, tmp_path):
    s1 = arena.lend("w1", job_id=10, n=1)
    s2 = arena.lend("w2", job_id=11, n=2)
    assert len(set(s1) | set(s2)) == 3
    r = ShmReader(arena.prefix, directory=str(tmp_path))
    r.view(s1[0], writable=True)[:] = 2.0
    g = arena.gradients("w1", 10)
    assert len(g) == 1 and np.all(g[0] == 2.0) and not g[0].flags.writeable
    assert arena.gradients("w2", 10) is None  # not lent to w2
    assert arena.gradients("w1", 99) is None
    ledger = {11: object()}
    arena.sweep(store={}, ledger=ledger, workers={"w1": 1, "w2": 1})  # job 10 settled
    assert arena.lend("w1", 12, 1) == s1  # back to w1
    assert arena.lend("w2", 13, 1) not in (s1,) and set(arena.lend("w2", 14, 1)).isdisjoint(s2)  # 11 still live
    arena.sweep(store={}, ledger={}, workers={"w1": 1})  # w2 left: its slots are unlinked
    names = arena.files()
    for s in s2:
        assert f"{arena.prefix}-{s}" not in names


def test_a_new_incarnation_never_gets_its_predecessors_slots(arena):
    s1 = arena.lend("w1", 1, 1)
    arena.sweep(store={}, ledger={}, workers={"w1": 1})
    arena.forget_worker("w1")  # hello again: a new process under the same id
    assert set(arena.lend("w1", 2, 1)).isdisjoint(s1)


def test_step_into_a_shared_buffer_is_what_a_worker_reads(arena, tmp_path):
    import algorithms._pool as pool_mod

    old = pool_mod.POOL.factory
    pool_mod.POOL.factory = arena.allocate
    try:
        x = np.ones(D, np.float32)
        g = np.full(D, 0.5, np.float32)
        y = step_into(x, 0.1, g)
        slot = arena.iterate_slot(1, y)
        assert arena.copies_made == 0
        got = ShmReader(arena.prefix, directory=str(tmp_path)).view(slot)
        assert np.array_equal(got, x - np.float32(0.1) * g)
    finally:
        pool_mod.POOL.factory = old
        pool_mod.POOL.clear()


def test_close_unlinks_everything_and_stale_files_of_dead_servers_go(tmp_path):
    a = ShmArena(D, boot=1, directory=str(tmp_path))
    a.lend("w", 1, 1)
    a.iterate_slot(0, np.zeros(D, np.float32))
    assert len(a.files()) == 3  # probe, gradient, iterate
    a.close()
    assert os.listdir(tmp_path) == []
    from protocol.shm import _pid_namespace

    ns = _pid_namespace().to_bytes(8, "little")
    dead = 2**22 + 12345  # above any pid_max: no such process
    files = {
        f"latecomer-{dead:x}-1-probe": b"\1" * 8 + ns,  # a dead server of our pid namespace: removed
        f"latecomer-{dead:x}-1-0": b"x",
        f"latecomer-{dead:x}-2-probe": b"\1" * 8 + (1).to_bytes(8, "little"),  # another namespace: kept
        f"latecomer-{dead:x}-2-0": b"x",
        f"latecomer-{dead:x}-3-0": b"x",  # no probe: kept
        f"latecomer-{os.getpid():x}-1-probe": b"\1" * 8 + ns,  # alive: kept
        f"latecomer-{os.getpid():x}-1-0": b"x",
        "other": b"x",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert remove_stale(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(n for n in files if not n.startswith(f"latecomer-{dead:x}-1-"))
