"""CurveZMQ keys and the worker allow-list ("ironhouse": pyzmq's ``zmq.auth``).

Layout of a keys directory (``latecomer keys init DIR``)::

    DIR/server.key          server public key   (give it to every worker)
    DIR/server.key_secret   server secret key   (mode 0600, stays on the server)
    DIR/authorized/NAME.key public keys of the workers allowed to connect (the allow-list)
    DIR/workers/NAME.key, NAME.key_secret   key pairs made by ``keys add-worker`` (hand each
                                            worker its pair; delete the copy here if you like)

Revoking a worker = deleting ``authorized/NAME.key`` and sending the server SIGHUP (or
``latecomer keys revoke NAME``, which does the first half). A connection with an unknown key is
refused during the handshake and logged with the key's fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from worker.keys import client_keys, load_public, load_secret  # noqa: F401 (load_public: for the CLI)

log = logging.getLogger("latecomer.security")

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def fingerprint(z85_key: str | bytes) -> str:
    """A short, stable name for a public key (first 16 hex digits of its SHA-256)."""
    if isinstance(z85_key, str):
        z85_key = z85_key.encode()
    return hashlib.sha256(z85_key).hexdigest()[:16]


def init_keys(keys_dir: str) -> str:
    """Create the server key pair and the allow-list folder. Refuses to overwrite keys."""
    if os.path.exists(os.path.join(keys_dir, "server.key_secret")):
        raise FileExistsError(f"{keys_dir} already holds a server key")
    os.makedirs(os.path.join(keys_dir, "authorized"), exist_ok=True)
    os.makedirs(os.path.join(keys_dir, "workers"), exist_ok=True)
    os.chmod(keys_dir, 0o700)
    pub, sec = zmq.auth.create_certificates(keys_dir, "server")
    os.chmod(sec, 0o600)
    return pub


def add_worker(keys_dir: str, name: str) -> tuple[str, str]:
    """Make a key pair for worker NAME and put its public key on the allow-list."""
    if not NAME_RE.match(name):
        raise ValueError(f"worker key name must be 1-64 characters of letters, digits, '_', '.', '-': {name!r}")
    if not os.path.exists(os.path.join(keys_dir, "server.key")):
        raise FileNotFoundError(f"{keys_dir} holds no server key: run `latecomer keys init {keys_dir}` first")
    workers = os.path.join(keys_dir, "workers")
    if os.path.exists(os.path.join(workers, f"{name}.key")):
        raise FileExistsError(f"a key named {name!r} exists already")
    os.makedirs(workers, exist_ok=True)
    # the name travels inside the key files: a renamed copy still gives the worker its default id
    pub, sec = zmq.auth.create_certificates(workers, name, metadata={"name": name})
    os.chmod(sec, 0o600)
    shutil.copy(pub, os.path.join(keys_dir, "authorized", f"{name}.key"))
    return pub, sec


def revoke_worker(keys_dir: str, name: str) -> None:
    path = os.path.join(keys_dir, "authorized", f"{name}.key")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no authorized key named {name!r}")
    os.remove(path)


class _LoggingAuthenticator(ThreadAuthenticator):
    """The allow-list authenticator, logging every refused key by fingerprint."""

    refused = 0

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            type(self).refused += 1
            z85 = zmq.utils.z85.encode(client_key)
            log.warning("refused a connection with an unknown key %s (%s)", fingerprint(z85), reason.decode())
        return allowed, reason


SHARD_DOMAIN = "latecomer-shards"  # the ZAP domain of a coordinator's shard socket: the server's own key only


class ServerSecurity:
    """CURVE server side: the secret key, and the authenticator thread holding the allow-list.

    A sharded server's processes all hold the server's key pair: each shard's data socket is a
    CURVE server under it (workers connect as to the server, with the allow-list), and a shard
    connects to the coordinator's shard socket as a CURVE client with it, which that socket's ZAP
    domain (:data:`SHARD_DOMAIN`, :meth:`allow_shards`) alone admits: being a shard takes the
    server's secret key."""

    def __init__(self, ctx: zmq.Context, keys_dir: str) -> None:
        self.keys_dir = keys_dir
        self.public, self.secret = load_secret(os.path.join(keys_dir, "server.key_secret"))
        self.allowed_dir = os.path.join(keys_dir, "authorized")
        if not os.path.isdir(self.allowed_dir):
            raise ValueError(f"{keys_dir} has no authorized/ folder (run `latecomer keys init`)")
        self.auth = _LoggingAuthenticator(ctx)
        self.auth.start()
        self.reload()

    def reload(self) -> set[str]:
        """Re-read the allow-list (SIGHUP). Returns the fingerprints of the allowed keys."""
        self.auth.configure_curve(domain="*", location=self.allowed_dir)
        allowed = set()
        for f in sorted(os.listdir(self.allowed_dir)):
            if f.endswith(".key"):
                try:
                    allowed.add(fingerprint(load_public(os.path.join(self.allowed_dir, f))))
                except ValueError as e:
                    log.warning("ignoring %s: %s", f, e)
        log.info("allow-list loaded: %d worker key(s)", len(allowed))
        self.allowed = allowed
        return allowed

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def apply_shard_server(self, sock: zmq.Socket) -> None:
        """The coordinator's shard socket: a CURVE server whose only admitted client key is the
        server's own (a shard's), in a ZAP domain of its own (before bind)."""
        self.auth.certs[SHARD_DOMAIN] = {self.public: True}  # what configure_curve would load from a folder
        sock.zap_domain = SHARD_DOMAIN.encode()
        self.apply(sock)

    def apply_shard_client(self, sock: zmq.Socket) -> None:
        """A shard's control socket to its coordinator: a CURVE client with the server's key pair."""
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self.public, self.secret, self.public

    def stop(self) -> None:
        self.auth.stop()


def apply_client(sock: zmq.Socket, key_secret_path: str, server_key_path: str) -> None:
    """CURVE client side for a worker's DEALER."""
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = client_keys(key_secret_path, server_key_path)


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for endpoints only this host can reach (loopback TCP, ipc, inproc)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    m = re.match(r"^tcp://(\[[^\]]+\]|[^:]+):", endpoint)
    if not m:
        return False
    host = m.group(1).strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")
