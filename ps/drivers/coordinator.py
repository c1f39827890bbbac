"""The daemon's side of a sharded run: what the coordinator's loop does with its ShardHub.

Owns the hub (ps/sharded/hub.py) as the daemon drives it: a worker's reply held until its
blocks are at every shard, the hold of the issuing of jobs while a shard is missing
(journaled), the records shipped and the held replies handed to the core on each pass of the
loop, the iterates gathered from the shards (the coordinator's core holds an empty one) and the
final gather at shutdown. Every core input still goes through the daemon's journaling inputs
(ps/journal/inputs.py) and its commands through the daemon.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from protocol.messages import Heartbeat, Hello, Reply
from ps.sharded.hub import ShardHub

log = logging.getLogger("latecomer.server")


class ShardedRun:
    """The coordinator's shards, driven from the daemon's loop.

    Args:
        daemon: the coordinator's daemon (ps/drivers/daemon.py).
        shards: ``{"n", "bind", "ranges", "x0"}``; the core is the coordinator's (an empty
            iterate), the parameters are the shards'.
    """

    def __init__(self, daemon: Any, shards: dict) -> None:
        self.daemon = daemon
        core = daemon.core
        self.hub = ShardHub(daemon.ctx, shards["bind"], shards["n"], core=core, persist=daemon.persist,
                            ranges=shards["ranges"], clock=daemon.clock, security=daemon.security)
        daemon.transport.shards_map = self.hub.shards_map
        daemon.transport.admission.needs_shards = True  # a hello without `shards` is refused
        self.x: np.ndarray | None = None  # the latest iterate gathered from the shards, and its version
        self.x_version = -1
        self.gathering: int | None = None  # the token of the gather an evaluation waits for
        if core.version == 0 and shards.get("x0") is not None:
            self.x, self.x_version = np.asarray(shards["x0"]), 0

    def params(self) -> np.ndarray:
        """The latest iterate gathered from the shards (empty before the first)."""
        return self.x if self.x is not None else np.zeros(0, self.daemon.core.dtype)

    def message(self, item: Any, now: float) -> bool:
        """A sharded server: a reply waits for its blocks (True: held); a heartbeat or hello counts
        the jobs whose replies wait as busy, so the core's reconciliation does not write them off."""
        msg, transport = item.msg, self.daemon.transport
        if type(msg) is Reply and item.refusal is None:
            if self.hub.take_reply(item, now):
                transport.handled(item, now)
                return True
        elif type(msg) is Hello and not self.hub.shards_map():
            # Not answered until every shard has joined once: the welcome must tell the shards. The
            # worker says hello again (its backoff); nothing of it reaches the core or the journal.
            transport.handled(item, now)
            return True
        if type(msg) in (Heartbeat, Hello):
            waiting = [j for j in self.hub.pending_for(item.wid) if j not in msg.busy]
            if waiting:
                item.msg = dataclasses.replace(msg, busy=(tuple(msg.busy) + tuple(waiting))[:256])
        return False

    def gather_for(self, version: int) -> bool:
        """Whether an evaluation of ``version`` must wait for the shards' iterate (asked for here,
        once); it starts when that has come (:meth:`gathered`)."""
        if self.x_version == version and self.x is not None:
            return False
        if self.gathering is None:
            self.gathering = self.hub.request_params(self.daemon.persist.journal.next_lsn - 1)
        return True

    def gathered(self) -> None:
        """Parameters the shards sent: the newest is the iterate; evaluated when asked for."""
        for token, _lsn, version, x in self.hub.take_params():
            if version >= self.x_version:
                self.x, self.x_version = x, version
            if token == self.gathering:
                self.gathering = None
                self.daemon.evals.start(version, x)

    def sync_hold(self, now: float) -> None:
        """Hold the issuing of jobs while a shard is missing (journaled: the shards and replay follow)."""
        d = self.daemon
        why = self.hub.hold_reason()
        if why and not d.core.held:
            log.warning("holding the issuing of jobs: %s", why)
            d.inputs.hold(now, why)
        elif not why and d.core.held:
            log.info("every shard is up: issuing jobs")
            d._execute(d.inputs.release(now) or [])

    def loop_pass(self, now: float) -> None:
        """Each pass of the loop: records to the shards, replies whose blocks have all arrived to
        the core, the hold, gathered parameters."""
        d, hub = self.daemon, self.hub
        hub.ship(now)
        for item, refusal in hub.ready_replies(now):
            cmds = d.inputs.message(item.wid, item.msg, now, item.key, refusal or item.refusal, frames=item.frames,
                                    wire=item.wire, keep_refusal=refusal is not None)
            if cmds is not None:
                d._execute(cmds)
            if d._check_stop():  # the rest are not accepted: the run is over
                break
        if not d.stopping:
            self.sync_hold(now)
        self.gathered()

    def final_gather(self, timeout_s: float = 120.0) -> None:
        """The run is over: every shard applies the journal to its end and sends its slice (at most
        ``timeout_s``; a shard that is gone is waited for, as long as that), then is told to stop."""
        d, hub = self.daemon, self.hub
        last = d.persist.journal.next_lsn - 1
        d.persist.journal.sync()
        token = hub.request_params(last)
        deadline = d.clock() + timeout_s
        while d.clock() < deadline:
            now = d.clock()
            hub.receive(now)
            hub.ship(now)
            got = [g for g in hub.take_params() if g[0] == token]
            if got:
                _, _, version, x = got[0]
                self.x, self.x_version = x, version
                break
            hub.sock.poll(50)
        else:
            log.error("the shards did not all send their parameters within %.0f s: final_x.npy is of step %d",
                      timeout_s, self.x_version)
        hub.stop(f"the run is over: {d.stopping}")
