"""Would pipelining the sealed path pay? A lockstep round trip of one sealed array each way over loopback TCP.

    python -m benchmarks.seal_pipeline [--bytes 400000] [--segment 131072] [--rounds 2000]

Two processes play the daemon and a worker with nothing else to do: each seals its array with
AES-256-GCM in segments (as protocol/seal.py does) and sends it; the other opens it and answers.

* ``whole``: seal every segment, then send the message; the receiver wakes once it is all there
  (``SO_RCVLOWAT``, at most 1 MiB, as worker/plainsock.py does) and opens it. What latecomer does.
* ``threads``: as ``whole``, the segments shared by the caller and one helper thread (the cipher
  lets go of the GIL), as protocol/seal.py does from 2 MiB.
* ``stream``: send each segment as soon as it is sealed; the receiver wakes for each segment and
  opens it while the sender seals the next, so that the two cores overlap the cipher's passes.

Prints the microseconds per round trip of each, alternating, and checks that every array opened to
the bytes sealed. Results for this machine are in benchmarks/PROFILE.md ("Pipelining the sealed
path", 2026-12-06).
"""

from __future__ import annotations

import os
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import click
import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG = 16
MODES = ("whole", "threads", "stream")


def _aegis_modes() -> tuple[str, ...]:
    from protocol.seal import AEGIS, available_ciphers

    return ("aegis-whole", "aegis-stream") if AEGIS in available_ciphers() else ()


MODES += _aegis_modes()


def _recv_some(s: socket.socket, view: memoryview, got: int, total: int, want: int, timeout_s: float) -> int:
    """Wait until ``want`` more bytes (at most what is left of ``total``) can be read, then read
    them into ``view`` after ``got``: how many came."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, min(want, total - got)))
    if not select.select([s], [], [], timeout_s)[0]:
        raise TimeoutError(f"no bytes in {timeout_s} s ({got} of {total})")
    k = s.recv_into(view[got:], total - got)
    if not k:
        raise ConnectionError("closed by the peer")
    return k


class _AegisEnd:
    """One side under AEGIS-256X4, each array one frame (one nonce, the tag at its end), as
    protocol/seal.py seals a frame below 8 MiB: ``aegis-whole`` seals it in one call, sends it,
    and the receiver opens it in place once it is all there; ``aegis-stream`` seals it a chunk of
    ``segment`` bytes at a time as it is sent (protocol/seal.py ``Streamed``) and the receiver
    opens each chunk in place as it arrives, the tag checked at the end (as ``Opener.early``)."""

    def __init__(self, mode: str, nbytes: int, segment: int, seed: int) -> None:
        from protocol.seal import AEGIS, make_aead

        self.mode, self.n, self.seg, self.segs = mode, nbytes, segment & ~63 or 64, 1
        self.aead = make_aead(AEGIS, bytes(range(32)))
        self.total = nbytes + TAG
        self.plain = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        self.sealed = np.empty(self.total, np.uint8)
        self.inbox = np.empty(self.total, np.uint8)
        self.opened = self.inbox[:nbytes]
        self.counter = 0
        self.pool = None

    def send(self, s: socket.socket) -> None:
        from protocol.seal import Streamed

        nonce, self.counter = self.counter.to_bytes(12, "big"), self.counter + 1
        if self.mode == "aegis-whole":
            self.aead.encrypt_into(nonce, memoryview(self.plain), b"", self.sealed)
            s.sendall(memoryview(self.sealed))
            return
        body, view = Streamed(self.aead, nonce, memoryview(self.plain), b"", self.sealed), memoryview(self.sealed)
        body.step = self.seg
        while body.ready < self.total:
            lo = body.ready
            body.more()
            s.sendall(view[lo:body.ready])

    def recv(self, s: socket.socket, base: int, timeout_s: float = 10.0) -> None:
        from protocol.seal import _addr, _ffi, _held

        nonce, stream = base.to_bytes(12, "big"), self.mode == "aegis-stream"
        got = done = 0
        view, n = memoryview(self.inbox), self.n
        state = self.aead.begin(nonce, b"") if stream else None
        ptr = _addr(_ffi.from_buffer(self.inbox))
        while got < self.total:
            want = min(self.seg, n - done) if stream and done < n else 1 << 20
            got += _recv_some(s, view, got, self.total, want, timeout_s)
            upto = n if got >= n else got & ~63  # whole blocks while more comes
            if stream and upto > done:
                _held.aegis256x4_state_decrypt_update(_addr(state), ptr + done, ptr + done, upto - done)
                done = upto
        if stream:
            ok = _held.aegis256x4_state_decrypt_final(_addr(state), ptr + n, TAG) == 0
        else:
            try:
                self.aead.decrypt_into(nonce, view, b"", self.opened)
                ok = True
            except Exception:  # noqa: BLE001 - InvalidTag
                ok = False
        if not ok:
            raise AssertionError("an array did not open to the bytes sealed (its tag failed)")


def _end(mode: str, nbytes: int, segment: int, seed: int):
    return (_AegisEnd if mode.startswith("aegis") else _End)(mode, nbytes, segment, seed)


class _End:
    """One side: its key, its array and its buffers."""

    def __init__(self, mode: str, nbytes: int, segment: int, seed: int) -> None:
        self.mode, self.n, self.seg = mode, nbytes, segment
        self.aead = AESGCM(bytes(range(32)))
        self.segs = max(1, -(-nbytes // segment))
        self.step = segment + TAG
        self.total = nbytes + TAG * self.segs
        self.plain = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        self.sealed = np.empty(self.total, np.uint8)
        self.inbox = np.empty(self.total, np.uint8)
        self.opened = np.empty(nbytes, np.uint8)
        self.counter = 0
        self.pool = ThreadPoolExecutor(1) if mode == "threads" else None

    def _all(self, fn, base: int) -> None:
        """``fn`` over every segment: on this thread, or shared with the helper (``threads``)."""
        if self.pool is None or self.segs < 2:
            for j in range(self.segs):
                fn(j, base)
            return
        shared = iter(range(self.segs))

        def run() -> None:
            for j in shared:
                fn(j, base)

        f = self.pool.submit(run)
        run()
        f.result()

    def _nonce(self, j: int, base: int) -> bytes:
        return (base + j).to_bytes(12, "big")

    def _seal(self, j: int, base: int) -> None:
        lo = j * self.seg
        part = memoryview(self.plain)[lo:lo + self.seg]
        at = j * self.step
        self.aead.encrypt_into(self._nonce(j, base), part, b"", memoryview(self.sealed)[at:at + part.nbytes + TAG])

    def _open(self, j: int, base: int) -> None:
        lo = j * self.seg
        n = min(self.seg, self.n - lo)
        at = j * self.step
        self.aead.decrypt_into(self._nonce(j, base), memoryview(self.inbox)[at:at + n + TAG], b"",
                               memoryview(self.opened)[lo:lo + n])

    def send(self, s: socket.socket) -> None:
        base, self.counter = self.counter, self.counter + self.segs
        if self.mode != "stream":
            self._all(self._seal, base)
            s.sendall(memoryview(self.sealed))
            return
        for j in range(self.segs):
            self._seal(j, base)
            s.sendall(memoryview(self.sealed)[j * self.step:min(self.total, (j + 1) * self.step)])

    def recv(self, s: socket.socket, base: int, timeout_s: float = 10.0) -> None:
        got = opened = 0
        view = memoryview(self.inbox)
        while got < self.total:
            if self.mode == "stream":  # wake for the rest of the segment being read
                want = self.step - got % self.step
            else:  # wake once the message is (nearly) all there
                want = 1 << 20
            got += _recv_some(s, view, got, self.total, want, timeout_s)
            if self.mode == "stream":
                while opened < self.segs - 1 and (opened + 1) * self.step <= got:
                    self._open(opened, base)
                    opened += 1
        if opened == 0:
            self._all(self._open, base)
            return
        for j in range(opened, self.segs):
            self._open(j, base)


def round_trips(mode: str, nbytes: int, segment: int, rounds: int, warmup: int = 50) -> float:
    """Seconds per lockstep round trip (a sealed array each way) in ``mode``; raises if an array did
    not open to the bytes sealed."""
    if mode not in MODES:
        raise ValueError(f"mode: one of {MODES}")
    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the worker: answer each array with its own, until the other end closes
        code = 0
        try:
            lst.close()
            c = socket.create_connection(("127.0.0.1", port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            w = _end(mode, nbytes, segment, seed=1)
            server_counter = 0
            for _ in range(warmup + rounds):
                w.recv(c, server_counter)
                server_counter += w.segs
                w.send(c)
        except ConnectionError:
            pass
        except BaseException:  # noqa: BLE001 - any failure is the exit status
            code = 1
        os._exit(code)
    d = None
    try:
        lst.settimeout(10)
        s, _ = lst.accept()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        d = _end(mode, nbytes, segment, seed=2)
        expected = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        worker_counter = 0
        t0 = 0.0
        for r in range(warmup + rounds):
            if r == warmup:
                t0 = time.perf_counter()
            d.send(s)
            d.recv(s, worker_counter)
            worker_counter += d.segs
        dt = (time.perf_counter() - t0) / rounds
        if not np.array_equal(d.opened, expected):
            raise AssertionError("an array did not open to the bytes sealed")
        s.close()
    finally:
        lst.close()
        if d is not None and d.pool is not None:
            d.pool.shutdown()
        _, status = os.waitpid(pid, 0)
    if status:
        raise RuntimeError(f"the worker process failed (status {status})")
    return dt


@click.command()
@click.option("--bytes", "nbytes", type=click.IntRange(min=1), default=400_000, show_default=True)
@click.option("--segment", type=click.IntRange(min=1024), default=128 * 1024, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True)
def main(nbytes: int, segment: int, rounds: int, repeat: int) -> None:
    for _ in range(repeat):
        for mode in MODES:
            dt = round_trips(mode, nbytes, segment, rounds)
            click.echo(f"{mode:7s} {nbytes:,} bytes each way, {segment:,}-byte segments: "
                       f"{dt * 1e6:.0f} µs a round trip")


if __name__ == "__main__":
    main()
