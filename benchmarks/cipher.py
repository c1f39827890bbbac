"""The cipher's limit on this machine, and what libzmq's CurveZMQ makes of it (issue 32).

Two measurements, both in this process, on one core each:

* **The cipher alone.** libsodium's authenticated encryption, through the very library pyzmq's
  libzmq links (``pyzmq.libs/libsodium-*.so``, loaded with ctypes; nothing to install): the box
  CurveZMQ seals every frame with once its handshake is done (XSalsa20-Poly1305 with the
  precomputed key: ``crypto_secretbox_easy`` is the same construction), and for reference
  ChaCha20-Poly1305 (IETF) and, where the CPU has AES-NI and PCLMUL, AES-256-GCM. GB/s of
  plaintext sealed per second of CPU, at the bench's message sizes (d float32 for d = 10^3 ...
  10^7).
* **libzmq's CurveZMQ.** Raw pyzmq, two DEALER sockets over loopback TCP, one echoing: the
  round trip of one message each way, plain and under CURVE. A round trip seals and opens the
  message twice (4 passes of the cipher over it), so the extra time per byte and pass, against
  the cipher's own, is what libzmq's framing adds (it copies each frame into a zeroed, padded
  buffer, seals it, and copies the box into a new message; opening does the same).

    python -m benchmarks.cipher [--quick] [--out benchmarks/RESULTS-cipher.md] [--json FILE]

The latecomer rows of ``latecomer bench`` (``latecomer-curve`` beside ``latecomer``) say what the
server makes of it; benchmarks/RESULTS-curve.md puts the three side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

SIZES = (4_000, 400_000, 4_000_000, 40_000_000)  # d float32 at d = 10^3, 10^5, 10^6, 10^7
QUICK_SIZES = (4_000, 400_000)
KEY_BYTES, NONCE_BYTES, MAC_BYTES = 32, 24, 16
IETF_NONCE_BYTES = 12


def libsodium() -> ctypes.CDLL:
    """The libsodium pyzmq's libzmq links (its wheel bundles one), or a system one."""
    import zmq

    here = os.path.dirname(os.path.dirname(zmq.__file__))
    found = sorted(glob.glob(os.path.join(here, "pyzmq.libs", "libsodium*.so*")))
    for path in [*found, "libsodium.so.26", "libsodium.so.23", "libsodium.so"]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if lib.sodium_init() < 0:
            raise RuntimeError(f"sodium_init failed in {path}")
        return lib
    raise RuntimeError("no libsodium: neither pyzmq's bundled one nor a system one")


@dataclass
class Aead:
    """One of libsodium's AEAD constructions, sealing and opening with ctypes."""

    name: str
    lib: ctypes.CDLL

    @property
    def available(self) -> bool:
        return self.name != "aes256gcm" or bool(self.lib.crypto_aead_aes256gcm_is_available())

    def seal(self, out, msg, n: int, nonce, key) -> None:
        u = ctypes.c_ulonglong
        if self.name == "xsalsa20poly1305":
            rc = self.lib.crypto_secretbox_easy(out, msg, u(n), nonce, key)
        else:
            fn = getattr(self.lib, f"crypto_aead_{self._c_name}_encrypt")
            rc = fn(out, None, msg, u(n), None, u(0), None, nonce, key)
        if rc != 0:
            raise RuntimeError(f"{self.name}: sealing failed ({rc})")

    def open(self, out, box, n: int, nonce, key) -> bool:
        """Open a box of ``n`` plaintext bytes (``n + MAC_BYTES`` sealed); False if it is forged."""
        u = ctypes.c_ulonglong
        if self.name == "xsalsa20poly1305":
            return self.lib.crypto_secretbox_open_easy(out, box, u(n + MAC_BYTES), nonce, key) == 0
        fn = getattr(self.lib, f"crypto_aead_{self._c_name}_decrypt")
        return fn(out, None, None, box, u(n + MAC_BYTES), None, u(0), nonce, key) == 0

    @property
    def _c_name(self) -> str:
        return {"chacha20poly1305": "chacha20poly1305_ietf", "aes256gcm": "aes256gcm"}[self.name]

    @property
    def nonce_bytes(self) -> int:
        return NONCE_BYTES if self.name == "xsalsa20poly1305" else IETF_NONCE_BYTES


def constructions(lib: ctypes.CDLL | None = None) -> list[Aead]:
    lib = lib or libsodium()
    return [Aead(n, lib) for n in ("xsalsa20poly1305", "chacha20poly1305", "aes256gcm")]


def cipher_gbps(aead: Aead, n: int, seconds: float = 0.5) -> float:
    """Plaintext GB sealed per CPU second (this thread) at message size ``n``."""
    msg = ctypes.create_string_buffer((os.urandom(min(n, 1 << 16)) * (n // (1 << 16) + 1))[:n], n)
    out = ctypes.create_string_buffer(n + MAC_BYTES)
    key = ctypes.create_string_buffer(os.urandom(KEY_BYTES), KEY_BYTES)
    nonce = ctypes.create_string_buffer(aead.nonce_bytes)
    aead.seal(out, msg, n, nonce, key)  # warm
    reps, cpu0 = 0, time.thread_time()
    while time.thread_time() - cpu0 < seconds:
        aead.seal(out, msg, n, nonce, key)
        reps += 1
    return n * reps / (time.thread_time() - cpu0) / 1e9


def openssl_gcm_gbps(n: int, seconds: float = 0.5) -> float:
    """AES-256-GCM through OpenSSL (``cryptography``): a cipher of the sealed data connection
    (protocol/seal.py, PROTOCOL.md §6.15), sealing into a warm buffer as the sealer does; plaintext
    GB sealed per CPU second (this thread) at message size ``n``."""
    return session_cipher_gbps("aes256gcm", n, seconds)


def session_cipher_gbps(cipher: str, n: int, seconds: float = 0.5) -> float:
    """A cipher of the sealed data connection (protocol/seal.py: ``aes256gcm`` through OpenSSL,
    ``aegis256x4`` through libaegis), called as the sealer calls it, into a warm buffer; plaintext
    GB sealed per CPU second (this thread) at message size ``n``."""
    import numpy as np

    from protocol.seal import make_aead

    aead = make_aead(cipher, os.urandom(KEY_BYTES))
    msg = np.frombuffer((os.urandom(min(n, 1 << 16)) * (n // (1 << 16) + 1))[:n], np.uint8)
    out = np.empty(n + MAC_BYTES, np.uint8)
    nonce = bytes(IETF_NONCE_BYTES)
    aead.encrypt_into(nonce, msg, b"prefix", out)  # warm
    reps, cpu0 = 0, time.thread_time()
    while time.thread_time() - cpu0 < seconds:
        aead.encrypt_into(nonce, msg, b"prefix", out)
        reps += 1
    return n * reps / (time.thread_time() - cpu0) / 1e9


def zmq_round_trip(n: int, curve: bool, seconds: float = 1.0) -> float:
    """Seconds per round trip of an ``n``-byte message between two DEALERs over loopback TCP
    (one thread echoes), plain or under CurveZMQ; the median of a timed interval's round trips."""
    import numpy as np
    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (a, b):
        s.linger = 0
    if curve:
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        a.curve_server, a.curve_secretkey, a.curve_publickey = True, ssec, spub
        b.curve_serverkey, b.curve_publickey, b.curve_secretkey = spub, cpub, csec
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if a.poll(100):
                a.send(a.recv(copy=False), copy=False)

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    msg = np.ones(max(n // 4, 1), np.float32)
    times: list[float] = []
    try:
        for _ in range(2):  # the handshake and the first buffers
            b.send(msg, copy=False)
            b.recv(copy=False)
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(times) < 3:
            t = time.perf_counter()
            b.send(msg, copy=False)
            b.recv(copy=False)
            times.append(time.perf_counter() - t)
    finally:
        stop.set()
        th.join(5)
        a.close(0)
        b.close(0)
        ctx.term()
    times.sort()
    return times[len(times) // 2]


@dataclass
class CipherRow:
    bytes: int
    gbps: dict  # construction -> GB/s per core (sealing)
    rtt_plain_s: float
    rtt_curve_s: float

    @property
    def curve_over_plain(self) -> float:
        return self.rtt_plain_s / self.rtt_curve_s

    def ns_per_byte_pass(self) -> float:
        """CurveZMQ's extra time per byte and pass of the cipher (4 passes a round trip)."""
        return (self.rtt_curve_s - self.rtt_plain_s) / (4 * self.bytes) * 1e9


def measure(sizes=SIZES, seconds: float = 0.5) -> list[CipherRow]:
    aeads = [a for a in constructions() if a.available]
    return [CipherRow(n, {**{a.name: cipher_gbps(a, n, seconds) for a in aeads},
                          "aes256gcm-openssl": openssl_gcm_gbps(n, seconds)},
                      zmq_round_trip(n, False, 2 * seconds), zmq_round_trip(n, True, 2 * seconds)) for n in sizes]


def limit_gbps(rows: list[CipherRow], at_least: int = 4_000_000) -> float:
    """CurveZMQ's cipher limit: XSalsa20-Poly1305's GB/s per core at the large sizes (the median)."""
    vals = sorted(r.gbps["xsalsa20poly1305"] for r in rows if r.bytes >= at_least) or \
        sorted(r.gbps["xsalsa20poly1305"] for r in rows)
    return vals[len(vals) // 2]


def markdown(rows: list[CipherRow]) -> str:
    names = list(rows[0].gbps)
    zmq_cols = (" | raw pyzmq round trip, plain ms | under CurveZMQ ms | CurveZMQ / plain"
                " | CurveZMQ ns per byte and pass |")
    out = ["| message bytes | " + " | ".join(f"{n} GB/s per core" for n in names) + zmq_cols,
           "|" + "---|" * (len(names) + 5)]
    for r in rows:
        xs = r.gbps["xsalsa20poly1305"]
        out.append(f"| {r.bytes:,} | " + " | ".join(f"{r.gbps[n]:.2f}" for n in names)
                   + f" | {r.rtt_plain_s * 1e3:.3f} | {r.rtt_curve_s * 1e3:.3f} | {r.curve_over_plain:.2f}"
                   + f" | {r.ns_per_byte_pass():.2f} (the cipher: {1 / xs:.2f}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cipher", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two sizes, short intervals")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    rows = measure(QUICK_SIZES, 0.1) if args.quick else measure()
    table = markdown(rows)
    print(table)
    print(f"\nCurveZMQ's cipher limit here: {limit_gbps(rows):.2f} GB/s per core (XSalsa20-Poly1305)")
    if args.out:
        import platform

        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"# The cipher's limit and libzmq's CurveZMQ ({time.strftime('%Y-%m-%d')})\n\n"
                    f"`python -m benchmarks.cipher`: {platform.machine()}, {os.cpu_count()} logical cores, "
                    f"Python {platform.python_version()}, pyzmq's bundled libzmq and libsodium; sealing GB/s of "
                    "plaintext per CPU second on one core, and raw pyzmq round trips of one message each way "
                    "(median). Shared, noisy machine: read the ratios. What it means for latecomer: "
                    "benchmarks/PROFILE.md, \"The encrypted path\".\n\n" + table
                    + f"\n\nCurveZMQ's cipher limit here: {limit_gbps(rows):.2f} GB/s per core "
                    "(XSalsa20-Poly1305 at 4-40 MB).\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{**asdict(r), "curve_over_plain": r.curve_over_plain} for r in rows], f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
