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
    pure = [*(ROOT / "algorithms").glob("*.py"), *(ROOT / "protocol").glob("*.py"), ROOT / "ps" / "core.py",
            ROOT / "ps" / "sim.py", ROOT / "worker" / "compute.py", *(ROOT / "problems").glob("*.py")]
    assert len(pure) > 10
    for path in pure:
        bad = imported_modules(path) & FORBIDDEN
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_layering_only_the_shells_import_zmq():
    users = {str(p.relative_to(ROOT)) for d in ("ps", "worker", "protocol", "algorithms", "problems")
             for p in (ROOT / d).glob("*.py") if "zmq" in imported_modules(p)}
    # ps/supervise.py is a shell too: the supervisor in front of the daemon (issue 13 points 1-2).
    shells = {"ps/daemon.py", "worker/link.py", "ps/cli.py", "ps/security.py", "ps/status.py", "ps/supervise.py"}
    assert users <= shells, users


def test_layering_no_pickle_anywhere():
    for d in ("ps", "worker", "protocol", "algorithms", "problems"):
        for p in (ROOT / d).glob("*.py"):
            assert "pickle" not in imported_modules(p), p
