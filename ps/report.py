"""Reading event logs and traces back, and drawing the plots a person looks at."""

from __future__ import annotations

import csv
import json
from typing import Any, Iterable, Sequence

import numpy as np


def read_events(path: str) -> list[dict[str, Any]]:
    """Events written by the daemon (JSON lines); a torn last line is ignored."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    except FileNotFoundError:
        pass
    return out


def age_stats(events: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Mean, median, p90 and max age of the applied replies."""
    ages = np.array([e["age"] for e in events if e.get("ev") == "applied"], dtype=float)
    if ages.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "max": float("nan"), "n": 0}
    return {"mean": float(ages.mean()), "p50": float(np.median(ages)), "p90": float(np.percentile(ages, 90)),
            "max": float(ages.max()), "n": int(ages.size)}


def plot_run(evaluations: Sequence[dict[str, float]], events: Sequence[dict[str, Any]], path: str, *,
             title: str = "") -> str:
    """Loss (and accuracy) against steps and time, plus the age histogram per worker. Returns path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    steps = [e["version"] for e in evaluations]
    times = [e["t"] for e in evaluations]
    loss = [e["loss"] for e in evaluations]
    ax = axes[0]
    ax.plot(steps, loss, marker=".", label="loss")
    ax.set_xlabel("server step (version)")
    ax.set_ylabel("evaluation loss")
    if min(loss) > 0 and max(loss) / max(min(loss), 1e-300) > 20:
        ax.set_yscale("log")
    if "accuracy" in evaluations[0]:
        ax2 = ax.twinx()
        ax2.plot(steps, [e["accuracy"] for e in evaluations], color="tab:green", marker=".", label="accuracy")
        ax2.set_ylabel("test accuracy", color="tab:green")
        ax2.set_ylim(0, 1)
    ax.set_title("convergence")
    ax = axes[1]
    ax.plot(times, loss, marker=".")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("evaluation loss")
    if min(loss) > 0 and max(loss) / max(min(loss), 1e-300) > 20:
        ax.set_yscale("log")
    ax.set_title("loss against time")
    ax = axes[2]
    by_worker: dict[str, list[int]] = {}
    for e in events:
        if e.get("ev") == "applied":
            by_worker.setdefault(e["worker_id"], []).append(e["age"])
    if by_worker:
        top = max(max(a) for a in by_worker.values())
        bins = np.arange(-0.5, top + 1.5, max(1, (top + 1) // 40))
        for wid in sorted(by_worker):
            ax.hist(by_worker[wid], bins=bins, alpha=0.6, label=wid)
        ax.legend(fontsize=8)
    ax.set_xlabel("age of applied reply (steps)")
    ax.set_ylabel("replies")
    ax.set_title("age histogram per worker")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_trace_csv(trace: Any, path: str) -> None:
    """The evaluation points of a simulator trace as CSV."""
    keys = list(trace.points[0].keys()) if trace.points else []
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for p in trace.points:
            w.writerow(p)
