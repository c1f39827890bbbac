"""Sealed messages: the protocol's messages under AES-256-GCM on the data connection (PROTOCOL.md §6.15).

Under CurveZMQ every byte of a job's iterates and a reply's gradients is sealed and opened by
libzmq's CURVE with XSalsa20-Poly1305, which copies each frame twice more on either side
(benchmarks/PROFILE.md, "The encrypted path"). A connection whose handshake CurveZMQ finished
gets, inside its ``welcome`` (so only that peer, and only after ZAP accepted its key), a fresh
32-byte key per direction and a token; the worker then opens a second connection to the same
endpoint under ZMTP's NULL mechanism, its routing id the token, and the messages after the
welcome travel on it sealed here: each frame of a message encrypted and authenticated
separately (AES-256-GCM; `cryptography`'s OpenSSL uses the CPU's AES instructions), no frame
copied on the way in or out beyond the cipher's own pass.

A sealed message is its frames, each sealed, after a clear prefix frame. Whole (the first
format, what a peer that did not say ``seal_segments`` opens)::

    prefix  = counter (u64, big-endian) | frame count n (u16)
    frame i = AES-256-GCM(key, nonce = direction (4 bytes) | counter + i (u64), aad = prefix)(plain frame i)

In segments (``hello.seal_segments`` / ``welcome.seal_segments``: the peer opens them), each frame
is cut into segments of 2^p bytes (the last shorter; an empty frame is one empty segment), each
sealed on its own, so that the segments of a large frame are sealed and opened on several cores
at once (``cryptography`` lets go of the GIL inside the cipher)::

    prefix    = counter (u64) | frame count n (u16) | p (u8)
    segment g = AES-256-GCM(key, nonce = direction | counter + g (u64),
                            aad = prefix | frame index (u16) | segment index in the frame (u32) |
                                  the frame's segment count (u32))(plain segment)
    frame i   = its segments, each followed by its tag

with g counting the message's segments in order over its frames. The receiver tells the format
by the prefix's length and finds the segments from each frame's length alone.

The cipher is AES-256-GCM unless both ends can use AEGIS-256X4 (the CFRG's AEGIS family,
draft-irtf-cfrg-aegis-aead; ``pyaegis``'s libaegis, about three times AES-GCM's speed on CPUs
with vector AES): the worker lists it in ``hello.seal_ciphers``, the server names its choice in
``welcome.seal_cipher`` (empty: AES-256-GCM), both inside the CurveZMQ channel. Either way the
key is 256 bits, the tag 128, and the 12-byte nonce above (AEGIS-256 takes 32 bytes: the same 12,
then zeros); everything else here is the same for both.

The counter counts nonces (frames, or segments): the sender's next message starts where the last
one ended, so no nonce is used twice under a key. The receiver takes a message only if its
counter is at least the one after the last message it took and every frame (segment) opens: a
repeat (a replay), an older message, a frame or segment moved or cut, a changed prefix or a
message under another key is refused whole, before any of it is decoded. A gap (messages lost
with a dropped connection) is allowed: the protocol tolerates lost messages, and nothing lost
can come back afterwards.

Large frames in flight. A frame of at least STREAM_MIN bytes that is one AEGIS segment may be
sealed as it is written (``Sealer.seal(streamed=True)``: a :class:`Streamed`, which the writer
seals a chunk at a time through libaegis's incremental calls and writes chunk by chunk,
protocol/zmtp.py ``send_streamed``), and opened as it arrives (``Opener.early``, called by the
ZMTP codec after each read into the frame's buffer: the part that came is opened where it lies,
the tag checked once the frame is whole, and :meth:`Opener.open` takes that verdict). Either end
does it or not on its own: the bytes are those of the one-call seal and open. The daemon streams
the jobs it sends on a handed connection and opens large replies as they arrive; a worker opens
large jobs as they arrive and sends its replies whole (benchmarks/PROFILE.md, "Large jobs sealed
as they are written").

Pure: no sockets. The daemon (ps/net/sealed.py) and the worker (worker/link.py) hold one
:class:`Sealer` and one :class:`Opener` per session.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from protocol.errors import RemoteProtocolError
from protocol.messages import SEAL_SESSION_BYTES
from protocol.zmtp import LazyBody

KEY_BYTES = 32  # AES-256
TAG_BYTES = 16  # the GCM tag each sealed frame ends with
TOKEN_BYTES = 32  # the data connection's routing id: "S", 15 random bytes, 16 bytes of MAC
SECRET_BYTES = 32  # the front's and the daemon's shared secret for tokens
SESSION_BYTES = SEAL_SESSION_BYTES  # Welcome.seal: key up, key down, token (2 x KEY_BYTES + TOKEN_BYTES)
UP, DOWN = b"up\x00\x00", b"dn\x00\x00"  # nonce prefixes: worker -> server, server -> worker
_PREFIX = struct.Struct(">QH")
_PREFIX_SEGMENTS = struct.Struct(">QHB")
_SEGMENT_AAD = struct.Struct(">HII")  # frame index, segment index in the frame, the frame's segment count
MAX_FRAMES = 0xFFFF
SEGMENT_LOG2 = 20  # this sender's segments: 1 MiB (larger under AEGIS for messages no thread shares)
SEGMENT_LOG2_MIN, SEGMENT_LOG2_MAX = 16, 24  # what a receiver accepts
PARALLEL_MIN_BYTES = 2 << 20  # a message's sealed bytes from which its segments are spread over threads
MAX_CIPHER_THREADS = 4  # the calling thread and up to 3 helpers
CIPHER_THREADS_ENV = "LATECOMER_CIPHER_THREADS"
_NONCES = 1 << 64
MAX_SIZES = 8  # frame sizes an Opener remembers as genuine (its warm buffers' sizes)


class SealError(RemoteProtocolError):
    """A sealed message that does not open: tampered, replayed, reordered or under another key."""


class Session(NamedTuple):
    """The keys of one sealed session and its data connection's token (Welcome.seal)."""

    up: bytes  # worker -> server
    down: bytes  # server -> worker
    token: bytes

    @classmethod
    def new(cls, token: bytes) -> "Session":
        return cls(os.urandom(KEY_BYTES), os.urandom(KEY_BYTES), token)

    def pack(self) -> bytes:
        return self.up + self.down + self.token

    @classmethod
    def unpack(cls, raw: bytes) -> "Session":
        if len(raw) != SESSION_BYTES:
            raise RemoteProtocolError(f"seal: {len(raw)} bytes, expected {SESSION_BYTES}")
        return cls(raw[:KEY_BYTES], raw[KEY_BYTES:2 * KEY_BYTES], raw[2 * KEY_BYTES:])


def make_token(secret: bytes) -> bytes:
    """A fresh data-connection token: ``S``, 15 random bytes and their HMAC-SHA256 (first 16
    bytes) under ``secret``, which the daemon and its front share: the front passes a NULL
    connection to the daemon only if its routing id is such a token (:func:`token_ok`)."""
    head = b"S" + os.urandom(15)
    return head + hmac.new(secret, head, hashlib.sha256).digest()[:16]


def token_ok(secret: bytes, token: bytes) -> bool:
    if len(token) != TOKEN_BYTES or token[:1] != b"S":
        return False
    return hmac.compare_digest(token[16:], hmac.new(secret, token[:16], hashlib.sha256).digest()[:16])


GCM, AEGIS = "aes256gcm", "aegis256x4"  # the bulk ciphers (Welcome.seal_cipher; "" is GCM)
# Where a message's segments are spread over threads: from this many sealed bytes (a helper's
# wake-up costs tens of µs, so a fast cipher needs larger messages for it to pay).
PARALLEL_MIN = {GCM: PARALLEL_MIN_BYTES, AEGIS: 8 << 20}
_AEGIS_PAD = bytes(20)  # AEGIS-256's nonce is 32 bytes: the 12 of a frame's nonce, then zeros


class _Aegis256X4:
    """AEGIS-256X4 with AESGCM's ``encrypt_into`` / ``decrypt_into`` (the tag after the
    ciphertext; :class:`InvalidTag` when a frame does not authenticate), through libaegis's
    detached calls (``pyaegis``'s build). These keep the GIL (ctypes' PyDLL): letting go of it for
    a few microseconds' work hands it to any other runnable thread (a worker's compute thread,
    pyzmq's garbage collector) until that one lets go, and a 150-byte header frame then cost
    20-200 µs instead of 2. The ``*_released`` twins (cffi) let go of it, for the segments of a
    large message that several threads share (:func:`_spread`)."""

    __slots__ = ("key",)
    in_place = True  # decrypt_into may write over its input (same start); OpenSSL's AES-GCM refuses overlap

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"AEGIS-256 takes a {KEY_BYTES}-byte key")
        self.key = bytes(key)

    def encrypt_into(self, nonce: bytes, data: Any, aad: bytes, out: Any, lib: Any = None) -> None:
        if lib is None and type(data) is bytes:  # ctypes passes a bytes object's own memory (a header frame)
            src: Any = data
            n = len(data)
        else:
            src = _ffi.from_buffer(data)
            n = len(src)
        dst = _ffi.from_buffer(out, require_writable=True)
        if len(dst) != n + TAG_BYTES:
            raise ValueError(f"the output buffer must be {n + TAG_BYTES} bytes")
        if lib is None:
            p = _addr(dst)
            rc = _held.aegis256x4_encrypt_detached(p, p + n, TAG_BYTES, src if src is data else _addr(src), n, aad,
                                                   len(aad), nonce + _AEGIS_PAD, self.key)
        else:
            rc = lib.aegis256x4_encrypt_detached(dst, dst + n, TAG_BYTES, src, n, aad, len(aad), nonce + _AEGIS_PAD,
                                                 self.key)
        if rc != 0:
            raise ValueError("AEGIS-256X4 refused to seal")

    def decrypt_into(self, nonce: bytes, data: Any, aad: bytes, out: Any, lib: Any = None) -> None:
        src = _ffi.from_buffer(data)
        n = len(src) - TAG_BYTES
        if n < 0:
            raise InvalidTag()
        dst = _ffi.from_buffer(out, require_writable=True)
        if len(dst) != n:
            raise ValueError(f"the output buffer must be {n} bytes")
        if lib is None:
            q = _addr(src)
            rc = _held.aegis256x4_decrypt_detached(_addr(dst), q, n, q + n, TAG_BYTES, aad, len(aad),
                                                   nonce + _AEGIS_PAD, self.key)
        else:
            rc = lib.aegis256x4_decrypt_detached(dst, src, n, src + n, TAG_BYTES, aad, len(aad), nonce + _AEGIS_PAD,
                                                 self.key)
        if rc != 0:
            raise InvalidTag()

    def begin(self, nonce: bytes, aad: bytes) -> Any:
        """A fresh incremental state for one frame under ``nonce`` and ``aad`` (either way: the
        updates then give the bytes the one-call seal or open would, a chunk at a time)."""
        st = _ffi.new("aegis256x4_state *")
        _held.aegis256x4_state_init(_addr(st), aad, len(aad), nonce + _AEGIS_PAD, self.key)
        return st

    def encrypt_into_released(self, nonce: bytes, data: Any, aad: bytes, out: Any) -> None:
        self.encrypt_into(nonce, data, aad, out, _lib)

    def decrypt_into_released(self, nonce: bytes, data: Any, aad: bytes, out: Any) -> None:
        self.decrypt_into(nonce, data, aad, out, _lib)


def _held_calls(path: str) -> Any:
    """libaegis's two detached calls through ctypes.PyDLL (the GIL held) from pyaegis's build."""
    import ctypes

    dll = ctypes.PyDLL(path)
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for name in ("aegis256x4_encrypt_detached", "aegis256x4_decrypt_detached"):
        fn = getattr(dll, name)
        fn.argtypes = [vp, vp, sz, vp, sz, cp, sz, cp, cp]
        fn.restype = ctypes.c_int
    # the incremental calls (a frame sealed or opened a chunk at a time: Streamed, Opener.early)
    dll.aegis256x4_state_init.argtypes = [vp, cp, sz, cp, cp]
    dll.aegis256x4_state_init.restype = None
    for name in ("aegis256x4_state_encrypt_update", "aegis256x4_state_decrypt_update"):
        getattr(dll, name).argtypes = [vp, vp, vp, sz]
        getattr(dll, name).restype = ctypes.c_int
    for name in ("aegis256x4_state_encrypt_final", "aegis256x4_state_decrypt_final"):
        getattr(dll, name).argtypes = [vp, vp, sz]
        getattr(dll, name).restype = ctypes.c_int
    return dll


# draft-irtf-cfrg-aegis-aead, AEGIS-256X4 test vectors 1 and 2 (key, nonce, ad, msg, ct, tag128):
# what the library must give before a session may use it.
_AEGIS_KAT = (
    ("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
     "101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f", "", "", "",
     "3b7fee6cee7bf17888ad11ed2397beb4"),
    ("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
     "101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f", "0102030401020304", "05060708" * 30,
     "bec109547f8316d598b3b7d947ad4c0ef5b98e217cffa0d858ad49ae34109a95abc5b5fada820c4d6ae2fca0f5e2444e"
     "52a04a1edb7bec71408de3e19950052194506be3ba6a4de51a15a577ea0e4c14f7539a13e751a555f48d0f49fecffb22"
     "0525e60d381e2efa803b09b7164ba59fdc66656affd51e06",
     "ec44b512d713f745547be345bcc66b6c"),
)


def _aegis_passes() -> bool:
    """Whether the library gives the draft's test vectors through both ways of calling it (cffi,
    the GIL let go; ctypes, the GIL held): sealed, opened, and a changed tag refused."""
    for key, nonce, ad, msg, ct, tag in _AEGIS_KAT:
        k, n, a, m = (bytes.fromhex(x) for x in (key, nonce, ad, msg))
        for released in (True, False):
            out, back = bytearray(len(m) + TAG_BYTES), bytearray(len(m))
            o, b, src = _ffi.from_buffer(out), _ffi.from_buffer(back), _ffi.from_buffer(m)
            if released:
                enc, dec = _lib.aegis256x4_encrypt_detached, _lib.aegis256x4_decrypt_detached
            else:
                enc, dec = _held.aegis256x4_encrypt_detached, _held.aegis256x4_decrypt_detached
                o, b, src = _addr(o), _addr(b), _addr(src)
            if enc(o, o + len(m), TAG_BYTES, src, len(m), a, len(a), n, k) != 0:
                return False
            if bytes(out) != bytes.fromhex(ct + tag):
                return False
            if dec(b, o, len(m), o + len(m), TAG_BYTES, a, len(a), n, k) != 0 or bytes(back) != m:
                return False
            out[-1] ^= 1
            if dec(b, o, len(m), o + len(m), TAG_BYTES, a, len(a), n, k) == 0:
                return False
    return True


def _addr(buf: Any) -> int:
    """The address of a cdata buffer (for the ctypes calls)."""
    return int(_ffi.cast("uintptr_t", buf))


try:  # optional (``pip install latecomer[aegis]``): without it every session is AES-256-GCM
    import pyaegis._aegis_ffi as _aegis_module
    from pyaegis._aegis_ffi import ffi as _ffi
    from pyaegis._aegis_ffi import lib as _lib

    _lib.aegis_init()  # picks the code for this CPU's instructions (vector AES, AVX-512, ARM crypto)
    _held = _held_calls(_aegis_module.__file__)
    _AEGIS_OK = _aegis_passes()
except (ImportError, AttributeError, OSError):
    _AEGIS_OK = False


CIPHERS_ENV = "LATECOMER_SEAL_CIPHERS"


def available_ciphers() -> tuple[str, ...]:
    """The bulk ciphers this process can seal and open with, fastest first: AES-256-GCM always,
    AEGIS-256X4 with ``pyaegis``; ``LATECOMER_SEAL_CIPHERS`` (comma-separated names) keeps only
    those it names (AES-256-GCM, the protocol's baseline, stays). A name it does not know is
    refused in one line (ValueError)."""
    have = (AEGIS, GCM) if _AEGIS_OK else (GCM,)
    raw = os.environ.get(CIPHERS_ENV, "").strip()
    if not raw:
        return have
    want = {c.strip() for c in raw.split(",") if c.strip()}
    for c in sorted(want):
        if c not in (GCM, AEGIS):
            raise ValueError(f"{CIPHERS_ENV}={raw!r}: unknown cipher {c!r} (known: {GCM}, {AEGIS})")
    return tuple(c for c in have if c in want or c == GCM)


AEGIS_MIN_BYTES = 64 << 10  # under auto, AEGIS for runs whose arrays are at least this large


def choose_cipher(offered: Any, allowed: tuple[str, ...], array_bytes: int | None = None) -> str | None:
    """The server's pick for a worker that offered ``offered`` (hello.seal_ciphers, besides GCM):
    the first of ``allowed`` (the server's, fastest first) the worker can use too; None if none.
    ``array_bytes`` (an iterate's bytes on the wire), when the server may pick either: below
    AEGIS_MIN_BYTES AES-256-GCM, whose calls cost a third of AEGIS's on small frames (OpenSSL's C
    entry against ctypes'), where AEGIS's speed per byte buys nothing."""
    if array_bytes is not None and array_bytes < AEGIS_MIN_BYTES and GCM in allowed:
        allowed = (GCM,)
    for c in allowed:
        if c == GCM or c in offered:
            return c
    return None


def make_aead(cipher: str, key: bytes) -> Any:
    if cipher == GCM:
        return AESGCM(key)
    if cipher == AEGIS and _AEGIS_OK:
        return _Aegis256X4(key)
    raise ValueError(f"seal cipher {cipher!r} is not available here (have: {', '.join(available_ciphers())})")


Alloc = Callable[[int], np.ndarray]  # n -> a writable uint8 array of n bytes, contents arbitrary


def _empty(n: int) -> np.ndarray:
    return np.empty(n, np.uint8)


class BufferPool:
    """Warm byte buffers for sealing and opening, one list per size, a buffer handed out again
    once nothing but the pool refers to it (pyzmq holds a frame sent without a copy until libzmq
    is done with it; an opened frame lives as long as the arrays decoded from it). Bounded: at
    most ``max_sizes`` sizes (the least recently asked for goes) and ``keep_free`` idle buffers
    of a size; buffers below ``min_bytes`` are plain ``np.empty`` (malloc reuses them warm).
    One thread asks (the loop that seals and opens); others may drop references."""

    UNSHARED = 3  # getrefcount of a buffer only the list refers to: the list, the loop variable, the argument

    def __init__(self, max_sizes: int = 8, keep_free: int = 2, min_bytes: int = 256 * 1024) -> None:
        self.max_sizes, self.keep_free, self.min_bytes = max_sizes, keep_free, min_bytes
        self.lists: dict[int, list[np.ndarray]] = {}
        self.allocated = 0

    def __call__(self, n: int) -> np.ndarray:
        if n < self.min_bytes:
            return np.empty(n, np.uint8)
        bufs = self.lists.pop(n, None)
        if bufs is None:
            bufs = []
            while len(self.lists) >= self.max_sizes:
                del self.lists[next(iter(self.lists))]
        self.lists[n] = bufs  # the most recently asked for last
        found, free = None, 0
        for b in list(bufs):
            if sys.getrefcount(b) > self.UNSHARED + 1:  # + the list copy
                continue
            if found is None:
                found = b
            elif free < self.keep_free:
                free += 1
            else:  # more idle buffers of this size than kept: let it go (by identity: arrays compare by value)
                bufs[:] = [x for x in bufs if x is not b]
        if found is None:
            found = np.empty(n, np.uint8)
            bufs.append(found)
            self.allocated += 1
        return found


def _fresh_below(alloc: Alloc) -> int:
    """The sizes below which ``alloc`` gives a plain ``np.empty`` buffer (the sealer and opener then
    make it themselves: a call less a frame): a BufferPool's ``min_bytes``, every size for the
    default, none for any other allocator."""
    if type(alloc) is BufferPool:
        return alloc.min_bytes
    return 1 << 62 if alloc is _empty else 0


def _nbytes(f: Any) -> int:
    return f.nbytes if hasattr(f, "nbytes") else len(f)


def _view(f: Any) -> memoryview:
    """A received frame's bytes: ``bytes``, a numpy array or a buffer as they are, a ``zmq.Frame``'s buffer."""
    t = type(f)
    return memoryview(f) if t is bytes or t is np.ndarray or not hasattr(f, "buffer") else f.buffer


_helpers: Any = None  # the cipher's helper threads (a ThreadPoolExecutor), False for none
_helpers_pid = 0
_helpers_wanted: int | None = None  # set_cipher_threads: None, as many as the CPUs allow


def set_cipher_threads(n: int | None) -> None:
    """How many threads seal and open a large message's segments, the caller's included (None: as
    many as this process may run on, at most MAX_CIPHER_THREADS; 1: the caller alone)."""
    global _helpers, _helpers_wanted
    if n is not None and n < 1:
        raise ValueError("cipher threads must be at least 1")
    _helpers_wanted = n
    if _helpers:
        _helpers.shutdown(wait=False)
    _helpers = None


def cipher_threads() -> int:
    """The threads sealing and opening a large message in this process, the caller's included."""
    pool = _pool()
    return 1 + (pool._max_workers if pool else 0)


def threads_from_env() -> int | None:
    """``LATECOMER_CIPHER_THREADS``: how many threads seal and open (1: the caller alone); unset or
    empty: the default. Anything else is refused in one line."""
    raw = os.environ.get(CIPHER_THREADS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise ValueError(f"{CIPHER_THREADS_ENV}={raw!r}: expected an integer from 1 to 64")
    return int(raw)


def _pool() -> Any:
    global _helpers, _helpers_pid
    if _helpers is None or _helpers_pid != os.getpid():  # made in this process (not inherited by a fork)
        n = _helpers_wanted
        if n is None:
            n = threads_from_env()
        if n is None:
            n = min(MAX_CIPHER_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count() or 1)
        _helpers = ThreadPoolExecutor(n - 1, thread_name_prefix="latecomer-cipher") if n > 1 else False
        _helpers_pid = os.getpid()
    return _helpers


def _run(fn: Callable, tasks: list) -> bool:
    """``fn(nonce, data, aad, out)`` over ``tasks``; False if one did not authenticate."""
    try:
        for t in tasks:
            fn(*t)
    except InvalidTag:
        return False
    return True


def _spread(fn: Callable, tasks: list, nbytes: int, parallel_min: int = PARALLEL_MIN_BYTES) -> bool:
    """:func:`_run` over ``tasks``, shared with the helper threads when the message is large: the
    cipher lets go of the GIL, so the segments are sealed (opened) on several cores at once. The
    threads take the next segment from one iterator (``next`` on a list iterator is atomic under
    the GIL), so a helper that wakes late (an idle virtual CPU can take a tenth of a millisecond)
    takes fewer, and one that has not started when the caller ran out is cancelled rather than
    waited for. Returns only once no helper touches the buffers any more."""
    pool = _pool() if nbytes >= parallel_min and len(tasks) > 1 else False
    if not pool:
        return _run(fn, tasks)
    fn = getattr(fn.__self__, fn.__name__ + "_released", fn)  # AEGIS: the calls that let go of the GIL
    shared = iter(tasks)
    futures = [pool.submit(_run, fn, shared) for _ in range(min(pool._max_workers, len(tasks) - 1))]
    try:
        ok = _run(fn, shared)
    finally:
        # a helper still queued is cancelled; one that started is waited for (it may be mid-segment)
        ok = all([f.cancel() or f.result() for f in futures]) and ok
    return ok


def _segments(nbytes: int, log2: int) -> int:
    """How many segments a plain frame of ``nbytes`` is cut into (an empty frame: one)."""
    return max(1, -(-nbytes // (1 << log2)))


def sealed_frame_bytes(plain_bytes: int) -> int:
    """The most bytes a sealed frame of at most ``plain_bytes`` takes, whatever its format: a tag
    per segment of the smallest size a receiver takes (the bound a receiver sets on sealed frames)."""
    return plain_bytes + TAG_BYTES * _segments(plain_bytes, SEGMENT_LOG2_MIN)


# A frame of at least STREAM_MIN plain bytes that is one segment of an AEGIS message is sealed as it
# is written when the writer streams (Sealer.seal(streamed=True)): a chunk of STREAM_STEP bytes
# (a quarter of the frame, within these bounds, a multiple of AEGIS-256X4's 64-byte block) sealed,
# written, the next sealed while the peer reads and opens that one (benchmarks/PROFILE.md).
STREAM_MIN = 1 << 20
STREAM_STEP_MIN, STREAM_STEP_MAX = 256 << 10, 1 << 20
EARLY_STEP = 256 << 10  # the least an early open takes at a time (Opener.early)
EARLY_MIN = STREAM_MIN + 16  # the least sealed frame Opener.early opens (a ZMTP codec's progress_min)


def stream_step(n: int) -> int:
    """The chunk a frame of ``n`` plain bytes is sealed in when it is streamed."""
    return min(STREAM_STEP_MAX, max(STREAM_STEP_MIN, (n // 8) & ~63))


class Streamed(LazyBody):
    """A frame sealed a chunk at a time as its writer sends it (protocol/zmtp.py
    ``send_streamed``): the same bytes as the one-call seal (the cipher's incremental state), its
    tag made with its last chunk. Its source must not change until it is whole; the writers make
    it whole before their ``send`` returns."""

    __slots__ = ("buf", "dst", "src", "n", "ready", "state", "step")

    def __init__(self, aead: Any, nonce: bytes, src: Any, aad: bytes, buf: np.ndarray) -> None:
        self.buf = buf
        self.src = _ffi.from_buffer(src)
        self.dst = _ffi.from_buffer(buf, require_writable=True)
        self.n = len(self.src)
        if len(self.dst) != self.n + TAG_BYTES:
            raise ValueError(f"the output buffer must be {self.n + TAG_BYTES} bytes")
        self.state = aead.begin(nonce, aad)
        self.ready = 0
        self.step = stream_step(self.n)

    def __len__(self) -> int:
        return self.n + TAG_BYTES

    def more(self, upto: int | None = None) -> None:
        """Seal the next chunk (``upto``: everything to that byte), and the tag with the last."""
        lo, n = self.ready, self.n
        hi = min(n, lo + self.step if upto is None else upto)
        st, dst = _addr(self.state), _addr(self.dst)
        rc = _held.aegis256x4_state_encrypt_update(st, dst + lo, _addr(self.src) + lo, hi - lo) if hi > lo else 0
        if hi == n and rc == 0:
            rc = _held.aegis256x4_state_encrypt_final(st, dst + n, TAG_BYTES)
            hi = n + TAG_BYTES
        if rc != 0:
            raise ValueError("AEGIS-256X4 refused to seal")
        self.ready = hi

    def finish(self) -> memoryview:
        if self.ready < self.n + TAG_BYTES:
            self.more(self.n)
        self.src = None  # the source may change from now on
        return memoryview(self.buf)

    def view(self, lo: int, hi: int) -> memoryview:
        return memoryview(self.buf)[lo:hi]


class Sealer:
    """One direction's sending side: seals the frames of a message under its key, whole or (when
    the peer opens them, ``segments``) in segments. ``alloc`` gives the sealed frames' buffers (a
    pool of warm ones: fresh large ones cost page faults that outweigh the cipher)."""

    __slots__ = ("aead", "direction", "counter", "sealed_bytes", "alloc", "segments", "cipher", "parallel_min",
                 "fresh_below", "lazy", "stream_min", "streamed")

    def __init__(self, key: bytes, direction: bytes, alloc: Alloc = _empty, segments: bool = False,
                 cipher: str = GCM) -> None:
        self.alloc = alloc
        self.fresh_below = _fresh_below(alloc)
        self.aead = make_aead(cipher, key)
        self.cipher, self.parallel_min = cipher, PARALLEL_MIN[cipher]
        self.direction = direction
        self.counter = 0
        self.sealed_bytes = 0
        self.segments = segments
        self.lazy = 0  # frames the last seal left to be sealed as they are written (Streamed)
        self.streamed = 0  # such frames, ever
        # streamed frames: AEGIS's (its incremental calls), from STREAM_MIN plain bytes
        self.stream_min = STREAM_MIN if hasattr(self.aead, "begin") else _NONCES

    def seal(self, frames: list, streamed: bool = False) -> list:
        """``frames`` sealed: the prefix, then each frame's buffer. ``streamed`` (a writer that
        calls protocol/zmtp.py ``send_streamed``): a large frame that is one segment comes as a
        :class:`Streamed`, sealed as it is written (:attr:`lazy` counts them)."""
        self.lazy = 0
        n = len(frames)
        if not 0 < n <= MAX_FRAMES:
            raise ValueError(f"a sealed message has 1..{MAX_FRAMES} frames, got {n}")
        sizes = [len(f) if type(f) is bytes else f.nbytes if type(f) is np.ndarray else _nbytes(f) for f in frames]
        if self.segments:
            total = sum(sizes)
            if total < self.parallel_min and max(sizes) <= 1 << SEGMENT_LOG2:  # every job and reply below 2 MiB
                # (AEGIS: 8 MiB): a segment a frame of 2^SEGMENT_LOG2 bytes (_segment_log2's answer for such frames)
                return self._seal_each(frames, sizes, _PREFIX_SEGMENTS.pack(self.counter, n, SEGMENT_LOG2), total,
                                       True, streamed)
            return self._seal_segments(frames, sizes, streamed)
        return self._seal_each(frames, sizes, _PREFIX.pack(self.counter, n), sum(sizes), False, streamed)

    def _segment_log2(self, sizes: list, total: int) -> int:
        """The segments' size for this message: 1 MiB, except where the peer opens in place (AEGIS)
        and no helper thread would share the work (under the cipher's PARALLEL_MIN): then each frame
        is one segment, which the receiver opens over itself where its read left it, rather than
        into another buffer (a 4 MB frame cut in four cannot be: the tags between the segments
        shift each plaintext). The receiver reads the size from the prefix."""
        if not getattr(self.aead, "in_place", False) or total >= self.parallel_min:
            return SEGMENT_LOG2
        return min(SEGMENT_LOG2_MAX, max(SEGMENT_LOG2, (max(sizes) - 1).bit_length()))

    def _seal_segments(self, frames: list, sizes: list, streamed: bool = False) -> list:
        total = sum(sizes)
        c, n, p = self.counter, len(frames), self._segment_log2(sizes, total)
        seg = 1 << p
        prefix = _PREFIX_SEGMENTS.pack(c, n, p)
        if total < self.parallel_min and max(sizes) <= seg:
            return self._seal_each(frames, sizes, prefix, total, True, streamed)
        out: list = [prefix]
        tasks, d, g, total = [], self.direction, c, 0
        aad = _SEGMENT_AAD.pack
        for i, f in enumerate(frames):
            src = memoryview(f) if type(f) is bytes else memoryview(f).cast("B")
            size = src.nbytes
            m = _segments(size, p)
            buf = self.alloc(size + m * TAG_BYTES)
            dst = memoryview(buf)
            for j in range(m):
                lo = j * seg
                part = src[lo:lo + seg]
                at = j * (seg + TAG_BYTES)
                tasks.append((d + g.to_bytes(8, "big"), part, prefix + aad(i, j, m),
                              dst[at:at + part.nbytes + TAG_BYTES]))
                g += 1
            out.append(buf)
            total += size
        _spread(self.aead.encrypt_into, tasks, total, self.parallel_min)
        self.sealed_bytes += total
        self.counter = g
        return out

    def _seal_each(self, frames: list, sizes: list, prefix: bytes, total: int, segments: bool = True,
                   streamed: bool = False) -> list:
        """One cipher call a frame on this thread: the whole format (``segments`` False: the AAD is
        the prefix), or :meth:`_seal_segments` where each frame is one segment and no helper
        thread shares the message (every job and reply under 2 MiB, and under AEGIS under 8 MiB):
        the same bytes, without the segment bookkeeping. ``streamed``: frames from
        :attr:`stream_min` bytes as :class:`Streamed`."""
        out: list = [prefix]
        seal, d, alloc, aad, g = self.aead.encrypt_into, self.direction, self.alloc, _SEGMENT_AAD.pack, self.counter
        fresh, lazy = self.fresh_below, self.stream_min if streamed else _NONCES
        for i, f in enumerate(frames):
            k = sizes[i] + TAG_BYTES
            buf = np.empty(k, np.uint8) if k < fresh else alloc(k)
            src = f if type(f) is bytes else memoryview(f).cast("B")
            if sizes[i] >= lazy:
                out.append(Streamed(self.aead, d + g.to_bytes(8, "big"), src,
                                    prefix + aad(i, 0, 1) if segments else prefix, buf))
                self.lazy += 1
                self.streamed += 1
                g += 1
                continue
            seal(d + g.to_bytes(8, "big"), src, prefix + aad(i, 0, 1) if segments else prefix, buf)
            out.append(buf)
            g += 1
        self.sealed_bytes += total
        self.counter = g
        return out


class OpenFrame(np.ndarray):
    """A frame opened by :meth:`Opener.open`: a uint8 array with ``zmq.Frame``'s ``bytes`` and
    ``get`` (the properties of the authenticated connection it stands for, ``props``)."""

    props: dict = {}

    @property
    def bytes(self) -> bytes:
        return self.tobytes()

    def get(self, name: str) -> str:
        return self.props[name]


class _Early:
    """A frame opened while it arrives (:meth:`Opener.early`): where it lies, the message it is
    part of, how far it is opened, and (once whole) whether its tag held."""

    __slots__ = ("buf", "ptr", "state", "prefix", "c", "i", "n", "done", "ok", "ref")

    def __init__(self, buf: np.ndarray, state: Any, prefix: bytes, c: int, i: int) -> None:
        self.buf, self.ptr, self.state = buf, _ffi.from_buffer(buf, require_writable=True), state
        self.ref: Any = None  # once whole: a weak reference to buf (a verdict holds no buffer alive)
        self.prefix, self.c, self.i, self.n = prefix, c, i, buf.nbytes - TAG_BYTES
        self.done = 0
        self.ok: bool | None = None  # None until the frame is whole


MAX_EARLY = 64  # frames opened early and not yet taken by open (beyond: the oldest is refused)


class Opener:
    """One direction's receiving side: opens a sealed message's frames, in order, whole or in
    segments (the prefix says which)."""

    __slots__ = ("aead", "direction", "next", "opened_bytes", "props", "alloc", "sizes", "segmented", "cipher",
                 "parallel_min", "in_place", "opened_in_place", "fresh_below", "current", "verdicts", "opened_early")

    def __init__(self, key: bytes, direction: bytes, props: dict | None = None, alloc: Alloc = _empty,
                 cipher: str = GCM) -> None:
        # A frame is opened into a buffer before it is known to be genuine: ``alloc`` (warm
        # buffers, kept) only for sizes a genuine frame of this session had, else a fresh one
        # (let go): forged frames of new sizes never make the pool keep anything.
        self.alloc = alloc
        self.fresh_below = _fresh_below(alloc)
        self.sizes: dict[int, None] = {}  # sizes of frames that opened (at most MAX_SIZES, the latest)
        self.aead = make_aead(cipher, key)
        self.cipher, self.parallel_min = cipher, PARALLEL_MIN[cipher]
        self.direction = direction
        self.next = 0  # the least counter the next message may have
        self.opened_bytes = 0
        self.segmented = 0  # messages that came in segments
        self.props = props or {}  # what OpenFrame.get answers (the CURVE connection's User-Id)
        # Set by an owner whose large frames are buffers of its own, read once (the daemon's handed
        # connections, the worker's data connection): a frame of one segment in a writable uint8
        # array is then opened where it lies, its plaintext a view of it, when the cipher can
        # (AEGIS: libaegis opens in place). The buffer was just filled by the read, so the pass
        # stays in the cache, where a fresh destination costs a trip to memory: in place, a
        # 400 KB frame opened in 20 µs against 50-70 in another buffer (benchmarks/PROFILE.md).
        self.in_place = False
        self.opened_in_place = 0  # frames opened so
        self.current: _Early | None = None  # the frame being opened as it arrives (early)
        self.verdicts: dict[int, _Early] = {}  # frames opened as they arrived, whole, by id (until open takes them)
        self.opened_early = 0  # frames open takes so

    def early(self, parts: list, big: Any, filled: int, first: bool) -> None:
        """protocol/zmtp.py ``Connection.progress``: open a large frame where it lies while the rest
        of it arrives (its sender seals it as it writes it, :class:`Streamed`), so that the two
        ends' cipher passes overlap. Only a frame that is one AEGIS segment of a message in
        segments, in a buffer of the owner's (:attr:`in_place`), at least STREAM_MIN bytes, whose
        counter may still be taken. Once whole, its tag is checked here; :meth:`open` then takes
        the verdict (and refuses the message if it failed or was lost). Never raises."""
        e = self.current
        if first:
            e = self.current = self._early_begin(parts, big)
        if e is None or e.buf is not big:
            return
        n, done = e.n, e.done
        upto = min(filled, n)
        if upto < n:
            upto &= ~63  # whole blocks while more comes
            if upto - done < EARLY_STEP:
                return
        base = _addr(e.ptr)
        rc = _held.aegis256x4_state_decrypt_update(_addr(e.state), base + done, base + done, upto - done) \
            if upto > done else 0
        e.done = upto
        if rc == 0 and filled < n + TAG_BYTES:
            return
        self.current = None
        e.ok = rc == 0 and _held.aegis256x4_state_decrypt_final(_addr(e.state), base + n, TAG_BYTES) == 0
        if not e.ok:
            big[:e.done] = 0  # what a forged frame opened to is not left in the buffer
        e.ref, e.buf, e.ptr, e.state = weakref.ref(big), None, None, None
        verdicts = self.verdicts
        verdicts[id(big)] = e
        if len(verdicts) > MAX_EARLY:
            del verdicts[next(iter(verdicts))]  # its message is refused (its frame is opened in place, not sealed)

    def _early_begin(self, parts: list, big: Any) -> _Early | None:
        if not (self.in_place and parts and type(big) is np.ndarray and hasattr(self.aead, "begin")
                and big.dtype == np.uint8 and big.ndim == 1 and big.flags.writeable and big.flags.c_contiguous):
            return None
        f0 = parts[0]
        prefix = f0 if type(f0) is bytes else bytes(f0)
        if len(prefix) != _PREFIX_SEGMENTS.size:
            return None
        c, count, p = _PREFIX_SEGMENTS.unpack(prefix)
        i, size = len(parts) - 1, big.nbytes
        if (i >= count or c < self.next or not SEGMENT_LOG2_MIN <= p <= SEGMENT_LOG2_MAX
                or size < EARLY_MIN or size > (1 << p) + TAG_BYTES):
            return None
        g, step = c, (1 << p) + TAG_BYTES  # its nonce: after the segments of the frames before it
        for f in parts[1:]:
            g += max(1, -(-memoryview(f).nbytes // step))
        if g >= _NONCES:
            return None
        aad = prefix + _SEGMENT_AAD.pack(i, 0, 1)
        return _Early(big, self.aead.begin(self.direction + g.to_bytes(8, "big"), aad), prefix, c, i)

    def _own(self, f: Any, size: int) -> np.ndarray | None:
        """``f``'s first ``size`` bytes as the opened frame, if it may be opened in place (see in_place)."""
        if (self.in_place and type(f) is np.ndarray and f.dtype == np.uint8 and f.ndim == 1 and f.flags.writeable
                and f.flags.c_contiguous and getattr(self.aead, "in_place", False)):
            out = f[:size].view(OpenFrame)
            out.props = self.props
            self.opened_in_place += 1
            return out
        return None

    def _take_early(self, f: Any, prefix: bytes, c: int, i: int, size: int) -> np.ndarray | None:
        """Frame ``i`` as :meth:`early` opened it (None: it did not); SealError if its tag failed,
        or it was opened as part of another message."""
        e = self.verdicts.pop(id(f), None)
        if e is None or e.ref() is not f:
            return None
        if not (e.ok and e.prefix == prefix and e.c == c and e.i == i and e.n == size):
            raise SealError("a segment of a sealed message does not authenticate")
        out = f[:size].view(OpenFrame)
        out.props = self.props
        self.opened_in_place += 1
        self.opened_early += 1
        return out

    def _frame(self, size: int) -> np.ndarray:
        """A fresh frame of ``size`` bytes: from ``alloc`` only for a size a genuine frame had, and
        only where ``alloc`` would not give a plain ``np.empty`` anyway (``fresh_below``)."""
        fresh = size < self.fresh_below or size not in self.sizes
        out = (np.empty(size, np.uint8) if fresh else self.alloc(size)).view(OpenFrame)
        out.props = self.props
        return out

    def open(self, frames: list) -> list:
        """The plain frames of ``frames`` (the prefix, then the sealed frames); SealError if
        it does not open whole. Nothing changes when it raises."""
        if len(frames) < 2:
            raise SealError("a sealed message has a prefix and at least one frame")
        f0 = frames[0]
        prefix = f0 if type(f0) is bytes else f0.bytes if hasattr(f0, "bytes") else bytes(f0)
        if len(prefix) == _PREFIX_SEGMENTS.size:
            c, n, p = _PREFIX_SEGMENTS.unpack(prefix)
        elif len(prefix) == _PREFIX.size:
            (c, n), p = _PREFIX.unpack(prefix), None
        else:
            raise SealError(f"a sealed message's prefix has {_PREFIX.size} or {_PREFIX_SEGMENTS.size} bytes, "
                            f"got {len(prefix)}")
        if n != len(frames) - 1:
            raise SealError(f"the prefix names {n} frames, the message has {len(frames) - 1}")
        if c < self.next:
            raise SealError(f"message counter {c}: a repeat or out of order (next at least {self.next})")
        try:
            if p is None:
                opened, end = self._open_whole(frames, prefix, c, n)
            else:
                opened, end = self._open_segments(frames, prefix, c, p)
                self.segmented += 1
        finally:
            if self.verdicts:  # what early opened of this message is taken (or refused) with it
                for f in frames:
                    self.verdicts.pop(id(f), None)
        self.next = end
        sizes = self.sizes
        for f in opened:
            size = f.nbytes
            self.opened_bytes += size
            if size not in sizes:
                sizes[size] = None
                if len(sizes) > MAX_SIZES:
                    del sizes[next(iter(sizes))]
        return opened

    def _open_whole(self, frames: list, prefix: bytes, c: int, n: int) -> tuple[list, int]:
        bufs = [_view(f) for f in frames[1:]]
        return self._open_each(frames, bufs, [b.nbytes for b in bufs], prefix, c, segments=False)

    def _open_segments(self, frames: list, prefix: bytes, c: int, p: int) -> tuple[list, int]:
        if not SEGMENT_LOG2_MIN <= p <= SEGMENT_LOG2_MAX:
            raise SealError(f"segments of 2^{p} bytes: a receiver takes 2^{SEGMENT_LOG2_MIN} to 2^{SEGMENT_LOG2_MAX}")
        seg = 1 << p
        step = seg + TAG_BYTES
        bufs, lengths, total, fits = [], [], 0, True
        for f in frames[1:]:
            t = type(f)
            b = memoryview(f) if t is bytes or t is np.ndarray else _view(f)
            k = b.nbytes
            bufs.append(b)
            lengths.append(k)
            total += k
            fits = fits and k <= step
        if fits and total < self.parallel_min:
            return self._open_each(frames, bufs, lengths, prefix, c)
        opened, tasks, d, g, total = [], [], self.direction, c, 0
        aad = _SEGMENT_AAD.pack
        for i, f in enumerate(frames[1:]):
            buf = bufs[i]
            if buf.ndim != 1 or buf.itemsize != 1:
                buf = buf.cast("B")
            sealed = buf.nbytes
            m = max(1, -(-sealed // step))
            if sealed - (m - 1) * step < TAG_BYTES:
                raise SealError(f"frame {i} of a sealed message: a segment shorter than its tag")
            size = sealed - m * TAG_BYTES
            if g + m > _NONCES:
                raise SealError(f"message counter {c}: past the last nonce")
            out = None
            if m == 1:  # one segment: its plaintext starts where it does
                out = self._take_early(f, prefix, c, i, size) if self.verdicts else None
                if out is not None:
                    opened.append(out)
                    total += size
                    g += 1
                    continue
                out = self._own(f, size)
            if out is None:
                out = self._frame(size)
            dst = memoryview(out).cast("B") if size else memoryview(out)
            for j in range(m):
                at = j * step
                part = buf[at:at + step]
                lo = j * seg
                tasks.append((d + g.to_bytes(8, "big"), part, prefix + aad(i, j, m),
                              dst[lo:lo + part.nbytes - TAG_BYTES]))
                g += 1
            opened.append(out)
            total += size
        if not _spread(self.aead.decrypt_into, tasks, total, self.parallel_min):
            raise SealError("a segment of a sealed message does not authenticate")
        return opened, g

    def _open_each(self, frames: list, bufs: list, sealed: list, prefix: bytes, c: int,
                   segments: bool = True) -> tuple[list, int]:
        """One cipher call a frame on this thread: the whole format (``segments`` False: the AAD
        is the prefix), or :meth:`_open_segments` where each frame is one segment and no helper
        thread shares the message, with that path's checks and errors."""
        n = len(bufs)
        if c + n > _NONCES:
            raise SealError(f"message counter {c}: past the last nonce")
        if min(sealed) < TAG_BYTES:
            i = next(i for i, size in enumerate(sealed) if size < TAG_BYTES)
            raise SealError(f"frame {i} of a sealed message: a segment shorter than its tag" if segments
                            else "a sealed frame shorter than its tag")
        opened, d, aad, dec = [], self.direction, _SEGMENT_AAD.pack, self.aead.decrypt_into
        own = self.in_place and getattr(self.aead, "in_place", False)  # else _own answers None
        early = self.verdicts
        for i, f in enumerate(frames[1:]):
            buf = bufs[i]
            size = sealed[i] - TAG_BYTES
            if early and segments:
                out = self._take_early(f, prefix, c, i, size)
                if out is not None:
                    opened.append(out)
                    continue
            out = self._own(f, size) if own and type(f) is np.ndarray else None
            if out is None:
                out = self._frame(size)
            try:
                dec(d + (c + i).to_bytes(8, "big"), buf if buf.ndim == 1 and buf.itemsize == 1 else buf.cast("B"),
                    prefix + aad(i, 0, 1) if segments else prefix, out)
            except InvalidTag:
                raise SealError("a segment of a sealed message does not authenticate" if segments
                                else f"frame {i} of a sealed message does not authenticate") from None
            opened.append(out)
        return opened, c + n


def sealer_opener(session: Session, *, server: bool, props: dict | None = None,
                  alloc: Alloc = _empty, segments: bool = False, cipher: str = GCM) -> tuple[Sealer, Opener]:
    """The two halves of a session for one end: the server seals down and opens up. ``segments``:
    the peer opens messages sealed in segments (it said so: ``seal_segments``); ``cipher``: the
    session's (welcome.seal_cipher)."""
    if server:
        return (Sealer(session.down, DOWN, alloc, segments, cipher),
                Opener(session.up, UP, props, alloc, cipher))
    return Sealer(session.up, UP, alloc, segments, cipher), Opener(session.down, DOWN, props, alloc, cipher)
