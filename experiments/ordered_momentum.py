"""Ordered Momentum (A6) and Ordered μ²-SGD (A7) under data-dependent delays (docs/ALGORITHMS.md §4).

Setup ("Reference experiments (data-dependent delays)", our choices [I]): the ``digits`` MLP
(64–32–10 ReLU) with ``homogeneous=True``: every job draws a minibatch of 32 from one class,
picked with its train frequency (unbiased), and a class-9 batch takes κ = 10 times longer
(``sample_cost``; ``DelayModel(data_dependent=True)``, the default). M = 8 workers with equal
base speed (``DelayModel.named("uniform", 8, noise="frac")``: τ = 1 s, a class-9 job 10 s, plus
half-normal noise 5 % of τ). With these numbers about half the workers are busy with a class-9
batch at any time, and a class-9 gradient arrives some 40 versions old (a fast one about 7).

Methods: Ordered Momentum (``ordered-momentum``) and Ordered μ²-SGD (``ordered-mu2``, constant
weights, γ_x = 0.1; its GRAD_PAIR jobs cost two gradients) against vanilla ASGD (``asgd``), naive
momentum (``naive-momentum``), delay-adaptive SGD (``delay-adaptive``, ``n_workers`` = M) and
delay-filtered SGD (``delay-filtered``). Each method is tuned over the lr grid of :func:`config`
(× β for the momentum methods, × τ_max for delay-filtered); the setting with the highest final test
macro-F1 is reported. Metrics against simulated time: test macro-F1 (``f1``) and class-9 recall
(``recall_slow``). Also: (a) the lr sweep, the final F1 at each lr (best β / τ_max there) per
method; (b) the non-Lipschitz variant (``cubic=True``, logits z ↦ z³), each method with its best
β / τ_max from the standard run over the cubic lr grid; (c) in the default run, the best setting
of each method re-run with other seeds (initialization, minibatches and delay noise).

Claim (Dahan, Reshef, Goldstein, Levy, arXiv 2605.02043, via the seed summary): the ordered
methods reach higher test F1, are more stable across learning rates, and do not under-represent
the slow class.
"""

from __future__ import annotations

import math
import os

import numpy as np

from experiments import common
from problems import load_problem
from ps.core import CoreConfig
from ps.sim import DelayModel

GUARD = "loss"  # divergence check on the test loss (common.simulate_run)
METHODS = ("ordered-momentum", "ordered-mu2", "asgd", "naive-momentum", "delay-adaptive", "delay-filtered")
LABELS = {"ordered-momentum": "Ordered Momentum", "ordered-mu2": "Ordered μ²-SGD", "asgd": "ASGD",
          "naive-momentum": "naive momentum", "delay-adaptive": "delay-adaptive", "delay-filtered": "delay-filtered"}
COLUMNS = ["t", "version", "f1", "recall_slow", "accuracy", "loss", "train_loss", "applied", "dropped"]
GROUPS = ("standard", "cubic")


def config(quick: bool) -> dict:
    m = 8
    if quick:
        lrs, betas = (0.03, 0.1), (0.01, 0.1)
        return {"M": m, "batch": 32, "kappa": 10.0, "horizon": 150.0, "points": 30, "cubic_lr": (0.03,),
                "seeds": (), "tail": 0.1, "grids": _grids(m, lrs, betas, (4 * m,))}
    lrs, betas = (0.01, 0.03, 0.1, 0.3, 1.0), (0.01, 0.1, 0.3)
    return {"M": m, "batch": 32, "kappa": 10.0, "horizon": 600.0, "points": 60,
            "cubic_lr": (0.01, 0.02, 0.03, 0.05, 0.1),
            "seeds": (1, 2, 3), "tail": 0.1, "grids": _grids(m, lrs, betas, (m, 4 * m))}


def _grids(m: int, lrs: tuple, betas: tuple, taus: tuple) -> dict[str, list[dict]]:
    return {
        "ordered-momentum": common.grid(lr=lrs, beta=betas),
        "ordered-mu2": common.grid(lr=lrs, beta=betas),
        "asgd": common.grid(lr=lrs),
        "naive-momentum": common.grid(lr=lrs, beta=betas),
        "delay-adaptive": common.grid(lr=lrs),
        "delay-filtered": common.grid(lr=lrs, tau_max=taus),
    }


def _extra(method: str, c: dict) -> dict:
    return {"n_workers": c["M"]} if method == "delay-adaptive" else {}


def _sim_run(c: dict, problem, group: str, method: str, params: dict, seed: int) -> common.Run:
    def make():
        alg = common.build(method, params, _extra(method, c))
        cfg = CoreConfig(min_workers=c["M"], liveness_timeout_s=1e9, seed=seed, batch_size=c["batch"])
        delays = DelayModel.named("uniform", c["M"], noise="frac")  # data_dependent=True (default)
        return alg, problem, delays, cfg, {"seed": seed + 1}

    return common.Run(group, method, params, make, c["horizon"])


def final_f1(r: common.Run, metric: str = "f1") -> float:
    """``metric`` at the end of the horizon; a diverged run (or one without points) scores 0."""
    if r.diverged or not r.points:
        return 0.0
    return float(r.points[-1][metric])


def tail_mean(r: common.Run, frac: float, metric: str = "f1") -> float:
    """Mean of ``metric`` over the evaluations in the last ``frac`` of the horizon (0 if diverged)."""
    if r.diverged or not r.points:
        return 0.0
    t0 = r.horizon * (1.0 - frac)
    return float(np.mean([p[metric] for p in r.points if p["t"] >= t0 - 1e-9]))


def _key(r: common.Run) -> tuple:
    return (-final_f1(r),)


def _sweep(runs: list[common.Run]) -> dict[tuple[str, str], list[tuple[float, common.Run]]]:
    """(group, method) -> [(lr, best run at that lr)] sorted by lr (best: highest final F1)."""
    by: dict[tuple[str, str, float], common.Run] = {}
    for r in runs:
        k = (r.group, r.method, float(r.params["lr"]))
        if k not in by or _key(r) < _key(by[k]):
            by[k] = r
    out: dict[tuple[str, str], list[tuple[float, common.Run]]] = {}
    for (g, m, lr), r in by.items():
        out.setdefault((g, m), []).append((lr, r))
    return {k: sorted(v, key=lambda x: x[0]) for k, v in out.items()}


def _plot_sweep(path: str, sweep: dict, groups: list[str]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("f1", "final test macro-F1"), ("recall_slow", "final class-9 recall"))
    fig, axes = plt.subplots(len(metrics), len(groups), figsize=(4.4 * len(groups), 3.2 * len(metrics)),
                             squeeze=False)
    for j, g in enumerate(groups):
        for i, (metric, ylabel) in enumerate(metrics):
            ax = axes[i][j]
            for m in METHODS:
                pts = sweep.get((g, m), [])
                ax.plot([lr for lr, _ in pts], [final_f1(r, metric) for _, r in pts], marker="o", markersize=3,
                        linewidth=1.3, label=LABELS[m])
            ax.set_xscale("log")
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(f"{g}: {ylabel}", fontsize=9)
            ax.set_xlabel("learning rate (best β / τ_max at each lr)", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.25)
            ax.legend(fontsize=6.5)
    fig.suptitle("learning-rate sweep, digits MLP, M = 8, class 9 κ = 10× slower", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=common.DPI)
    plt.close(fig)
    common._shrink_png(path)
    return path


def run(out_dir: str, quick: bool = False, seed: int = 0, progress: bool = True) -> dict:
    """Run the experiment (see the module docstring) on one torch thread: the 64–32–10 MLP is too
    small to gain from more, and on a shared 2-core machine extra threads only contend."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(out_dir, quick, seed, progress)
    finally:
        torch.set_num_threads(threads)


def _run(out_dir: str, quick: bool, seed: int, progress: bool) -> dict:
    c = config(quick)
    os.makedirs(out_dir, exist_ok=True)
    opts = {"homogeneous": True, "slow_class": 9, "kappa": c["kappa"]}
    problems = {"standard": load_problem("digits", opts), "cubic": load_problem("digits", {**opts, "cubic": True})}
    ei = c["horizon"] / c["points"]

    main = [_sim_run(c, problems["standard"], "standard", m, p, seed) for m in METHODS for p in c["grids"][m]]
    common.execute(main, metric=GUARD, eval_interval=ei, progress=progress, desc="ordered-momentum")
    best_std = common.best_per_method(main, key=_key)

    # (b) cubic: each method's best non-lr setting from the standard run, over the cubic lr grid
    cubic = []
    for m in METHODS:
        fixed = {k: v for k, v in best_std[("standard", m)].params.items() if k != "lr"}
        cubic += [_sim_run(c, problems["cubic"], "cubic", m, {"lr": lr, **fixed}, seed) for lr in c["cubic_lr"]]
    common.execute(cubic, metric=GUARD, eval_interval=ei, progress=progress, desc="ordered-momentum cubic")
    runs = main + cubic
    best = common.best_per_method(runs, key=_key)

    # (c) robustness to the seed: the best setting of each method with other seeds
    reseeded = [_sim_run(c, problems[g], g, m, best[(g, m)].params, seed + 100 * s)
                for s in c["seeds"] for g in GROUPS for m in METHODS]
    common.execute(reseeded, metric=GUARD, eval_interval=ei, progress=progress, desc="ordered-momentum seeds")

    csv_curves = common.write_curves_csv(os.path.join(out_dir, "curves.csv"), runs, best, COLUMNS)
    sweep = _sweep(runs)
    csv_sweep = common.write_rows_csv(
        os.path.join(out_dir, "lr_sweep.csv"), ["group", "method", "lr", "setting", "f1", "recall_slow", "diverged"],
        [[g, m, lr, r.label, final_f1(r), final_f1(r, "recall_slow"), int(r.diverged)]
         for g in GROUPS for m in METHODS for lr, r in sweep[(g, m)]])
    csvs = [csv_curves, csv_sweep]
    seed_f1: dict[tuple[str, str], list[float]] = {}
    if reseeded:
        rows = []
        for i, r in enumerate(reseeded):
            s = seed + 100 * c["seeds"][i // (len(GROUPS) * len(METHODS))]
            rows.append([r.group, r.method, r.label, s, final_f1(r), final_f1(r, "recall_slow"),
                         tail_mean(r, c["tail"]), int(r.diverged)])
            seed_f1.setdefault((r.group, r.method), []).append(final_f1(r))
        csvs.append(common.write_rows_csv(os.path.join(out_dir, "seeds.csv"),
                                          ["group", "method", "setting", "seed", "f1", "recall_slow", "f1_tail",
                                           "diverged"], rows))

    def lines(g: str, metric: str) -> list:
        return [(f"{LABELS[m]} ({best[(g, m)].label})", *common.curve(best[(g, m)], metric)) for m in METHODS]

    title = (f"digits MLP, homogeneous batches of {c['batch']}, M = {c['M']} equal workers, "
             f"class 9 κ = {c['kappa']:g}× slower")
    short = f"digits MLP, M = {c['M']}, class 9 κ = {c['kappa']:g}× slower"
    panel = f"softmax CE, homogeneous batches of {c['batch']}"
    png_f1 = common.plot_panels(os.path.join(out_dir, "f1.png"), [(panel, lines("standard", "f1"))],
                                xlabel="simulated time (s)", ylabel="test macro-F1", suptitle=short, logy=False,
                                ncols=1)
    png_rec = common.plot_panels(os.path.join(out_dir, "recall_slow.png"), [(panel, lines("standard", "recall_slow"))],
                                 xlabel="simulated time (s)", ylabel="class-9 recall", suptitle=short, logy=False,
                                 ncols=1)
    png_sweep = _plot_sweep(os.path.join(out_dir, "lr_sweep.png"), sweep, list(GROUPS))
    png_cubic = common.plot_panels(os.path.join(out_dir, "cubic.png"),
                                   [("cubic logits: test macro-F1", lines("cubic", "f1")),
                                    ("cubic logits: class-9 recall", lines("cubic", "recall_slow"))],
                                   xlabel="simulated time (s)", ylabel="",
                                   suptitle=f"non-Lipschitz variant (cubic logits), {short}", logy=False, ncols=2)

    headline: dict[str, dict[str, float]] = {}
    tables = []
    for g in GROUPS:
        rows = []
        for m in METHODS:
            r = best[(g, m)]
            pts = sweep[(g, m)]
            f1_best = final_f1(r)
            robust = sum(final_f1(x) >= f1_best - 0.05 for _, x in pts)
            cells = [LABELS[m], r.label, f"{f1_best:.3f}", f"{final_f1(r, 'recall_slow'):.3f}",
                     f"{tail_mean(r, c['tail']):.3f}", f"{tail_mean(r, c['tail'], 'recall_slow'):.3f}",
                     f"{robust}/{len(pts)}", str(r.counters.get("updates", 0))]
            if seed_f1:
                v = seed_f1[(g, m)]
                cells.append(f"{np.mean(v):.3f} ± {np.std(v):.3f}")
            rows.append(cells)
            headline.setdefault(f"{g} f1", {})[m] = f1_best
            headline.setdefault(f"{g} recall_slow", {})[m] = final_f1(r, "recall_slow")
        header = ["method", "best setting", "final F1", "final class-9 recall",
                  f"F1, last {c['tail']:.0%}", f"recall, last {c['tail']:.0%}", "lrs within 0.05 of best F1",
                  "updates"]
        if seed_f1:
            header.append(f"final F1 over seeds +{', +'.join(str(100 * s) for s in c['seeds'])}")
        tables.append(f"### {g}\n\n" + common.markdown_table(header, rows))
    # β (τ_max for delay-filtered) vs the slow class: best lr per value, standard objective
    knob_rows = []
    for m in METHODS:
        knob = "tau_max" if m == "delay-filtered" else "beta"
        by: dict[float, common.Run] = {}
        for r in main:
            if r.method == m and knob in r.params:
                v = r.params[knob]
                if v not in by or _key(r) < _key(by[v]):
                    by[v] = r
        for v, r in sorted(by.items()):
            knob_rows.append([LABELS[m], f"{knob}={v:g}", f"lr={r.params['lr']:g}", f"{final_f1(r):.3f}",
                              f"{final_f1(r, 'recall_slow'):.3f}", f"{tail_mean(r, c['tail'], 'recall_slow'):.3f}"])
    tables.append("### standard, by β / τ_max (best lr for each)\n\n" + common.markdown_table(
        ["method", "setting", "best lr", "final F1", "final class-9 recall", f"recall, last {c['tail']:.0%}"],
        knob_rows))
    start = main[0].points[0]
    md = (f"# ordered-momentum (seed {seed}{', quick' if quick else ''})\n\n"
          f"{title}; simulated horizon {c['horizon']:g} s, evaluated every {ei:g} s (start: F1 "
          f"{start['f1']:.3f}, loss {start['loss']:.3g}). Best setting per method = highest final test macro-F1; "
          "the 'lrs within 0.05' column counts the lr grid points (best β / τ_max at each) whose final F1 is within "
          "0.05 of the method's best. Cubic: each method's best β / τ_max from the standard run, lr over "
          f"{', '.join(f'{x:g}' for x in c['cubic_lr'])}.\n\n" + "\n".join(tables))
    md_path = common.write_text(os.path.join(out_dir, "summary.md"), md)
    assert all(math.isfinite(v) for d in headline.values() for v in d.values())
    return {"csv": csvs, "png": [png_f1, png_rec, png_sweep, png_cubic], "markdown": md_path, "headline": headline}
