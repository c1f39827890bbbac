"""Sending and receiving one multipart message with pyzmq's compiled socket calls.

pyzmq's ``Socket.send_multipart`` and ``recv_multipart`` are Python loops over ``send`` /
``recv`` that combine flag enums and ask ``RCVMORE`` per frame: on this project's 2-core VM
they cost about 20 µs for a three-frame job, four times the compiled calls themselves
(benchmarks/PROFILE.md). Both ends of the protocol (ps/net/transport.py, worker/link.py) send
and receive through these two functions instead: the same libzmq calls, flags as plain ints,
frames below COPY_BELOW copied into the message and larger ones sent without a copy.
"""

from __future__ import annotations

from typing import Any

import zmq

_SEND = zmq.backend.Socket.send
_RECV = zmq.backend.Socket.recv
_MORE = int(zmq.SNDMORE)
# Smaller frames are copied: pyzmq's zero-copy path costs a Frame, a free callback and a hand-off
# to its garbage-collection thread (which needs the GIL) per frame, more than a memcpy of this size.
COPY_BELOW = 1 << 20


def _nbytes(f: Any) -> int:
    if type(f) is bytes:  # headers and routing ids: no attribute lookup that fails (and raises inside)
        return len(f)
    n = getattr(f, "nbytes", None)  # numpy arrays, memoryviews
    return len(f) if n is None else n


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)``; raises what it raises (zmq.Again
    when the first frame cannot be queued, then nothing was sent)."""
    more = int(flags) | _MORE
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _SEND(sock, f, more if i < last else int(flags), _nbytes(f) < COPY_BELOW, False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list:
    """``sock.recv_multipart(flags, copy=False)``: the message's frames as ``zmq.Frame``."""
    f = _RECV(sock, int(flags), False, False)
    parts = [f]
    while f.more:
        f = _RECV(sock, int(flags), False, False)
        parts.append(f)
    return parts
