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

import numpy as np
import zmq

_SEND = zmq.backend.Socket.send
_RECV = zmq.backend.Socket.recv
_MORE = int(zmq.SNDMORE)
_RCVTIMEO = int(zmq.RCVTIMEO)
# Smaller frames are copied: pyzmq's zero-copy path costs a Frame, a free callback and a hand-off
# to its garbage-collection thread (which needs the GIL) per frame, more than a memcpy of this size.
COPY_BELOW = 1 << 20


def dealer_options(s: zmq.Socket, endpoint: str) -> None:
    """A worker DEALER's reconnection, keepalive and handshake options (PROTOCOL.md §1), for the
    endpoint it connects to. No ZMTP heartbeats (PINGs): the protocol's own heartbeats and the
    liveness timeout tell a silent server, and a PING queued behind a full receive pipe on a reset
    connection is what makes libzmq 4.3.5 abort (SECURITY.md, "the libzmq abort"), on either end.
    TCP keepalive closes a connection whose server vanished without a FIN."""
    from protocol.messages import RECONNECT_IVL_MAX_S, RECONNECT_IVL_S

    s.setsockopt(zmq.RECONNECT_IVL, round(RECONNECT_IVL_S * 1000))
    s.setsockopt(zmq.RECONNECT_IVL_MAX, round(RECONNECT_IVL_MAX_S * 1000))
    s.setsockopt(zmq.TCP_KEEPALIVE, 1)
    s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
    s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
    s.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    s.setsockopt(zmq.HANDSHAKE_IVL, 5000)
    s.ipv6 = endpoint.startswith("tcp://[")  # an IPv6 literal (ps/net/endpoints.py needs_ipv6)


def recv_within(sock: zmq.Socket, timeout_ms: int, set_ms: int) -> tuple[list | None, int]:
    """One message within ``timeout_ms`` (None: none came), with ``RCVTIMEO`` set only when it
    changes (``set_ms``: its value now). Returns the frames and the ``RCVTIMEO`` now set."""
    if timeout_ms != set_ms:
        sock.set(_RCVTIMEO, timeout_ms)
    try:
        return recv_frames(sock), timeout_ms
    except zmq.Again:  # the timeout
        return None, timeout_ms


def _nbytes(f: Any) -> int:
    if type(f) is bytes:  # headers and routing ids: no attribute lookup that fails (and raises inside)
        return len(f)
    n = getattr(f, "nbytes", None)  # numpy arrays, memoryviews
    return len(f) if n is None else n


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)``; raises what it raises (zmq.Again
    when the first frame cannot be queued, then nothing was sent)."""
    flags = int(flags)
    more = flags | _MORE
    last = len(frames) - 1
    for i, f in enumerate(frames):
        n = len(f) if type(f) is bytes else f.nbytes if type(f) is np.ndarray else _nbytes(f)  # the common two: no call
        _SEND(sock, f, more if i < last else flags, n < COPY_BELOW, False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list:
    """``sock.recv_multipart(flags, copy=False)``: the message's frames as ``zmq.Frame``."""
    f = _RECV(sock, int(flags), False, False)
    parts = [f]
    while f.more:
        f = _RECV(sock, int(flags), False, False)
        parts.append(f)
    return parts
