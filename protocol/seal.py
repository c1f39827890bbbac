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

A sealed message is its frames, each sealed, after a clear prefix frame::

    prefix  = counter (u64, big-endian) | frame count n (u16)
    frame i = AES-256-GCM(key, nonce = direction (4 bytes) | counter + i (u64), aad = prefix)(plain frame i)

The counter counts frames: the sender's next message starts where the last one ended, so no
nonce is used twice under a key. The receiver takes a message only if its counter is at least
the one after the last message it took and every frame opens: a repeat (a replay), an older
message, a frame moved or cut, a changed prefix or a message under another key is refused
whole, before any of it is decoded. A gap (messages lost with a dropped connection) is allowed:
the protocol tolerates lost messages, and nothing lost can come back afterwards.

Pure: no sockets. The daemon (ps/net/sealed.py) and the worker (worker/link.py) hold one
:class:`Sealer` and one :class:`Opener` per session.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
from typing import Any, Callable, NamedTuple

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from protocol.errors import RemoteProtocolError
from protocol.messages import SEAL_SESSION_BYTES

KEY_BYTES = 32  # AES-256
TAG_BYTES = 16  # the GCM tag each sealed frame ends with
TOKEN_BYTES = 32  # the data connection's routing id: "S", 15 random bytes, 16 bytes of MAC
SECRET_BYTES = 32  # the front's and the daemon's shared secret for tokens
SESSION_BYTES = SEAL_SESSION_BYTES  # Welcome.seal: key up, key down, token (2 x KEY_BYTES + TOKEN_BYTES)
UP, DOWN = b"up\x00\x00", b"dn\x00\x00"  # nonce prefixes: worker -> server, server -> worker
_PREFIX = struct.Struct(">QH")
MAX_FRAMES = 0xFFFF
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


def _nbytes(f: Any) -> int:
    return f.nbytes if hasattr(f, "nbytes") else len(f)


class Sealer:
    """One direction's sending side: seals the frames of a message under its key. ``alloc``
    gives the sealed frames' buffers (a pool of warm ones: fresh large ones cost page faults
    that outweigh the cipher)."""

    __slots__ = ("aead", "direction", "counter", "sealed_bytes", "alloc")

    def __init__(self, key: bytes, direction: bytes, alloc: Alloc = _empty) -> None:
        self.alloc = alloc
        self.aead = AESGCM(key)
        self.direction = direction
        self.counter = 0
        self.sealed_bytes = 0

    def seal(self, frames: list) -> list:
        n = len(frames)
        if not 0 < n <= MAX_FRAMES:
            raise ValueError(f"a sealed message has 1..{MAX_FRAMES} frames, got {n}")
        c = self.counter
        prefix = _PREFIX.pack(c, n)
        out: list = [prefix]
        seal, d = self.aead.encrypt_into, self.direction
        for i, f in enumerate(frames):
            size = _nbytes(f)
            buf = self.alloc(size + TAG_BYTES)
            seal(d + (c + i).to_bytes(8, "big"), f if type(f) is bytes else memoryview(f).cast("B"), prefix, buf)
            out.append(buf)
            self.sealed_bytes += size
        self.counter = c + n
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


class Opener:
    """One direction's receiving side: opens a sealed message's frames, in order."""

    __slots__ = ("aead", "direction", "next", "opened_bytes", "props", "alloc", "sizes")

    def __init__(self, key: bytes, direction: bytes, props: dict | None = None, alloc: Alloc = _empty) -> None:
        # A frame is opened into a buffer before it is known to be genuine: ``alloc`` (warm
        # buffers, kept) only for sizes a genuine frame of this session had, else a fresh one
        # (let go): forged frames of new sizes never make the pool keep anything.
        self.alloc = alloc
        self.sizes: dict[int, None] = {}  # sizes of frames that opened (at most MAX_SIZES, the latest)
        self.aead = AESGCM(key)
        self.direction = direction
        self.next = 0  # the least counter the next message may have
        self.opened_bytes = 0
        self.props = props or {}  # what OpenFrame.get answers (the CURVE connection's User-Id)

    def open(self, frames: list) -> list:
        """The plain frames of ``frames`` (the prefix, then the sealed frames); SealError if
        it does not open whole. Nothing changes when it raises."""
        if len(frames) < 2:
            raise SealError("a sealed message has a prefix and at least one frame")
        prefix = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
        if len(prefix) != _PREFIX.size:
            raise SealError(f"a sealed message's prefix has {_PREFIX.size} bytes, got {len(prefix)}")
        c, n = _PREFIX.unpack(prefix)
        if n != len(frames) - 1:
            raise SealError(f"the prefix names {n} frames, the message has {len(frames) - 1}")
        if c < self.next:
            raise SealError(f"message counter {c}: a repeat or out of order (next at least {self.next})")
        opened, total = [], 0
        dec, d = self.aead.decrypt_into, self.direction
        for i, f in enumerate(frames[1:]):
            buf = f.buffer if hasattr(f, "buffer") else memoryview(f)
            size = buf.nbytes - TAG_BYTES
            if size < 0:
                raise SealError("a sealed frame shorter than its tag")
            out = (self.alloc if size in self.sizes else _empty)(size).view(OpenFrame)
            out.props = self.props
            try:
                dec(d + (c + i).to_bytes(8, "big"), buf, prefix, out)
            except InvalidTag:
                raise SealError(f"frame {i} of a sealed message does not authenticate") from None
            opened.append(out)
            total += size
        self.next = c + n
        self.opened_bytes += total
        for f in opened:
            if f.nbytes not in self.sizes:
                self.sizes[f.nbytes] = None
                if len(self.sizes) > MAX_SIZES:
                    del self.sizes[next(iter(self.sizes))]
        return opened


def sealer_opener(session: Session, *, server: bool, props: dict | None = None,
                  alloc: Alloc = _empty) -> tuple[Sealer, Opener]:
    """The two halves of a session for one end: the server seals down and opens up."""
    if server:
        return Sealer(session.down, DOWN, alloc), Opener(session.up, UP, props, alloc)
    return Sealer(session.up, UP, alloc), Opener(session.down, DOWN, props, alloc)
