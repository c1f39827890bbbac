"""Crafted state files (issue 29, point 5), shared by the unit tests (against the readers) and
the integration tests (against the commands): each builder writes one hostile file into a state
directory and returns its path.

- ``deep_checkpoint``: a checkpoint whose tree nests 600 lists deep, with a valid checksum (the
  recursive tree decoder overflowed the stack);
- ``deep_json``: ``run.json``/``problem.json``/``summary.json`` nested 200,000 deep (json's C
  parser raised RecursionError);
- ``overlong_segment``: a 6 MB journal segment of one record whose length runs past the end,
  then 6,000 candidate records each claiming a length to the end of the file (resync
  checksummed each candidate's whole length: quadratic, 45 s);
- ``bad_npy_*``: ``final_x.npy`` with a header numpy's parser chokes on, a header declaring a
  huge shape, data cut short;
- ``problem_json_list``: ``problem.json`` that is ``[]``.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import msgpack

from ps.journal.checkpoints import CKPT_MAGIC
from ps.journal.records import REC_HEADER

CKPT_DEPTH = 600
JSON_DEPTH = 200_000
SEGMENT_BYTES = 6 << 20
CANDIDATES = 6000


def deep_checkpoint(path: str, lsn: int, depth: int = CKPT_DEPTH) -> str:
    """A well-formed, checksummed checkpoint file whose tree is a list nested ``depth`` deep."""
    tree: list = []
    for _ in range(depth - 1):
        tree = [tree]
    head = msgpack.packb({"lsn": lsn, "tree": {"deep": tree}, "arrays": []}, use_bin_type=True)
    body = CKPT_MAGIC + struct.pack("<Q", len(head)) + head
    with open(path, "wb") as f:
        f.write(body + hashlib.sha256(body).digest())
    return path


def deep_json(path: str, depth: int = JSON_DEPTH) -> str:
    """A JSON map whose "problem" is a list nested ``depth`` deep."""
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"problem": ' + "[" * depth + "]" * depth + "}")
    return path


def _record(lsn: int, op: str = "tick", pad: int = 0) -> bytes:
    body = msgpack.packb({"lsn": lsn, "op": op, "now": 1.0, **({"pad": b"\0" * pad} if pad else {})},
                         use_bin_type=True)
    return REC_HEADER.pack(len(body), zlib.crc32(body)) + body


def overlong_segment(path: str, first_lsn: int, size: int = SEGMENT_BYTES, candidates: int = CANDIDATES) -> str:
    """A segment: one record whose length runs past the end of the file, then ``candidates``
    record-shaped chunks, each with an LSN above ``first_lsn``, a length that reaches the end
    of the file exactly and a wrong checksum (so every one had to be checksummed whole)."""
    step = (size - 64) // candidates
    head = REC_HEADER.pack(size * 2, 0) + b"\x83\xa3lsn" + msgpack.packb(first_lsn)
    chunks = [head + b"\0" * (64 - len(head))]
    pos = 64
    for k in range(candidates):
        n = size - pos - REC_HEADER.size
        start = REC_HEADER.pack(n, 0xDEADBEEF) + b"\x83\xa3lsn" + msgpack.packb(first_lsn + 1 + k)
        chunks.append(start + b"\0" * (step - len(start)))
        pos += step
    data = b"".join(chunks)
    with open(path, "wb") as f:
        f.write(data + b"\0" * (size - len(data)))
    return path


NPY_MAGIC = b"\x93NUMPY\x01\x00"


def _npy(path: str, header: bytes, data: bytes = b"") -> str:
    header = header + b" " * (-(len(NPY_MAGIC) + 2 + len(header) + 1) % 64) + b"\n"
    with open(path, "wb") as f:
        f.write(NPY_MAGIC + struct.pack("<H", len(header)) + header + data)
    return path


def bad_npy_header(path: str) -> str:
    """A header that is not a Python literal (an unterminated string: tokenize errors)."""
    return _npy(path, b"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), '''")


def bad_npy_huge(path: str) -> str:
    """A header declaring 2**40 float64 values (8 TiB) over 16 bytes of data."""
    return _npy(path, b"{'descr': '<f8', 'fortran_order': False, 'shape': (1099511627776,), }", b"\0" * 16)


def bad_npy_truncated(path: str) -> str:
    """A header declaring 64 float32 values, and 10 bytes of data."""
    return _npy(path, b"{'descr': '<f4', 'fortran_order': False, 'shape': (64,), }", b"\0" * 10)


def bad_npy_object(path: str) -> str:
    """An object array (pickled data: never loaded)."""
    return _npy(path, b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", b"\x80\x04N.")


BAD_NPY = {"header": bad_npy_header, "huge": bad_npy_huge, "truncated": bad_npy_truncated, "object": bad_npy_object}


def deep_event_line(path: str, depth: int = JSON_DEPTH) -> str:
    """An event log with one line nested ``depth`` deep appended (a good line after it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"ev": ' + "[" * depth + "]" * depth + "}\n" + '{"ev": "note", "t": 1.0}\n')
    return path


def problem_json_list(path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("[]")
    return path


def tick_records(first_lsn: int, n: int, pad: int = 0) -> bytes:
    """``n`` good ``tick`` records from ``first_lsn`` (a segment's bytes), each padded with ``pad`` bytes."""
    return b"".join(_record(first_lsn + k, pad=pad) for k in range(n))


def write_bytes(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path
