"""A host with systemd as PID 1 for tests/deploy/test_systemd.py: a podman container (runc,
``--systemd=always``) booted from ``/sbin/init`` on a Debian bookworm base made here with mmdebstrap
(systemd, sudo, python3-venv), with the repository's working tree copied in and pip pointed at this
host's CPU torch wheel. Reuses tests/deploy/containers.py (its runner, timings, mirrors, CAs, wheel
lookup and the Scope that removes containers); only the base's package list and the booting differ.

Caches, so that a rerun is fast: ``CACHE/systemd-base-KEY.tar`` and the podman image
``localhost/lc-systemd-base:KEY``; pip's download cache in ``CACHE/systemd-pip-cache`` (mounted as
root's pip cache in the container: the README's ``sudo pip install`` runs as root there).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import tarfile
import tempfile

from tests.deploy import containers as C

PACKAGES = ("systemd", "systemd-sysv", "dbus", "sudo", "python3", "python3-venv", "ca-certificates", "procps")
PIP_CACHE = os.path.join(C.CACHE, "systemd-pip-cache")
SRC = "/src/latecomer"  # where the checkout is in the container: the README's /path/to/latecomer


def base_recipe(out: str) -> list[str]:
    """mmdebstrap: Debian minbase with systemd as init, sudo and Python; this host's own CAs added
    (pip inside reaches PyPI through this host's egress, which they sign)."""
    argv = ["mmdebstrap", "--variant=minbase", "--format=tar", f"--include={','.join(PACKAGES)}",
            "--aptopt=Acquire::Check-Valid-Until \"false\""]
    cas = C.local_cas()
    if cas:
        argv += ['--customize-hook=mkdir -p "$1/usr/local/share/ca-certificates"',
                 "--customize-hook=copy-in " + " ".join(cas) + " /usr/local/share/ca-certificates/",
                 '--customize-hook=chroot "$1" update-ca-certificates']
    return argv + [C.SUITE, out, *C.MIRRORS]


def base_key() -> str:
    h = hashlib.sha256(json.dumps(base_recipe("OUT")).encode())
    for ca in C.local_cas():
        with open(ca, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def base_image() -> str:
    """``localhost/lc-systemd-base:KEY`` from podman's store, else imported from the cached tarball,
    else made with mmdebstrap (about 2 minutes) and cached."""
    key = base_key()
    ref = f"localhost/lc-systemd-base:{key}"
    if C.image_exists(ref):
        C.TIMINGS.setdefault("systemd base: cached image", 0.0)
        return ref
    os.makedirs(C.CACHE, exist_ok=True)
    tar = os.path.join(C.CACHE, f"systemd-base-{key}.tar")
    if not os.path.exists(tar):
        partial = tar + ".partial"
        with C.timed("systemd base: mmdebstrap"):
            C.run(base_recipe(partial), timeout=900)
        os.replace(partial, tar)
    with C.timed("systemd base: podman import"):
        C.run(["podman", "import", "--change", 'CMD ["/sbin/init"]', tar, ref], timeout=300)
    return ref


def pip_conf() -> tuple[str, list[str]]:
    """/etc/pip.conf for the container and the podman volumes it needs: this host's CPU torch wheel
    (its find-links folder mounted read-only at the same path) pinned by a constraint, else the
    PyTorch CPU index. A file, not PIP_* variables: ``sudo`` resets the environment."""
    wheels = C.torch_wheel_dir()
    if wheels:
        conf = f"[global]\nfind-links = {wheels}\nconstraint = /etc/pip-torch-cpu.txt\n"
        return conf, ["-v", f"{wheels}:{wheels}:ro"]
    conf = ("[global]\nextra-index-url = https://download.pytorch.org/whl/cpu\n"
            "constraint = /etc/pip-torch-cpu.txt\n")
    return conf, []


def working_tree_tar(out: str) -> None:
    """The repository's tracked and untracked-but-not-ignored files as they are on disk (so the
    units and the README under test are the working tree's, not the last commit's)."""
    files = C.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], timeout=60, cwd=C.REPO).stdout
    with tarfile.open(out, "w") as tar:
        for rel in sorted(set(filter(None, files.split("\0")))):
            path = os.path.join(C.REPO, rel)
            if os.path.isfile(path) and not os.path.islink(path):
                tar.add(path, arcname=rel, recursive=False)


class Host:
    """A booted systemd container named ``name`` with host name ``hostname``."""

    def __init__(self, scope: C.Scope, image: str, hostname: str):
        self.name = scope.container("host")
        self.hostname = hostname
        conf, volumes = pip_conf()
        os.makedirs(PIP_CACHE, exist_ok=True)
        C.podman("run", "-d", "--name", self.name, "--hostname", hostname, "--systemd=always",
                 "-v", f"{PIP_CACHE}:/root/.cache/pip", *volumes, image, "/sbin/init", timeout=120)
        with C.timed("systemd: boot"):
            # systemctl needs the manager's socket first (an exec can come before PID 1 made it)
            boot = "until [ -S /run/systemd/private ]; do sleep 0.1; done; systemctl is-system-running --wait"
            r = self.exec(["timeout", "90", "bash", "-c", boot], timeout=120, check=False, cwd="/")
        if r.stdout.strip() != "running":
            failed = self.exec(["bash", "-c", "systemctl --failed --no-pager; journalctl -b --no-pager | tail -n 40"],
                               timeout=60, check=False, cwd="/")
            raise C.Failed(f"systemd in {self.name} did not come up: is-system-running says "
                           f"{r.stdout.strip() or r.stderr.strip()!r}\n{failed.stdout}")
        self.exec(["mkdir", "-p", SRC], timeout=60, cwd="/")
        self.write("/etc/pip.conf", conf)
        self.write("/etc/pip-torch-cpu.txt", f"torch=={C.TORCH_VERSION}+cpu\n")
        with tempfile.TemporaryDirectory() as d:
            tar = os.path.join(d, "src.tar")
            working_tree_tar(tar)
            with open(tar, "rb") as f:
                r = subprocess.run(["podman", "exec", "-i", self.name, "tar", "-x", "-C", SRC], stdin=f,
                                   capture_output=True, timeout=120)
            if r.returncode != 0:
                raise C.Failed(f"copying the checkout into {self.name}: {r.stderr.decode(errors='replace')}")

    def exec(self, argv: list[str], *, timeout: float, check: bool = True, cwd: str = SRC,
             ) -> subprocess.CompletedProcess:
        return C.podman("exec", "-w", cwd, self.name, *argv, timeout=timeout, check=check)

    def sh(self, script: str, *, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """``script`` run by bash as root in the checkout (``set -euo pipefail``: a failing line stops it)."""
        return self.exec(["bash", "-euo", "pipefail", "-c", script], timeout=timeout, check=check)

    def write(self, path: str, text: str) -> None:
        self.sh(f"mkdir -p {shlex.quote(os.path.dirname(path))} && cat > {shlex.quote(path)} <<'EOF'\n{text}EOF")

    def read(self, path: str) -> str:
        return self.exec(["cat", path], timeout=60).stdout

    def show(self, unit: str) -> dict[str, str]:
        """``systemctl show`` of the properties the test checks."""
        props = "ActiveState,SubState,Result,ExecMainCode,ExecMainStatus,NRestarts"
        out = self.exec(["systemctl", "show", "-p", props, unit], timeout=60).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *units: str) -> str:
        args = [a for u in units for a in ("-u", u)]
        return self.exec(["journalctl", "--no-pager", "-o", "short-iso", *args], timeout=60, check=False).stdout

    def wait_journal(self, unit: str, text: str, timeout: float) -> None:
        """Until ``text`` is in ``unit``'s journal (a bounded loop of journalctl in the container)."""
        inner = f"until journalctl --no-pager -u {unit} | grep -q -F {shlex.quote(text)}; do sleep 0.2; done"
        r = self.sh(f"timeout {timeout:g} bash -c {shlex.quote(inner)}", timeout=timeout + 30, check=False)
        if r.returncode != 0:
            raise C.Failed(f"{text!r} not in the journal of {unit} within {timeout:g} s "
                           f"(show: {self.show(unit)}):\n{self.journal(unit)[-3000:]}")

    def wait_inactive(self, units: list[str], timeout: float) -> None:
        """Until none of ``units`` is active (a bounded loop of ``systemctl is-active`` in the
        container). A unit waiting to be restarted is not active either: the caller's
        ``show`` then says ``activating``/``auto-restart``."""
        inner = "while " + " || ".join(f"systemctl is-active -q {u}" for u in units) + "; do sleep 0.2; done"
        r = self.sh(f"timeout {timeout:g} bash -c {shlex.quote(inner)}", timeout=timeout + 30, check=False)
        if r.returncode != 0:
            states = {u: self.show(u) for u in units}
            raise C.Failed(f"still active after {timeout:g} s: {states}\n{self.journal(*units)[-4000:]}")
