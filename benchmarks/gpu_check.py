"""`make gpu-check`: the GPU paths run for real, for a machine with a CUDA device (under 5 minutes).

Three checks on a user's own TorchProblem (examples/own_model/mymodel.py: an MLP with BatchNorm
and Dropout on scikit-learn's digits, served as ``mymodel:make`` and allowed on the workers):

1. **Mixed workers.** A real ``latecomer serve --log-payloads`` with two CUDA workers
   (``--device cuda``) next to two CPU workers: every worker's replies are applied, nothing is
   lost, the run reaches its steps and its accuracy.
2. **Exact replay.** ``latecomer replay`` of that state directory: the CUDA workers' gradients
   cannot be recomputed bit for bit by the CPU oracle, so replay reads them from the journal
   (``--log-payloads``) and must end at the recorded final iterate, bit for bit.
3. **Same-host and TCP paths.** Updates per second with one CUDA worker through the same-host
   path (``--shm auto``: iterates and gradients through /dev/shm) and through TCP (``--shm off``),
   beside the same two rows with one CPU worker, measured in the same run.

Results go to benchmarks/RESULTS-gpu.md (``--out``). Without CUDA it prints one line and exits 2;
``--device cpu`` runs the same plan on CPU workers only (what the test suite runs, to keep the
script working on machines without a GPU). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common import reap_popen

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "examples", "own_model")
PROBLEM = "mymodel:make"
START_TIMEOUT_S = 120.0


def _env() -> dict[str, str]:
    path = os.pathsep.join([MODEL_DIR, REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


def _start(args: list[str], log: str) -> subprocess.Popen:
    out = open(log, "wb")  # noqa: SIM115 - the child owns it; closed by _reap
    p = subprocess.Popen([sys.executable, "-m", "ps", *args], cwd=REPO, env=_env(), stdin=subprocess.DEVNULL,
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    p.log_file = out  # type: ignore[attr-defined]
    return p


def _reap(procs: list[subprocess.Popen]) -> None:
    """Every child stopped and waited for (benchmarks.common.reap_popen), then its log closed."""
    reap_popen(procs, grace=10.0)
    for p in procs:
        p.log_file.close()  # type: ignore[attr-defined]


def _endpoint(log: str, server: subprocess.Popen) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with open(log, encoding="utf-8", errors="replace") as f:
            m = re.search(r"listening on (tcp://\S+)", f.read())
        if m:
            return m.group(1)
        if server.poll() is not None:
            break
        time.sleep(0.1)
    with open(log, encoding="utf-8", errors="replace") as f:
        tail = f.read()[-2000:]
    raise RuntimeError(f"the server did not start within {START_TIMEOUT_S:.0f} s:\n{tail}")


def _events(path: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                out.append(json.loads(line))
    return out


def _serve(state: str, shm: str, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    os.makedirs(state, exist_ok=True)
    log = os.path.join(state, "..", os.path.basename(state) + "-serve.log")
    server = _start(["serve", "--bind", "tcp://127.0.0.1:0", "--problem", PROBLEM, "--algorithm", "asgd",
                     "--set", "lr=0.05", "--state", state, "--shm", shm, "--no-progress", *extra], log)
    return server, _endpoint(log, server), log


def _worker(endpoint: str, wid: str, device: str, shm: str, log: str) -> subprocess.Popen:
    return _start(["work", "--server", endpoint, "--worker-id", wid, "--device", device, "--shm", shm,
                   "--allow-problem", PROBLEM], log)


def mixed(tmp: str, device: str, steps: int, timeout: float) -> dict:
    """Check 1 and 2: two ``device`` workers beside two CPU workers, then an exact replay."""
    state = os.path.join(tmp, "mixed")
    server, endpoint, _ = _serve(state, "auto", ["--max-steps", str(steps), "--log-payloads", "--min-workers", "4",
                                                 "--eval-every", str(max(1, steps // 4)), "--out", state])
    devices = {"gpu-0": device, "gpu-1": device, "cpu-0": "cpu", "cpu-1": "cpu"}
    procs = [server] + [_worker(endpoint, w, d, "auto", os.path.join(tmp, f"{w}.log")) for w, d in devices.items()]
    t0 = time.monotonic()
    try:
        rc = server.wait(timeout=timeout)
        wall = time.monotonic() - t0
        worker_rc = {w: p.wait(timeout=60) for w, p in zip(devices, procs[1:], strict=True)}
    finally:
        _reap(procs)
    ev = _events(os.path.join(state, "events.jsonl"))
    with open(os.path.join(state, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    applied = {w: sum(e["ev"] == "applied" and e.get("worker_id") == w for e in ev) for w in devices}
    joined = {e["worker_id"]: e.get("device", "") for e in ev if e["ev"] == "joined"}
    lost = sum(e["ev"] == "lost" for e in ev)
    evals = summary.get("evaluations") or []
    accuracy = round(evals[-1]["accuracy"], 4) if evals and "accuracy" in evals[-1] else None
    r = subprocess.run([sys.executable, "-m", "ps", "replay", state, "--allow-problem", PROBLEM], cwd=REPO,
                       env=_env(), capture_output=True, text=True, timeout=timeout)
    exact = r.returncode == 0 and "bit-identical to the recorded final iterate: yes" in r.stdout
    checks = {
        "server exited 0": rc == 0,
        "every worker exited 0": all(v == 0 for v in worker_rc.values()),
        f"steps reached ({steps})": summary.get("version", 0) >= steps,
        "every worker's replies applied": all(v > 0 for v in applied.values()),
        f"the {device} workers joined on {device}": all(joined.get(w, "").startswith(device.split(":")[0])
                                                        for w in ("gpu-0", "gpu-1")),
        "lost 0": lost == 0,
        "replay bit-identical (journaled gradients)": exact,
    }
    return {"wall_s": wall, "applied": applied, "joined": joined, "lost": lost, "accuracy": accuracy,
            "replay": (r.stdout + r.stderr).strip().splitlines()[-2:], "checks": checks}


def path_rate(tmp: str, device: str, shm: str, seconds: float) -> dict:
    """Check 3, one row: one worker on ``device`` through ``shm``; applied updates/s over a window
    that starts at its 20th update (after the problem loaded and CUDA warmed up)."""
    name = f"{device.replace(':', '')}-{shm}"
    state = os.path.join(tmp, name)
    server, endpoint, _ = _serve(state, shm, ["--max-time", str(seconds + START_TIMEOUT_S), "--eval-every", "0"])
    events = os.path.join(state, "events.jsonl")
    procs = [server, _worker(endpoint, "w", device, shm, os.path.join(tmp, f"{name}-w.log"))]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if os.path.exists(events) and sum(e["ev"] == "applied" for e in _events(events)) >= 20:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{name}: no 20 updates within {START_TIMEOUT_S:.0f} s")
        time.sleep(seconds)  # the measured window; the rate comes from the events' own times
    finally:
        _reap(procs)
    t = [e["t"] for e in _events(events) if e["ev"] == "applied" and "t" in e][20:]
    rate = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0
    return {"device": device, "shm": shm, "updates_per_s": rate, "updates": len(t)}


def _machine(device: str) -> list[str]:
    import torch

    rows = [f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
            f"{os.cpu_count()} CPUs"]
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        rows.append(f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    return rows


def write(out: str, device: str, mix: dict, rows: list[dict], started: float) -> None:
    lines = ["# GPU check (`make gpu-check`, benchmarks/gpu_check.py)", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
             f"{time.time() - started:.0f} s in all; worker device `{device}`.", "", *_machine(device), "",
             "## 1-2. Two GPU workers beside two CPU workers, then an exact replay", "",
             f"`mymodel:make` (examples/own_model), asgd, `--log-payloads`: {mix['wall_s']:.1f} s, "
             f"final accuracy {mix['accuracy']}, lost {mix['lost']}.", "",
             "| worker | device | applied |", "|---|---|---|"]
    lines += [f"| {w} | {mix['joined'].get(w, '?')} | {n} |" for w, n in mix["applied"].items()]
    lines += ["", "| check | holds |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else '**NO**'} |" for k, v in mix["checks"].items()]
    lines += ["", "Replay: " + " / ".join(mix["replay"]), "",
              "## 3. Same-host and TCP paths, one worker", "",
              "| worker device | path | updates/s | updates timed |", "|---|---|---|---|"]
    lines += [f"| {r['device']} | {'same-host (--shm auto)' if r['shm'] == 'auto' else 'TCP (--shm off)'} | "
              f"{r['updates_per_s']:.1f} | {r['updates']} |" for r in rows]
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="the GPU workers' device (cpu: the same plan without a GPU)")
    ap.add_argument("--steps", type=int, default=1200, help="updates of the mixed run")
    ap.add_argument("--seconds", type=float, default=15.0, help="timed window of each path row")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS-gpu.md"))
    ap.add_argument("--timeout", type=float, default=240.0, help="bound on each run")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device here (torch.cuda.is_available() is False): run it on a machine "
                  "with a GPU, or with --device cpu to check the plan", file=sys.stderr)
            return 2
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="latecomer-gpu-check-") as tmp:
        mix = mixed(tmp, a.device, a.steps, a.timeout)
        print(json.dumps({k: v for k, v in mix.items() if k != "replay"}, default=str), flush=True)
        rows = []
        for dev in dict.fromkeys([a.device, "cpu"]):
            for shm in ("auto", "off"):
                rows.append(path_rate(tmp, dev, shm, a.seconds))
                print(json.dumps(rows[-1]), flush=True)
    write(a.out, a.device, mix, rows, started)
    failed = [k for k, v in mix["checks"].items() if not v]
    print(f"gpu-check: {len(mix['checks']) - len(failed)} of {len(mix['checks'])} checks hold; "
          f"results in {a.out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
