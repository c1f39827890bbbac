"""The acceptance experiment of ``latecomer advise`` (issue 30): is the prediction right about reality?

For each delay setting (homogeneous, sqrt, one 10x straggler; 4 local workers with injected
per-job delays of 20-200 ms, large next to the quadratic's compute): record a real run with asgd
(``latecomer serve --state`` and ``latecomer work --delay`` processes), run ``latecomer advise`` on
it, then actually run every algorithm it ranks with its recommended settings on the real daemon,
to the same target, and compare predicted with measured time to target: Kendall τ of the two
rankings, whether the top choice was the measured best (or within 10 % of it), and the winner's
prediction error. The what-if ``--drop-slowest 1`` on the straggler setting is checked against a
real run without the straggler.

Not a test (minutes of wall time; real runs are not deterministic):

    .venv/bin/python -m experiments.advise_validation --out experiments/results/advise

writes ``validation.json``, ``validation.md`` (the table docs/ADVISE.md quotes) and
``validation.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from ps.ops.advise import kendall_tau

SETTINGS = {
    "homogeneous": [0.04, 0.04, 0.04, 0.04],
    "sqrt": [round(0.02 * math.sqrt(i), 4) for i in (1, 2, 3, 4)],
    "straggler": [0.02, 0.02, 0.02, 0.2],
}
ALGORITHMS = "asgd,delay-adaptive,delay-filtered,naive-momentum,ordered-momentum,ringmaster,rennala"
PROBLEM = ["--problem", "quadratic", "--problem-opt", "d=64", "--batch-size", "8"]
RECORD = ["--algorithm", "asgd", "--set", "lr=0.1", "--max-steps", "400"]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ps", *args]


def _endpoint(log_path: str, server: subprocess.Popen, timeout: float = 60.0) -> str:
    """The server's address from its log (a file: a pipe nobody drains would block the server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            m = re.search(r"listening on (tcp://\S+)", f.read())
        if m:
            return m.group(1)
        time.sleep(0.05)  # polling a log with a deadline
    raise RuntimeError(f"server did not start: see {log_path}")


def real_run(state: str, delays: list[float], serve_args: list[str], timeout: float) -> dict[str, Any]:
    """One real run: ``latecomer serve --state`` and a worker per delay; returns summary.json."""
    log_path = state.rstrip("/") + ".log"
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        server = subprocess.Popen(_cmd("serve", "--bind", "tcp://127.0.0.1:0", "--state", state, "--eval-every", "10",
                                       "--min-workers", str(len(delays)), *serve_args),
                                  stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        ep = _endpoint(log_path, server)
        workers = [subprocess.Popen(_cmd("work", "--server", ep, "--worker-id", f"w{i + 1}", "--delay", str(d)),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for i, d in enumerate(delays)]
        server.wait(timeout=timeout)
    finally:
        for p in (server, *workers):
            if p.poll() is None:
                p.terminate()
        for p in (server, *workers):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    try:
        with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
            return json.load(f)
    except OSError:  # stopped from outside: no time to target
        return {}


def measured_time(summary: dict[str, Any], target: float) -> float:
    for ev in summary.get("evaluations", []):
        if ev.get("loss", math.inf) <= target:
            return float(ev["t"])
    return math.inf


def advise(state: str, out: str, *extra: str) -> dict[str, Any]:
    r = subprocess.run(_cmd("advise", state, "--algorithms", ALGORITHMS, "--seeds", "3", "--budget", "240",
                            "--oracle", os.environ.get("ADVISE_ORACLE", "exact"),
                            "--out", out, "--json", *extra), capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout)


def _serve_args(row: dict[str, Any], target: float, limit: float) -> list[str]:
    args = [*PROBLEM, "--algorithm", row["algorithm"], "--target-loss", f"{target:.6g}", "--max-time", f"{limit:.1f}"]
    for k, v in row["settings"].items():
        args += ["--set", f"{k}={v}"]
    return args


def one_setting(name: str, delays: list[float], root: str) -> dict[str, Any]:
    """Record with asgd, advise, run every ranked candidate for real."""
    rec_dir = os.path.join(root, name, "recorded")
    real_run(rec_dir, delays, [*PROBLEM, *RECORD], timeout=300)
    adv = advise(rec_dir, os.path.join(root, name, "advise"))
    target = adv["target"]["value"]
    rows = []
    for row in adv["ranking"]:
        pred = row["predicted_s"] or math.inf
        # --max-time counts from the server's start, worker start-up included: only a bound for a run
        # that never gets there (the target stops the others)
        limit = 4 * (pred if math.isfinite(pred) else 30.0) + 60
        summary = real_run(os.path.join(root, name, row["algorithm"]), delays, _serve_args(row, target, limit),
                           timeout=limit + 60)
        rows.append({"algorithm": row["algorithm"], "settings": row["settings"], "predicted_s": row["predicted_s"],
                     "spread": [row["min_s"], row["max_s"]], "measured_s": _finite(measured_time(summary, target))})
    return {"setting": name, "delays": delays, "target": target, "oracle": adv["oracle"],
            "recorded_s": adv["recorded"]["time_to_target_s"],
            "recorded_predicted_s": (adv["recorded"]["predicted"] or {}).get("predicted_s"),
            "rows": rows, **verdict(rows)}


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    inf = 1e9
    pred = [r["predicted_s"] or inf for r in rows]
    meas = [r["measured_s"] or inf for r in rows]
    best = min(meas)
    top = rows[0]
    top_meas = top["measured_s"] or inf
    return {"kendall_tau": kendall_tau(pred, meas), "top_is_best": top_meas == best,
            "top_within_10pct": top_meas <= 1.10 * best,
            "winner_error": (top["predicted_s"] - top_meas) / top_meas if top["measured_s"] else None}


def what_if(root: str, delays: list[float]) -> dict[str, Any]:
    """--drop-slowest 1 on the straggler recording against a real run without the straggler."""
    rec_dir = os.path.join(root, "straggler", "recorded")
    adv = advise(rec_dir, os.path.join(root, "straggler", "advise-drop1"), "--drop-slowest", "1")
    target = adv["target"]["value"]
    win = adv["ranking"][0]
    kept = [d for d in delays if d != max(delays)]
    summary = real_run(os.path.join(root, "straggler", "drop1-real"), kept,
                       _serve_args(win, target, 4 * (win["predicted_s"] or 30) + 60), timeout=400)
    meas = measured_time(summary, target)
    return {"algorithm": win["algorithm"], "settings": win["settings"], "predicted_s": win["predicted_s"],
            "measured_s": _finite(meas), "error": (win["predicted_s"] - meas) / meas if math.isfinite(meas) else None}


def write_outputs(out: str, results: list[dict[str, Any]], whatif: dict[str, Any]) -> None:
    with open(os.path.join(out, "validation.json"), "w", encoding="utf-8") as f:
        json.dump({"settings": results, "what_if_drop_slowest_1": whatif}, f, indent=1)
    lines = [f"oracle: {results[0]['oracle'] if results else '-'}", "",
             "| setting | algorithm (recommended settings) | predicted (s) [spread] | measured (s) |",
             "|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            s = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["settings"].items())
            lo, hi = r["spread"]
            lines.append(f"| {res['setting']} | {r['algorithm']} ({s}) | {_f(r['predicted_s'])} [{_f(lo)}, {_f(hi)}] "
                         f"| {_f(r['measured_s'])} |")
    lines += ["", "| setting | Kendall τ | top = measured best | top within 10 % | winner's error "
                  "| recorded asgd: measured / predicted (s) |", "|---|---|---|---|---|---|"]
    for res in results:
        err = res["winner_error"]
        lines.append(f"| {res['setting']} | {res['kendall_tau']:.2f} | {res['top_is_best']} | {res['top_within_10pct']}"
                     f" | {'-' if err is None else f'{100 * err:+.0f} %'} | {_f(res['recorded_s'])} / "
                     f"{_f(res['recorded_predicted_s'])} |")
    w = whatif
    lines += ["", f"what-if --drop-slowest 1 (straggler): {w['algorithm']} predicted {_f(w['predicted_s'])} s, "
                  f"measured {_f(w['measured_s'])} s"
              + ("" if w["error"] is None else f" ({100 * w['error']:+.0f} %)")]
    with open(os.path.join(out, "validation.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    _plot(out, results)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _plot(out: str, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    top = 1.0
    for res, marker in zip(results, "os^"[:len(results)], strict=True):
        xs = [r["predicted_s"] for r in res["rows"] if r["predicted_s"] and r["measured_s"]]
        ys = [r["measured_s"] for r in res["rows"] if r["predicted_s"] and r["measured_s"]]
        ax.scatter(xs, ys, marker=marker, label=f"{res['setting']} (τ {res['kendall_tau']:.2f})")
        top = max([top, *xs, *ys])
    ax.plot([0, top], [0, top], "k:", lw=0.8)
    ax.set_xlabel("predicted time to target (s)")
    ax.set_ylabel("measured time to target (s)")
    ax.set_title("latecomer advise: predicted vs measured")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "validation.png"), dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="experiments/results/advise")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--work", default=None, help="Keep the runs here (default: a temporary directory).")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="advise-val-", dir=a.work) as root:
        results = []
        for name in a.settings.split(","):
            results.append(one_setting(name, SETTINGS[name], root))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}), flush=True)
        whatif = what_if(root, SETTINGS["straggler"]) if "straggler" in a.settings else {}
        print(json.dumps(whatif), flush=True)
        write_outputs(a.out, results, whatif)


if __name__ == "__main__":
    main()
