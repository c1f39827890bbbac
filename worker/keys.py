"""CurveZMQ key files, read one way for every client (a worker's link, ``latecomer status``) and
for the server (ps/net/security.py): ``*.key_secret`` holds a key pair, ``*.key`` a public key
(pyzmq's ``zmq.auth`` certificate format). Errors are ValueErrors naming the file."""

from __future__ import annotations

import zmq.auth


def load_secret(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``*.key_secret`` file; a clear error if it is not one."""
    try:
        pub, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read key pair {path}: {e}") from None
    if not sec:
        raise ValueError(f"{path} holds no secret key (give the .key_secret file)")
    return pub, sec


def load_public(path: str) -> bytes:
    """The public key of a ``*.key`` (or ``*.key_secret``) file."""
    try:
        pub, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read public key {path}: {e}") from None
    return pub


def client_keys(key_secret: str | None, server_key: str | None) -> tuple[bytes, bytes, bytes]:
    """(public, secret, the server's public) for a CURVE client; ValueError with the culprit."""
    if not (key_secret and server_key):
        raise ValueError("CurveZMQ needs both the worker's key pair and the server's public key")
    pub, sec = load_secret(key_secret)
    return pub, sec, load_public(server_key)
