"""The simulator experiments re-run on the real daemon with local worker processes.

``latecomer experiment async-vs-sync --real`` / ``ordered-momentum --real``: a small simulator
grid picks the best setting per method (the same selection rule as the simulator experiment,
scaled down to n = 4 workers), then each method runs once with that setting on a real
:class:`ps.drivers.daemon.Daemon` (in-process, tcp://127.0.0.1) with ``n`` worker subprocesses
(``python -m ps work --delay SECONDS [--data-delay]``) whose injected delay is the simulator's
τ_i times ``scale`` seconds. Outputs: ``curves.csv`` (simulator and real curves, long format),
``side_by_side.png`` (left: simulator, x = simulated time; right: real, x = seconds since the first
job; same methods and colours) and ``summary.md`` (final metric per method in both systems, the two
rankings, Kendall τ and whether the order is the same).

Real runs are not deterministic (OS scheduling decides which worker replies first), so these
experiments are not in :data:`experiments.EXPERIMENTS` (whose tests check determinism).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from experiments import common
from experiments.sync_sgd import SyncSGD
from problems import load_problem
from problems.trust import is_user_problem
from ps.core.config import CoreConfig
from ps.drivers.sim import DelayModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


# --------------------------------------------------------------------------- one real run

def _build_algorithm(method: str, params: dict[str, Any], n: int, extra: dict[str, Any] | None = None):
    if method == "sync-sgd":
        return SyncSGD(n_workers=n, **params)
    return common.build(method, params, extra)


def run_real(problem_name: str, problem_opts: dict[str, Any], method: str, params: dict[str, Any], *,
             delays: Sequence[float], budget_s: float, eval_s: float, batch_size: int = 1,
             data_delay: bool = False, seed: int = 0, extra: dict[str, Any] | None = None,
             log_path: str | None = None, start_timeout_s: float = 60.0) -> list[dict[str, float]]:
    """Run ``method`` with ``params`` on a real daemon with ``len(delays)`` local worker processes.

    Worker ``i`` sleeps ``delays[i]`` seconds per job (times the batch's sample cost with
    ``data_delay``). The daemon evaluates every ``eval_s`` seconds of training (time counted from
    the first job) and stops ``budget_s`` seconds after the first job (or ``start_timeout_s`` +
    ``budget_s`` after it started, if the workers never come). Every worker is reaped with bounded
    waits. Returns ``daemon.evaluations`` (dicts with ``t``, ``version`` and the problem's figures).
    """
    from ps.core.server_core import ServerCore
    from ps.drivers.daemon import Daemon, StopCondition

    n = len(delays)
    problem = load_problem(problem_name, problem_opts)
    alg = _build_algorithm(method, params, n, extra)
    cfg = CoreConfig(problem=problem_name, problem_options=dict(problem.options or problem_opts),
                     batch_size=batch_size, min_workers=n, liveness_timeout_s=5.0, seed=seed)
    core = ServerCore(alg, problem.init_params(seed), cfg, now=time.monotonic())
    daemon = Daemon(core, problem, "tcp://127.0.0.1:0", stop=StopCondition(max_time_s=start_timeout_s + budget_s),
                    eval_every=0)
    last = [0.0]

    def on_progress(d: Daemon, ev: dict[str, float] | None) -> None:
        if d.training_started_at is None:
            return
        t = d.clock() - d.training_started_at
        if t >= budget_s:
            d.stopping = d.stopping or f"budget {budget_s:g} s"
        elif t - last[0] >= eval_s:
            last[0] = t
            d.evaluate()

    daemon.on_progress = on_progress
    log = open(log_path, "a", encoding="utf-8") if log_path else subprocess.DEVNULL
    procs: list[subprocess.Popen] = []
    try:
        for i, dl in enumerate(delays):
            cmd = [sys.executable, "-m", "ps", "work", "--server", daemon.endpoint, "--worker-id", f"w{i + 1}",
                   "--delay", f"{dl:g}", "--give-up", "10", "--seed", str(seed * 1000 + i),
                   *(["--data-delay"] if data_delay else []),
                   *(["--allow-problem", problem_name] if is_user_problem(problem_name) else [])]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
        daemon.run()
    finally:
        daemon.close()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        if log_path:
            log.close()
    return [dict(ev) for ev in daemon.evaluations if ev["t"] <= budget_s + 1.0]


# --------------------------------------------------------------------------- comparison helpers

def ranking(finals: dict[str, float], higher_is_better: bool) -> list[str]:
    """Methods from best to worst (non-finite values last)."""
    def key(m: str) -> tuple:
        v = finals[m]
        if not math.isfinite(v):
            return (1, 0.0)
        return (0, -v if higher_is_better else v)

    return sorted(finals, key=key)


def kendall_tau(a: Sequence[str], b: Sequence[str]) -> float:
    """Kendall τ between two orders of the same items (1: same order, −1: reversed)."""
    pos_a = {m: i for i, m in enumerate(a)}
    pos_b = {m: i for i, m in enumerate(b)}
    items = list(a)
    conc = disc = 0
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            s = (pos_a[items[i]] - pos_a[items[j]]) * (pos_b[items[i]] - pos_b[items[j]])
            conc += s > 0
            disc += s < 0
    pairs = len(items) * (len(items) - 1) // 2
    return (conc - disc) / pairs if pairs else 1.0


def plot_side_by_side(path: str, methods: Sequence[str], labels: dict[str, str],
                      sim: dict[str, tuple[np.ndarray, np.ndarray]], real: dict[str, tuple[np.ndarray, np.ndarray]], *,
                      ylabel: str, suptitle: str, logy: bool, sim_title: str, real_title: str,
                      hline: float | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.4))
    for ax, curves, title, xlabel in ((axes[0], sim, sim_title, "simulated time (s)"),
                                      (axes[1], real, real_title, "wall-clock time since the first job (s)")):
        for k, m in enumerate(methods):
            x, y = curves[m]
            ok = np.isfinite(y) & ((y > 0) if logy else True)
            ax.plot(x[ok], y[ok], label=labels[m], color=COLORS[k % len(COLORS)], linewidth=1.3)
        common.style_axis(ax, title, xlabel, ylabel, logy=logy, hline=hline)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=common.DPI)
    plt.close(fig)
    common._shrink_png(path)
    return path


def _compare(out_dir: str, *, name: str, methods: Sequence[str], labels: dict[str, str], metric: str,
             higher_is_better: bool, best: dict[str, common.Run], real: dict[str, list[dict[str, float]]],
             real_secs: dict[str, float], intro: str, ylabel: str, suptitle: str, logy: bool, sim_title: str,
             real_title: str, columns: Sequence[str], hline: float | None = None,
             target: float | None = None) -> dict:
    """Write curves.csv, side_by_side.png and summary.md for one sim-vs-real comparison."""
    rows = []
    for m in methods:
        for p in best[m].points:
            rows.append(["sim", m, best[m].label, *(float(p[c]) if c in p else "" for c in columns)])
        for p in real[m]:
            rows.append(["real", m, best[m].label, *(float(p[c]) if c in p else "" for c in columns)])
    csv_path = common.write_rows_csv(os.path.join(out_dir, "curves.csv"), ["system", "method", "setting", *columns],
                                     rows)

    def arr(points: list[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
        return (np.array([p["t"] for p in points], dtype=float), np.array([p[metric] for p in points], dtype=float))

    png = plot_side_by_side(os.path.join(out_dir, "side_by_side.png"), methods, labels,
                            {m: arr(best[m].points) for m in methods}, {m: arr(real[m]) for m in methods},
                            ylabel=ylabel, suptitle=suptitle, logy=logy, sim_title=sim_title, real_title=real_title,
                            hline=hline)
    sim_final = {m: (float(best[m].points[-1][metric]) if best[m].points and not best[m].diverged else math.nan)
                 for m in methods}
    real_final = {m: (float(real[m][-1][metric]) if real[m] else math.nan) for m in methods}
    sim_rank = ranking(sim_final, higher_is_better)
    real_rank = ranking(real_final, higher_is_better)
    tau = kendall_tau(sim_rank, real_rank)
    same = sim_rank == real_rank
    table = common.markdown_table(
        ["method", "setting", f"sim final {metric}", "sim rank", f"real final {metric}", "real rank",
         "real updates", "real run (s)"],
        [[labels[m], best[m].label, f"{sim_final[m]:.4g}", sim_rank.index(m) + 1, f"{real_final[m]:.4g}",
          real_rank.index(m) + 1, int(real[m][-1]["version"]) if real[m] else 0, f"{real_secs[m]:.1f}"]
         for m in methods])
    order = " > ".join
    md = (f"# {name} (simulator vs real daemon)\n\n{intro}\n\n" + table
          + f"\nRanking by final {metric} ({'higher' if higher_is_better else 'lower'} is better):\n\n"
          f"- simulator: {order(labels[m] for m in sim_rank)}\n"
          f"- real: {order(labels[m] for m in real_rank)}\n"
          f"- same order: {'yes' if same else 'no'}; Kendall τ = {tau:.2f}\n")
    if target is not None:  # the simulator experiment's own metric: time until metric <= target
        def ttt(points: list[dict[str, float]]) -> float:
            return next((float(p["t"]) for p in points if p[metric] <= target), math.inf)

        sim_t = {m: ttt(best[m].points) for m in methods}
        real_t = {m: ttt(real[m]) for m in methods}
        sim_tr, real_tr = ranking(sim_t, False), ranking(real_t, False)
        md += (f"\nTime until {metric} ≤ {target:g} (the simulator experiment's metric; simulated s vs real s):\n\n"
               + common.markdown_table(["method", "sim", "real"],
                                       [[labels[m], common.fmt_num(sim_t[m]), common.fmt_num(real_t[m])]
                                        for m in methods])
               + f"\n- simulator: {order(labels[m] for m in sim_tr)}\n- real: {order(labels[m] for m in real_tr)}\n"
               f"- same order: {'yes' if sim_tr == real_tr else 'no'}; "
               f"Kendall τ = {kendall_tau(sim_tr, real_tr):.2f}\n")
    md_path = common.write_text(os.path.join(out_dir, "summary.md"), md)
    return {"csv": [csv_path], "png": [png], "markdown": md_path,
            "headline": {"sim": sim_final, "real": real_final},
            "ranking": {"sim": sim_rank, "real": real_rank, "kendall_tau": tau, "same": same}}


def _real_all(methods: Sequence[str], one: Callable[[str], list[dict[str, float]]], progress: bool, desc: str
              ) -> tuple[dict[str, list[dict[str, float]]], dict[str, float]]:
    from tqdm import tqdm

    real, secs = {}, {}
    for m in tqdm(methods, desc=desc, unit="run", disable=not progress, dynamic_ncols=True):
        t0 = time.monotonic()
        real[m] = one(m)
        secs[m] = time.monotonic() - t0
    return real, secs


# --------------------------------------------------------------------------- async-vs-sync

AVS_METHODS = ("sync-sgd", "asgd", "ringmaster", "ordered-momentum")


def async_vs_sync(out_dir: str, quick: bool = False, seed: int = 0, progress: bool = True) -> dict:
    """Experiment 5 (async-vs-sync), sqrt delay model only, n = 4 workers: simulator vs real daemon."""
    from experiments import async_vs_sync as avs

    n, d = 4, 64 if quick else 256
    methods = ("sync-sgd", "asgd") if quick else AVS_METHODS
    horizon = 600.0 if quick else 1500.0  # simulated seconds (τ_i = √i)
    budget = 6.0 if quick else 20.0  # real seconds
    scale = budget / horizon  # real seconds per simulated second
    target = avs.config(quick)["target"]
    grids = avs.config(quick)["grids"]
    os.makedirs(out_dir, exist_ok=True)
    runs = []
    for m in methods:
        for params in grids[m]:
            def make(m=m, params=params):
                alg = _build_algorithm(m, params, n)
                cfg = CoreConfig(min_workers=n, liveness_timeout_s=1e9, seed=seed)
                return (alg, load_problem("quadratic", {"d": d}), DelayModel.named("sqrt", n, noise="frac"), cfg,
                        {"seed": seed + 1})

            runs.append(common.Run("sqrt", m, params, make, horizon))
    common.execute(runs, metric="loss", eval_interval=horizon / 100, progress=progress, desc="async-vs-sync sim")
    best = {m: r for (_, m), r in common.best_per_method(
        runs, key=lambda r: (common.time_to_target(r, "loss", target), common.final_value(r, "loss"))).items()}
    delays = [float(t) * scale for t in DelayModel.named("sqrt", n, noise="frac").tau]
    log = os.path.join(out_dir, "workers.log")
    real, secs = _real_all(methods, lambda m: run_real("quadratic", {"d": d}, m, best[m].params, delays=delays,
                                                       budget_s=budget, eval_s=budget / 50, seed=seed, log_path=log),
                           progress, "async-vs-sync real")
    intro = (f"Quadratic d = {d}, n = {n} workers, sqrt delay model τ_i = √i. Simulator: horizon {horizon:g} s, "
             "per-job noise 5 % of τ_i, best setting per method over the async-vs-sync grid (lowest time to "
             f"f − f* ≤ {target:g}, then lowest final loss). Real daemon: the same settings, worker i sleeps "
             f"τ_i × {scale:.3g} s per job ({', '.join(f'{x:.3g}' for x in delays)} s), {budget:g} s of training "
             "(the simulated horizon scaled by the same factor).")
    return _compare(out_dir, name=f"async-vs-sync, sqrt{', quick' if quick else ''}", methods=methods,
                    labels=avs.LABELS, metric="loss", higher_is_better=False, best=best, real=real, real_secs=secs,
                    intro=intro, ylabel="f(x) − f*", logy=True, hline=target,
                    suptitle=f"sync vs async SGD, quadratic d={d}, n={n}, τ_i = √i: simulator vs real daemon",
                    sim_title=f"simulator (horizon {horizon:g})", real_title=f"real daemon, delay τ_i × {scale:.3g} s",
                    columns=["t", "version", "loss", "grad_norm_sq"], target=target)


# --------------------------------------------------------------------------- ordered-momentum

OM_METHODS = ("ordered-momentum", "asgd", "naive-momentum")


def ordered_momentum(out_dir: str, quick: bool = False, seed: int = 0, progress: bool = True) -> dict:
    """Experiment 2 (ordered-momentum), M = 4 workers, class 9 κ = 10× slower: simulator vs real daemon."""
    import torch

    from experiments import ordered_momentum as om

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _ordered_momentum(out_dir, quick, seed, progress, om)
    finally:
        torch.set_num_threads(threads)


def _ordered_momentum(out_dir: str, quick: bool, seed: int, progress: bool, om) -> dict:
    m_workers, batch, kappa = 4, 32, 10.0
    methods = ("ordered-momentum", "asgd") if quick else OM_METHODS
    horizon = 120.0 if quick else 400.0  # simulated seconds (τ = 1, class 9: κ)
    budget = 6.0 if quick else 20.0
    scale = budget / horizon
    lrs, betas = ((0.1,), (0.1,)) if quick else ((0.03, 0.1, 0.3), (0.1, 0.3))
    grids = {"ordered-momentum": common.grid(lr=lrs, beta=betas), "asgd": common.grid(lr=lrs),
             "naive-momentum": common.grid(lr=lrs, beta=betas)}
    opts = {"homogeneous": True, "slow_class": 9, "kappa": kappa}
    problem = load_problem("digits", opts)
    os.makedirs(out_dir, exist_ok=True)
    runs = []
    for m in methods:
        for params in grids[m]:
            def make(m=m, params=params):
                cfg = CoreConfig(min_workers=m_workers, liveness_timeout_s=1e9, seed=seed, batch_size=batch)
                return (common.build(m, params), problem, DelayModel.named("uniform", m_workers, noise="frac"), cfg,
                        {"seed": seed + 1})

            runs.append(common.Run("standard", m, params, make, horizon))
    common.execute(runs, metric=om.GUARD, eval_interval=horizon / 40, progress=progress, desc="ordered-momentum sim")
    best = {m: r for (_, m), r in common.best_per_method(runs, key=lambda r: (-om.final_f1(r),)).items()}
    delays = [scale] * m_workers
    log = os.path.join(out_dir, "workers.log")
    real, secs = _real_all(methods, lambda m: run_real("digits", opts, m, best[m].params, delays=delays,
                                                       budget_s=budget, eval_s=budget / 40, batch_size=batch,
                                                       data_delay=True, seed=seed, log_path=log),
                           progress, "ordered-momentum real")
    intro = (f"digits MLP, homogeneous batches of {batch}, M = {m_workers} equal workers, class 9 κ = {kappa:g}× "
             f"slower. Simulator: horizon {horizon:g} s (τ = 1 s, noise 5 %), best setting per method by final "
             f"test macro-F1 over lr ∈ {{{', '.join(f'{x:g}' for x in lrs)}}}"
             + (f" × β ∈ {{{', '.join(f'{x:g}' for x in betas)}}}" if not quick else "")
             + f". Real daemon: the same settings, every worker sleeps {scale:g} s per job (× κ for a class-9 "
             f"batch, `--data-delay`), {budget:g} s of training.")
    return _compare(out_dir, name=f"ordered-momentum{', quick' if quick else ''}", methods=methods,
                    labels=om.LABELS, metric="f1", higher_is_better=True, best=best, real=real, real_secs=secs,
                    intro=intro, ylabel="test macro-F1", logy=False,
                    suptitle=f"digits MLP, M = {m_workers}, class 9 κ = {kappa:g}× slower: simulator vs real daemon",
                    sim_title=f"simulator (horizon {horizon:g})",
                    real_title=f"real daemon, delay {scale:g} s (× κ for class 9)",
                    columns=["t", "version", "f1", "recall_slow", "accuracy", "loss"])


REAL_EXPERIMENTS: dict[str, Callable[..., dict]] = {
    "async-vs-sync": async_vs_sync,
    "ordered-momentum": ordered_momentum,
}

__all__ = ["REAL_EXPERIMENTS", "async_vs_sync", "kendall_tau", "ordered_momentum", "ranking", "run_real"]
