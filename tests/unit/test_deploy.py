"""deploy/ recipes and `latecomer launch` parsing: every command they run goes through the real
click parser (a flag typo fails here), every YAML parses and has what the daemon needs."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import click
import pytest
import yaml

from ps.cli.main import main
from ps.net.security import is_loopback_endpoint
from ps.ops import launch as lm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")


# --------------------------------------------------------------------------- the real parser

def parse(argv: list[str], tmp_path) -> tuple[str, dict]:
    """Parse ``latecomer SUBCOMMAND ...`` with the real click command (no command body runs).

    Options whose paths must exist (``--keys``, ``--key``) point into a container or a host we
    do not have: their values are swapped for stand-ins of the right kind in ``tmp_path``, and
    the original value is kept under ``params['_paths']``."""
    assert argv and argv[0] in main.commands, f"not a latecomer subcommand: {argv[:1]}"
    cmd = main.commands[argv[0]]
    by_opt = {o: p for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    out, paths, rest, i = [], {}, list(argv[1:]), 0
    while i < len(rest):
        a = rest[i]
        out.append(a)
        key, eq, _ = a.partition("=")
        p = by_opt.get(key)
        if a.startswith("-") and p is None:
            pytest.fail(f"unknown option {a!r} for `latecomer {argv[0]}` in {shlex.join(argv)}")
        if p is not None and not p.is_flag and not eq:
            i += 1
            assert i < len(rest), f"{a} needs a value in {shlex.join(argv)}"
            v = rest[i]
            if isinstance(p.type, click.Path) and p.type.exists:
                paths[p.name] = v
                stand_in = tmp_path / "stand-in" / v.strip("/").replace("/", "_")
                if p.type.file_okay and not p.type.dir_okay:
                    stand_in.parent.mkdir(parents=True, exist_ok=True)
                    stand_in.write_text("")
                else:
                    stand_in.mkdir(parents=True, exist_ok=True)
                v = str(stand_in)
            out.append(v)
        i += 1
    ctx = cmd.make_context(argv[0], out)  # raises click.UsageError / BadParameter on a bad flag or value
    params = dict(ctx.params)
    params["_paths"] = paths
    if argv[0] == "serve":  # the check serve's body makes before binding
        assert params["keys_dir"] or params["insecure"] or is_loopback_endpoint(params["bind"]), \
            f"serve binds {params['bind']} without --keys or --insecure"
    return argv[0], params


def test_the_parser_catches_a_flag_typo(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="unknown option '--devcie'"):
        parse(["work", "--server", "tcp://h:5555", "--devcie", "cuda"], tmp_path)
    with pytest.raises(click.BadParameter):
        parse(["work", "--server", "tcp://h:5555", "--credit", "0"], tmp_path)
    _, p = parse(["work", "--server", "tcp://h:5555", "--key", "/x/w.key_secret"], tmp_path)
    assert p["_paths"]["key_secret"] == "/x/w.key_secret"


def hostport(endpoint: str) -> tuple[str, int]:
    m = re.fullmatch(r"tcp://([^:/]+):(\d+)", endpoint)
    assert m, endpoint
    return m.group(1), int(m.group(2))


def load_yaml(*parts: str) -> list[dict]:
    with open(os.path.join(DEPLOY, *parts), encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


# --------------------------------------------------------------------------- compose

def compose_defaults(argv: list[str]) -> list[str]:
    """A compose command with its ``${VAR:-default}`` interpolations at their defaults."""
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in argv]


def test_compose_server_and_scalable_workers(tmp_path):
    (doc,) = load_yaml("compose", "docker-compose.yml")
    services = doc["services"]
    server, worker = services["server"], services["worker"]
    _, sp = parse(compose_defaults(server["command"]), tmp_path)
    assert sp["max_steps"] == 20000, "LATECOMER_MAX_STEPS overrides it; 20000 by default"
    assert "${LATECOMER_MAX_STEPS:-20000}" in server["command"]
    assert sp["bind"] == "tcp://0.0.0.0:5555"
    assert sp["state_dir"] == "/state"
    assert "state:/state" in server["volumes"] and "state" in doc["volumes"]
    assert sp["_paths"]["keys_dir"] == "/run/secrets/server_keys"
    assert "server_keys" in server["secrets"] and "server_keys" in doc["secrets"]
    assert server["restart"] != "always", "the server exits 0 when training is done"
    for name in ("worker", "worker-gpu"):
        svc = services[name]
        _, wp = parse(svc["command"], tmp_path)
        host, port = hostport(wp["server"])
        assert host == "server" and port == 5555
        assert "container_name" not in svc and "ports" not in svc, "--scale worker=N needs no fixed name or port"
        for opt in ("key_secret", "server_key"):
            secret = wp["_paths"][opt].removeprefix("/run/secrets/")
            assert secret in svc["secrets"] and secret in doc["secrets"], (name, opt)
        assert svc["healthcheck"]["test"][:2] == ["CMD", "pgrep"]
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    assert parse(services["worker-gpu"]["command"], tmp_path)[1]["device"] == "cuda"
    assert doc["secrets"]["server_keys"]["file"] == "./keys"
    for svc in (server, worker):
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert os.path.exists(os.path.join(DEPLOY, "compose", svc["build"]["context"], svc["build"]["dockerfile"]))
    for name, svc in services.items():
        # podman without systemd never runs healthchecks (their status stays "starting"): no start may wait on one
        deps = svc.get("depends_on", [])
        conditions = [d.get("condition") for d in deps.values()] if isinstance(deps, dict) else []
        assert "service_healthy" not in conditions, name


# --------------------------------------------------------------------------- kubernetes

def k8s_resources(base: str) -> list[dict]:
    (kust,) = load_yaml(base, "kustomization.yaml")
    docs = []
    for r in kust["resources"]:
        path = os.path.normpath(os.path.join(DEPLOY, base, r))
        if os.path.isdir(path):
            docs += k8s_resources(os.path.relpath(path, DEPLOY))
        else:
            docs += load_yaml(os.path.relpath(path, DEPLOY))
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container_args(workload: dict, tmp_path) -> tuple[dict, dict]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c, parse(c["args"], tmp_path)[1]


def mounted_secret(workload: dict, container: dict, path: str) -> tuple[str, str]:
    """(secret name, key inside it) of the file at ``path`` in the container."""
    vols = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    for m in container["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/") or path == m["mountPath"]:
            sec = vols[m["name"]]["secret"]
            rel = path[len(m["mountPath"]):].lstrip("/")
            items = {i["path"]: i["key"] for i in sec.get("items", [])}
            return sec["secretName"], items.get(rel, rel)
    pytest.fail(f"{path} is not on a mounted volume")


def generated_keys() -> dict[str, set[str]]:
    (kust,) = load_yaml("k8s", "base", "kustomization.yaml")
    out = {}
    for g in kust["secretGenerator"]:
        out[g["name"]] = {f.split("=", 1)[0] if "=" in f else os.path.basename(f) for f in g["files"]}
    return out


def test_k8s_server_statefulset_service_and_workers(tmp_path):
    (kust,) = load_yaml("k8s", "base", "kustomization.yaml")
    assert kust["kind"] == "Kustomization"
    for r in kust["resources"]:
        assert os.path.exists(os.path.join(DEPLOY, "k8s", "base", r)), r
    docs = k8s_resources("k8s/base")
    for d in docs:
        assert d["apiVersion"] and d["kind"] and d["metadata"]["name"]
    secrets = generated_keys()
    sts = by_kind(docs, "StatefulSet")["latecomer-server"]
    svc = by_kind(docs, "Service")[sts["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None", "headless Service"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    c, sp = container_args(sts, tmp_path)
    bind_host, bind_port = hostport(sp["bind"])
    assert bind_host == "0.0.0.0"
    (port,) = c["ports"]
    assert port["containerPort"] == bind_port and svc["spec"]["ports"][0]["port"] == bind_port
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    state_mount = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert state_mount and state_mount[0]["mountPath"] == sp["state_dir"], "--state lives on the PVC"
    keys_dir = sp["_paths"]["keys_dir"]
    for f in ("server.key_secret", "server.key", "authorized/worker.key"):
        name, key = mounted_secret(sts, c, f"{keys_dir}/{f}")
        assert key in secrets[name], (f, name, key)
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["tcpSocket"]["port"] in (port["name"], bind_port)
    workers = by_kind(docs, "Deployment")["latecomer-worker"]
    wc, wp = container_args(workers, tmp_path)
    host, wport = hostport(wp["server"])
    assert host == svc["metadata"]["name"] and wport == bind_port
    for opt in ("key_secret", "server_key"):
        name, key = mounted_secret(workers, wc, wp["_paths"][opt])
        assert key in secrets[name], (opt, name, key)
    for probe in ("livenessProbe", "readinessProbe"):
        assert wc[probe]["exec"]["command"][0] == "pgrep"


def test_k8s_gpu_overlay(tmp_path):
    (kust,) = load_yaml("k8s", "overlays", "gpu", "kustomization.yaml")
    assert "../../base" in kust["resources"]
    here = os.path.join(DEPLOY, "k8s", "overlays", "gpu")
    for r in kust["resources"]:  # kustomize: "cycle detected" when a resource root contains the overlay
        root = os.path.normpath(os.path.join(here, r))
        assert not (here + os.sep).startswith(root + os.sep), f"{r} contains the overlay"
    docs = k8s_resources("k8s/overlays/gpu")
    deployments = by_kind(docs, "Deployment")
    assert {"latecomer-worker", "latecomer-worker-gpu"} <= set(deployments)
    gpu = deployments["latecomer-worker-gpu"]
    c, p = container_args(gpu, tmp_path)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert p["device"] == "cuda"
    assert hostport(p["server"])[0] == by_kind(docs, "StatefulSet")["latecomer-server"]["spec"]["serviceName"]
    assert c["image"] in {i["name"] for i in kust["images"]}
    secrets = generated_keys()
    for opt in ("key_secret", "server_key"):
        name, key = mounted_secret(gpu, c, p["_paths"][opt])
        assert key in secrets[name]


# --------------------------------------------------------------------------- docker

def packages() -> set[str]:
    """The top-level packages pyproject.toml installs (its packages.find include list)."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return {p.rstrip("*") for p in include}


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_copy_what_the_package_needs(name, tmp_path):
    with open(os.path.join(DEPLOY, "docker", name), encoding="utf-8") as f:
        text = f.read()
    copied = {src for line in re.findall(r"^COPY (.+)$", text, flags=re.M) for src in line.split()[:-1]}
    assert packages() >= {"latecomer", "ps", "worker", "benchmarks"}
    for pkg in packages() | {"pyproject.toml", "README.md"}:  # all of them: `latecomer --help` imports benchmarks
        assert pkg in copied, pkg
        assert os.path.exists(os.path.join(REPO, pkg))
    assert 'ENTRYPOINT ["tini", "--", "latecomer"]' in text
    assert "torch==${TORCH_VERSION}" in text and "procps" in text
    # the image's own venv, never the base's pip (Debian's refuses: externally-managed-environment)
    assert "python3 -m venv /opt/venv" in text and "PATH=/opt/venv/bin:$PATH" in text
    assert re.search(r"^FROM \$\{(BASE_IMAGE|CUDA_IMAGE)\}$", text, flags=re.M), "the base is a build argument"
    assert "ARG WHEEL_DIR=" in text and "ARG TORCH_INDEX_URL=" in text
    assert "useradd --create-home --uid 10001" in text and "chown -R 10001:10001 keys" in text
    header = "\n".join(ln[1:].strip() for ln in text.splitlines() if ln.startswith("#"))
    runs = [shlex.split(c) for c in header.replace("\\\n", " ").splitlines() if c.startswith("docker run ")]
    assert {argv[argv.index(next(a for a in argv if a.startswith("latecomer:"))) + 1] for argv in runs} >= \
        ({"serve", "work"} if name == "Dockerfile" else {"work"})
    for argv in runs:
        image = next(i for i, a in enumerate(argv) if a.startswith("latecomer:"))
        parse(argv[image + 1:], tmp_path)


def test_dockerignore_keeps_the_checkout_out_of_the_build_context():
    with open(os.path.join(REPO, ".dockerignore"), encoding="utf-8") as f:
        rules = {ln.strip() for ln in f if ln.strip() and not ln.startswith("#")}
    assert {".venv", ".git", "runs", "**/*.key_secret", "deploy/*/keys", "**/__pycache__"} <= rules
    for pkg in packages() | {"pyproject.toml", "README.md"}:
        assert pkg not in rules and f"/{pkg}" not in rules, pkg


def readme_commands(section: str) -> list[list[str]]:
    """The commands of a deploy/README.md section's code blocks (continuation lines joined, comments dropped)."""
    text = open(os.path.join(DEPLOY, "README.md"), encoding="utf-8").read()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", body, flags=re.S)
    return [shlex.split(ln, comments=True) for b in blocks for ln in b.replace("\\\n", " ").splitlines() if ln.strip()]


def test_readme_container_commands_parse(tmp_path):
    """deploy/README.md's Docker and Docker Compose commands: each `latecomer` command in them, on the
    host or in a container (`podman run ... latecomer:cpu SUBCOMMAND ...`), goes through the real parser."""
    seen = set()
    for section in ("Docker", "Docker Compose"):
        for argv in readme_commands(section):
            for cmd in " ".join(argv).split(" && "):
                words = cmd.split()
                if words[:1] == ["latecomer"]:
                    seen.add(words[1])
                    assert words[1] == "keys", words
                if words[:2] == ["podman", "run"] and words[-1:] != ["."]:
                    image = next(i for i, w in enumerate(words) if w.startswith("latecomer:"))
                    if words[image + 1] in ("serve", "work"):
                        seen.add(words[image + 1])
                        parse(words[image + 1:], tmp_path)
    assert {"keys", "serve", "work"} <= seen


# --------------------------------------------------------------------------- slurm

SBATCH = os.path.join(DEPLOY, "slurm", "latecomer.sbatch")
SLURM_COMMANDS = ("srun", "scontrol", "sbatch", "salloc", "squeue", "sinfo", "scancel", "sacct")


def make_shims(tmp_path, real_latecomer: bool):
    """Every SLURM command on PATH records its call (a dry run must call none); the latecomer the
    script runs records its environment and arguments, then runs the real one (``real_latecomer``;
    else it stops there: the printed commands are parsed here with the real parser anyway)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in SLURM_COMMANDS:
        (bin_dir / tool).write_text(f'#!/bin/bash\necho "$*" >> "$SHIM_LOG.{tool}"\nexit 1\n')
    run = f"exec {shlex.quote(sys.executable)} -m ps \"$@\"" if real_latecomer else "exit 0"
    (bin_dir / "latecomer").write_text(f'#!/bin/bash\necho "CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES:-}} $*" '
                                       f'>> "$SHIM_LOG.latecomer"\n{run}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


@pytest.fixture
def slurm_shims(tmp_path):
    return make_shims(tmp_path, real_latecomer=False)


@pytest.fixture
def slurm_shims_real(tmp_path):
    return make_shims(tmp_path, real_latecomer=True)


def run_sbatch(bin_dir, tmp_path, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_", "LATECOMER"))}
    e.update({"PATH": f"{bin_dir}:{e['PATH']}", "LATECOMER_DRY_RUN": "1", "SHIM_LOG": str(tmp_path / "log"),
              "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NTASKS_PER_NODE": "2(x3)", "SLURM_JOB_ID": "42",
              "PYTHONPATH": REPO, **env})
    e = {k: v for k, v in e.items() if v is not None}
    for f in tmp_path.glob("log.*"):
        f.unlink()
    r = subprocess.run(["bash", SBATCH], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=60)
    called = {t: (tmp_path / f"log.{t}").read_text() for t in SLURM_COMMANDS if (tmp_path / f"log.{t}").exists()}
    assert not called, f"the dry run called SLURM commands: {called}"
    return r


def dry_run_commands(stdout: str) -> list[list[str]]:
    out = []
    for line in stdout.splitlines():
        argv = shlex.split(line.removeprefix("[dry-run] ")) if line.startswith("[dry-run] ") else []
        if "latecomer" in [os.path.basename(a) for a in argv]:
            i = [os.path.basename(a) for a in argv].index("latecomer")
            out.append(argv[:i] + ["latecomer"] + argv[i + 1:])
    return out


def dry_run(slurm_shims, tmp_path, **env) -> tuple[dict, list[str], dict, str]:
    """(serve's parameters, the srun line up to `latecomer`, work's parameters, stdout) of a dry run."""
    r = run_sbatch(slurm_shims, tmp_path, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[dry-run] ok" in r.stdout
    serve_line, work_line = dry_run_commands(r.stdout)
    _, sp = parse(serve_line[serve_line.index("latecomer") + 1:], tmp_path)
    i = work_line.index("latecomer")
    _, wp = parse(work_line[i + 1:], tmp_path)
    assert work_line[0] == "srun"
    return sp, work_line[:i], wp, r.stdout


def test_sbatch_header_asks_for_no_cpus_gpus_or_size():
    """Issues 2 and the CPU clusters: the job's size, CPUs and GPUs come from the sbatch command
    line; a fixed --cpus-per-task in the header left jobs pending (Reason=PartitionConfig) on
    smaller nodes, a --gpus-per-task one made CPU clusters refuse them."""
    header = [ln for ln in open(SBATCH, encoding="utf-8") if ln.startswith("#SBATCH")]
    assert header, "no #SBATCH lines"
    for ln in header:
        assert not re.search(r"--(cpus|gpus|gres|mem|ntasks|nodes)", ln), ln


@pytest.mark.slow
def test_sbatch_dry_run_spreads_workers_over_every_node(slurm_shims_real, tmp_path):
    """Issue 5: workers on every node, the server's (first) one included; no --exclude. Issue 3:
    no SLURM command is called (run_sbatch checks), the node list n[1-3] is expanded here; the
    latecomer commands run with --help."""
    sp, srun, wp, out = dry_run(slurm_shims_real, tmp_path)
    assert sp["bind"] == "tcp://0.0.0.0:5555" and sp["insecure"] and sp["state_dir"].endswith("latecomer-state-42")
    assert "--nodes=3" in srun and "--ntasks=6" in srun and "--ntasks-per-node=2" in srun
    assert not any(a.startswith("--exclude") for a in srun)
    assert "--kill-on-bad-exit=0" in srun
    assert wp["server"] == "tcp://n1:5555" and wp["device"] == "cpu" and wp["threads"] == 1
    assert "6 workers (2 2 2 per node) on n1 n2 n3" in out
    assert not any(a.startswith("--gpu") for a in srun), "no GPU option without GPUs in the job"
    runs = (tmp_path / "log.latecomer").read_text().splitlines()
    helps = [ln for ln in runs if ln.endswith("--help") or " --help " in ln]
    assert any(" serve " in ln for ln in helps) and any(" work " in ln for ln in helps)
    (worker_run,) = [ln for ln in runs if " work " in ln]
    assert worker_run.startswith("CUDA_VISIBLE_DEVICES= ")
    assert re.search(r"--worker-id n1-0 --device cpu$", worker_run), "NODE-LOCALID: SLURM's node name"


def test_sbatch_dry_run_one_node(slurm_shims, tmp_path):
    """Issue 1: a one-node allocation runs the server and the workers on that node."""
    sp, srun, wp, out = dry_run(slurm_shims, tmp_path, SLURM_JOB_NODELIST="gpu7", SLURM_NTASKS_PER_NODE="8",
                                SLURM_GPUS_PER_TASK="1")
    assert "--nodes=1" in srun and "--ntasks=8" in srun
    assert "--gpus-per-task=1" in srun, "one GPU per worker task"
    assert wp["server"] == "tcp://gpu7:5555" and wp["device"] == "cuda"
    (worker_run,) = [ln for ln in (tmp_path / "log.latecomer").read_text().splitlines() if " work " in ln]
    assert worker_run.startswith("CUDA_VISIBLE_DEVICES=0 "), "bound to the task's GPU when SLURM does not"
    assert re.search(r"--worker-id gpu7-0 --device cuda$", worker_run)


@pytest.mark.parametrize("env,cpus,gpu", [
    ({}, 1, False),                                                             # nothing known: 1 CPU
    ({"SLURM_JOB_CPUS_PER_NODE": "8(x3)"}, 4, False),                           # 8 CPUs / 2 tasks
    ({"SLURM_CPUS_ON_NODE": "6"}, 3, False),
    ({"SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_CPUS_PER_NODE": "8,4,2"}, 2, False),  # the smallest share
    ({"SLURM_JOB_CPUS_PER_NODE": "8(x3)", "SLURM_CPUS_PER_TASK": "3"}, 3, False),  # sbatch --cpus-per-task
    ({"SLURM_GPUS_ON_NODE": "2"}, 1, True),                                     # auto: the job has GPUs
    ({"SLURM_GPUS_PER_TASK": "1", "LATECOMER_DEVICE": "cpu"}, 1, False),        # forced off
    ({"LATECOMER_DEVICE": "cuda"}, 1, True),                                    # forced on
])
def test_sbatch_cpus_and_gpus_per_worker_come_from_the_allocation(slurm_shims, tmp_path, env, cpus, gpu):
    """Issue 2: CPUs per worker from the allocation (srun --cpus-per-task and torch threads); GPU
    options only when the workers run on CUDA."""
    sp, srun, wp, out = dry_run(slurm_shims, tmp_path, **env)
    assert f"--cpus-per-task={cpus}" in srun and wp["threads"] == cpus
    assert ("--gpus-per-task=1" in srun) == gpu and any(a.startswith("--gpu") for a in srun) == gpu
    assert wp["device"] == ("cuda" if gpu else "cpu")
    if "SLURM_TASKS_PER_NODE" in env:
        assert "--ntasks=5" in srun and not any(a.startswith("--ntasks-per-node") for a in srun)


def test_sbatch_bind_and_server_address_are_variables(slurm_shims, tmp_path):
    """Issue 6: the bind address was fixed at tcp://0.0.0.0."""
    sp, _, wp, _ = dry_run(slurm_shims, tmp_path, LATECOMER_BIND="tcp://10.1.2.3:6000")
    assert sp["bind"] == "tcp://10.1.2.3:6000" and wp["server"] == "tcp://n1:6000"
    sp, _, wp, _ = dry_run(slurm_shims, tmp_path, LATECOMER_PORT="7000", LATECOMER_SERVER="tcp://n1-ib:7000")
    assert sp["bind"] == "tcp://0.0.0.0:7000" and wp["server"] == "tcp://n1-ib:7000"


def test_sbatch_keys_work_args_and_bad_input(slurm_shims, tmp_path):
    sp, srun, wp, _ = dry_run(slurm_shims, tmp_path, LATECOMER_KEYS="/shared/keys", LATECOMER_WORK_ARGS="--credit 2")
    assert sp["_paths"]["keys_dir"] == "/shared/keys" and not sp["insecure"]
    assert wp["_paths"] == {"key_secret": "/shared/keys/workers/worker.key_secret",
                            "server_key": "/shared/keys/server.key"}
    assert wp["credit"] == 2
    r = run_sbatch(slurm_shims, tmp_path, LATECOMER_DEVICE="tpu")
    assert r.returncode == 2 and "LATECOMER_DEVICE must be auto, cuda or cpu" in r.stderr
    r = run_sbatch(slurm_shims, tmp_path, SLURM_JOB_NODELIST="n[1-3")
    assert r.returncode == 2 and "cannot read the node list" in r.stderr
    r = run_sbatch(slurm_shims, tmp_path, SLURM_JOB_NODELIST=None)
    assert r.returncode != 0 and "not inside a SLURM allocation" in r.stderr


@pytest.mark.parametrize("nodelist,nodes", [
    ("n1", "n1"), ("n[1-3]", "n1 n2 n3"), ("n[01-03,7],gpu5,a[2]b", "n01 n02 n03 n7 gpu5 a2b"),
    ("rack1-[9-10]", "rack1-9 rack1-10"),
])
def test_sbatch_dry_run_expands_node_lists_itself(slurm_shims, tmp_path, nodelist, nodes):
    n = len(nodes.split())
    _, srun, wp, out = dry_run(slurm_shims, tmp_path, SLURM_JOB_NODELIST=nodelist, SLURM_NTASKS_PER_NODE="1")
    assert f"on {nodes}, device" in out and f"--nodes={n}" in srun
    assert wp["server"] == f"tcp://{nodes.split()[0]}:5555"


def test_sbatch_passes_a_problem_of_your_own_to_the_workers(slurm_shims, tmp_path):
    sp, _, wp, _ = dry_run(slurm_shims, tmp_path, LATECOMER_SERVE_ARGS="--problem mymodel:make --algorithm asgd "
                                                                       "--max-steps 10")
    assert sp["problem"] == "mymodel:make"
    assert wp["allow_problem"] == ("mymodel:make",), "a worker loads no code the server names unless allowed"
    _, _, wp, _ = dry_run(slurm_shims, tmp_path, LATECOMER_SERVE_ARGS="--problem=digits")
    assert wp["allow_problem"] == ()


def test_compose_and_k8s_workers_take_the_allow_list_from_the_environment():
    (doc,) = load_yaml("compose", "docker-compose.yml")
    for name in ("worker", "worker-gpu"):
        assert doc["services"][name]["environment"]["LATECOMER_ALLOW_PROBLEM"] == "${LATECOMER_ALLOW_PROBLEM:-}"
    for base in ("k8s/base", "k8s/overlays/gpu"):
        for w in by_kind(k8s_resources(base), "Deployment").values():
            (c,) = w["spec"]["template"]["spec"]["containers"]
            assert {e["name"] for e in c["env"]} >= {"LATECOMER_ALLOW_PROBLEM"}, w["metadata"]["name"]
    assert main.commands["work"].params[[p.name for p in main.commands["work"].params].index("allow_problem")
                                        ].envvar == "LATECOMER_ALLOW_PROBLEM"


# --------------------------------------------------------------------------- systemd

def read_unit(path: str) -> list[tuple[str, str, str]]:
    """A minimal systemd INI reader: (section, key, value) in order (keys may repeat)."""
    out, section = [], None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            assert sep and section, f"{path}:{n}: not KEY=VALUE in a section"
            out.append((section, key.strip(), value.strip()))
    return out


def exec_start(path: str, **values: str) -> list[str]:
    (cmd,) = [v for s, k, v in read_unit(path) if (s, k) == ("Service", "ExecStart")]
    cmd = cmd.replace("%H", values.get("host", "node1")).replace("%i", values.get("instance", "0"))
    cmd = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], cmd)
    argv = shlex.split(cmd)
    argv = [a for a in argv if not re.fullmatch(r"\$\w+", a)]  # $VAR: split words, empty by default
    assert os.path.basename(argv[0]) == "latecomer", argv[0]
    return argv


UNITS = os.path.join(DEPLOY, "systemd")


def test_systemd_units_run_real_subcommands(tmp_path):
    server = os.path.join(UNITS, "latecomer-server.service")
    worker = os.path.join(UNITS, "latecomer-worker@.service")
    _, sp = parse(exec_start(server)[1:], tmp_path)
    state_dir = dict((k, v) for s, k, v in read_unit(server) if s == "Service")["StateDirectory"]
    assert sp["state_dir"].startswith(f"/var/lib/{state_dir}/")
    assert sp["_paths"]["keys_dir"] == "/etc/latecomer/keys"
    assert dict((k, v) for s, k, v in read_unit(server))["Restart"] == "on-failure"
    wargv = exec_start(worker, LATECOMER_SERVER="tcp://server.example:5555", LATECOMER_DEVICE="cuda:1",
                       instance="3", host="gpu7")
    _, wp = parse(wargv[1:], tmp_path)
    assert wp["worker_id"] == "gpu7-3" and wp["device"] == "cuda:1" and wp["server"] == "tcp://server.example:5555"
    svc = {k: v for s, k, v in read_unit(worker) if s == "Service"}
    assert svc["Restart"] == "on-failure"  # exits 0 after the server's bye and stays down (test_systemd.py)
    assert svc["RestartPreventExitStatus"].split() == ["2", "3"]  # id in use, problem not allowed: config errors
    envs = [v for s, k, v in read_unit(worker) if k == "Environment"]
    assert "LATECOMER_DEVICE=cpu" in envs, "a default device for ${LATECOMER_DEVICE}"
    assert exec_start(server)[0] == wargv[0]


def test_the_sharded_recipe_and_the_shard_unit_parse(tmp_path):
    """deploy/README.md's multi-host sharded run: every command it gives parses, the shards name the
    coordinator's --shard-bind port and take the slots 0..N-1 of --shards N; the shard unit's too."""
    text = open(os.path.join(DEPLOY, "README.md"), encoding="utf-8").read()
    section = text.split("## A sharded server over several hosts", 1)[1].split("\n## ", 1)[0]
    cmds = [shlex.split(ln)[1:] for ln in section.splitlines() if ln.startswith("latecomer ")]
    parsed = [(argv[0], parse(argv, tmp_path)[1]) for argv in cmds]
    (serve,) = [p for c, p in parsed if c == "serve"]
    shards = [p for c, p in parsed if c == "shard"]
    assert serve["shards"] == len(shards) == 2 and serve["local_shards"] == 0 and serve["state_dir"]
    port = serve["shard_bind"].rsplit(":", 1)[1]
    assert {p["coordinator"].rsplit(":", 1)[1] for p in shards} == {port}
    assert sorted(p["slot"] for p in shards) == [0, 1] and all(p["state_dir"] and p["advertise"] for p in shards)
    (work,) = [p for c, p in parsed if c == "work"]
    assert work["server"].endswith(serve["bind"].rsplit(":", 1)[1])
    unit = os.path.join(UNITS, "latecomer-shard@.service")
    argv = exec_start(unit, LATECOMER_COORDINATOR="tcp://coord.example:5556", LATECOMER_SHARD_BIND="tcp://0.0.0.0:7000",
                      LATECOMER_SHARD_ADVERTISE="tcp://node1:7000", instance="1")
    _, p = parse(argv[1:], tmp_path)
    assert p["slot"] == 1 and p["state_dir"] == "/var/lib/latecomer/shard-1" and p["coordinator"].endswith(":5556")
    assert dict((k, v) for s, k, v in read_unit(unit))["Restart"] == "on-failure"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "latecomer")
    if not os.access(exe, os.X_OK):
        pytest.skip("no latecomer console script next to this python")
    for name in ("latecomer-server.service", "latecomer-worker@.service", "latecomer-shard@.service"):
        text = open(os.path.join(UNITS, name), encoding="utf-8").read()
        dest = name.replace("@.", "@0.")  # verify an instance of the template
        (tmp_path / dest).write_text(text.replace("/opt/latecomer/venv/bin/latecomer", exe))
        r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / dest)], capture_output=True, text=True,
                           timeout=30, env=dict(os.environ, SYSTEMD_LOG_LEVEL="warning"))
        complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if str(tmp_path) in ln or dest in ln]
        assert r.returncode == 0 and not complaints, r.stdout + r.stderr


# --------------------------------------------------------------------------- launch: hosts file and commands

def test_hosts_file_parses_devices_and_comments():
    hosts = lm.parse_hosts("# cluster\n\ngpu1 3 cuda   # three GPUs\ncpu1 2\nalice@cpu2 1 cpu\ngpu2 2 cuda:1\n")
    assert [(h.host, h.count, h.device, h.line) for h in hosts] == [
        ("gpu1", 3, "cuda", 3), ("cpu1", 2, "cpu", 4), ("alice@cpu2", 1, "cpu", 5), ("gpu2", 2, "cuda:1", 6)]
    ws = lm.plan(hosts, "/var/log")
    assert [(w.host, w.worker_id, w.device) for w in ws] == [
        ("gpu1", "gpu1-0", "cuda:0"), ("gpu1", "gpu1-1", "cuda:1"), ("gpu1", "gpu1-2", "cuda:2"),
        ("cpu1", "cpu1-0", "cpu"), ("cpu1", "cpu1-1", "cpu"), ("alice@cpu2", "cpu2-0", "cpu"),
        ("gpu2", "gpu2-0", "cuda:1"), ("gpu2", "gpu2-1", "cuda:1")]
    assert ws[0].log == "/var/log/latecomer-gpu1-0.log"
    assert lm.plan(lm.parse_hosts("g 1 cuda"))[0].device == "cuda"


@pytest.mark.parametrize("text,needle", [
    ("a 2\nb\n", "hosts:2: expected HOST COUNT [DEVICE]"),
    ("a 2 cpu extra\n", "hosts:1: expected HOST COUNT [DEVICE]"),
    ("a two\n", "hosts:1: COUNT must be a whole number, got 'two'"),
    ("\n\na 0\n", "hosts:3: COUNT must be between 1 and 1024"),
    ("a 1 tpu\n", "hosts:1: DEVICE must be cpu, cuda or cuda:N, got 'tpu'"),
    ("a;rm 1\n", "hosts:1: 'a;rm' is not a host name"),
    ("-oProxyCommand=x 1\n", "is not a host name"),
    ("a 1\n# c\na 2\n", "hosts:3: host 'a' already listed on line 1"),
    ("# nothing\n\n", "no hosts"),
])
def test_hosts_file_errors_name_the_line(text, needle):
    with pytest.raises(lm.LaunchError) as e:
        lm.parse_hosts(text, source="hosts")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_remote_commands_quote_and_parse(tmp_path):
    (w,) = lm.plan(lm.parse_hosts("h 1 cuda:2"), "/tmp/my logs")
    cmd = lm.remote_start_command(w, "tcp://10.0.0.1:5555", "~/venv/bin/latecomer", ("--credit", "2"))
    assert cmd.startswith("setsid nohup ~/venv/bin/latecomer work ") and cmd.endswith("& echo $!")
    assert "> '/tmp/my logs/latecomer-h-0.log' 2>&1 < /dev/null" in cmd
    argv = shlex.split(cmd.split(" > ")[0])[2:]
    _, p = parse(argv[1:], tmp_path)
    assert (p["server"], p["worker_id"], p["device"], p["credit"]) == ("tcp://10.0.0.1:5555", "h-0", "cuda:2", 2)
    assert lm.ssh_argv("ssh -p 2222", "h", cmd) == ["ssh", "-p", "2222", "-n", "-o", "BatchMode=yes", "h", cmd]
    stop = lm.remote_stop_command([12, 34], grace_s=2)
    assert "for p in 12 34;" in stop and "kill -TERM" in stop and "kill -KILL" in stop
    r = subprocess.run(["sh", "-n", "-c", stop], capture_output=True, timeout=10)
    assert r.returncode == 0, r.stderr


def test_launch_cli_dry_run_and_errors(tmp_path):
    from click.testing import CliRunner

    hosts = tmp_path / "hosts"
    hosts.write_text("node1 2 cuda\nnode2 1\n")
    cli = CliRunner()
    r = cli.invoke(main, ["launch", "--hosts", str(hosts), "--server", "tcp://srv:5555", "--dry-run",
                          "--ssh", "ssh -i key"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 3
    for line, (host, wid, dev) in zip(lines, [("node1", "node1-0", "cuda:0"), ("node1", "node1-1", "cuda:1"),
                                              ("node2", "node2-0", "cpu")], strict=True):
        argv = shlex.split(line)
        assert argv[:7] == ["ssh", "-i", "key", "-n", "-o", "BatchMode=yes", host]
        remote = shlex.split(argv[7].split(" > ")[0])
        assert remote[:3] == ["setsid", "nohup", "latecomer"]
        _, p = parse(remote[3:], tmp_path)
        assert (p["worker_id"], p["device"]) == (wid, dev)
    assert not (tmp_path / "latecomer-launch.json").exists()
    hosts.write_text("node1 2\nnode2 x\n")
    r = cli.invoke(main, ["launch", "--hosts", str(hosts), "--server", "tcp://srv:5555"])
    assert r.exit_code == 1 and f"{hosts}:2: COUNT must be a whole number" in r.output
    assert "Traceback" not in r.output
    r = cli.invoke(main, ["launch", "--hosts", str(hosts)])
    assert r.exit_code == 2 and "--server" in r.output
    r = cli.invoke(main, ["launch", "--stop", "--launch-file", str(tmp_path / "none.json")])
    assert r.exit_code == 1 and "cannot read launch file" in r.output
