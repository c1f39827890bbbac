"""The container harness of tests/deploy/test_containers.py: a Debian base image made here with
mmdebstrap (no registry but Debian's archive), the image built from deploy/docker/Dockerfile on it,
podman and podman-compose runs with bounded waits, and the removal of every container, pod, volume
and network a test made (by the unique names and compose project it gave them), also on failure.

Two caches, so that a rerun is fast:

- the base: ``CACHE/base-KEY.tar`` (mmdebstrap's output, KEY a hash of the recipe and of the CA
  certificates put in) and the podman image ``localhost/latecomer-deploy-base:KEY`` imported from it;
- the image: podman's own layer cache (the Dockerfile's steps are reused while the base, the build
  arguments and the copied files are the same).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.environ.get("LATECOMER_DEPLOY_CACHE", "/var/cache/latecomer-deploy")
DOCKERFILE = os.path.join(REPO, "deploy", "docker", "Dockerfile")
COMPOSE_FILE = os.path.join(REPO, "deploy", "compose", "docker-compose.yml")
IMAGE = "latecomer:cpu"  # the tag deploy/README.md builds and the compose file runs
TORCH_VERSION = "2.13.0"  # the Dockerfile's default TORCH_VERSION
UID = 10001  # the image's user

# The base: Debian bookworm minbase with the Python the image runs on and what its entry point
# uses (tini, pgrep). python3 and python3-pip are Debian's: that pip refuses to install into the
# system (externally-managed-environment), the case the Dockerfile handles with its own venv.
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates", "procps", "tini")
MIRRORS = ("deb http://deb.debian.org/debian bookworm main",
           "deb http://deb.debian.org/debian bookworm-updates main",
           "deb http://deb.debian.org/debian-security bookworm-security main")
LOCAL_CAS = "/usr/local/share/ca-certificates"  # this host's own CAs (a TLS-inspecting egress trusts them)

TIMINGS: dict[str, float] = {}  # stage -> seconds, reported at the end of the session


class Failed(AssertionError):
    pass


def run(argv: list[str], *, timeout: float, check: bool = True, env: dict | None = None, cwd: str | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    """``argv`` to its end within ``timeout`` seconds (killed after it); output captured as text."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, input=input)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise Failed(f"{' '.join(argv)}: still running after {timeout:g} s\n{out[-3000:]}\n{err[-3000:]}") from None
    if check and r.returncode != 0:
        raise Failed(f"{' '.join(argv)}: exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


@contextlib.contextmanager
def timed(stage: str) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    TIMINGS[stage] = round(time.monotonic() - t0, 1)


# --------------------------------------------------------------------------- the base image

def local_cas() -> list[str]:
    return sorted(glob.glob(os.path.join(LOCAL_CAS, "**", "*.crt"), recursive=True))


def base_recipe(out: str) -> list[str]:
    """The mmdebstrap command that writes the base as a tarball to ``out``."""
    argv = ["mmdebstrap", "--variant=minbase", "--format=tar", f"--include={','.join(BASE_PACKAGES)}",
            "--aptopt=Acquire::Check-Valid-Until \"false\""]
    cas = local_cas()
    if cas:  # pip inside the build reaches PyPI through this host's egress, which these CAs sign
        argv += ['--customize-hook=mkdir -p "$1/usr/local/share/ca-certificates"',
                 "--customize-hook=copy-in " + " ".join(cas) + " /usr/local/share/ca-certificates/",
                 '--customize-hook=chroot "$1" update-ca-certificates']
    return argv + [SUITE, out, *MIRRORS]


def base_key() -> str:
    h = hashlib.sha256(json.dumps(base_recipe("OUT")).encode())
    for ca in local_cas():
        with open(ca, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def image_exists(ref: str) -> bool:
    return run(["podman", "image", "exists", ref], timeout=60, check=False).returncode == 0


def base_image() -> str:
    """``localhost/latecomer-deploy-base:KEY``: from podman's store, else imported from the cached
    tarball, else made with mmdebstrap (a few minutes: Debian's archive) and cached."""
    key = base_key()
    ref = f"localhost/latecomer-deploy-base:{key}"
    if image_exists(ref):
        TIMINGS.setdefault("base: cached image", 0.0)
        return ref
    os.makedirs(CACHE, exist_ok=True)
    tar = os.path.join(CACHE, f"base-{key}.tar")
    if not os.path.exists(tar):
        partial = tar + ".partial"
        with timed("base: mmdebstrap"):
            run(base_recipe(partial), timeout=900)
        os.replace(partial, tar)
    with timed("base: podman import"):
        run(["podman", "import", "--change", "CMD [\"/bin/bash\"]", tar, ref], timeout=300)
    return ref


# --------------------------------------------------------------------------- the image

def pip_find_links() -> list[str]:
    """The directories this host's pip takes wheels from (PIP_FIND_LINKS, ``pip config``)."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    r = run([sys.executable, "-m", "pip", "config", "list"], timeout=60, check=False)
    for line in r.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            dirs += value.strip().strip("'\"").split()
    return [d.removeprefix("file://") for d in dirs if os.path.isdir(d.removeprefix("file://"))]


def torch_wheel_dir() -> str | None:
    """A directory with this host's CPU torch wheel for the base's Python (3.11), if there is one."""
    for d in pip_find_links():
        if glob.glob(os.path.join(d, f"torch-{TORCH_VERSION}+cpu-cp311-*.whl")):
            return d
    return None


def build_args(base: str) -> list[str]:
    """``podman build`` options beyond the README's command: the base, and where torch comes from
    (the CPU wheel this host has, mounted; else the PyTorch CPU index, never the 3 GB CUDA build)."""
    args = ["--build-arg", f"BASE_IMAGE={base}"]
    wheels = torch_wheel_dir()
    if wheels:
        return args + ["--volume", f"{wheels}:/wheels:ro", "--build-arg", "WHEEL_DIR=/wheels"]
    return args + ["--build-arg", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"]


def build_image(base: str, tag: str = IMAGE, dockerfile: str = DOCKERFILE, timeout: float = 1500) -> str:
    """``podman build -f deploy/docker/Dockerfile -t TAG . `` from the repository root, on ``base``."""
    with timed(f"image: podman build {tag}"):
        run(["podman", "build", "-f", dockerfile, "-t", tag, *build_args(base), "."], timeout=timeout, cwd=REPO)
    return tag


# --------------------------------------------------------------------------- runs and cleanup

def podman(*args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return run(["podman", *args], timeout=timeout, check=check, **kw)


def wait_exit(container: str, timeout: float) -> int:
    """The exit status of ``container`` once it has exited (``podman wait``, bounded)."""
    r = podman("wait", container, timeout=timeout)
    return int(r.stdout.strip().splitlines()[-1])


def logs(container: str) -> str:
    r = podman("logs", container, timeout=60, check=False)
    return r.stdout + r.stderr


def volume_dir(volume: str) -> str:
    """Where a local volume's files are on this host (rootful podman)."""
    return podman("volume", "inspect", "--format", "{{.Mountpoint}}", volume, timeout=60).stdout.strip()


class Scope:
    """Names for the containers, volumes and networks of one test (``PREFIX-NAME``) and their
    removal at the end, whatever happened; compose projects are removed by their label."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.containers: list[str] = []
        self.volumes: list[str] = []
        self.networks: list[str] = []
        self.projects: list[str] = []

    def name(self, what: str) -> str:
        return f"{self.prefix}-{what}"

    def container(self, what: str) -> str:
        self.containers.append(self.name(what))
        return self.containers[-1]

    def volume(self, what: str) -> str:
        self.volumes.append(self.name(what))
        return self.volumes[-1]

    def network(self, what: str) -> str:
        self.networks.append(self.name(what))
        podman("network", "create", self.networks[-1])
        return self.networks[-1]

    def project(self, what: str) -> str:
        self.projects.append(self.name(what))
        return self.projects[-1]

    def close(self) -> list[str]:
        """Remove everything; returns what could not be removed (the test reports it)."""
        left = []
        label = [f"label=io.podman.compose.project={p}" for p in self.projects]
        for flt in label:
            ids = podman("ps", "-a", "-q", "--filter", flt, timeout=60, check=False).stdout.split()
            self.containers += ids
        for c in self.containers:  # their volumes too: the image's VOLUME /state gives each an anonymous one
            r = podman("inspect", "--format", "{{range .Mounts}}{{.Name}} {{end}}", c, timeout=60, check=False)
            self.volumes += [v for v in r.stdout.split() if v not in self.volumes] if r.returncode == 0 else []
            podman("rm", "-f", "-v", "-t", "5", c, timeout=120, check=False)
        for p in self.projects:
            podman("pod", "rm", "-f", f"pod_{p}", timeout=120, check=False)
        for flt in label:
            self.volumes += podman("volume", "ls", "-q", "--filter", flt, timeout=60, check=False).stdout.split()
            self.networks += podman("network", "ls", "-q", "--filter", flt, timeout=60,
                                    check=False).stdout.split()
        for v in self.volumes:
            podman("volume", "rm", "-f", v, timeout=60, check=False)
        for n in self.networks:
            podman("network", "rm", "-f", n, timeout=60, check=False)
        for c in self.containers:
            if podman("container", "exists", c, timeout=60, check=False).returncode == 0:
                left.append(f"container {c}")
        for v in self.volumes:
            if podman("volume", "exists", v, timeout=60, check=False).returncode == 0:
                left.append(f"volume {v}")
        for p in self.projects:
            if podman("pod", "exists", f"pod_{p}", timeout=60, check=False).returncode == 0:
                left.append(f"pod pod_{p}")
        return left


def copy_compose(dest: str) -> str:
    """The compose file, unchanged, in ``dest`` (the keys go beside it, as the README says)."""
    os.makedirs(dest, exist_ok=True)
    shutil.copy(COMPOSE_FILE, os.path.join(dest, "docker-compose.yml"))
    return dest
