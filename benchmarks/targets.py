"""The performance targets of issues 16 and 32, read off a bench run's rows: for each target and
cell, the figure in each repetition (`bench --repeat N`; one figure without it), their median, and
whether the median meets the bound. A ratio is taken within a repetition (its two rows ran seconds
apart), so a machine whose speed drifts between rounds moves the figures, not the verdict's basis.
`python -m benchmarks.targets RUN.json` reads a run saved by `latecomer bench --json`.

The verdicts are the report's, never a test's: they depend on the machine (RESULTS.md's machine
line says which, and its idle policy)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from benchmarks.common import Row
from benchmarks.common import measured as _ok

GB = 1e9


@dataclass(frozen=True)
class Target:
    label: str  # as the report names it
    sizes: tuple[int, ...]  # the d it is read at (an empty tuple: every d run)
    workers: tuple[int, ...]  # and the worker counts
    bound: float
    at_least: bool  # True: the figure must be >= bound; False: <= bound
    fmt: str
    # (rows of one cell and repetition by backend, the cipher limits in GB/s, d) -> the figure, or None
    figure: Callable[[dict[str, Row], dict[str, float], int], float | None]


def _ratio(a: str, b: str) -> Callable:
    def figure(by: dict[str, Row], cipher: dict[str, float], d: int) -> float | None:
        x, y = by.get(a), by.get(b)
        return x.updates_per_s / y.updates_per_s if _ok(x) and _ok(y) else None
    return figure


def _cpu_ms(b: str) -> Callable:
    def figure(by: dict[str, Row], cipher: dict[str, float], d: int) -> float | None:
        r = by.get(b)
        return r.cpu_s_per_update * 1e3 if _ok(r) and math.isfinite(r.cpu_s_per_update) else None
    return figure


def session_cipher(d: int, cipher: dict[str, float]) -> str:
    """The cipher a `latecomer-curve` run of iterate size ``d`` seals with under `--seal-cipher auto`:
    AEGIS-256X4 where both ends have it (as in the bench) and the iterate is at least 64 KiB on
    the wire, else AES-256-GCM (OpenSSL)."""
    from protocol.seal import AEGIS, AEGIS_MIN_BYTES

    return AEGIS if AEGIS in cipher and 4 * d >= AEGIS_MIN_BYTES else "aes256gcm-openssl"


def _payload_share(limit: Callable[[int, dict[str, float]], str]) -> Callable:
    """The sealed rows' payload (both directions, bytes per second) as a percentage of a cipher's
    one-core limit (``limit`` names the cipher for d)."""
    def figure(by: dict[str, Row], cipher: dict[str, float], d: int) -> float | None:
        r, gbps = by.get("latecomer-curve"), cipher.get(limit(d, cipher), math.nan)
        if not _ok(r) or not math.isfinite(r.bytes_per_update) or not gbps > 0:
            return None
        return 100.0 * r.updates_per_s * r.bytes_per_update / (gbps * GB)
    return figure


TARGETS = (
    Target("plaintext TCP / raw pyzmq >= 0.8 (issues 16, 32)", (1000, 100_000), (1, 2), 0.8, True, ".2f",
           _ratio("latecomer", "raw-zmq")),
    Target("plaintext TCP / raw pyzmq >= 0.9 (issue 16)", (1_000_000, 10_000_000), (1, 2), 0.9, True, ".2f",
           _ratio("latecomer", "raw-zmq")),
    Target("server CPU per update <= 0.2 ms (issue 32)", (1000,), (1, 2), 0.2, False, ".3f",
           _cpu_ms("latecomer")),
    Target("sealed / plaintext >= 0.7 (issue 32)", (), (1, 2), 0.7, True, ".2f",
           _ratio("latecomer-curve", "latecomer")),
    Target("sealed payload >= 50 % of XSalsa20-Poly1305's one-core limit (issue 32)", (1_000_000, 10_000_000),
           (1, 2), 50.0, True, ".0f", _payload_share(lambda d, c: "xsalsa20poly1305")),
    Target("sealed payload >= 50 % of its session cipher's one-core limit", (1_000_000, 10_000_000),
           (1, 2), 50.0, True, ".0f", _payload_share(session_cipher)),
)


@dataclass(frozen=True)
class Verdict:
    target: Target
    d: int
    workers: int
    values: tuple[float, ...]  # one per repetition that gave the figure, in repetition order
    median: float  # the lower middle one for an even count, as the paired table takes it
    met: bool


def verdicts(rows: list[Row], cipher: dict[str, float] | None = None) -> list[Verdict]:
    """Each target in each of its cells that the run measured."""
    cipher = cipher or {}
    by: dict[tuple[int, int, int], dict[str, Row]] = {}
    for r in rows:
        by.setdefault((r.d, r.workers, r.rep), {})[r.backend] = r
    reps = sorted({k for _, _, k in by})
    cells = sorted({(d, w) for d, w, _ in by})
    out = []
    for t in TARGETS:
        for d, w in cells:
            if (t.sizes and d not in t.sizes) or w not in t.workers:
                continue
            vals = tuple(v for k in reps for v in [t.figure(by.get((d, w, k), {}), cipher, d)] if v is not None)
            if not vals:
                continue
            med = sorted(vals)[(len(vals) - 1) // 2]
            out.append(Verdict(t, d, w, vals, med, med >= t.bound if t.at_least else med <= t.bound))
    return out


def targets_table(rows: list[Row], cipher: dict[str, float] | None = None) -> list[str]:
    """The report's section: one line per target and cell, and how many cells meet their target."""
    vs = verdicts(rows, cipher)
    if not vs:
        return []
    repeated = any(r.rep for r in rows)
    body = [f"| {v.target.label} | {v.d:,} | {v.workers} | {' '.join(format(x, v.target.fmt) for x in v.values)} | "
            f"{format(v.median, v.target.fmt)} | {'met' if v.met else '**not met**'} |" for v in vs]
    met = sum(v.met for v in vs)
    return ["", "## The targets", "",
            ("Each figure within each repetition (a ratio of two rows that ran seconds apart) and their median "
             "(the lower middle one for an even count); the verdict is the median's. " if repeated else
             "One run (no `--repeat`): each figure once; a single run on a shared machine can land either side "
             "of a bound, so read the verdicts of a `--repeat` run. ")
            + "Sealed payload: both directions' bytes per second of the `latecomer-curve` rows over the cipher's "
            "one-core limit measured in this run (its session cipher: AEGIS-256X4 from 64 KiB iterates where "
            "pyaegis is installed, else AES-256-GCM). Machine-dependent: this machine's line is at the top. "
            f"**{met} of {len(vs)} cells meet their target.**", "",
            "| target | d | workers | per repetition | median | verdict |",
            "|---|---|---|---|---|---|"] + body


def from_json(path: str) -> list[str]:
    """The section for a run saved by `latecomer bench` (its ``--json`` file: rows and cipher limits)."""
    import json

    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    return targets_table([Row(**r) for r in saved["rows"]], saved.get("cipher_gbps"))


if __name__ == "__main__":  # python -m benchmarks.targets benchmarks/RESULTS.json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m benchmarks.targets RUN.json (a `latecomer bench --json` file)")
    print("\n".join(from_json(sys.argv[1]) or ["no target's cells in this run"]))
