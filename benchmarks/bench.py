"""``latecomer bench``: the same parameter-server workload over several systems, one table.

Workload: the server holds x of d float32; each worker loops "send g (a constant vector), receive
x", the server applies x <- x - lr*g and returns x; workers' compute is negligible. Backends:

* ``raw-zmq``: raw pyzmq ROUTER/DEALER, msgpack header + zero-copy frame (benchmarks/raw_zmq.py)
* ``latecomer``: real daemon + worker processes, ``asgd`` on ``synthetic``, TCP path
  (``--shm off``; benchmarks/latecomer_ps.py)
* ``latecomer-relay``: the same with ``serve --hand-over off`` (the front relays every byte)
* ``latecomer-shm``: the same on the same-host shared-memory path (``--shm auto``, the default)
* ``latecomer-curve``: TCP under ``--keys`` (sealed data connection, the default)
* ``latecomer-curvezmq``: TCP under ``--keys --seal off`` (libzmq's CurveZMQ carries everything)
* ``latecomer-bf16``: TCP with ``serve --wire-dtype bf16``
* ``latecomer-c4``: TCP with ``work --credit 4`` (pipelined: the next job waits in the worker)
* ``torch-rpc``: torch.distributed.rpc (TensorPipe) PS as in the PyTorch tutorial (benchmarks/torch_rpc.py)
* ``ray``: Ray actor PS as in Ray's example (benchmarks/ray_ps.py; the ``bench`` extra)
* ``simulator``: simulated jobs per wall second of ``ps.drivers.sim`` (quadratic, d = 1,000, 100 workers;
  benchmarks/sim_speed.py)

Then two ratio tables: latecomer against each other backend, and latecomer's server CPU per
update against the least vector work an update needs (benchmarks/reference.py); the encrypted
path beside the plaintext one; and the targets of issues 16 and 32, each with its verdict
(benchmarks/targets.py).

    python -m benchmarks.bench [--quick] [--sizes 1000,100000] [--workers 1,2,4] [--seconds 2]
"""

from __future__ import annotations

import json
import math
import os
import time

import click

from benchmarks.common import Row, machine, skipped
from benchmarks.common import measured as _ok
from benchmarks.models import model_options
from benchmarks.targets import session_cipher, targets_table
from ps.cli.paths import output_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATECOMER = ("latecomer", "latecomer-relay", "latecomer-shm", "latecomer-curve", "latecomer-curve-gcm",
             "latecomer-curvezmq", "latecomer-bf16", "latecomer-c4")
SIM = "simulator"
BACKENDS = ("raw-zmq", *LATECOMER, "torch-rpc", "ray", SIM)
# backends --backends takes that the default plan leaves out
OPTIONAL = ("latecomer-busy", "latecomer-nopoll")
SIZES = (1000, 100_000, 1_000_000, 10_000_000)
QUICK_SIZES = (1000, 100_000)
WORKERS = (1, 2, 4)
# The default plan (no --workers): the relay, CurveZMQ and bf16 rows are a cost of an option on
# top of the latecomer row, so one or two worker counts show it; the rest run 1, 2 and 4 workers.
REDUCED_WORKERS = {"latecomer-relay": (1, 2), "latecomer-curve": (1, 2), "latecomer-curvezmq": (1,),
                   "latecomer-bf16": (1, 4), "latecomer-c4": (1, 2), "latecomer-busy": (1, 2),
                   "latecomer-nopoll": (1, 2), "latecomer-curve-gcm": (1, 2)}
SECONDS, QUICK_SECONDS, WARMUP = 2.0, 1.5, 0.5
TARGET_S = 17 * 60  # the default full run should fit in this (the hard limit is 20 min)

# Seconds a cell costs besides warm-up and timed interval (process start-up, connection, the first
# updates, shutdown; curve: key generation), + PER_1E7_S * d / 1e7 for allocating and moving the first
# large iterates; measured on the reference machine (2 cores shared, load average about 3). Only for
# the estimate printed at the start; a busier machine stretches it (a run at load average 5 took
# about 2.5 times as long).
OVERHEAD_S = {"raw-zmq": 1.0, "latecomer": 1.2, "latecomer-relay": 1.2, "latecomer-shm": 1.2, "latecomer-curve": 2.0,
              "latecomer-curvezmq": 2.0, "latecomer-curve-gcm": 2.0,
              "latecomer-bf16": 1.2, "latecomer-c4": 1.2, "latecomer-busy": 1.2, "latecomer-nopoll": 1.2,
              "torch-rpc": 3.5, "ray": 1.0}
PER_1E7_S = {"raw-zmq": 0.6, "latecomer": 1.0, "latecomer-relay": 1.0, "latecomer-shm": 1.0, "latecomer-curve": 1.5,
             "latecomer-curvezmq": 3.0, "latecomer-curve-gcm": 1.5,
             "latecomer-bf16": 1.0, "latecomer-c4": 1.0, "latecomer-busy": 1.0, "latecomer-nopoll": 1.0,
             "torch-rpc": 2.5, "ray": 1.5}
RAY_START_S = 8.0  # one Ray instance for the whole ray sweep
SIM_S = 5.0
LOADED = 2.5  # worst case seen: factor on the estimate on a loaded machine


def plan(backends: list[str], sizes: list[int], workers: list[int] | None, quick: bool) -> list[tuple[str, list]]:
    """(backend, [(d, workers), ...]) in run order. ``workers`` None: the default per-backend counts."""
    out = []
    for b in backends:
        if b == SIM:
            out.append((b, [(1000, 100)]))
            continue
        ws = workers if workers is not None else ([1] if quick else list(REDUCED_WORKERS.get(b, WORKERS)))
        out.append((b, [(d, w) for d in sizes for w in ws]))
    return out


def estimate_s(the_plan: list[tuple[str, list]], seconds: float, warmup: float, repeat: int = 1) -> float:
    total = 0.0
    for b, cells in the_plan:
        if b == SIM:
            total += SIM_S
            continue
        total += RAY_START_S if b == "ray" else 0.0
        total += sum(OVERHEAD_S[b] + PER_1E7_S[b] * d / 1e7 + warmup + seconds for d, _ in cells) * (
            1 if b == "ray" else repeat)
    return total


def interleaved(the_plan: list[tuple[str, list]], repeat: int) -> list[tuple[int, str, int, int]]:
    """``bench --repeat N``: (repetition, backend, d, workers) in run order. Each cell's backends run
    back to back (in the plan's backend order), cell after cell, and the whole round N times, so
    that the rows a ratio compares ran seconds apart, not a backend's whole sweep apart: whole
    rounds on this project's machines swing by up to 2x within minutes. Ray (one instance for
    its sweep) and the simulator are not in it: they run once, after the rounds."""
    cells = list(dict.fromkeys(c for b, cs in the_plan if b not in (SIM, "ray") for c in cs))
    return [(k, b, d, w) for k in range(1, repeat + 1) for d, w in cells
            for b, cs in the_plan if b not in (SIM, "ray") and (d, w) in cs]


def median_rows(rows: list[Row]) -> list[Row]:
    """One row per (backend, d, workers): the repetition with the median updates/s (the lower of
    the two middle ones for an even count); rows that were not repeated as they are."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.backend, r.d, r.workers), []).append(r)
    out = []
    for g in groups.values():
        ok = sorted((r for r in g if _ok(r)), key=lambda r: r.updates_per_s)
        out.append(ok[(len(ok) - 1) // 2] if ok else g[0])
    return out


PAIRED = (("latecomer", "raw-zmq"), ("latecomer-nopoll", "raw-zmq"), ("latecomer", "latecomer-nopoll"),
          ("latecomer-busy", "raw-zmq"), ("latecomer-busy", "latecomer"),
          ("latecomer-curve", "latecomer"), ("latecomer-curve-gcm", "latecomer"),
          ("latecomer-curve", "latecomer-curve-gcm"),
          ("latecomer-curvezmq", "latecomer"), ("latecomer-relay", "latecomer"),
          ("latecomer-shm", "latecomer"))


def paired_table(rows: list[Row]) -> list[str]:
    """``bench --repeat N``: for each cell, each ratio of PAIRED whose two backends ran in it, the
    ratio within each repetition (the two rows seconds apart) and the median of those: the figure
    to read on a machine whose speed drifts; the other tables compare the median rows."""
    by = {(r.backend, r.d, r.workers, r.rep): r for r in rows if r.rep}
    reps = sorted({r.rep for r in rows if r.rep})
    cells = list(dict.fromkeys((r.d, r.workers) for r in rows if r.rep))
    body = []
    for d, w in cells:
        for a, b in PAIRED:
            got = [(by.get((a, d, w, k)), by.get((b, d, w, k))) for k in reps]
            vals = [x.updates_per_s / y.updates_per_s for x, y in got if _ok(x) and _ok(y)]
            if not vals:
                continue
            cpu = [x.cpu_s_per_update * 1e3 for x, _ in got if _ok(x) and math.isfinite(x.cpu_s_per_update)]
            body.append(f"| {d:,} | {w} | {a} / {b} | {' '.join(f'{v:.2f}' for v in vals)} | "
                        f"{_f(sorted(vals)[(len(vals) - 1) // 2], '.2f')} | "
                        f"{' '.join(f'{c:.3f}' for c in cpu) or 'n/a'} |")
    if not body:
        return []
    return ["", "## Paired ratios, per repetition", "",
            f"`--repeat {len(reps)}`: each cell's backends ran back to back, the round {len(reps)} times. "
            "Updates/s of the first backend over the second's within each repetition, their median (the lower "
            "middle one for an even count), and the first backend's server CPU ms per update in each.", "",
            "| d | workers | ratio | per repetition | median | first's CPU ms/upd per repetition |",
            "|---|---|---|---|---|---|"] + body


def run_cell(backend: str, d: int, workers: int, seconds: float, warmup: float, credit: int = 1) -> Row:
    if backend == "raw-zmq":
        from benchmarks import raw_zmq
        return raw_zmq.run(d, workers, seconds, warmup)
    if backend in LATECOMER or backend in OPTIONAL:
        from benchmarks import latecomer_ps
        return latecomer_ps.run(d, workers, seconds, warmup, variant=backend, credit=credit)
    if backend == "torch-rpc":
        from benchmarks import torch_rpc
        return torch_rpc.run(d, workers, seconds, warmup)
    raise ValueError(backend)


def sweep(the_plan: list[tuple[str, list]], seconds: float, warmup: float, *, credit: int = 1, quick: bool = False,
          echo=print, repeat: int = 1) -> list[Row]:
    rows: list[Row] = []
    if repeat > 1:  # the cells interleaved, the round repeated; then Ray and the simulator, once
        for k, b, d, w in interleaved(the_plan, repeat):
            t = time.monotonic()
            r = run_cell(b, d, w, seconds, warmup, credit)
            r.wall_s, r.rep = time.monotonic() - t, k
            echo(f"[{k}/{repeat}] " + line(r))
            rows.append(r)
        the_plan = [(b, c) for b, c in the_plan if b in (SIM, "ray")]
    for b, cells in the_plan:
        if b == "ray":
            from benchmarks import ray_ps
            got = ray_ps.run_all(cells, seconds, warmup)
            for r in got:
                echo(line(r))
            rows += got
            continue
        if b == SIM:
            from benchmarks import sim_speed
            t = time.monotonic()
            try:
                r = sim_speed.run(sim_speed.QUICK_UPDATES if quick else sim_speed.UPDATES)
            except Exception as e:  # noqa: BLE001 - a failed row says why
                r = skipped(SIM, 1000, 100, f"{type(e).__name__}: {e}"[:200])
            r.wall_s = time.monotonic() - t
            echo(line(r))
            rows.append(r)
            continue
        for d, w in cells:
            t = time.monotonic()
            r = run_cell(b, d, w, seconds, warmup, credit)
            r.wall_s = time.monotonic() - t
            echo(line(r))
            rows.append(r)
    return rows


def _f(v: float | None, fmt: str) -> str:
    return "n/a" if v is None or not math.isfinite(v) else format(v, fmt)


def line(r: Row) -> str:
    if r.skipped:
        return f"{r.backend:16s} d={r.d:>10,} w={r.workers}: n/a ({r.skipped})"
    return (f"{r.backend:16s} d={r.d:>10,} w={r.workers}: {r.updates_per_s:9.1f} upd/s  "
            f"cpu {_f(r.cpu_s_per_update * 1e3, '8.3f')} ms/upd  rtt p50 {_f(r.rtt_p50_s * 1e3, '8.3f')} ms "
            f"p99 {_f(r.rtt_p99_s * 1e3, '8.3f')} ms  rss {_f(r.peak_rss_bytes / 2**20, '7.1f')} MiB  "
            f"[{r.wall_s:.0f} s]")



def _ratio(a: Row | None, b: Row | None, field: str = "updates_per_s") -> str:
    if not (_ok(a) and _ok(b)):
        return "n/a"
    x, y = getattr(a, field), getattr(b, field)
    return _f(x / y, ".2f") if math.isfinite(x) and math.isfinite(y) and y > 0 else "n/a"


def _best(*rows: Row | None) -> Row | None:
    ok = [r for r in rows if _ok(r)]
    return max(ok, key=lambda r: r.updates_per_s) if ok else None


def cipher_limit(seconds: float = 0.5, n: int = 4_000_000) -> dict[str, float]:
    """The ciphers' limits on this machine: GB of plaintext sealed per CPU second, one core, at
    ``n`` bytes (benchmarks/cipher.py): libsodium through pyzmq's own build (XSalsa20-Poly1305,
    the box CurveZMQ seals every frame with, and AES-256-GCM where the CPU has AES-NI), and
    AES-256-GCM through OpenSSL (``aes256gcm-openssl``) and, where pyaegis is installed,
    AEGIS-256X4 through libaegis (``aegis256x4``): the sealed data connection's two."""
    from benchmarks.cipher import cipher_gbps, constructions, openssl_gcm_gbps, session_cipher_gbps
    from protocol.seal import AEGIS, available_ciphers

    out = {a.name: cipher_gbps(a, n, seconds) for a in constructions() if a.available}
    out["aes256gcm-openssl"] = openssl_gcm_gbps(n, seconds)
    if AEGIS in available_ciphers():
        out[AEGIS] = session_cipher_gbps(AEGIS, n, seconds)
    return out


def encrypted_table(rows: list[Row], cipher: dict[str, float] | None) -> list[str]:
    """The secure rows beside the plaintext ones: latecomer under ``--keys`` (``latecomer-curve``:
    the sealed data connection, the default, with the faster cipher both ends have; with
    ``latecomer-curve-gcm``, the same on AES-256-GCM) and under ``--keys --seal off``
    (``latecomer-curvezmq``: libzmq's CurveZMQ carries the arrays) over latecomer in plaintext
    (TCP); the sealed rows' payload bytes/s and what fraction of XSalsa20's and the session
    cipher's one-core limit that is; and the updates/s a lockstep worker would reach if sealing
    cost only the cipher's 4 passes over the arrays (x sealed and opened, g sealed and opened, one
    after the other) on top of the plaintext round trip."""
    from protocol.seal import AEGIS

    by = {(r.backend, r.d, r.workers): r for r in rows}
    cells = sorted({(r.d, r.workers) for r in rows if r.backend == "latecomer-curve" and _ok(r)})
    if not cells:
        return []
    cipher = cipher or {}
    xs = cipher.get("xsalsa20poly1305", math.nan)
    aegis = AEGIS in cipher  # latecomer-curve's sessions here: AEGIS for iterates of 64 KiB and more, else AES-GCM
    name = ("AEGIS-256X4 (libaegis) where the iterate is at least 64 KiB, AES-256-GCM (OpenSSL) below"
            if aegis else "AES-256-GCM (OpenSSL)")
    limit = ", ".join(f"{k} {v:.2f} GB/s" for k, v in cipher.items()) or "not measured"
    out = ["", "## The encrypted path", "",
           f"Cipher limits, one core, 4 MB messages (measured in this run): {limit}. *sealed*: `serve --keys` "
           "(the default `--seal auto`: after the welcome, every message on a second connection, each frame "
           f"sealed with {name}, the faster cipher both ends have (`--seal-cipher auto`); a large frame in 1 MiB "
           "segments, on up to 4 threads from 2 MiB (AES-GCM) or 8 MiB (AEGIS; below that AEGIS seals a frame "
           "as one segment, which the receiver opens in place, and from 1 MiB the daemon seals it a chunk at a "
           "time as it writes it while the worker opens each chunk as it arrives); PROTOCOL.md 6.15); *sealed, "
           "AES-GCM*: the same with `--seal-cipher aes256gcm` (the `latecomer-curve-gcm` rows, where they ran); "
           "*CurveZMQ*: `--keys --seal off` (libzmq seals every frame with XSalsa20-Poly1305). Targets (issue "
           "32): the secure path >= 0.7x plaintext at every d with 1 and 2 workers; payload bytes/s >= 50 % of "
           "the cipher limit at 1e6-1e7. *cipher bound*: the updates/s of a lockstep worker if each update cost "
           "only its session cipher's 4 passes over its arrays, each at one core's limit, on top of the plaintext "
           "round trip (the segments' threads, and the overlap of a streamed job's sealing and opening, may "
           "pass it).", "",
           "| d | workers | plaintext upd/s | sealed upd/s | sealed / plaintext | sealed, AES-GCM / plaintext | "
           "CurveZMQ upd/s | CurveZMQ / plaintext | sealed payload MB/s | % of XSalsa20 limit | "
           "% of its cipher's limit | 1-worker cipher bound upd/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, w in cells:
        c, p, z = by[("latecomer-curve", d, w)], by.get(("latecomer", d, w)), by.get(("latecomer-curvezmq", d, w))
        g = by.get(("latecomer-curve-gcm", d, w))
        plain = p.updates_per_s if p is not None and _ok(p) else math.nan
        zq = z.updates_per_s if z is not None and _ok(z) else math.nan
        gq = g.updates_per_s if g is not None and _ok(g) else math.nan
        mbps = c.updates_per_s * c.bytes_per_update / 1e6
        arrays = 4.0 * d  # bytes of one float32 array
        lim = cipher.get(session_cipher(d, cipher), math.nan)
        bound = 1.0 / (1.0 / plain + 4 * arrays / (lim * 1e9)) if w == 1 else math.nan
        out.append(f"| {d:,} | {w} | {_cell(plain, ',.1f')} | {c.updates_per_s:,.1f} | "
                   f"{_f(c.updates_per_s / plain, '.2f')} | {_f(gq / plain, '.2f')} | {_cell(zq, ',.1f')} | "
                   f"{_f(zq / plain, '.2f')} | {mbps:,.0f} | {_f(100 * mbps / (xs * 1e3), '.0f')} | "
                   f"{_f(100 * mbps / (lim * 1e3), '.0f')} | {_f(bound, ',.0f')} |")
    return out


def ratio_table(rows: list[Row], ref: dict[int, float] | None = None,
                ceiling: dict[int, float] | None = None) -> list[str]:
    """Ratios of latecomer to the other backends (updates/s, server CPU per update), latecomer's
    server CPU per update over the reference vector work (``ref``: d -> seconds) and its
    updates/s over the no-transport ceiling (``ceiling``: d -> seconds per update)."""
    by = {(r.backend, r.d, r.workers): r for r in rows}
    cells = sorted({(r.d, r.workers) for r in rows if r.backend in ("latecomer", "latecomer-shm")})
    if not cells:
        return []
    out = ["", "## Ratios", "",
           "Updates/s ratios (> 1: the first faster). *best latecomer* = the better of `latecomer` (TCP) and "
           "`latecomer-shm` in that cell; *best other* = the better of torch-rpc and ray. Target: "
           "latecomer-shm / best other >= 1.5 at d >= 1e6. CPU ratios: server CPU per update of "
           "`latecomer` (TCP) over the other's (< 1: latecomer cheaper).", "",
           "| d | workers | latecomer / raw-zmq | best latecomer / torch-rpc | best latecomer / ray "
           "| latecomer-shm / best other | latecomer-curve / latecomer | latecomer-bf16 / latecomer "
           "| latecomer-c4 / raw-zmq | CPU/upd vs raw-zmq | CPU/upd vs torch-rpc | CPU/upd vs ray |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, w in cells:
        def g(b: str, d: int = d, w: int = w) -> Row | None:
            return by.get((b, d, w))

        lc, shm = g("latecomer"), g("latecomer-shm")
        best, other = _best(lc, shm), _best(g("torch-rpc"), g("ray"))
        target = _ratio(shm, other)
        if target != "n/a" and d >= 1_000_000:
            target += " (met)" if float(target) >= 1.5 else " (not met)"
        out.append(f"| {d:,} | {w} | {_ratio(lc, g('raw-zmq'))} | {_ratio(best, g('torch-rpc'))} | "
                   f"{_ratio(best, g('ray'))} | {target} | {_ratio(g('latecomer-curve'), lc)} | "
                   f"{_ratio(g('latecomer-bf16'), lc)} | {_ratio(g('latecomer-c4'), g('raw-zmq'))} | "
                   + " | ".join(_ratio(lc, g(o), "cpu_s_per_update") for o in ("raw-zmq", "torch-rpc", "ray")) + " |")
    if ref:
        out += ["", "## Server CPU per update / vector passes", "",
                "Reference: the vector work plain async SGD must do per update (read g and x, write x), timed "
                "in the bench process as `torch.add(x, g, alpha=-lr, out=y)` on `torch.from_numpy` float32 views, "
                "one thread, median of repetitions. Ratio = the daemon's server CPU per update / reference "
                "(target <= 2; the TCP path also copies x and g through the kernel). Ceiling: the same update with "
                "no transport, one thread (benchmarks/reference.py `ceiling_s`: the synthetic gradient written "
                "into the buffer the server reads, the finiteness check and the step); target for latecomer-shm: "
                ">= 0.8 of it at d >= 1e6.", "",
                "| d | workers | reference ms | latecomer CPU ms/upd | latecomer / ref | latecomer-shm CPU ms/upd "
                "| latecomer-shm / ref | ceiling upd/s | latecomer-shm / ceiling |",
                "|---|---|---|---|---|---|---|---|---|"]
        for d, w in cells:
            r0, c0 = ref.get(d), (ceiling or {}).get(d)
            cols = [f"| {d:,} | {w} | {_f(r0 * 1e3 if r0 else None, '.4f')}"]
            for b in ("latecomer", "latecomer-shm"):
                r = by.get((b, d, w))
                c = r.cpu_s_per_update if _ok(r) else math.nan
                cols += [_f(c * 1e3, ".3f"), _f(c / r0 if r0 else math.nan, ".1f")]
            shm = by.get(("latecomer-shm", d, w))
            cols += [_f(1 / c0 if c0 else math.nan, ",.0f"),
                     _f(shm.updates_per_s * c0 if c0 and _ok(shm) else math.nan, ".2f")]
            out.append(" | ".join(cols) + " |")
    return out


def _short(d: int) -> str:
    """1e3 for 1000, 2.5e5 for 250000; other values as they are."""
    m, e = f"{d:e}".split("e")
    m = m.rstrip("0").rstrip(".")
    return f"{m}e{int(e)}" if float(f"{m}e{e}") == d and d >= 1000 else str(d)


def _cell(v: float, fmt: str, scale: float = 1.0) -> str:
    return _f(v * scale if v is not None and math.isfinite(v) else math.nan, fmt)


def markdown(rows: list[Row], seconds: float, warmup: float, elapsed: float, desc: str, *,
             the_plan: list[tuple[str, list]] | None = None, credit: int = 1, estimate: float | None = None,
             ref: dict[int, float] | None = None, plan_note: str = "",
             ceiling: dict[int, float] | None = None, cipher: dict[str, float] | None = None) -> str:
    planned = ""
    if the_plan:
        planned = ("Cells run: " + "; ".join(
            f"{b} " + ("d=1,000 with 100 simulated workers" if b == SIM else
                       f"d in {{{', '.join(_short(d) for d in sorted({d for d, _ in c}))}}} x workers "
                       f"{{{', '.join(str(w) for w in sorted({w for _, w in c}))}}}")
            for b, c in the_plan) + ". ")
    lines = [f"# latecomer bench ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {desc}.", "",
             f"Workload: server holds x (d float32), workers loop send g / receive x, server x <- x - lr*g; "
             f"negligible worker compute; all on loopback. Per cell: start, warm-up {warmup:g} s, then a "
             f"{seconds:g} s timed interval cut into 5 windows; updates/s = median window. Server CPU = "
             "user+system seconds of the server process over the interval / updates in it. RTT = per update, "
             "send g to x back in the worker (latecomer: job issue -> apply, from the daemon's events file, "
             "whose writing is part of the daemon's CPU). Peak RSS = VmHWM of the server process. "
             "Bytes/update = application payload both ways (latecomer: protocol Job+Reply as encoded; "
             "latecomer-shm: the headers only, x and g go through shared memory; latecomer-bf16: 2-byte "
             "frames; raw-zmq: frames sent; torch-rpc/ray: pickled tensors/arrays). latecomer rows: "
             f"`latecomer work --credit {credit}`"
             + (" (one job prefetched per worker)" if credit == 2 else "") + ". "
             "simulator: simulated jobs (replies applied) per wall second of the discrete-event simulator "
             "(quadratic, d = 1,000, asgd, 100 workers, sqrt delays), in the bench process; its bytes, RTT and "
             "RSS are n/a. " + planned
             + plan_note + (f"Estimated {estimate / 60:.1f} min; " if estimate else "")
             + f"whole run {elapsed:.0f} s. Shared, noisy machine: read the ratios, not the absolute figures.", "",
             "| backend | d | workers | updates/s | bytes/update | server CPU ms/update | RTT p50 ms | RTT p99 ms "
             "| peak server RSS MiB | windows (upd/s) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.backend} | {r.d:,} | {r.workers} | n/a | n/a | n/a | n/a | n/a | n/a | | "
                         f"skipped: {r.skipped} |")
            continue
        lines.append(f"| {r.backend} | {r.d:,} | {r.workers} | {_cell(r.updates_per_s, ',.1f')} | "
                     f"{_cell(r.bytes_per_update, ',.0f')} | {_cell(r.cpu_s_per_update, '.3f', 1e3)} | "
                     f"{_cell(r.rtt_p50_s, '.3f', 1e3)} | {_cell(r.rtt_p99_s, '.3f', 1e3)} | "
                     f"{_cell(r.peak_rss_bytes, ',.1f', 2**-20)} | {' '.join(f'{x:.0f}' for x in r.windows)} | "
                     f"{f'repetition {r.rep}. ' if r.rep else ''}{r.note} |")
    goals = targets_table(rows, cipher)  # from every repetition's rows
    if any(r.rep for r in rows):
        lines += paired_table(rows)
        rows = median_rows(rows)  # the tables below compare each cell's median repetition
    lines += ratio_table(rows, ref, ceiling)
    lines += encrypted_table(rows, cipher)
    return "\n".join(lines + goals) + "\n"


DEFAULT_PLAN_NOTE = (
    f"Default plan: a {SECONDS:g} s timed interval after a {WARMUP:g} s warm-up (a cell's fixed cost, process "
    "start-up and shutdown, is a few seconds, so longer intervals buy little), the CurveZMQ rows at 1 and 2 "
    "workers (the encrypted path's targets), the bf16 rows at 1 and 4 workers only, so that the full default "
    f"run stays within {TARGET_S // 60} min even at {LOADED:g}x its "
    "estimate (a loaded machine: the previous 5-backend run at load average 5 took 14 min). ")


def _ints(s: str) -> list[int]:
    try:
        return [int(float(v)) for v in s.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {s!r}") from None


@click.command("bench")
@click.option("--quick", is_flag=True, help="d in {1e3, 1e5}, 1 worker, 1.5 s intervals, a shorter simulator "
                                           "row (what the test suite runs).")
@click.option("--sizes", default=None, help="Comma-separated d values (default 1000,100000,1000000,10000000).")
@click.option("--workers", "workers_", default=None,
              help="Comma-separated worker counts for every backend (default 1,2,4; curve and bf16 rows 1,4).")
@click.option("--seconds", type=float, default=None,
              help=f"Timed interval per cell (default {SECONDS:g}; --quick {QUICK_SECONDS:g}).")
@click.option("--warmup", type=float, default=WARMUP, show_default=True, help="Seconds after start before timing.")
@click.option("--credit", type=click.IntRange(1, 64), default=1, show_default=True,
              help="latecomer rows: jobs each worker holds at once (`latecomer work --credit N`).")
@click.option("--backends", default=",".join(BACKENDS), show_default=True,
              help=f"Comma-separated backends; also {', '.join(OPTIONAL)} (`serve --busy-poll-us`), not in the "
                   "default.")
@click.option("--repeat", type=click.IntRange(1, 20), default=1, show_default=True,
              help="Run each cell's backends back to back, cell after cell, and the whole round N times (Ray and "
                   "the simulator once, after); the report adds each ratio per repetition and its median, and "
                   "its other tables compare each cell's median repetition.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, callback=output_file,
              help="Markdown table (default: benchmarks/RESULTS.md for the default plan; RESULTS-quick.md with "
                   "--quick, RESULTS-partial.md otherwise, so that no partial run replaces the committed table).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, callback=output_file,
              help="Also write the rows as JSON (default: next to --out, with the .json suffix).")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None, callback=output_file,
              help="Also plot updates/s against d (default for the full run: docs/img/bench.png).")
@click.option("--workers-scale", is_flag=True,
              help="Instead: server CPU per message with many connected workers (benchmarks/scale.py): "
                   "--scale-workers fake workers (idle, then hoarding a job each) and 2 real ones; writes "
                   "benchmarks/RESULTS-scale.md (or --out).")
@click.option("--scale-workers", default=None,
              help="With --workers-scale: comma-separated fake worker counts (default 10,1000,10000).")
@click.option("--scale-serve-arg", "scale_serve_args", multiple=True,
              help="With --workers-scale: one more `latecomer serve` argument (repeatable), e.g. "
                   "--scale-serve-arg=--no-supervise.")
@click.option("--models", "models_", is_flag=True,
              help="Instead: real models (ResNet-18, GPT-2-like, a 60-block MLP) through latecomer against a plain "
                   "PyTorch loop and DistributedDataParallel, homogeneous and with one worker slowed 3x "
                   "(benchmarks/models.py); writes benchmarks/RESULTS-models.md (or --out). --quick and --seconds "
                   "apply (per training run).")
@model_options
def bench(quick, sizes, workers_, seconds, warmup, credit, backends, repeat, out, json_out, plot_out, workers_scale,
          scale_workers, scale_serve_args, models_, model_names, model_size, grad_size, grad_reps, systems,
          cores) -> None:
    """Throughput of latecomer vs raw pyzmq, torch.distributed.rpc and Ray on one workload (--models: real
    models against plain PyTorch and DDP)."""
    if models_:
        from benchmarks.models import main as models_main

        models_main(model_names, model_size, grad_size, seconds, grad_reps, quick, cores, systems, out, json_out,
                    plot_out, echo=click.echo)
        return
    if workers_scale:
        from benchmarks import scale

        counts = _ints(scale_workers) if scale_workers else list(scale.SCALE_WORKERS)
        if any(n < 1 for n in counts):
            raise click.BadParameter("fake worker counts must be positive", param_hint="--scale-workers")
        out = out or os.path.join(REPO, "benchmarks", "RESULTS-scale.md")
        json_out = json_out or os.path.splitext(out)[0] + ".json"
        desc = machine()
        click.echo(f"machine: {desc}")
        scale.run(counts, seconds if seconds is not None else scale.SECONDS, warmup, out, json_out, desc,
                  echo=click.echo, serve_args=tuple(scale_serve_args))
        click.echo(f"wrote {out}")
        return
    sizes_l = _ints(sizes) if sizes else list(QUICK_SIZES if quick else SIZES)
    workers_l = _ints(workers_) if workers_ else None
    seconds = seconds if seconds is not None else (QUICK_SECONDS if quick else SECONDS)
    if seconds <= 0 or warmup < 0 or any(d < 1 for d in sizes_l) or any(w < 1 for w in workers_l or [1]):
        raise click.BadParameter("sizes, workers and seconds must be positive")
    bl = [b.strip() for b in backends.split(",") if b.strip()]
    bad = [b for b in bl if b not in BACKENDS + OPTIONAL]
    if bad:
        raise click.BadParameter(f"unknown backend(s) {bad}; choose from {', '.join(BACKENDS + OPTIONAL)}",
                                 param_hint="--backends")
    the_plan = plan(bl, sizes_l, workers_l, quick)
    est = estimate_s(the_plan, seconds, warmup, repeat)
    desc = machine()
    click.echo(f"machine: {desc}")
    click.echo(f"plan: {sum(len(c) for _, c in the_plan)} cells" + (f" x {repeat} repetitions" if repeat > 1 else "")
               + f", estimated {est / 60:.1f} min "
               f"(up to {LOADED * est / 60:.0f} min on a loaded machine)"
               + (f", over the {TARGET_S / 60:.0f} min target" if LOADED * est > TARGET_S else ""))
    t = time.monotonic()
    rows = sweep(the_plan, seconds, warmup, credit=credit, quick=quick, echo=lambda s: click.echo(s), repeat=repeat)
    elapsed = time.monotonic() - t
    ref = ceil = None
    if any(b in bl for b in ("latecomer", "latecomer-shm")):
        from benchmarks.reference import ceiling_s, vector_passes
        ds = sorted({d for b, c in the_plan if b != SIM for d, _ in c})
        ref, ceil = vector_passes(ds), {d: ceiling_s(d) for d in ds}
    cipher = cipher_limit() if "latecomer-curve" in bl else None
    default = (not (quick or sizes or workers_) and seconds == SECONDS and warmup == WARMUP and credit == 1
               and bl == list(BACKENDS))  # with or without --repeat: the whole plan
    out = out or os.path.join(REPO, "benchmarks", "RESULTS.md" if default else
                              "RESULTS-quick.md" if quick else "RESULTS-partial.md")
    json_out = json_out or os.path.splitext(out)[0] + ".json"
    if json_out:  # first: the raw rows survive whatever happens below
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump({"machine": desc, "seconds": seconds, "warmup": warmup, "credit": credit, "repeat": repeat,
                       "estimate_s": est, "elapsed_s": elapsed, "vector_pass_s": ref, "ceiling_s": ceil,
                       "cipher_gbps": cipher,
                       "rows": [r.as_dict() for r in rows]}, f, indent=1)
    note = DEFAULT_PLAN_NOTE if default else ("--quick: d in {1e3, 1e5}, 1 worker. " if quick else
                                              "Cells, interval and warm-up chosen on the command line. ")
    if repeat > 1:
        note += (f"--repeat {repeat}: each cell's backends back to back, cell after cell, the round {repeat} "
                 "times (Ray and the simulator once, after). ")
    md = markdown(rows, seconds, warmup, elapsed, desc, the_plan=the_plan, credit=credit, estimate=est, ref=ref,
                  ceiling=ceil, plan_note=note, cipher=cipher)
    with open(out, "w", encoding="utf-8") as f:
        f.write(md)
    if plot_out or default:
        from benchmarks.plot import plot
        plot_out = plot_out or os.path.join(REPO, "docs", "img", "bench.png")
        plot([r.as_dict() for r in (median_rows(rows) if repeat > 1 else rows)], plot_out, cipher_gbps=cipher,
             title=f"latecomer bench ({time.strftime('%Y-%m-%d')}): x -= lr*g on loopback; " + desc.split(";")[0])
        click.echo(f"wrote {plot_out}")
    med = median_rows(rows) if repeat > 1 else rows
    click.echo("\n".join(paired_table(rows) + ratio_table(med, ref, ceil) + encrypted_table(med, cipher)
                          + targets_table(rows, cipher)))
    click.echo(f"wrote {out} ({elapsed:.0f} s; estimated {est:.0f} s)")


if __name__ == "__main__":
    bench()
