"""benchmarks/seal_pipeline.py: each way of moving a sealed array runs a real lockstep exchange over
loopback TCP (two processes) and opens every array to the bytes sealed; a wrong key is caught."""

from __future__ import annotations

import pytest

from benchmarks import seal_pipeline


@pytest.mark.parametrize("mode", seal_pipeline.MODES)
def test_each_mode_round_trips_and_opens_what_was_sealed(mode):
    dt = seal_pipeline.round_trips(mode, 300_001, 64 * 1024, rounds=8, warmup=2)  # 5 segments, the last short
    assert 0 < dt < 10


def test_an_array_that_opens_to_other_bytes_fails_the_run(monkeypatch):
    real = seal_pipeline._End.__init__

    def other_bytes(self, mode, nbytes, segment, seed):
        real(self, mode, nbytes, segment, seed)
        if seed == 1:  # the worker's array is not the one the daemon expects
            self.plain[12345] ^= 1

    monkeypatch.setattr(seal_pipeline._End, "__init__", other_bytes)
    with pytest.raises(AssertionError, match="did not open to the bytes sealed"):
        seal_pipeline.round_trips("stream", 70_000, 64 * 1024, rounds=2, warmup=1)
