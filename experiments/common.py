"""Shared pieces of the simulator experiments: running a tuning grid, picking the best
setting per method, and writing the CSV, the PNG plots and the markdown table.

Everything is deterministic for a seed: the simulator is seeded, the CSV is written with
``repr``-exact floats in a fixed row order, and nothing time-dependent (wall clock, host)
goes into the CSV.
"""

from __future__ import annotations

import csv
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

import algorithms
from algorithms.base import Algorithm
from problems.base import Problem
from ps.core.config import CoreConfig
from ps.drivers.sim import DelayModel, Simulator

DPI = 80
DIVERGED = 1e8  # a run stops once its metric exceeds this factor times its start value


def grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    """The Cartesian product of hyper-parameter axes, in a fixed order."""
    keys = list(axes)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(axes[k] for k in keys))]


@dataclass
class Run:
    """One simulation of one hyper-parameter setting of one method in one group (scenario)."""

    group: str
    method: str
    params: dict[str, Any]
    make: Callable[[], tuple[Algorithm, Problem, DelayModel, CoreConfig, dict[str, Any]]]
    horizon: float
    points: list[dict[str, float]] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    diverged: bool = False
    applied: list[tuple[int, int, int]] = field(default_factory=list)  # (seed, created_at, age) if recorded

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={_fmt(v)}" for k, v in self.params.items())


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def build(name: str, params: dict[str, Any], extra: dict[str, Any] | None = None) -> Algorithm:
    """A registered algorithm with the grid parameters plus fixed extras."""
    return algorithms.build(name, {**(extra or {}), **params})


def simulate_run(run: Run, *, metric: str, eval_interval: float, keep_metrics: bool = False,
                 record_applied: bool = False) -> Run:
    """Run one grid point: evaluate every ``eval_interval`` simulated seconds up to the horizon;
    stop early (and mark the run diverged) when ``metric`` turns non-finite or blows up.
    ``record_applied``: keep (job seed, created_at, age) of every applied reply in ``run.applied``."""
    alg, problem, delays, cfg, sim_kw = run.make()
    sim = Simulator(alg, problem, delays, cfg, **sim_kw)
    start: list[float] = []
    if record_applied:
        drain = sim.core.drain_events

        def drain_and_record() -> list[dict[str, Any]]:
            events = drain()
            run.applied.extend((int(e["seed"]), int(e["created_at"]), int(e["age"])) for e in events
                               if e["ev"] == "applied")
            return events

        sim.core.drain_events = drain_and_record  # type: ignore[method-assign]

    def stop(ev: dict[str, float]) -> bool:
        v = ev[metric]
        if not start:
            start.append(v)
        if not math.isfinite(v) or v > DIVERGED * max(start[0], 1e-300):
            run.diverged = True
            return True
        return False

    with np.errstate(all="ignore"):
        trace = sim.run(max_time=run.horizon, eval_interval=eval_interval, stop=stop)
    if not run.diverged and not math.isfinite(trace.points[-1][metric]):
        run.diverged = True
    run.points = [p for p in trace.points if all(math.isfinite(float(v)) for v in p.values())]
    run.metrics = trace.metrics if keep_metrics else []
    run.counters = dict(trace.counters)
    return run


def final_value(run: Run, metric: str) -> float:
    """The metric at the end of the horizon (inf for a diverged run)."""
    if run.diverged or not run.points:
        return math.inf
    return float(run.points[-1][metric])


def time_to_target(run: Run, metric: str, target: float) -> float:
    """First evaluated simulated time at which ``metric <= target`` (inf: not reached)."""
    for p in run.points:
        if p[metric] <= target:
            return float(p["t"])
    return math.inf


def execute(runs: Sequence[Run], *, metric: str, eval_interval: float | Callable[[Run], float],
            progress: bool, desc: str, keep_metrics: bool = False, record_applied: bool = False) -> list[Run]:
    """Run every grid point in order with a tqdm bar (one tick per simulation)."""
    from tqdm import tqdm

    with tqdm(total=len(runs), desc=desc, unit="run", disable=not progress, dynamic_ncols=True) as bar:
        for r in runs:
            bar.set_postfix_str(f"{r.group} | {r.method}", refresh=False)
            ei = eval_interval(r) if callable(eval_interval) else eval_interval
            simulate_run(r, metric=metric, eval_interval=ei, keep_metrics=keep_metrics, record_applied=record_applied)
            bar.update(1)
    return runs


def best_per_method(runs: Iterable[Run], key: Callable[[Run], tuple]) -> dict[tuple[str, str], Run]:
    """(group, method) -> the run with the smallest ``key`` (ties: first in grid order)."""
    best: dict[tuple[str, str], Run] = {}
    for r in runs:
        k = (r.group, r.method)
        if k not in best or key(r) < key(best[k]):
            best[k] = r
    return best


# --------------------------------------------------------------------------- output

def write_curves_csv(path: str, runs: Sequence[Run], best: dict[tuple[str, str], Run],
                     columns: Sequence[str]) -> str:
    """Every curve of every grid point, long format: group, method, setting, best flag, then
    ``columns`` of each evaluation point (t, version, metric...)."""
    best_ids = {id(r) for r in best.values()}
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["group", "method", "setting", "best", "diverged", *columns])
        for r in runs:
            for p in r.points:
                w.writerow([r.group, r.method, r.label, int(id(r) in best_ids), int(r.diverged),
                            *(repr(float(p[c])) if c in p else "" for c in columns)])
    return path


def write_rows_csv(path: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(list(header))
        for row in rows:
            w.writerow([repr(float(v)) if isinstance(v, (float, np.floating)) else v for v in row])
    return path


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def fmt_num(v: float, digits: int = 3) -> str:
    if not math.isfinite(v):
        return "not reached" if v == math.inf else "diverged"
    return f"{v:.{digits}g}"


def write_text(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def style_axis(ax: Any, title: str, xlabel: str, ylabel: str, *, logy: bool, hline: float | None) -> None:
    """The look every experiment panel shares: log scale, target line, labels, grid, legend."""
    if logy:
        ax.set_yscale("log")
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle=":", linewidth=1)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=6.5)


def plot_panels(path: str, panels: Sequence[tuple[str, Sequence[tuple[str, np.ndarray, np.ndarray]]]], *,
                xlabel: str, ylabel: str, suptitle: str, logy: bool = True, ncols: int = 3,
                hline: float | None = None) -> str:
    """One subplot per panel (title, [(line label, x, y), ...]); one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels, strict=False):
        for label, x, y in lines:
            ok = np.isfinite(y) & ((y > 0) if logy else True)
            ax.plot(x[ok], y[ok], label=label, linewidth=1.3)
        style_axis(ax, title, xlabel, ylabel, logy=logy, hline=hline)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    _shrink_png(path)
    return path


def _shrink_png(path: str, colors: int = 64) -> None:
    """Re-save as a palette PNG (line plots need few colours; about a third of the size)."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=colors)
    small.save(path, optimize=True)


def curve(run: Run, metric: str) -> tuple[np.ndarray, np.ndarray]:
    t = np.array([p["t"] for p in run.points], dtype=float)
    y = np.array([p[metric] for p in run.points], dtype=float)
    return t, y
