"""A real SLURM cluster on this host for the deployment tests: munged, slurmctld and two slurmd
(nodes n1 and n2, 2 CPUs each) in a network namespace of our own.

Every daemon runs in the namespace (``nsenter --net``) and in a private mount namespace
(``unshare --mount``) where a hosts file of ours is bind-mounted on /etc/hosts: n1 and n2 are
127.0.0.2 and 127.0.0.3 there, on the namespace's own loopback (which also needs an address
besides 127.0.0.1, else glibc's AI_ADDRCONFIG finds no IPv4 address and slurmctld loops on
``getaddrinfo() failed``). ``ip netns exec`` is not used: it remounts /sys, after which slurmd
finds no cgroup file system. The client commands (sbatch, scontrol, ...) run the same way, so
nothing of the cluster is reachable, or reaches, outside the namespace.

The configuration, state, logs and the munge key live in one directory of the caller's; the
daemons find the configuration through ``SLURM_CONF``. Teardown (``stop``, also from ``with``
on any failure) cancels the jobs, stops slurmd, slurmctld and munged with bounded waits, kills
whatever process is still in the namespace (job steps that slurmd left) and deletes the namespace.

Run as a script (root) to bring a cluster up, print ``sinfo`` and tear it down:
``python -m tests.deploy.slurm_cluster``.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NODES = {"n1": "127.0.0.2", "n2": "127.0.0.3"}
CPUS = 2  # per node: this box's cores
CTLD_PORT = 6817
SLURMD_PORT = {"n1": 6818, "n2": 6819}
FINISHED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE"}


class ClusterError(RuntimeError):
    pass


def _run(cmd: list[str], timeout: float = 15, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)}: status {r.returncode}: {(r.stderr or r.stdout).strip()[-500:]}")
    return r


def parse_fields(line: str) -> dict[str, str]:
    """``scontrol show -o`` output: Key=value pairs (a value may hold spaces: it runs to the next Key=)."""
    out = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][\w:/]*)=(.*?)(?=\s[A-Za-z][\w:/]*=|$)", line.strip()):
        out[m.group(1)] = m.group(2)
    return out


class SlurmCluster:
    def __init__(self, base: str | os.PathLike) -> None:
        self.base = Path(base)
        self.ns = f"lcslurm{secrets.token_hex(3)}"
        self.conf = self.base / "slurm.conf"
        self.sock = self.base / "munge" / "munge.socket"
        self.daemons: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.ns_made = False
        self.host = socket.gethostname().split(".")[0]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env["SLURM_CONF"] = str(self.conf)

    # ------------------------------------------------------------------ commands in the namespace
    def enter(self) -> list[str]:
        """The prefix that runs a command inside the cluster's namespaces."""
        return ["nsenter", f"--net=/run/netns/{self.ns}", "--", "unshare", "--mount", "--propagation", "private",
                "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(self.base / "hosts")]

    def run(self, *cmd: str, timeout: float = 15, check: bool = True, env: dict | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        return _run([*self.enter(), *cmd], timeout=timeout, check=check, env={**self.env, **(env or {})}, cwd=cwd)

    def popen(self, name: str, *cmd: str) -> subprocess.Popen:
        log = self.base / f"{name}.out"
        self.logs[name] = log
        with open(log, "wb") as f:
            p = subprocess.Popen([*self.enter(), *cmd], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=self.env, start_new_session=True)
        self.daemons[name] = p
        return p

    # ------------------------------------------------------------------ bring up
    def write_config(self) -> None:
        b = self.base
        for d in ("munge", "ctld", "log", *(f"spool-{n}" for n in NODES)):
            (b / d).mkdir(parents=True, exist_ok=True)
        os.chmod(b / "munge", 0o711)  # munged wants its socket's directory searchable by all
        key = b / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        hosts = ["127.0.0.1 localhost", f"127.0.0.1 {self.host}"] + [f"{a} {n}" for n, a in NODES.items()]
        (b / "hosts").write_text("\n".join(hosts) + "\n")
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} Port={SLURMD_PORT[n]} CPUs={CPUS} "
                          f"State=UNKNOWN" for n, a in NODES.items())
        self.conf.write_text(f"""\
ClusterName=latecomer
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.sock}
StateSaveLocation={b}/ctld
SlurmdSpoolDir={b}/spool-%n
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=20
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=60
PlugStackConfig={b}/plugstack.conf
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        (b / "plugstack.conf").write_text("")

    def start(self, timeout: float = 30) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.write_config()
        _run(["ip", "netns", "add", self.ns])
        self.ns_made = True
        _run(["ip", "-n", self.ns, "link", "set", "lo", "up"])
        for a in NODES.values():
            _run(["ip", "-n", self.ns, "addr", "add", f"{a}/8", "dev", "lo"])
        m = self.base / "munge"
        self.popen("munged", "munged", "-F", "--force", f"--socket={self.sock}", f"--key-file={m}/munge.key",
                   f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed", f"--log-file={m}/munged.log")
        self.wait_for(lambda: self.sock.exists(), timeout, "munged's socket")
        self.popen("slurmctld", "slurmctld", "-D", "-i")
        self.wait_for(lambda: self.run("scontrol", "ping", check=False).returncode == 0, timeout,
                      "slurmctld (scontrol ping)")
        for n in NODES:
            self.popen(f"slurmd-{n}", "slurmd", "-D", "-N", n)
        self.wait_for(lambda: sorted(self.node_states().values()) == ["idle"] * len(NODES), timeout,
                      "both nodes idle (sinfo)")

    def node_states(self) -> dict[str, str]:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)  # e.g. "n1 idle"
        return dict(ln.split()[:2] for ln in r.stdout.splitlines() if len(ln.split()) >= 2) if r.returncode == 0 \
            else {}

    def wait_for(self, cond, timeout: float, what: str, poll_s: float = 0.2):
        deadline = time.monotonic() + timeout
        while True:
            for name, p in self.daemons.items():
                if p.poll() is not None:
                    raise ClusterError(f"{name} exited with status {p.returncode} while waiting for {what}: "
                                       f"{self.tail(name)}")
            v = cond()
            if v:
                return v
            if time.monotonic() > deadline:
                raise ClusterError(f"no {what} within {timeout} s; {self.tails()}")
            time.sleep(poll_s)  # the polling interval of a bounded wait

    def tail(self, name: str, n: int = 1500) -> str:
        out = []
        for p in (self.logs.get(name), self.base / "log" / f"{name}.log"):
            if p and p.exists():
                out.append(p.read_text(errors="replace")[-n:])
        return " | ".join(out)

    def tails(self) -> str:
        return "; ".join(f"{n}: {self.tail(n, 600)}" for n in self.daemons)

    # ------------------------------------------------------------------ jobs
    def sbatch(self, script: str, *opts: str, env: dict | None = None, cwd: str | None = None) -> int:
        r = self.run("sbatch", "--parsable", *opts, script, env=env, cwd=cwd)
        return int(r.stdout.strip().split(";")[0])

    def job(self, jobid: int) -> dict[str, str]:
        r = self.run("scontrol", "show", "-o", "job", str(jobid), check=False)
        return parse_fields(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}

    def jobs(self) -> list[str]:
        """The ids of jobs still queued or running (squeue)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def steps(self, jobid: int) -> list[str]:
        """Step ids of a running job, e.g. ``['12.batch', '12.0']``."""
        return self.run("squeue", "-h", "-s", "-j", str(jobid), "-o", "%i", check=False).stdout.split()

    def wait_job(self, jobid: int, timeout: float, states=FINISHED) -> dict[str, str]:
        last: dict[str, str] = {}

        def done():
            last.update(self.job(jobid))
            return dict(last) if last.get("JobState") in states else None

        try:
            return self.wait_for(done, timeout, f"job {jobid} in {sorted(states)}", poll_s=0.5)
        except ClusterError as e:
            seen = {k: last.get(k) for k in ("JobState", "Reason", "ExitCode", "NodeList")}
            raise ClusterError(f"job {jobid} is {seen} after {timeout} s; {str(e)[:1500]}") from None

    # ------------------------------------------------------------------ teardown
    def ns_pids(self) -> list[int]:
        """Every process inside the cluster's network namespace."""
        try:
            ino = os.stat(f"/run/netns/{self.ns}").st_ino
        except FileNotFoundError:
            return []
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.stat(f"/proc/{d}/ns/net").st_ino == ino:
                        out.append(int(d))
                except (FileNotFoundError, PermissionError, ProcessLookupError):
                    pass
        return out

    def stop(self, timeout: float = 20) -> None:
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.run("scancel", "--full", "-p", "debug", check=False, timeout=10)
            try:
                self.wait_for(lambda: not self.jobs(), timeout, "no job left", poll_s=0.5)
            except (ClusterError, subprocess.SubprocessError):
                pass  # killed below
        for name in [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            p = self.daemons.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        deadline = time.monotonic() + timeout
        while pids := self.ns_pids():  # slurmstepd and job processes slurmd left behind
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise ClusterError(f"processes {pids} still in namespace {self.ns} after SIGKILL")
            time.sleep(0.1)  # the polling interval of a bounded wait
        if self.ns_made:
            _run(["ip", "netns", "del", self.ns])
            self.ns_made = False

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> int:
    base = tempfile.mkdtemp(prefix="slurm-")
    t0 = time.monotonic()
    with SlurmCluster(base) as c:
        print(f"up in {time.monotonic() - t0:.1f} s in {base}, namespace {c.ns}")
        print(c.run("sinfo").stdout)
    print(f"down after {time.monotonic() - t0:.1f} s")
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
