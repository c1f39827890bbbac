"""The Kubernetes manifests rendered by a real ``kubectl kustomize`` (the base and every overlay,
with keys made by ``latecomer keys init`` as deploy/README.md says) and validated with
``kubernetes-validate --strict`` against the oldest and the newest Kubernetes the README claims.
No cluster can be had on these machines, so nothing is applied: what a cluster would reject in
the manifests themselves is caught here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.deploy.conftest import REPO, require

K8S = os.path.join(REPO, "deploy", "k8s")
VERSIONS = ("1.27", "1.37")  # deploy/README.md: kubectl >= 1.27; the newest kubernetes-validate knows
OVERLAYS = sorted(os.listdir(os.path.join(K8S, "overlays")))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of deploy/k8s with keys in base/keys, made as the README says."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, root)
    latecomer = [sys.executable, "-m", "ps"]
    env = dict(os.environ, PYTHONPATH=REPO)
    for args in (["keys", "init", "keys"], ["keys", "add-worker", "worker", "--keys", "keys"]):
        subprocess.run([*latecomer, *args], cwd=root / "base", env=env, check=True, capture_output=True, timeout=120)
    return root


def render(tree, target: str, tmp_path) -> tuple[list[dict], str]:
    kubectl = require("kubectl", "install_k8s.sh")
    r = subprocess.run([kubectl, "kustomize", str(tree / target)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {target}: {r.stderr.strip()}"
    out = tmp_path / (target.replace("/", "_") + ".yaml")
    out.write_text(r.stdout)
    return [d for d in yaml.safe_load_all(r.stdout) if d], str(out)


def validate(path: str) -> None:
    tool = require("kubernetes-validate", "install_k8s.sh")
    for v in VERSIONS:
        r = subprocess.run([tool, "--strict", "-k", v, path], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"kubernetes-validate --strict -k {v}: {r.stdout}{r.stderr}"
        assert "passed" in r.stdout and "failed" not in r.stdout, r.stdout


def kinds(docs: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d["metadata"]["name"])
    return out


def test_base_renders_and_validates(tree, tmp_path):
    docs, path = render(tree, "base", tmp_path)
    k = kinds(docs)
    assert k["Namespace"] == ["latecomer"]
    assert sorted(k["Secret"]) == ["latecomer-server-keys", "latecomer-worker-keys"]
    assert k["StatefulSet"] == ["latecomer-server"] and k["Service"] == ["latecomer-server"]
    assert k["Deployment"] == ["latecomer-worker"]
    assert all(d["metadata"].get("namespace") == "latecomer" for d in docs if d["kind"] != "Namespace")
    validate(path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_validates(tree, tmp_path, overlay):
    """Before the base had a folder of its own, the GPU overlay sat inside it and kustomize
    refused it: ``cycle detected: candidate root ... contains visited root``."""
    docs, path = render(tree, f"overlays/{overlay}", tmp_path)
    base, _ = render(tree, "base", tmp_path)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {(d["kind"], d["metadata"]["name"]) for d in base} <= names, "an overlay keeps the whole base"
    if overlay == "gpu":
        (gpu,) = [d for d in docs if d["metadata"]["name"] == "latecomer-worker-gpu"]
        (c,) = gpu["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"] == "latecomer:cuda"
        assert gpu["metadata"]["namespace"] == "latecomer"
    validate(path)


def test_secrets_hold_the_keys_the_pods_mount(tree, tmp_path):
    """The secret generator reads base/keys (made by `latecomer keys init keys` there): the server
    secret has the server's pair and the worker's allow-list entry, the worker secret the worker's
    pair and the server's public key, each the file `keys init` wrote."""
    import base64

    docs, _ = render(tree, "base", tmp_path)
    sec = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    keys = tree / "base" / "keys"
    expect = {
        "latecomer-server-keys": {"server.key": "server.key", "server.key_secret": "server.key_secret",
                                  "authorized-worker.key": "authorized/worker.key"},
        "latecomer-worker-keys": {"worker.key_secret": "workers/worker.key_secret", "server.key": "server.key"},
    }
    for name, files in expect.items():
        assert set(sec[name]) == set(files)
        for k, f in files.items():
            assert base64.b64decode(sec[name][k]) == (keys / f).read_bytes()
