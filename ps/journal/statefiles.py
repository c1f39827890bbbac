"""The one checked reader of a state directory's small files (``run.json``, ``problem.json``,
``summary.json``, event lines, ``final_x.npy``) and the depth bound of checkpoint trees.

A state directory is data that may have been tampered with, so every reader here bounds its
work before the parser runs: a file's size is checked before it is read, JSON's nesting depth by
a linear pre-scan before ``json.loads`` (whose C parser would otherwise recurse into a
RecursionError traceback), a tree's depth iteratively before it is walked recursively, and an
``.npy`` header is validated (dtype allow-listed, shape times item size equal to the bytes that
follow) before an array is allocated. Whatever does not pass is a :class:`StateError`: one line
naming the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np

from ps.journal.statedir import StateError

MAX_JSON_BYTES = 4 << 20  # a run.json or problem.json is a few hundred bytes; summary.json a few KB per evaluation
SUMMARY_BYTES = 64 << 20  # summary.json holds every evaluation of a run
MAX_JSON_DEPTH = 64  # a real run.json nests 3 deep, a checkpoint tree 5
MAX_TREE_DEPTH = 64
# final_x.npy: the iterate's dtypes; its header at most 10,000 bytes (numpy's default)
_NPY_DTYPES = {np.dtype(t).newbyteorder(o).str for t in (np.float16, np.float32, np.float64) for o in "<>"}
_MAX_NPY_HEADER = 10_000
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in a JSON text, outside strings: linear, no recursion
    (an unterminated string counts its brackets: the text is not JSON then anyway)."""
    text = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    step = (text == ord("[")).astype(np.int32) + (text == ord("{")) - (text == ord("]")) - (text == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def loads_bounded(raw: bytes | str, where: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of ``raw`` once its depth is checked. Raises StateError (one line, ``where``)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    depth = json_depth(data)
    if depth > max_depth:
        raise StateError(f"{where}: nested {depth} deep (at most {max_depth}): not a file this program wrote")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise StateError(f"{where}: cannot be read ({type(e).__name__}: {str(e)[:120]})") from None


def read_bytes(path: str, *, max_bytes: int) -> bytes:
    """A state file's bytes, refused (StateError) when larger than ``max_bytes`` or unreadable."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise StateError(f"{path}: {size} bytes, more than this file ever holds ({max_bytes}): "
                                 f"not a file this program wrote")
            return f.read(max_bytes + 1)
    except OSError as e:
        raise StateError(f"{path}: cannot be read ({e.strerror or e})") from None


def read_json(path: str, what: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
              expect: type = dict) -> Any:
    """A JSON state file, its size, depth and top-level type (``expect``) checked. ``what`` says
    what it should be (e.g. "a run description"). Raises StateError naming the file."""
    doc = loads_bounded(read_bytes(path, max_bytes=max_bytes), path, max_depth=max_depth)
    if type(doc) is not expect:
        raise StateError(f"{path}: not {what} (a JSON {'map' if expect is dict else expect.__name__}, "
                         f"got {type(doc).__name__})")
    return doc


def check_tree_depth(tree: Any, *, max_depth: int = MAX_TREE_DEPTH) -> None:
    """Raise ValueError if ``tree`` (lists and maps) nests deeper than ``max_depth``; iterative,
    so a crafted tree cannot make the check itself recurse."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"nested more than {max_depth} deep")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))


def read_npy(path: str, *, max_bytes: int = 1 << 34) -> np.ndarray:
    """An iterate saved with ``np.save`` (``final_x.npy``), its header checked before any
    allocation: format 1.0 or 2.0, a float dtype, a shape whose byte count is exactly what follows
    the header. Raises StateError naming the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            dtype, shape, fortran = _npy_header(f, path)
            body = size - f.tell()
            if fortran or body != dtype.itemsize * math.prod(shape) or body > max_bytes:
                raise StateError(f"{path}: its header says {math.prod(shape)} values of {dtype.str}, and "
                                 f"{body} bytes follow: damaged")
            x = np.fromfile(f, dtype=dtype, count=math.prod(shape))
    except OSError as e:
        raise StateError(f"{path}: cannot be read ({e.strerror or e})") from None
    return x.reshape(shape)


def _npy_header(f: Any, path: str) -> tuple[np.dtype, tuple[int, ...], bool]:
    """(dtype, shape, fortran order) of an open .npy file, validated; StateError otherwise."""
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(f)
        read = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f"format version {version}")
        # max_header_size bounds the text numpy's literal parser is given (np.save writes < 200 bytes)
        shape, fortran, dtype = read(f, max_header_size=_MAX_NPY_HEADER)
    except Exception as e:  # noqa: BLE001 - any failure of numpy's header parser is the file's: one line
        why = (str(e).splitlines() or [""])[0][:120]
        raise StateError(f"{path}: not an .npy array ({type(e).__name__}: {why})") from None
    if dtype.str not in _NPY_DTYPES or type(shape) is not tuple or any(type(s) is not int or s < 0 for s in shape):
        raise StateError(f"{path}: an array of {dtype.str} {shape!r:.60}, not an iterate (a float vector)")
    return dtype, shape, bool(fortran)


def read_problem_json(path: str) -> dict[str, Any]:
    """An ``--out`` directory's ``problem.json``: a map naming the problem (a string) and its
    options (a map, absent: none). Raises StateError naming the file otherwise."""
    desc = read_json(path, "a problem description")
    if type(desc.get("problem")) is not str:
        raise StateError(f"{path}: 'problem' must be a string (the problem's spec)")
    if type(desc.setdefault("problem_options", {})) is not dict:
        raise StateError(f"{path}: 'problem_options' must be a map")
    return desc
