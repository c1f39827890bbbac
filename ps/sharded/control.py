"""The control channel between a sharded server's coordinator and its shards (PROTOCOL.md §12).

One DEALER per shard, connected to the coordinator's shard ROUTER (``serve --shard-bind``).
Every message is ``[header, *frames]``: a msgpack map with a type ``t`` and the fields below,
each checked here (types, ranges, sizes) before anything reads it, so a bad peer gets a one-line
:class:`ControlError` and changes nothing.

shard -> coordinator
    ``shello``   {index, run_id, boot, endpoint, applied, ckpt, token}: a shard (re)joins. ``index`` -1
                 and ``run_id`` 0: a new shard, which takes the first free slot; ``endpoint`` ""
                 until its data socket is bound (a new shard binds once it knows its slice);
                 ``token``: the run's shard token (ps/sharded/hub_admit.py; "" if left out).
    ``have``     {jobs: [[job_id, created_at, code, text(, bsq)], ...]}: gradient blocks journaled
                 (code 0) or refused (an ErrorCode and its text). ``bsq``, where the algorithm
                 needs a norm over every block (``clip_norm``): the squared norm of each of this
                 shard's blocks of the job's gradient, float64, in block order.
    ``progress`` {applied, ckpt, version, applied_count, rss, blocks, records_s, endpoint}: every 0.2 s.
    ``params``   {token, lsn, version} + one frame: the shard's slice of x after record ``lsn``.
    ``reduce``   {token, job_id, bsq}: the squared norms of this shard's blocks of the vector of
                 state the job's step divides by (``reduce?``).
    ``refuse``   {message}: the shard cannot go on (the run it was given does not fit it).

coordinator -> shard
    ``swelcome`` {index, shards, run_id, from, lo, hi}: the slot, the LSN of the next record it
                 gets, and the values [lo, hi) it owns (its data socket's message bound).
    ``recs``     {first, count} + ``count`` frames: journal records, each its msgpack body.
    ``params?``  {token, lsn}: answer ``params`` once record ``lsn`` is applied.
    ``reduce?``  {token, job_id, created_at, after, bsq}: once record ``after`` is applied, answer
                 ``reduce`` for the step the job's reply would make now (``lmo='l2'``: its
                 blocks of ‖u‖²); ``bsq``: the reply's gradient block norms ([] if none).
    ``stop``     {reason}: the run is over: checkpoint and exit.
    ``refuse``   {message}: this shard is not wanted (no or a wrong shard token, wrong run, no free
                 slot, its figures disagree): it exits saying why. A ``shello`` for a slot whose
                 holder lives gets no answer (the shard says it again).
"""

from __future__ import annotations

from typing import Any

import msgpack

MAX_CONTROL_HEADER = 1 << 20
MAX_HAVES = 4096
MAX_BLOCKS = 65536  # layout blocks a shard measures in one have's bsq
I64 = (1 << 63) - 1


class ControlError(ValueError):
    """A control message that does not read (one line, the peer's fault)."""


def _int(v: Any, lo: int = -1, hi: int = I64) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ControlError(f"expected an integer in [{lo}, {hi}], got {v!r:.60}")
    return v


def _num(v: Any) -> float:
    if type(v) not in (int, float) or v != v or v in (float("inf"), float("-inf")):
        raise ControlError(f"expected a finite number, got {v!r:.60}")
    return float(v)


def _text(v: Any, n: int = 1024) -> str:
    if type(v) is not str or len(v) > n or not v.isprintable():
        raise ControlError(f"expected printable text of at most {n} characters, got {v!r:.60}")
    return v


_FIELDS: dict[str, dict[str, Any]] = {
    "shello": {"index": lambda v: _int(v, -1, 63), "run_id": lambda v: _int(v, 0, (1 << 64) - 1),
               "boot": lambda v: _int(v, 0, (1 << 64) - 1), "endpoint": _text, "applied": _int, "ckpt": _int,
               "token": lambda v: _text(v, 128)},
    "have": {"jobs": None},
    "progress": {"applied": _int, "ckpt": _int, "version": lambda v: _int(v, 0), "applied_count": lambda v: _int(v, 0),
                 "rss": lambda v: _int(v, 0), "blocks": lambda v: _int(v, 0), "records_s": _num, "endpoint": _text},
    "params": {"token": lambda v: _int(v, 0), "lsn": _int, "version": lambda v: _int(v, 0)},
    "reduce": {"token": lambda v: _int(v, 0), "job_id": lambda v: _int(v, 0), "bsq": None},
    "reduce?": {"token": lambda v: _int(v, 0), "job_id": lambda v: _int(v, 0), "created_at": lambda v: _int(v, 0),
                "after": _int, "bsq": None},
    "refuse": {"message": _text},
    "swelcome": {"index": lambda v: _int(v, 0, 63), "shards": lambda v: _int(v, 1, 64),
                 "run_id": lambda v: _int(v, 0, (1 << 64) - 1), "from": lambda v: _int(v, 0),
                 "lo": lambda v: _int(v, 0), "hi": lambda v: _int(v, 0)},
    "recs": {"first": lambda v: _int(v, 0), "count": lambda v: _int(v, 0, 1 << 20)},
    "params?": {"token": lambda v: _int(v, 0), "lsn": _int},
    "stop": {"reason": _text},
}
_DEFAULTS: dict[str, dict[str, Any]] = {"shello": {"token": ""}}  # fields a peer may leave out


def _block_sq(v: Any) -> tuple[float, ...]:
    if type(v) is not list or len(v) > MAX_BLOCKS:
        raise ControlError(f"a have's bsq is a list of at most {MAX_BLOCKS} numbers")
    out = tuple(_num(x) for x in v)
    if any(x < 0.0 for x in out):
        raise ControlError("a have's bsq holds a negative squared norm")
    return out


def _haves(v: Any) -> list[tuple]:
    if type(v) is not list or len(v) > MAX_HAVES:
        raise ControlError(f"expected a list of at most {MAX_HAVES} jobs")
    out = []
    for h in v:
        if type(h) is not list or len(h) not in (4, 5):
            raise ControlError("a have is [job_id, created_at, code, text] or [job_id, created_at, code, text, bsq]")
        have = (_int(h[0], 0), _int(h[1], 0), _int(h[2], 0, 255), _text(h[3]))
        out.append(have + (_block_sq(h[4]),) if len(h) == 5 else have)
    return out


def pack(t: str, **fields: Any) -> bytes:
    return msgpack.packb({"t": t, **fields}, use_bin_type=True)


def unpack(frame: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The checked header of a control message of one of the ``allowed`` types."""
    data = bytes(frame)
    if len(data) > MAX_CONTROL_HEADER:
        raise ControlError(f"control header of {len(data)} bytes (at most {MAX_CONTROL_HEADER})")
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - whatever msgpack raises on garbage
        raise ControlError(f"undecodable control header ({type(e).__name__})") from None
    if type(m) is not dict or m.get("t") not in allowed:
        raise ControlError(f"not a control message of {', '.join(allowed)}: {str(m)[:60]!r}")
    spec = _FIELDS[m["t"]]
    out: dict[str, Any] = {"t": m["t"]}
    for k, check in spec.items():
        if k not in m and k in _DEFAULTS.get(m["t"], {}):
            out[k] = _DEFAULTS[m["t"]][k]
            continue
        if k not in m:
            raise ControlError(f"{m['t']}: {k} missing")
        out[k] = _haves(m[k]) if k == "jobs" else _block_sq(m[k]) if k == "bsq" else check(m[k])
    return out
