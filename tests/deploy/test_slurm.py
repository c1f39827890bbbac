"""deploy/slurm/latecomer.sbatch on a real SLURM cluster (tests/deploy/slurm_cluster.py: slurmctld and
two slurmd, nodes n1 and n2 with 2 CPUs each, munged, in a network namespace of the module's own).

The script is submitted unchanged, with the commands of deploy/README.md's SLURM section (the last
test checks that the section has no other command); only its documented variables differ: this
venv's latecomer, a state directory here, and a short run of the quadratic problem. What each test
claims is read from the run's own files (events.jsonl, summary.json), the job's output file and
``scontrol show job`` (no accounting here, so no sacct)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import time

import pytest

from tests.deploy.conftest import REPO, VENV_BIN, require
from tests.deploy.slurm_cluster import SlurmCluster
from tests.integration.util import read_events, wait_events

pytestmark = pytest.mark.slow

SCRIPT = "deploy/slurm/latecomer.sbatch"
# deploy/README.md's SLURM commands, each run below
TWO_NODES = f"sbatch --nodes=2 --ntasks-per-node=2 {SCRIPT}"
ONE_NODE = f"sbatch --nodes=1 --ntasks-per-node=2 {SCRIPT}"
STEPS = "squeue -s -j JOBID"
CANCEL = "scancel JOBID"
CANCEL_WORKERS = "scancel JOBID.0"
DRY_RUN = f"LATECOMER_DRY_RUN=1 SLURM_JOB_NODELIST='n[1-2]' SLURM_NTASKS_PER_NODE=2 bash {SCRIPT}"
TESTED = {TWO_NODES, ONE_NODE, STEPS, CANCEL, CANCEL_WORKERS, DRY_RUN}
JOB_S = 90  # bound on one job, submission to end (about 8 s here)


def readme_commands() -> list[str]:
    """The command lines of the SLURM section's code block (no comments, no `export` lines)."""
    text = open(os.path.join(REPO, "deploy", "README.md"), encoding="utf-8").read()
    section = text.split("\n## SLURM\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    out = []
    for line in block.splitlines():
        line = line.split("  #", 1)[0].strip()
        if line and not line.startswith(("#", "export ")):
            out.append(line)
    return out


def readme_exports() -> list[str]:
    text = open(os.path.join(REPO, "deploy", "README.md"), encoding="utf-8").read()
    section = text.split("\n## SLURM\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [ln.split()[1].split("=")[0] for ln in block.splitlines() if ln.startswith("export ")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the SLURM tests need root (a network namespace, slurmd): run `make test-deploy` as root",
                    pytrace=False)
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel", "srun"):
        require(tool, "install_slurm.sh")
    for tool in ("nsenter", "unshare", "ip"):
        require(tool, "install_slurm.sh")
    t0 = time.monotonic()
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        print(f"SLURM cluster up in {time.monotonic() - t0:.1f} s")
        yield c


def quadratic(max_steps: int, min_workers: int = 1) -> str:
    """LATECOMER_SERVE_ARGS for a short run; --min-workers: every worker joins before training, so
    every one hears the server's bye at the end."""
    return f"--problem quadratic --max-steps {max_steps} --min-workers {min_workers}"


def job_env(tmp_path, serve_args: str, **extra: str) -> dict[str, str]:
    """The README's exported variables, with this test's values."""
    env = {"LATECOMER": os.path.join(VENV_BIN, "latecomer"), "LATECOMER_STATE": str(tmp_path / "state"),
           "LATECOMER_SERVE_ARGS": serve_args, **extra}
    assert set(readme_exports()) <= set(env), "the README exports a variable this test does not set"
    return env


def submit(cluster, line: str, tmp_path, env: dict[str, str]) -> int:
    assert line in readme_commands(), line
    argv = shlex.split(line)
    assert argv[0] == "sbatch" and argv[-1] == SCRIPT
    # the script by its absolute path; the job's output file and working directory in tmp_path
    return cluster.sbatch(os.path.join(REPO, SCRIPT), *argv[1:-1], env=env, cwd=str(tmp_path))


def finished(cluster, jobid: int, tmp_path) -> tuple[dict, str]:
    job = cluster.wait_job(jobid, JOB_S)
    out = (tmp_path / f"latecomer-{jobid}.out").read_text(errors="replace")
    return job, out


def summary(tmp_path) -> dict:
    with open(tmp_path / "state" / "summary.json", encoding="utf-8") as f:
        return json.load(f)


def events(tmp_path) -> list[dict]:
    return read_events(str(tmp_path / "state" / "events.jsonl"))


def joined(evs) -> set[str]:
    return {e["worker_id"] for e in evs if e["ev"] == "joined"}


def test_two_node_job_completes_with_workers_on_every_node(cluster, tmp_path):
    """Issues 5 and 6: workers on the server's node too, and the bind address from LATECOMER_BIND."""
    env = job_env(tmp_path, quadratic(300, 4), LATECOMER_BIND="tcp://127.0.0.2:5555")
    jobid = submit(cluster, TWO_NODES, tmp_path, env)
    job, out = finished(cluster, jobid, tmp_path)
    assert (job["JobState"], job["ExitCode"], job["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), out
    assert "listening on tcp://127.0.0.2:5555" in out, "the server's own line: bound where LATECOMER_BIND says"
    assert "server exited with status 0" in out
    s = summary(tmp_path)
    assert s["version"] == 300 and s["counters"]["applied"] == 300 and s["counters"]["lost"] == 0, s["counters"]
    assert s["evaluations"][-1]["loss"] < s["evaluations"][0]["loss"] / 10
    assert joined(events(tmp_path)) == {"n1-0", "n1-1", "n2-0", "n2-1"}, "2 workers per node, the server's too"
    assert s["counters"]["workers_joined"] == 4


def test_one_node_job_runs_the_workers_beside_the_server(cluster, tmp_path):
    """Issue 1: a one-node allocation, the server and its workers on that node."""
    jobid = submit(cluster, ONE_NODE, tmp_path, job_env(tmp_path, quadratic(300, 2)))
    job, out = finished(cluster, jobid, tmp_path)
    assert (job["JobState"], job["ExitCode"], job["NodeList"]) == ("COMPLETED", "0:0", "n1"), out
    s = summary(tmp_path)
    assert s["version"] == 300 and s["counters"]["lost"] == 0, s["counters"]
    assert joined(events(tmp_path)) == {"n1-0", "n1-1"}


def test_resubmitting_with_the_same_state_resumes(cluster, tmp_path):
    jobid = submit(cluster, TWO_NODES, tmp_path, job_env(tmp_path, quadratic(200, 4)))
    job, out = finished(cluster, jobid, tmp_path)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert summary(tmp_path)["version"] == 200
    n_before = len(events(tmp_path))
    jobid = submit(cluster, TWO_NODES, tmp_path, job_env(tmp_path, quadratic(1200, 4)))
    job, out = finished(cluster, jobid, tmp_path)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), out
    new = events(tmp_path)[n_before:]
    resumed = [e for e in new if e["ev"] == "resumed"]
    assert resumed and resumed[0]["version"] == 200, resumed
    applied = [e for e in new if e["ev"] == "applied"]
    assert len(applied) == 1000, "steps 201..1200, none twice"
    # the jobs in flight when the first job stopped are written off as their workers come back
    lost = [e for e in new if e["ev"] == "lost"]
    assert len(lost) <= resumed[0]["outstanding"] and {e["reason"] for e in lost} <= {"restarted"}, lost
    s = summary(tmp_path)
    assert s["version"] == 1200 and s["counters"]["lost"] == len(lost)


def test_scancel_ends_with_the_servers_own_status(cluster, tmp_path):
    """Issue 4: SIGTERM from scancel reaches the script's trap; the job's exit code is the server's (0), not 143."""
    jobid = submit(cluster, TWO_NODES, tmp_path, job_env(tmp_path, quadratic(1000000, 4),
                                                         LATECOMER_WORK_ARGS="--delay 0.005"))
    wait_events(str(tmp_path / "state" / "events.jsonl"),
                lambda ev: sum(e["ev"] == "applied" for e in ev) >= 200, JOB_S, poll_s=0.2)
    cluster.run(*shlex.split(CANCEL.replace("JOBID", str(jobid))))
    job, out = finished(cluster, jobid, tmp_path)
    assert (job["JobState"], job["ExitCode"]) == ("CANCELLED", "0:0"), out
    # "143" (128 + SIGTERM) as a status, not as digits of a loss figure in the log ("loss 0.04143")
    assert "server exited with status 0" in out and not re.search(r"(status|code|exit)\D{0,3}143\b", out), out
    s = summary(tmp_path)
    assert s["stopped"] and s["version"] >= 200
    assert re.search(rf"stopped \(.*\) at step {s['version']}\b", out), "the server drained at its step"


def worker_pid(cluster, worker_id: str) -> int | None:
    for pid in cluster.ns_pids():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"work" in argv and b"--worker-id" in argv and argv[argv.index(b"--worker-id") + 1] == worker_id.encode():
            return pid
    return None


def test_lost_workers_are_written_off_and_the_workers_step_restarts(cluster, tmp_path):
    """A worker task killed (-9): its job written off, the others go on. Then the workers' step
    cancelled (``scancel JOBID.0``): the script starts it again and the run reaches its steps."""
    state_events = str(tmp_path / "state" / "events.jsonl")
    jobid = submit(cluster, TWO_NODES, tmp_path, job_env(tmp_path, quadratic(1500, 4),
                                                         LATECOMER_WORK_ARGS="--delay 0.02"))
    wait_events(state_events, lambda ev: sum(e["ev"] == "applied" for e in ev) >= 100, JOB_S, poll_s=0.2)
    pid = worker_pid(cluster, "n2-1")
    assert pid, "no worker n2-1 in the cluster's namespace"
    os.kill(pid, signal.SIGKILL)
    wait_events(state_events, lambda ev: any(e["ev"] == "left" and e["worker_id"] == "n2-1" for e in ev), 20)
    ev = read_events(state_events)
    assert any(e["ev"] == "lost" and e["worker_id"] == "n2-1" for e in ev), "the killed worker's job written off"
    after = len(ev)  # the others go on
    wait_events(state_events, lambda ev: sum(e["ev"] == "applied" for e in ev[after:]) >= 50, 20, poll_s=0.2)
    ev = read_events(state_events)
    assert {e["worker_id"] for e in ev[after:] if e["ev"] == "applied"} <= {"n1-0", "n1-1", "n2-0"}
    assert sum(e["ev"] == "applied" for e in ev) < 1500
    steps = cluster.run(*shlex.split(STEPS.replace("JOBID", str(jobid)))).stdout
    assert f"{jobid}.0 " in steps and f"{jobid}.batch " in steps, steps
    cluster.run(*shlex.split(CANCEL_WORKERS.replace("JOBID", str(jobid))))
    job, out = finished(cluster, jobid, tmp_path)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert "starting it again (restart 1 of 3)" in out, out
    ev = events(tmp_path)
    left = {e["worker_id"] for e in ev if e["ev"] == "left"}
    assert {"n1-0", "n1-1", "n2-0", "n2-1"} <= left, "every worker of the cancelled step written off"
    lost = [e for e in ev if e["ev"] == "lost"]
    assert lost and sum(e["lost"] for e in ev if e["ev"] == "left") == len(lost)
    rejoined = [e["worker_id"] for e in ev[ev.index([e for e in ev if e["ev"] == "left"][-1]):] if e["ev"] == "joined"]
    assert sorted(rejoined) == ["n1-0", "n1-1", "n2-0", "n2-1"], "the restarted step's workers"
    s = summary(tmp_path)
    assert s["version"] == 1500 and s["counters"]["lost"] == len(lost), s["counters"]


def test_dry_run_calls_no_slurm_command(cluster, tmp_path):
    """Issue 3: with SLURM installed (this cluster's configuration), the dry run calls no SLURM
    command: every one on PATH is a shim that records its call (then runs the real one), and no job
    appears in the cluster."""
    shims = tmp_path / "bin"
    shims.mkdir()
    for tool in ("srun", "scontrol", "sbatch", "salloc", "squeue", "sinfo", "scancel", "sacct"):
        (shims / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {tmp_path}/calls\n'
                                  f'PATH=${{PATH#*:}} exec {tool} "$@"\n')
        (shims / tool).chmod(0o755)
    jobs_before = cluster.run("scontrol", "show", "-o", "job").stdout.count("JobId=")
    words = shlex.split(DRY_RUN)
    env = dict(w.split("=", 1) for w in words if re.match(r"[A-Z_]+=", w))
    argv = [w for w in words if not re.match(r"[A-Z_]+=", w)]
    env.update(PATH=f"{shims}:{VENV_BIN}:{os.environ['PATH']}", LATECOMER_STATE=str(tmp_path / "state"))
    r = cluster.run(*argv, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "[dry-run] ok" in r.stdout, r.stdout + r.stderr
    assert "4 workers (2 2 per node) on n1 n2" in r.stdout
    assert not (tmp_path / "calls").exists(), (tmp_path / "calls").read_text()
    assert cluster.run("scontrol", "show", "-o", "job").stdout.count("JobId=") == jobs_before
    assert not (tmp_path / "state").exists()


def test_the_readme_commands_are_the_tested_ones():
    assert set(readme_commands()) == TESTED, "deploy/README.md's SLURM commands and those run here differ"
