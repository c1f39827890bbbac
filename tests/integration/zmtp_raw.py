"""A raw ZMTP 3.0 client over a plain TCP socket (NULL mechanism), for hostile-input tests.

It speaks just enough of the wire protocol (rfc.zeromq.org/spec/23) to do what a libzmq socket
never would: leave a multipart message unfinished forever, or reset the connection with
answers still queued.

    c = ZmtpClient("tcp://127.0.0.1:5555")   # greeting + READY (Socket-Type DEALER)
    c.send_frames([b"..."])                   # one message (MORE on all frames but the last)
    c.send_frame(b"x" * 65536, more=True)     # a frame of a message that never ends
    c.reset()                                 # SO_LINGER 0 close: the peer sees a TCP RST
"""

from __future__ import annotations

import socket
import struct

MORE, LONG, COMMAND = 0x01, 0x02, 0x04


def greeting(mechanism: bytes = b"NULL", as_server: bool = False) -> bytes:
    """The 64-byte ZMTP 3.0 greeting: signature, version 3.0, mechanism, as-server, filler."""
    return (b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\x00")
            + bytes([int(as_server)]) + b"\x00" * 31)


def frame_header(size: int, flags: int = 0) -> bytes:
    """A frame's flags byte and size (1 byte, or 8 bytes with LONG)."""
    if size > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", size)
    return bytes([flags, size])


def command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    return frame_header(len(data), COMMAND) + data


def ready(socket_type: bytes = b"DEALER", identity: bytes = b"") -> bytes:
    """The NULL mechanism's READY command with the Socket-Type (and Identity) properties."""
    props = b""
    for k, v in ((b"Socket-Type", socket_type), (b"Identity", identity)):
        if k == b"Identity" and not v:
            continue
        props += bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
    return command(b"READY", props)


def tcp_address(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


class ZmtpClient:
    """One ZMTP connection. ``handshake`` (the default) sends greeting and READY and reads the
    server's greeting and READY, so that what follows is application traffic."""

    def __init__(self, endpoint: str, *, handshake: bool = True, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(tcp_address(endpoint), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if handshake:
            self.sock.sendall(greeting() + ready())
            self._read_exact(64)
            self.read_frame()  # the server's READY command

    def _read_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            buf += chunk
        return buf

    def read_frame(self) -> tuple[int, bytes]:
        """One frame (or command): (flags, body)."""
        flags = self._read_exact(1)[0]
        size = struct.unpack(">Q", self._read_exact(8))[0] if flags & LONG else self._read_exact(1)[0]
        return flags, self._read_exact(size)

    def read_message(self) -> list[bytes]:
        """One whole message (commands such as PING are skipped)."""
        frames = []
        while True:
            flags, body = self.read_frame()
            if flags & COMMAND:
                continue
            frames.append(body)
            if not flags & MORE:
                return frames

    def send_frame(self, body: bytes, *, more: bool = False) -> None:
        self.sock.sendall(frame_header(len(body), MORE if more else 0) + body)

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.sendall(b"".join(frame_header(len(f), MORE if i < len(frames) - 1 else 0) + f
                                   for i, f in enumerate(frames)))

    def reset(self) -> None:
        """Close with SO_LINGER 0: the kernel drops what is queued and sends the peer a TCP RST."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()
