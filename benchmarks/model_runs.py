"""The measurements of ``latecomer bench --models`` (benchmarks/models.py): the worker's gradient
time, and training runs of the same model by three systems.

* :func:`grad_time`: ``TorchProblem.grad(x, seed, batch)`` (what a latecomer worker calls per
  job) against a plain ``loss_fn(model(inputs), target).backward()`` on the same batch, in one
  process, interleaved, median of ``reps`` after warm-up (:func:`grad_time_fresh`: in a fresh one).
* :func:`run_torch`: a plain single-process SGD loop (``procs=0``) or
  ``torch.nn.parallel.DistributedDataParallel`` over gloo with ``procs`` processes on this host
  (``torch.multiprocessing`` spawn, ``init_process_group("gloo", "tcp://127.0.0.1:PORT")``).
  Every step draws one global batch of ``spec.batch`` items; a DDP rank computes its
  ``batch / procs`` of them, so one step of any system is one SGD step on ``spec.batch`` items.
  The slowed rank sleeps ``(slowdown - 1)`` times its measured forward+backward (the
  all-reduce included) after each step.
* :func:`run_latecomer`: a real ``latecomer serve`` and ``procs`` ``latecomer work`` processes on
  loopback, the model served from a temporary folder as a user's module (``benchmodel:make``,
  workers with ``--allow-problem``), ``asgd`` with the same lr and batch per job; the slowed
  worker has ``--slowdown``.

Every system saves its parameters every ``spec.snap_every`` steps (latecomer: the server's
``--eval-every``, whose evaluation here only saves x, see benchmarks/model_zoo.py), the step
and time of each, and the seconds the saving took. The snapshots are scored afterwards by
:func:`score` with the one ``TorchProblem.evaluate`` (BatchNorm statistics re-estimated at the
point, the same for every system), and every system's clock leaves out its own saving time.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

import numpy as np

from benchmarks.common import free_port, reap_mp, reap_popen, server_cpu, sleep_until

START_TIMEOUT_S = 120.0  # process start-up (imports, model and data) on a loaded machine

USER_MODULE = '''"""The model of `latecomer bench --models`, served as a user's module (benchmarks/model_zoo.py)."""

from benchmarks.model_zoo import make_problem


def make(model: str = "mlp", size: str = "small", snapshots: str = "", device: str = "cpu"):
    return make_problem(model, size, snapshots, device)
'''


@dataclass
class Run:
    """One training run of one system."""

    model: str
    size: str
    system: str  # plain, ddp, latecomer
    procs: int  # processes (plain: 1)
    slowdown: float = 1.0  # of the slowed process (1: homogeneous)
    steps: int = 0
    train_s: float = math.nan  # first step to last, saving time left out
    steps_per_s: float = math.nan
    tta_s: float = math.nan  # time to target (nan: not reached)
    tta_step: int = -1
    final: float = math.nan  # the metric at the last snapshot scored
    snap_s: float = 0.0  # seconds spent saving snapshots (left out of train_s and tta_s)
    curve: list = field(default_factory=list)  # [t_s, step, value] of the snapshots scored
    snapshots: list = field(default_factory=list)  # [t_s, step, path] before scoring
    profile: dict = field(default_factory=dict)
    skipped: str = ""
    wall_s: float = math.nan

    @property
    def name(self) -> str:
        if self.system == "plain":
            return "plain"
        return f"{self.system}-{self.procs}" + ("-slow" if self.slowdown > 1 else "")

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("snapshots")
        d["name"] = self.name
        return d


# --------------------------------------------------------------------------- gradient time


def grad_time(model: str, size: str, reps: int, threads: int, warmup: int = 2, seed: int = 1) -> dict:
    """Seconds of ``TorchProblem.grad`` and of a plain forward+backward on the same batch (medians)."""
    import torch

    from benchmarks import model_zoo as zoo

    torch.set_num_threads(threads)
    spec = zoo.spec_of(model, size)
    problem = zoo.make_problem(model, size)
    x = problem.init_params(0)
    torch.manual_seed(0)
    net = zoo.build_model(spec)
    net.train()
    loss_fn = zoo.loss_fn(spec)
    x_tr, y_tr, _, _ = zoo.train_arrays(spec)
    pos = problem.batch_positions(seed, spec.batch)
    xb, yb = x_tr[pos], y_tr[pos]

    def plain() -> float:
        t = time.perf_counter()
        net.zero_grad(set_to_none=True)
        loss_fn(net(xb), yb).backward()
        return time.perf_counter() - t

    def ours() -> float:
        t = time.perf_counter()
        problem.grad(x, seed, spec.batch)
        return time.perf_counter() - t

    for _ in range(warmup):
        plain()
        ours()
    tp, tg = [], []
    for i in range(reps):  # interleaved, the order alternating: a drift of the machine hits both alike
        if i % 2:
            tg.append(ours())
            tp.append(plain())
        else:
            tp.append(plain())
            tg.append(ours())
    # The floor the issue names: plain forward+backward plus two copies of d floats (x into the
    # model's parameters, the gradients out as one flat float32 vector), timed alike.
    params = [q for q in net.parameters() if q.requires_grad]
    flat = torch.from_numpy(np.asarray(x, dtype=np.float32))

    def copies() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            off = 0
            for q in params:
                q.copy_(flat[off:off + q.numel()].view_as(q))
                off += q.numel()
        torch.cat([q.grad.reshape(-1) for q in params]).numpy()
        return time.perf_counter() - t

    copies()
    tc = [copies() for _ in range(reps)]
    p, g, c = statistics.median(tp), statistics.median(tg), statistics.median(tc)
    return {"model": model, "size": size, "params": zoo.num_params(net), "blocks": len(params), "batch": spec.batch,
            "threads": threads, "reps": reps, "plain_s": p, "grad_s": g, "ratio": g / p if p > 0 else math.nan,
            "copies_s": c, "floor_ratio": (p + c) / p if p > 0 else math.nan, "plain_all": tp, "grad_all": tg}


def _grad_child(args: tuple, q) -> None:
    try:
        q.put(("done", grad_time(*args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        q.put(("error", traceback.format_exc()[-1500:]))


def grad_time_fresh(model: str, size: str, reps: int, threads: int, timeout_s: float = 600.0) -> dict:
    """:func:`grad_time` in a fresh process, as a worker computes: the allocator's state of this
    process (earlier models' large buffers) changes what large copies cost (a 7.4 M-parameter MLP's
    gradient measured 1.01x plain in a fresh process, 1.24x after a ResNet-18's in the same one)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_grad_child, args=((model, size, reps, threads), q), daemon=True)
    try:
        p.start()
        msg = q.get(timeout=timeout_s)
    finally:
        reap_mp([p], grace=10)
    if msg[0] == "error":
        raise RuntimeError(f"gradient timing of {model}/{size} failed: {msg[1].strip().splitlines()[-1]}")
    return msg[1]


# --------------------------------------------------------------------------- plain loop and DDP


def _torch_rank(rank: int, world: int, model: str, size: str, seconds: float, max_steps: int, slowdown: float,
                threads: int, port: int, outdir: str, q) -> None:
    """One process of a plain loop (``world`` 0) or of DDP. Rank 0 writes ``outdir/run.json`` and
    the snapshots; every rank puts ("done", rank) or ("error", rank, text) on ``q``."""
    try:
        _torch_loop(rank, world, model, size, seconds, max_steps, slowdown, threads, port, outdir)
        q.put(("done", rank))
    except BaseException:  # noqa: BLE001 - the parent reports it
        q.put(("error", rank, traceback.format_exc()[-1500:]))


def _torch_loop(rank: int, world: int, model: str, size: str, seconds: float, max_steps: int, slowdown: float,
                threads: int, port: int, outdir: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks import model_zoo as zoo

    torch.set_num_threads(threads)
    spec = zoo.spec_of(model, size)
    x_tr, y_tr, _, _ = zoo.train_arrays(spec)
    torch.manual_seed(0)  # the x0 of every system: TorchProblem.init_params(0) builds the same way
    net = zoo.build_model(spec)
    params = [p for p in net.parameters() if p.requires_grad]
    loss_fn = zoo.loss_fn(spec)
    n = max(1, world)
    if spec.batch % n:
        raise ValueError(f"batch {spec.batch} is not divisible by {n} processes")
    part = spec.batch // n
    if world:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=spec.lr)
    gen = torch.Generator().manual_seed(1234)  # the same global batches on every rank
    flag = torch.zeros(1)
    snaps, ends, compute = [], [], []

    def snapshot(step: int) -> None:
        t = time.monotonic()
        flat = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
        path = os.path.join(outdir, f"{len(snaps):05d}.npy")
        np.save(path, flat)
        snaps.append([step, t, time.monotonic() - t, path])

    if world:
        dist.barrier()
    t_first = time.monotonic()
    if rank == 0:
        snapshot(0)
    step = 0
    while True:
        idx = torch.randperm(len(x_tr), generator=gen)[:spec.batch][rank * part:(rank + 1) * part]
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x_tr[idx]), y_tr[idx]).backward()
        c = time.perf_counter() - t
        opt.step()
        compute.append(c)
        if slowdown > 1:
            time.sleep((slowdown - 1) * c)
        step += 1
        ends.append(time.monotonic())
        if rank == 0 and step % spec.snap_every == 0:
            snapshot(step)
        stop = step >= max_steps or time.monotonic() - t_first >= seconds
        if world:  # rank 0's clock decides for everyone: no rank steps alone into a collective
            flag[0] = float(stop) if rank == 0 else 0.0
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag[0])
        if stop:
            break
    if rank == 0:
        if snaps[-1][0] != step:
            snapshot(step)
        with open(os.path.join(outdir, "run.json"), "w", encoding="utf-8") as f:
            json.dump({"t_first": t_first, "ends": ends, "snapshots": snaps,
                       "compute_s": statistics.median(compute) if compute else math.nan}, f)
    if world:
        dist.barrier()
        dist.destroy_process_group()


def run_torch(model: str, size: str, procs: int, seconds: float, max_steps: int, slowdown: float, cores: int,
              outdir: str, timeout_s: float | None = None) -> Run:
    """``procs`` 0: the plain loop, ``cores`` threads; else DDP with ``procs`` ranks of
    ``cores // procs`` threads, rank ``procs - 1`` slowed by ``slowdown``."""
    import multiprocessing as mp

    system = "plain" if procs == 0 else "ddp"
    run = Run(model, size, system, max(1, procs), slowdown)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    world = procs
    threads = max(1, cores // max(1, procs))
    ps = [ctx.Process(target=_torch_rank, args=(r, world, model, size, seconds, max_steps,
                                                slowdown if (procs > 1 and r == procs - 1) else 1.0, threads, port,
                                                outdir, q), daemon=True)
          for r in range(max(1, procs))]
    t_start = time.monotonic()
    try:
        for p in ps:
            p.start()
        deadline = time.monotonic() + (timeout_s or seconds * max(1.0, slowdown) + START_TIMEOUT_S)
        done = 0
        while done < len(ps):
            msg = q.get(timeout=max(0.1, deadline - time.monotonic()))
            if msg[0] == "error":
                run.skipped = f"rank {msg[1]} failed: {msg[2].strip().splitlines()[-1]}"[:300]
                return run
            done += 1
        with open(os.path.join(outdir, "run.json"), encoding="utf-8") as f:
            got = json.load(f)
    except Exception as e:  # noqa: BLE001 - a failed run is a row saying why
        run.skipped = f"{type(e).__name__}: {e}"[:300]
        return run
    finally:
        reap_mp(ps, grace=10)
    stalls = [(t, d) for _, t, d, _ in got["snapshots"]]
    run.snapshots = [[_clock(t, got["t_first"], stalls), step, path] for step, t, _, path in got["snapshots"]]
    ends = got["ends"]
    run.steps = len(ends)
    run.snap_s = sum(d for _, d in stalls)
    if ends:
        run.train_s = _clock(ends[-1], got["t_first"], stalls)
        run.steps_per_s = run.steps / run.train_s if run.train_s > 0 else math.nan
    run.profile = {"compute_s": got["compute_s"], "threads": threads, "start_s": got["t_first"] - t_start}
    return run


def _clock(t: float, t_first: float, stalls: list[tuple[float, float]]) -> float:
    """Seconds from ``t_first`` to ``t``, less the saving stalls (start, seconds) that began before ``t``."""
    return t - t_first - sum(d for s, d in stalls if t_first <= s < t)


# --------------------------------------------------------------------------- latecomer


def _ps(args: list[str], cwd: str, stdout, stderr) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "ps", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=stderr, start_new_session=True)


def _read_events(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n") and ('"issued"' in line or '"applied"' in line):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


class _EventTail:
    """Reads the server's events file as it grows: the first job's issue time and the newest step."""

    def __init__(self, path: str):
        self.path, self.offset, self.rest = path, 0, ""
        self.t_first: float | None = None
        self.version = 0

    def poll(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return
        lines = (self.rest + chunk).split("\n")
        self.rest = lines.pop()  # a line not yet complete
        for line in lines:
            if self.t_first is None and '"issued"' in line:
                self.t_first = float(json.loads(line)["t"])
            elif '"applied"' in line:
                self.version = max(self.version, int(json.loads(line)["version"]))


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:].strip().replace("\n", " | ")
    except OSError:
        return ""


def run_latecomer(model: str, size: str, procs: int, seconds: float, max_steps: int, slowdown: float, cores: int,
                  outdir: str) -> Run:
    """A real server and ``procs`` workers (``cores // procs`` threads each; the last slowed)."""
    from benchmarks import model_zoo as zoo

    spec = zoo.spec_of(model, size)
    run = Run(model, size, "latecomer", procs, slowdown)
    folder = os.path.join(outdir, "project")
    os.makedirs(folder)
    with open(os.path.join(folder, "benchmodel.py"), "w", encoding="utf-8") as f:
        f.write(USER_MODULE)
    snaps, events = os.path.join(outdir, "snapshots"), os.path.join(folder, "events.jsonl")
    threads = max(1, cores // procs)
    serve_log = open(os.path.join(outdir, "serve.log"), "wb")  # noqa: SIM115 - closed below
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # known before the server binds: the workers start with it
    args = ["serve", "--bind", endpoint, "--problem", "benchmodel:make", "--problem-opt", f"model={model}",
            "--problem-opt", f"size={size}", "--problem-opt", f"snapshots={snaps}", "--algorithm", "asgd",
            "--set", f"lr={spec.lr}", "--batch-size", str(spec.batch), "--eval-every", str(spec.snap_every),
            "--max-time", str(START_TIMEOUT_S + seconds + 60),
            "--min-workers", str(procs), "--events", events, "--out", "out", "--log-level", "warning"]
    t_start = time.monotonic()
    server = _ps(args, folder, subprocess.DEVNULL, serve_log)
    procs_ = [server]
    logs = [serve_log]
    try:
        for i in range(procs):  # at once: they retry until the server listens
            wlog = open(os.path.join(outdir, f"work{i}.log"), "wb")  # noqa: SIM115 - closed below
            logs.append(wlog)
            w = ["work", "--server", endpoint, "--worker-id", f"w{i}", "--threads", str(threads),
                 "--allow-problem", "benchmodel:make", "--log-level", "warning", "--give-up", "60"]
            if slowdown > 1 and i == procs - 1:
                w += ["--slowdown", f"{slowdown:g}"]
            procs_.append(_ps(w, folder, subprocess.DEVNULL, wlog))
        tail, deadline = _EventTail(events), time.monotonic() + START_TIMEOUT_S
        while tail.t_first is None and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            tail.poll()
        t_first = tail.t_first
        if t_first is None:
            serve_log.flush()
            run.skipped = f"no job issued within {START_TIMEOUT_S:g} s: {_tail(serve_log.name)}"[:300]
            return run
        cpu0, sample = server_cpu(server.pid), ([], math.nan, 0)
        next_status = time.monotonic() + 1.0
        while server.poll() is None and time.monotonic() < t_first + seconds and tail.version < max_steps:
            sleep_until(min(t_first + seconds, time.monotonic() + 0.1))
            tail.poll()
            if time.monotonic() >= next_status:  # the figures a second before its end, if it ends by itself
                sample = _sample(endpoint, server.pid) or sample
                next_status = time.monotonic() + 1.0
        sample = _sample(endpoint, server.pid) or sample
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)  # graceful: the last snapshot, bye to the workers
        t_stop = time.monotonic()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.skipped = "the server did not stop within 60 s of SIGTERM"
            return run
        for w in procs_[1:]:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        timing = {"start_s": t_first - t_start, "stop_s": time.monotonic() - t_stop}
        with open(os.path.join(folder, "out", "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    except Exception as e:  # noqa: BLE001
        run.skipped = f"{type(e).__name__}: {e}"[:300]
        return run
    finally:
        reap_popen(procs_[1:], grace=5)
        reap_popen(procs_[:1], grace=5)
        for f in logs:
            f.close()
    rows, cpu1, version = sample
    _latecomer_figures(run, _read_events(events), summary, t_first, snaps, rows,
                       (cpu1 - cpu0) / version if version else math.nan, threads)
    run.profile.update(timing)
    return run


def _sample(endpoint: str, pid: int) -> tuple[list[dict], float, int] | None:
    """(the server's worker rows, its CPU seconds so far, its step) from a status request (None: no answer)."""
    from ps.ops.status import fetch_status

    try:
        st = fetch_status(endpoint, timeout_s=2.0)
        cpu = server_cpu(pid)
    except (TimeoutError, OSError):
        return None
    return [dict(zip(st.columns, row, strict=False)) for row in st.rows], cpu, int(st.info.get("version", 0))


def _latecomer_figures(run: Run, events: list[dict], summary: dict, t_first: float, snaps: str, rows: list[dict],
                       cpu_per_update: float, threads: int) -> None:
    applied = sorted((e["t"], e["version"]) for e in events if e["ev"] == "applied")
    ages = [e["age"] for e in events if e["ev"] == "applied"]
    evals = [e for e in summary.get("evaluations", []) if "snapshot" in e]
    # the server's evaluation times count from its first job issued: t_first, to the events' resolution
    # a saving the loop waited for (evaluations on the loop) is left out of the clock; one in the server's
    # evaluation thread is not: the loop went on meanwhile
    stalls = [(t_first + e["t"], e.get("snapshot_s", 0.0)) for e in evals if e.get("in_loop", 1.0)]
    at = {}  # version -> time it was reached
    for t, v in applied:
        at.setdefault(int(v), t)
    run.snapshots = []
    for e in evals:
        v = int(e["version"])
        t = t_first if v == 0 else at.get(v)
        if t is None:
            continue
        run.snapshots.append([_clock(t, t_first, stalls), v, os.path.join(snaps, f"{int(e['snapshot']):05d}.npy")])
    run.steps = int(applied[-1][1]) if applied else 0
    run.snap_s = sum(e.get("snapshot_s", 0.0) for e in evals)
    if applied:
        run.train_s = _clock(applied[-1][0], t_first, stalls)
        run.steps_per_s = run.steps / run.train_s if run.train_s > 0 else math.nan
    c = summary.get("counters", {})
    run.profile = {"threads": threads, "server_cpu_s_per_update": cpu_per_update,
                   "snapshots_in_loop": bool(evals) and all(e.get("in_loop", 1.0) for e in evals),
                   "workers": [{"id": r.get("worker"), "jobs": r.get("jobs_done"), "mean_job_s": r.get("mean_job_s")}
                               for r in rows],
                   "lost": c.get("lost"), "dropped": c.get("dropped"),
                   "age_mean": float(np.mean(ages)) if ages else math.nan, "age_max": int(max(ages)) if ages else 0}


# --------------------------------------------------------------------------- scoring


def score(run: Run, problem, spec, max_points: int = 24) -> None:
    """Evaluate ``run``'s snapshots with ``problem.evaluate``: every one up to the first that
    reaches ``spec``'s target (its time is the time to target), then evenly thinned to at most
    ``max_points`` in all, the last always included."""
    snaps = sorted(run.snapshots, key=lambda s: s[1])
    run.curve = []
    if not snaps:
        return
    picked = set()
    i = 0
    while i < len(snaps):
        t, step, path = snaps[i]
        value = float(problem.evaluate(np.load(path))[spec.metric])
        run.curve.append([t, step, value])
        picked.add(i)
        if spec.reached(value):
            run.tta_s, run.tta_step = t, step
            break
        i += 1
    rest = [j for j in range(i + 1, len(snaps))]
    room = max(1, max_points - len(run.curve))
    if rest:
        keep = {rest[round(k * (len(rest) - 1) / max(1, room - 1))] for k in range(min(room, len(rest)))}
        keep.add(rest[-1])
        for j in sorted(keep):
            t, step, path = snaps[j]
            run.curve.append([t, step, float(problem.evaluate(np.load(path))[spec.metric])])
    run.final = run.curve[-1][2]


def tmpdir(prefix: str) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=prefix)
