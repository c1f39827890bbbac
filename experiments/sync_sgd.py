"""Synchronous minibatch SGD as an experiment-side baseline (not in the global registry).

Round k: every worker gets exactly one GRAD job at x_k; a worker whose job of round k is done
idles (``make_job`` returns None) until the round is complete; once the replies of all workers
that got a job in round k are in, x_{k+1} = x_k − lr · mean(g). So each update waits for the
slowest worker, unlike Rennala SGD with B = n, where fast workers contribute several gradients.

Every outstanding job belongs to the current round (nobody gets a job of round k+1 before
round k is complete), so a job written off (``on_lost``) simply shrinks the round; a reply with
another ``created_at`` (stale) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from algorithms._common import frozen, grad_job
from algorithms.base import Algorithm, Outcome, Result, check_hyper


@dataclass(slots=True)
class SyncState:
    version: int
    x: np.ndarray  # x_k, read-only
    grad_sum: np.ndarray
    received: int = 0  # replies of round k
    lost: int = 0  # jobs of round k written off
    got_job: list[str] = field(default_factory=list)  # workers that have a job of round k


@dataclass(frozen=True)
class SyncSGD(Algorithm):
    """Synchronous SGD over ``n_workers`` workers (one gradient each per step).

    Args:
        lr: step size (> 0).
        n_workers: workers per round (>= 1): a round starts its update only after this many
            jobs went out (minus jobs written off) and all came back.
    """

    name = "sync-sgd"
    lr: float = 0.1
    n_workers: int = 1

    def __post_init__(self) -> None:
        check_hyper("lr", self.lr, lo=0.0, lo_open=True)
        check_hyper("n_workers", self.n_workers, lo=1, integer=True)

    def state_class(self) -> type:
        return SyncState

    def init(self, x0: np.ndarray, *, seed: int):
        x = frozen(np.array(x0, copy=True))
        return SyncState(version=0, x=x, grad_sum=np.zeros_like(x)), []

    def make_job(self, state: SyncState, worker_id: str):
        if worker_id in state.got_job or len(state.got_job) >= self.n_workers:
            return state, None
        state.got_job.append(worker_id)
        return state, grad_job(state.version, state.x)

    def _complete(self, state: SyncState) -> bool:
        issued = len(state.got_job)
        return state.received > 0 and issued >= self.n_workers - state.lost \
            and state.received + state.lost >= issued

    def apply(self, state: SyncState, results: Sequence[Result]):
        applied, dropped, updated = [], [], False
        for r in results:
            if r.created_at != state.version:
                dropped.append(r.job_id)
                continue
            state.grad_sum += r.grads[0]
            state.received += 1
            applied.append(r.job_id)
        if self._complete(state):
            dt = state.x.dtype
            mean = state.grad_sum / np.asarray(state.received, dt)
            state.x = frozen(state.x - np.asarray(self.lr, dt) * mean)
            state.version += 1
            state.grad_sum[...] = 0
            state.received, state.lost, state.got_job = 0, 0, []
            updated = True
        return state, Outcome(applied=tuple(applied), dropped=tuple(dropped), updated=updated,
                              ages=(0,) * len(applied))

    def on_lost(self, state: SyncState, job_ids: Sequence[int]) -> SyncState:
        state.lost += len(job_ids)
        return state

    def live_iterate_ids(self, state: SyncState) -> set[int]:
        return {state.version}
