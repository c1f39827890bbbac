"""Observers: what a logger, the dashboard or a Python caller sees of a running server.

The daemon (ps/drivers/daemon.py) calls every observer in ``Daemon.observers`` from its own loop:

- ``on_start(settings)`` once, before the first job: the run's settings (problem, algorithm and
  its hyper-parameters, batch size, seed, ...), a flat JSON-able dict, for a logger's
  hyper-parameters.
- ``on_events(events, now)`` with each batch of core events (the dicts ``--events`` writes, see
  ps/core/, where each is appended): ``issued`` (when an observer's ``wants_issued`` is True), ``applied``
  (with its ``age``), ``lost``, ``failed``, ``joined``, ``left``, ...
- ``on_evaluation(ev)`` with each evaluation's figures (``version``, ``t``, ``loss``, ...).
- ``on_tick(snapshot, now)`` about every :data:`TICK_S` seconds: :func:`snapshot` of the
  daemon (the status figures and the worker table).
- ``close()`` once, when the daemon closes.

An observer runs in the loop's thread and must return quickly: anything slow (a file write per
scalar, an upload) goes to a thread of its own. An observer that raises is logged once and
dropped; the run goes on.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("latecomer.server")

#: Seconds between two ``on_tick`` calls.
TICK_S = 0.5


class Observer:
    """The base of an observer: every method does nothing. ``wants_issued``: set it to True to
    receive the ``issued`` events too (the daemon records them only when someone wants them)."""

    wants_issued = False

    def on_start(self, settings: dict[str, Any]) -> None:
        pass

    def on_events(self, events: list[dict[str, Any]], now: float) -> None:
        pass

    def on_evaluation(self, ev: dict[str, float]) -> None:
        pass

    def on_tick(self, snapshot: dict[str, Any], now: float) -> None:
        pass

    def close(self) -> None:
        pass


def snapshot(daemon: Any) -> dict[str, Any]:
    """The figures an observer's tick gets: ``info`` (what ``latecomer status`` shows: version,
    step rate, counters, ages, the last evaluation, the algorithm's figures ``alg.*``),
    ``columns`` and ``rows`` (the worker table), ``age_counts`` (age -> applied replies, all run
    long), ``shards`` (a sharded server's per-shard summary, else ()) and ``alg`` (the
    algorithm's latest figures, all of them: ``info`` is capped at 64 entries)."""
    columns, rows = daemon.worker_rows()
    return {"info": daemon.status_info(), "columns": columns, "rows": rows, "age_counts": dict(daemon.age_counts),
            "shards": daemon.hub.summary() if daemon.hub is not None else (),
            "alg": dict(daemon.core.last_metrics)}


class Observers:
    """The daemon's list of observers, each call guarded: one that raises is dropped, logged once."""

    def __init__(self) -> None:
        self.items: list[Observer] = []
        self.next_tick = -math.inf  # the daemon's clock at the next on_tick

    def add(self, obs: Observer) -> None:
        self.items.append(obs)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self):
        return iter(self.items)

    @property
    def wants_issued(self) -> bool:
        return any(getattr(o, "wants_issued", False) for o in self.items)

    def call(self, method: str, *args: Any) -> None:
        for obs in list(self.items):
            try:
                getattr(obs, method)(*args)
            except Exception as e:  # noqa: BLE001 - an observer's bug must not stop the run
                log.warning("observer %s failed in %s and is dropped: %s: %s", type(obs).__name__, method,
                            type(e).__name__, e)
                self.items.remove(obs)
                if method != "close":
                    try:
                        obs.close()
                    except Exception:  # noqa: BLE001
                        pass
