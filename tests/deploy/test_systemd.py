"""deploy/README.md's systemd recipe started for real under systemd: a podman container whose PID 1
is systemd (tests/deploy/systemd_host.py, a Debian base made here with mmdebstrap) is the server
host and the worker host `host7` at once. The section's shell blocks run as written, as root with
sudo, in a copy of the checkout (the README's /path/to/latecomer), with only the placeholders
changed: /path/to/latecomer, `--max-steps 20000` (MAX_STEPS), SERVER_HOST (127.0.0.1) and
`{0..3}` (two instances). The copy of the two key files to the worker host is a `cp` into root's
home. The units are the working tree's deploy/systemd files, copied by the README's own `cp`.

Checked: the server trains to MAX_STEPS with lost 0 and two workers `host7-0`, `host7-1`, ends
`inactive`/`success`/0 and is not restarted; a `systemctl reload` while it runs re-reads the
allow-list; both worker units end `inactive`/`success`/0 after the server's bye and stay down
(not restarted); the GPU drop-in's text passes `systemd-analyze verify` and gives instance N
`cuda:N`. Root only; `make test-deploy` installs the tools (tests/deploy/install_containers.sh).
Measured stages go to CACHE/last-run-systemd.json."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.deploy import containers as C
from tests.deploy import systemd_host as S
from tests.deploy.conftest import require

SCRIPT = "install_containers.sh"
README = os.path.join(C.REPO, "deploy", "README.md")
MAX_STEPS = 1000  # instead of the README's 20000
WORKERS = 2  # instances, instead of the README's {0..3}
HOST = "host7"  # the README's worker host; the container's host name, so the worker ids are host7-N
REPORT: dict = {}
pytestmark = pytest.mark.timeout(1500)  # cold: mmdebstrap (about 2 minutes) and pip's downloads


def section_blocks(path: str = README) -> tuple[list[str], list[str]]:
    """The ```bash and ```ini blocks of the README's `## systemd` section, in order."""
    text = open(path, encoding="utf-8").read()
    section = text.split("\n## systemd\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```(\w+)\n(.*?)^```$", section, flags=re.S | re.M)
    return [b for lang, b in blocks if lang == "bash"], [b for lang, b in blocks if lang == "ini"]


def substitute(block: str, **changes: str) -> str:
    """``block`` with each placeholder replaced; a placeholder the README no longer has fails."""
    for old, new in changes.items():
        assert old in block, f"deploy/README.md's systemd block no longer has {old!r}:\n{block}"
        block = block.replace(old, new)
    return block


def _report() -> None:
    os.makedirs(C.CACHE, exist_ok=True)
    with open(os.path.join(C.CACHE, "last-run-systemd.json"), "w", encoding="utf-8") as f:
        json.dump({"timings_s": {k: v for k, v in C.TIMINGS.items() if "systemd" in k}, **REPORT}, f, indent=1)


@pytest.fixture(scope="module")
def host():
    """The booted systemd container, removed at the end whatever happened."""
    for tool in ("podman", "runc", "mmdebstrap"):
        require(tool, SCRIPT)
    if os.geteuid() != 0:
        pytest.fail("the systemd test needs root (rootful podman): run `make test-deploy` as root", pytrace=False)
    scope = C.Scope(f"lc-systemd-{os.getpid()}")
    failed = None
    try:
        try:
            with C.timed("systemd: base image"):
                image = S.base_image()
            booted = S.Host(scope, image, HOST)
        except C.Failed as e:
            failed = str(e)
        if failed:
            pytest.fail(failed, pytrace=False)
        yield booted
    finally:
        left = scope.close()
        _report()
        assert not left, f"not removed: {left}"


def test_the_readme_recipe_trains_and_every_unit_ends_clean(host):
    bash, _ = section_blocks()
    assert len(bash) == 4, f"the systemd section's 4 shell blocks (every host, server, worker host, added host): {bash}"
    every_host, server, worker_host, added_host = bash
    try:
        with C.timed("systemd: every host (useradd, venv, pip install)"):
            host.sh(substitute(every_host, **{"/path/to/latecomer": S.SRC}), timeout=900)
        with C.timed("systemd: server host, to listening"):
            # --min-workers: both workers are in before the first job, so both train (1,000 steps are soon over)
            host.sh(substitute(server, **{"--max-steps 20000": f"--max-steps {MAX_STEPS} --min-workers {WORKERS}"}),
                    timeout=120)
            host.wait_journal("latecomer-server", "listening on", timeout=90)
        # a worker host added while the server runs (no worker has joined yet: it is waiting)
        host.sh(added_host, timeout=120)
        host.wait_journal("latecomer-server", "allow-list loaded: 2 worker key(s)", timeout=30)
        assert host.show("latecomer-server")["ActiveState"] == "active", host.journal("latecomer-server")[-3000:]
        # the two key files "copied to your home folder on host7" (the same machine here)
        host.sh(f"cp /etc/latecomer/keys/workers/{HOST}.key_secret /etc/latecomer/keys/server.key ~/")
        with C.timed("systemd: workers started to the server's end"):
            host.sh(substitute(worker_host, **{"SERVER_HOST": "127.0.0.1", "{0..3}": f"{{0..{WORKERS - 1}}}"}),
                    timeout=120)
            host.wait_inactive(["latecomer-server"], timeout=300)
        units = [f"latecomer-worker@{i}" for i in range(WORKERS)]
        host.wait_inactive(units, timeout=60)
    except C.Failed as e:
        pytest.fail(str(e), pytrace=False)

    journal = host.journal("latecomer-server", *units)
    shown = {u: host.show(u) for u in ["latecomer-server", *units]}
    REPORT["units"] = shown
    clean = {"ActiveState": "inactive", "SubState": "dead", "Result": "success", "ExecMainStatus": "0",
             "NRestarts": "0"}
    for unit, props in shown.items():
        bad = {k: props.get(k) for k, v in clean.items() if props.get(k) != v}
        assert not bad, (f"{unit} did not end clean and stay down: {bad} (want {clean}); an `activating`/"
                         f"`auto-restart` unit is being restarted\n{journal[-4000:]}")
    assert f"latecomer: stopped (reached {MAX_STEPS} steps)" in journal, journal[-3000:]
    assert journal.count("server said bye") == WORKERS, journal[-3000:]

    summary = json.loads(host.read("/var/lib/latecomer/state/summary.json"))
    events = [json.loads(ln) for ln in host.read("/var/lib/latecomer/state/events.jsonl").splitlines() if ln.strip()]
    joined = [e["worker_id"] for e in events if e["ev"] == "joined"]
    applied: dict[str, int] = {}
    for e in events:
        if e["ev"] == "applied":
            applied[e["worker_id"]] = applied.get(e["worker_id"], 0) + 1
    last = summary["evaluations"][-1]
    REPORT["run"] = {"steps": summary["version"], "stopped": summary["stopped"], "lost": summary["counters"]["lost"],
                     "joined": joined, "applied_by": applied, "accuracy": last.get("accuracy")}
    assert summary["version"] == MAX_STEPS, summary["stopped"]
    assert summary["counters"]["lost"] == 0, summary["counters"]
    assert sorted(set(joined)) == [f"{HOST}-{i}" for i in range(WORKERS)], f"ids HOST-N: {joined}"
    assert set(applied) == set(joined), f"both workers trained: {applied}"
    owner = host.exec(["stat", "-c", "%U", "/var/lib/latecomer/state/summary.json"], timeout=60).stdout.strip()
    assert owner == "latecomer", f"the state belongs to {owner}, not the service's user"


def test_the_gpu_drop_in_parses(host):
    """The README's drop-in, written where its first line says: `systemd-analyze verify` accepts
    the worker unit with it and instance N gets LATECOMER_DEVICE=cuda:N (no GPU is used)."""
    _, ini = section_blocks()
    assert len(ini) == 1, ini
    first, _, body = ini[0].partition("\n")
    path = first.removeprefix("# ").strip()
    assert path == "/etc/systemd/system/latecomer-worker@.service.d/gpu.conf", first
    try:
        host.write(path, body)
        host.sh("systemctl daemon-reload")
        r = host.exec(["systemd-analyze", "verify", "latecomer-worker@1.service"], timeout=60, check=False)
        env = host.exec(["systemctl", "show", "-p", "Environment", "latecomer-worker@1"], timeout=60).stdout
    except C.Failed as e:
        pytest.fail(str(e), pytrace=False)
    finally:
        host.sh(f"rm -f {path} && systemctl daemon-reload", check=False)
    assert r.returncode == 0 and not r.stderr.strip(), f"systemd-analyze verify: {r.stdout}{r.stderr}"
    assert "LATECOMER_DEVICE=cuda:1" in env.split("=", 1)[1].split(), env
