"""Reading event logs and traces back, and drawing the plots a person looks at."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np

log = logging.getLogger("latecomer.report")

# The event fields the report reads, and their types: an event with one of another type is skipped.
_EVENT_FIELDS: dict[str, tuple[type, ...]] = {"ev": (str,), "t": (int, float), "age": (int,), "worker_id": (str,),
                                              "job_id": (int,), "created_at": (int,), "device": (str,),
                                              "message": (str,), "problem": (str,)}
_NEEDS = {"applied": ("worker_id", "age", "job_id"), "issued": ("worker_id", "job_id")}


def _event_ok(e: Any) -> bool:
    if type(e) is not dict or type(e.get("ev")) is not str:
        return False
    for k, types in _EVENT_FIELDS.items():
        if k in e and (type(e[k]) not in types or (k == "t" and not math.isfinite(e[k]))):
            return False
    return all(k in e for k in _NEEDS.get(e["ev"], ()))


def read_events(path: str) -> list[dict[str, Any]]:
    """Events written by the daemon (JSON lines). A torn last line is ignored; a line that is not
    an event (not JSON, not a map, a field of the wrong type) is skipped and counted in one
    warning, and the lines after it are still read."""
    out = []
    bad = 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return out
    last = len(lines) - 1  # the text after the final newline: empty, or a torn line
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except (ValueError, RecursionError):  # a line nested deeper than the parser recurses: damaged too
            e = None
        if _event_ok(e):
            out.append(e)
        elif i != last:
            bad += 1
    if bad:
        log.warning("%s: %d damaged lines skipped", path, bad)
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


# --------------------------------------------------------------------------- `latecomer report DIR`

_SETTLED = ("applied", "dropped", "lost", "failed", "cancelled", "rejected")


def _summary_ok(doc: Any) -> bool:
    """summary.json as the report reads it: counters and evaluations of numbers."""
    if type(doc) is not dict:
        return False
    counters, evals = doc.get("counters", {}), doc.get("evaluations") or []
    number = (int, float)
    if type(counters) is not dict or type(evals) is not list:
        return False
    if any(type(v) not in number for v in counters.values()) or type(doc.get("elapsed_s", 0.0)) not in number:
        return False
    if any(type(e) is not dict or any(type(v) not in number for v in e.values()) for e in evals):
        return False
    return not evals or all({"t", "version"} <= e.keys() and e.keys() == evals[0].keys() for e in evals)


def _read_summary(state_dir: str) -> dict[str, Any] | None:
    """summary.json, or None if there is none; a damaged one is ignored with a warning."""
    from ps.journal.statefiles import SUMMARY_BYTES, read_json

    path = f"{state_dir}/summary.json"
    if not os.path.exists(path):
        return None
    try:  # the checked reader: bounded size and depth (a crafted one is one warning, no traceback)
        doc = read_json(path, "a run summary", max_bytes=SUMMARY_BYTES)
    except ValueError as e:
        log.warning("%s (the report goes without it)", e)
        return None
    if not _summary_ok(doc):
        log.warning("%s is not a run summary (damaged?): the report goes without it", path)
        return None
    return doc


def job_intervals(events: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float, str]]]:
    """Per worker: (issued t, settled t, outcome) of every job that was settled."""
    issued: dict[Any, tuple[str, float]] = {}
    out: dict[str, list[tuple[float, float, str]]] = {}
    for e in events:
        ev = e.get("ev")
        if ev == "issued" and "t" in e:
            issued[e["job_id"]] = (e["worker_id"], float(e["t"]))
        elif ev in _SETTLED and "job_id" in e:
            start = issued.pop(e["job_id"], None)
            if start is not None and "t" in e:
                out.setdefault(start[0], []).append((start[1], float(e["t"]), ev))
    return out


def _merge(intervals: list[tuple[float, float]], gap: float = 0.0) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def split_sessions(events: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The event log of a run cut into server sessions, in order (one list: never restarted).

    A server resumed from its state directory appends to the same events.jsonl; its core's first
    event is ``resumed`` (ps.core.server_core.ServerCore.rebase_clock) naming the new process's ``boot``. A
    ``resumed`` event starts a new session unless its boot is the current session's (the end of
    a disk-full pause). The first session's boot is not in the log: a pause ending in it reads
    as a new session of the same boot as the next ``resumed`` events of that process."""
    out: list[list[dict[str, Any]]] = [[]]
    boot: Any = None
    for e in events:
        if e.get("ev") == "resumed" and (e.get("boot") is None or e.get("boot") != boot):
            if out[-1]:
                out.append([])
            boot = e.get("boot")
        out[-1].append(e)
    return out


def session_table(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per server session (:func:`split_sessions`): its boot, time span (the events' own
    clock), the steps it went from and to, its jobs by outcome, the jobs it wrote off when it
    resumed (reason ``server_restart`` or a restored worker timed out) and its workers."""
    rows = []
    for i, evs in enumerate(split_sessions(events), 1):
        ts = [float(e["t"]) for e in evs if "t" in e]
        head = evs[0] if evs and evs[0].get("ev") == "resumed" else {}
        versions = [e["version"] for e in evs if e.get("ev") == "applied" and type(e.get("version")) is int]
        start = head.get("version") if type(head.get("version")) is int else (min(versions) - 1 if versions else 0)
        counts = {k: sum(e.get("ev") == k for e in evs) for k in ("issued", *_SETTLED)}
        rows.append({"session": i, "boot": head.get("boot"), "t0": min(ts) if ts else float("nan"),
                     "t1": max(ts) if ts else float("nan"), "from_step": start,
                     "to_step": max(versions) if versions else start, **counts,
                     "restored_workers": head.get("workers"), "restored_outstanding": head.get("outstanding"),
                     "lost_at_resume": _lost_at_resume(evs) if head else 0,
                     "workers": len({e["worker_id"] for e in evs if "worker_id" in e})})
    return rows


def _lost_at_resume(evs: Sequence[dict[str, Any]]) -> int:
    """Jobs of a resumed session written off because of the restart: at a restored worker's
    hello (reason ``server_restart``), or with a restored worker that never came back (its only
    events in the session, up to its ``left``, are timeouts)."""
    n, back, gone = 0, set(), set()
    for e in evs[1:]:
        wid, ev, why = e.get("worker_id"), e.get("ev"), e.get("reason")
        if ev == "lost" and why == "server_restart":
            n += 1
        elif wid is None or wid in back:
            continue
        elif wid not in gone and ev in ("lost", "left") and why == "timeout":
            n += ev == "lost"
            if ev == "left":
                gone.add(wid)
        else:
            back.add(wid)
    return n


def worker_table(events: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker: device, jobs by outcome, mean job time, age statistics, busy fraction, times
    benched and the last error (of a failed job, or why it could not load the problem)."""
    rows: dict[str, dict[str, Any]] = {}

    def row(wid: str) -> dict[str, Any]:
        return rows.setdefault(wid, {"device": "", "joins": 0, "issued": 0, **{k: 0 for k in _SETTLED},
                                     "ages": [], "job_times": [], "busy_s": 0.0, "span_s": 0.0,
                                     "benched": 0, "last_error": ""})

    ts = [float(e["t"]) for e in events if "t" in e]
    t_end = max(ts) if ts else 0.0
    first_seen: dict[str, float] = {}
    for e in events:
        wid = e.get("worker_id")
        if wid is None:
            continue
        r = row(wid)
        if "t" in e:
            first_seen.setdefault(wid, float(e["t"]))
        ev = e.get("ev")
        if ev == "joined":
            r["joins"] += 1
            r["device"] = e.get("device") or r["device"]
        elif ev == "issued":
            r["issued"] += 1
        elif ev in _SETTLED:
            r[ev] += 1
            if ev == "applied":
                r["ages"].append(e["age"])
            elif ev == "failed":
                r["last_error"] = e.get("message", "")
        elif ev == "benched":
            r["benched"] += 1
        elif ev == "problem_unavailable":
            r["last_error"] = f"cannot load problem {e.get('problem', '?')}: {e.get('message', '')}"
    for wid, jobs in job_intervals(events).items():
        r = row(wid)
        r["job_times"] = [b - a for a, b, how in jobs if how in ("applied", "dropped")]
        r["busy_s"] = sum(b - a for a, b in _merge([(a, b) for a, b, _ in jobs]))
        r["span_s"] = max(0.0, t_end - first_seen.get(wid, t_end))
    return rows


def plot_utilisation(events: Sequence[dict[str, Any]], path: str, *, max_segments: int = 4000) -> str:
    """Worker utilisation timeline: a bar while a worker holds a job, a cross where one was lost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = job_intervals(events)
    ts = [float(e["t"]) for e in events if "t" in e]
    t0 = min(ts) if ts else 0.0
    span = (max(ts) - t0) if ts else 1.0
    workers = sorted({e["worker_id"] for e in events if "worker_id" in e}, key=lambda w: (len(w), w))
    fig, (ax, ax_rate) = plt.subplots(2, 1, figsize=(12, 3.6 + 0.45 * max(1, len(workers))), sharex=True,
                                      gridspec_kw={"height_ratios": [max(1, len(workers)), 3]})
    edges = np.linspace(0.0, max(span, 1e-9), 61)
    for wid in workers:
        done = [b - t0 for a, b, how in jobs.get(wid, []) if how in ("applied", "dropped")]
        if done:
            hist, _ = np.histogram(done, bins=edges)
            ax_rate.plot((edges[:-1] + edges[1:]) / 2, hist / np.diff(edges), label=wid)
    ax_rate.set_ylabel("replies / s")
    ax_rate.set_xlabel("time since the first event (s)")
    if ax_rate.get_legend_handles_labels()[1]:
        ax_rate.legend(fontsize=8, ncol=min(6, len(workers)))
    for y, wid in enumerate(workers):
        segs = _merge([(a - t0, b - t0) for a, b, _ in jobs.get(wid, [])])
        if len(segs) > max_segments:  # very long runs: close gaps shorter than a pixel or so
            segs = _merge(segs, gap=span / max_segments)
        ax.broken_barh([(a, max(b - a, span * 1e-4)) for a, b in segs], (y - 0.35, 0.7), color="tab:blue")
        lost = [float(e["t"]) - t0 for e in events if e.get("ev") == "lost" and e.get("worker_id") == wid
                and "t" in e]
        if lost:
            ax.plot(lost, [y] * len(lost), "x", color="tab:red", markersize=8,
                    label="lost job" if y == 0 or not ax.get_legend_handles_labels()[1] else None)
        left = [float(e["t"]) - t0 for e in events if e.get("ev") == "left" and e.get("worker_id") == wid
                and "t" in e]
        if left:
            ax.plot(left, [y] * len(left), "|", color="black", markersize=14)
    resumed = [float(e["t"]) - t0 for e in events if e.get("ev") == "resumed" and "t" in e]
    for a in (ax, ax_rate):
        for t in resumed:  # a new server session (or the end of a disk-full pause)
            a.axvline(t, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(workers)), workers)
    ax.set_ylim(-0.6, len(workers) - 0.4)
    ax.set_title("worker utilisation (blue: holding a job; red x: job lost; |: worker left; dashed: server resumed)")
    if ax.get_legend_handles_labels()[1]:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_ages(events: Sequence[dict[str, Any]], path: str) -> str:
    """Histogram of the ages of applied replies, one panel per worker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_worker: dict[str, list[int]] = {}
    for e in events:
        if e.get("ev") == "applied":
            by_worker.setdefault(e["worker_id"], []).append(e["age"])
    wids = sorted(by_worker, key=lambda w: (len(w), w)) or ["(no applied replies)"]
    cols = min(4, len(wids))
    rows = (len(wids) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    top = max((max(a) for a in by_worker.values()), default=1)
    bins = np.arange(-0.5, top + 1.5, max(1, (top + 1) // 40))
    for i, ax in enumerate(axes.flat):
        if i >= len(wids):
            ax.axis("off")
            continue
        ages = by_worker.get(wids[i], [])
        if ages:
            ax.hist(ages, bins=bins, color="tab:blue")
        ax.set_title(f"{wids[i]} ({len(ages)} replies)", fontsize=9)
        ax.set_xlabel("age (steps)")
        ax.set_ylabel("replies")
    fig.suptitle("age of applied replies per worker")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_evaluations(evaluations: Sequence[dict[str, float]], path: str) -> str:
    """Every evaluated figure (loss, accuracy, ...) against server steps and against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in evaluations[0] if k not in ("t", "version")]
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3 * len(keys)), squeeze=False)
    steps = [e["version"] for e in evaluations]
    times = [e["t"] for e in evaluations]
    for row, key in zip(axes, keys, strict=True):
        ys = [e.get(key, float("nan")) for e in evaluations]
        for ax, xs, label in ((row[0], steps, "server step (version)"), (row[1], times, "time (s)")):
            ax.plot(xs, ys, marker=".")
            ax.set_xlabel(label)
            ax.set_ylabel(key)
            finite = [y for y in ys if np.isfinite(y)]
            if key in ("loss", "grad_norm_sq") and finite and min(finite) > 0 and max(finite) / min(finite) > 20:
                ax.set_yscale("log")
    fig.suptitle("evaluations")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _fmt(x: Any, spec: str = ".3g") -> str:
    if isinstance(x, float) and not np.isfinite(x):
        return "-"
    return format(x, spec)


def _worker_lines(table: dict[str, dict[str, Any]]) -> list[str]:
    """The Workers table: per worker its jobs by outcome, job times, ages and busy share."""
    lines = ["## Workers", "",
              "| worker | device | joins | issued | applied | dropped | lost | failed | cancelled | rejected | "
              "mean job time (ms) | age mean | age median | age p90 | age max | busy |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for wid in sorted(table, key=lambda w: (len(w), w)):
        r = table[wid]
        a = np.array(r["ages"], dtype=float)
        st = [float(a.mean()), float(np.median(a)), float(np.percentile(a, 90)), float(a.max())] if a.size else \
            [float("nan")] * 4
        jt = float(np.mean(r["job_times"]) * 1000) if r["job_times"] else float("nan")
        busy = f"{100 * r['busy_s'] / r['span_s']:.0f}%" if r["span_s"] > 0 else "-"
        lines.append(f"| {wid} | {r['device'] or '-'} | {r['joins']} | {r['issued']} | {r['applied']} | "
                     f"{r['dropped']} | {r['lost']} | {r['failed']} | {r['cancelled']} | {r['rejected']} | "
                     f"{_fmt(jt, '.1f')} | "
                     f"{_fmt(st[0], '.2f')} | {_fmt(st[1], '.0f')} | {_fmt(st[2], '.0f')} | {_fmt(st[3], '.0f')} | "
                     f"{busy} |")
    lines += ["", "Job time: from `issued` to the reply being applied or dropped, as the server saw it. Busy: the "
              "share of time since the worker first appeared during which it held at least one job.", ""]
    return lines


def render_markdown(events: Sequence[dict[str, Any]], summary: dict[str, Any] | None, figures: Sequence[str],
                    source: str) -> str:
    counts: dict[str, int] = {}
    for e in events:
        counts[e.get("ev", "?")] = counts.get(e.get("ev", "?"), 0) + 1
    ts = [float(e["t"]) for e in events if "t" in e]
    sessions = session_table(events)
    last_of = f" (the last of {len(sessions)} server sessions)" if len(sessions) > 1 else ""
    lines = [f"# latecomer run report: {source}", ""]
    if summary:
        c = summary.get("counters", {})
        lines += [f"- stopped: {summary.get('stopped') or 'running or killed'} at step {summary.get('version')}, "
                  f"after {_fmt(float(summary.get('elapsed_s', float('nan'))), '.1f')} s{last_of}",
                  f"- accounted (issued = applied + dropped + lost + failed + cancelled + rejected + outstanding): "
                  f"{summary.get('accounted')}", ""]
        evals = summary.get("evaluations") or []
        if evals:
            first, last = evals[0], evals[-1]
            figs = [k for k in first if k not in ("t", "version")]
            lines += [f"- {k}: {_fmt(first[k], '.4g')} -> {_fmt(last[k], '.4g')}{last_of}" for k in figs] + [""]
        lines += ["## Counters (summary.json, the whole run)", "", "| counter | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in c.items()]
        lines += [f"| outstanding | {summary.get('outstanding')} |", ""]
        lines += _shard_lines(summary)
    lines += ["## Events (events.jsonl)", "",
              f"{len(events)} events over {_fmt(max(ts) - min(ts) if ts else 0.0, '.1f')} s", "",
              "| event | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(counts.items())]
    lines += _session_lines(sessions, ts)
    ages = age_stats(events)
    lines += ["", f"Ages of applied replies (all workers): mean {_fmt(ages['mean'], '.2f')}, median "
              f"{_fmt(ages['p50'], '.0f')}, p90 {_fmt(ages['p90'], '.0f')}, max {_fmt(ages['max'], '.0f')}", ""]
    table = worker_table(events)
    lines += _worker_lines(table)
    failing = [wid for wid in sorted(table, key=lambda w: (len(w), w)) if table[wid]["last_error"]]
    if failing:
        lines += ["## Worker errors", "", "| worker | failed jobs | benched | last error |", "|---|---|---|---|"]
        for wid in failing:
            r = table[wid]
            text = r["last_error"].replace("|", "\\|")
            lines.append(f"| {wid} | {r['failed']} | {r['benched']} | {text} |")
        lines += [""]
    if figures:
        lines += ["## Figures", ""] + [f"![{name}]({name})" for name in figures] + [""]
    return "\n".join(lines)


def _shard_lines(summary: dict[str, Any]) -> list[str]:
    """A sharded server's shards at the end of the run (summary.json ``shards``)."""
    shards = summary.get("shards")
    if not isinstance(shards, list) or not shards:
        return []
    lines = ["## Shards (summary.json)", "", "| shard | values | endpoint | joins | records behind | RSS (MB) | "
             "blocks held |", "|---|---|---|---|---|---|---|"]
    for sh in shards:
        if not isinstance(sh, dict):
            continue
        lo, hi = (sh.get("range") or [0, 0])[:2]
        lines.append(f"| {sh.get('index')} | [{lo}, {hi}) | {sh.get('endpoint')} | {sh.get('joins')} | "
                     f"{sh.get('lag_records')} | {_fmt(float(sh.get('rss_bytes', 0)) / 1e6, '.0f')} | "
                     f"{sh.get('blocks_held')} |")
    return lines + ["", f"Replies dropped because a shard's gradient block never came: "
                        f"{summary.get('blocks_timed_out', 0)}", ""]


def _session_lines(sessions: Sequence[dict[str, Any]], ts: Sequence[float]) -> list[str]:
    """The "Server sessions" section: one row per session (:func:`session_table`), and the
    totals over all of them when the server was restarted."""
    t0 = min(ts) if ts else 0.0
    cols = ("issued", "applied", "dropped", "lost", "failed", "cancelled", "rejected")
    lines = ["", "## Server sessions", "",
             "A server resumed from its state directory (`serve --state DIR`) starts a new session; its jobs "
             "lost at resume are those written off because of the restart (reason `server_restart`, or a "
             "restored worker that did not come back within the restart grace). A job counts where it was "
             "issued and where it was settled.", "",
             "| session | boot | start (s) | end (s) | steps | restored workers | restored jobs | lost at resume | "
             + " | ".join(cols) + " | workers |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(cols) + "---|"]
    for r in sessions:
        boot = "-" if r["boot"] is None else f"{r['boot']:x}" if type(r["boot"]) is int else str(r["boot"])
        lines.append(f"| {r['session']} | {boot} | {_fmt(r['t0'] - t0, '.1f')} | {_fmt(r['t1'] - t0, '.1f')} | "
                     f"{r['from_step']} -> {r['to_step']} | {_dash(r['restored_workers'])} | "
                     f"{_dash(r['restored_outstanding'])} | {r['lost_at_resume']} | "
                     + " | ".join(str(r[k]) for k in cols) + f" | {r['workers']} |")
    if len(sessions) > 1:
        tot = {k: sum(r[k] for r in sessions) for k in (*cols, "lost_at_resume")}
        lines.append(f"| all | | {_fmt(sessions[0]['t0'] - t0, '.1f')} | {_fmt(sessions[-1]['t1'] - t0, '.1f')} | "
                     f"{sessions[0]['from_step']} -> {sessions[-1]['to_step']} | | | {tot['lost_at_resume']} | "
                     + " | ".join(str(tot[k]) for k in cols) + " | |")
    return lines


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)


def make_report(state_dir: str, out_dir: str, *, events_path: str | None = None) -> dict[str, Any]:
    """Write ``report.md`` and the PNGs of a run into ``out_dir``; return the paths and the counts."""
    import os

    events_path = events_path or os.path.join(state_dir, "events.jsonl")
    if not os.path.exists(events_path):
        raise ValueError(f"no {events_path}: is {state_dir} a state directory (serve --state) or an --out "
                         f"directory with --events?")
    events = read_events(events_path)
    summary = _read_summary(state_dir)
    os.makedirs(out_dir, exist_ok=True)
    figures = []
    if summary and summary.get("evaluations"):
        figures.append(os.path.basename(plot_evaluations(summary["evaluations"],
                                                         os.path.join(out_dir, "evaluations.png"))))
    figures.append(os.path.basename(plot_ages(events, os.path.join(out_dir, "ages.png"))))
    figures.append(os.path.basename(plot_utilisation(events, os.path.join(out_dir, "utilisation.png"))))
    md = render_markdown(events, summary, figures, state_dir)
    md_path = os.path.join(out_dir, "report.md")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(md)
    return {"files": [md_path] + [os.path.join(out_dir, n) for n in figures], "events": len(events),
            "workers": worker_table(events), "sessions": session_table(events)}
