"""``latecomer simulate`` (the server core against simulated workers) and ``latecomer replay`` (a
recorded run again from its journal, or its delay trace under another algorithm)."""

from __future__ import annotations

import json
import math
import os

import click
import numpy as np

from ps.cli.options import allow_options, allowed_from, parse_pairs, positive, training_options, training_spec
from ps.cli.paths import output_dir


@click.command()
@training_options("quadratic", "ordered-momentum")
@click.option("--workers", "-n", type=click.IntRange(1, 100000), default=10, show_default=True)
@click.option("--delays", "delay_model", default="sqrt", show_default=True,
              type=click.Choice(["sqrt", "sqrt1", "linear", "uniform", "mixture"]))
@click.option("--noise", default="sqrt", show_default=True, type=click.Choice(["sqrt", "frac", "none"]))
@click.option("--time", "max_time", type=float, default=200.0, show_default=True, callback=positive,
              help="Simulated seconds.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None)
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--crash", "crashes", multiple=True, metavar="WORKER@TIME[+REJOIN]",
              help="Crash worker index (0-based) at a simulated time, optionally rejoining after a delay.")
@click.option("--loss-prob", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Probability that a reply is lost in transit.")
@click.option("--liveness-timeout", type=float, default=10.0, show_default=True, callback=positive)
@click.option("--eval-every", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--wire-dtype", type=click.Choice(["f32", "f16", "bf16"]), default="f32", show_default=True,
              help="How iterates and gradients travel (PROTOCOL.md §6.12): simulated workers compute on the "
                   "quantized iterate and their gradients reach the server quantized.")
@click.option("--shards", type=click.IntRange(min=1), default=1, show_default=True,
              help="Shard the parameter vector over this many server shards (contiguous ranges; blocks cut only "
                   "where the algorithm's work is elementwise; one decision for all, checked; the same bits as 1).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="runs/sim", show_default=True, callback=output_dir,
              help="Write trace.csv, convergence.png, summary.json and final_x.npy here.")
def simulate(problem, problem_opt, algorithm, settings, config, workers, delay_model, noise, max_time, max_steps,
             batch_size, crashes, loss_prob, liveness_timeout, eval_every, wire_dtype, shards, seed, out) -> None:
    """Run the same server core against simulated workers (deterministic, seeded)."""
    from ps.core.config import CoreConfig
    from ps.drivers.sim import Crash, DelayModel, Simulator

    spec = training_spec(problem, problem_opt, algorithm, settings, config, default_problem="quadratic",
                         default_algorithm="ordered-momentum")
    spec.max_steps = max_steps
    problem_obj, alg = spec.build()
    crash_list = []
    for c in crashes:
        try:
            w, _, rest = c.partition("@")
            at, _, rejoin = rest.partition("+")
            crash_list.append(Crash(int(w), float(at), float(rejoin) if rejoin else None))
        except ValueError:
            raise click.BadParameter(f"expected WORKER@TIME[+REJOIN], got {c!r}", param_hint="--crash") from None
        times = (crash_list[-1].at, crash_list[-1].rejoin_after)
        if not all(t is None or (math.isfinite(t) and t >= 0) for t in times):
            raise click.BadParameter(f"TIME and REJOIN must be finite seconds >= 0, got {c!r}", param_hint="--crash")
        if not 0 <= crash_list[-1].worker < workers:
            raise click.BadParameter(f"worker index {crash_list[-1].worker} out of range", param_hint="--crash")
    cfg = CoreConfig(problem=spec.problem, problem_options=dict(problem_obj.options or {}), batch_size=batch_size,
                     liveness_timeout_s=liveness_timeout, min_workers=workers, seed=seed)
    try:
        sim = Simulator(alg, problem_obj, DelayModel.named(delay_model, workers, noise=noise), cfg, seed=seed,
                        crashes=crash_list, loss_prob=loss_prob, wire_dtype=wire_dtype, shards=shards)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--shards") from None
    from tqdm import tqdm

    bar = tqdm(total=max_time, desc=f"simulating {spec.algorithm}", unit="sim-s", dynamic_ncols=True)

    def progress(core, t):
        bar.n = min(t, max_time)
        bar.refresh() if core.version % 200 == 0 else None

    trace = sim.run(max_time=max_time, max_updates=max_steps, eval_every=eval_every, progress=progress)
    bar.n = min(trace.final_t, max_time)
    bar.close()
    title = (f"{spec.algorithm} on {spec.problem} (simulated, {workers} workers, {delay_model}"
             f"{'' if wire_dtype == 'f32' else ', wire ' + wire_dtype}{'' if shards == 1 else f', {shards} shards'})")
    plot = _write_sim_outputs(trace, out, title, {"wire_dtype": wire_dtype, "shards": shards})
    first, last = trace.points[0], trace.points[-1]
    c = trace.counters
    click.echo(f"simulated {trace.final_t:.1f} s: {c['updates']} updates, applied {c['applied']}, "
               f"dropped {c['dropped']}, lost {c['lost']}, wire dtype {wire_dtype}")
    for key in ("loss", "grad_norm_sq", "accuracy"):
        if key in first:
            click.echo(f"  {key}: {first[key]:.6g} -> {last[key]:.6g}")
    click.echo(f"  trace: {os.path.join(out, 'trace.csv')}  plot: {plot}")


def _write_sim_outputs(trace, out: str, title: str, extra: dict) -> str:
    """trace.csv, convergence.png, summary.json and final_x.npy (as ``serve --out`` writes it) in
    ``out``; returns the plot's path."""
    from ps.ops.report import plot_run, write_trace_csv

    os.makedirs(out, exist_ok=True)
    write_trace_csv(trace, os.path.join(out, "trace.csv"))
    evs = [{"ev": "applied", "age": a[3], "worker_id": a[2], "t": a[4]} for a in trace.applied]
    plot = plot_run(trace.points, evs, os.path.join(out, "convergence.png"), title=title)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"counters": trace.counters, "points": trace.points[-1:], "final_t": trace.final_t, **extra}, f,
                  indent=1)
    np.save(os.path.join(out, "final_x.npy"), np.asarray(trace.final_x))
    return plot


@click.command()
@click.argument("state_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--algorithm", "-a", default=None,
              help="Re-run the recorded delay trace under this algorithm instead (in the simulator).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Its hyper-parameters.")
@click.option("--out", type=click.Path(file_okay=False), default=None, callback=output_dir,
              help="With --algorithm: trace and plot here.")
@click.option("--shard-state", "shard_state", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A sharded run that logged its payloads: each shard's --state directory, in slot order "
                   "(default: the local shards', STATE_DIR/shard-<i>).")
@allow_options
def replay(state_dir, algorithm, settings, out, shard_state, allow_problem, allow_algorithm) -> None:
    """Re-run a recorded run exactly from its journal and check the final iterate bit for bit.

    Gradients journaled without payload are recomputed from their seeds with the problem's
    oracle (deterministic on CPU); a run served with --log-payloads replays the gradients its
    workers sent (a sharded one: its shards' blocks journals). With --algorithm, the recorded
    per-worker job durations are played back in the simulator under another algorithm, for a
    like-for-like comparison.
    A problem or algorithm of your own that run.json names is loaded only with --allow-problem/
    --allow-algorithm patterns that match it.
    """
    from ps.drivers.replay import recorded_final_x, replay_run

    allowed = allowed_from(allow_problem, allow_algorithm)
    try:
        result = replay_run(state_dir, allowed, tuple(shard_state))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    recorded = recorded_final_x(state_dir)
    if result.from_checkpoint:
        click.echo(f"the journal before LSN {result.start_lsn} was removed (serve --max-journal-bytes): replaying "
                   f"from {result.from_checkpoint}")
    click.echo(f"replayed {result.records} journal records: step {result.version}, "
               f"applied {result.counters['applied']}, lost {result.counters['lost']}, "
               f"final iterate sha256 {result.sha256[:16]}")
    if algorithm is None:
        if recorded is None:
            click.echo("no final_x.npy (the server did not stop cleanly): nothing to compare with")
            return
        same = recorded.dtype == result.final_x.dtype and np.array_equal(recorded, result.final_x)
        click.echo(f"bit-identical to the recorded final iterate: {'yes' if same else 'NO'}")
        if not same:
            diff = float(np.max(np.abs(recorded.astype(np.float64) - result.final_x)))
            raise click.ClickException(f"replay differs from the recorded iterate (max abs diff {diff:.3g})"
                                       + _why_different(state_dir))
        return
    _replay_other_algorithm(state_dir, result, algorithm, parse_pairs(settings, "--set"), out, allowed)


def _why_different(state_dir: str) -> str:
    """What a replay that differs says of a run whose gradients were recomputed."""
    from ps.journal.runfile import read_run

    run = read_run(state_dir) or {}
    logged = run.get("log_payloads") if run.get("shards") else None
    if logged:
        return ""
    return ("; gradients journaled without payload were recomputed with the problem's code from each job's seed, "
            "and a worker that computes them otherwise (a GPU, another language or sampler: PROTOCOL.md 8.12) needs "
            "serve --log-payloads for its run to replay")


def _replay_other_algorithm(state_dir, result, algorithm, settings, out, allowed) -> None:
    from ps.drivers.replay import TraceDelays, build_from_run
    from ps.drivers.sim import Simulator
    from ps.journal.runfile import read_run

    run = read_run(state_dir)
    try:
        where = os.path.join(state_dir, "run.json")
        problem, alg, cfg = build_from_run(run, algorithm=algorithm, settings=settings, allowed=allowed, where=where)
        _, base_alg, _ = build_from_run(run, allowed=allowed, where=where)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--algorithm/--set") from None
    workers = sorted(result.durations, key=lambda w: (len(w), w))
    seqs = [result.durations[w] for w in workers]
    horizon = sum(sum(s) for s in seqs) / max(1, len(seqs))
    rows = []
    import dataclasses

    cfg = dataclasses.replace(cfg, min_workers=len(workers))
    for name, a in ((run["algorithm"], base_alg), (algorithm, alg)):
        tr = Simulator(a, problem, TraceDelays(seqs), cfg).run(max_time=horizon, eval_every=50)
        rows.append((name, tr))
    click.echo(f"the recorded delay trace of {len(workers)} workers ({', '.join(workers)}), "
               f"{horizon:.1f} s per worker, played back in the simulator:")
    for name, tr in rows:
        last = tr.points[-1]
        figs = ", ".join(f"{k} {last[k]:.4g}" for k in ("loss", "accuracy", "grad_norm_sq") if k in last)
        click.echo(f"  {name:24s} steps {tr.counters['updates']:6d}  {figs}")
    if out:
        from ps.ops.report import write_trace_csv

        os.makedirs(out, exist_ok=True)
        for name, tr in rows:
            write_trace_csv(tr, os.path.join(out, f"trace-{name}.csv"))
