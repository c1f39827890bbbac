"""PROTOCOL.md's section 6 against the codec: every message type the codec knows is in the list
of types and has a subsection (or rows in a subsection's table), every field the codec reads or
writes has a row in a field table, no row names a field the codec does not know, and "req."
rows are the fields without a default. Also the caps the rows state for ``welcome.shards`` and
``fetch`` (section 6.2, 6.14) are the codec's. Pure parsing: no sockets."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from protocol.codec import _ARRAY_FIELD, _SCHEMA, decode, encode
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.messages import TYPE_NAMES, TYPES_BY_NAME, Fetch, Reply, Welcome

DOC = Path(__file__).resolve().parents[2] / "protocol" / "PROTOCOL.md"
# Dataclass fields that never travel as header keys: the raw frame of a part, and what a sharded
# coordinator gathers from its shards and journals with a reply (never on the wire).
NOT_HEADER = {"Part": {"data"}, "Reply": {"block_sq", "step_sq"}}


def section_6() -> str:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index("\n## 6. Messages\n"), text.index("\n## 7. Error codes\n")
    return text[start:end]


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # "\|" is a pipe in a cell


def unquote(cell: str) -> str:
    return cell.strip().strip("`").strip('"')


def tables(text: str) -> list[tuple[str, str, list[list[str]]]]:
    """(the subsection's heading, the text before the table in it, the rows: header first)."""
    out, heading, before, rows = [], "", [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append(cells(line))
            continue
        if rows:
            out.append((heading, "\n".join(before), [r for r in rows if not set("".join(r)) <= set("-: ")]))
            rows = []
        if line.startswith("### "):
            heading, before = line, []
        else:
            before.append(line)
    return out


def named(text: str) -> list[str]:
    """The message types a piece of text names in backticks, in order."""
    return [t for t in re.findall(r"`([a-z?]+)`", text) if t in TYPES_BY_NAME]


def field_rows() -> dict[str, dict[str, str]]:
    """type name -> field -> its Default cell ("" where the table has none)."""
    rows: dict[str, dict[str, str]] = {}
    for heading, before, table in tables(section_6()):
        head, body = table[0], table[1:]
        default = head.index("Default") if "Default" in head else None
        if head[0] == "Field":  # the message is the heading's, else the first the text before names
            (t, *_) = named(heading) or named(before)
            for r in body:
                rows.setdefault(t, {})[unquote(r[0])] = r[default] if default is not None else ""
        elif head[:2] == ["Message", "Field"]:
            for r in body:
                for t in (unquote(x) for x in r[0].split(",")):
                    rows.setdefault(t, {})[unquote(r[1])] = r[default] if default is not None else ""
    return rows


def wire_fields(cls: type) -> set[str]:
    """The header keys of a message type: its schema, and ``arrays`` for the array field."""
    return set(_SCHEMA[cls]) | ({"arrays"} if cls in _ARRAY_FIELD else set())


def test_the_list_of_types_names_every_type_the_codec_knows():
    (_, _, listing), *_ = [t for t in tables(section_6()) if t[2][0][0] == "`t`"]
    assert {unquote(r[0]) for r in listing[1:]} == set(TYPE_NAMES.values())


def test_every_type_has_a_subsection_or_rows_in_one():
    text = section_6()
    headings = {t for line in text.splitlines() if line.startswith("### ") for t in named(line)}
    missing = set(TYPE_NAMES.values()) - headings - set(field_rows())
    assert not missing, f"no subsection of section 6 for {sorted(missing)}"
    assert "### 6.14 `fetch` (worker → shard)" in text


@pytest.mark.parametrize("cls", sorted(_SCHEMA, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_field_has_a_row_and_every_row_a_field(cls):
    documented = field_rows().get(TYPE_NAMES[cls], {})
    assert set(documented) == wire_fields(cls), (
        f"{TYPE_NAMES[cls]}: rows without a field {sorted(set(documented) - wire_fields(cls))}, "
        f"fields without a row {sorted(wire_fields(cls) - set(documented))}")
    array = _ARRAY_FIELD.get(cls)
    others = {f.name for f in dataclasses.fields(cls)} - set(_SCHEMA[cls]) - {array}
    assert others == NOT_HEADER.get(cls.__name__, set()), f"{cls.__name__}: fields the codec does not say: {others}"


@pytest.mark.parametrize("cls", sorted(_SCHEMA, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_req_rows_are_the_fields_without_a_default(cls):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, default in field_rows().get(TYPE_NAMES[cls], {}).items():
        if name == "arrays" or not default:
            continue
        required = fields[name].default is dataclasses.MISSING and fields[name].default_factory is dataclasses.MISSING
        assert (default == "req.") == required, f"{TYPE_NAMES[cls]}.{name}: Default {default!r}"


def row(t: str, name: str) -> str:
    for heading, before, table in tables(section_6()):
        if table[0][0] == "Field" and (named(heading) or named(before))[0] == t:
            for r in table[1:]:
                if unquote(r[0]) == name:
                    return " | ".join(r)
    raise AssertionError(f"no row for {t}.{name}")


def welcome(shards: list) -> list:
    return encode(Welcome(server_boot=1, version=1, problem="quadratic", shards=tuple(map(tuple, shards))))


def test_welcome_shards_row_states_the_codecs_rules():
    assert "≤ 64" in row("welcome", "shards") and "contiguous from 0" in row("welcome", "shards")
    ok = [(f"tcp://h:{i}", 2 * i, 2 * i + 2) for i in range(64)]
    assert decode(welcome(ok)).shards == tuple(ok)
    assert b"shards" not in bytes(welcome([])[0])  # left out while []
    too_many, not_from_0 = ok + [("tcp://h:64", 128, 130)], [("tcp://h:0", 1, 2)]
    for bad in (too_many, not_from_0, [("a", 0, 2), ("b", 3, 4)], [("a", 0, 2), ("b", 2, 1)], [("", 0, 2)]):
        with pytest.raises(LocalProtocolError):
            welcome(bad)


def test_fetch_rows_state_the_codecs_rules():
    assert "`list[nat, ≤2]`" in row("fetch", "iterate_ids") and "req." in row("fetch", "job_id")
    frames = encode(Fetch(job_id=3, created_at=2, iterate_ids=(0, 1)))
    assert len(frames) == 1 and decode(frames) == Fetch(job_id=3, created_at=2, iterate_ids=(0, 1))
    with pytest.raises(LocalProtocolError):
        encode(Fetch(job_id=3, created_at=2, iterate_ids=(0, 1, 2)))
    with pytest.raises(RemoteProtocolError, match="missing field 'created_at'"):
        decode([b"\x83\xa1v\x01\xa1t\xa5fetch\xa6job_id\x03"])


def test_the_empty_gradients_of_a_reply_header_are_shape_0_and_0_bytes():
    """Section 12.1, step 7: what the coordinator gets (worker/shards.py header_only)."""
    from worker.shards import header_only

    r = Reply(job_id=4, created_at=1, grads=(np.ones(6, "<u2"), np.ones(6, "<u2")), loss=0.5, count=3,
              compute_s=0.25, holds=(1,))
    h = header_only(r)
    frames = encode(h)
    assert [bytes(memoryview(f)) for f in frames[1:]] == [b"", b""]
    assert decode(frames).grads[0].shape == (0,) and decode(frames).grads[0].dtype == np.dtype("<u2")
    assert (h.job_id, h.created_at, h.loss, h.count, h.compute_s, h.holds) == (4, 1, 0.5, 3, 0.25, (1,))
