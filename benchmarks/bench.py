"""``latecomer bench``: the same parameter-server workload over several systems, one table.

Workload: the server holds x of d float32; each worker loops "send g (a constant vector), receive
x", the server applies x <- x - lr*g and returns x; workers' compute is negligible. Backends:

* ``raw-zmq``: raw pyzmq ROUTER/DEALER, msgpack header + zero-copy frame (benchmarks/raw_zmq.py)
* ``latecomer``: real daemon + worker processes, ``asgd`` on ``synthetic`` (benchmarks/latecomer_ps.py)
* ``latecomer-curve``: the same with CurveZMQ on
* ``torch-rpc``: torch.distributed.rpc (TensorPipe) PS as in the PyTorch tutorial (benchmarks/torch_rpc.py)
* ``ray``: Ray actor PS as in Ray's example (benchmarks/ray_ps.py; the ``bench`` extra)

A ``latecomer --wire-dtype bf16`` row is listed as n/a: that flag does not exist yet.

    python -m benchmarks.bench [--quick] [--sizes 1000,100000] [--workers 1,2,4] [--seconds 4]
"""

from __future__ import annotations

import json
import math
import os
import platform
import time

import click
import psutil

from benchmarks.common import Row, skipped

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("raw-zmq", "latecomer", "latecomer-curve", "torch-rpc", "ray")
BF16 = "latecomer-bf16"
BF16_WHY = "`latecomer work/serve --wire-dtype bf16` does not exist yet"


def run_cell(backend: str, d: int, workers: int, seconds: float, warmup: float) -> Row:
    if backend == "raw-zmq":
        from benchmarks import raw_zmq
        return raw_zmq.run(d, workers, seconds, warmup)
    if backend in ("latecomer", "latecomer-curve"):
        from benchmarks import latecomer_ps
        return latecomer_ps.run(d, workers, seconds, warmup, curve=backend == "latecomer-curve")
    if backend == "torch-rpc":
        from benchmarks import torch_rpc
        return torch_rpc.run(d, workers, seconds, warmup)
    raise ValueError(backend)


def sweep(backends: list[str], sizes: list[int], workers: list[int], seconds: float, warmup: float,
          echo=print) -> list[Row]:
    cells = [(d, w) for d in sizes for w in workers]
    rows: list[Row] = []
    for b in backends:
        if b == "ray":
            from benchmarks import ray_ps
            got = ray_ps.run_all(cells, seconds, warmup)
            for r in got:
                echo(line(r))
            rows += got
            continue
        for d, w in cells:
            r = run_cell(b, d, w, seconds, warmup)
            echo(line(r))
            rows.append(r)
    rows += [skipped(BF16, d, w, BF16_WHY) for d, w in cells]
    return rows


def _f(v: float, fmt: str) -> str:
    return "n/a" if v is None or not math.isfinite(v) else format(v, fmt)


def line(r: Row) -> str:
    if r.skipped:
        return f"{r.backend:16s} d={r.d:>10,} w={r.workers}: n/a ({r.skipped})"
    return (f"{r.backend:16s} d={r.d:>10,} w={r.workers}: {r.updates_per_s:9.1f} upd/s  "
            f"cpu {r.cpu_s_per_update * 1e3:8.3f} ms/upd  rtt p50 {r.rtt_p50_s * 1e3:8.3f} ms "
            f"p99 {r.rtt_p99_s * 1e3:8.3f} ms  rss {r.peak_rss_bytes / 2**20:7.1f} MiB")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy
    import torch
    import zmq
    try:
        import ray
        rv = ray.__version__
    except Exception:  # noqa: BLE001
        rv = "not installed"
    return (f"{cpu}, {os.cpu_count()} logical cores, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, "
            f"{platform.system()} {platform.release()}; Python {platform.python_version()}, pyzmq {zmq.__version__} "
            f"(libzmq {zmq.zmq_version()}), numpy {numpy.__version__}, torch {torch.__version__}, ray {rv}; "
            f"load average at start {os.getloadavg()[0]:.2f}")


def ratio_table(rows: list[Row]) -> list[str]:
    by = {(r.backend, r.d, r.workers): r for r in rows}
    others = [b for b in ("raw-zmq", "torch-rpc", "ray", "latecomer-curve") if any(r.backend == b for r in rows)]
    if not any(r.backend == "latecomer" for r in rows) or not others:
        return []
    out = ["", "Ratios of latecomer to each other backend, updates/s (> 1: latecomer faster) and server CPU "
                "per update (< 1: latecomer cheaper); for latecomer-curve the ratio is latecomer / "
                "latecomer-curve.", "",
           "| d | workers | " + " | ".join(f"upd/s vs {b}" for b in others) + " | "
           + " | ".join(f"CPU/upd vs {b}" for b in others) + " |",
           "|---|---|" + "---|" * (2 * len(others))]
    for (b, d, w), lc in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if b != "latecomer":
            continue
        rs, cs = [], []
        for o in others:
            r = by.get((o, d, w))
            ok = r is not None and not r.skipped and not lc.skipped
            rs.append(_f(lc.updates_per_s / r.updates_per_s, ".2f") if ok and r.updates_per_s > 0 else "n/a")
            cs.append(_f(lc.cpu_s_per_update / r.cpu_s_per_update, ".2f") if ok and r.cpu_s_per_update > 0
                      else "n/a")
        out.append(f"| {d:,} | {w} | " + " | ".join(rs) + " | " + " | ".join(cs) + " |")
    return out


def markdown(rows: list[Row], seconds: float, warmup: float, elapsed: float, desc: str) -> str:
    lines = [f"# latecomer bench ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {desc}.", "",
             f"Workload: server holds x (d float32), workers loop send g / receive x, server x <- x - lr*g; "
             f"negligible worker compute; all on loopback. Per cell: start, warm-up {warmup:g} s, then a "
             f"{seconds:g} s timed interval cut into 5 windows; updates/s = median window. Server CPU = "
             "user+system seconds of the server process over the interval / updates in it. RTT = per update, "
             "send g to x back in the worker (latecomer: job issue -> apply, from the daemon's events). Peak "
             "RSS = VmHWM of the server process. Bytes/update = application payload both ways (latecomer: "
             "protocol Job+Reply as encoded; raw-zmq: frames sent; torch-rpc/ray: pickled tensors/arrays). "
             f"Whole run {elapsed:.0f} s. Shared, noisy machine: read the ratios, not the absolute figures.", "",
             "| backend | d | workers | updates/s | bytes/update | server CPU ms/update | RTT p50 ms | RTT p99 ms "
             "| peak server RSS MiB | windows (upd/s) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.backend} | {r.d:,} | {r.workers} | n/a | n/a | n/a | n/a | n/a | n/a | | "
                         f"skipped: {r.skipped} |")
            continue
        lines.append(f"| {r.backend} | {r.d:,} | {r.workers} | {r.updates_per_s:,.1f} | {r.bytes_per_update:,.0f} | "
                     f"{r.cpu_s_per_update * 1e3:.3f} | {r.rtt_p50_s * 1e3:.3f} | {r.rtt_p99_s * 1e3:.3f} | "
                     f"{r.peak_rss_bytes / 2**20:,.1f} | {' '.join(f'{x:.0f}' for x in r.windows)} | {r.note} |")
    lines += ratio_table(rows)
    return "\n".join(lines) + "\n"


def _ints(s: str) -> list[int]:
    try:
        return [int(float(v)) for v in s.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {s!r}") from None


@click.command("bench")
@click.option("--quick", is_flag=True, help="d in {1e3, 1e5}, 1 worker, 2 s windows (what the test suite runs).")
@click.option("--sizes", default=None, help="Comma-separated d values (default 1000,100000,1000000,10000000).")
@click.option("--workers", "workers_", default=None, help="Comma-separated worker counts (default 1,2,4).")
@click.option("--seconds", type=float, default=None, help="Timed interval per cell (default 4; --quick 2).")
@click.option("--warmup", type=float, default=1.0, show_default=True, help="Seconds after start before timing.")
@click.option("--backends", default=",".join(BACKENDS), show_default=True, help="Comma-separated backends.")
@click.option("--out", type=click.Path(dir_okay=False), default=os.path.join(REPO, "benchmarks", "RESULTS.md"),
              show_default=True, help="Markdown table.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write the rows as JSON.")
def bench(quick, sizes, workers_, seconds, warmup, backends, out, json_out) -> None:
    """Throughput of latecomer vs raw pyzmq, torch.distributed.rpc and Ray on one workload."""
    sizes_l = _ints(sizes) if sizes else ([1000, 100_000] if quick else [1000, 100_000, 1_000_000, 10_000_000])
    workers_l = _ints(workers_) if workers_ else ([1] if quick else [1, 2, 4])
    seconds = seconds if seconds is not None else (2.0 if quick else 4.0)
    if seconds <= 0 or warmup < 0 or any(d < 1 for d in sizes_l) or any(w < 1 for w in workers_l):
        raise click.BadParameter("sizes, workers and seconds must be positive")
    bl = [b.strip() for b in backends.split(",") if b.strip()]
    bad = [b for b in bl if b not in BACKENDS]
    if bad:
        raise click.BadParameter(f"unknown backend(s) {bad}; choose from {', '.join(BACKENDS)}",
                                 param_hint="--backends")
    desc = machine()
    click.echo(f"machine: {desc}")
    t = time.monotonic()
    rows = sweep(bl, sizes_l, workers_l, seconds, warmup, echo=lambda s: click.echo(s))
    elapsed = time.monotonic() - t
    if json_out:  # first: the raw rows survive whatever happens below
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump({"machine": desc, "seconds": seconds, "rows": [r.as_dict() for r in rows]}, f, indent=1)
    md = markdown(rows, seconds, warmup, elapsed, desc)
    with open(out, "w", encoding="utf-8") as f:
        f.write(md)
    click.echo("\n".join(ratio_table(rows)))
    click.echo(f"wrote {out} ({elapsed:.0f} s)")


if __name__ == "__main__":
    bench()
