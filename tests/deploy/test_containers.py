"""The container recipes run for real under podman (deploy/README.md, "Docker" and "Docker Compose"):
the image built from deploy/docker/Dockerfile, unchanged but for documented build arguments, on a
Debian base made here (tests/deploy/containers.py); the package complete in it; a problem of your
own trained in it; the compose file's server and 2 workers trained to the end with keys made and
handed over as the README says. Root only (rootful podman); ``make test-deploy`` installs the tools
(tests/deploy/install_containers.sh). Measured stages go to CACHE/last-run.json."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.deploy import containers as C
from tests.deploy.conftest import VENV_BIN, require

SCRIPT = "install_containers.sh"
MAX_STEPS = 2000  # the README's LATECOMER_MAX_STEPS for the compose run (the compose file's default is 20000)
COMPOSE_ENV = f"printf 'LATECOMER_MAX_STEPS={MAX_STEPS}\\nLATECOMER_WORKERS=2\\n' > .env"  # the README's settings
OWN_STEPS = 2000  # the README's --max-steps for the problem of your own
REPORT: dict = {}
# The first test waits for the base and the image (about 10 minutes from nothing on 2 cores).
pytestmark = pytest.mark.timeout(2400)


def _report() -> None:
    os.makedirs(C.CACHE, exist_ok=True)
    with open(os.path.join(C.CACHE, "last-run.json"), "w", encoding="utf-8") as f:
        json.dump({"timings_s": C.TIMINGS, **REPORT}, f, indent=1)


@pytest.fixture(scope="session")
def base():
    """The Debian base made here (cached: CACHE/base-KEY.tar and the podman image)."""
    for tool in ("podman", "runc", "mmdebstrap", "podman-compose"):
        require(tool, SCRIPT)
    if os.geteuid() != 0:
        pytest.fail("the container tests need root (rootful podman): run `make test-deploy` as root", pytrace=False)
    try:
        with C.timed("base: total"):
            ref = C.base_image()
    except C.Failed as e:
        _report()
        pytest.fail(str(e), pytrace=False)
    yield ref
    _report()


@pytest.fixture(scope="session")
def image(base):
    """deploy/docker/Dockerfile built on the base, as ``latecomer:cpu`` (podman's layer cache)."""
    try:
        yield C.build_image(base)
    except C.Failed as e:
        pytest.fail(str(e), pytrace=False)
    finally:
        _report()


@pytest.fixture
def scope(request):
    s = C.Scope(f"lctest-{os.getpid()}-{request.node.name[5:25].replace('_', '-')}")
    yield s
    left = s.close()
    assert not left, f"not removed: {left}"


def latecomer(*args: str, cwd: str) -> str:
    """The host's ``latecomer`` (the README's key commands run on the host)."""
    return C.run([os.path.join(VENV_BIN, "latecomer"), *args], timeout=120, cwd=cwd).stdout


def make_keys(folder: str) -> None:
    """deploy/README.md's keys, word for word: made by the user, then handed to the image's uid."""
    latecomer("keys", "init", "keys", cwd=folder)
    latecomer("keys", "add-worker", "worker", "--keys", "keys", cwd=folder)
    C.run(["chown", "-R", "10001:10001", "keys"], timeout=60, cwd=folder)


def state_files(volume: str) -> tuple[dict, list[dict], dict]:
    """summary.json, events.jsonl and run.json of a finished server's state volume."""
    d = C.volume_dir(volume)
    with open(os.path.join(d, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    with open(os.path.join(d, "events.jsonl"), encoding="utf-8") as f:
        events = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(d, "run.json"), encoding="utf-8") as f:
        run = json.load(f)
    return summary, events, run


def test_the_image_holds_the_whole_package(image):
    """`latecomer --help` and `import latecomer` in the image (issue: only five of the eight packages
    were copied: ModuleNotFoundError: No module named 'benchmarks'); it runs as uid 10001 from /opt/venv."""
    r = C.podman("run", "--rm", image, "--help", timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "serve" in r.stdout and "work" in r.stdout
    C.podman("run", "--rm", "--entrypoint", "python", image, "-c", "import latecomer", timeout=120)
    r = C.podman("run", "--rm", "--entrypoint", "python", image, "-c",
                 "import os, sys, latecomer, benchmarks, experiments; latecomer.TorchProblem; "
                 "print(os.getuid(), sys.prefix)", timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["10001", "/opt/venv"]


def test_the_build_context_leaves_the_checkout_out(base, tmp_path, scope):
    """.dockerignore: the context the Dockerfile sees has the package but no .venv, .git, keys or caches."""
    probe = tmp_path / "Probe.Dockerfile"
    probe.write_text(f"FROM {base}\n"
                     "COPY . /ctx\nRUN du -sk /ctx > /ctx.size\n")
    tag = f"localhost/{scope.name('context')}:probe"
    try:
        C.run(["podman", "build", "-f", str(probe), "-t", tag, "."], timeout=300, cwd=C.REPO)
        r = C.podman("run", "--rm", "--entrypoint", "sh", tag, "-c",
                     "cat /ctx.size; find /ctx -maxdepth 1 | sort; "
                     "find /ctx -name '*.key_secret' -o -name __pycache__ -o -name '*.pyc' | head -5", timeout=120)
    finally:
        C.podman("rmi", "-f", tag, timeout=120, check=False)
    size_kb, *paths = r.stdout.split()
    top = {os.path.relpath(p, "/ctx") for p in paths if p.startswith("/ctx/") and p.count("/") == 2}
    for needed in ("pyproject.toml", "README.md", "latecomer", "ps", "worker", "protocol", "algorithms", "problems",
                   "experiments", "benchmarks"):
        assert needed in top, needed
    for kept_out in (".venv", ".git", "runs", "tests", ".pytest_cache"):
        assert kept_out not in top, kept_out
    assert not [p for p in paths if p.count("/") > 2], f"keys or caches in the context: {paths}"
    assert int(size_kb) < 20_000, f"the build context is {size_kb} kB"


def test_a_problem_of_your_own_trains_in_the_image(image, tmp_path, scope):
    """deploy/README.md, "Docker": the server and a worker from the image on one host (a podman
    network), keys made and chowned as the README says, the user's TorchProblem module
    (examples/own_model/mymodel.py) mounted into the working directory, the worker allowed by
    LATECOMER_ALLOW_PROBLEM."""
    d = str(tmp_path)
    shutil.copy(os.path.join(C.REPO, "examples", "own_model", "mymodel.py"), d)
    make_keys(d)
    net, state = scope.network("net"), scope.volume("state")
    server, worker = scope.container("server"), scope.container("worker")
    model = f"{d}/mymodel.py:/home/latecomer/mymodel.py:ro"
    C.podman("run", "-d", "--name", server, "--network", net, "-v", f"{state}:/state", "-v", f"{d}/keys:/keys:ro",
             "-v", model, image,
             "serve", "--bind", "tcp://0.0.0.0:5555", "--state", "/state", "--keys", "/keys",
             "--problem", "mymodel:make", "--algorithm", "asgd", "--set", "lr=0.05", "--max-steps", str(OWN_STEPS))
    C.podman("run", "-d", "--name", worker, "--network", net, "-v", f"{d}/keys/workers:/keys:ro",
             "-v", f"{d}/keys/server.key:/server.key:ro", "-v", model, "-e", "LATECOMER_ALLOW_PROBLEM=mymodel:make",
             image, "work", "--server", f"tcp://{server}:5555", "--key", "/keys/worker.key_secret",
             "--server-key", "/server.key")
    with C.timed("own problem: logs -f server (training)"):
        server_log = C.podman("logs", "-f", server, timeout=600).stdout
    rc = C.wait_exit(server, timeout=60)
    assert rc == 0, f"server exited {rc}:\n{C.logs(server)[-3000:]}"
    assert f"stopped (reached {OWN_STEPS} steps)" in server_log
    wrc = C.wait_exit(worker, timeout=60)
    assert wrc == 0, f"worker exited {wrc}:\n{C.logs(worker)[-3000:]}"
    summary, events, run = state_files(state)
    assert run["problem"] == "mymodel:make", run
    assert summary["version"] == OWN_STEPS and summary["counters"]["lost"] == 0, summary["counters"]
    first, last = summary["evaluations"][0], summary["evaluations"][-1]
    assert last["loss"] < first["loss"], (first, last)
    REPORT["own_problem"] = {"steps": summary["version"], "loss": [first["loss"], last["loss"]],
                             "accuracy": last.get("accuracy"), "lost": summary["counters"]["lost"],
                             "exit": {"server": rc, "worker": wrc}}


def test_compose_trains_with_keys_and_two_workers(image, tmp_path, scope):
    """deploy/README.md, "Docker Compose", under podman-compose: the compose file unchanged, keys made
    and chowned beside it, the README's .env (LATECOMER_MAX_STEPS, LATECOMER_WORKERS=2); the server
    trains to the end, 2 workers with distinct ids took part, nothing lost, every container exits 0,
    and `down -v` removes the containers, the pod, the network and the state volume."""
    d = C.copy_compose(str(tmp_path / "compose"))
    make_keys(d)
    C.run(["bash", "-c", COMPOSE_ENV], timeout=30, cwd=d)
    project = scope.project("compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATECOMER_")}
    env["COMPOSE_PROJECT_NAME"] = project  # unique names on a shared host; the compose file is unchanged
    compose = [os.path.join(VENV_BIN, "podman-compose")]
    with C.timed("compose: up -d"):
        C.run(compose + ["up", "-d"], timeout=300, cwd=d, env=env)
    with C.timed("compose: logs -f server (training)"):
        server_log = C.run(compose + ["logs", "-f", "server"], timeout=300, cwd=d, env=env).stdout
    ps = json.loads(C.podman("ps", "-a", "--format", "json", "--filter",
                             f"label=io.podman.compose.project={project}", timeout=60).stdout)
    by_service: dict[str, list[str]] = {}
    for c in ps:
        by_service.setdefault(c["Labels"].get("com.docker.compose.service", "?"), []).append(c["Names"][0])
    assert len(by_service.get("server", [])) == 1 and len(by_service.get("worker", [])) == 2, by_service
    try:
        exits = {name: C.wait_exit(name, timeout=120) for names in by_service.values() for name in names}
    except C.Failed as e:
        tails = {n: C.logs(n)[-1500:] for names in by_service.values() for n in names}
        pytest.fail(f"{e}\n" + "\n".join(f"--- {n}:\n{t}" for n, t in tails.items()), pytrace=False)
    assert set(exits.values()) == {0}, f"exit codes {exits}\n{server_log[-3000:]}"
    summary, events, _ = state_files(f"{project}_state")
    down = C.run(compose + ["down", "-v"], timeout=300, cwd=d, env=env)
    left = C.podman("ps", "-a", "-q", "--filter", f"label=io.podman.compose.project={project}", timeout=60).stdout
    assert not left.split(), f"`down -v` left containers: {left}"
    assert C.podman("volume", "exists", f"{project}_state", timeout=60, check=False).returncode != 0, \
        f"`down -v` left the state volume:\n{down.stdout[-2000:]}\n{down.stderr[-2000:]}"
    joined = [e["worker_id"] for e in events if e["ev"] == "joined"]
    applied = {}
    for e in events:
        if e["ev"] == "applied":
            applied[e["worker_id"]] = applied.get(e["worker_id"], 0) + 1
    last = summary["evaluations"][-1]
    REPORT["compose"] = {"steps": summary["version"], "accuracy": last.get("accuracy"), "joined": joined,
                         "applied_by": applied, "lost": summary["counters"]["lost"], "exit": exits}
    assert summary["version"] == MAX_STEPS and f"reached {MAX_STEPS} steps" in summary["stopped"], summary["stopped"]
    assert summary["counters"]["lost"] == 0 and summary["counters"]["workers_joined"] == 2, summary["counters"]
    assert len(set(joined)) == 2, f"2 workers, 2 distinct ids: {joined}"
    assert set(applied) == set(joined), f"both workers trained: {applied}"
    order = [e["ev"] for e in events if e["ev"] in ("ready", "applied")]
    assert order[:2] == ["ready", "ready"], f"--min-workers ${{LATECOMER_WORKERS}}: both in before a step: {order[:5]}"
    assert last["accuracy"] >= 0.9, last
    assert f"stopped (reached {MAX_STEPS} steps)" in server_log


def test_workers_on_host_networking_sharing_a_key_end_with_two_ids(image, tmp_path, scope):
    """Two worker containers on host networking (`--network host --uts host`: the host's name in
    both, each its own /tmp) with one key both default to `worker@HOST`. Before the server settled
    it they knocked each other out for the whole run (hundreds of left/joined lines, lost 81). Now:
    the second takes the id, the first is refused `worker id in use` when it speaks again and joins
    as `worker@HOST-XXXXXX`; one write-off (at most its credit, 1 job), then both train to the end."""
    import socket

    d = str(tmp_path)
    make_keys(d)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = scope.volume("state")
    server = scope.container("server")
    C.podman("run", "-d", "--name", server, "--network", "host", "-v", f"{state}:/state",
             "-v", f"{d}/keys:/keys:ro", image, "serve", "--bind", f"tcp://127.0.0.1:{port}", "--state", "/state",
             "--keys", "/keys", "--problem", "digits", "--algorithm", "asgd", "--set", "lr=0.1",
             "--max-steps", "1500", "--min-workers", "2")
    workers = []
    for i in range(2):
        w = scope.container(f"worker{i}")
        C.podman("run", "-d", "--name", w, "--network", "host", "--uts", "host", "-v", f"{d}/keys/workers:/keys:ro",
                 "-v", f"{d}/keys/server.key:/server.key:ro", image, "work", "--server", f"tcp://127.0.0.1:{port}",
                 "--key", "/keys/worker.key_secret", "--server-key", "/server.key", "--delay", "0.005")
        workers.append(w)
    with C.timed("host network: logs -f server (training)"):
        server_log = C.podman("logs", "-f", server, timeout=600).stdout
    exits = {n: C.wait_exit(n, timeout=120) for n in (server, *workers)}
    assert set(exits.values()) == {0}, f"exit codes {exits}\n{server_log[-3000:]}"
    summary, events, _ = state_files(state)
    host = socket.gethostname().split(".")[0]
    joined = [e["worker_id"] for e in events if e["ev"] == "joined"]
    left = [(e["worker_id"], e.get("reason")) for e in events if e["ev"] == "left"]
    REPORT["host_network"] = {"joined": joined, "left": left, "lost": summary["counters"]["lost"]}
    assert summary["version"] == 1500, summary["stopped"]
    base = f"worker@{host}"
    if joined.count(base) == 1:  # the second hello came after the first had gone (nothing to settle)
        assert len(set(joined)) == 2 and not left, (joined, left)
    else:
        assert joined.count(base) == 2 and len(set(joined)) == 2, joined
        (other,) = set(joined) - {base}
        assert other.startswith(f"{base}-") and len(other) == len(base) + 7, other
        assert left == [(base, "restarted")], left
    assert summary["counters"]["lost"] <= 1, summary["counters"]
