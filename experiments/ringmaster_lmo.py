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
"""

from __future__ import annotations

import itertools
import math
import os

from experiments import common
from problems import load_problem
from ps.core import CoreConfig
from ps.sim import DelayModel

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


def _algorithm(method: str) -> tuple[str, dict]:
    """Registry name and fixed extras of a method label."""
    if method.startswith("ringmaster-"):
        lmo = method.split("-")[1]
        extra = {"lmo": lmo, "schedule": "agnostic" if method.endswith("-pa") else "fixed"}
        if lmo != "muon":  # no code for these: the paper's algorithm box, a step on the momentum
            extra["nesterov"] = False
        return "ringmaster-lmo", extra
    if method == "delay-adaptive-muon":
        return method, {"n_workers": N_WORKERS}
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


def run(out_dir: str, quick: bool = False, seed: int = 0, progress: bool = True) -> dict:
    import torch

    c = config(quick)
    os.makedirs(out_dir, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = common.execute(make_runs(c, seed), metric=METRIC, progress=progress, desc="ringmaster-lmo",
                              eval_interval=lambda r: c[r.group.split(",")[0]]["horizon"]
                              / c[r.group.split(",")[0]]["points"])
    finally:
        torch.set_num_threads(threads)
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
    md_path = common.write_text(os.path.join(out_dir, "summary.md"), md)
    return {"csv": [csv_path], "png": pngs, "markdown": md_path, "headline": headline}
