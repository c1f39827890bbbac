"""The daemon's sealed data path (PROTOCOL.md §6.15): a NULL-mechanism ROUTER beside the CURVE one.

Under CurveZMQ a supervised daemon (its front routes a connection by its greeting's mechanism,
ps/net/front.py) binds a second, private ROUTER. A worker whose hello asked for it gets a
session in its ``welcome`` (keys and a token, protocol/seal.py): the front lets a NULL
connection through to this socket only if its routing id is a token the daemon made (an HMAC
under the secret the two share), and this side opens a message only under the session of
that token, from the counter on. What opens is handed to the transport as if it had come
over the worker's CURVE connection (its routing id first, its frames carrying the key CURVE
authenticated), so the core, the journal and the replay see exactly what they saw before.

Once a worker's first sealed message came, every message to it goes sealed on its data
connection; when that connection is gone (``EHOSTUNREACH``), a message goes over CURVE, which
the worker reads as well, until its next sealed message comes.

With the hand-over (``serve --hand-over auto``, ps/net/handover.py) the front does not relay a
data connection whose token checked out: it hands the connection itself to the daemon, which
reads and writes it (``handed``, its routing id the token) with no ROUTER and no relay between;
what comes on it is opened here exactly as what comes on the ROUTER (:meth:`SealedPath.opened`).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
from typing import Any, Iterator

import zmq

from protocol.chunks import chunking
from protocol.errors import RemoteProtocolError
from protocol.seal import (
    DOWN,
    EARLY_MIN,
    GCM,
    SECRET_BYTES,
    UP,
    BufferPool,
    Opener,
    OpenFrame,
    Sealer,
    SealError,
    Session,
    choose_cipher,
    make_token,
    sealed_frame_bytes,
)
from ps.net.connections import RateLimitedLog
from worker.sockio import recv_frames, send_frames

log = logging.getLogger("latecomer.server")
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
SECRET_FILE = "seal.secret"  # in the supervisor's private directory (mode 0700), mode 0600
ENDED_KEPT = 4096  # the ended sessions' tokens kept to tell a late message from a refused one (32 bytes each)


class RidFrame(bytes):
    """The CURVE connection's routing id, standing first in an opened message's frames."""

    @property
    def bytes(self) -> bytes:
        return bytes(self)


class _Session:
    __slots__ = ("rid", "token", "sealer", "opener", "bound", "rid_frame", "handed")

    def __init__(self, rid: bytes, session: Session, key: str, alloc: Any, segments: bool = False,
                 cipher: str = GCM) -> None:
        self.rid, self.token = rid, session.token
        self.sealer = Sealer(session.down, DOWN, alloc, segments, cipher)
        self.opener = Opener(session.up, UP, {"key": key}, alloc, cipher)
        self.opener.in_place = True  # a handed connection's large frames are the daemon's own buffers, read once
        self.bound = False  # a sealed message came on the data connection: send there
        self.rid_frame = RidFrame(rid)
        self.handed = False  # its data connection is one the daemon was handed (else the ROUTER's)


def secret_path(endpoint: str) -> str:
    """The shared secret's file beside a private ``ipc://`` endpoint."""
    return os.path.join(os.path.dirname(endpoint.removeprefix("ipc://")), SECRET_FILE)


def write_secret(directory: str) -> bytes:
    """A fresh secret for the tokens of one daemon (the supervisor's, at each start)."""
    secret = os.urandom(SECRET_BYTES)
    path = os.path.join(directory, SECRET_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    return secret


def attach(transport: Any, endpoint: str, secret: bytes, ciphers: tuple[str, ...] = (GCM,)) -> None:
    """Under CurveZMQ, behind the front: bind the daemon transport's sealed data path at the private
    ``endpoint``; workers whose hello asks get a session in their welcome (ServerTransport.send),
    under the first of ``ciphers`` (``serve --seal-cipher``) their hello can use."""
    if transport.security is None or transport.sealed is not None:
        return
    sock = transport.sock
    transport.sealed = path = SealedPath(sock.context, endpoint, secret, sock.getsockopt(zmq.MAXMSGSIZE),
                                         sock.rcvhwm, transport.clock, ciphers)
    transport.conns.on_unbind = path.forget


class SealedPath:
    """The data ROUTER and the sessions (at most one per CURVE connection that said hello)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, secret: bytes, max_frame_bytes: int, hwm: int,
                 clock: Any, ciphers: tuple[str, ...] = (GCM,)) -> None:
        self.secret, self.clock = secret, clock
        self.ciphers = ciphers  # what sessions may use, the first a worker can use taken (serve --seal-cipher)
        self.by_cipher: dict[str, int] = {}  # sessions offered, per cipher (status, summary.json)
        self.pool = BufferPool()  # warm buffers for what is sealed and opened (reused once unreferenced)
        self.chunking = chunking(False)  # what goes sealed is split as plaintext is
        s = ctx.socket(zmq.ROUTER)
        s.linger = 0
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker's reconnected data connection takes its token over
        s.setsockopt(zmq.MAXMSGSIZE, sealed_frame_bytes(max_frame_bytes) + 64)  # a sealed frame: plain bytes, tags
        s.sndhwm, s.rcvhwm = hwm, hwm
        s.bind(endpoint)
        self.sock = s
        self.endpoint = endpoint
        self.by_token: dict[bytes, _Session] = {}
        self.by_rid: dict[bytes, _Session] = {}
        self.messages_in = self.messages_out = self.refused = self.fallbacks = 0
        # the tokens of the sessions that ended lately (their worker said hello again, or left), so
        # that a message still on its way under one is told apart from a refused one (:meth:`_open`)
        self.ended: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.stale = 0
        self.refusals = RateLimitedLog(log)
        self.handed: Any = None  # the data connections the front hands over (ps/net/handover.py), if any

    def offer(self, rid: bytes, key: str, segments: bool = False, offered: tuple[str, ...] = (),
              array_bytes: int | None = None) -> tuple[str, str]:
        """A new session for the CURVE connection ``rid`` (its key's fingerprint ``key``), replacing
        any it had; returns Welcome.seal and the session's cipher (("", ""): none, when the worker
        can use none of ``ciphers``: it stays on CurveZMQ). ``segments``: its worker opens sealed
        frames in segments (hello.seal_segments), so large ones go that way (sealed on several
        threads); ``offered``: the ciphers besides AES-256-GCM it can seal with (hello.seal_ciphers);
        ``array_bytes``: an iterate's bytes on the wire (small ones: AES-256-GCM, :func:`choose_cipher`)."""
        self.forget(rid)
        cipher = choose_cipher(offered, self.ciphers, array_bytes)
        if cipher is None:
            return "", ""
        session = Session.new(make_token(self.secret))
        self.by_rid[rid] = self.by_token[session.token] = _Session(rid, session, key, self.pool, segments, cipher)
        self.by_cipher[cipher] = self.by_cipher.get(cipher, 0) + 1
        return session.pack().hex(), cipher

    def forget(self, rid: bytes) -> None:
        """The connection's worker is gone or said hello again: its session ends."""
        s = self.by_rid.pop(rid, None)
        if s is not None:
            self.by_token.pop(s.token, None)
            self.ended[s.token] = None
            if len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)

    def pending(self, wait: Any = None) -> Iterator[list]:
        """The data socket's messages that open, as the CURVE connection's (its routing id, then
        the plain frames); the others are counted and dropped. ``wait``: the daemon loop's
        (ps/net/loopwait.py), which may know the socket holds nothing."""
        sock = self.sock
        if wait is not None and wait.take_quiet(sock) or not sock.get(_EVENTS) & _POLLIN:
            return
        while True:
            try:
                frames = recv_frames(sock, _NOBLOCK)
            except zmq.Again:
                return
            opened = self._open(frames, False)
            if opened is not None:
                yield opened

    def opened(self, messages: Iterator[list]) -> Iterator[list]:
        """The messages of the handed data connections (each its token, then the sealed frames)
        that open, as :meth:`pending`'s."""
        for frames in messages:
            opened = self._open(frames, True)
            if opened is not None:
                yield opened

    def _open(self, frames: list, handed: bool) -> list | None:
        token = frames[0].bytes
        s = self.by_token.get(token)
        if s is None:  # no session to open it with
            if token in self.ended:  # one that ended while the message was on its way:
                self.stale += 1  # sent before its worker's new hello, read after it (two connections)
            else:
                self.refused += 1
            return None
        try:
            opened = s.opener.open(frames[1:])
        except RemoteProtocolError as e:
            self.refused += 1
            self.refusals.warning("sealed", self.clock(), "refused a sealed message: %s", e)
            return None
        s.bound, s.handed = True, handed
        if handed:  # its next large frames opened as they arrive (Opener.early)
            h = self.handed.by_rid.get(token) if self.handed is not None else None
            if h is not None and h.codec.progress is None:
                h.codec.progress, h.codec.progress_min = s.opener.early, EARLY_MIN
        self.messages_in += 1
        return [s.rid_frame, *opened]

    def live_token(self, token: bytes, live: Any) -> bool:
        """Whether ``token`` is the data connection of a session whose CURVE connection ``live`` says is live."""
        s = self.by_token.get(token)
        return s is not None and live(s.rid)

    def is_bound(self, rid: bytes) -> bool:
        s = self.by_rid.get(rid)
        return s is not None and s.bound

    def send(self, rid: bytes, frames: list) -> bool | None:
        """Send ``frames`` sealed to the worker of CURVE connection ``rid``: True sent, False its
        pipe is full, None not bound (the caller sends over CURVE)."""
        s = self.by_rid.get(rid)
        if s is None or not s.bound:
            return None
        if s.handed:
            handed = self.handed
            if handed is not None:  # large AEGIS frames sealed as they are written (zmtp.send_streamed)
                sealed = s.sealer.seal(frames, streamed=True)
                sent = handed.send(s.token, sealed, s.sealer.lazy > 0)
            else:
                sent = None
            if sent is None or s.token not in handed.by_rid:  # its data connection is gone (or went
                # as this was sent): CURVE until the next sealed message
                s.bound = False
                self.fallbacks += 1
                return None
            self.messages_out += sent
            return sent
        try:
            send_frames(self.sock, [s.token, *s.sealer.seal(frames)], _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            s.bound = False  # its data connection is gone: CURVE until the next sealed message
            self.fallbacks += 1
            return None
        self.messages_out += 1
        return True

    def figures(self) -> dict[str, Any]:
        sealed = sum(s.sealer.sealed_bytes for s in self.by_rid.values())
        opened = sum(s.opener.opened_bytes for s in self.by_rid.values())
        return {"sealed_sessions": len(self.by_rid),
                "sealed_sessions_in_segments": sum(s.sealer.segments for s in self.by_rid.values()),
                "sealed_segmented_live_in": sum(s.opener.segmented for s in self.by_rid.values()),
                "sealed_in_place_live_in": sum(s.opener.opened_in_place for s in self.by_rid.values()),
                # large frames sealed as they were written, and opened as they arrived (protocol/seal.py)
                "sealed_streamed_live_out": sum(s.sealer.streamed for s in self.by_rid.values()),
                "sealed_early_live_in": sum(s.opener.opened_early for s in self.by_rid.values()),
                "sealed_messages_in": self.messages_in,
                "sealed_messages_out": self.messages_out, "sealed_refused": self.refused,
                "sealed_stale": self.stale,
                "sealed_fallbacks": self.fallbacks, "sealed_bytes_live_out": sealed, "sealed_bytes_live_in": opened,
                # per cipher: the sessions live now, and those offered since the start
                **{f"sealed_sessions_{c}": sum(s.sealer.cipher == c for s in self.by_rid.values())
                   for c in self.ciphers},
                **{f"sealed_offered_{c}": n for c, n in self.by_cipher.items()}}

    def close(self) -> None:
        self.sock.close(linger=0)  # the handed connections are closed with the transport's HandedPath


__all__ = ["SealedPath", "RidFrame", "OpenFrame", "SealError", "secret_path", "write_secret"]
