"""Delayed-feedback variance reduction (docs/ALGORITHMS.md §7: A11 STORM-VR, A12 snapshot VR).

Jiang, Yu, Li, delayed-feedback variance reduction, preprint dated 20 Oct 2026. The paper and its
code were not found; the rules below are the spec's reading of the seed summary ([S]) plus our
inferences ([I]), §7 and §10.5.

Both algorithms share one round engine (:class:`_DelayedVR`) and one state class
(:class:`DelayedVRState`).

Round counter (both algorithms). ``state.version = k`` means that x_k is the newest iterate and
that the next round is round k:

* ``apply`` performs steps 1–2 of round k (v_k, then x_{k+1} = x_k − η v_k, even with no
  reply) and advances ``version`` to k+1;
* ``make_job`` then performs step 3: it issues job k+1 = GRAD_PAIR on (x_{k+1}, x_k) with
  ``created_at = k+1`` (= the new ``version``).

Round 0 is the initialization round: it consumes the blocking initial estimate (A11: a
B_init-sample minibatch at x_0; A12: the full gradient at x_0) as v_0 and forms x_1. A round is
performed only once the job of the current version has been handed out (or skipped: the basic
A12 variant skips the job of an anchor). Results that reach ``apply`` before that (the round is
"held": A11 ``on_excess="block"``, an A12 deadline block, or FULL_GRAD shards handed out first)
are accumulated with the weight of the round they will enter, so R_k is simply "everything
received since round k−1". A held ``apply`` returns ``updated=False``.

Job ids. ``make_job`` cannot know the id the driver gives a job, yet ``on_lost`` names jobs by id
only. The core tells the algorithm each job's id when it hands the job out (``on_issued``), so a
write-off always names a known job; that matters with clock rounds (``round_period_s``), where
the specs of several rounds can wait in the core's queue and several handed-out jobs are new
between two ``cancel`` calls. For a driver that never calls ``on_issued`` the ids are also
learned from the ``outstanding`` list of each ``cancel`` call, and an id not seen yet is matched
to the oldest job made since (exact only when at most one such job is out, as in a demand-driven
driver). ``on_issued`` and ``cancel`` therefore update the state's id table in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np

from algorithms._common import frozen
from algorithms.base import Algorithm, JobSpec, Outcome, Result, check_hyper
from protocol.messages import JobKind

__all__ = ["DelayedStormVR", "SnapshotVR", "DelayedVRState"]

_NONE = -1  # "no snapshot in flight" / "no further snapshot"


@dataclass(slots=True)
class DelayedVRState:
    """Evolving state of A11 and A12 (plain ints, floats, arrays, lists of ints).

    Indices: ``version`` = k (x_k newest, round k next); ``v`` is v_{k−1}; ``acc`` holds the
    corrections received since round k−1, already weighted (1−a)^{k−s} for round k.
    """

    version: int
    x: np.ndarray  # x_k, read-only (handed out in jobs)
    x_prev: np.ndarray  # x_{k-1}, read-only (x_0 while k = 0)
    v: np.ndarray  # v_{k-1}
    acc: np.ndarray  # Σ_{received since round k-1} (1-a)^{k-s} q_s
    issued: int  # newest s whose pair job was handed out (or skipped); round k needs issued >= k
    covered: int  # corrections s <= covered are replaced by an applied snapshot
    pending: list[int]  # s of pair jobs in flight, ascending
    gone: list[int]  # s of written-off pair jobs, still counted one by one in M
    lost_mass: float  # M-contribution of missing jobs past tau_lost, at index k-1
    next_anchor: int  # version at which the next snapshot starts (-1: never)
    snap_anchor: int  # anchor s0 of the snapshot in flight (-1: none); 0 = initialization
    snap_x: np.ndarray  # x_{s0}, read-only (== x when none)
    snap_todo: list[int]  # parts (shards) still to hand out
    snap_wait: list[int]  # parts handed out, not back
    snap_done: list[int]  # parts received
    snap_sum: np.ndarray  # sum of the received parts
    corr: np.ndarray  # S_{k-1}: corrections s > s0 since the anchor
    corr_acc: np.ndarray  # the part of acc with s > s0
    job_ids: list[int]  # driver job ids learned in cancel() ...
    job_tags: list[int]  # ... and their tags: s >= 1 pair job, < 0 snapshot part
    unseen: list[int]  # tags of jobs issued whose id is not known yet, oldest first
    applied_total: int
    dropped_total: int
    lost_total: int  # pair jobs written off or expired (age > tau_lost) unreceived
    written_off_total: int  # jobs the driver wrote off (on_lost), any kind
    excess_rounds: int  # rounds that ended with M_k > M_max
    forced_rounds: int  # "block": jobs issued with M_k > M_max because nothing was in flight
    snapshots_applied: int
    snapshots_abandoned: int


_LIST_FIELDS = ("pending", "gone", "snap_todo", "snap_wait", "snap_done", "job_ids", "job_tags", "unseen")
_INT_FIELDS = ("version", "issued", "covered", "next_anchor", "snap_anchor", "applied_total", "dropped_total",
               "lost_total", "written_off_total", "excess_rounds", "forced_rounds", "snapshots_applied",
               "snapshots_abandoned")
_FROZEN_FIELDS = ("x", "x_prev", "snap_x")
_WORK_FIELDS = ("v", "acc", "snap_sum", "corr", "corr_acc")


class _DelayedVR(Algorithm):
    """Round engine shared by A11 and A12 (see the module docstring); not registered itself."""

    mode = "round"

    # ---- hooks the two algorithms fill in
    def _keep(self) -> float:
        """1 − a: the decay of v per round."""
        return 1.0 - self.a

    def _tau(self) -> int | None:
        """τ_lost, or None when jobs never expire."""
        return None

    def _excess(self) -> tuple[float, bool] | None:
        """(M_max, block?) or None when M_k is not checked."""
        return None

    def _period(self) -> int | None:
        """Snapshot period m, or None when only the initialization is a snapshot."""
        return None

    def _parts(self) -> int:
        """Jobs per snapshot."""
        return 1

    def _part_job(self, state: DelayedVRState, j: int) -> JobSpec:
        raise NotImplementedError

    def _part_index(self, shard: tuple[int, int] | None) -> int | None:
        """Which part a (lo, hi) shard is; None if it is not one of ours."""
        return 0 if shard is None else None

    def _part_count_ok(self, j: int, r: Result) -> bool:
        return True

    def _snapshot_value(self, state: DelayedVRState) -> np.ndarray:
        """G from the received parts."""
        return state.snap_sum

    def _window(self, anchor: int) -> int:
        """D for this anchor: the snapshot may be used up to round anchor + D."""
        return 0

    def _waits(self, anchor: int) -> bool:
        """Whether the round anchor + D waits for a missing snapshot (else abandon it)."""
        return True

    def _skips_anchor_job(self) -> bool:
        """Basic A12 variant: the pair job of an anchor is covered by G, so it is not issued."""
        return False

    def _pair_batch(self) -> int | None:
        return None

    # ---- Algorithm interface
    def state_class(self) -> type:
        return DelayedVRState

    def init(self, x0: np.ndarray, *, seed: int):
        x = np.array(x0, copy=True)
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float64)
        if x.ndim != 1:
            raise ValueError(f"{self.name}: x0 must be a 1-D vector, got shape {x.shape}")
        x = frozen(x)
        period = self._period()
        state = DelayedVRState(
            version=0, x=x, x_prev=x, v=np.zeros_like(x), acc=np.zeros_like(x), issued=0, covered=0,
            pending=[], gone=[], lost_mass=0.0, next_anchor=_NONE if period is None else period,
            snap_anchor=0, snap_x=x, snap_todo=list(range(self._parts())), snap_wait=[], snap_done=[],
            snap_sum=np.zeros_like(x), corr=np.zeros_like(x), corr_acc=np.zeros_like(x),
            job_ids=[], job_tags=[], unseen=[], applied_total=0, dropped_total=0, lost_total=0,
            written_off_total=0, excess_rounds=0, forced_rounds=0, snapshots_applied=0, snapshots_abandoned=0,
        )
        return state, []

    def make_job(self, state: DelayedVRState, worker_id: str):
        if state.snap_todo:  # snapshot parts first: the full gradient should start as early as possible
            j = state.snap_todo.pop(0)
            state.snap_wait.append(j)
            state.unseen.append(self._part_tag(state.snap_anchor, j))
            return state, self._part_job(state, j)
        k = state.version
        if state.issued >= k:  # job k is out; round k has not happened yet (held)
            return state, None
        limit = self._excess()
        if limit is not None and limit[1] and self._missing_mass(state) > limit[0]:
            if state.pending:  # replies in flight can still lower M_{k-1}: wait for them
                return state, None
            state.forced_rounds += 1  # nothing can lower it by waiting: go on rather than deadlock
        state.issued = k
        state.pending.append(k)
        state.unseen.append(k)
        return state, JobSpec(kind=JobKind.GRAD_PAIR, created_at=k, iterate_ids=(k, k - 1),
                              points=(state.x, state.x_prev), batch_size=self._pair_batch())

    def apply(self, state: DelayedVRState, results: Sequence[Result]):
        k = state.version
        keep = self._keep()
        dt = state.v.dtype
        applied: list[int] = []
        dropped: list[int] = []
        age_of: dict[int, int] = {}
        fresh: list[tuple[int, int]] = []  # (job_id, s) of corrections accepted in this call
        lost_before = state.lost_total
        for r in results:
            if r.kind == JobKind.GRAD_PAIR:
                self._forget(state, r.job_id, r.created_at)
                s = r.created_at
                if s not in state.pending or s <= state.covered or len(r.grads) != 2:
                    dropped.append(r.job_id)
                    continue
                state.pending.remove(s)
                q = np.array(r.grads[0], dtype=dt, copy=True)
                q -= np.asarray(keep, dt) * r.grads[1]
                q *= np.asarray(keep ** (k - s), dt)
                state.acc += q
                if state.snap_anchor != _NONE and s > state.snap_anchor:
                    state.corr_acc += q
                applied.append(r.job_id)
                age_of[r.job_id] = k - s
                fresh.append((r.job_id, s))
            else:
                j = self._take_part(state, r)
                if j is None:
                    dropped.append(r.job_id)
                else:
                    applied.append(r.job_id)
                    age_of[r.job_id] = k - state.snap_anchor

        events: dict[str, float] = {}
        ready = state.issued >= k
        anchor = state.snap_anchor
        complete = anchor != _NONE and len(state.snap_done) == self._parts()
        if ready and anchor != _NONE and not complete and k >= anchor + self._window(anchor):
            if self._waits(anchor):
                ready = False  # deadline block: round k waits for G
            else:
                self._end_snapshot(state)
                state.snapshots_abandoned += 1
                events["snapshot_abandoned"] = float(anchor)
        if ready:
            covered_now = self._round(state, k, events)
            if covered_now is not None:  # this round's corrections with s <= s0 are covered by G
                for jid, s in fresh:
                    if s <= covered_now:
                        applied.remove(jid)
                        dropped.append(jid)
        state.applied_total += len(applied)
        state.dropped_total += len(dropped)
        metrics = self.metrics(state)
        metrics.update(applied=float(len(applied)), dropped=float(len(dropped)),
                       lost=float(state.lost_total - lost_before), **events)
        return state, Outcome(applied=tuple(applied), dropped=tuple(dropped), updated=ready,
                              ages=tuple(age_of[j] for j in applied),
                              metrics=metrics)

    def cancel(self, state: DelayedVRState, outstanding: Sequence[Any]) -> list[int]:
        """Stop pair jobs that expired (age > τ_lost) or are covered by a snapshot, and
        snapshot parts that are stale (abandoned or superseded anchor) or duplicated.

        Also learns the driver's job ids (in place) so that ``on_lost`` can place them.
        """
        self._learn(state, outstanding)
        pending = set(state.pending)
        known = dict(zip(state.job_ids, state.job_tags, strict=True))
        out = []
        for o in outstanding:
            if o.kind == JobKind.GRAD_PAIR:
                if o.created_at not in pending:
                    out.append(o.job_id)
                continue
            anchor = o.iterate_ids[0] if o.iterate_ids else _NONE
            if state.snap_anchor == _NONE or anchor != state.snap_anchor:
                out.append(o.job_id)
                continue
            tag = known.get(o.job_id)
            if tag is not None and tag < 0 and self._part_of(tag)[1] in state.snap_done:
                out.append(o.job_id)
        if out:
            gone = set(out)
            keep_pairs = [(i, t) for i, t in zip(state.job_ids, state.job_tags, strict=True) if i not in gone]
            state.job_ids = [i for i, _ in keep_pairs]
            state.job_tags = [t for _, t in keep_pairs]
        return out

    def on_issued(self, state: DelayedVRState, job_id: int, spec: JobSpec) -> DelayedVRState:
        """Record the driver's id of a job made by ``make_job`` (its tag read off the spec)."""
        if spec.kind == JobKind.GRAD_PAIR:
            tag: int | None = spec.created_at
        else:
            anchor = spec.iterate_ids[0] if spec.iterate_ids else _NONE
            j = self._part_index(spec.shard)
            tag = None if j is None else self._part_tag(anchor, j)
        if tag is None or job_id in state.job_ids:
            return state
        if tag in state.unseen:
            state.unseen.remove(tag)
        state.job_ids.append(job_id)
        state.job_tags.append(tag)
        return state

    def on_lost(self, state: DelayedVRState, job_ids: Sequence[int]) -> DelayedVRState:
        """Written-off jobs: pair jobs stay in M_k with their decaying weight; parts are reissued."""
        for jid in job_ids:
            tag = self._pop_tag(state, jid)
            if tag is None:  # a driver that does not call on_issued: the oldest job made since
                tag = state.unseen.pop(0) if state.unseen else None
            if tag is None:
                continue
            state.written_off_total += 1
            if tag > 0:
                if tag in state.pending:
                    state.pending.remove(tag)
                    state.gone.append(tag)
                    state.lost_total += 1
            else:
                anchor, j = self._part_of(tag)
                if anchor == state.snap_anchor and j in state.snap_wait:
                    state.snap_wait.remove(j)
                    state.snap_todo.append(j)
        return state

    def live_iterate_ids(self, state: DelayedVRState) -> set[int]:
        k = state.version
        ids = {k, k - 1} if k > 0 else {0}
        for s in state.pending:
            ids.update((s, s - 1))
        if state.snap_anchor != _NONE:
            ids.add(state.snap_anchor)
        return ids

    def shard_refusal(self) -> str:
        return ""  # every vector operation is elementwise; M_k and the rounds come from job metadata

    def splittable_blocks(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
        return (True,) * len(tuple(layout))

    def metrics(self, state: DelayedVRState) -> dict[str, float]:
        m = {
            "round": float(state.version - 1),
            "missing_mass": float(self._missing_mass(state)),
            "in_flight": float(len(state.pending)),
            "applied_total": float(state.applied_total),
            "dropped_total": float(state.dropped_total),
            "lost_total": float(state.lost_total),
            "written_off_total": float(state.written_off_total),
            "blocked": float(self._blocked(state)),
        }
        if self._excess() is not None:
            m["excess_rounds"] = float(state.excess_rounds)
            m["forced_rounds"] = float(state.forced_rounds)
        if self._period() is not None:
            m["snapshot_anchor"] = float(state.snap_anchor)
            m["snapshot_parts_left"] = float(len(state.snap_todo) + len(state.snap_wait))
            m["snapshots_applied"] = float(state.snapshots_applied)
            m["snapshots_abandoned"] = float(state.snapshots_abandoned)
        return m

    # ---- state save/load
    def from_state_dict(self, d: dict[str, Any]) -> DelayedVRState:
        d = dict(d)
        for name in _LIST_FIELDS:
            if isinstance(d.get(name), (list, tuple)):
                d[name] = [int(t) for t in d[name]]  # own copy: never alias the caller's dict
        for name in _INT_FIELDS:
            if isinstance(d.get(name), np.integer):
                d[name] = int(d[name])
        if isinstance(d.get("lost_mass"), (int, np.floating)) and not isinstance(d.get("lost_mass"), bool):
            d["lost_mass"] = float(d["lost_mass"])
        state = super().from_state_dict(d)
        for name in _FROZEN_FIELDS:
            getattr(state, name).setflags(write=False)
        return state

    def validate_state(self, state: DelayedVRState) -> None:
        super().validate_state(state)
        name = self.name
        for f in _INT_FIELDS:
            v = getattr(state, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name}: state field {f} must be an int, got {v!r}")
        for f in _LIST_FIELDS:
            v = getattr(state, f)
            if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise ValueError(f"{name}: state field {f} must be a list of ints")
        x = state.x
        for f in _FROZEN_FIELDS + _WORK_FIELDS:
            a = getattr(state, f)
            if not isinstance(a, np.ndarray) or a.shape != x.shape or a.dtype != x.dtype or not np.all(np.isfinite(a)):
                raise ValueError(f"{name}: state array {f} must be finite and match x in shape and dtype")
        k, parts = state.version, self._parts()
        if not (state.issued == k or (k > 0 and state.issued == k - 1)):
            raise ValueError(f"{name}: issued={state.issued} inconsistent with version={k}")
        if not 0 <= state.covered <= k:
            raise ValueError(f"{name}: covered={state.covered} outside [0, {k}]")
        for f in ("pending", "gone"):
            v = getattr(state, f)
            if len(set(v)) != len(v) or any(not state.covered < s <= state.issued for s in v):
                raise ValueError(f"{name}: {f} must hold distinct job indices in ({state.covered}, {state.issued}]")
        if set(state.pending) & set(state.gone):
            raise ValueError(f"{name}: a job cannot be both pending and written off")
        if not (isinstance(state.lost_mass, float) and np.isfinite(state.lost_mass) and state.lost_mass >= 0):
            raise ValueError(f"{name}: lost_mass must be a finite float >= 0")
        if state.snap_anchor != _NONE and not 0 <= state.snap_anchor <= k:
            raise ValueError(f"{name}: snapshot anchor {state.snap_anchor} outside [0, {k}]")
        if k == 0 and state.snap_anchor != 0:
            raise ValueError(f"{name}: the initialization snapshot must be in flight at version 0")
        parts_lists = state.snap_todo + state.snap_wait + state.snap_done
        if len(set(parts_lists)) != len(parts_lists) or any(not 0 <= j < parts for j in parts_lists):
            raise ValueError(f"{name}: snapshot parts must be distinct indices in [0, {parts})")
        if state.snap_anchor != _NONE and len(parts_lists) != parts:
            raise ValueError(f"{name}: snapshot parts do not add up to {parts}")
        if len(state.job_ids) != len(state.job_tags):
            raise ValueError(f"{name}: job_ids and job_tags differ in length")
        for f in _INT_FIELDS[5:]:
            if getattr(state, f) < 0:
                raise ValueError(f"{name}: counter {f} is negative")

    # ---- internals
    def _round(self, state: DelayedVRState, k: int, events: dict[str, float]) -> int | None:
        """Steps 1–2 of round k; returns the anchor whose snapshot was applied, if any."""
        keep = self._keep()
        dt = state.v.dtype
        kp = np.asarray(keep, dt)
        state.v *= kp
        state.v += state.acc
        state.acc[...] = 0
        covered_now = None
        anchor = state.snap_anchor
        if anchor != _NONE:
            state.corr *= kp
            state.corr += state.corr_acc
            state.corr_acc[...] = 0
            if len(state.snap_done) == self._parts():
                g = self._snapshot_value(state)
                # v_t = (1-a)^{t-s0} G + S_t: G stands in for every correction with s <= s0
                state.v[...] = np.asarray(keep ** (k - anchor), dt) * g + state.corr
                state.covered = max(state.covered, anchor)
                self._purge_covered(state)
                self._end_snapshot(state)
                state.snapshots_applied += 1
                events["snapshot_applied"] = float(anchor)
                covered_now = anchor
        state.lost_mass *= keep
        x_new = state.x - np.asarray(self.lr, dt) * state.v
        state.x_prev = state.x
        state.x = frozen(x_new)
        state.version = k + 1
        self._expire(state)
        limit = self._excess()
        if limit is not None and self._missing_mass(state) > limit[0]:
            state.excess_rounds += 1
            events["excess"] = 1.0
        period = self._period()
        if period is not None and state.snap_anchor == _NONE and state.version >= state.next_anchor:
            self._launch(state, period)
            events["snapshot_launched"] = float(state.snap_anchor)
        return covered_now

    def _launch(self, state: DelayedVRState, period: int) -> None:
        a0 = state.version
        state.snap_anchor = a0
        state.snap_x = state.x
        state.snap_todo = list(range(self._parts()))
        state.snap_wait, state.snap_done = [], []
        state.next_anchor = a0 + period
        if self._skips_anchor_job():  # basic variant: job a0 and every older correction are covered by G
            state.issued = a0
            state.covered = a0
            self._purge_covered(state)

    def _end_snapshot(self, state: DelayedVRState) -> None:
        state.snap_anchor = _NONE
        state.snap_x = state.x
        state.snap_todo, state.snap_wait, state.snap_done = [], [], []
        for a in (state.snap_sum, state.corr, state.corr_acc):
            a[...] = 0

    def _purge_covered(self, state: DelayedVRState) -> None:
        state.pending = [s for s in state.pending if s > state.covered]
        state.gone = [s for s in state.gone if s > state.covered]

    def _expire(self, state: DelayedVRState) -> None:
        """Jobs older than τ_lost: lost; their weight moves into lost_mass and keeps decaying."""
        tau = self._tau()
        if tau is None:
            return
        keep, k = self._keep(), state.version - 1
        for name, counts in (("pending", True), ("gone", False)):
            stay = []
            for s in getattr(state, name):
                if state.version - s > tau:
                    state.lost_mass += keep ** (k - s)
                    state.lost_total += counts
                else:
                    stay.append(s)
            setattr(state, name, stay)

    def _missing_mass(self, state: DelayedVRState) -> float:
        """M_{k-1} = Σ_{s <= k-1 not received, s > covered} (1-a)^{k-1-s}, k = version."""
        keep, m = self._keep(), state.version - 1
        total = state.lost_mass
        for s in state.pending + state.gone:
            if state.covered < s <= m:
                total += keep ** (m - s)
        return total

    def _blocked(self, state: DelayedVRState) -> bool:
        k = state.version
        anchor = state.snap_anchor
        if (anchor != _NONE and state.issued >= k and len(state.snap_done) < self._parts()
                and k >= anchor + self._window(anchor) and self._waits(anchor)):
            return True
        limit = self._excess()
        return bool(limit is not None and limit[1] and state.issued < k and state.pending
                    and self._missing_mass(state) > limit[0])

    def _take_part(self, state: DelayedVRState, r: Result) -> int | None:
        """Add a snapshot part to the running sum; the part index, or None if it is dropped."""
        anchor = r.iterate_ids[0] if r.iterate_ids else _NONE
        tag = self._pop_tag(state, r.job_id)
        j = self._part_index(r.shard)
        if j is None and r.shard is None and tag is not None and tag < 0:
            j = self._part_of(tag)[1]
        if j is None and r.shard is None and len(state.snap_wait) == 1:
            j = state.snap_wait[0]
        if j is not None:
            t = self._part_tag(anchor, j)
            if t in state.unseen:
                state.unseen.remove(t)
        if (state.snap_anchor == _NONE or anchor != state.snap_anchor or j is None or j in state.snap_done
                or len(r.grads) != 1):
            return None
        if not self._part_count_ok(j, r):  # the worker's shard size disagrees: ask again
            if j in state.snap_wait:
                state.snap_wait.remove(j)
                state.snap_todo.append(j)
            return None
        for lst in (state.snap_wait, state.snap_todo):
            if j in lst:
                lst.remove(j)
        state.snap_done.append(j)
        state.snap_sum += r.grads[0].astype(state.snap_sum.dtype, copy=False)
        return j

    def _part_tag(self, anchor: int, j: int) -> int:
        return -1 - (anchor * self._parts() + j)

    def _part_of(self, tag: int) -> tuple[int, int]:
        return divmod(-1 - tag, self._parts())

    def _pop_tag(self, state: DelayedVRState, job_id: int) -> int | None:
        try:
            i = state.job_ids.index(job_id)
        except ValueError:
            return None
        state.job_ids.pop(i)
        return state.job_tags.pop(i)

    def _forget(self, state: DelayedVRState, job_id: int, s: int) -> None:
        """A pair result arrived: its id and tag are no longer needed."""
        self._pop_tag(state, job_id)
        if s in state.unseen:
            state.unseen.remove(s)

    def _learn(self, state: DelayedVRState, outstanding: Sequence[Any]) -> None:
        """Rebuild the id table from the driver's outstanding jobs (bounded by their number)."""
        known = dict(zip(state.job_ids, state.job_tags, strict=True))
        unseen = list(state.unseen)
        ids, tags = [], []
        for o in outstanding:
            tag = known.get(o.job_id)
            if tag is None:
                if o.kind == JobKind.GRAD_PAIR:
                    tag = o.created_at
                else:
                    anchor = o.iterate_ids[0] if o.iterate_ids else _NONE
                    shard = getattr(o, "shard", None)
                    j = self._part_index(shard) if shard is not None else None
                    if j is not None:
                        tag = self._part_tag(anchor, j)
                    else:  # no shard attribute: the oldest unplaced part of that anchor
                        tag = next((t for t in unseen if t < 0 and self._part_of(t)[0] == anchor), None)
                if tag in unseen:
                    unseen.remove(tag)
            if tag is not None:
                ids.append(o.job_id)
                tags.append(tag)
        state.job_ids, state.job_tags = ids, tags
        state.unseen = [t for t in unseen if self._tag_live(state, t)]

    def _tag_live(self, state: DelayedVRState, tag: int) -> bool:
        if tag > 0:
            return tag in state.pending
        anchor, j = self._part_of(tag)
        return anchor == state.snap_anchor and j in state.snap_wait


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r} (choose one of {', '.join(choices)})")


@dataclass(frozen=True)
class DelayedStormVR(_DelayedVR):
    """A11, STORM-style variance reduction with ordered weights and lost-reply tolerance.

    Jiang, Yu, Li, delayed-feedback variance reduction, preprint dated 20 Oct 2026
    (docs/ALGORITHMS.md §7.2; paper not found, rules from the seed [S] and the spec [I]).

    Correction of job s (GRAD_PAIR on (x_s, x_{s−1}), same sample ξ_s, ``created_at = s``):

        q_s = ∇f(x_s; ξ_s) − (1−a) ∇f(x_{s−1}; ξ_s)

    Round k (R_k = the replies received since round k−1; the driver calls ``apply`` for
    steps 1–2 and ``make_job`` for step 3, see the module docstring for the round counter):

        1. v_k = (1−a) v_{k−1} + Σ_{s∈R_k} (1−a)^{k−s} q_s
        2. x_{k+1} = x_k − η v_k                       (also with no reply)
        3. issue job k+1 on (x_{k+1}, x_k)

    Round 0 sets v_0 to the B_init-sample gradient at x_0 (one blocking GRAD job, handed out by
    ``make_job``; ``make_job`` returns None until it is back) and forms x_1. Every job is applied
    whatever its arrival order, so once every job s ≤ k is in,
    v_k = (1−a)^k v_0 + Σ_{s≤k} (1−a)^{k−s} q_s. Missing mass, logged every round:
    M_k = Σ_{s≤k, not received} (1−a)^{k−s}.

    Choices where the spec is open (§10.5) [I]:

    * Lost jobs: job s is lost once ``version − s > tau_lost`` (after round k it could only
      enter round k+1 with age > τ_lost); ``cancel`` returns it, its iterates are released and a
      late reply is dropped. A job the driver wrote off (``on_lost``) is lost at once. Both keep
      counting in M_k with their decayed weight (1−a)^{k−s}, as the definition of M_k says.
    * ``on_excess="warn"``: rounds with M_k > M_max are only counted (metrics ``excess`` and
      ``excess_rounds``; the driver logs them).
    * ``on_excess="block"``: if M_k > M_max after round k, job k+1 is withheld (``make_job``
      returns None), so no round runs (a round needs its job handed out). Replies to jobs in
      flight keep arriving; each is accumulated for round k+1 and lowers M_k. The algorithm
      resumes as soon as M_k ≤ M_max, or when no job is in flight any more: the rest of M_k is
      then lost mass that waiting cannot lower, so it issues job k+1 anyway and counts a forced
      round (``forced_rounds``) instead of deadlocking. The driver resolves every outstanding
      job (reply or write-off), so a block always ends. While rounds stop, M_k cannot decay.
    * M_k grows with the number of jobs in flight (about Σ_{j<n} (1−a)^j for n busy workers,
      and always < 1/a), so set M_max above that. The default, 10, never triggers with a = 0.1.

    Args:
        lr: η (> 0).
        a: decay a ∈ (0, 1] (a = 1: plain SGD on fresh gradients only).
        B_init: samples in the initial minibatch at x_0 (>= 1).
        tau_lost: a job older than this many rounds is declared lost (>= 0).
        M_max: bound on the missing mass M_k (> 0).
        on_excess: "warn" (count) or "block" (withhold rounds) when M_k > M_max.
    """

    name = "storm-vr"
    lr: float = 0.1
    a: float = 0.1
    B_init: int = 16
    tau_lost: int = 50
    M_max: float = 10.0
    on_excess: Literal["warn", "block"] = "warn"

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("a", self.a, lo=0.0, hi=1.0, lo_open=True)
        check_hyper("B_init", self.B_init, lo=1, integer=True)
        check_hyper("tau_lost", self.tau_lost, lo=0, integer=True)
        check_hyper("M_max", self.M_max, lo=0.0, lo_open=True)
        _check_choice("on_excess", self.on_excess, ("warn", "block"))

    def _tau(self) -> int | None:
        return int(self.tau_lost)

    def _excess(self) -> tuple[float, bool] | None:
        return float(self.M_max), self.on_excess == "block"

    def _part_job(self, state: DelayedVRState, j: int) -> JobSpec:
        return JobSpec(kind=JobKind.GRAD, created_at=state.version, iterate_ids=(state.snap_anchor,),
                       points=(state.snap_x,), batch_size=int(self.B_init))


@dataclass(frozen=True)
class SnapshotVR(_DelayedVR):
    """A12, finite-sum variance reduction with periodic snapshots computed in the background.

    Jiang, Yu, Li, delayed-feedback variance reduction, preprint dated 20 Oct 2026
    (docs/ALGORITHMS.md §7.3; paper not found, rules from the seed [S] and the spec [I]).

    F(x) = (1/N) Σ_i f_i(x). Rounds as in A11 (:class:`DelayedStormVR`) with
    q_s = ∇f_i(x_s) − (1−a) ∇f_i(x_{s−1}) on a component minibatch (``batch``) picked by the
    job's seed; a = 0 is the SARAH/SPIDER recursion. Snapshots:

    * Round 0: v_0 = ∇F(x_0), blocking, as ``shards`` FULL_GRAD jobs over [0, N).
    * Anchor s0 (every m rounds): when x_{s0} is formed (end of round s0−1) FULL_GRAD jobs at
      x_{s0} go out (deadline s0 + D), before the pair job s0; rounds go on. While waiting,
      S_k = (1−a) S_{k−1} + Σ_{received s > s0} (1−a)^{k−s} q_s (S_{s0} = 0); those corrections
      also enter v as usual.
    * In the round t where G = ∇F(x_{s0}) is complete (t ≤ s0 + D): v_t = (1−a)^{t−s0} G + S_t.
      Corrections with s ≤ s0 are covered by G: outstanding ones are cancelled, late ones dropped.
    * G missing at round s0 + D: ``on_deadline="block"`` holds round s0 + D (``make_job`` returns
      None, except to reissue a written-off shard) until G is in, then applies it in that round;
      ``"abandon"`` performs the round with the current v, releases the anchor and cancels its
      shards (``snapshots_abandoned``).
    * ``background=False`` is the basic variant: at s0 the pair job s0 is not issued, every
      correction s ≤ s0 is cancelled or dropped, and round s0 waits for G (v_{s0} = G).

    Choices where the spec is open (§10.5) [I]:

    * Anchors: the initialization is the snapshot at anchor 0; the next one starts at the first
      version ≥ previous anchor + m at which no snapshot is in flight. A snapshot still in flight
      when the next anchor falls due postpones it (snapshots never overlap), e.g. with m = 2, D = 2
      and G for anchor 2 used in round 4, the next anchor is 5, not 4.
    * FULL_GRAD shards are handed out before the round's pair job, so a launch holds the round for
      ``shards`` ``make_job`` calls; shards = 1 (default) diverts one worker.
    * A written-off shard (``on_lost``) is reissued; a written-off pair job stays missing until a
      snapshot covers it. There is no τ_lost: the next snapshot bounds the history.
    * G = Σ shard sums / N; a shard whose reported ``count`` (if non-zero) differs from hi − lo is
      dropped and asked again. FULL_GRAD jobs carry ``batch_size = batch`` (the shard is summed in
      chunks of b; §2.5 charges N/b).

    Args:
        lr: η (> 0).
        a: decay a ∈ [0, 1] (default 0).
        m: snapshot period in rounds (>= 1).
        D: deadline: G of anchor s0 may be used up to round s0 + D (>= 0).
        background: True: compute G while rounds go on; False: the basic, waiting variant.
        on_deadline: "block" (wait for G) or "abandon" (keep v, drop the snapshot); the basic
            variant always waits.
        num_samples: N, the number of components (required; 0 = unknown is refused by ``init``).
        shards: FULL_GRAD jobs per snapshot (>= 1, <= N).
        batch: components per pair job (>= 1).
    """

    name = "snapshot-vr"
    lr: float = 0.1
    a: float = 0.0
    m: int = 100
    D: int = 10
    background: bool = True
    on_deadline: Literal["block", "abandon"] = "block"
    num_samples: int = 0
    shards: int = 1
    batch: int = 1

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("a", self.a, lo=0.0, hi=1.0)
        check_hyper("m", self.m, lo=1, integer=True)
        check_hyper("D", self.D, lo=0, integer=True)
        if not isinstance(self.background, (bool, np.bool_)):
            raise ValueError(f"Invalid background: {self.background!r} (expected a bool)")
        _check_choice("on_deadline", self.on_deadline, ("block", "abandon"))
        if not self.background and self.on_deadline == "abandon":
            raise ValueError("Invalid on_deadline: 'abandon' needs background=True (the basic variant waits)")
        check_hyper("num_samples", self.num_samples, lo=0, integer=True)
        check_hyper("shards", self.shards, lo=1, integer=True)
        if self.num_samples and self.shards > self.num_samples:
            raise ValueError(f"Invalid shards: {self.shards!r} (more than num_samples={self.num_samples})")
        check_hyper("batch", self.batch, lo=1, integer=True)

    def init(self, x0: np.ndarray, *, seed: int):
        if not self.num_samples:
            raise ValueError(f"{self.name} needs num_samples (the problem's N) to shard the full gradient")
        return super().init(x0, seed=seed)

    def _period(self) -> int | None:
        return int(self.m)

    def _parts(self) -> int:
        return int(self.shards)

    def _shard(self, j: int) -> tuple[int, int]:
        n, p = int(self.num_samples), int(self.shards)
        return j * n // p, (j + 1) * n // p

    def _part_index(self, shard: tuple[int, int] | None) -> int | None:
        if shard is None:
            return None
        lo, hi = shard
        for j in range(int(self.shards)):
            if self._shard(j) == (lo, hi):
                return j
        return None

    def _part_count_ok(self, j: int, r: Result) -> bool:
        lo, hi = self._shard(j)
        return r.count in (0, hi - lo)

    def _part_job(self, state: DelayedVRState, j: int) -> JobSpec:
        anchor = state.snap_anchor
        # batch_size = b: the shard is summed in chunks of b (the simulator charges shard size / b).
        return JobSpec(kind=JobKind.FULL_GRAD, created_at=state.version, iterate_ids=(anchor,),
                       points=(state.snap_x,), batch_size=int(self.batch), shard=self._shard(j),
                       deadline=anchor + self._window(anchor))

    def _snapshot_value(self, state: DelayedVRState) -> np.ndarray:
        return state.snap_sum / np.asarray(self.num_samples, state.snap_sum.dtype)

    def _window(self, anchor: int) -> int:
        return int(self.D) if self.background and anchor > 0 else 0

    def _waits(self, anchor: int) -> bool:
        return anchor == 0 or not self.background or self.on_deadline == "block"

    def _skips_anchor_job(self) -> bool:
        return not self.background

    def _pair_batch(self) -> int | None:
        return int(self.batch)

