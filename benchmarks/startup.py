"""What the seconds before the first job are spent on: each phase of a server's and a worker's
start, timed in fresh processes, then ``latecomer run``'s time to its first step.

Phases (each the median of ``--reps`` fresh interpreters, minus the bare interpreter's start):

- ``import torch``, ``import ps.cli.main`` (the console script's module), ``import worker.runner``;
- building the ``digits`` problem with the data cache empty (scikit-learn imported, the split
  computed and cached) and with it filled (read back, no scikit-learn);
- the first evaluation of the digits problem at x0;
- ``latecomer run --steps 200``: seconds from the command's start to its first reply applied
  (the events file's first ``applied`` event, on the same monotonic clock) and to its end.

    python -m benchmarks.startup [--reps 3]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import click

PHASES = {
    "bare interpreter": "pass",
    "import torch": "import torch",
    "import ps.cli.main": "import ps.cli.main",
    "import worker.runner": "import worker.runner",
    "digits, cache empty": "from problems import load_problem; load_problem('digits', {})",
    "digits, cache filled": "from problems import load_problem; load_problem('digits', {})",
    "digits + first evaluation": "from problems import load_problem; p = load_problem('digits', {}); "
                                 "p.evaluate(p.init_params(0))",
}


def _time(code: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def phases(reps: int) -> dict[str, float]:
    """Median seconds of each phase, the bare interpreter's start subtracted from the others."""
    out: dict[str, float] = {}
    for name, code in PHASES.items():
        times = []
        for _ in range(reps):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "LATECOMER_CACHE": cache}
                if name == "digits, cache filled" or name == "digits + first evaluation":
                    _time(PHASES["digits, cache empty"], env)  # fills it
                times.append(_time(code, env))
        out[name] = statistics.median(times)
    bare = out["bare interpreter"]
    return {k: (v if k == "bare interpreter" else v - bare) for k, v in out.items()}


def first_step(steps: int = 200) -> dict[str, float]:
    """``latecomer run``: seconds to the first reply applied and to the end."""
    with tempfile.TemporaryDirectory() as out:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "ps", "run", "--steps", str(steps), "--no-progress", "--out", out],
                       check=True, timeout=600, stdout=subprocess.DEVNULL)
        end = time.monotonic()
        with open(os.path.join(out, "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
    first = min(e["t"] for e in events if e["ev"] == "applied")
    return {"run: first reply applied": first - t0, "run: whole run": end - t0}


@click.command()
@click.option("--reps", type=click.IntRange(1, 20), default=3, show_default=True)
def main(reps: int) -> None:
    rows = {**phases(reps), **first_step()}
    click.echo(f"{'phase':<30} {'seconds':>8}")
    for k, v in rows.items():
        click.echo(f"{k:<30} {v:8.2f}")


if __name__ == "__main__":
    main()
