"""Synchronous minibatch SGD vs asynchronous methods as worker heterogeneity grows.

The §8.1 quadratic (d = 256, σ = 0.01) with 16 workers under the uniform, sqrt and linear
delay models plus "straggler" (uniform, with the last worker 50× slower), per-job noise 5 % of
τ_i (``noise="frac"``) so that "uniform" really means equal workers. Methods: synchronous SGD
(:class:`experiments.sync_sgd.SyncSGD`, waits for every worker each step) against Ringmaster
ASGD, Rennala SGD, Ordered Momentum and vanilla ASGD. Metric: simulated time until
f(x) − f* ≤ target; each method is tuned over the grid below (lowest time to target, then lowest
final loss). Claim (Ringmaster / Rennala papers): asynchronous methods with the right delay
handling keep their speed as heterogeneity grows, while synchronous SGD is paced by the slowest
worker.
"""

from __future__ import annotations

import os

from experiments import common
from experiments.sync_sgd import SyncSGD
from problems import load_problem
from ps.core.config import CoreConfig
from ps.drivers.sim import DelayModel

METRIC = "loss"
METHODS = ("sync-sgd", "ringmaster", "rennala", "ordered-momentum", "asgd")
LABELS = {"sync-sgd": "sync SGD", "ringmaster": "Ringmaster", "rennala": "Rennala SGD",
          "ordered-momentum": "Ordered Momentum", "asgd": "ASGD"}
SCENARIOS = (("uniform", "uniform", None), ("sqrt", "sqrt", None), ("linear", "linear", None),
             ("straggler 50x", "uniform", 50.0))


def config(quick: bool) -> dict:
    n = 16
    if quick:
        return {"d": 64, "n": n, "horizon": 400.0, "target": 0.01, "points": 200, "grids": {
            "sync-sgd": common.grid(lr=(1.0, 1.8)),
            "ringmaster": common.grid(lr=(0.3, 1.0), R=(1, 4)),
            "rennala": common.grid(lr=(1.0, 1.8), B=(4, 16)),
            "ordered-momentum": common.grid(lr=(0.3, 1.0), beta=(0.3,)),
            "asgd": common.grid(lr=(0.03, 0.1)),
        }}
    return {"d": 256, "n": n, "horizon": 2000.0, "target": 0.01, "points": 400, "grids": {
        "sync-sgd": common.grid(lr=(0.5, 1.0, 1.8)),
        "ringmaster": common.grid(lr=(0.1, 0.3, 1.0), R=(1, 4, 16)),
        "rennala": common.grid(lr=(0.5, 1.0, 1.8), B=(4, 8, 16)),
        "ordered-momentum": common.grid(lr=(0.1, 0.3, 1.0, 3.0, 10.0), beta=(0.1, 0.3)),
        "asgd": common.grid(lr=(0.03, 0.1, 0.3, 1.0)),
    }}


def make_runs(c: dict, seed: int) -> list[common.Run]:
    runs = []
    n = c["n"]
    for group, model, straggler in SCENARIOS:
        for method in METHODS:
            for params in c["grids"][method]:
                def make(method=method, params=params, model=model, straggler=straggler):
                    problem = load_problem("quadratic", {"d": c["d"]})
                    if method == "sync-sgd":
                        alg = SyncSGD(n_workers=n, **params)
                    else:
                        alg = common.build(method, params)
                    cfg = CoreConfig(min_workers=n, liveness_timeout_s=1e9, seed=seed)
                    delays = DelayModel.named(model, n, noise="frac", straggler=straggler)
                    return alg, problem, delays, cfg, {"seed": seed + 1}

                runs.append(common.Run(group, method, params, make, c["horizon"]))
    return runs


def run(out_dir: str, quick: bool = False, seed: int = 0, progress: bool = True) -> dict:
    c = config(quick)
    os.makedirs(out_dir, exist_ok=True)
    runs = common.execute(make_runs(c, seed), metric=METRIC, eval_interval=c["horizon"] / c["points"],
                          progress=progress, desc="async-vs-sync")

    def key(r: common.Run) -> tuple:
        return (common.time_to_target(r, METRIC, c["target"]), common.final_value(r, METRIC))

    best = common.best_per_method(runs, key=key)
    csv_path = common.write_curves_csv(os.path.join(out_dir, "curves.csv"), runs, best,
                                       ["t", "version", "loss", "grad_norm_sq", "applied", "dropped"])
    groups = [g for g, _, _ in SCENARIOS]
    panels = [(g, [(f"{LABELS[m]} ({best[(g, m)].label})", *common.curve(best[(g, m)], METRIC)) for m in METHODS])
              for g in groups]
    png = common.plot_panels(os.path.join(out_dir, "loss.png"), panels, xlabel="simulated time (s)",
                             ylabel="f(x) − f*", ncols=2, hline=c["target"],
                             suptitle=f"sync vs async SGD, quadratic d={c['d']}, n={c['n']} workers")
    rows, settings_rows, headline = [], [], {}
    for g in groups:
        cells, srow = [g], [g]
        for m in METHODS:
            r = best[(g, m)]
            ttt = common.time_to_target(r, METRIC, c["target"])
            cells.append(common.fmt_num(ttt))
            srow.append(r.label)
            headline.setdefault(g, {})[m] = ttt
        rows.append(cells)
        settings_rows.append(srow)
    header = ["delay model", *(LABELS[m] for m in METHODS)]
    md = (f"# async-vs-sync (seed {seed}{', quick' if quick else ''})\n\n"
          f"Simulated time (s) until f(x) − f* ≤ {c['target']:g} (start {runs[0].points[0]['loss']:.3g}); "
          f"quadratic d = {c['d']}, n = {c['n']} workers, per-job noise 5 % of τ_i, horizon {c['horizon']:g} s; "
          "best setting per method (lowest time to target, then lowest final loss).\n\n"
          + common.markdown_table(header, rows)
          + "\nBest settings:\n\n" + common.markdown_table(header, settings_rows))
    md_path = common.write_text(os.path.join(out_dir, "summary.md"), md)
    return {"csv": [csv_path], "png": [png], "markdown": md_path, "headline": headline}
