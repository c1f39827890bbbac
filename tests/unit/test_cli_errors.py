"""Bad command-line values give one line naming the fix and exit 2 (usage) or 1, never a
traceback (issue 12 item 6): endpoints, output paths, numbers, default worker ids under
CurveZMQ, --problem's help, the README's algorithm table, and TOML on Python 3.10."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from ps.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def error_line(output: str) -> str:
    """The one ``Error:`` line of a refused command."""
    lines = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, output
    return lines[0]


def assert_refused(r, needle: str, code: int = 2) -> None:
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == code, r.output
    line = error_line(r.output)
    assert needle in line, line


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working directory holding a file ``afile``, a folder ``adir`` and a hosts file."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    (tmp_path / "hosts.txt").write_text("localhost 1\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --------------------------------------------------------------------------- 1. endpoints

ENDPOINT_CASES = [
    (["work", "--server", "tcp://127.0.0.1"], "give tcp://127.0.0.1:PORT"),
    (["work", "--server", "tcp://127.0.0.1:0"], "port 0 is out of range: give 1-65535"),
    (["work", "--server", "inproc://x"], "inproc:// reaches only sockets inside one process"),
    (["work", "--server", "tcp://*:5555"], "connect to the server's host name or address"),
    (["status", "--server", "garbage"], "expected tcp://HOST:PORT or ipc://PATH"),
    (["status", "--server", "tcp://127.0.0.1:99999"], "port 99999 is out of range: give 1-65535"),
    (["status", "--server", "tcp://::1:5555"], "tcp://[::1]:5555"),
    (["serve", "--bind", "127.0.0.1:5694"], "did you mean tcp://127.0.0.1:5694?"),
    (["serve", "--bind", "tcp://127.0.0.1:99999"], "give 1-65535 (0: any free port)"),
    (["serve", "--bind", "tcp://127.0.0.1"], "port 0: any free port"),
    (["serve", "--bind", "tcp://[::1"], "IPv6 in brackets"),
    (["launch", "--hosts", "hosts.txt", "--server", "garbage", "--dry-run"], "expected tcp://HOST:PORT"),
    (["launch", "--hosts", "hosts.txt", "--server", "tcp://0.0.0.0:5555", "--dry-run"],
     "give the server host's name or address"),
    (["launch", "--hosts", "hosts.txt", "--server", "tcp://h:70000", "--dry-run"], "give 1-65535"),
]


@pytest.mark.parametrize("args,fix", ENDPOINT_CASES, ids=[" ".join(a) for a, _ in ENDPOINT_CASES])
def test_cli_errors_bad_endpoints(here, args, fix):
    r = CliRunner().invoke(main, args)
    assert_refused(r, fix)
    assert "--server" in r.output or "--bind" in r.output  # the option is named


def test_cli_errors_bad_endpoint_from_the_environment(here):
    r = CliRunner().invoke(main, ["work"], env={"LATECOMER_SERVER": "garbage"})
    assert_refused(r, "expected tcp://HOST:PORT or ipc://PATH")


@pytest.mark.parametrize("cmd", [["serve"], ["work", "--server", "tcp://127.0.0.1:5555"]], ids=["serve", "work"])
@pytest.mark.parametrize("value", ["0", "abc", "-2", "65"])
def test_cli_errors_bad_cipher_threads_from_the_environment(here, cmd, value):
    """LATECOMER_CIPHER_THREADS (protocol/seal.py) is checked before anything starts."""
    r = CliRunner().invoke(main, cmd, env={"LATECOMER_CIPHER_THREADS": value})
    assert_refused(r, "expected an integer from 1 to 64")
    assert "LATECOMER_CIPHER_THREADS" in r.output


@pytest.mark.parametrize("cmd", [["serve"], ["work", "--server", "tcp://127.0.0.1:5555"]], ids=["serve", "work"])
def test_cli_errors_bad_seal_ciphers_from_the_environment(here, cmd):
    """LATECOMER_SEAL_CIPHERS (protocol/seal.py) is checked before anything starts."""
    r = CliRunner().invoke(main, cmd, env={"LATECOMER_SEAL_CIPHERS": "aes256gcm,chacha"})
    assert_refused(r, "unknown cipher 'chacha'")
    assert "LATECOMER_SEAL_CIPHERS" in r.output


def test_cli_errors_seal_cipher_that_is_not_here(here):
    """serve --seal-cipher aegis256x4 where AEGIS is not available: one line saying how to get it."""
    r = CliRunner().invoke(main, ["serve", "--seal-cipher", "aegis256x4"], env={"LATECOMER_SEAL_CIPHERS": "aes256gcm"})
    assert_refused(r, "AEGIS-256X4 is not available here")


@pytest.mark.parametrize("value", ["-1", "100001", "abc", "1.5"])
def test_cli_errors_bad_busy_poll(here, value):
    r = CliRunner().invoke(main, ["serve", "--busy-poll-us", value])
    assert_refused(r, "--busy-poll-us")


def _console() -> list[str]:
    exe = ROOT / ".venv" / "bin" / "latecomer"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ps"]


@pytest.mark.parametrize("args,fix", [
    (["work", "--server", "tcp://127.0.0.1"], "give tcp://127.0.0.1:PORT"),
    (["status", "--server", "garbage"], "expected tcp://HOST:PORT or ipc://PATH"),
    (["status", "--server", "tcp://127.0.0.1:99999"], "port 99999 is out of range"),
    (["serve", "--bind", "127.0.0.1:5694"], "did you mean tcp://127.0.0.1:5694?"),
    (["serve", "--state", "afile/sub"], "afile is a file, not a directory"),
])
def test_cli_errors_console_script(here, args, fix):
    """The issue's examples through the installed console script: exit 2, one line, no traceback."""
    p = subprocess.run(_console() + args, capture_output=True, text=True, timeout=60, cwd=here)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert fix in error_line(p.stderr)
    assert "keys" not in error_line(p.stderr)  # no misleading talk of --keys for a malformed --bind


# --------------------------------------------------------------------------- 2. output paths

PATH_CASES = [
    (["serve", "--state", "afile/sub"], "cannot create afile/sub: afile is a file, not a directory"),
    (["serve", "--state", "afile"], "'afile' is a file"),  # click.Path's own check
    (["serve", "--out", "afile/sub"], "afile is a file, not a directory"),
    (["serve", "--events", "afile/x.jsonl"], "afile is a file, not a directory"),
    (["serve", "--events", "adir/nodir/x.jsonl"], "directory adir/nodir does not exist: create it first"),
    (["serve", "--events", "adir"], "'adir' is a directory"),
    (["run", "--out", "afile/sub"], "afile is a file, not a directory"),
    (["simulate", "--out", "afile/sub"], "afile is a file, not a directory"),
    (["replay", "adir", "--algorithm", "asgd", "--out", "afile/sub"], "afile is a file, not a directory"),
    (["report", "adir", "--out", "afile/sub"], "afile is a file, not a directory"),
    (["chaos", "--state", "afile/sub"], "afile is a file, not a directory"),
    (["keys", "init", "afile/sub"], "afile is a file, not a directory"),
    (["experiment", "ordered-momentum", "--quick", "--out", "afile/sub"], "afile is a file, not a directory"),
    (["bench", "--quick", "--out", "afile/x.md"], "afile is a file, not a directory"),
    (["launch", "--hosts", "hosts.txt", "--server", "tcp://127.0.0.1:5555", "--ssh", "/bin/false",
      "--launch-file", "afile/x.json"], "afile is a file, not a directory"),
]


@pytest.mark.parametrize("args,fix", PATH_CASES, ids=[" ".join(a) for a, _ in PATH_CASES])
def test_cli_errors_bad_output_paths(here, args, fix):
    r = CliRunner().invoke(main, args)
    assert_refused(r, fix)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize("args", [["serve", "--state", "/proc/nope/x"], ["serve", "--out", "/proc/self"],
                                  ["serve", "--events", "/proc/nope/x.jsonl"], ["keys", "init", "/proc/nope/k"]])
def test_cli_errors_paths_that_cannot_be_created(here, args):
    r = CliRunner().invoke(main, args)
    assert_refused(r, "/proc/")
    assert "you can write to" in r.output or "create it first" in r.output


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_cli_errors_unwritable_directory(here):
    ro = here / "ro"
    ro.mkdir(mode=0o500)
    try:
        assert_refused(CliRunner().invoke(main, ["serve", "--out", "ro"]), "cannot write into ro")
        assert_refused(CliRunner().invoke(main, ["serve", "--state", "ro/sub"]), "cannot create ro/sub")
    finally:
        ro.chmod(0o700)


def test_cli_errors_path_checks_leave_nothing_behind(here):
    """The probe creates the missing levels and removes them again: a refused command leaves no
    directories (here --bind is refused after --state was probed)."""
    r = CliRunner().invoke(main, ["serve", "--state", "new/deeper/state", "--out", "new2", "--events",
                                  "adir/e.jsonl", "--bind", "garbage"])
    assert_refused(r, "expected tcp://HOST:PORT")
    assert not (here / "new").exists() and not (here / "new2").exists()
    assert sorted(p.name for p in (here / "adir").iterdir()) == []


def test_cli_errors_path_helpers(tmp_path):
    from ps.cli.paths import OutputPathError, check_output_dir, check_output_file

    existing = tmp_path / "log.jsonl"
    existing.write_text("keep\n")
    assert check_output_file(str(existing)) == str(existing) and existing.read_text() == "keep\n"
    assert check_output_dir(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    assert check_output_file(str(tmp_path / "x" / "y.json"), make_parents=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]
    os.symlink(tmp_path / "missing", tmp_path / "dangling")
    with pytest.raises(OutputPathError, match="broken link"):
        check_output_dir(str(tmp_path / "dangling"))


# --------------------------------------------------------------------------- 7. other values

VALUE_CASES = [
    (["work", "--server", "tcp://127.0.0.1:5555", "--delay", "nan"], "must be a finite number, got nan"),
    (["work", "--server", "tcp://127.0.0.1:5555", "--jitter", "inf"], "must be a finite number, got inf"),
    (["work", "--server", "tcp://127.0.0.1:5555", "--slowdown", "nan"], "must be a finite number"),
    (["work", "--server", "tcp://127.0.0.1:5555", "--device", "cuda:x"], "expected cpu, cuda or cuda:N"),
    (["work", "--server", "tcp://127.0.0.1:5555", "--device", "cpu:0"], "expected cpu, cuda or cuda:N"),
    (["serve", "--target-loss", "nan"], "must be a finite number"),
    (["serve", "--checkpoint-interval", "inf"], "must be a finite number"),
    (["simulate", "--crash", "0@-1"], "TIME and REJOIN must be finite seconds >= 0"),
    (["simulate", "--crash", "0@nan"], "TIME and REJOIN must be finite seconds >= 0"),
    (["simulate", "--crash", "0@1+-3"], "TIME and REJOIN must be finite seconds >= 0"),
    (["serve", "--algorithm", "snapshot-vr", "--problem", "quadratic", "--state", "adir/s"],
     "snapshot-vr needs num_samples"),  # refused on the iterate, before run.json is written
]


@pytest.mark.parametrize("args,fix", VALUE_CASES, ids=[" ".join(a) for a, _ in VALUE_CASES])
def test_cli_errors_bad_values(here, args, fix):
    assert_refused(CliRunner().invoke(main, args), fix)


# --------------------------------------------------------------------------- 5. --problem's help

@pytest.mark.parametrize("command", ["serve", "run", "simulate"])
def test_cli_errors_problem_help_lists_every_builtin(command):
    from problems.loader import BUILTIN_PROBLEMS

    r = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert r.exit_code == 0
    m = re.search(r"Built-in problem \(([^)]*)\)", " ".join(r.output.split()))
    assert m, r.output
    assert [s.strip() for s in m.group(1).split(",")] == list(BUILTIN_PROBLEMS)


# --------------------------------------------------------------------------- 6. README tables

def markdown_tables(text: str) -> tuple[list[list[list[str]]], list[int]]:
    """The tables of a markdown text (each a list of rows of cells, header first; a table's rows
    run from its header to the next line that is not a row) and the line numbers of rows that
    belong to no table (a stray blank line cuts a table: what follows has no header)."""
    lines = text.splitlines()
    tables, orphans, i = [], [], 0
    fence = False
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("|"):
            if i + 1 < len(lines) and re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?", lines[i + 1].strip()):
                rows = [_cells(line)]
                i += 2
                while i < len(lines) and lines[i].strip().startswith("|"):
                    rows.append(_cells(lines[i].strip()))
                    i += 1
                tables.append(rows)
                continue
            orphans.append(i + 1)
        i += 1
    return tables, orphans


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def test_cli_errors_readme_algorithm_table_lists_every_algorithm():
    import algorithms

    tables, orphans = markdown_tables((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not orphans, f"README.md lines {orphans}: table rows outside a table (a stray blank line?)"
    alg_tables = [t for t in tables if t[0][:3] == ["name", "id", "paper"]]
    assert len(alg_tables) == 1, "README.md has one algorithm table (| name | id | paper |)"
    listed = {n for row in alg_tables[0][1:] for n in re.findall(r"`([^`]+)`", row[0])}
    missing = sorted(set(algorithms.ALGORITHMS) - listed)
    assert not missing, f"README.md's algorithm table lacks {missing}"


def test_cli_errors_table_parser_catches_a_stray_blank_line():
    good = "| name | id | paper |\n|---|---|---|\n| `a` | A1 | x |\n| `b` | A2 | y |\n\ntext\n"
    tables, orphans = markdown_tables(good)
    assert orphans == [] and [r[0] for r in tables[0]] == ["name", "`a`", "`b`"]
    tables, orphans = markdown_tables(good.replace("| `b`", "\n| `b`"))
    assert orphans == [5] and [r[0] for r in tables[0]] == ["name", "`a`"]


# --------------------------------------------------------------------------- 3. Python 3.10 and TOML

def test_cli_errors_tomllib_imports_are_guarded():
    """Every ``import tomllib`` falls back to ``tomli`` (requires-python says 3.10, which lacks it)."""
    offenders = []
    for d in ("ps", "worker", "protocol", "algorithms", "problems", "experiments", "benchmarks", "latecomer"):
        for path in (ROOT / d).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            guarded = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Try) and any(
                        isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                        and any(isinstance(n, ast.Import) and n.names[0].name == "tomli" for n in ast.walk(h))
                        for h in node.handlers):
                    guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
            for node in ast.walk(tree):
                uses = (isinstance(node, ast.Import) and any(a.name == "tomllib" for a in node.names)) or \
                    (isinstance(node, ast.ImportFrom) and node.module == "tomllib")
                if uses and id(node) not in guarded:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"unguarded tomllib imports (use try/except ModuleNotFoundError: import tomli): {offenders}"


def test_cli_errors_python_version_promises_agree():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert meta["project"]["requires-python"] == ">=3.10"
    assert meta["tool"]["ruff"]["target-version"] == "py310"
    deps = [re.sub(r"\s", "", d) for d in meta["project"]["dependencies"]]
    assert any(d.startswith("tomli>=") and "python_version<'3.11'" in d.replace('"', "'") for d in deps), deps
    assert "Python 3.10+" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_cli_errors_config_reads_with_tomli_where_tomllib_is_missing(tmp_path):
    """Python 3.10 simulated: ``tomllib`` cannot be imported, ``tomli`` (same API) can."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[problem]\nname = "quadratic"\nd = 8\n')
    code = textwrap.dedent(f"""
        import sys, types
        import tomllib as real
        fake = types.ModuleType("tomli")
        fake.load, fake.loads, fake.TOMLDecodeError = real.load, real.loads, real.TOMLDecodeError
        sys.modules["tomli"], sys.modules["tomllib"] = fake, None  # None: import tomllib fails
        import click
        import ps.cli.options
        assert ps.cli.options.tomllib is fake
        spec = ps.cli.options.training_spec(None, (), None, (), {str(cfg)!r}, default_problem="digits",
                                    default_algorithm="asgd")
        assert spec.problem == "quadratic" and spec.problem_options == {{"d": 8}}, spec
        open({str(cfg)!r}, "w").write("[problem")
        try:
            ps.cli.options.training_spec(None, (), None, (), {str(cfg)!r}, default_problem="digits",
                                      default_algorithm="asgd")
        except click.BadParameter as e:
            assert "not valid TOML" in str(e)
        else:
            raise AssertionError("bad TOML accepted")
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


# --------------------------------------------------------------------------- 4. default worker ids

@pytest.fixture
def keys_dir(tmp_path):
    d = tmp_path / "keys"
    r = CliRunner()
    assert r.invoke(main, ["keys", "init", str(d)]).exit_code == 0
    for name in ("gpu7", "worker"):
        res = r.invoke(main, ["keys", "add-worker", name, "--keys", str(d)])
        assert res.exit_code == 0, res.output
    return d


def test_cli_errors_key_name_from_the_key_file(keys_dir, tmp_path):
    import shutil

    import zmq.auth

    from worker.identity import key_name

    assert key_name(str(keys_dir / "workers" / "gpu7.key_secret")) == "gpu7"
    renamed = tmp_path / "worker_key"  # e.g. a compose secret: the name comes from inside the file
    shutil.copy(keys_dir / "workers" / "gpu7.key_secret", renamed)
    assert key_name(str(renamed)) == "gpu7"
    _, old = zmq.auth.create_certificates(str(tmp_path), "old-style")  # made before the metadata
    assert key_name(old) == "old-style"
    shutil.copy(old, tmp_path / "plain")
    assert key_name(str(tmp_path / "plain")) == "plain"


def test_cli_errors_base_id_is_the_key_name_on_its_own_host(keys_dir):
    from worker.identity import BASE_MAX, base_id

    gpu7, shared = str(keys_dir / "workers" / "gpu7.key_secret"), str(keys_dir / "workers" / "worker.key_secret")
    assert base_id(gpu7, "gpu7") == "gpu7" and base_id(gpu7, "GPU7.cluster.example") == "gpu7"
    assert base_id(shared, "latecomer-worker-5d8c7-x2k4p") == "worker@latecomer-worker-5d8c7-x2k4p"
    assert len(base_id(shared, "h" * 80)) == BASE_MAX


def test_cli_errors_default_ids_of_one_key_on_one_host_differ(keys_dir, tmp_path):
    from worker.identity import claim_default_id

    key, locks = str(keys_dir / "workers" / "gpu7.key_secret"), str(tmp_path / "locks")
    a, b, c = (claim_default_id(key, host="gpu7", locks=locks) for _ in range(3))
    assert [a.worker_id, b.worker_id, c.worker_id] == ["gpu7", "gpu7-2", "gpu7-3"]
    b.release()
    assert claim_default_id(key, host="gpu7", locks=locks).worker_id == "gpu7-2"  # the free one, again
    assert claim_default_id(None, host="gpu7", pid=42).worker_id == "gpu7-42"  # no CurveZMQ: HOST-PID
    (tmp_path / "file").write_text("")
    assert claim_default_id(key, host="gpu7", pid=42, locks=str(tmp_path / "file" / "x")).worker_id == "gpu7-42"


def test_cli_errors_a_dead_workers_id_is_free_again(keys_dir, tmp_path):
    """The claim is a flock: the kernel drops it when the process dies (kill -9 included)."""
    from worker.identity import claim_default_id

    key, locks = str(keys_dir / "workers" / "gpu7.key_secret"), str(tmp_path / "locks")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from worker.identity import claim_default_id
        c = claim_default_id({key!r}, host="gpu7", locks={locks!r})
        print(c.worker_id, flush=True)
        time.sleep(60)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "gpu7"
        mine = claim_default_id(key, host="gpu7", locks=locks)
        assert mine.worker_id == "gpu7-2"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        child.stdout.close()
    assert claim_default_id(key, host="gpu7", locks=locks).worker_id == "gpu7"


def test_cli_errors_worker_default_id_is_the_key_name(keys_dir, tmp_path, monkeypatch):
    import tempfile

    import worker.identity
    from worker.link import Worker, WorkerConfig

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(worker.identity, "host_name", lambda: "gpu7")
    cfg = WorkerConfig(server="tcp://127.0.0.1:1", key_secret=str(keys_dir / "workers" / "gpu7.key_secret"),
                       server_key=str(keys_dir / "server.key"))
    first, second = Worker(cfg), Worker(cfg)
    assert (first.worker_id, second.worker_id) == ("gpu7", "gpu7-2")
    first._close()  # its id is free for the next worker of this key
    third = Worker(cfg)
    assert third.worker_id == "gpu7"
    assert Worker(WorkerConfig(server="tcp://127.0.0.1:1", worker_id="mine")).worker_id == "mine"
    for w in (second, third):
        w._close()


def test_cli_errors_two_workers_under_one_id_knock_each_other_out():
    """Why one key's workers need distinct ids: the server takes a hello with a known id and a new
    boot for a restart and writes the other incarnation off, back and forth."""
    import numpy as np

    import algorithms
    from protocol.messages import Hello, Ready
    from ps.core.config import CoreConfig
    from ps.core.server_core import ServerCore

    core = ServerCore(algorithms.build("asgd", {"lr": 0.1}), np.ones(4, np.float32), CoreConfig())
    for t, boot in enumerate((1, 2, 1, 2)):  # two processes both calling themselves gpu7
        core.handle("gpu7", Hello(worker_id="gpu7", boot=boot, credit=1), float(t))
        core.handle("gpu7", Ready(credit=1), float(t))
    left = [e for e in core.events if e["ev"] == "left"]
    assert [e["reason"] for e in left] == ["restarted"] * 3 and core.counters.lost >= 3


# --------------------------------------------------------------------------- the conformance kit

CONFORMANCE_CASES = [
    (["conformance"], "Missing option '--worker'"),
    (["conformance", "--worker", "latecomer work --server tcp://127.0.0.1:5555"], "needs {endpoint}"),
    (["conformance", "--worker", "no-such-program-here {endpoint}"], "no program 'no-such-program-here'"),
    (["conformance", "--worker", "'unbalanced {endpoint}"], "not a command line"),
    (["conformance", "--worker", f"{sys.executable} {{endpoint}}", "--case", "nope"], "unknown case(s): nope"),
    (["conformance", "--worker", f"{sys.executable} {{endpoint}}", "--case", "bye", "--sharded"], "no case left"),
]


@pytest.mark.parametrize("args,needle", CONFORMANCE_CASES)
def test_conformance_refuses_a_bad_command_or_case_in_one_line(args, needle):
    """Nothing is started: every refusal comes before the kit binds or spawns anything."""
    assert_refused(CliRunner().invoke(main, args), needle)
