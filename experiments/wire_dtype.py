"""Reduced-precision transfer (``--wire-dtype``, PROTOCOL.md §6.12): f32 vs f16 vs bf16.

The simulator quantizes exactly what the real transport does (``ps/drivers/sim.py``): workers compute
on ``roundtrip(x, wire)`` and the server applies ``roundtrip(g, wire)``; the server's iterate
and the algorithms stay float32. Same problem, same hyper-parameters, same seeds and therefore
the same delays and job schedule for the three wire dtypes: only the bits differ.

Three problems, n = 16 workers, delays ``DelayModel.named("sqrt", 16, noise="frac")``, methods
Ordered Momentum (lr 3, β 0.3 on the quadratics; lr 1 on logreg) and ASGD (lr 0.1), fixed
settings (no tuning), several seeds:

(a) ``quadratic σ=0.01``: the §8.1 quadratic, d = 256, scalar noise σ = 0.01 (the noisy SGD
    regime of the other experiments); metric f(x) − f*.
(b) ``quadratic σ=0``: the same quadratic with exact gradients, d = 16 (small enough to converge
    far within the horizon): the worst case for quantization, which is then the only noise.
(c) ``logreg``: synthetic logistic regression (N = 10,000, p = 20, minibatch 32); metric
    F(w) − F*, with F* from Newton's method in float64.

Per run, "final" is the mean of f − f* over the last 10 % of the horizon; the table gives its
geometric mean over the seeds, the ratio to f32, and the mean simulated time and number of
updates until f − f* ≤ target (when every seed reached it).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from experiments import common
from problems import load_problem
from ps.core.config import CoreConfig
from ps.drivers.sim import DelayModel

WIRES = ("f32", "f16", "bf16")
METHODS = ("ordered-momentum", "asgd")
LABELS = {"ordered-momentum": "Ordered Momentum", "asgd": "ASGD"}
N_WORKERS = 16
COLUMNS = ["t", "version", "loss", "gap", "applied"]


def config(quick: bool) -> dict[str, Any]:
    """Problems (group -> spec), seeds and evaluation resolution."""
    om, asgd = {"lr": 3.0, "beta": 0.3}, {"lr": 0.1}
    # per mode: sizes (quadratic noisy d, exact d, logreg n), horizons and targets (same order)
    (d_noisy, d_exact, n), (h_noisy, h_exact, h_lr), (t_noisy, t_exact, t_lr) = (
        ((64, 8, 2000), (300.0, 400.0, 100.0), (0.03, 1e-7, 0.02)) if quick else
        ((256, 16, 10000), (1000.0, 2000.0, 300.0), (0.01, 1e-6, 0.01)))
    problems = {
        "quadratic σ=0.01": {"name": "quadratic", "opts": {"d": d_noisy}, "batch": 1, "horizon": h_noisy,
                             "target": t_noisy, "settings": {"ordered-momentum": om, "asgd": asgd}},
        "quadratic σ=0": {"name": "quadratic", "opts": {"d": d_exact, "sigma": 0.0}, "batch": 1,
                          "horizon": h_exact, "target": t_exact, "settings": {"ordered-momentum": om, "asgd": asgd}},
        "logreg": {"name": "logreg", "opts": {"n": n}, "batch": 32, "horizon": h_lr, "target": t_lr,
                   "settings": {"ordered-momentum": {"lr": 1.0, "beta": 0.3}, "asgd": asgd}},
    }
    return {"problems": problems, "seeds": 1 if quick else 3, "points": 50 if quick else 200}


def optimum(problem: Any) -> float:
    """f* of a problem: the quadratic's ``loss`` is already f − f* (0); logreg's F* by Newton in float64."""
    if not hasattr(problem, "features"):
        return 0.0
    a, y, reg = problem.features, problem.labels, problem.reg
    w = np.zeros(a.shape[1])
    for _ in range(50):
        s = 1.0 / (1.0 + np.exp(y * (a @ w)))  # σ(−y aᵀw)
        g = a.T @ (-y * s) / len(y) + reg * w
        h = (a.T * (s * (1.0 - s))) @ a / len(y) + reg * np.eye(len(w))
        step = np.linalg.solve(h, g)
        w -= step
        if float(np.abs(step).max()) < 1e-15:
            break
    return float(problem.evaluate(w)["loss"])


def make_runs(c: dict[str, Any], seed: int) -> list[common.Run]:
    runs = []
    for group, spec in c["problems"].items():
        for method in METHODS:
            for k in range(c["seeds"]):
                for wire in WIRES:
                    def make(spec=spec, method=method, wire=wire, s=seed + k):
                        problem = load_problem(spec["name"], spec["opts"])
                        alg = common.build(method, spec["settings"][method])
                        cfg = CoreConfig(min_workers=N_WORKERS, liveness_timeout_s=1e9, seed=s,
                                         batch_size=spec["batch"])
                        delays = DelayModel.named("sqrt", N_WORKERS, noise="frac")
                        return alg, problem, delays, cfg, {"seed": s + 1, "wire_dtype": wire}

                    runs.append(common.Run(group, method, {"wire": wire, "seed": seed + k}, make, spec["horizon"]))
    return runs


def tail_mean(run: common.Run, f_star: float, frac: float = 0.1) -> float:
    """Mean of f − f* over the last ``frac`` of the horizon (inf if the run diverged)."""
    if run.diverged or not run.points:
        return math.inf
    t0 = run.horizon * (1.0 - frac)
    tail = [p["loss"] - f_star for p in run.points if p["t"] >= t0] or [run.points[-1]["loss"] - f_star]
    return float(np.mean(tail))


def first_reach(run: common.Run, f_star: float, target: float) -> tuple[float, float]:
    """(simulated time, updates) of the first evaluation with f − f* ≤ target (inf, inf: never)."""
    for p in run.points:
        if p["loss"] - f_star <= target:
            return float(p["t"]), float(p["version"])
    return math.inf, math.inf


def on_grid(run: common.Run, f_star: float, grid: np.ndarray) -> np.ndarray:
    """f − f* of a run at the grid times (the last evaluation at or before each)."""
    t = np.array([p["t"] for p in run.points])
    y = np.array([p["loss"] - f_star for p in run.points])
    if not t.size:
        return np.full(grid.shape, np.nan)
    return y[np.clip(np.searchsorted(t, grid, side="right") - 1, 0, None)]


def geomean(values: list[float]) -> float:
    v = np.asarray(values, float)
    if not np.all(np.isfinite(v)):
        return math.inf
    return float(np.exp(np.mean(np.log(np.maximum(v, 1e-300)))))


def run(out_dir: str, quick: bool = False, seed: int = 0, progress: bool = True) -> dict:
    c = config(quick)
    os.makedirs(out_dir, exist_ok=True)
    runs = common.execute(make_runs(c, seed), metric="loss",
                          eval_interval=lambda r: r.horizon / c["points"], progress=progress, desc="wire-dtype")
    f_stars = {g: optimum(load_problem(s["name"], s["opts"])) for g, s in c["problems"].items()}

    csv_rows = []
    for r in runs:
        fs = f_stars[r.group]
        for p in r.points:
            csv_rows.append([r.group, r.method, r.params["wire"], r.params["seed"], float(p["t"]), int(p["version"]),
                             float(p["loss"]), float(p["loss"] - fs), int(p["applied"])])
    csv_path = common.write_rows_csv(os.path.join(out_dir, "curves.csv"),
                                     ["group", "method", "wire", "seed", *COLUMNS], csv_rows)

    by: dict[tuple[str, str, str], list[common.Run]] = {}
    for r in runs:
        by.setdefault((r.group, r.method, r.params["wire"]), []).append(r)

    panels, rows, headline = [], [], {}
    for method in METHODS:
        for group, spec in c["problems"].items():
            grid = np.linspace(0.0, spec["horizon"], c["points"] + 1)
            lines = []
            for wire in WIRES:
                curves = np.array([on_grid(r, f_stars[group], grid) for r in by[(group, method, wire)]])
                with np.errstate(all="ignore"):
                    mean = np.exp(np.nanmean(np.log(np.maximum(curves, 1e-300)), axis=0))
                lines.append((wire, grid, mean))
            panels.append((f"{group}, {LABELS[method]}", lines))
    for group, spec in c["problems"].items():
        for method in METHODS:
            finals = {w: geomean([tail_mean(r, f_stars[group]) for r in by[(group, method, w)]]) for w in WIRES}
            headline[f"{group}, {method}"] = finals
            for wire in WIRES:
                reach = [first_reach(r, f_stars[group], spec["target"]) for r in by[(group, method, wire)]]
                hit = [x for x in reach if math.isfinite(x[0])]
                if len(hit) == len(reach):
                    ttt = common.fmt_num(float(np.mean([x[0] for x in hit])))
                    steps = f"{np.mean([x[1] for x in hit]):.0f}"
                else:
                    ttt = steps = f"not reached ({len(reach) - len(hit)}/{len(reach)} seeds)"
                ratio = finals[wire] / finals["f32"] if finals["f32"] > 0 else math.inf
                rows.append([group, LABELS[method], wire, f"{finals[wire]:.3g}", f"{ratio:.4g}", ttt, steps])
    png = common.plot_panels(os.path.join(out_dir, "wire_dtype.png"), panels, xlabel="simulated time (s)",
                             ylabel="f(x) − f*", ncols=len(c["problems"]),
                             suptitle=f"wire dtype f32 / f16 / bf16, n={N_WORKERS} workers, sqrt delays, "
                                      f"geometric mean over {c['seeds']} seed(s)")
    targets = ", ".join(f"{g}: {s['target']:g}" for g, s in c["problems"].items())
    desc = "; ".join(f"{g}: {s['name']} {', '.join(f'{k}={v}' for k, v in s['opts'].items())}, batch {s['batch']}, "
                     f"horizon {s['horizon']:g} s" for g, s in c["problems"].items())
    md = (f"# wire-dtype (seed {seed}, {c['seeds']} seed(s){', quick' if quick else ''})\n\n"
          f"{desc}. n = {N_WORKERS} workers, sqrt delays; Ordered Momentum and ASGD with fixed settings; same "
          "seeds (hence delays) for every wire dtype. final = mean f − f* over the last 10 % of the horizon, "
          f"geometric mean over seeds; ratio = final / final(f32); targets (f − f*): {targets}.\n\n"
          + common.markdown_table(["problem", "method", "wire", "final f − f*", "ratio to f32", "time to target (s)",
                                   "updates to target"], rows))
    md_path = common.write_text(os.path.join(out_dir, "summary.md"), md)
    return {"csv": [csv_path], "png": [png], "markdown": md_path, "headline": headline}
