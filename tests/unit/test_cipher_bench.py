"""benchmarks/cipher.py: the ctypes bindings to pyzmq's libsodium seal and open correctly (a
figure of a wrong binding would be meaningless), and the quick measurement runs."""

from __future__ import annotations

import ctypes
import os

import pytest

from benchmarks import cipher


@pytest.mark.parametrize("name", ["xsalsa20poly1305", "chacha20poly1305", "aes256gcm"])
def test_each_construction_round_trips_and_refuses_a_forgery(name):
    aead = next(a for a in cipher.constructions() if a.name == name)
    if not aead.available:
        pytest.skip("AES-256-GCM needs AES-NI and PCLMUL")
    n = 1000
    plain = os.urandom(n)
    msg = ctypes.create_string_buffer(plain, n)
    box = ctypes.create_string_buffer(n + cipher.MAC_BYTES)
    back = ctypes.create_string_buffer(n)
    key = ctypes.create_string_buffer(os.urandom(cipher.KEY_BYTES), cipher.KEY_BYTES)
    nonce = ctypes.create_string_buffer(os.urandom(aead.nonce_bytes), aead.nonce_bytes)
    aead.seal(box, msg, n, nonce, key)
    assert box.raw[:n] != plain
    assert aead.open(back, box, n, nonce, key) and back.raw == plain
    forged = bytearray(box.raw)
    forged[5] ^= 1
    assert not aead.open(back, ctypes.create_string_buffer(bytes(forged), len(forged)), n, nonce, key)


def test_the_quick_measurement_gives_finite_figures():
    rows = cipher.measure(sizes=(4_000, 100_000), seconds=0.02)  # one size under 64 KiB, one above
    for r in rows:
        assert all(0 < v < 1000 for v in r.gbps.values()), r.gbps
        assert 0 < r.rtt_plain_s < 1 and 0 < r.rtt_curve_s < 1
    assert "xsalsa20poly1305" in cipher.markdown(rows) and cipher.limit_gbps(rows) > 0
