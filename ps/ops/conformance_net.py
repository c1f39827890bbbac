"""The conformance kit's sockets (docs/CONFORMANCE.md): the fake server's ROUTERs on loopback,
bound to a fixed endpoint so that a "restarted" server (or shard) rebinds the same one.

The only module of the kit that touches ZeroMQ. Messages are encoded and decoded with the
protocol's own codec (never pickle); what cannot be decoded is handed back as the error, so a
case can tell garbage from silence.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import zmq

from protocol.chunks import Reassembler
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import DEFAULT_MAX_ARRAY_BYTES, Part

BIND_RETRY_S = 5.0  # a port just closed may take a moment to be free again


def free_endpoint() -> str:
    """A tcp endpoint on loopback with a port free now (the kit keeps it for the whole session)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Router:
    """One ROUTER bound to ``endpoint``; ``peer`` is the routing id of the last sender."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.ctx, self.endpoint = ctx, endpoint
        self.sock: zmq.Socket | None = None
        self.peer: bytes | None = None
        self.parts = Reassembler(DEFAULT_MAX_ARRAY_BYTES)  # a transfer in parts from the peer (§6.13)
        self.parts_in = 0
        self.bind()

    def bind(self) -> None:
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            s = self.ctx.socket(zmq.ROUTER)
            s.linger = 0
            try:
                s.bind(self.endpoint)
                self.sock = s
                return
            except zmq.ZMQError:
                s.close(linger=0)
                if time.monotonic() > deadline:
                    raise
                zmq.Poller().poll(50)  # a bounded retry, not a synchronisation

    def crash(self) -> None:
        """Close abruptly, dropping whatever is queued either way (a server killed with -9)."""
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def restart(self) -> None:
        self.crash()
        self.parts = Reassembler(DEFAULT_MAX_ARRAY_BYTES)
        self.bind()

    def send(self, msg: Any) -> None:
        self.send_frames(encode(msg))

    def send_frames(self, frames: list) -> None:
        if self.sock is None or self.peer is None:
            return
        try:
            self.sock.send_multipart([self.peer, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone: the case's next wait says so

    def receive(self) -> tuple[Any, list] | None:
        """One waiting message: (the message, or the RemoteProtocolError decoding raised; the frames).
        A ``part`` is kept for its transfer and counted; the message it carries comes whole."""
        try:
            parts = self.sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        self.peer, frames = parts[0], parts[1:]
        try:
            msg = decode(frames, payload=self.parts.take)
            if type(msg) is Part:
                self.parts.add(msg)
                self.parts_in += 1
            return msg, frames
        except RemoteProtocolError as e:
            return e, frames

    def close(self) -> None:
        self.crash()


def wait_any(routers: list[Router], timeout_s: float) -> Router | None:
    """The first of ``routers`` with a message waiting, within ``timeout_s``; None if none."""
    poller = zmq.Poller()
    for r in routers:
        if r.sock is not None:
            poller.register(r.sock, zmq.POLLIN)
    ready = dict(poller.poll(max(0, int(timeout_s * 1000))))
    for r in routers:
        if r.sock is not None and r.sock in ready:
            return r
    return None


def context() -> zmq.Context:
    return zmq.Context()
