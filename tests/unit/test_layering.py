"""Dependencies point one way: the math and the core never touch sockets, clocks or threads."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN = {"zmq", "time", "threading", "socket", "asyncio", "pickle", "subprocess"}


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_layering_pure_modules_import_no_io():
    pure = [*(ROOT / "algorithms").glob("*.py"), *(ROOT / "protocol").glob("*.py"),
            *(ROOT / "ps" / "core").rglob("*.py"), ROOT / "ps" / "drivers" / "sim.py", ROOT / "worker" / "compute.py",
            *(ROOT / "problems").glob("*.py")]
    assert len(pure) > 10
    for path in pure:
        bad = imported_modules(path) & FORBIDDEN
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_layering_only_the_shells_import_zmq():
    """Exactly these modules touch ZeroMQ: the two ends' transports and the commands that open a
    socket of their own (the supervisor's front speaks ZMTP itself, without zmq)."""
    users = {str(p.relative_to(ROOT)) for d in ("ps", "worker", "protocol", "algorithms", "problems")
             for p in (ROOT / d).rglob("*.py") if "zmq" in imported_modules(p)}
    shells = {"ps/net/transport.py", "ps/drivers/daemon.py", "worker/link.py", "worker/keys.py", "ps/drivers/server.py",
              "ps/net/security.py", "ps/ops/status.py", "ps/net/supervise.py", "worker/sockio.py",
              "ps/sharded/shard.py", "ps/net/sealed.py", "worker/sealed.py",  # the sealed data sockets (§6.15)
              "ps/sharded/hub.py", "worker/shards.py",
              "ps/net/loopwait.py",  # the daemon loop's wait on its sockets' descriptors
              "ps/ops/conformance_net.py"}  # the conformance kit's fake server and shards
    assert users == shells, users ^ shells


def test_layering_the_worker_depends_on_protocol_not_on_the_server():
    """worker/ imports protocol/, problems/ and algorithms/ code, never ps/ (the server package)."""
    for p in (ROOT / "worker").rglob("*.py"):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            assert not any(n == "ps" or n.startswith("ps.") for n in names), f"{p.relative_to(ROOT)} imports {names}"


def test_layering_no_pickle_anywhere():
    for d in ("ps", "worker", "protocol", "algorithms", "problems"):
        for p in (ROOT / d).rglob("*.py"):
            assert "pickle" not in imported_modules(p), p


def test_no_function_in_the_server_or_the_worker_is_longer_than_60_lines():
    """A reader can follow each function of ps/ and worker/ (issue 14): none is longer than 60
    lines, docstring included."""
    long = []
    for d in ("ps", "worker"):
        for p in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
