"""docs/ALGORITHMS.md is the algorithms' reference: every citation of it resolves, nothing cites
another copy, and it names every registered algorithm.

A citation is the path ``docs/ALGORITHMS.md`` followed, on the same line (or at the start of the
next one), by section numbers such as ``§2.4``, ``§3–4`` or ``§5 A8, §6``; each number must be a
numbered heading of the document. Any other spelling of the file name (bare, under ``shared/``,
``../``) points outside the repository and fails.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from algorithms import ALGORITHMS

NAME = "ALGORITHMS" + ".md"  # spelled in two parts so that this file does not cite it
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / NAME
SUFFIXES = {".py", ".md", ".toml"}
SKIP_DIRS = {"__pycache__", "build", "dist", "out", "runs", "node_modules"}

HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)*)(?:\s*[–-]\s*(\d+(?:\.\d+)*))?")
OTHER_DOC = re.compile(r"[\w-]+\.md\b")
IN_DOCS = re.compile(r"(?<![\w./-])docs/$")  # what must come right before the file name


def project_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [Path(dirpath) / f for f in filenames if Path(f).suffix in SUFFIXES]
    return sorted(out)


def headings() -> set[str]:
    return set(HEADING.findall(DOC.read_text(encoding="utf-8")))


def mentions(path: Path) -> list[tuple[int, str, str]]:
    """(line number, the text before the file name, the text after it up to the next document)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    out = []
    for i, line in enumerate(lines):
        for m in re.finditer(re.escape(NAME), line):
            after = line[m.end():]
            if not after.strip() and i + 1 < len(lines):  # "... docs/ALGORITHMS.md\n§2.4 ..."
                after = lines[i + 1]
            other = OTHER_DOC.search(after)
            if other:
                after = after[:other.start()]
            out.append((i + 1, line[:m.start()], after))
    return out


def test_the_document_exists_with_numbered_sections():
    found = headings()
    for section in ("1", "2", "2.1", "2.2", "2.3", "2.4", "3", "4", "5", "6", "7", "8.1", "8.2", "8.4", "11"):
        assert section in found, f"docs/{NAME} lacks section {section}"


def test_every_citation_resolves_and_none_points_outside():
    found = headings()
    bad, cited = [], 0
    for path in project_files():
        rel = path.relative_to(ROOT)
        for lineno, before, after in mentions(path):
            where = f"{rel}:{lineno}"
            if not IN_DOCS.search(before):
                bad.append(f"{where}: cites {NAME} outside docs/ (write docs/{NAME})")
                continue
            for m in SECTION.finditer(after):
                for number in filter(None, m.groups()):
                    cited += 1
                    if number not in found:
                        bad.append(f"{where}: §{number} is not a heading of docs/{NAME}")
    assert not bad, "\n".join(bad)
    assert cited >= 20  # the scan is not vacuous


def test_the_scan_catches_bad_citations(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(f'"""See {NAME} §2.4, shared/{NAME}, /x/docs/{NAME}, and docs/{NAME} §99 or §3–4.\n'
                      f'Also docs/{NAME}\n§42."""\n', encoding="utf-8")
    got = mentions(sample)
    assert [lineno for lineno, _, _ in got] == [1, 1, 1, 1, 2]
    assert [bool(IN_DOCS.search(before)) for _, before, _ in got] == [False, False, False, True, True]
    numbers = [n for _, _, after in got[3:] for m in SECTION.finditer(after) for n in m.groups() if n]
    assert numbers == ["99", "3", "4", "42"]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_is_documented(name):
    assert f"`{name}`" in DOC.read_text(encoding="utf-8"), f"docs/{NAME} does not describe {name}"
