"""The coordinator's gathers of the iterate from its shards.

Owns the open ``params?`` requests (each for the parameters after a given journal record), the
slices that came for them, and the whole iterates gathered: the concatenation, in shard order,
is what the coordinator evaluates and writes as ``final_x.npy`` (ps/drivers/coordinator.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from ps.sharded.control import pack
from ps.sharded.hub_table import Slot

log = logging.getLogger("latecomer.shards")


class ParamsGathers:
    """Requests of each of the ``n`` shards' slice over ``ranges`` (dtype ``dtype``), sent through
    ``send(rid, header)``."""

    def __init__(self, n: int, ranges: tuple, dtype: Any, send: Callable[..., bool]) -> None:
        self.n, self.ranges, self.dtype, self.send = n, ranges, dtype, send
        self.open: dict[int, dict] = {}  # token -> {"lsn", "parts": {shard: slice}, "versions": {shard: version}}
        self.done: list[tuple[int, int, int, np.ndarray]] = []  # (token, lsn, version, x) gathered

    def request(self, token: int, lsn: int, slots: list[Slot]) -> None:
        """Ask every connected shard for its slice once it has applied record ``lsn``."""
        self.open[token] = {"lsn": lsn, "parts": {}, "versions": {}}
        for s in slots:
            if s.connected:
                self.send(s.rid, pack("params?", token=token, lsn=lsn))

    def ask_again(self, slot: Slot) -> None:
        """A shard (re)joined: the requests it has not answered, asked again."""
        for token, g in self.open.items():
            if slot.index not in g["parts"]:
                self.send(slot.rid, pack("params?", token=token, lsn=g["lsn"]))

    def take(self) -> list[tuple[int, int, int, np.ndarray]]:
        done, self.done = self.done, []
        return done

    def on_params(self, slot: Slot, m: dict, frames: list) -> None:
        """A shard's slice; the iterate is gathered once every shard's has come."""
        g = self.open.get(m["token"])
        if g is None or len(frames) != 1:
            return
        lo, hi = self.ranges[slot.index]
        dt = self.dtype
        buf = frames[0].buffer
        if len(buf) != (hi - lo) * dt.itemsize:
            log.warning("shard %d sent %d bytes of parameters, not %d", slot.index, len(buf), (hi - lo) * dt.itemsize)
            return
        slot.applied = max(slot.applied, m["lsn"])
        g["parts"][slot.index] = np.frombuffer(buf, dtype=dt).copy()
        g["versions"][slot.index] = m["version"]
        if len(g["parts"]) == self.n:
            del self.open[m["token"]]
            versions = set(g["versions"].values())
            if len(versions) != 1:
                log.error("shards sent parameters of different versions %s for record %d", sorted(versions),
                          g["lsn"])
            x = np.concatenate([g["parts"][i] for i in range(self.n)]) if self.n > 1 else g["parts"][0]
            self.done.append((m["token"], g["lsn"], max(versions), x))
