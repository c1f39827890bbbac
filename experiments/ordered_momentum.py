"""Ordered Momentum (A6) and Ordered μ²-SGD (A7) under data-dependent delays (docs/ALGORITHMS.md §4).

Setup ("Reference experiments (data-dependent delays)", our choices [I]): the ``digits`` MLP
(64–32–10 ReLU) with ``homogeneous=True``: every job draws a minibatch of 32 from one class,
picked with its train frequency (unbiased), and a class-9 batch takes κ = 10 times longer
(``sample_cost``; ``DelayModel(data_dependent=True)``, the default). M = 8 workers with equal
base speed (``DelayModel.named("uniform", 8, noise="frac")``: τ = 1 s, a class-9 job 10 s, plus
half-normal noise 5 % of τ). With these numbers about half the workers are busy with a class-9
batch at any time, and a class-9 gradient arrives some 40 versions old (a fast one about 7).

Methods: Ordered Momentum (``ordered-momentum``), Ordered μ²-SGD with constant weights
(``ordered-mu2``, γ_x = 0.1) and with its theory weights (``weights=theory``: β_t = 1/t, α_t = t;
its lr scaled to the horizon), both on GRAD_PAIR jobs that cost two gradients, against vanilla
ASGD (``asgd``), naive momentum (``naive-momentum``), delay-adaptive SGD (``delay-adaptive``,
``n_workers`` = M) and delay-filtered SGD (``delay-filtered``); plus, labelled everywhere as
such, an opt-in extension of ours that is **not the paper's method**: Ordered Momentum with
catch-up (``catch_up=True``: a reply of age δ also applies on arrival the share
η(1 − (1−β)^δ) g it missed in flight). Each method is tuned over the grid of :func:`config`
(lr × β for the momentum methods, β down to 0.001 for the ordered ones, × τ_max for
delay-filtered); the setting with the highest final test macro-F1 is reported.

Metrics against simulated time: test macro-F1 (``f1``) and class-9 recall (``recall_slow``).
Per class, over the replies each reported run applied: their mean age δ, the mean of
(1−β)^δ (the share of its weight an Ordered-Momentum reply keeps; ρ = s/t for the theory
weights) and the share the method gives it in total (1 for ASGD, naive momentum and catch-up,
min(1, M/δ) for delay-adaptive). Also: (a) the lr sweep, the final F1 at each lr (best β / τ_max
there) per method; (b) the non-Lipschitz variant (``cubic=True``, logits z ↦ z³), each method
with its best β / τ_max from the standard run over the cubic lr grid; (c) in the default run,
the best setting of each method re-run with other seeds; (d) what catch-up costs where nothing
is slow because of its data: the §8.1 quadratic with M workers of √i speeds, Ordered Momentum
with and without catch-up over lr × β.

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
from ps.core.config import CoreConfig
from ps.drivers.sim import DelayModel

GUARD = "loss"  # divergence check on the test loss (common.simulate_run)
METHODS = ("ordered-momentum", "ordered-momentum-catch-up", "ordered-mu2", "ordered-mu2-theory", "asgd",
           "naive-momentum", "delay-adaptive", "delay-filtered")
LABELS = {"ordered-momentum": "Ordered Momentum",
          "ordered-momentum-catch-up": "Ordered Momentum + catch-up (ours, not the paper's)",
          "ordered-mu2": "Ordered μ²-SGD", "ordered-mu2-theory": "Ordered μ²-SGD, theory weights",
          "asgd": "ASGD", "naive-momentum": "naive momentum", "delay-adaptive": "delay-adaptive",
          "delay-filtered": "delay-filtered"}
#: method label -> (registry name, fixed hyper-parameters)
ALGORITHM = {"ordered-momentum-catch-up": ("ordered-momentum", {"catch_up": True}),
             "ordered-mu2-theory": ("ordered-mu2", {"weights": "theory"})}
COLUMNS = ["t", "version", "f1", "recall_slow", "accuracy", "loss", "train_loss", "applied", "dropped"]
GROUPS = ("standard", "cubic")
SLOW = 9
QUAD_METHODS = ("ordered-momentum", "ordered-momentum-catch-up")


def config(quick: bool) -> dict:
    m = 8
    if quick:
        lrs, betas = (0.03, 0.1), (0.003, 0.1)
        return {"M": m, "batch": 32, "kappa": 10.0, "horizon": 150.0, "points": 30, "cubic_lr": (0.03,),
                "theory_lr": (1e-4,), "cubic_theory_lr": (1e-4,), "seeds": (), "tail": 0.1,
                "grids": _grids(lrs, betas, betas, (1e-4,), (4 * m,)),
                "quad": {"d": 64, "horizon": 60.0, "points": 12, "target": 0.1,
                         "grid": common.grid(lr=(0.3, 1.0), beta=(0.1,))}}
    lrs, betas = (0.01, 0.03, 0.1, 0.3, 1.0), (0.001, 0.003, 0.01, 0.1, 0.3)
    theory = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
    return {"M": m, "batch": 32, "kappa": 10.0, "horizon": 600.0, "points": 60,
            "cubic_lr": (0.01, 0.02, 0.03, 0.05, 0.1), "theory_lr": theory, "cubic_theory_lr": theory,
            "seeds": (1, 2, 3), "tail": 0.1, "grids": _grids(lrs, betas, (0.01, 0.1, 0.3), theory, (m, 4 * m)),
            "quad": {"d": 256, "horizon": 300.0, "points": 30, "target": 0.01,
                     "grid": common.grid(lr=(0.1, 0.3, 1.0, 3.0), beta=(0.01, 0.1, 0.3))}}


def _grids(lrs: tuple, betas: tuple, naive_betas: tuple, theory_lrs: tuple, taus: tuple) -> dict[str, list[dict]]:
    return {
        "ordered-momentum": common.grid(lr=lrs, beta=betas),
        "ordered-momentum-catch-up": common.grid(lr=lrs, beta=betas),
        "ordered-mu2": common.grid(lr=lrs, beta=betas),
        "ordered-mu2-theory": common.grid(lr=theory_lrs),
        "asgd": common.grid(lr=lrs),
        "naive-momentum": common.grid(lr=lrs, beta=naive_betas),
        "delay-adaptive": common.grid(lr=lrs),
        "delay-filtered": common.grid(lr=lrs, tau_max=taus),
    }


def _algorithm(method: str, c: dict) -> tuple[str, dict]:
    """Registry name and fixed extras of a method label."""
    name, extra = ALGORITHM.get(method, (method, {}))
    if method == "delay-adaptive":
        extra = {"n_workers": c["M"]}
    return name, extra


def _sim_run(c: dict, problem, group: str, method: str, params: dict, seed: int,
             delays: DelayModel | None = None, horizon: float | None = None, batch: int | None = None) -> common.Run:
    name, extra = _algorithm(method, c)

    def make():
        alg = common.build(name, params, extra)
        cfg = CoreConfig(min_workers=c["M"], liveness_timeout_s=1e9, seed=seed, batch_size=batch or c["batch"])
        dm = delays or DelayModel.named("uniform", c["M"], noise="frac")  # data_dependent=True (default)
        return alg, problem, dm, cfg, {"seed": seed + 1}

    return common.Run(group, method, params, make, horizon or c["horizon"])


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


# --------------------------------------------------------------------------- per-class weights

def _decay(method: str, params: dict, created_at: int, age: int) -> float | None:
    """The share of its weight the ordered rule keeps for a reply: (1−β)^δ (Ordered Momentum, its
    catch-up variant's momentum term, Ordered μ²-SGD with constant weights), ρ = s/t (theory
    weights: s = created_at + 1, t = s + δ); None for the other methods."""
    if method in ("ordered-momentum", "ordered-momentum-catch-up", "ordered-mu2"):
        return (1.0 - params["beta"]) ** age
    if method == "ordered-mu2-theory":
        s = created_at + 1
        return s / (s + age)
    return None


def _kept(method: str, params: dict, created_at: int, age: int, m: int) -> float:
    """The share of an on-time reply's total weight that the method gives this reply."""
    d = _decay(method, params, created_at, age)
    if d is not None and method != "ordered-momentum-catch-up":
        return d
    if method == "delay-adaptive":
        return min(1.0, m / max(age, 1))
    return 1.0  # ASGD, naive momentum, delay-filtered (what it applies), catch-up (by construction)


def class_weights(r: common.Run, problem, c: dict, classes: dict[int, int]) -> dict[int, dict[str, float]]:
    """Per class: applied replies, mean age, mean decay ((1−β)^δ or ρ; nan if none), mean kept share.
    ``classes`` caches the class of each job seed."""
    acc: dict[int, list[list[float]]] = {}
    for seed, created_at, age in r.applied:
        cls = classes.get(seed)
        if cls is None:
            cls = classes[seed] = int(problem.batch_indices(seed, c["batch"])[0])
        d = _decay(r.method, r.params, created_at, age)
        acc.setdefault(cls, []).append([age, math.nan if d is None else d,
                                        _kept(r.method, r.params, created_at, age, c["M"])])
    out = {}
    for cls, rows in sorted(acc.items()):
        a = np.array(rows)
        out[cls] = {"applied": float(len(rows)), "age": float(a[:, 0].mean()), "decay": float(a[:, 1].mean()),
                    "kept": float(a[:, 2].mean())}
    return out


def _fast_slow(w: dict[int, dict[str, float]], key: str) -> tuple[float, float]:
    """(mean of ``key`` over the replies of the fast classes, the same for the slow class)."""
    n = sum(v["applied"] for k, v in w.items() if k != SLOW)
    fast = sum(v[key] * v["applied"] for k, v in w.items() if k != SLOW) / n if n else math.nan
    return fast, w.get(SLOW, {}).get(key, math.nan)


def _f(v: float, digits: int = 3) -> str:
    return "—" if not math.isfinite(v) else (f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.{digits}g}")


# --------------------------------------------------------------------------- plots

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
                        linewidth=1.3, label=LABELS[m], linestyle="--" if m.endswith("catch-up") else "-")
            ax.set_xscale("log")
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(f"{g}: {ylabel}", fontsize=9)
            ax.set_xlabel("learning rate (best β / τ_max at each lr)", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.25)
            ax.legend(fontsize=5.5)
    fig.suptitle("learning-rate sweep, digits MLP, M = 8, class 9 κ = 10× slower", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=common.DPI)
    plt.close(fig)
    common._shrink_png(path)
    return path


def _plot_beta(path: str, rows: list[tuple[str, float, float, float, float]], title: str) -> str:
    """Per method, against β: final class-9 recall and the class-9 mean of (1−β)^δ (best lr per β)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.4), squeeze=False)
    for m in dict.fromkeys(r[0] for r in rows):
        pts = sorted((b, rec, dec) for mm, b, rec, dec, _ in rows if mm == m)
        style = "--" if m.endswith("catch-up") else "-"
        axes[0][0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, linestyle=style,
                        label=LABELS[m])
        axes[0][1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", markersize=3, linestyle=style,
                        label=LABELS[m])
    for ax, ylabel in zip(axes[0], ("final class-9 recall", "class 9: mean (1−β)^δ of applied replies"),
                          strict=True):
        ax.set_xscale("log")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("β (best lr for each)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=common.DPI)
    plt.close(fig)
    common._shrink_png(path)
    return path


# --------------------------------------------------------------------------- run

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
    opts = {"homogeneous": True, "slow_class": SLOW, "kappa": c["kappa"]}
    problems = {"standard": load_problem("digits", opts), "cubic": load_problem("digits", {**opts, "cubic": True})}
    ei = c["horizon"] / c["points"]

    main = [_sim_run(c, problems["standard"], "standard", m, p, seed) for m in METHODS for p in c["grids"][m]]
    common.execute(main, metric=GUARD, eval_interval=ei, progress=progress, desc="ordered-momentum",
                   record_applied=True)
    best_std = common.best_per_method(main, key=_key)

    # (b) cubic: each method's best non-lr setting from the standard run, over the cubic lr grid
    cubic = []
    for m in METHODS:
        fixed = {k: v for k, v in best_std[("standard", m)].params.items() if k != "lr"}
        lrs = c["cubic_theory_lr"] if m == "ordered-mu2-theory" else c["cubic_lr"]
        cubic += [_sim_run(c, problems["cubic"], "cubic", m, {"lr": lr, **fixed}, seed) for lr in lrs]
    common.execute(cubic, metric=GUARD, eval_interval=ei, progress=progress, desc="ordered-momentum cubic",
                   record_applied=True)
    runs = main + cubic
    best = common.best_per_method(runs, key=_key)

    # (c) robustness to the seed: the best setting of each method with other seeds
    reseeded = [_sim_run(c, problems[g], g, m, best[(g, m)].params, seed + 100 * s)
                for s in c["seeds"] for g in GROUPS for m in METHODS]
    common.execute(reseeded, metric=GUARD, eval_interval=ei, progress=progress, desc="ordered-momentum seeds")

    # (d) what catch-up costs on the quadratic (no data-dependent delays)
    q = c["quad"]
    quad_problem = load_problem("quadratic", {"d": q["d"]})
    quad_delays = DelayModel.named("sqrt", c["M"])
    quad = [_sim_run(c, quad_problem, "quadratic", m, p, seed, delays=quad_delays, horizon=q["horizon"], batch=1)
            for m in QUAD_METHODS for p in q["grid"]]
    common.execute(quad, metric="loss", eval_interval=q["horizon"] / q["points"], progress=progress,
                   desc="ordered-momentum quadratic")

    csv_curves = common.write_curves_csv(os.path.join(out_dir, "curves.csv"), runs, best, COLUMNS)
    sweep = _sweep(runs)
    csv_sweep = common.write_rows_csv(
        os.path.join(out_dir, "lr_sweep.csv"), ["group", "method", "lr", "setting", "f1", "recall_slow", "diverged"],
        [[g, m, lr, r.label, final_f1(r), final_f1(r, "recall_slow"), int(r.diverged)]
         for g in GROUPS for m in METHODS for lr, r in sweep[(g, m)]])
    csvs = [csv_curves, csv_sweep]

    # per-class weights of the reported runs: each method's best (both groups), each β's best
    classes: dict[int, int] = {}
    weights: dict[int, dict[int, dict[str, float]]] = {}

    def w_of(r: common.Run) -> dict[int, dict[str, float]]:
        if id(r) not in weights:
            weights[id(r)] = class_weights(r, problems[r.group], c, classes)
        return weights[id(r)]

    by_beta: dict[tuple[str, float], common.Run] = {}
    for r in main:
        if "beta" in r.params:
            k = (r.method, float(r.params["beta"]))
            if k not in by_beta or _key(r) < _key(by_beta[k]):
                by_beta[k] = r
    reported = {id(r): r for r in [best[(g, m)] for g in GROUPS for m in METHODS] + list(by_beta.values())}
    rows = []
    for r in reported.values():
        for cls, v in w_of(r).items():
            rows.append([r.group, r.method, r.label, cls, int(v["applied"]), v["age"], v["decay"], v["kept"]])
    csvs.append(common.write_rows_csv(os.path.join(out_dir, "class_weights.csv"),
                                      ["group", "method", "setting", "class", "applied", "mean_age", "mean_decay",
                                       "mean_kept"], rows))
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
    quad_best = common.best_per_method(quad, key=lambda r: (common.final_value(r, "loss"),))
    csvs.append(common.write_rows_csv(
        os.path.join(out_dir, "quadratic.csv"), ["method", "lr", "beta", "final_loss", "time_to_target", "diverged"],
        [[r.method, r.params["lr"], r.params["beta"], common.final_value(r, "loss"),
          common.time_to_target(r, "loss", q["target"]), int(r.diverged)] for r in quad]))

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
    beta_rows = [(m, b, final_f1(r, "recall_slow"), _fast_slow(w_of(r), "decay")[1], final_f1(r))
                 for (m, b), r in sorted(by_beta.items()) if m != "naive-momentum"]
    png_beta = _plot_beta(os.path.join(out_dir, "beta.png"), beta_rows,
                          f"slow class against β, {short} (catch-up: ours, not the paper's)")
    png_quad = common.plot_panels(
        os.path.join(out_dir, "quadratic.png"),
        [(f"quadratic d = {q['d']}, M = {c['M']}, τ_i = √i",
          [(f"{LABELS[m]} ({quad_best[('quadratic', m)].label})", *common.curve(quad_best[("quadratic", m)], "loss"))
           for m in QUAD_METHODS])],
        xlabel="simulated time (s)", ylabel="f(x) − f*", suptitle="what catch-up costs on the quadratic", ncols=1)

    headline: dict[str, dict[str, float]] = {}
    tables = []
    for g in GROUPS:
        rows = []
        for m in METHODS:
            r = best[(g, m)]
            pts = sweep[(g, m)]
            f1_best = final_f1(r)
            robust = sum(final_f1(x) >= f1_best - 0.05 for _, x in pts)
            fast_kept, slow_kept = _fast_slow(w_of(r), "kept")
            cells = [LABELS[m], r.label, f"{f1_best:.3f}", f"{final_f1(r, 'recall_slow'):.3f}",
                     f"{tail_mean(r, c['tail']):.3f}", f"{tail_mean(r, c['tail'], 'recall_slow'):.3f}",
                     f"{robust}/{len(pts)}", str(r.counters.get("updates", 0)), _f(slow_kept), _f(fast_kept)]
            if seed_f1:
                v = seed_f1[(g, m)]
                cells.append(f"{np.mean(v):.3f} ± {np.std(v):.3f}")
            rows.append(cells)
            headline.setdefault(f"{g} f1", {})[m] = f1_best
            headline.setdefault(f"{g} recall_slow", {})[m] = final_f1(r, "recall_slow")
        header = ["method", "best setting", "final F1", "final class-9 recall",
                  f"F1, last {c['tail']:.0%}", f"recall, last {c['tail']:.0%}", "lrs within 0.05 of best F1",
                  "updates", "class 9: mean weight share", "other classes: mean weight share"]
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
            w = w_of(r) if knob == "beta" else {}
            fast_dec, slow_dec = _fast_slow(w, "decay") if w else (math.nan, math.nan)
            slow_age = w.get(SLOW, {}).get("age", math.nan) if w else math.nan
            knob_rows.append([LABELS[m], f"{knob}={v:g}", f"lr={r.params['lr']:g}", f"{final_f1(r):.3f}",
                              f"{final_f1(r, 'recall_slow'):.3f}", f"{tail_mean(r, c['tail'], 'recall_slow'):.3f}",
                              _f(slow_age), _f(slow_dec), _f(fast_dec),
                              _f(float(v) * slow_age) if knob == "beta" else "—"])
    tables.append("### standard, by β / τ_max (best lr for each)\n\n"
                  "Mean age and mean (1−β)^δ over the replies the run applied, class 9 and the other classes "
                  "(Ordered μ²-SGD with constant weights: the same (1−β)^δ; the catch-up variant: that of its "
                  "momentum term, the missed share is applied on arrival; naive momentum applies every reply in "
                  "full).\n\n" + common.markdown_table(
                      ["method", "setting", "best lr", "final F1", "final class-9 recall",
                       f"recall, last {c['tail']:.0%}", "class-9 mean age", "class 9: mean (1−β)^δ",
                       "others: mean (1−β)^δ", "β × class-9 age"], knob_rows))
    qrows = []
    for m in QUAD_METHODS:
        r = quad_best[("quadratic", m)]
        stable = sorted({float(x.params["lr"]) for x in quad if x.method == m and not x.diverged and x.points
                         and x.points[-1]["loss"] < x.points[0]["loss"]})
        qrows.append([LABELS[m], r.label, common.fmt_num(common.final_value(r, "loss")),
                      common.fmt_num(common.time_to_target(r, "loss", q["target"])),
                      ", ".join(f"{x:g}" for x in stable) or "none"])
    tables.append(f"### quadratic (what catch-up costs): d = {q['d']}, M = {c['M']} workers τ_i = √i, horizon "
                  f"{q['horizon']:g} s\n\n" + common.markdown_table(
                      ["method", "best setting", "final f − f*", f"time to f − f* ≤ {q['target']:g}",
                       "lrs with a run that ends below f(x0) − f*"], qrows))
    start = main[0].points[0]
    md = (f"# ordered-momentum (seed {seed}{', quick' if quick else ''})\n\n"
          f"{title}; simulated horizon {c['horizon']:g} s, evaluated every {ei:g} s (start: F1 "
          f"{start['f1']:.3f}, loss {start['loss']:.3g}). Best setting per method = highest final test macro-F1; "
          "the 'lrs within 0.05' column counts the lr grid points (best β / τ_max at each) whose final F1 is within "
          "0.05 of the method's best. Weight share: the mean, over the replies of that class the run applied, of "
          "the share of an on-time reply's total weight the method gives a reply ((1−β)^δ for Ordered Momentum "
          "and Ordered μ²-SGD with constant weights, ρ = s/t with theory weights, min(1, M/δ) for delay-adaptive, "
          "1 otherwise). 'Ordered Momentum + catch-up' is an extension of ours, not the paper's method. Cubic: "
          "each method's best β / τ_max from the standard run, lr over "
          f"{', '.join(f'{x:g}' for x in c['cubic_lr'])} (theory weights: "
          f"{', '.join(f'{x:g}' for x in c['cubic_theory_lr'])}).\n\n" + "\n".join(tables))
    md_path = common.write_text(os.path.join(out_dir, "summary.md"), md)
    assert all(math.isfinite(v) for d in headline.values() for v in d.values())
    return {"csv": csvs, "png": [png_f1, png_rec, png_sweep, png_cubic, png_beta, png_quad], "markdown": md_path,
            "headline": headline}
