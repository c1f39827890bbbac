"""The house's plan, checked: which package of ps/ may import which, no import circles anywhere,
and no class or function too long to follow (issue 27; docs/ARCHITECTURE.md "Who may import whom").

Every import counts, at module level or inside a function: a lazy import hides an arrow from the
reader, not from the plan. A new arrow that the plan does not allow fails here with its file and
line; the fix is to move the code to the package it belongs to, or to change the plan (and
ARCHITECTURE.md) on purpose.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE = ("ps", "worker", "protocol", "algorithms", "problems", "latecomer", "benchmarks", "experiments")

# The packages of ps/, lowest first, and what each may import of ps/ (itself always). The rest of the
# project (algorithms/, protocol/, problems/) is below all of them; worker/ is beside, never under ps/.
PS_ALLOWED: dict[str, set[str]] = {
    "ps.core": set(),
    "ps.journal": {"ps.core"},
    "ps.net": {"ps.core", "ps.journal"},
    "ps.sharded": {"ps.core", "ps.journal", "ps.net"},
    "ps.observe": {"ps.core"},
    "ps.drivers": {"ps.core", "ps.journal", "ps.net", "ps.sharded", "ps.observe"},
    "ps.ops": {"ps.core", "ps.journal", "ps.net", "ps.drivers", "ps.observe"},
    "ps.cli": {"ps.core", "ps.journal", "ps.net", "ps.sharded", "ps.observe", "ps.drivers", "ps.ops", "latecomer",
               "worker"},
    "ps": {"ps.cli"},  # ps/__main__.py: ``python -m ps``
}
# The rest of the project: what each top-level package may import of the project's packages.
PROJECT_ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "algorithms": {"protocol"},
    "problems": {"protocol", "algorithms"},
    "worker (shared)": {"protocol", "algorithms", "problems"},
    "worker": {"protocol", "algorithms", "problems", "worker (shared)"},
    # The public API drives the server's packages, never its command line (the CLI may use the API).
    "latecomer": {"protocol", "algorithms", "problems", "worker", "worker (shared)", "ps.core", "ps.journal", "ps.net",
                  "ps.sharded", "ps.observe", "ps.drivers", "ps.ops"},
}
# Three modules of worker/ are what both ends share: one job's gradients (the server recomputes a
# journaled reply's from its seed; the simulator computes them), key files, and frame I/O on a socket.
# The server imports these and nothing else of worker/ (the command line runs a worker: all of it).
WORKER_SHARED = {"worker.compute", "worker.keys", "worker.sockio"}
BELOW_PS = {"protocol", "algorithms", "problems", "worker (shared)"}
PS_PACKAGES = sorted(PS_ALLOWED, key=len, reverse=True)


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for top in CODE:
        for p in (ROOT / top).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(path: pathlib.Path, name: str, known: dict[str, pathlib.Path]) -> list[tuple[str, int]]:
    """The project's modules that ``path`` (module ``name``) imports, with the line of each import."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds this module
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:  # ``from pkg import submodule`` imports the submodule
                sub = f"{base}.{a.name}"
                out.append((sub if sub in known else base, node.lineno))
    resolved = []
    for mod, line in dict.fromkeys(out):
        while mod and mod not in known:  # ``import ps.journal.wal.os``-like attribute paths
            mod = mod.rpartition(".")[0]
        if mod:
            resolved.append((mod, line))
    return resolved


def package_of(mod: str) -> str:
    if mod in WORKER_SHARED:
        return "worker (shared)"
    if mod.startswith("ps.") or mod == "ps":
        return next((p for p in PS_PACKAGES if mod == p or mod.startswith(p + ".")), "ps")
    return mod.split(".")[0]


def test_every_module_of_ps_belongs_to_a_package_of_the_plan():
    loose = [m for m in modules() if m.startswith("ps.") and package_of(m) == "ps" and m != "ps.__main__"]
    assert not loose, f"modules of ps/ outside its packages: {loose} (ps/__init__.py says where each kind goes)"


def test_imports_follow_the_plan():
    known = modules()
    wrong = []
    for name, path in known.items():
        here = package_of(name)
        allowed = PS_ALLOWED[here] | BELOW_PS if here in PS_ALLOWED else PROJECT_ALLOWED.get(here)
        if allowed is None:  # benchmarks/, experiments/: tools over everything
            continue
        for mod, line in imports(path, name, known):
            there = package_of(mod)
            if there != here and there not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {mod} ({there})")
    assert not wrong, "\n".join(wrong)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles_between_modules():
    known = modules()
    graph = {name: {m for m, _ in imports(path, name, known) if m != name} for name, path in known.items()}
    # A package's __init__ that imports its own modules is a face, not a circle with them.
    for name in graph:
        graph[name] = {m for m in graph[name] if not (known[name].name == "__init__.py" and m.startswith(name + "."))
                       and not (known.get(m) and known[m].name == "__init__.py" and name.startswith(m + "."))}
    assert not circles(graph), circles(graph)


def test_circle_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_class_in_the_server_or_the_worker_is_longer_than_400_lines():
    long = []
    for d in ("ps", "worker"):
        for p in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_each_package_of_ps_says_what_it_owns_and_may_import():
    for pkg in PS_ALLOWED:
        if pkg == "ps":
            continue
        init = ROOT / pkg.replace(".", "/") / "__init__.py"
        doc = " ".join((ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or "").split())
        assert "May import" in doc, f"{init.relative_to(ROOT)}: its docstring must say what it may import"


def test_the_architecture_and_contributing_guides_name_files_that_exist():
    """docs/ARCHITECTURE.md and CONTRIBUTING.md send a newcomer to files: each must be there, and
    every package of the plan must be in the architecture's table."""
    import re

    arch = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for pkg in PS_ALLOWED:
        if pkg != "ps":
            assert f"`{pkg.replace('.', '/')}/`" in arch, f"docs/ARCHITECTURE.md does not describe {pkg}"
    for doc in (ROOT / "docs" / "ARCHITECTURE.md", ROOT / "CONTRIBUTING.md"):
        if not doc.exists():
            continue
        text = doc.read_text(encoding="utf-8")
        named = r"\b((?:ps|worker|protocol|algorithms|problems|latecomer|tests)/[\w/]+\.py)\b"
        for path in set(re.findall(named, text)):
            assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"
