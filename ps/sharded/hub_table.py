"""The coordinator's table of its shards: one slot per shard, and where workers reach each.

Owns :class:`Slot` (what the coordinator knows of one shard: its process, progress, liveness
and figures), the routing-id index of the slots, the record of the shards' endpoints in the
state directory (``shards.json``, so a restarted coordinator welcomes workers before every
shard has said it again), the map that welcomes tell workers, and the per-shard figures of
status and the summary. What fills the slots is the hub's (ps/sharded/hub.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

from ps.journal.records import Record
from ps.journal.statefiles import read_json

log = logging.getLogger("latecomer.shards")

SHARDS_FILE = "shards.json"  # the coordinator's record of its shards' endpoints


@dataclass
class Slot:
    index: int
    endpoint: str = ""
    rid: bytes | None = None
    boot: int = 0
    connected: bool = False
    applied: int = -1
    ckpt: int = -1
    next: int = 0  # next LSN to ship
    last_seen: float = -math.inf
    last_sent: float = -math.inf
    version: int = 0
    applied_count: int = 0
    rss: int = 0
    blocks: int = 0
    records_s: float = 0.0
    joins: int = 0
    built: bool = False  # it has applied the run's start record (its data socket takes whole blocks)
    disagrees: str = ""  # why its last holder was dropped (disagreed, could not go on) until a holder agrees
    reader: Iterator[Record] | None = None
    peek: Record | None = None


class ShardTable:
    """The slots of a run's ``n`` shards over ``ranges``, and their endpoints' file in ``state_dir``."""

    def __init__(self, n: int, ranges: tuple, state_dir: str) -> None:
        self.n, self.ranges, self.state_dir = n, ranges, state_dir
        self.slots = [Slot(i) for i in range(n)]
        self.by_rid: dict[bytes, Slot] = {}

    def load_endpoints(self) -> None:
        path = os.path.join(self.state_dir, SHARDS_FILE)
        if not os.path.exists(path):
            return
        try:  # the checked reader (bounded size and depth): a crafted file is one warning
            eps = read_json(path, "the shards' endpoints")["endpoints"]
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s: ignored (%s): the shards tell their endpoints again", path, e)
            return
        for slot, ep in zip(self.slots, eps, strict=False):
            if type(ep) is str:
                slot.endpoint = ep

    def _save_endpoints(self) -> None:
        path = os.path.join(self.state_dir, SHARDS_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"endpoints": [s.endpoint for s in self.slots], "ranges": [list(r) for r in self.ranges]}, f)
        os.replace(path + ".tmp", path)

    def set_endpoint(self, slot: Slot, endpoint: str) -> None:
        """Where workers reach the shard (a new shard says it once bound: in its progress)."""
        if not endpoint or slot.endpoint == endpoint:
            return
        if slot.endpoint:
            log.warning("shard %d moved from %s to %s: workers welcomed before must say hello again", slot.index,
                        slot.endpoint, endpoint)
        slot.endpoint = endpoint
        self._save_endpoints()

    def shards_map(self) -> tuple:
        """What Welcome.shards tells workers: every shard's (endpoint, lo, hi); () until every shard
        has joined and built its core (a shard's data socket takes whole blocks only from then on, and
        libzmq fixes a connection's message size limit when it is made)."""
        if not all(s.endpoint and s.built for s in self.slots):
            return ()
        return tuple((s.endpoint, lo, hi) for s, (lo, hi) in zip(self.slots, self.ranges, strict=True))

    def figures(self, last: int) -> dict[str, Any]:
        """One status line per shard; ``last``: the coordinator's last journal record."""
        def state(s: Slot) -> str:
            return "DISAGREES" if s.disagrees else "up" if s.connected else "GONE"

        return {f"shard.{s.index}": (f"{state(s)} lag {max(0, last - s.applied)} "
                                     f"rss {s.rss / 1e6:.0f}MB blocks {s.blocks} joins {s.joins}")
                for s in self.slots}

    def summary(self, last: int) -> list[dict[str, Any]]:
        """Each shard's figures for the run's summary; ``last``: the coordinator's last journal record."""
        return [{"index": s.index, "endpoint": s.endpoint, "range": list(self.ranges[s.index]),
                 "connected": s.connected, "applied_lsn": s.applied, "lag_records": max(0, last - s.applied),
                 "version": s.version, "rss_bytes": s.rss, "blocks_held": s.blocks, "joins": s.joins,
                 "records_per_s": s.records_s, "disagrees": s.disagrees} for s in self.slots]
