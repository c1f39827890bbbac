"""Ringmaster LMO (A10) vs Rennala Muon and Delay-adaptive Muon (docs/ALGORITHMS.md §6).

Reference claim (Sadiev, Maranjyan, Ilin, Richtárik, NanoChat experiment): Ringmaster Muon is
on par with the baselines when the workers are near-homogeneous, its advantage grows with
heterogeneity, and under the linear profile Ringmaster Muon has the lowest loss.

Two problems, n = 8 workers, delays ``DelayModel.named(model, 8, noise="frac")`` (τ_i = 1, √i or
i plus half-normal noise of scale 0.05·τ_i per job, the NanoChat setting) for model in uniform,
sqrt, linear; metric: ``loss`` against simulated time, each method tuned over the grids in
:func:`config` (best setting = lowest final loss).

(a) the §8.1 quadratic (d = 1729 by default, σ = 0.01 scalar noise, x0 = (√d, 0, …, 0)); its
    one vector block is flagged for Muon (``lmo_mask = (True,)``), so the Muon methods
    orthogonalise it as a 1×d matrix (≈ 0.859·u/‖u‖), as the group's quadratic script; Ringmaster
    also runs the ℓ∞ (``sign``) and ℓ2 LMOs. ``loss`` is f(x) − f*.
(b) ``charlm``: a 2-layer character transformer on the sources of Python's ``json`` package;
    Muon on the hidden matrices, the embeddings and the head take the momentum fallback
    (NanoChat's rule, the problem's ``lmo_mask``); batch 8 windows per gradient; ``loss`` is the
    validation cross-entropy in nats per character.

Ringmaster variants: fixed schedule (lr × R grid, α = 0.05, i.e. β = 0.95) and the
parameter-agnostic schedule (η grid only). The Muon variants step on the Nesterov blend, as the
public code; the sign and ℓ2 variants, which exist only in the paper, on the momentum itself, as
its algorithm box (``nesterov=False``). torch runs single-threaded during the experiment.

The authors' recipes (:func:`recipes`): besides the tuned grids, each problem is run once per
method with the official code's own hyper-parameters, nothing tuned (issue 15 item 7):

(c) ``charlm recipe``: the NanoChat script's settings (n = 8, τ_i ∝ i or √i with half-normal
    noise 0.05·τ_i, horizon 500 s, depth 6, 3 heads, β = 0.95, Polar Express NS5, Nesterov;
    Ringmaster Muon γ = 1, R = 2; parameter-agnostic η = 5; Rennala Muon γ = 1, B = 2;
    delay-adaptive Muon γ = 1), scaled to a 2-core CPU: width 48 (theirs 192; Newton–Schulz on
    the 192-wide matrices costs 1.8 s per update here), 97 characters of the ``email``
    package's sources (364 KB) for NanoChat's 8192-token BPE vocabulary and climbmix shards,
    windows of 32 characters for sequences of 2048 tokens, 4 windows per gradient (their device
    batch), time unit one fastest-worker gradient (theirs: the measured gradient time), linear
    delays only (the profile of their quoted plot). Metric: ``train_loss``, the cross-entropy on 64 fixed
    training windows (theirs: the latest minibatch loss), ``loss`` (validation) alongside.
(d) ``quadratic recipe``: the group's quadratic script (d = 1729, n = 6174 workers, σ = 0.01
    scalar noise, τ_i = 1 + √i for i = 0..n−1 plus half-normal noise of scale √(i+1), i.e.
    ``DelayModel.named("sqrt1", n, noise="sqrt")``, horizon 2000; Ringmaster Muon γ = 0.04,
    R = 6; parameter-agnostic η = 0.5; Rennala Muon γ = 0.04, B = 6; delay-adaptive γ = 0.005),
    not scaled. Metric f − f*.
"""

from __future__ import annotations

import itertools
import math
import os

from experiments import common
from problems import load_problem
from ps.core.config import CoreConfig
from ps.drivers.sim import DelayModel

METRIC = "loss"
N_WORKERS = 8
MODELS = ("uniform", "sqrt", "linear")
BASELINES = ("rennala-muon", "delay-adaptive-muon")
COLUMNS = ["t", "version", "loss", "train_loss", "grad_norm_sq", "applied", "dropped"]


def config(quick: bool) -> dict:
    """Problems, horizons and the grids (per problem and method)."""
    if quick:
        quad = {"opts": {"d": 256}, "batch": 1, "horizon": 100.0, "points": 25, "grids": {
            "ringmaster-sign": common.grid(lr=(0.003, 0.03), R=(2, 8)),
            "ringmaster-l2": common.grid(lr=(0.1, 1.0), R=(2, 8)),
            "ringmaster-sign-pa": common.grid(lr=(0.1,)),
            "ringmaster-l2-pa": common.grid(lr=(1.0,)),
            "ringmaster-muon": common.grid(lr=(0.1, 1.0), R=(2, 8)),
            "ringmaster-muon-pa": common.grid(lr=(1.0,)),
            "rennala-muon": common.grid(lr=(0.5,), B=(1, 4)),
            "delay-adaptive-muon": common.grid(lr=(0.5,)),
        }}
        lm = {"opts": {"d_model": 16, "context": 16, "eval_windows": 16}, "batch": 4, "horizon": 8.0, "points": 4,
              "grids": {
                  "ringmaster-muon": common.grid(lr=(0.03,), R=(2, 8)),
                  "ringmaster-sign": common.grid(lr=(0.003,), R=(2,)),
                  "ringmaster-muon-pa": common.grid(lr=(1.0,)),
                  "ringmaster-sign-pa": common.grid(lr=(0.1,)),
                  "rennala-muon": common.grid(lr=(0.03,), B=(1, 4)),
                  "delay-adaptive-muon": common.grid(lr=(0.03,)),
              }}
        return {"quadratic": quad, "charlm": lm}
    quad = {"opts": {"d": 1729}, "batch": 1, "horizon": 400.0, "points": 80, "grids": {
        "ringmaster-sign": common.grid(lr=(0.001, 0.003, 0.01, 0.03, 0.1), R=(1, 2, 4, 8)),
        "ringmaster-l2": common.grid(lr=(0.1, 0.3, 1.0, 3.0), R=(1, 2, 4, 8)),
        "ringmaster-sign-pa": common.grid(lr=(0.02, 0.1, 0.5, 2.5, 12.5)),
        "ringmaster-l2-pa": common.grid(lr=(0.2, 1.0, 5.0, 25.0)),
        "ringmaster-muon": common.grid(lr=(0.1, 0.3, 1.0, 3.0), R=(1, 2, 4, 8)),
        "ringmaster-muon-pa": common.grid(lr=(0.2, 1.0, 5.0, 25.0)),
        "rennala-muon": common.grid(lr=(0.03, 0.1, 0.3, 1.0, 3.0), B=(1, 2, 4, 8)),
        "delay-adaptive-muon": common.grid(lr=(0.03, 0.1, 0.3, 1.0, 3.0)),
    }}
    lm = {"opts": {}, "batch": 8, "horizon": 120.0, "points": 30, "grids": {
        "ringmaster-muon": common.grid(lr=(0.003, 0.01, 0.03, 0.1), R=(1, 2, 4, 8, 16)),
        "ringmaster-sign": common.grid(lr=(0.0003, 0.001, 0.003, 0.01), R=(2, 8)),
        "ringmaster-muon-pa": common.grid(lr=(0.04, 0.2, 1.0, 5.0)),
        "ringmaster-sign-pa": common.grid(lr=(0.004, 0.02, 0.1, 0.5)),
        "rennala-muon": common.grid(lr=(0.01, 0.03, 0.1), B=(1, 2, 4, 8, 16)),
        "delay-adaptive-muon": common.grid(lr=(0.003, 0.01, 0.03, 0.1, 0.3)),
    }}
    return {"quadratic": quad, "charlm": lm}


RECIPE_METHODS = ("ringmaster-muon", "ringmaster-muon-pa", "rennala-muon", "delay-adaptive-muon")
PARTS = ("all", "grids", "recipes")
# the authors' plot for linear delays (NanoChat, latest minibatch loss at 500 s), read off by eye
AUTHORS_NANOCHAT_LINEAR = {"ringmaster-muon": 4.05, "rennala-muon": 4.35, "delay-adaptive-muon": 4.6,
                           "ringmaster-muon-pa": 6.3}


def recipes(quick: bool) -> dict:
    """The authors' own settings per problem (no tuning): problem options, workers, delays,
    horizon and one setting per method (module docstring, (c) and (d))."""
    if quick:
        lm_opts = {"package": "json", "layers": 2, "d_model": 12, "heads": 3, "context": 16, "eval_windows": 16}
        lm = {"problem": "charlm", "opts": lm_opts, "n": 8, "models": ("linear",), "noise": "frac", "batch": 4,
              "horizon": 8.0, "points": 4, "metric": "train_loss"}
        quad = {"problem": "quadratic", "opts": {"d": 64}, "n": 64, "models": ("sqrt1",), "noise": "sqrt",
                "batch": 1, "horizon": 40.0, "points": 8, "metric": "loss"}
    else:
        lm_opts = {"package": "email", "layers": 6, "d_model": 48, "heads": 3, "context": 32, "eval_windows": 64}
        lm = {"problem": "charlm", "opts": lm_opts, "n": 8, "models": ("linear",), "noise": "frac", "batch": 4,
              "horizon": 500.0, "points": 25, "metric": "train_loss"}
        quad = {"problem": "quadratic", "opts": {"d": 1729}, "n": 6174, "models": ("sqrt1",), "noise": "sqrt",
                "batch": 1, "horizon": 2000.0, "points": 40, "metric": "loss"}
    lm["settings"] = {"ringmaster-muon": {"lr": 1.0, "R": 2}, "ringmaster-muon-pa": {"lr": 5.0},
                      "rennala-muon": {"lr": 1.0, "B": 2}, "delay-adaptive-muon": {"lr": 1.0}}
    quad["settings"] = {"ringmaster-muon": {"lr": 0.04, "R": 6}, "ringmaster-muon-pa": {"lr": 0.5},
                        "rennala-muon": {"lr": 0.04, "B": 6}, "delay-adaptive-muon": {"lr": 0.005}}
    return {"charlm recipe": lm, "quadratic recipe": quad}


def make_recipe_runs(c: dict, seed: int) -> list[common.Run]:
    """One run per (recipe, delay model, method) at the authors' setting."""
    runs = []
    for rname, spec in c.items():
        problem = load_problem(spec["problem"], spec["opts"])
        n = spec["n"]
        for model in spec["models"]:
            group = f"{rname}, {model}"
            for method in RECIPE_METHODS:
                alg_name, extra = _algorithm(method, n)

                def make(alg_name=alg_name, extra=extra, params=spec["settings"][method], spec=spec, model=model,
                         problem=problem, n=n):
                    alg = common.build(alg_name, params, extra)
                    cfg = CoreConfig(min_workers=n, liveness_timeout_s=1e9, seed=seed, batch_size=spec["batch"])
                    return (alg, problem, DelayModel.named(model, n, noise=spec["noise"]), cfg, {"seed": seed + 1})

                runs.append(common.Run(group, method, dict(spec["settings"][method]), make, spec["horizon"]))
    return runs


def _algorithm(method: str, n_workers: int = N_WORKERS) -> tuple[str, dict]:
    """Registry name and fixed extras of a method label."""
    if method.startswith("ringmaster-"):
        lmo = method.split("-")[1]
        extra = {"lmo": lmo, "schedule": "agnostic" if method.endswith("-pa") else "fixed"}
        if lmo != "muon":  # no code for these: the paper's algorithm box, a step on the momentum
            extra["nesterov"] = False
        return "ringmaster-lmo", extra
    if method == "delay-adaptive-muon":
        return method, {"n_workers": n_workers}
    return method, {}


def make_runs(c: dict, seed: int) -> list[common.Run]:
    runs = []
    problems = {name: load_problem(name, spec["opts"]) for name, spec in c.items()}
    for (pname, spec), model in itertools.product(c.items(), MODELS):
        group = f"{pname}, {model}"
        for method, settings in spec["grids"].items():
            alg_name, extra = _algorithm(method)
            for params in settings:
                def make(alg_name=alg_name, extra=extra, params=params, pname=pname, spec=spec, model=model):
                    alg = common.build(alg_name, params, extra)
                    cfg = CoreConfig(min_workers=N_WORKERS, liveness_timeout_s=1e9, seed=seed,
                                     batch_size=spec["batch"])
                    return (alg, problems[pname], DelayModel.named(model, N_WORKERS, noise="frac"), cfg,
                            {"seed": seed + 1})

                runs.append(common.Run(group, method, params, make, spec["horizon"]))
    return runs


def _cell(r: common.Run) -> str:
    return "diverged" if r.diverged else common.fmt_num(common.final_value(r, METRIC), 4)


def _run_grids(out_dir: str, quick: bool, seed: int, progress: bool) -> tuple[str, list[str], str, dict]:
    """The tuned grids: CSV path, PNG paths, markdown text and headline numbers."""
    c = config(quick)
    runs = common.execute(make_runs(c, seed), metric=METRIC, progress=progress, desc="ringmaster-lmo",
                          eval_interval=lambda r: c[r.group.split(",")[0]]["horizon"]
                          / c[r.group.split(",")[0]]["points"])
    best = common.best_per_method(runs, key=lambda r: (common.final_value(r, METRIC),))
    csv_path = common.write_curves_csv(os.path.join(out_dir, "curves.csv"), runs, best, COLUMNS)

    pngs, rows, headline = [], [], {}
    for pname, spec in c.items():
        methods = list(spec["grids"])
        groups = [f"{pname}, {m}" for m in MODELS]
        panels = [(g, [(f"{m} ({best[(g, m)].label})", *common.curve(best[(g, m)], METRIC)) for m in methods])
                  for g in groups]
        ylabel = "f(x) − f*" if pname == "quadratic" else "validation loss (nats/char)"
        title = (f"Ringmaster LMO vs Muon baselines, quadratic d={spec['opts']['d']}, n={N_WORKERS}"
                 if pname == "quadratic" else
                 f"Ringmaster LMO vs Muon baselines, char transformer, n={N_WORKERS}, batch {spec['batch']}")
        pngs.append(common.plot_panels(os.path.join(out_dir, f"{pname}.png"), panels, xlabel="simulated time (s)",
                                       ylabel=ylabel, suptitle=title, logy=pname == "quadratic", ncols=3))
        for g in groups:
            finals = {m: common.final_value(best[(g, m)], METRIC) for m in methods}
            ring = min((m for m in methods if m.startswith("ringmaster-")), key=lambda m: finals[m])
            base = min(BASELINES, key=lambda m: finals[m])
            lowest = min(methods, key=lambda m: finals[m])
            ratio = finals[base] / finals[ring] if finals[ring] > 0 else math.inf
            rows.append([g, *(f"{_cell(best[(g, m)])} ({best[(g, m)].label})" for m in methods),
                         ring, base, f"{ratio:.3g}", lowest])
            headline[g] = {**finals, "ratio_baseline_over_ringmaster": ratio}
    md = (f"# ringmaster-lmo (seed {seed}{', quick' if quick else ''})\n\n"
          f"n = {N_WORKERS} workers, delays uniform / sqrt / linear with NanoChat noise (0.05·τ_i); final loss at "
          f"the horizon (quadratic {c['quadratic']['horizon']:g} s: f − f*; char transformer "
          f"{c['charlm']['horizon']:g} s: validation nats/char), best setting per method in brackets. "
          "Ratio: best baseline / best Ringmaster variant (> 1: Ringmaster lower).\n\n")
    for pname, spec in c.items():
        methods = list(spec["grids"])
        md += f"## {pname}\n\n" + common.markdown_table(
            ["setting", *methods, "best Ringmaster", "best baseline", "baseline / Ringmaster", "lowest"],
            [r for r in rows if r[0].startswith(pname + ",")]) + "\n"
    return csv_path, pngs, md, headline


def _recipe_table(finals: dict[str, dict[str, float]], authors: dict[str, float] | None) -> tuple[list, list]:
    """Header and rows of one recipe group: final values, ratio to Ringmaster Muon, rank."""
    order = sorted(RECIPE_METHODS, key=lambda m: finals[m]["metric"])
    ring = finals["ringmaster-muon"]["metric"]
    header = ["method", "setting", "final", "ratio to Ringmaster Muon", "rank"]
    if authors:
        a_order = sorted(authors, key=authors.get)
        header += ["authors (NanoChat, linear)", "authors' ratio", "authors' rank"]
    rows = []
    for m in RECIPE_METHODS:
        f = finals[m]
        row = [m, f["setting"], common.fmt_num(f["metric"], 4), common.fmt_num(f["metric"] / ring, 3)
               if math.isfinite(ring) and ring > 0 else "n/a", order.index(m) + 1]
        if authors:
            row += [f"{authors[m]:g}", f"{authors[m] / authors['ringmaster-muon']:.3g}", a_order.index(m) + 1]
        rows.append(row)
    return header, rows


def _run_recipes(out_dir: str, quick: bool, seed: int, progress: bool) -> tuple[str, list[str], str, dict]:
    """The authors' settings, one run per method: CSV path, PNG paths, markdown text, headline."""
    c = recipes(quick)
    runs = []
    for r in make_recipe_runs(c, seed):  # per recipe: its own metric and evaluation interval
        spec = c[r.group.split(",")[0]]
        runs += common.execute([r], metric=spec["metric"], progress=progress, desc=f"ringmaster-lmo {r.group}",
                               eval_interval=spec["horizon"] / spec["points"])
    return report_recipes(out_dir, c, runs, seed, quick)


def report_recipes(out_dir: str, c: dict, runs: list[common.Run], seed: int,
                   quick: bool) -> tuple[str, list[str], str, dict]:
    """CSV, plots and tables of the recipe runs (``c``: :func:`recipes`)."""
    best = {(r.group, r.method): r for r in runs}
    csv_path = common.write_curves_csv(os.path.join(out_dir, "recipes.csv"), runs, best, COLUMNS)
    pngs, headline = [], {}
    md = (f"# ringmaster-lmo, the authors' recipes (seed {seed}{', quick' if quick else ''})\n\n"
          "One run per method at the official code's setting, nothing tuned. Ratio: final value / Ringmaster "
          "Muon's (> 1: Ringmaster Muon lower).\n\n")
    for rname, spec in c.items():
        metric = spec["metric"]
        groups = [f"{rname}, {m}" for m in spec["models"]]
        panels = []
        for g in groups:
            lines = [(f"{m} ({best[(g, m)].label})", *common.curve(best[(g, m)], metric)) for m in RECIPE_METHODS]
            panels.append((f"{g.split(', ')[1]} delays: {metric}", lines))
            if metric != "loss":  # the char transformer: validation alongside, and a zoom
                panels.append((f"{g.split(', ')[1]} delays: validation loss",
                               [(m, *common.curve(best[(g, m)], "loss")) for m in RECIPE_METHODS]))
                below = [ln for ln in lines if len(ln[2]) and ln[2][-1] < ln[2][0]]
                if len(below) < len(lines):
                    panels.append((f"{g.split(', ')[1]}: {metric}, zoom on runs ending below the start", below))
        opts = spec["opts"]
        if spec["problem"] == "charlm":
            title = (f"Authors' NanoChat recipe, scaled: char transformer depth {opts['layers']}, width "
                     f"{opts['d_model']}, {opts['heads']} heads, '{opts['package']}' sources, n={spec['n']}, "
                     f"batch {spec['batch']}")
            ylabel, logy = "cross-entropy (nats/char)", False
        else:
            title = f"Group's quadratic recipe, d={opts['d']}, n={spec['n']}"
            ylabel, logy = "f(x) − f*", True
        slug = "recipe-charlm" if spec["problem"] == "charlm" else "recipe-quadratic"
        pngs.append(common.plot_panels(os.path.join(out_dir, f"{slug}.png"), panels, xlabel="simulated time (s)",
                                       ylabel=ylabel, suptitle=title, logy=logy, ncols=3))
        md += (f"## {rname} ({metric} at {spec['horizon']:g} s; n = {spec['n']}, options "
               f"{', '.join(f'{k}={v}' for k, v in opts.items())})\n\n")
        for g in groups:
            finals = {m: {"metric": common.final_value(best[(g, m)], metric), "setting": best[(g, m)].label,
                          "loss": common.final_value(best[(g, m)], "loss")} for m in RECIPE_METHODS}
            authors = AUTHORS_NANOCHAT_LINEAR if spec["problem"] == "charlm" and g.endswith("linear") else None
            header, rows = _recipe_table(finals, authors)
            if metric != "loss":
                header.append("validation loss")
                for row, m in zip(rows, RECIPE_METHODS, strict=True):
                    row.append(common.fmt_num(finals[m]["loss"], 4))
            md += f"### {g}\n\n" + common.markdown_table(header, rows) + "\n"
            headline[g] = {m: finals[m]["metric"] for m in RECIPE_METHODS}
            if metric != "loss":
                headline[g].update({f"{m} validation": finals[m]["loss"] for m in RECIPE_METHODS})
    return csv_path, pngs, md, headline


def run(out_dir: str, quick: bool = False, seed: int = 0, progress: bool = True, part: str = "all") -> dict:
    """Run the tuned grids and/or the authors' recipes (``part``: ``all``, ``grids``, ``recipes``).

    Returns ``csv``, ``png``, ``markdown`` (``summary.md``: both parts' tables), ``headline`` (the
    grids' numbers per group) and ``recipes`` (the recipes' numbers per group).
    """
    import torch

    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    os.makedirs(out_dir, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    csvs, pngs, md, headline, recipe_headline = [], [], "", {}, {}
    try:
        if part in ("all", "grids"):
            path, p, text, headline = _run_grids(out_dir, quick, seed, progress)
            csvs.append(path)
            pngs += p
            md += text
        if part in ("all", "recipes"):
            path, p, text, recipe_headline = _run_recipes(out_dir, quick, seed, progress)
            csvs.append(path)
            pngs += p
            md += ("\n" if md else "") + text
    finally:
        torch.set_num_threads(threads)
    md_path = common.write_text(os.path.join(out_dir, "summary.md"), md)
    return {"csv": csvs, "png": pngs, "markdown": md_path, "headline": headline, "recipes": recipe_headline}
