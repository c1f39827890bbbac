"""``latecomer advise DIR``: which algorithm, with which settings, for this cluster, predicted
from the run's own recorded delays (docs/ADVISE.md; the predictions are ps/ops/advise.py's).

This module owns what the sans-I/O part does not: reading the run directory (or asking a live
server), the clock of ``--budget``, the progress bar, the table, the JSON, the plot."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import click

from ps.cli.options import allow_options, allowed_from, finite, parse_pairs
from ps.cli.paths import output_dir

HORIZON_FACTOR = 3.0  # simulate up to this many times the recorded run's time to target
SIM_STEP_S = 2e-4  # the simulator's own cost per step (core, events), measured on a laptop-class CPU


@dataclass
class Recorded:
    """What advise knows of the recorded run."""

    problem_spec: str
    problem_options: dict[str, Any]
    problem: Any
    cfg: Any
    algorithm: str | None
    settings: dict[str, Any]
    events: list[dict[str, Any]]
    evaluations: list[dict[str, float]] = field(default_factory=list)
    source: str = ""


def _read_evaluations(run_dir: str) -> list[dict[str, float]]:
    """summary.json's evaluations, else a state directory's evaluations.jsonl (a run still going)."""
    from ps.ops.report import _read_summary

    summary = _read_summary(run_dir)
    if summary and summary.get("evaluations"):
        return list(summary["evaluations"])
    out = []
    path = os.path.join(run_dir, "evaluations.jsonl")
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict) and isinstance(ev.get("t"), (int, float)):
                    out.append(ev)
    return out


def load_recorded(run_dir: str, allowed: Any) -> Recorded:
    """The run of a ``serve --state`` directory (run.json) or an ``--out`` directory (problem.json).

    Raises:
        ValueError: neither, no events.jsonl, or an untrusted problem (one line each).
    """
    from problems import load_problem
    from problems.trust import check_run
    from ps.core.config import CoreConfig
    from ps.drivers.replay import build_from_run
    from ps.journal.runfile import read_run
    from ps.ops.report import read_events

    events_path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(events_path):
        raise ValueError(f"{run_dir} has no events.jsonl: give a `serve --state` or `--out` directory of a run")
    run = read_run(run_dir) if os.path.exists(os.path.join(run_dir, "run.json")) else None
    if run is not None:
        problem, _, cfg = build_from_run(run, allowed=allowed, where=os.path.join(run_dir, "run.json"))
        spec, opts, alg, settings = run["problem"], dict(run["problem_options"]), run["algorithm"], run["settings"]
    else:
        try:
            with open(os.path.join(run_dir, "problem.json"), encoding="utf-8") as f:
                desc = json.load(f)
            spec, opts = str(desc["problem"]), dict(desc.get("problem_options") or {})
        except (OSError, ValueError, KeyError, TypeError):
            raise ValueError(f"{run_dir} has neither run.json nor a readable problem.json: which problem it "
                             "trained is unknown") from None
        check_run({"problem": spec}, allowed, os.path.join(run_dir, "problem.json"), check_algorithm=False)
        problem = load_problem(spec, opts)
        cfg = CoreConfig(problem=spec, problem_options=opts, batch_size=int(getattr(problem, "batch_size", 0) or 32))
        alg, settings = None, {}
    return Recorded(spec, opts, problem, cfg, alg, dict(settings), read_events(events_path),
                    _read_evaluations(run_dir), source=run_dir)


def load_live(server: str, problem_opt: dict, settings: dict, timeout_s: float = 5.0) -> tuple[Recorded, Any]:
    """A running server's problem, algorithm, evaluation and per-worker mean job times (status?)."""
    from problems import load_problem
    from ps.core.config import CoreConfig
    from ps.ops.advise import trace_from_means
    from ps.ops.status import fetch_status

    st = fetch_status(server, timeout_s=timeout_s)
    info = st.info
    col = {c: j for j, c in enumerate(st.columns)}
    if "worker" not in col or "mean_job_s" not in col:
        raise ValueError(f"{server}'s status has no per-worker job times")
    means = {str(r[col["worker"]]): float(r[col["mean_job_s"]]) for r in st.rows}
    done = {str(r[col["worker"]]): int(r[col["jobs_done"]]) for r in st.rows} if "jobs_done" in col else {}
    spec = str(info.get("problem"))
    problem = load_problem(spec, problem_opt)
    cfg = CoreConfig(problem=spec, problem_options=problem_opt,
                     batch_size=int(getattr(problem, "batch_size", 0) or 32))
    evals = [{"t": float(info.get("eval.t", 0.0)), "version": float(info.get("eval.version", 0.0)),
              **{k[5:]: float(v) for k, v in info.items() if k.startswith("eval.") and k not in ("eval.t",
                                                                                              "eval.version")}}]
    rec = Recorded(spec, problem_opt, problem, cfg, str(info.get("algorithm")), settings, [],
                   evals if "eval.loss" in info else [], source=server)
    return rec, trace_from_means(means, done)


def _target(rec: Recorded, target_loss: float | None, target_accuracy: float | None) -> Any:
    from ps.ops.advise import Target

    if target_loss is not None:
        return Target("loss", target_loss)
    if target_accuracy is not None:
        return Target("accuracy", target_accuracy)
    losses = [e for e in rec.evaluations if isinstance(e.get("loss"), (int, float)) and math.isfinite(e["loss"])]
    if not losses:
        raise click.UsageError("the run has no evaluated loss to aim at: give --target-loss or --target-accuracy")
    return Target("loss", float(losses[-1]["loss"]))


def _base_lr(rec: Recorded) -> float | None:
    try:
        return float(rec.settings["lr"])
    except (KeyError, TypeError, ValueError):
        return None


def _timed(f: Any) -> float:
    """Seconds one call of ``f`` took (the least of several is the cost; the rest is contention)."""
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _oracle(rec: Recorded, choice: str, budget: float, n_cand: int, steps: int) -> tuple[Any, str]:
    """(problem, how it is described): the run's own problem (exact), or the proxy quadratic when
    asked, or (auto) when one gradient times the steps the search needs would not fit the budget
    and the run has what the proxy needs (else exact, saying why)."""
    exact = f"exact: the run's problem ({rec.problem_spec}), its real gradients"
    if choice == "exact":
        return rec.problem, exact
    if choice == "auto":
        x = rec.problem.init_params(0)
        rec.problem.grad(x, 1, rec.cfg.batch_size)  # the first call pays for imports and caches
        cost = SIM_STEP_S + min(_timed(lambda s=s: rec.problem.grad(x, s, rec.cfg.batch_size)) for s in range(5))
        if cost * max(steps, 1) * HORIZON_FACTOR * n_cand <= budget:
            return rec.problem, exact
    try:
        return _proxy(rec)
    except ValueError as e:
        if choice == "proxy":
            raise click.ClickException(str(e)) from None
        return rec.problem, f"{exact} (over the budget's estimate, but no proxy: {e})"


def _proxy(rec: Recorded) -> tuple[Any, str]:
    """The proxy quadratic of the recorded run (ps/ops/advise.py ``fit_proxy``)."""
    from ps.ops.advise import ProxyQuadratic, fit_proxy

    lr = _base_lr(rec)
    if lr is None:
        raise ValueError("the proxy oracle needs the recorded run's step size (lr): a --state directory's "
                         "run.json records it")
    fit = fit_proxy([(e["version"], e["loss"]) for e in rec.evaluations if "loss" in e])
    proxy = ProxyQuadratic.from_fit(fit, lr, rec.cfg.batch_size)
    return proxy, (f"proxy: a quadratic fitted to the run's loss curve (start {fit.l0:.4g}, floor {fit.floor:.4g}, "
                   f"rate {fit.rate:.3g}/step at lr {lr:g}; d={proxy.d}, h={proxy.h:.3g}, noise {proxy.sigma:.3g})")


@dataclass
class Search:
    """What the search found, and what it left out (the budget ran out, or a setting failed)."""

    ranked: list[Any]
    sync: Any
    recorded_pred: Any
    skipped: dict[str, str]
    not_evaluated: list[str]
    grid_size: int
    seeds: int


def _order(cands: list[Any], recorded: str | None) -> list[Any]:
    """The middle of each algorithm's grid first (its likeliest settings; the recorded algorithm's
    first of all), then the rest: a search the budget cuts short has looked at every algorithm."""
    by_alg: dict[str, list[Any]] = {}
    for c in cands:
        by_alg.setdefault(c.algorithm, []).append(c)
    names = sorted(by_alg, key=lambda a: a != recorded)
    firsts = [by_alg[a][len(by_alg[a]) // 2] for a in names]
    return firsts + [c for a in names for c in by_alg[a] if c is not by_alg[a][len(by_alg[a]) // 2]]


def search(rec: Recorded, problem: Any, trace: Any, target: Any, names: list[str], seeds: int, horizon: float,
           max_updates: int, out_of_time: Any, bar: Any) -> Search:
    """Every candidate once (seed 0), then the best of each algorithm and the recorded settings
    over the other seeds, then synchronous SGD over its step-size grid and the seeds. Evaluated
    every ``max_updates / 4000`` steps at least (a time to target is as fine as its evaluations)."""
    from functools import partial

    from ps.ops.advise import Candidate, best_per_algorithm, grid
    from ps.ops.advise import predict as predict_every

    predict = partial(predict_every, eval_every=max(1, max_updates // 4000))

    cands, skipped = grid(names, problem, len(trace.workers), _base_lr(rec))
    ordered = _order(cands, rec.algorithm)
    preds, not_done = [], []
    for c in ordered:
        if out_of_time():
            not_done.append(f"{c.algorithm} {c.label}")
            continue
        preds.append(predict(c, problem, trace, rec.cfg, target, horizon, 0, max_updates=max_updates))
        bar.update(1)
    recorded_pred = None
    if rec.algorithm in names and rec.algorithm is not None:
        try:
            rc = Candidate(rec.algorithm, {k: _num(v) for k, v in rec.settings.items()})
            recorded_pred = predict(rc, problem, trace, rec.cfg, target, horizon, 0, max_updates=max_updates)
        except ValueError:
            recorded_pred = None
    best = best_per_algorithm(preds)
    for p in [*best, *([recorded_pred] if recorded_pred is not None else [])]:
        for s in range(1, seeds):
            if out_of_time():
                break
            predict(p.candidate, problem, trace, rec.cfg, target, horizon, s, max_updates=max_updates, pred=p)
            bar.update(1)
    sync = _search_sync(rec, problem, trace, target, seeds, horizon, max_updates, out_of_time, bar)
    return Search(best_per_algorithm(preds), sync, recorded_pred, skipped, not_done, len(cands), seeds)


def _num(v: Any) -> Any:
    try:
        return float(v) if "." in str(v) or "e" in str(v).lower() else int(v)
    except (TypeError, ValueError):
        return v


def _search_sync(rec, problem, trace, target, seeds, horizon, max_updates, out_of_time, bar) -> Any:
    """Synchronous SGD with the recorded step size times 1, 2 and 4 (a round averages one gradient
    per worker, so it takes a larger step), the best over seed 0, then the other seeds."""
    from ps.ops.advise import predict_sync, rank

    base = _base_lr(rec) or 0.1
    preds = []
    rounds = max(1, max_updates // max(1, len(trace.workers)))
    for f in (1.0, 2.0, 4.0):
        if out_of_time() and preds:
            break
        preds.append(predict_sync(problem, trace, base * f, rec.cfg.batch_size, target, horizon, 0,
                                  eval_every=max(1, rounds // 4000)))
        bar.update(1)
    best = rank(preds)[0]
    for s in range(1, seeds):
        if out_of_time():
            break
        p = predict_sync(problem, trace, best.candidate.settings["lr"], rec.cfg.batch_size, target, horizon, s,
                         eval_every=max(1, rounds // 4000))
        best.times += p.times
        best.curves += p.curves
        bar.update(1)
    return best


def serve_command(rec: Recorded, cand: Any, target: Any) -> str:
    """The ``latecomer serve`` command line of a candidate on the recorded run's problem."""
    args = ["latecomer", "serve", "--problem", rec.problem_spec]
    for k, v in rec.problem_options.items():
        args += ["--problem-opt", f"{k}={v}"]
    args += ["--algorithm", cand.algorithm]
    for k, v in cand.settings.items():
        args += ["--set", f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"]
    args += ["--batch-size", str(rec.cfg.batch_size)]
    if target.key == "loss":
        args += ["--target-loss", f"{target.value:.6g}"]
    return shlex.join(args)


def _recorded_time(rec: Recorded, target: Any) -> float:
    from ps.ops.advise import time_to_target

    return time_to_target(rec.evaluations, target)


def _secs(t: float) -> str:
    return "not reached" if not math.isfinite(t) else f"{t:.3g} s"


def _row(p: Any, t_rec: float) -> dict[str, Any]:
    lo, hi = p.spread
    return {"algorithm": p.candidate.algorithm, "settings": dict(p.candidate.settings),
            "predicted_s": _finite(p.median), "min_s": _finite(lo), "max_s": _finite(hi), "seeds": len(p.times),
            "speedup": _finite(t_rec / p.median) if math.isfinite(t_rec) and p.median > 0 else None,
            "error": p.error}


def _finite(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def report_dict(rec: Recorded, trace: Any, target: Any, oracle: str, found: Search, command: str,
                plot: str, horizon: float) -> dict[str, Any]:
    """Everything the table says, for ``--json``."""
    from ps.ops.advise import LR_FACTORS

    t_rec = _recorded_time(rec, target)
    return {
        "source": rec.source, "problem": rec.problem_spec, "oracle": oracle,
        "target": {"key": target.key, "value": target.value},
        "recorded": {"algorithm": rec.algorithm, "settings": rec.settings, "time_to_target_s": _finite(t_rec),
                     "predicted": _row(found.recorded_pred, t_rec) if found.recorded_pred else None},
        "cluster": {"note": trace.note, "workers": [
            {"worker": w.worker_id, "jobs": w.seen, "mean_job_s": w.mean, "lost": w.lost,
             "present": w.present} for w in trace.workers]},
        "grid": {"lr_factors": list(LR_FACTORS), "structure": "R / B / tau_max at n/2, n, 2n workers",
                 "candidates": found.grid_size, "seeds": found.seeds, "horizon_s": horizon},
        "ranking": [_row(p, t_rec) for p in found.ranked],
        "synchronous": _row(found.sync, t_rec),
        "skipped": found.skipped, "not_evaluated": found.not_evaluated,
        "command": command, "plot": plot,
    }


def render(d: dict[str, Any]) -> str:
    """The table a person reads."""
    t = d["target"]
    rec = d["recorded"]
    lines = [f"advise: {d['source']} ({d['problem']}), target {t['key']} "
             f"{'<=' if t['key'] == 'loss' else '>='} {t['value']:.4g}",
             f"oracle: {d['oracle']}",
             f"cluster{' ' + d['cluster']['note'] if d['cluster']['note'] else ''}: " + ", ".join(
                 f"{w['worker']} {w['mean_job_s'] * 1000:.3g} ms/job ({w['jobs']} jobs)"
                 for w in d['cluster']['workers']),
             f"grid: lr x {', '.join(f'{f:g}' for f in d['grid']['lr_factors'])}; {d['grid']['structure']}; "
             f"{d['grid']['candidates']} candidates, best of each over {d['grid']['seeds']} seeds "
             f"(simulated up to {d['grid']['horizon_s']:.3g} s)",
             f"recorded: {rec['algorithm'] or 'unknown algorithm'} reached the target in "
             f"{_secs(rec['time_to_target_s'] or math.inf)}"]
    if rec["predicted"]:
        lines[-1] += f" (predicted {_secs(rec['predicted']['predicted_s'] or math.inf)})"
    lines += ["", f"{'#':>2}  {'algorithm':20s} {'settings':28s} {'predicted':>10s} {'spread over seeds':>19s} "
              f"{'speed-up':>8s}"]
    for i, r in enumerate(d["ranking"], 1):
        lines.append(_table_line(str(i), r))
    lines.append(_table_line("", d["synchronous"]))
    if d["skipped"]:
        lines.append("not applicable: " + "; ".join(f"{a} ({why})" for a, why in d["skipped"].items()))
    if d["not_evaluated"]:
        lines.append(f"not evaluated (--budget ran out): {len(d['not_evaluated'])} candidates")
    lines += ["", f"plot: {d['plot']}", "winner:", f"  {d['command']}"]
    return "\n".join(lines)


def _table_line(rank: str, r: dict[str, Any]) -> str:
    settings = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["settings"].items())
    spread = f"[{_secs(r['min_s'] or math.inf)}, {_secs(r['max_s'] or math.inf)}]" if r["seeds"] > 1 else "1 seed"
    speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
    return (f"{rank:>2}  {r['algorithm']:20s} {settings[:28]:28s} {_secs(r['predicted_s'] or math.inf):>10s} "
            f"{spread:>19s} {speed:>8s}")


def plot_predictions(rec: Recorded, found: Search, target: Any, path: str) -> str:
    """Predicted curves (seed 0) of each algorithm's best settings and of synchronous SGD, the
    recorded run's measured one, and the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for p in [*found.ranked, found.sync]:
        if p.curves:
            ts, vs = zip(*p.curves[0], strict=True)
            ax.plot(ts, vs, label=f"{p.candidate.algorithm} {p.candidate.label}", lw=1.2,
                    ls="--" if p is found.sync else "-")
    meas = [(e["t"], e[target.key]) for e in rec.evaluations if target.key in e]
    if meas:
        ts, vs = zip(*meas, strict=True)
        ax.plot(ts, vs, "k.", label=f"recorded ({rec.algorithm or 'measured'})")
    ax.axhline(target.value, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"predicted {target.key}")
    vals = [v for p in found.ranked for _, v in (p.curves[0] if p.curves else []) if math.isfinite(v)]
    if target.key == "loss" and vals and min(vals) > 0:
        ax.set_yscale("log")
    ax.set_title("latecomer advise: predicted curves on the recorded delays")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _what_if(trace: Any, drop_slowest: int, add: int, like: str | None, only: str | None) -> Any:
    from ps.ops import advise as A

    try:
        if only:
            trace = A.only_workers(trace, [w.strip() for w in only.split(",") if w.strip()])
        if drop_slowest:
            trace = A.drop_slowest(trace, drop_slowest)
        if add:
            if not like:
                raise ValueError("--add-workers needs --like WORKER (whose delays the new ones have)")
            trace = A.add_workers(trace, add, like)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return trace


def _names(algorithms: str | None) -> list[str]:
    import algorithms as registry

    if not algorithms:
        return sorted(registry.ALGORITHMS)
    names = [a.strip() for a in algorithms.split(",") if a.strip()]
    unknown = [a for a in names if a not in registry.ALGORITHMS]
    if unknown:
        raise click.BadParameter(f"unknown: {', '.join(unknown)} (see `latecomer algorithms`)",
                                 param_hint="--algorithms")
    return names


@click.command()
@click.argument("run_dir", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--live", metavar="tcp://HOST:PORT", default=None,
              help="Advise from a running server's status (the mean job time of each worker so far) instead.")
@click.option("--target-loss", type=float, default=None, callback=finite,
              help="Target (default: the loss the recorded run reached).")
@click.option("--target-accuracy", type=float, default=None, callback=finite)
@click.option("--oracle", type=click.Choice(["auto", "exact", "proxy"]), default="auto", show_default=True,
              help="exact: the run's own problem (its gradients); proxy: a quadratic fitted to the run's loss "
                   "curve; auto: exact if it fits the budget.")
@click.option("--algorithms", default=None, help="Comma-separated algorithms to consider (default: all that apply).")
@click.option("--seeds", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Draws of the delays (and of the samples) per prediction of the best settings.")
@click.option("--budget", type=click.FloatRange(min=1), default=120.0, show_default=True, callback=finite,
              help="Seconds advise may take; candidates not reached by then are listed as not evaluated.")
@click.option("--drop-slowest", type=click.IntRange(min=0), default=0, help="What if: without the K slowest workers.")
@click.option("--add-workers", type=click.IntRange(min=0), default=0, help="What if: N more workers (with --like).")
@click.option("--like", default=None, metavar="WORKER", help="The recorded worker whose delays new workers have.")
@click.option("--workers-only", default=None, metavar="W1,W2", help="What if: only these workers.")
@click.option("--problem-opt", multiple=True, metavar="KEY=VALUE", help="With --live: the server's problem options.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="With --live: the server's settings.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/advise", show_default=True,
              callback=output_dir, help="Write advise.png and advise.json here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (for scripts).")
@allow_options
def advise(run_dir, live, target_loss, target_accuracy, oracle, algorithms, seeds, budget, drop_slowest, add_workers,
           like, workers_only, problem_opt, settings, out, as_json, allow_problem, allow_algorithm) -> None:
    """Which algorithm, with which settings, for this cluster: each worker's job durations are
    fitted from the run's events and played back in the simulator under every algorithm that
    applies, over a small grid of settings, ranked by predicted time to the target
    (docs/ADVISE.md: how it works and when it is wrong)."""
    from ps.ops.advise import fit_trace

    start = time.monotonic()
    if (run_dir is None) == (live is None):
        raise click.UsageError("give a run directory or --live tcp://HOST:PORT (one of them)")
    try:
        if live:
            rec, trace = load_live(live, parse_pairs(problem_opt, "--problem-opt"), parse_pairs(settings, "--set"))
        else:
            rec = load_recorded(run_dir, allowed_from(allow_problem, allow_algorithm))
            trace = fit_trace(rec.events)
    except (ValueError, TimeoutError) as e:
        raise click.ClickException(str(e)) from None
    trace = _what_if(trace, drop_slowest, add_workers, like, workers_only)
    _advise(rec, trace, _target(rec, target_loss, target_accuracy), oracle, _names(algorithms), seeds,
            start + budget, out, as_json)


def _advise(rec, trace, target, oracle, names, seeds, deadline, out, as_json) -> None:
    t_rec = _recorded_time(rec, target)
    steps = int(max([e.get("version", 0) for e in rec.evaluations] or [1000]))
    horizon = HORIZON_FACTOR * (t_rec if math.isfinite(t_rec) and t_rec > 0 else max(trace.span, 1.0))
    max_updates = max(2000, 20 * steps)
    budget = max(1.0, deadline - time.monotonic())
    problem, oracle_text = _oracle(rec, oracle, budget, 3 * len(names), steps)
    total = 3 * len(names) + len(names) * (seeds - 1) + 3 + seeds
    with click.progressbar(length=total, label="advise: simulating", file=sys.stderr) as bar:
        found = search(rec, problem, trace, target, names, seeds, horizon, max_updates,
                       lambda: time.monotonic() > deadline, bar)
    if not found.ranked:
        if not found.grid_size:
            raise click.ClickException("none of the algorithms applies to this problem: " + "; ".join(
                f"{a} {why}" for a, why in found.skipped.items()))
        raise click.ClickException("no candidate could be simulated within the budget: give a larger --budget")
    os.makedirs(out, exist_ok=True)
    plot = plot_predictions(rec, found, target, os.path.join(out, "advise.png"))
    command = serve_command(rec, found.ranked[0].candidate, target)
    d = report_dict(rec, trace, target, oracle_text, found, command, plot, horizon)
    with open(os.path.join(out, "advise.json"), "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1)
    click.echo(json.dumps(d, indent=1) if as_json else render(d))
