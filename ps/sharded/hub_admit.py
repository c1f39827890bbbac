"""Who may be a shard of a run (SECURITY.md "The shard trust model"; PROTOCOL.md §12.3).

The run id is no secret (every worker's welcome carries it), so it proves nothing. A shard
proves itself with the run's **shard token**: 32 random bytes (64 hex digits) the coordinator
keeps in its state directory (``shard.token``, mode 0600), made the first time and read back on
every restart, so restarted shards still get in. Local shards (``serve --shards N``) get it
through the environment (``LATECOMER_SHARD_TOKEN``), never on a command line; a remote shard
reads a copy (``latecomer shard --token-file FILE``). With ``--keys`` the shard socket admits
only holders of the server's secret key (CurveZMQ), which is the shard's credential there: a
holder of that key can be the coordinator itself to every worker, so a token would add nothing.

:class:`ShardGate` is the hub's admission rules for a ``shello``: the token (constant time), and
a slot whose holder lives is never handed over (heard from within the liveness timeout and its
connection up: a probe over the ROUTER, whose ``ROUTER_MANDATORY`` send to a peer that is gone
fails at once). What it refuses is logged once per 10 s per kind, with the count since.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import secrets
from typing import Any, Callable

from ps.journal.statedir import StateError, fsync_dir
from ps.net.connections import RateLimitedLog

log = logging.getLogger("latecomer.shards")

TOKEN_FILE = "shard.token"  # the run's shard token, in the coordinator's state directory
TOKEN_ENV = "LATECOMER_SHARD_TOKEN"  # how a local shard (or any shard) is given it
MAX_TOKEN = 128  # characters
LOG_EVERY_S = 10.0  # a refusal of one kind is logged at most this often
PROBE_EVERY_S = 0.25  # a live holder is probed at most this often (a flood of shellos is not a flood of probes)


def _check(text: str, where: str) -> str:
    token = text.strip()
    if not token or len(token) > MAX_TOKEN or not token.isprintable() or " " in token:
        raise StateError(f"{where}: not a shard token (one word of at most {MAX_TOKEN} printable characters)")
    return token


def read_token(path: str) -> str:
    """A shard token from a file (``latecomer shard --token-file``). Raises StateError."""
    try:
        with open(path, encoding="utf-8") as f:
            return _check(f.read(MAX_TOKEN + 64), path)
    except (OSError, UnicodeDecodeError) as e:
        raise StateError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def run_token(state_dir: str, shards_file: str) -> str:
    """The run's shard token, ``<state_dir>/shard.token``: read back, or made (0600) when it is
    missing and no shard has ever joined the run (``shards_file`` absent: nobody holds a token it
    would lock out). Raises StateError (one line) for a damaged file, or a missing one of a run
    whose shards have joined."""
    path = os.path.join(state_dir, TOKEN_FILE)
    if os.path.exists(path):
        return read_token(path)
    if os.path.exists(os.path.join(state_dir, shards_file)):
        raise StateError(f"{path} is missing and shards of this run have joined with it: put it back (a remote "
                         f"shard's --token-file is a copy), or remove {os.path.join(state_dir, shards_file)} to "
                         f"make a new one (remote shards then need the new file)")
    token = secrets.token_hex(32)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(state_dir)
    return token


class ShardGate:
    """The hub's admission rules for ``shello``.

    Args:
        token: the run's shard token; None: not checked (CurveZMQ admits only shards holding the
            server's key pair).
        liveness_s: a slot's holder heard from within this long may still be alive.
        probe: whether a routing id's connection is up (the hub's ROUTER, ``ROUTER_MANDATORY``:
            a send to a peer that is gone fails at once).
    """

    def __init__(self, token: str | None, liveness_s: float, probe: Callable[[bytes], bool]) -> None:
        self.token, self.liveness_s, self.probe = token, liveness_s, probe
        self.lines = RateLimitedLog(log, LOG_EVERY_S)  # one line per kind per LOG_EVERY_S
        self.counts: dict[str, int] = {"bad_token": 0, "slot_live": 0}
        self.probed: dict[bytes, float] = {}  # holder's routing id -> when a probe last found it up

    def token_ok(self, given: str) -> bool:
        if self.token is None:
            return True
        return hmac.compare_digest(given.encode(), self.token.encode())

    def holder_alive(self, slot: Any, rid: bytes, now: float) -> bool:
        """Whether ``slot`` is held by another live peer than ``rid``: heard from within the
        liveness timeout, and its connection up (a probe to it does not fail)."""
        if slot.rid in (None, rid) or not slot.connected or now - slot.last_seen >= self.liveness_s:
            return False
        if now - self.probed.get(slot.rid, -math.inf) < PROBE_EVERY_S:
            return True
        if not self.probe(slot.rid):
            return False
        if len(self.probed) > 256:
            self.probed.clear()
        self.probed[slot.rid] = now
        return True

    def warn(self, kind: str, now: float, fmt: str, *args: Any) -> None:
        """One warning line per ``kind`` per ``LOG_EVERY_S``, saying how many went unlogged."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.lines.warning(kind, now, fmt, *args)


def peer_name(rid: bytes, endpoint: str) -> str:
    """How a log line names a peer: its routing id (printable, at most 40 bytes) and the endpoint it gave."""
    return f"{rid[:40]!r}" + (f" (endpoint {endpoint[:80]!r})" if endpoint else "")

