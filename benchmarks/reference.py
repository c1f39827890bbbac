"""The vector work an update must do at the least: the denominator of "server CPU per update /
vector passes" in the bench's ratio table.

Plain async SGD reads g and x and writes the new x: ``torch.add(x, g, alpha=-lr, out=y)`` on
``torch.from_numpy`` views of float32 arrays (one fused pass over three vectors), single-threaded,
median of several repetitions after a warm-up call (so the output pages are already mapped).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks.common import LR


def torch_threads() -> int:
    """torch's intra-op thread count as the process starts (before the measurement pins it to 1)."""
    import torch

    return torch.get_num_threads()


def vector_pass_s(d: int, *, budget_s: float = 0.25, min_reps: int = 5, max_reps: int = 1000) -> float:
    """Median seconds of one fused ``y = x - lr*g`` over d float32 on one thread."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = np.zeros(d, np.float32)
        g = np.full(d, 1e-3, np.float32)
        y = np.empty_like(x)
        xt, gt, yt = torch.from_numpy(x), torch.from_numpy(g), torch.from_numpy(y)
        torch.add(xt, gt, alpha=-LR, out=yt)
        times: list[float] = []
        end = time.perf_counter() + budget_s
        while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() < end):
            t = time.perf_counter()
            torch.add(xt, gt, alpha=-LR, out=yt)
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
        torch.set_num_threads(prev)


def vector_passes(sizes: list[int]) -> dict[int, float]:
    return {d: vector_pass_s(d) for d in sizes}


def ceiling_s(d: int, *, budget_s: float = 0.25, min_reps: int = 5, max_reps: int = 1000) -> float:
    """Median seconds of one update of the bench workload with no transport, on one thread: the
    worker's part (the synthetic problem's gradient written into the buffer the server reads,
    as the same-host path does) and the server's (the finiteness check and the step, with the
    server's own kernels). 1 / this is the no-transport ceiling of updates/s."""
    from algorithms._pool import finite, step_into
    from problems.synthetic import make_synthetic

    problem = make_synthetic(d)
    x = problem.init_params(0)
    gbuf = np.empty(d, np.float32)

    def one(x: np.ndarray) -> np.ndarray:
        np.copyto(gbuf, problem.grad(x, 0, 1).grad)
        if not finite(gbuf):
            raise AssertionError("the synthetic gradient is finite")
        return step_into(x, LR, gbuf)

    x = one(x)
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() < end):
        t = time.perf_counter()
        x = one(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
