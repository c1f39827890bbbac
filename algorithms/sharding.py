"""The parameter vector sharded over S server shards, one decision for all (docs/ALGORITHMS.md §14).

Two parts:

* :func:`plan_shards` cuts the layout into S contiguous ranges [lo, hi) of the flat vector,
  the largest as small as possible. A cut falls between two blocks, or inside a block the
  algorithm says it may split (``Algorithm.splittable_blocks``: its vector work there is
  elementwise), never inside any other: a per-matrix LMO/Muon step stays on one shard. A split
  block's pieces are flat blocks of the shards' sub-layouts (``name[a:b]``).
* :class:`Sharded` is an :class:`~algorithms.base.Algorithm` around S + 1 instances of one
  algorithm: a *coordinator*, run on an empty slice of the vector (every decision, no vector
  work), and S shards, the i-th bound to shard i's sub-layout (and its slice of ``lmo_mask``)
  and initialized on its slice of x0. Every call goes to the coordinator and to every shard
  with the same metadata (job ids, kinds, created_at, iterate ids, seeds, counts) and that
  instance's slice of the vectors. Everything scalar an algorithm decides (ages, acceptance and
  drops, rounds, weights, step sizes, thresholds, M_k, cancels, the jobs it asks for) is a
  function of that metadata, so the coordinator decides it without any vector and every shard
  decides the same; :class:`Sharded` returns the coordinator's decision and checks every
  shard's against it (each Outcome, JobSpec header, cancel list, live iterate set, metrics and
  version), raising :class:`ShardDisagreement` on a difference. A decision that looked at the
  vector would differ on the empty coordinator even with S = 1. The vector work (elementwise
  kernels, per-block Newton–Schulz) is the algorithm's own code on its slice: there is one
  implementation of each algorithm, and the unsharded algorithm is the S = 1 case.

Reductions over the whole gradient travel as per-block scalars: an algorithm that
``needs_block_norms`` (``clip_norm``: the norm of the whole gradient) reads
``Result.block_sq``, the gradient's squared norm per block of the whole layout. :meth:`Sharded.apply`
measures it on the whole gradient before slicing (as the coordinator of a multi-process server
gathers it from its shards, each measuring its own whole blocks) and gives every instance the
same figures, so the coordinator (no vector) and every shard clip by the same factor, the bits of
one process. A reduction over the algorithm's own *state* (``needs_step_norms``:
``ringmaster-lmo`` with ``lmo="l2"`` divides by the norm of the whole momentum u) is gathered
per reply: every shard's ``step_sq`` (its blocks' ‖u_b‖², on its state before the step), in
shard order, goes to every instance as ``Result.step_sq``. What may not be sharded: an algorithm
whose vector work needs another reduction over the whole vector says so through
``Algorithm.shard_refusal``, and :meth:`Sharded.bind` refuses it with that reason; so does an
algorithm that does not declare its vector work per-block (a user's own, unless it overrides
``shard_refusal``).

The coordinator/shard split of a multi-process server follows the same seam: the coordinator
process would run the algorithm on the empty slice (ledger and decisions, headers only) and send
its decisions to the shard processes, which run it on their blocks and must agree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from algorithms.base import Algorithm, JobSpec, Outcome, Result, bind_layout
from protocol.messages import JobKind

__all__ = ["ShardPlan", "plan_shards", "Sharded", "ShardedState", "ShardDisagreement", "shard_refusal",
           "splittable_blocks"]


_MERGED_KEPT = 2  # concatenated iterates kept besides the current job's (an id is asked for by many jobs; a pair
# job reuses its older point), so a shard's iterate is concatenated once, not once per job


class ShardDisagreement(RuntimeError):
    """Two shards decided differently: the "decided once" invariant is broken."""


@dataclass(frozen=True)
class ShardPlan:
    """Which layout blocks, or pieces of blocks, each shard owns.

    ``blocks[i]`` = (first, stop) indices of the blocks shard i touches (a contiguous run; a
    split block is touched by two or more shards);
    ``ranges[i]`` = (lo, hi) shard i's range of the flat vector;
    ``pieces[i]`` = ((block index, start, stop), ...) the coordinates of each block it owns,
    counted within the block (start 0, stop its size: the whole block). Empty: whole blocks,
    ``blocks[i]``.
    """

    layout: tuple
    blocks: tuple[tuple[int, int], ...]
    ranges: tuple[tuple[int, int], ...]
    pieces: tuple = ()

    @property
    def shards(self) -> int:
        return len(self.blocks)

    @property
    def split(self) -> bool:
        """Whether some block is cut between shards."""
        return any(a != 0 or b != math.prod(self.layout[k][1]) for p in self.pieces for k, a, b in p)

    def _pieces(self, i: int) -> tuple:
        if self.pieces:
            return self.pieces[i]
        a, b = self.blocks[i]
        return tuple((k, 0, math.prod(self.layout[k][1])) for k in range(a, b))

    def sub_layout(self, i: int) -> tuple:
        out = []
        for k, a, b in self._pieces(i):
            name, shape = self.layout[k]
            out.append(self.layout[k] if (a, b) == (0, math.prod(shape)) else (f"{name}[{a}:{b}]", (b - a,)))
        return tuple(out)

    def sub_mask(self, i: int, lmo_mask: Sequence[bool] | None) -> tuple[bool, ...] | None:
        """Shard i's slice of ``lmo_mask``. Without one, None, unless a block is split: then the
        default rule's flags over the whole layout, sliced (a piece of a block is a flat block,
        which the rule would read differently)."""
        if lmo_mask is None:
            if not self.split:
                return None
            from algorithms.lmo import default_lmo_mask
            lmo_mask = default_lmo_mask(self.layout)
        mask = tuple(lmo_mask)
        return tuple(bool(mask[k]) for k, _, _ in self._pieces(i))


def _sizes(layout: tuple) -> list[int]:
    return [math.prod(shape) for _, shape in layout]


def plan_shards(layout: tuple, shards: int, splittable: Sequence[bool] | None = None) -> ShardPlan:
    """``layout`` over ``shards`` shards, contiguous ranges, the largest as small as possible.
    Deterministic.

    Without ``splittable`` (or with none True), whole blocks: contiguous runs of blocks (ties:
    the earliest cuts). With ``splittable`` (one bool per block), a cut may also fall inside a
    block flagged True: the smallest largest range is found by bisection over a greedy fill
    (cuts as late as possible), then a shard is cut in two near its middle while there are
    fewer than ``shards``.

    Raises:
        ValueError: ``shards`` < 1, a ``splittable`` of the wrong length, or more shards than
            the layout can be cut into.
    """
    layout = tuple(layout)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"Invalid shards: {shards!r} (an integer >= 1)")
    sizes = _sizes(layout)
    n = len(sizes)
    if splittable is not None:
        splittable = tuple(bool(b) for b in splittable)
        if len(splittable) != n:
            raise ValueError(f"splittable has {len(splittable)} flags for {n} layout blocks")
        if any(s and sizes[k] > 1 for k, s in enumerate(splittable)):
            return _plan_split(layout, sizes, shards, splittable)
    if shards > max(n, 1):
        raise ValueError(f"cannot shard {n} layout block(s) over {shards} shards: a block is never split "
                         f"(give at most {max(n, 1)} shards)")
    if n == 0:
        return ShardPlan(layout, ((0, 0),), ((0, 0),))
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[j][i]: the smallest largest run over blocks [0, i) cut into j runs; cut[j][i] its last cut
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(shards + 1)]
    cut = [[0] * (n + 1) for _ in range(shards + 1)]
    best[0][0] = 0
    for j in range(1, shards + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):
                v = max(best[j - 1][c], prefix[i] - prefix[c])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, c
    bounds = [n]
    for j in range(shards, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    bounds.reverse()
    blocks = tuple((bounds[i], bounds[i + 1]) for i in range(shards))
    ranges = tuple((prefix[a], prefix[b]) for a, b in blocks)
    return ShardPlan(layout, blocks, ranges)


def _plan_split(layout: tuple, sizes: list[int], shards: int, splittable: tuple[bool, ...]) -> ShardPlan:
    """Cuts at block boundaries, or anywhere inside a splittable block: the smallest cap on a
    shard's size that a greedy fill meets (bisection), then shard by shard the end nearest an
    even share of what is left among those after which the rest still fits under the cap."""
    total = sum(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # an unsplittable block is one atom (it cannot be cut), a splittable one as many as its coordinates
    solid = [bool(s) and not sp for s, sp in zip(sizes, splittable, strict=True)]
    atoms_after = [0] * (len(sizes) + 1)  # atoms in blocks k.. (whole)
    for k in range(len(sizes) - 1, -1, -1):
        atoms_after[k] = atoms_after[k + 1] + (1 if solid[k] else sizes[k])
    if shards > atoms_after[0]:
        whole = [layout[k][0] for k in range(len(sizes)) if solid[k]]
        raise ValueError(f"cannot shard {total} coordinates over {shards} shards: at most {atoms_after[0]} (a "
                         f"block is split only where the algorithm's vector work is elementwise; whole: "
                         f"{', '.join(whole) or 'none'})")

    def block_at(pos: int) -> int:
        """The block holding coordinate ``pos`` (the first non-empty one starting there)."""
        lo, hi = 0, len(sizes)
        while lo < hi:
            mid = (lo + hi) // 2
            if prefix[mid + 1] <= pos:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def atoms(pos: int) -> int:
        """Atoms from ``pos`` (a cut point: a boundary, or inside a splittable block) on."""
        k = block_at(pos) if pos < total else len(sizes)
        return atoms_after[k] - (pos - prefix[k] if k < len(sizes) and not solid[k] else 0)

    def greedy(pos: int, cap: int) -> int:
        """Shards a fill from ``pos`` with at most ``cap`` each takes (as late cuts as can be)."""
        count, load = 0, 0
        k0 = block_at(pos) if pos < total else len(sizes)
        for k in range(k0, len(sizes)):
            left = prefix[k + 1] - max(pos, prefix[k])
            if solid[k]:
                if count == 0 or load + left > cap:
                    count, load = count + 1, 0
                load += left
            else:
                while left:
                    if count == 0 or load == cap:
                        count, load = count + 1, 0
                    take = min(left, cap - load)
                    load, left = load + take, left - take
            if count > shards:
                return count
        return count

    lo, hi = max(max((s for s, so in zip(sizes, solid, strict=True) if so), default=0), -(-total // shards)), total
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(0, mid) > shards:
            lo = mid + 1
        else:
            hi = mid
    cap = lo

    def fits(c: int, rest: int) -> bool:
        """The coordinates from ``c`` on make exactly ``rest`` shards under the cap."""
        return greedy(c, cap) <= rest <= atoms(c)

    def cut(pos: int, aim: float, rest: int) -> int:
        """The cut in (pos, pos + cap] nearest ``aim`` (ties: the earlier) after which the rest
        makes ``rest`` shards. Inside a splittable block the cuts that fit are an interval (the
        greedy count falls, the atoms left fall, as the cut moves on): it is found by bisection."""
        end, found = min(pos + cap, total), []
        k = block_at(pos)
        while k < len(sizes) and prefix[k] < end:
            b0, b1 = prefix[k], prefix[k + 1]
            if pos < b1 <= end and fits(b1, rest):
                found.append(b1)
            c_lo, c_hi = max(b0, pos) + 1, min(b1 - 1, end)  # cuts inside the block
            if not solid[k] and c_lo <= c_hi and greedy(c_hi, cap) <= rest:
                lo_, hi_ = c_lo, c_hi
                while lo_ < hi_:
                    mid = (lo_ + hi_) // 2
                    if greedy(mid, cap) <= rest:
                        hi_ = mid
                    else:
                        lo_ = mid + 1
                c_min = lo_
                if atoms(c_min) >= rest:
                    lo_, hi_ = c_min, c_hi
                    while lo_ < hi_:
                        mid = (lo_ + hi_ + 1) // 2
                        if atoms(mid) >= rest:
                            lo_ = mid
                        else:
                            hi_ = mid - 1
                    found.extend(min(max(c, c_min), lo_) for c in (math.floor(aim), math.ceil(aim)))
            k += 1
        if not found:  # unreachable: the greedy fill's own cut fits
            raise AssertionError(f"no cut after {pos} for {rest} more shards")
        return min(found, key=lambda c: (abs(c - aim), c))

    bounds = [0]
    for j in range(shards - 1):
        pos = bounds[-1]
        bounds.append(cut(pos, pos + (total - pos) / (shards - j), shards - j - 1))
    bounds.append(total)
    pieces, blocks = [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        last = b == total
        ps = [(k, max(a, prefix[k]) - prefix[k], min(b, prefix[k + 1]) - prefix[k]) for k in range(len(sizes))
              if (prefix[k] < b and prefix[k + 1] > a)
              or (sizes[k] == 0 and a <= prefix[k] and (prefix[k] < b or last))]  # an empty block: where it starts
        pieces.append(tuple(ps))
        blocks.append((ps[0][0], ps[-1][0] + 1))
    return ShardPlan(layout, tuple(blocks), tuple(zip(bounds[:-1], bounds[1:], strict=True)), tuple(pieces))


def splittable_blocks(alg: Algorithm, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> tuple[bool, ...]:
    """``alg.splittable_blocks(layout, lmo_mask)``, checked (an algorithm without the method
    splits nothing)."""
    fn = getattr(alg, "splittable_blocks", None)
    if fn is None:
        return (False,) * len(tuple(layout))
    got = tuple(bool(b) for b in fn(tuple(layout), lmo_mask))
    if len(got) != len(tuple(layout)):
        raise ValueError(f"splittable_blocks gave {len(got)} flags for {len(tuple(layout))} layout blocks")
    return got


def shard_refusal(alg: Algorithm) -> str:
    """Why ``alg`` cannot be sharded over whole blocks ("" when it can)."""
    fn = getattr(alg, "shard_refusal", None)
    if fn is None:
        return "it does not say whether its vector work is elementwise or per layout block"
    return fn()


@dataclass(slots=True)
class ShardedState:
    """The coordinator's state (over an empty vector) and one state per shard (each the wrapped
    algorithm's own state over its slice)."""

    coordinator: Any
    parts: list
    merged: dict = field(default_factory=dict)  # iterate id -> (the shards' arrays, their concatenation)


def _same_spec_header(a: JobSpec, b: JobSpec) -> bool:
    return (a.kind == b.kind and a.created_at == b.created_at and tuple(a.iterate_ids) == tuple(b.iterate_ids)
            and a.batch_size == b.batch_size and a.shard == b.shard and a.deadline == b.deadline
            and len(a.points) == len(b.points))


def _same_metrics(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if x != y and not (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
            return False
    return True


def _same_outcome(a: Outcome, b: Outcome) -> bool:
    return (tuple(a.applied) == tuple(b.applied) and tuple(a.dropped) == tuple(b.dropped)
            and bool(a.updated) == bool(b.updated) and tuple(a.ages) == tuple(b.ages)
            and _same_metrics(dict(a.metrics), dict(b.metrics)))


@dataclass(frozen=True)
class Sharded(Algorithm):
    """``inner`` decided by a coordinator and run on S shards of whole layout blocks, every
    shard's decision checked against the coordinator's.

    Build it around an unbound algorithm (wrappers included) and let the driver bind it:
    ``bind_layout(Sharded(alg, n_shards=S), problem.layout, problem.lmo_mask)``. Attribute reads
    it does not answer (hyper-parameters) go to ``inner``.

    Args:
        inner: the algorithm (one implementation, run by the coordinator and by each shard).
        n_shards: S >= 1 (not ``shards``: ``snapshot-vr`` has a hyper-parameter of that name,
            its FULL_GRAD data shards, which attribute reads pass on to).
    """

    inner: Algorithm
    n_shards: int = 1
    plan: ShardPlan | None = None  # set by bind
    parts: tuple = ()  # the per-shard bound algorithms, set by bind
    mask: tuple | None = None  # the lmo_mask bound with (all shards' slices together), set by bind
    coordinator: Algorithm | None = None  # inner bound to no blocks: the decisions alone, set by bind

    def __getattr__(self, item: str) -> Any:
        if item in ("inner", "parts", "plan", "n_shards", "mask", "coordinator") or item.startswith("__"):
            raise AttributeError(item)
        return getattr(self.inner, item)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def mode(self) -> str:  # type: ignore[override]
        return self.inner.mode

    # ---- binding and the plan
    def bind(self, layout: tuple, lmo_mask: Sequence[bool] | None = None) -> Sharded:
        """Plan the shards over ``layout``, bind one copy of ``inner`` to each sub-layout and
        one, the coordinator, to no blocks.

        Raises:
            ValueError: the algorithm cannot be sharded (``shard_refusal``; whatever S, since the
                coordinator runs it on no vector), or the layout has fewer blocks than shards.
        """
        mask = None if lmo_mask is None else tuple(bool(b) for b in lmo_mask)
        if self.plan is not None and self.plan.layout == tuple(layout) and self.mask == mask:
            return self  # already bound to it (its parts, maybe given by with_parts, are kept)
        reason = shard_refusal(self.inner)
        if reason:  # even for S = 1: the coordinator runs it on no vector at all
            raise ValueError(f"{self.inner.name or type(self.inner).__name__} cannot be sharded: {reason}")
        plan = plan_shards(tuple(layout), self.n_shards, splittable_blocks(self.inner, layout, lmo_mask))
        parts = tuple(bind_layout(self.inner, plan.sub_layout(i), plan.sub_mask(i, lmo_mask))
                      for i in range(plan.shards))
        return dataclasses.replace(self, plan=plan, parts=parts, mask=mask, coordinator=bind_layout(self.inner, ()))

    def with_parts(self, parts: Sequence[Algorithm]) -> Sharded:
        """The same plan and coordinator with these per-shard algorithms (tests give one shard
        other settings)."""
        if self.plan is None or len(parts) != self.plan.shards:
            raise ValueError("with_parts needs a bound Sharded and one algorithm per shard")
        return dataclasses.replace(self, parts=tuple(parts))

    def _need_plan(self) -> ShardPlan:
        if self.plan is None:
            raise ValueError("Sharded must be bound to the problem's layout before init (bind_layout)")
        return self.plan

    def _slices(self) -> list[slice]:
        return [slice(lo, hi) for lo, hi in self._need_plan().ranges]

    def _all(self, state: ShardedState):
        """(instance, its state's index or None for the coordinator, its slice), coordinator first."""
        yield self.coordinator, None, slice(0, 0)
        for i, (alg, sl) in enumerate(zip(self.parts, self._slices(), strict=True)):
            yield alg, i, sl

    @staticmethod
    def _get(state: ShardedState, i: int | None) -> Any:
        return state.coordinator if i is None else state.parts[i]

    @staticmethod
    def _put(state: ShardedState, i: int | None, st: Any) -> None:
        if i is None:
            state.coordinator = st
        else:
            state.parts[i] = st

    # ---- the agreement checks
    def _agree(self, what: str, values: Sequence[Any], same=lambda a, b: a == b) -> Any:
        """``values[0]``, the coordinator's decision, after checking each shard's (``values[1:]``)."""
        first = values[0]
        for i, v in enumerate(values[1:]):
            if not same(first, v):
                raise ShardDisagreement(f"{self.name}: shard {i} disagrees with the coordinator on {what}: "
                                        f"{v!r} != {first!r}")
        return first

    def _merge(self, state: ShardedState, specs: Sequence[JobSpec | None]) -> JobSpec | None:
        """One JobSpec from the coordinator's and the shards' specs: the coordinator's header
        (each shard's checked equal), the shards' points concatenated."""
        if all(s is None for s in specs):
            return None
        if any(s is None for s in specs):
            raise ShardDisagreement(f"{self.name}: the coordinator and the shards disagree on asking for a job: "
                                    f"{specs!r}")
        head = self._agree("the job asked for", specs, _same_spec_header)
        specs = specs[1:]
        if len(specs) == 1:
            return specs[0]
        points = []
        for j, iid in enumerate(head.iterate_ids):
            arrays = tuple(s.points[j] for s in specs)
            known = state.merged.get(iid)
            if known is not None and len(known[0]) == len(arrays) and all(
                    a is b for a, b in zip(known[0], arrays, strict=True)):
                points.append(known[1])
                continue
            merged = np.concatenate(arrays)
            merged.setflags(write=False)
            state.merged[iid] = (arrays, merged)
            points.append(merged)
        keep = set(head.iterate_ids)
        old = [i for i in state.merged if i not in keep]  # oldest first (insertion order)
        for iid in old[:max(0, len(old) - _MERGED_KEPT)]:
            del state.merged[iid]
        return dataclasses.replace(head, points=tuple(points))

    def _part_spec(self, spec: JobSpec, sl: slice) -> JobSpec:
        return dataclasses.replace(spec, points=tuple(p[sl] for p in spec.points))

    @staticmethod
    def _part_result(r: Result, sl: slice) -> Result:
        return dataclasses.replace(r, grads=tuple(g[sl] for g in r.grads))

    # ---- Algorithm interface
    def init(self, x0: np.ndarray, *, seed: int):
        plan = self._need_plan()
        x0 = np.asarray(x0)
        if x0.ndim != 1 or (plan.layout and plan.ranges[-1][1] != x0.shape[0]):
            raise ValueError(f"{self.name}: x0 of shape {x0.shape} does not match the sharded layout "
                             f"({plan.ranges[-1][1]} values)")
        states, jobs = [], []
        for alg, _, sl in self._all(None):
            st, js = alg.init(x0[sl], seed=seed)
            states.append(st)
            jobs.append(js)
        state = ShardedState(coordinator=states[0], parts=states[1:])
        n = self._agree("the number of initial jobs", [len(j) for j in jobs])
        return state, [self._merge(state, [j[t] for j in jobs]) for t in range(n)]

    def make_job(self, state: ShardedState, worker_id: str):
        specs = []
        for alg, i, _ in self._all(state):
            st, spec = alg.make_job(self._get(state, i), worker_id)
            self._put(state, i, st)
            specs.append(spec)
        return state, self._merge(state, specs)

    def needs_block_norms(self) -> bool:
        from algorithms.wrappers import needs_block_norms

        return needs_block_norms(self.inner)

    def _with_block_sq(self, results: Sequence[Result]) -> list[Result]:
        """The results with ``block_sq`` measured on the whole gradient, where the algorithm needs
        it and the driver did not give it."""
        from algorithms.wrappers import block_sq_sums

        layout = self._need_plan().layout
        return [r if r.block_sq is not None or r.kind == JobKind.FULL_GRAD or not r.grads
                else dataclasses.replace(r, block_sq=block_sq_sums(r.grads[0], layout)) for r in results]

    def needs_step_norms(self) -> bool:
        from algorithms.wrappers import needs_step_norms

        return needs_step_norms(self.inner)

    def _with_step_sq(self, state: ShardedState, results: Sequence[Result]) -> list[Result]:
        """The result with ``step_sq`` gathered from every shard (each its blocks' figures, on its
        state before the step), in shard order: as a multi-process coordinator gathers it, one
        reply at a time."""
        if len(results) != 1:
            raise ValueError(f"{self.name}: a norm over the state of every shard is gathered for one reply "
                             f"at a time, not {len(results)}")
        r = results[0]
        if r.step_sq is not None:
            return [r]
        parts = [alg.step_sq(state.parts[i], self._part_result(r, sl))
                 for alg, i, sl in self._all(state) if i is not None]
        if all(p is None for p in parts):
            return [r]
        return [dataclasses.replace(r, step_sq=tuple(v for p in parts for v in p))]

    def apply(self, state: ShardedState, results: Sequence[Result]):
        if self.needs_block_norms():
            results = self._with_block_sq(results)
        if self.needs_step_norms():
            results = self._with_step_sq(state, results)
        outcomes = []
        for alg, i, sl in self._all(state):
            st, out = alg.apply(self._get(state, i), [self._part_result(r, sl) for r in results])
            self._put(state, i, st)
            outcomes.append(out)
        return state, self._agree("the outcome", outcomes, _same_outcome)

    def params(self, state: ShardedState) -> np.ndarray:
        xs = [alg.params(st) for alg, st in zip(self.parts, state.parts, strict=True)]
        return np.concatenate(xs) if len(xs) > 1 else xs[0]

    def version(self, state: ShardedState) -> int:
        return self._agree("the version", [alg.version(self._get(state, i)) for alg, i, _ in self._all(state)])

    def cancel(self, state: ShardedState, outstanding: Sequence[Any]) -> list[int]:
        return list(self._agree("the jobs to cancel", [list(alg.cancel(self._get(state, i), outstanding))
                                                       for alg, i, _ in self._all(state)]))

    def on_issued(self, state: ShardedState, job_id: int, spec: JobSpec) -> ShardedState:
        for alg, i, sl in self._all(state):
            self._put(state, i, alg.on_issued(self._get(state, i), job_id, self._part_spec(spec, sl)))
        return state

    def on_lost(self, state: ShardedState, job_ids: Sequence[int]) -> ShardedState:
        for alg, i, _ in self._all(state):
            self._put(state, i, alg.on_lost(self._get(state, i), job_ids))
        return state

    def live_iterate_ids(self, state: ShardedState) -> set[int]:
        return set(self._agree("the live iterates", [set(alg.live_iterate_ids(self._get(state, i)))
                                                      for alg, i, _ in self._all(state)]))

    def metrics(self, state: ShardedState) -> dict[str, float]:
        return dict(self._agree("the metrics", [alg.metrics(self._get(state, i)) for alg, i, _ in self._all(state)],
                                _same_metrics))

    def shard_refusal(self) -> str:
        return shard_refusal(self.inner)

    # ---- state save/load: the coordinator's state dict and one per shard
    def _keys(self) -> list[str]:
        return ["coordinator"] + [f"shard{i}" for i in range(len(self.parts))]

    def to_state_dict(self, state: ShardedState) -> dict[str, Any]:
        return {k: alg.to_state_dict(self._get(state, i)) for k, (alg, i, _) in zip(self._keys(), self._all(state),
                                                                                   strict=True)}

    def from_state_dict(self, d: dict[str, Any]) -> ShardedState:
        want = self._keys()
        if sorted(d) != sorted(want):
            raise ValueError(f"{self.name}: sharded state dict keys {sorted(d)} do not match {want}")
        states = [alg.from_state_dict(d[k]) for k, (alg, _, _) in zip(want, self._all(None), strict=True)]
        state = ShardedState(coordinator=states[0], parts=states[1:])
        self.validate_state(state)
        return state

    def state_class(self) -> type:
        return ShardedState

    def validate_state(self, state: ShardedState) -> None:
        if not isinstance(state, ShardedState) or len(state.parts) != len(self.parts):
            raise ValueError(f"{self.name}: not a state of {len(self.parts)} shards")
        for alg, i, _ in self._all(state):
            alg.validate_state(self._get(state, i))
        self.version(state)
