"""The iterate store: the points (iterates) that outstanding jobs reference, by iterate id, with a
reference count per iterate; an iterate leaves when no job references it and the algorithm no
longer needs it (:func:`sweep`). What a driver keeps beside it learns what left
through an :class:`EvictionCursor`.

The store (``core.store``: iterate id -> point, read-only arrays shared with the jobs sent), the
reference counts (``core.refs``) and the peak (``core.store_peak``) are attributes of the core
(the ``core`` argument below), as a checkpoint sees it; the functions here keep them in step."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

EVICTED_KEPT = 4096  # iterate ids swept from the store that the core remembers (EvictionCursor)


class EvictionCursor:
    """What a driver keeps beside the core's store (shared-memory copies, wire-dtype copies of
    iterates) learns which iterates left the store from this, not by looking at each of its own:
    :meth:`take` answers the ids swept since its last call. With thousands of jobs outstanding the
    store holds thousands of iterates; a scan of every copy after each batch of messages was the
    biggest single cost of a server under 4,000 heartbeating fakes (13 % of its loop)."""

    def __init__(self) -> None:
        self.core: Any = None
        self.mark = 0

    def take(self, core: Any) -> list[int] | None:
        """The iterate ids ``core`` swept from its store since the last call; None where that is
        not known (the first call, another core object, or more swept than it keeps): look at all."""
        n = core.evictions - self.mark
        known = core is self.core and n <= len(core.evicted)
        self.core, self.mark = core, core.evictions
        if not known:
            return None
        if n == 1:  # a reply's usual sweep, without the comprehension below
            return [core.evicted[-1]]
        return [core.evicted[-i] for i in range(1, n + 1)] if n else []



def index_iterates(core: Any) -> None:
    """The store's derived state (never in a snapshot): ``_unref``, the iterate ids whose
    reference count fell to 0 (what :func:`sweep` looks at, not the whole store), and
    ``evicted``/``evictions``, the latest ids swept and how many were, ever, by this object."""
    core._unref = {i for i, n in core.refs.items() if n <= 0}
    core.evicted = deque(maxlen=EVICTED_KEPT)  # the latest iterate ids swept from the store
    core.evictions = 0  # how many were, ever, by this object (EvictionCursor)


def reference(core: Any, iterate_ids: Sequence[int], points: Sequence[np.ndarray]) -> None:
    """A job references these iterates (stored on first reference)."""
    store, refs = core.store, core.refs
    for iid, p in zip(iterate_ids, points, strict=True):
        if iid not in store:
            store[iid] = p
        refs[iid] = refs.get(iid, 0) + 1
    if len(store) > core.store_peak:
        core.store_peak = len(store)


def release(core: Any, iterate_ids: Sequence[int]) -> None:
    """A job that referenced these iterates was settled."""
    refs = core.refs
    for iid in iterate_ids:
        n = refs[iid] - 1
        refs[iid] = n
        if n <= 0:
            core._unref.add(iid)


def sweep(core: Any, live: Collection[int]) -> None:
    """Forget the iterates no job references and that are not ``live`` (those the algorithm
    needs). Only those whose count fell to 0 (``_unref``) are looked at."""
    for iid in list(core._unref):
        if core.refs.get(iid, 1) > 0:  # referenced again (or gone): no longer a candidate
            core._unref.discard(iid)
        elif iid not in live:
            del core.refs[iid]
            core.store.pop(iid, None)
            core._unref.discard(iid)
            core.evicted.append(iid)
            core.evictions += 1
