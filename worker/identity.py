"""A worker's default id (``latecomer work`` without ``--worker-id``).

Without CurveZMQ the default is ``HOST-PID``, as before: unique, but new at every restart.

With CurveZMQ (``--key NAME.key_secret``) the default is the key's NAME, so that ``latecomer
status`` rows read like the allow-list (one key per host, named after it: ``keys add-worker
gpu7`` for host gpu7) and a restarted worker comes back under the same id. A key's id must not
be taken by two live processes, though: the server treats a hello with a known id and a new boot
as that worker restarting, writes the old incarnation off, and when the old one speaks again and
says hello in turn, the new one is written off: two workers under one id knock each other out
(``tests/unit/test_cli_errors.py`` shows it on the server core). So:

- NAME alone when the key is named after this host (its short host name or its full one);
  otherwise ``NAME@HOST``, since one key is often shared by many hosts (the Kubernetes and compose
  recipes in deploy/ hand every replica the same ``worker.key_secret``).
- Several workers with the same key on one host: the first takes the id, the next ones
  ``ID-2``, ``ID-3``, ...: each claims its id with an exclusive ``flock`` on a file in a per-user
  folder of the temporary directory, held while the worker runs and released by the kernel when
  the process dies, so a restarted worker gets its old id back when it is free.
- If the lock folder cannot be used (read-only /tmp), ``ID-PID``: unique on this host, as before.

Two hosts with the same host name sharing a key, or two containers on one host with the same
host name (host networking) and separate /tmp, claim the same id without seeing each other. The
server settles it (PROTOCOL.md 8.10): the second hello replaces the first incarnation, the first
speaks again with its old boot and is refused ``worker id in use``, and a worker whose id is a
default then takes ``ID-XXXXXX`` (the low 24 bits of its boot) and joins under it. That costs the
first one's jobs in flight once; ``--worker-id`` (or ``LATECOMER_WORKER_ID``) or a key each
avoids even that.
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile

MAX_ID = 64
BASE_MAX = MAX_ID - 8  # room for "-PID" (7 digits) or "-N"
_SUFFIXES = 1000  # ID-2 .. ID-1000: more workers of one key on one host than anyone runs


def _clean(text: str) -> str:
    """Printable ASCII for the id; anything else becomes ``_``."""
    return "".join(c if c.isascii() and c.isprintable() and c != "/" else "_" for c in text)


def host_name() -> str:
    """This host's name as an id part (printable ASCII)."""
    return _clean(socket.gethostname()) or "host"


def key_name(key_secret: str) -> str:
    """The NAME of a worker key: the ``name`` metadata that ``latecomer keys add-worker`` writes
    into the key file, else the file name without ``.key_secret`` (keys made before the metadata,
    or renamed copies such as ``/run/secrets/worker_key`` keep whatever name their file has)."""
    try:
        with open(key_secret, encoding="utf-8", errors="replace") as f:
            section = ""
            for raw in f:
                line = raw.split("#", 1)[0].rstrip()
                if not line:
                    continue
                if not line[0].isspace():
                    section = line.strip()
                elif section == "metadata":
                    k, sep, v = line.strip().partition("=")
                    if sep and k.strip() == "name" and v.strip().strip('"'):
                        return _clean(v.strip().strip('"'))[:MAX_ID]
    except OSError:
        pass
    base = os.path.basename(key_secret)
    for suffix in (".key_secret", ".secret"):
        if base.endswith(suffix) and len(base) > len(suffix):
            base = base[:-len(suffix)]
            break
    return _clean(base)[:MAX_ID] or "worker"


def base_id(key_secret: str, host: str | None = None) -> str:
    """NAME when the key is named after this host, else ``NAME@HOST`` (at most 56 characters,
    leaving room for a ``-N`` or ``-PID`` suffix within the 64 of a worker id)."""
    name = key_name(key_secret)
    host = host if host is not None else host_name()
    short = host.split(".")[0] or host
    base = name if name.lower() in (host.lower(), short.lower()) else f"{name}@{short}"
    return base[:BASE_MAX]


def lock_dir() -> str:
    """Where the id claims live: a per-user folder of the temporary directory."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"latecomer-{uid}", "worker-ids")


class IdClaim:
    """A claimed worker id; the claim lasts until :meth:`release` or the process's end."""

    def __init__(self, worker_id: str, fd: int | None = None) -> None:
        self.worker_id = worker_id
        self._fd = fd

    def release(self) -> None:
        """Give the id back (closing the lock file drops its flock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.release()

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"IdClaim({self.worker_id!r}, held={self._fd is not None})"


def _try_lock(path: str) -> int | None:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def claim_default_id(key_secret: str | None, *, host: str | None = None, pid: int | None = None,
                     locks: str | None = None) -> IdClaim:
    """The default worker id for this process (see the module docstring), claimed.

    Args:
        key_secret: the worker's CurveZMQ key pair file, or None (no CurveZMQ: ``HOST-PID``).
        host, pid, locks: this host's name, this process's id and the lock folder (tests).
    """
    pid = os.getpid() if pid is None else pid
    host = host_name() if host is None else host
    if not key_secret:
        return IdClaim(f"{host[:50]}-{pid}")
    base = base_id(key_secret, host)
    folder = locks or lock_dir()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        for n in range(1, _SUFFIXES + 1):
            wid = base if n == 1 else f"{base}-{n}"
            fd = _try_lock(os.path.join(folder, f"{wid}.lock"))
            if fd is not None:
                return IdClaim(wid, fd)
    except OSError:
        pass
    return IdClaim(f"{base}-{pid}")
