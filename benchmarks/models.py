"""``latecomer bench --models``: real models through latecomer against plain PyTorch and DDP.

For each model of benchmarks/model_zoo.py (a ResNet-18 for 32x32 images, a GPT-2-like
character LM with tied embedding and head, a 60-block wide MLP):

1. **Gradient time**: a worker's ``TorchProblem.grad`` against a plain forward+backward on the
   same batch, in one fresh process, at full size and at the run size (benchmarks/model_runs.py
   ``grad_time``), beside the floor of two copies of d floats.
2. **Training runs** at the run size (``small`` by default), each for ``--seconds`` from its
   first step (or, after the plain run, until 5 times the steps the plain loop needed to reach
   the target), by these systems, on this machine's cores split evenly between processes:

   ======================  ==========================================================
   ``plain``               one process, a plain SGD loop, all cores
   ``ddp-1``               DistributedDataParallel (gloo), 1 process
   ``latecomer-1``         ``latecomer serve`` + 1 ``latecomer work`` (asgd)
   ``ddp-2``               DDP, 2 processes, half the cores each
   ``latecomer-2``         serve + 2 workers, half the cores each
   ``ddp-2-slow``          DDP, 2 processes, the second 3x slower (sleeps 2x its compute per step)
   ``latecomer-2-slow``    serve + 2 workers, the second with ``--slowdown 3``
   ======================  ==========================================================

   Steps/s (one step = one SGD step on a batch of ``spec.batch`` items; a DDP step is one
   step over all ranks, each computing its share of the batch), and the time to the target
   (accuracy, or validation loss for the LM) from the snapshots scored afterwards with one
   ``TorchProblem.evaluate``; the seconds a system's training waited for its snapshots are left
   out of its clock (none for a latecomer server that evaluates off its loop).

Then the ratios the issue's targets are about, each printed with whether its target is met
(reported here only, never asserted in tests): gradient <= 1.15x plain forward+backward;
latecomer-2 steps/s >= 1.0x ddp-2's; latecomer-2-slow time to target <= 0.7x ddp-2-slow's.

Writes benchmarks/RESULTS-models.md, a JSON beside it and docs/img/bench-models.png (a full
default run, about 11 minutes on 2 cores; ``--quick``, 5 s runs of the systems of the three targets,
about 3.5, and partial runs write RESULTS-models-quick.md / -partial.md).

    python -m benchmarks.models [--quick] [--model resnet18,gpt2,mlp] [--seconds 30] [--model-size small]
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
import time

import click

from benchmarks.model_runs import Run, grad_time_fresh, run_latecomer, run_torch, score
from ps.cli.paths import output_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("plain", "ddp-1", "latecomer-1", "ddp-2", "latecomer-2", "ddp-2-slow", "latecomer-2-slow")
QUICK_SYSTEMS = ("plain", "ddp-2", "latecomer-2", "ddp-2-slow", "latecomer-2-slow")  # the three targets' runs
SLOWDOWN = 3.0
SECONDS, QUICK_SECONDS = 30.0, 5.0
GRAD_REPS, QUICK_GRAD_REPS = 7, 3
CAP_FACTOR = 5  # after the plain run, runs stop at this many times its steps to the target
GRAD_TARGET, STEPS_TARGET, TTA_TARGET = 1.15, 1.0, 0.7


def parse_system(name: str) -> tuple[str, int, float]:
    """``"ddp-2-slow"`` -> ("ddp", 2, 3.0); ``"plain"`` -> ("plain", 1, 1.0)."""
    if name == "plain":
        return "plain", 1, 1.0
    parts = name.split("-")
    if len(parts) not in (2, 3) or parts[0] not in ("ddp", "latecomer") or not parts[1].isdigit() \
            or int(parts[1]) < 1 or (len(parts) == 3 and (parts[2] != "slow" or int(parts[1]) < 2)):
        raise ValueError(f"unknown system {name!r}: plain, ddp-N, latecomer-N, ddp-N-slow, latecomer-N-slow")
    return parts[0], int(parts[1]), SLOWDOWN if len(parts) == 3 else 1.0


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + (" (with uncommitted changes)" if dirty else "")) if head else "unknown"


def machine_line() -> str:
    try:
        from benchmarks.common import machine

        return machine()
    except Exception:  # noqa: BLE001 - the figures matter more than the description
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"


class CpuSteal:
    """The share of this machine's CPU time stolen by its hypervisor since construction (``/proc/stat``;
    nan where there is none): another tenant's load that the load average does not show."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> list[int] | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                return [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None

    def share(self) -> float:
        end = self._read()
        if self.start is None or end is None or len(end) < 8:
            return math.nan
        d = [b - a for a, b in zip(self.start, end, strict=True)]
        return d[7] / sum(d) if sum(d) > 0 else math.nan


def _fmt(v, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if v is None or not isinstance(v, (int, float)) or not math.isfinite(v) else format(v * scale, fmt)


def run_line(r: Run, spec) -> str:
    if r.skipped:
        return f"{r.model:8s} {r.name:17s} n/a ({r.skipped})"
    cmp = ">=" if spec.higher_is_better else "<="
    tta = f"{r.tta_s:6.2f} s (step {r.tta_step})" if math.isfinite(r.tta_s) else "not reached"
    return (f"{r.model:8s} {r.name:17s} {r.steps:6d} steps {r.steps_per_s:8.1f} steps/s  "
            f"{spec.metric} {cmp} {spec.target:g}: {tta:22s} final {_fmt(r.final, '.3f')}  [{r.wall_s:.0f} s]")


def grad_line(g: dict) -> str:
    return (f"{g['model']:8s} gradient ({g['size']}, {g['params']:,} params, {g['blocks']} blocks, "
            f"batch {g['batch']}): "
            f"plain fwd+bwd {g['plain_s'] * 1e3:8.1f} ms, TorchProblem.grad {g['grad_s'] * 1e3:8.1f} ms, "
            f"ratio {g['ratio']:.2f} (copies of d floats {g['copies_s'] * 1e3:.1f} ms: floor {g['floor_ratio']:.2f})")


def run_models(models: list[str], size: str, grad_size: str, seconds: float, grad_reps: int, cores: int,
               systems: list[str], echo=print, json_out: str | None = None) -> dict:
    """Everything the report needs (JSON-able); ``json_out`` is rewritten after each model."""
    import torch

    from benchmarks import model_zoo as zoo

    data = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit(),
            "cores": cores, "seconds": seconds, "size": size, "grad_size": grad_size, "grad_reps": grad_reps,
            "slowdown": SLOWDOWN, "systems": systems, "load_start": os.getloadavg()[0],
            "specs": {m: zoo.spec_of(m, size).__dict__ for m in models}, "grad": [], "runs": []}
    t0 = time.monotonic()
    for model in models:
        spec = zoo.spec_of(model, size)
        for gs in dict.fromkeys((grad_size, size)):  # full size for the target; the run size for the profile
            g = grad_time_fresh(model, gs, grad_reps, max(1, cores // 2))  # threads: a 2-worker run's worker's
            echo(grad_line(g))
            data["grad"].append(g)
        torch.set_num_threads(1)  # scoring is not timed: one thread, the least disturbed by other load
        problem = zoo.make_problem(model, size)
        cap = 10**9
        for name in systems:
            kind, procs, slow = parse_system(name)
            steal = CpuSteal()
            with tempfile.TemporaryDirectory(prefix="latecomer-models-") as tmp:
                t = time.monotonic()
                if kind == "latecomer":
                    r = run_latecomer(model, size, procs, seconds, cap, slow, cores, tmp)
                else:
                    r = run_torch(model, size, 0 if kind == "plain" else procs, seconds, cap, slow, cores, tmp)
                t_score = time.monotonic()
                if not r.skipped:
                    score(r, problem, spec)
                r.wall_s = time.monotonic() - t
            r.profile["score_s"] = time.monotonic() - t_score
            r.profile["load"] = os.getloadavg()[0]
            r.profile["steal"] = steal.share()
            if name == "plain" and r.tta_step > 0:
                cap = max(CAP_FACTOR * r.tta_step, 4 * spec.snap_every)
            echo(run_line(r, spec))
            data["runs"].append(r.as_dict())
        data["elapsed_s"] = time.monotonic() - t0
        if json_out:
            with open(json_out, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
    data["load_end"] = os.getloadavg()[0]
    data["elapsed_s"] = time.monotonic() - t0
    data["ratios"] = ratios(data)
    return data


# --------------------------------------------------------------------------- ratios


def _ratio_row(model: str, what: str, a: float, b: float, target: str = "", met: bool | None = None,
               note: str = "") -> dict:
    v = a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan
    return {"model": model, "what": what, "value": v, "target": target, "met": met, "note": note}


def _met(v: float, op: str, bound: float) -> bool | None:
    if not math.isfinite(v):
        return None
    return v <= bound if op == "<=" else v >= bound


def ratios(data: dict) -> list[dict]:
    """The ratios per model, those with a target marked met or not (None: not measurable). A pair
    with a system that was not run has no row; one whose run was skipped has a n/a row. Where one of
    the two never reached the target, the time ratio is a bound (``bound``: "upper" or "lower")."""
    out = []
    planned = {(r["model"], r["name"]) for r in data["runs"]}
    runs = {(r["model"], r["name"]): r for r in data["runs"] if not r["skipped"]}
    for model in data["specs"]:
        for g in data["grad"]:
            if g["model"] == model and g["size"] == data["grad_size"]:
                row = _ratio_row(model, f"gradient time ({g['size']}): TorchProblem.grad / plain forward+backward",
                                 g["grad_s"], g["plain_s"], f"<= {GRAD_TARGET:g}")
                row["met"] = _met(row["value"], "<=", GRAD_TARGET)
                out.append(row)

        def get(name: str, field: str, model: str = model) -> float:
            r = runs.get((model, name))
            return float(r[field]) if r is not None else math.nan

        for a, b in (("latecomer-1", "plain"), ("latecomer-1", "ddp-1"), ("latecomer-2", "ddp-2"),
                     ("latecomer-2-slow", "ddp-2-slow")):
            if (model, a) not in planned or (model, b) not in planned:
                continue
            row = _ratio_row(model, f"steps/s: {a} / {b}", get(a, "steps_per_s"), get(b, "steps_per_s"))
            if (a, b) == ("latecomer-2", "ddp-2"):
                row["target"], row["met"] = f">= {STEPS_TARGET:g}", _met(row["value"], ">=", STEPS_TARGET)
            out.append(row)
        for a, b in (("latecomer-1", "plain"), ("latecomer-2", "ddp-2"), ("latecomer-2-slow", "ddp-2-slow")):
            if (model, a) not in planned or (model, b) not in planned:
                continue
            out.append(_tta_row(model, a, b, runs.get((model, a)), runs.get((model, b)),
                                TTA_TARGET if (a, b) == ("latecomer-2-slow", "ddp-2-slow") else None))
    return out


def _tta_row(model: str, a: str, b: str, ra: dict | None, rb: dict | None, target: float | None) -> dict:
    ta = ra["tta_s"] if ra else math.nan
    tb = rb["tta_s"] if rb else math.nan
    row = _ratio_row(model, f"time to target: {a} / {b}", ta, tb)
    row["bound"] = ""
    if ra and rb and math.isfinite(ta) != math.isfinite(tb):
        if math.isfinite(ta) and rb["train_s"] > 0:  # b's time is more than its whole run
            row["value"], row["bound"] = ta / rb["train_s"], "upper"
            row["note"] = f"{b} did not reach the target in its {rb['train_s']:.1f} s: an upper bound"
        elif math.isfinite(tb) and tb > 0:
            row["value"], row["bound"] = ra["train_s"] / tb, "lower"
            row["note"] = (f"{a} did not reach the target in its {ra['train_s']:.1f} s ({ra['steps']} steps): "
                           "a lower bound")
    if target is not None:
        row["target"] = f"<= {target:g}"
        if row["bound"] == "upper":
            row["met"] = True if row["value"] <= target else None  # below a bound above the target: unknown
        elif row["bound"] == "lower":
            row["met"] = False  # latecomer did not get there in its run
        else:
            row["met"] = _met(row["value"], "<=", target)
    return row


def _value(row: dict) -> str:
    return {"upper": "< ", "lower": "> "}.get(row.get("bound", ""), "") + _fmt(row["value"], ".2f")


def _verdict(row: dict) -> str:
    if not row["target"]:
        return ""
    return {True: "met", False: "not met", None: "n/a"}[row["met"]]


def ratio_lines(rows: list[dict]) -> list[str]:
    return [f"{r['model']:8s} {r['what']:64s} {_value(r):>6s}  "
            + (f"target {r['target']}: {_verdict(r)}" if r["target"] else "")
            + (f"  ({r['note']})" if r["note"] else "")
            for r in rows]


# --------------------------------------------------------------------------- report


def markdown(data: dict, plot_path: str | None = None) -> str:
    specs = data["specs"]
    lines = [f"# latecomer bench --models ({data['date']})", "",
             f"Machine: {data['machine']}. Commit {data['commit']}. Load average {data['load_start']:.2f} at the "
             f"start, {_fmt(data.get('load_end'), '.2f')} at the end; whole run "
             f"{data.get('elapsed_s', 0) / 60:.1f} min. "
             f"Produced by `latecomer bench --models` (benchmarks/models.py); a shared, noisy machine: read the "
             "ratios, not the absolute figures.", "",
             "## Gradient time", "",
             "A latecomer worker's gradient (`TorchProblem.grad(x, seed, batch)`: parameters from the flat vector, the "
             "seeded batch, forward, backward, the flat gradient) against a plain `loss_fn(model(inputs), target)"
             ".backward()` on the same batch, in one fresh process (as a worker's) with the same threads (those of one "
             "worker of the 2-worker runs), interleaved; median of "
             f"{data['grad_reps']} repetitions after 2 of warm-up. Target: <= {GRAD_TARGET:g} at full size. *Copies*: "
             "what the issue counts as the least a worker adds, two copies of d floats (x into the parameters, the "
             "gradients out as one flat vector: `copy_` per block and one `torch.cat`), timed alike in the same "
             "process; *floor* = (plain + copies) / plain.", "",
             "| model | size | parameters | blocks | batch | threads | plain fwd+bwd ms | TorchProblem.grad ms | ratio "
             "| target | copies ms | floor |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in data["grad"]:
        target = ""
        if g["size"] == data["grad_size"]:
            target = "met" if g["ratio"] <= GRAD_TARGET else "not met"
        lines.append(f"| {g['model']} | {g['size']} | {g['params']:,} | {g['blocks']} | {g['batch']} | "
                     f"{g['threads']} | {g['plain_s'] * 1e3:.1f} | {g['grad_s'] * 1e3:.1f} | {g['ratio']:.2f} | "
                     f"{target} | {_fmt(g.get('copies_s'), '.1f', 1e3)} | {_fmt(g.get('floor_ratio'), '.2f')} |")
    lines += ["", "## Training runs", "",
              f"Size `{data['size']}` (benchmarks/model_zoo.py). Each run: {data['seconds']:g} s from its first step, "
              f"or, after the plain run, until {CAP_FACTOR}x the steps the plain loop took to the target. One step = "
              "one SGD step on the model's batch (a DDP step: all ranks, each on its share of the batch; a latecomer "
              "step: one applied reply of one worker's job on a whole batch; the same lr for all). Threads: "
              f"{data['cores']} cores split evenly over the processes (`torch.set_num_threads`, `latecomer work "
              "--threads`); the latecomer server process comes on top. Slowed: the last DDP rank sleeps "
              f"{SLOWDOWN - 1:g}x its measured forward+backward (all-reduce included) per step; the last latecomer "
              f"worker has `--slowdown {SLOWDOWN:g}`. Time to target: wall clock from the first step to the first "
              "snapshot (every model's `snap_every` steps) whose score reaches the target; snapshots are scored "
              "after the run by the same `TorchProblem.evaluate` (BatchNorm statistics re-estimated at the point) for "
              "every system, and the seconds each system spent saving them are left out of its clock (evaluation "
              "time excluded for all). Steps/s = steps / (last step's time - first step's, saving left out).", ""]
    for model, spec in specs.items():
        cmp = ">=" if spec["metric"] != "loss" else "<="
        lines.append(f"- `{model}`: batch {spec['batch']}, lr {spec['lr']:g}, target {spec['metric']} {cmp} "
                     f"{spec['target']:g}, a snapshot every {spec['snap_every']} steps.")
    lines += ["", "| model | system | processes | threads each | steps | train s | steps/s | time to target s "
              "| at step | final | start-up s | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        if r["skipped"]:
            lines.append(f"| {r['model']} | {r['name']} | {r['procs']} | | | | n/a | n/a | | | | skipped: "
                         f"{r['skipped']} |")
            continue
        tta = _fmt(r["tta_s"], ".2f") if math.isfinite(r["tta_s"]) else "not reached"
        lines.append(f"| {r['model']} | {r['name']} | {r['procs']} | {r['profile'].get('threads', '')} | "
                     f"{r['steps']} | "
                     f"{_fmt(r['train_s'], '.1f')} | {_fmt(r['steps_per_s'], '.1f')} | {tta} | "
                     f"{r['tta_step'] if r['tta_step'] >= 0 else ''} | {_fmt(r['final'], '.3f')} | "
                     f"{_fmt(r['profile'].get('start_s'), '.1f')} | {_fmt(r['profile'].get('load'), '.1f')} |")
    lines += ["", "## Ratios and targets", "", "| model | ratio | value | target | verdict | note |",
              "|---|---|---|---|---|---|"]
    for r in data.get("ratios", []):
        lines.append(f"| {r['model']} | {r['what']} | {_value(r)} | {r['target']} | {_verdict(r)} | "
                     f"{r['note']} |")
    lines += ["", "## Notes", ""] + _notes(data)
    lines += ["", "## Where a latecomer worker's time goes", "",
              "Per latecomer run and worker: jobs done, the worker's mean compute per job (as it reports it: the "
              "gradient, and the injected slowdown), wall seconds per job (run time / jobs) and the rest (wall - "
              "compute: waiting for the next job, transport, the server's step); the server's CPU per update "
              "(user + system of the serve process tree over the run / updates); the ages of the applied replies "
              "(steps between the iterate a gradient was computed at and the one it was applied to).", "",
              "| model | system | worker | jobs | compute ms/job | wall ms/job | rest ms/job | server CPU ms/update "
              "| mean age (max) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        if r["system"] != "latecomer" or r["skipped"]:
            continue
        cpu = _fmt(r["profile"].get("server_cpu_s_per_update"), ".2f", 1e3)
        for w in sorted(r["profile"].get("workers", []), key=lambda w: str(w["id"])):
            jobs = w.get("jobs") or 0
            wall = r["train_s"] / jobs if jobs else math.nan
            comp = w.get("mean_job_s") or math.nan
            lines.append(f"| {r['model']} | {r['name']} | {w['id']} | {jobs} | {_fmt(comp, '.1f', 1e3)} | "
                         f"{_fmt(wall, '.1f', 1e3)} | {_fmt(wall - comp, '.1f', 1e3)} | {cpu} | "
                         f"{_fmt(r['profile'].get('age_mean'), '.2f')} ({r['profile'].get('age_max', '')}) |")
    if plot_path:
        rel = os.path.relpath(plot_path, os.path.join(REPO, "benchmarks"))
        lines += ["", f"![accuracy against wall time, and the ratios]({rel})"]
    return "\n".join(lines) + "\n"


def _notes(data: dict) -> list[str]:
    """What the tables do not say by themselves (sizes, steps against time, threads)."""
    sizes = {g["model"]: g for g in data["grad"] if g["size"] == data["size"]}
    full = {g["model"]: g for g in data["grad"] if g["size"] == data["grad_size"]}
    out = []
    if data["size"] != data["grad_size"] and sizes:
        desc = "; ".join(f"`{m}` {g['params']:,} parameters in {g['blocks']} blocks"
                         + (f" (full: {full[m]['params']:,} in {full[m]['blocks']})" if m in full else "")
                         for m, g in sizes.items())
        r = full.get("resnet18")
        why = (f" (a full ResNet-18 step on a batch of {r['batch']} takes {r['plain_s']:.2f} s of plain "
               f"forward+backward on {r['threads']} thread{'s' if r['threads'] > 1 else ''})") if r else ""
        out.append(f"- The training runs use the `{data['size']}` variants ({desc}): the full models cannot train to a "
                   f"target in tens of seconds on this machine{why}. The gradient table has both sizes; the gradient "
                   "target is about the full ones.")
    out += ["- Time to target is steps to target times seconds per step. An asynchronous step applies a gradient "
            "computed at an older iterate (the age of a reply: about 1 with two workers, more from the slowed one), so "
            "latecomer may need more steps than the synchronous systems at the same learning rate: the *at step* "
            "column says how many each needed (one snapshot's resolution).",
            "- A DDP step waits for its slowest rank; a latecomer step waits for nobody. With one process 3x slower, "
            "DDP runs at about a third of its speed and latecomer at about two thirds of its own (the fast worker "
            "alone, and a third of the slow one)."]
    one = []
    for r in data["runs"]:
        if r["name"] == "latecomer-1" and not r["skipped"] and r["profile"].get("workers") and r["model"] in sizes:
            w = r["profile"]["workers"][0]
            one.append(f"{r['model']} {_fmt(w.get('mean_job_s'), '.1f', 1e3)} ms against "
                       f"{sizes[r['model']]['grad_s'] * 1e3:.1f} ms")
    if one:
        t1 = sizes[next(iter(sizes))]["threads"]
        out.append(f"- `latecomer-1`'s worker runs {data['cores']} thread{'s' if data['cores'] > 1 else ''} beside the "
                   f"server process and its own I/O thread on {data['cores']} core{'s' if data['cores'] > 1 else ''}; "
                   "its compute per job (the profile below) against `TorchProblem.grad` at the run size on "
                   f"{t1} thread{'s' if t1 > 1 else ''} (the gradient table): " + "; ".join(one) + ". The plain loop "
                   "and `ddp-1` have the cores to themselves.")
    return out


# --------------------------------------------------------------------------- plot

STYLE = {"plain": ("black", "-"), "ddp-1": ("tab:orange", ":"), "latecomer-1": ("tab:blue", ":"),
         "ddp-2": ("tab:orange", "--"), "latecomer-2": ("tab:blue", "--"), "ddp-2-slow": ("tab:red", "-"),
         "latecomer-2-slow": ("tab:green", "-")}


def plot(data: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(data["specs"])
    fig, axes = plt.subplots(2, max(3, len(models)), figsize=(5 * max(3, len(models)), 8.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        spec = data["specs"][model]
        for r in data["runs"]:
            if r["model"] == model and not r["skipped"] and r["curve"]:
                c, ls = STYLE.get(r["name"], ("gray", "-"))
                ts, _, vs = zip(*r["curve"], strict=True)
                ax.plot(ts, vs, color=c, linestyle=ls, marker=".", markersize=3, label=r["name"])
        ax.axhline(spec["target"], color="gray", linewidth=0.8)
        ax.set_title(f"{model} ({data['size']})")
        ax.set_xlabel("wall seconds from the first step (saving excluded)")
        ax.set_ylabel(f"test {spec['metric']}" if spec["metric"] != "loss" else "validation loss (nats/char)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    kinds = [("gradient time", "gradient: TorchProblem.grad / plain fwd+bwd", GRAD_TARGET),
             ("steps/s: latecomer-2 / ddp-2", "steps/s: latecomer-2 / ddp-2 (homogeneous)", STEPS_TARGET),
             ("time to target: latecomer-2-slow / ddp-2-slow", "time to target: latecomer-2-slow / ddp-2-slow",
              TTA_TARGET)]
    for ax, (prefix, title, target) in zip(axes[1], kinds, strict=False):
        vals, labels = [], []
        for model in models:
            got = [r for r in data.get("ratios", []) if r["model"] == model and r["what"].startswith(prefix)]
            ok = bool(got) and math.isfinite(got[0]["value"])
            vals.append(got[0]["value"] if ok else 0.0)
            labels.append(_value(got[0]) if ok else "n/a")
        bars = ax.bar(models, vals, color="tab:blue")
        for b, v, label in zip(bars, vals, labels, strict=True):
            ax.annotate(label, (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.axhline(target, color="tab:red", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_title(title, fontsize=9)
        if prefix == "gradient time" and max(vals, default=0) > 5:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in [*axes[0][len(models):], *axes[1][len(kinds):]]:
        ax.set_visible(False)
    fig.suptitle(f"latecomer bench --models ({data['date']}, commit {data['commit'].split()[0]}): "
                 + data["machine"].split(";")[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- command


def default_paths(default: bool, quick: bool) -> tuple[str, str]:
    name = "RESULTS-models.md" if default else "RESULTS-models-quick.md" if quick else "RESULTS-models-partial.md"
    return os.path.join(REPO, "benchmarks", name), os.path.join(REPO, "docs", "img", "bench-models.png")


def main(models: str, size: str, grad_size: str, seconds: float | None, grad_reps: int | None, quick: bool,
         cores: int | None, systems: str | None, out: str | None, json_out: str | None, plot_out: str | None,
         echo=print) -> dict:
    """What ``latecomer bench --models`` and ``python -m benchmarks.models`` run."""
    from benchmarks import model_zoo as zoo

    ms = [m.strip() for m in models.split(",") if m.strip()]
    bad = [m for m in ms if m not in zoo.MODELS]
    if bad or not ms:
        raise click.BadParameter(f"unknown model(s) {bad}; choose from {', '.join(zoo.MODELS)}", param_hint="--model")
    if systems is None:
        systems = ",".join(QUICK_SYSTEMS if quick else SYSTEMS)
    sl = [s.strip() for s in systems.split(",") if s.strip()]
    for s in sl:
        try:
            parse_system(s)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--systems") from None
    seconds = seconds if seconds is not None else (QUICK_SECONDS if quick else SECONDS)
    grad_reps = grad_reps if grad_reps is not None else (QUICK_GRAD_REPS if quick else GRAD_REPS)
    if seconds <= 0 or grad_reps < 1:
        raise click.BadParameter("--seconds and --grad-reps must be positive")
    cores = cores or os.cpu_count() or 1
    default = (not quick and ms == list(zoo.MODELS) and size == "small" and grad_size == "full"
               and seconds == SECONDS and grad_reps == GRAD_REPS and sl == list(SYSTEMS))
    d_out, d_plot = default_paths(default, quick)
    out = out or d_out
    json_out = json_out or os.path.splitext(out)[0] + ".json"
    plot_out = plot_out or (d_plot if default else None)
    echo(f"machine: {machine_line()}")
    echo(f"plan: models {', '.join(ms)} ({size}; gradients at {grad_size}), systems {', '.join(sl)}, "
         f"{seconds:g} s per run, {cores} cores")
    data = run_models(ms, size, grad_size, seconds, grad_reps, cores, sl, echo=echo, json_out=json_out)
    with open(json_out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    if plot_out:
        plot(data, plot_out)
        echo(f"wrote {plot_out}")
    with open(out, "w", encoding="utf-8") as f:
        f.write(markdown(data, plot_out))
    echo("")
    for line in ratio_lines(data["ratios"]):
        echo(line)
    echo(f"wrote {out} and {json_out} ({data['elapsed_s'] / 60:.1f} min)")
    return data


def model_options(f):
    """The options of the model benchmark (also on ``latecomer bench``, next to ``--models``)."""
    opts = [
        click.option("--model", "model_names", default="resnet18,gpt2,mlp", show_default=True,
                     help="With --models: comma-separated models (resnet18, gpt2, mlp)."),
        click.option("--model-size", type=click.Choice(["small", "tiny"]), default="small", show_default=True,
                     help="With --models: model size of the training runs (tiny: what the test suite runs)."),
        click.option("--grad-size", type=click.Choice(["full", "small", "tiny"]), default="full", show_default=True,
                     help="With --models: model size of the gradient-time comparison."),
        click.option("--grad-reps", type=click.IntRange(min=1), default=None,
                     help=f"With --models: timed repetitions per gradient (default {GRAD_REPS}; --quick "
                          f"{QUICK_GRAD_REPS})."),
        click.option("--systems", default=None,
                     help=f"With --models: comma-separated systems to run (default {','.join(SYSTEMS)}; --quick "
                          f"{','.join(QUICK_SYSTEMS)})."),
        click.option("--cores", type=click.IntRange(min=1), default=None,
                     help="With --models: cores split between a run's processes (default: this machine's)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@click.command("models")
@click.option("--quick", is_flag=True, help=f"{QUICK_SECONDS:g} s per run, {QUICK_GRAD_REPS} gradient repetitions, "
                                           f"the systems of the three targets only.")
@click.option("--seconds", type=float, default=None, help=f"Seconds per run (default {SECONDS:g}).")
@model_options
@click.option("--out", default=None, callback=output_file,
              help="Markdown report (default benchmarks/RESULTS-models.md for the full run).")
@click.option("--json", "json_out", default=None, callback=output_file, help="JSON (default: beside --out).")
@click.option("--plot", "plot_out", default=None, callback=output_file,
              help="PNG (default for the full run: docs/img/bench-models.png).")
def cli(quick, seconds, model_names, model_size, grad_size, grad_reps, systems, cores, out, json_out,
        plot_out) -> None:
    """Real models: latecomer against a plain loop and DDP (see benchmarks/models.py)."""
    main(model_names, model_size, grad_size, seconds, grad_reps, quick, cores, systems, out, json_out, plot_out,
         echo=click.echo)


if __name__ == "__main__":
    cli()
