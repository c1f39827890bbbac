"""Simulator speed: simulated jobs (replies applied) per wall second (the ``simulator`` bench row).

The §8.1 quadratic at d = 1,000, plain async SGD (``asgd``), 100 simulated workers with sqrt
delays (τ_i = √i plus half-normal noise), driven by :class:`ps.drivers.sim.Simulator` in this process:
the same ServerCore, algorithm and worker compute (``worker.compute.run_job``) as a real run,
with simulated time. A fixed number of updates is timed, cut into windows of equal update
counts; the rate is the median window. CPU per update is this process's CPU time over the timed
updates. Bytes, round trip and RSS have no meaning here (n/a).

    python -m benchmarks.sim_speed [--updates 35000]
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import N_WINDOWS, Row

D = 1000
WORKERS = 100
UPDATES = 35_000  # about 3.5 s on the reference machine (2 shared cores)
QUICK_UPDATES = 12_000
WARM_UPDATES = 500
LR = 0.002  # lr * L * (max delay ~ 2 n) < 1: no divergence, hence no rejected replies, however long


def run(updates: int = UPDATES, *, d: int = D, workers: int = WORKERS, warm: int = WARM_UPDATES) -> Row:
    import algorithms
    from problems import load_problem
    from ps.core.config import CoreConfig
    from ps.drivers.sim import DelayModel, Simulator

    problem = load_problem("quadratic", {"d": d})
    alg = algorithms.build("asgd", {"lr": LR})  # stable with 100 stale workers
    sim = Simulator(alg, problem, DelayModel.named("sqrt", workers), CoreConfig(min_workers=workers, seed=0), seed=0)
    sim.run(max_updates=warm)  # every worker joined and holds a job
    c = sim.core.counters
    applied0, cpu0, t_start = c.applied, time.process_time(), time.perf_counter()
    rates, target = [], sim.core.version
    for i in range(N_WINDOWS):
        target = warm + (i + 1) * updates // N_WINDOWS
        a, t = c.applied, time.perf_counter()
        sim.run(max_updates=target, max_time=sim.now + 10.0 * (target - sim.core.version) + 100.0)  # bounded
        rates.append((c.applied - a) / max(time.perf_counter() - t, 1e-9))
    wall, cpu, jobs = time.perf_counter() - t_start, time.process_time() - cpu0, c.applied - applied0
    row = Row("simulator", d, workers, windows=rates, updates=jobs,
              note=f"simulated jobs (replies applied) per wall second: quadratic d={d:,}, asgd, {workers} workers, "
                   f"sqrt delays, {jobs:,} jobs in {wall:.2f} s (simulated {sim.now:,.0f} s); CPU: the bench process")
    if jobs <= 0 or c.rejected:
        row.skipped = f"{jobs} jobs applied, {c.rejected} rejected (diverged?)"
        return row
    row.updates_per_s = statistics.median(rates)
    row.cpu_s_per_update = cpu / jobs
    return row


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=UPDATES)
    r = run(ap.parse_args().updates)
    print(f"{r.updates_per_s:,.0f} simulated jobs/s (windows {', '.join(f'{x:,.0f}' for x in r.windows)}); "
          f"CPU {r.cpu_s_per_update * 1e6:.1f} us/job; {r.note}")
