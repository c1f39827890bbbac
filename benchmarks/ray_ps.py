"""(d) Ray actor parameter server, as in Ray's "Parameter Server" example: a ``@ray.remote`` actor
holds x and ``apply_gradients`` returns it; each worker is a ``@ray.remote`` actor looping
``ray.get(ps.apply_gradients.remote(g))``. One local Ray instance serves the whole sweep (started
in a child process, shut down at the end). Server CPU/RSS are the PS actor process's only (not
raylet, GCS or the object store); arrays >= 100 KB travel through Ray's shared-memory object store.
Needs the ``bench`` extra (``pip install latecomer[bench]``)."""

from __future__ import annotations

import os
import time

from benchmarks.common import LR, Row, peak_rss, server_cpu, skipped, sleep_until, summarize


def unavailable() -> str:
    """Why this backend cannot run here ("" when it can)."""
    try:
        import ray  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"ray not installed ({type(e).__name__}); pip install latecomer[bench]"
    return ""


def _sweep(cells: list[tuple[int, int]], seconds: float, warmup: float, q) -> None:
    import pickle

    import numpy as np
    import ray

    try:
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, object_store_memory=1 << 30,
                 configure_logging=False)
    except Exception as e:  # noqa: BLE001
        for d, w in cells:
            q.put(skipped("ray", d, w, f"ray.init failed: {type(e).__name__}: {e}"[:200]).as_dict())
        q.put(None)
        return

    @ray.remote(num_cpus=1)
    class ParameterServer:
        def __init__(self, d):
            self.x = np.zeros(d, np.float32)

        def apply_gradients(self, g):
            self.x = self.x - np.float32(LR) * g
            return self.x

        def pid(self):
            return os.getpid()

    @ray.remote(num_cpus=1)
    class Worker:
        def __init__(self, ps, d):
            self.ps, self.g = ps, np.full(d, 1e-3, np.float32)

        def warm(self):
            for _ in range(3):
                ray.get(self.ps.apply_gradients.remote(self.g))
            return True

        def run(self, t_end):
            ts, rt = [], []
            now = time.monotonic()
            while now < t_end:
                ray.get(self.ps.apply_gradients.remote(self.g))
                t = time.monotonic()
                ts.append(t)
                rt.append(t - now)
                now = t
            return np.asarray(ts), np.asarray(rt)

    try:
        for d, workers in cells:
            cell_start = time.monotonic()
            try:
                ps = ParameterServer.remote(d)
                pid = ray.get(ps.pid.remote(), timeout=120)
                ws = [Worker.remote(ps, d) for _ in range(workers)]
                ray.get([w.warm.remote() for w in ws], timeout=120)
                t0 = time.monotonic() + warmup
                t1 = t0 + seconds
                futs = [w.run.remote(t1) for w in ws]
                sleep_until(t0)
                cpu0 = server_cpu(pid)
                sleep_until(t1)
                cpu1 = server_cpu(pid)
                rss = peak_rss(pid)
                res = ray.get(futs, timeout=120 + seconds)
                g = np.zeros(d, np.float32)
                nbytes = 2 * len(pickle.dumps(g, protocol=5))
                row = summarize("ray", d, workers, np.concatenate([r[0] for r in res]),
                                np.concatenate([r[1] for r in res]), t0, t1, cpu0, cpu1, rss, nbytes,
                                note="bytes: pickled arrays; CPU/RSS: PS actor only")
            except Exception as e:  # noqa: BLE001
                row = skipped("ray", d, workers, f"{type(e).__name__}: {e}"[:200])
            finally:
                for a in [*locals().get("ws", []), locals().get("ps")]:
                    if a is not None:
                        ray.kill(a)
                ws, ps = [], None
            row.wall_s = time.monotonic() - cell_start
            q.put(row.as_dict())
    finally:
        ray.shutdown()
        q.put(None)


def run_all(cells: list[tuple[int, int]], seconds: float, warmup: float) -> list[Row]:
    """All (d, workers) cells in one spawned child (one Ray instance); bounded, always reaped."""
    import multiprocessing as mp
    import queue

    from benchmarks.common import reap_mp

    why = unavailable()
    if why:
        return [skipped("ray", d, w, why) for d, w in cells]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_sweep, args=(cells, seconds, warmup, q))
    p.start()
    rows: list[Row] = []
    deadline = time.monotonic() + 180 + len(cells) * (seconds + warmup + 60)
    try:
        while True:
            try:
                item = q.get(timeout=max(0.1, min(30.0, deadline - time.monotonic())))
            except queue.Empty:
                if not p.is_alive() or time.monotonic() > deadline:
                    break
                continue
            if item is None:
                break
            rows.append(Row(**item))
    finally:
        reap_mp([p], grace=30)
    done = {(r.d, r.workers) for r in rows}
    rows += [skipped("ray", d, w, "ray sweep ended early (crash or timeout)") for d, w in cells if (d, w) not in done]
    return rows
