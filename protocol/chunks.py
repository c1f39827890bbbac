"""Large messages in parts (PROTOCOL.md §6.13): splitting on the way out, reassembly on the way in.

A ``job`` or ``reply`` whose array bytes exceed ``CHUNK_THRESHOLD`` travels as ``part``
messages of about ``CHUNK_BYTES`` (each a zero-copy slice of one array), then the message
itself with ``xfer`` set and no frames. libzmq moves a 40 MB message as one allocation read
in small batches; as ten 4 MB messages it moved twice as fast on loopback here (30-34 ms
against 16 ms, PROTOCOL_NOTES §1.3 saw 2.4x at 400 MB), copy into one buffer included.

Pure: no sockets. The daemon and the worker call :func:`split` before sending and feed a
:class:`Reassembler` (one per peer) with the parts they receive.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from protocol.codec import encode
from protocol.errors import RemoteProtocolError
from protocol.messages import (
    CHUNK_BYTES,
    CHUNK_THRESHOLD,
    CURVE_CHUNK_BYTES,
    CURVE_CHUNK_THRESHOLD,
    CURVE_MAX_PARTS,
    MAX_PARTS,
    Part,
)


class Chunking(NamedTuple):
    """How a sender splits a connection's large messages (its choice, PROTOCOL.md §6.13): the
    array bytes above which a ``job`` or ``reply`` travels in parts, the parts' size, and the
    most parts one message takes (past it the parts are larger)."""

    threshold: int
    chunk: int
    max_parts: int = MAX_PARTS

    def split(self, msg: Any, xfer: int) -> list[list[Any]]:
        return split(msg, xfer, threshold=self.threshold, chunk=self.chunk, max_parts=self.max_parts)


def chunking(encrypted: bool) -> Chunking:
    """A connection's :class:`Chunking`: under CurveZMQ small parts (CURVE_CHUNK_BYTES, at most
    CURVE_MAX_PARTS a message), else few large ones."""
    if encrypted:
        return Chunking(CURVE_CHUNK_THRESHOLD, CURVE_CHUNK_BYTES, CURVE_MAX_PARTS)
    return Chunking(CHUNK_THRESHOLD, CHUNK_BYTES)


def array_bytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames[1:])


def split(msg: Any, xfer: int, *, threshold: int = CHUNK_THRESHOLD, chunk: int = CHUNK_BYTES,
          max_parts: int = MAX_PARTS) -> list[list[Any]]:
    """The messages (each a list of frames) that carry ``msg``: ``[encode(msg)]`` when its arrays
    are small, else its parts then the header-only carrier. ``xfer``: a transfer id, nonzero and
    new on this connection (the sender's counter). Parts are ``chunk`` bytes unless that needs
    more than ``max_parts`` (at most MAX_PARTS) parts; then larger."""
    frames = encode(msg)
    total = array_bytes(frames)
    if total <= threshold or len(frames) == 1:
        return [frames]
    carrier = encode(dataclasses.replace(msg, xfer=xfer))
    arrays = [memoryview(a).cast("B") if memoryview(a).nbytes else memoryview(b"") for a in carrier[1:]]
    pieces = [(a, lo) for a in arrays for lo in range(0, a.nbytes, chunk)]
    max_parts = min(max_parts, MAX_PARTS)
    if len(pieces) > max_parts:  # very large: bigger parts, never more than max_parts
        chunk = max(chunk, math.ceil(total / max(max_parts - len(arrays), 1)))
        pieces = [(a, lo) for a in arrays for lo in range(0, a.nbytes, chunk)]
    out = [encode(Part(xfer=xfer, index=i, count=len(pieces), data=a[lo:lo + chunk]))
           for i, (a, lo) in enumerate(pieces)]
    out.append(carrier[:1])
    return out


class Reassembler:
    """The parts of one transfer at a time from one peer (a sender finishes a transfer before
    starting the next; a new ``xfer`` drops an unfinished one). Holds at most ``max_bytes``."""

    def __init__(self, max_bytes: int, alloc: Any = None) -> None:
        self.max_bytes = max_bytes
        self.alloc = alloc or (lambda n: np.empty(n, np.uint8))
        self.xfer = 0
        self.count = 0
        self.frames: list[Any] = []
        self.size = 0
        self.dropped = 0  # unfinished transfers abandoned

    def add(self, part: Part) -> None:
        """Keep a part (zero-copy). Raises RemoteProtocolError for an out-of-order or oversized one
        (the transfer is then dropped)."""
        if part.xfer != self.xfer:
            if self.frames:
                self.dropped += 1
            self._reset(part.xfer, part.count)
        if part.index != len(self.frames) or part.count != self.count:
            self._reset(0, 0)
            raise RemoteProtocolError(f"part {part.index} of {part.count} out of order (transfer {part.xfer})")
        n = memoryview(part.data).nbytes
        if self.size + n > self.max_bytes:
            self._reset(0, 0)
            raise RemoteProtocolError(f"transfer {part.xfer} larger than {self.max_bytes} bytes")
        self.frames.append(part.data)
        self.size += n

    def take(self, xfer: int, nbytes: int) -> np.ndarray:
        """The bytes of a complete transfer, copied into one buffer (the ``payload`` of
        :func:`protocol.codec.decode`)."""
        try:
            if xfer != self.xfer or len(self.frames) != self.count or self.count == 0:
                raise RemoteProtocolError(f"transfer {xfer} incomplete ({len(self.frames)} of {self.count} parts)")
            if nbytes != self.size:
                raise RemoteProtocolError(f"transfer {xfer} holds {self.size} bytes, the arrays need {nbytes}")
            buf = self.alloc(nbytes)
            off = 0
            for f in self.frames:
                m = memoryview(f).cast("B")
                buf[off:off + m.nbytes] = m
                off += m.nbytes
            return buf
        finally:
            self._reset(0, 0)

    def _reset(self, xfer: int, count: int) -> None:
        self.xfer, self.count, self.frames, self.size = xfer, count, [], 0
