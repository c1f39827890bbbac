"""Snapshot and restore of a :class:`ps.core.server_core.ServerCore`: everything needed to
continue a run exactly, as a nested structure of plain values and arrays (format 2: the worker
table, the ledger and the closed job ids as checkpoint columns; format 1, lists of rows, is still
restored), and the core rebuilt from it bit for bit."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import numpy as np

from algorithms.base import Algorithm, JobSpec, Result
from protocol.messages import JobKind
from ps.core.columns import _column, _table, _uncolumn, _untable
from ps.core.ledger import Counters, LedgerEntry
from ps.core.workers import WorkerInfo


def snapshot_of(core: Any) -> dict[str, Any]:
    """``core``'s state (see ``ServerCore.snapshot``). Arrays are shared, not copied."""
    return {
        "format": 2,  # 1: workers, ledger and closed as lists of rows (still restored)
        "algorithm": core.alg.name,
        "alg_state": core.alg.to_state_dict(core.state),
        "rng": core.rng.bit_generator.state,
        "workers": _table(core.workers.values(), WorkerInfo.__slots__),
        "ledger": _table(core.ledger.values(), LedgerEntry.__slots__),
        "store": dict(core.store),
        "refs": dict(core.refs),
        "store_peak": core.store_peak,
        "pending_specs": [{f: getattr(sp, f) for f in JobSpec.__slots__} for sp in core.pending_specs],
        "buffer": [{f: getattr(r, f) for f in Result.__slots__} for r in core.buffer],
        "closed": {"ids": _column(list(core.closed)), "how": _column(list(core.closed.values()))},
        "counters": core.counters.as_dict(),
        "next_job_id": core.next_job_id,
        "started": core.started,
        "issuing": core.issuing,
        "held": core.held,
        "next_round_at": core.next_round_at,
        "round_blocked": core.round_blocked,
        "last_metrics": dict(core.last_metrics),
        "quarantine": dict(core.quarantine),
        "dim": core.dim,
        "dtype": core.dtype.str,
    }


def restore_into(core: Any, algorithm: Algorithm, snap: dict[str, Any]) -> None:
    """Set ``core`` (a ``ServerCore`` not yet initialised: its algorithm, config and server boot
    set by the caller, its indexes built after) to the state of ``snap``, the inverse of
    :func:`snapshot_of`."""
    core.dim = int(snap["dim"])
    core.dtype = np.dtype(snap["dtype"])
    core.state = algorithm.from_state_dict(snap["alg_state"])
    core.rng = np.random.default_rng()
    core.rng.bit_generator.state = snap["rng"]
    core.workers = {w["worker_id"]: WorkerInfo(**w) for w in _untable(snap["workers"])}
    core.ledger = {e["job_id"]: LedgerEntry(**e) for e in _untable(snap["ledger"])}
    for e in core.ledger.values():
        e.kind = JobKind(e.kind)
    core.store = {int(k): v for k, v in snap["store"].items()}
    for v in core.store.values():
        v.setflags(write=False)
    core.refs = {int(k): int(v) for k, v in snap["refs"].items()}
    core.store_peak = int(snap["store_peak"])
    core.pending_specs = deque(JobSpec(**{**sp, "kind": JobKind(sp["kind"])}) for sp in snap["pending_specs"])
    core.buffer = [Result(**{**r, "kind": JobKind(r["kind"])}) for r in snap["buffer"]]
    closed = snap["closed"]
    pairs = zip(_uncolumn(closed["ids"]), _uncolumn(closed["how"]), strict=True) if isinstance(closed, dict) \
        else closed
    core.closed = OrderedDict((int(k), v) for k, v in pairs)
    core.counters = Counters(**snap["counters"])
    core.next_job_id = int(snap["next_job_id"])
    core.started = bool(snap["started"])
    core.issuing = bool(snap["issuing"])
    core.held = str(snap.get("held", ""))
    core.next_round_at = float(snap["next_round_at"])
    core.round_blocked = bool(snap["round_blocked"])
    core.last_metrics = dict(snap["last_metrics"])
    core.quarantine = dict(snap.get("quarantine", {}))
    core.events = []
    core.layout_text = ""
