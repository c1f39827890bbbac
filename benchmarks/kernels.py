"""Microbenchmark of the server's per-update vector kernels (algorithms/_pool.py).

Milliseconds per call, float32, of: the plain two-pass ``step_into`` (numpy over whole arrays,
as before cache blocking) against the blocked one; the core's finiteness check followed by the
plain step (``math.isfinite(np.dot(g, g))`` then step) against the fused ``step_into_checked``;
``add_scaled`` plain against blocked; the momentum update ``m *= c; add_scaled(m, a, g);
step_into(x, lr, m)`` with the plain helpers against the fused ``momentum_step``; and the
``vector passes`` reference of benchmarks/bench.py (``torch.add(x, g, alpha=-lr, out=y)``, one
thread; fused multiply-add, so not bit-identical and not used by the server). Two cache states:

* warm: the same x, g and output buffer every call (as benchmarks/reference.py times the
  reference): everything at d <= 1e6 is in L3;
* cold: a 64 MiB array is written between calls, and x, g and the output rotate through a few
  buffers like a chain of iterates, so x and g come from memory, as in the live daemon where the
  network copies and the rest of the server evict them.

Median of repetitions, variants interleaved. ``--block N`` sets the block size (elements) to
sweep it.

    python -m benchmarks.kernels [--sizes 1000,100000,1000000,10000000] [--block 65536]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import numpy as np

from algorithms import _pool
from algorithms._pool import POOL

LR = 0.01
EVICT = np.ones(64 * 2**20 // 8)


def old_step_into(x: np.ndarray, lr: float, d: np.ndarray) -> np.ndarray:
    y = POOL.empty(x.shape, x.dtype)
    np.multiply(d, np.asarray(-lr, x.dtype), out=y)
    np.add(x, y, out=y)
    y.setflags(write=False)
    return y


def old_check_step(x: np.ndarray, lr: float, g: np.ndarray) -> np.ndarray | None:
    if not math.isfinite(np.dot(g, g)) and not np.isfinite(g).all():
        return None
    return old_step_into(x, lr, g)


def old_add_scaled(m: np.ndarray, a: float, g: np.ndarray) -> None:
    t = POOL.empty(m.shape, m.dtype)
    np.multiply(g, np.asarray(a, m.dtype), out=t)
    m += t


def old_momentum(x: np.ndarray, lr: float, m: np.ndarray, c: float, a: float, g: np.ndarray) -> np.ndarray:
    m *= np.asarray(c, m.dtype)
    old_add_scaled(m, a, g)
    return old_step_into(x, lr, m)


def _torch_ref() -> Callable | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)

    def ref(x: np.ndarray, lr: float, g: np.ndarray, y: np.ndarray) -> None:
        torch.add(torch.from_numpy(x), torch.from_numpy(g), alpha=-lr, out=torch.from_numpy(y))
    return ref


def measure(d: int, cold: bool, budget_s: float) -> dict[str, float]:
    """Median ms per call of each variant at d float32 elements."""
    rng = np.random.default_rng(d)
    xs = [rng.standard_normal(d).astype(np.float32) for _ in range(3)]
    gs = [rng.standard_normal(d).astype(np.float32) for _ in range(3)]
    ms = [np.zeros(d, np.float32) for _ in range(3)]
    outs = [np.empty(d, np.float32) for _ in range(3)]
    ref = _torch_ref()
    variants: dict[str, Callable[[int], object]] = {
        "step old": lambda k: old_step_into(xs[k], LR, gs[k]),
        "step blocked": lambda k: _pool.step_into(xs[k], LR, gs[k]),
        "check+step old": lambda k: old_check_step(xs[k], LR, gs[k]),
        "checked fused": lambda k: _pool.step_into_checked(xs[k], LR, gs[k]),
        "add_scaled old": lambda k: old_add_scaled(ms[k], 0.1, gs[k]),
        "add_scaled blocked": lambda k: _pool.add_scaled(ms[k], 0.1, gs[k]),
        "momentum old": lambda k: old_momentum(xs[k], LR, ms[k], 0.9, 0.1, gs[k]),
        "momentum fused": lambda k: _pool.momentum_step(xs[k], LR, ms[k], 0.9, 0.1, gs[k]),
    }
    if ref is not None:
        variants["torch.add ref"] = lambda k: ref(xs[k], LR, gs[k], outs[k])
    times: dict[str, list[float]] = {k: [] for k in variants}
    for f in variants.values():  # warm-up: map the pooled buffers
        f(0)
    end = time.perf_counter() + budget_s
    rep = 0
    while rep < 5 or (rep < 2000 and time.perf_counter() < end):
        k = rep % 3 if cold else 0
        for name, f in variants.items():
            if cold:
                EVICT.fill(rep)
            t = time.perf_counter()
            f(k)
            times[name].append(time.perf_counter() - t)
        rep += 1
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,100000,1000000,10000000")
    ap.add_argument("--block", type=int, default=_pool.BLOCK)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per (size, cache state) cell")
    a = ap.parse_args(argv)
    _pool.BLOCK, _pool.BLOCKED_MIN = a.block, 2 * a.block
    sizes = [int(float(s)) for s in a.sizes.split(",")]
    print(f"block {_pool.BLOCK} elements, blocked from {_pool.BLOCKED_MIN}; ms per call, float32, median")
    names = None
    for cold in (False, True):
        for d in sizes:
            r = measure(d, cold, a.budget)
            if names is None:
                names = list(r)
                print("| cache | d | " + " | ".join(names) + " |")
                print("|---|---|" + "---|" * len(names))
            print(f"| {'cold' if cold else 'warm'} | {d:,} | " + " | ".join(f"{r[n]:.4f}" for n in names) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
