"""Issue 29, point 4: a gradient value whose square overflows the run's dtype (a finite 3.4e38
in float32) is refused as NON_FINITE, like a NaN, by every algorithm (wrapped too, and the
fused step of asgd), with the core's state exactly as after a NaN's refusal and the iterate and
the algorithm's state bit-identical to before; runs of earlier versions (``refuse_overflow``
False, what an old run.json reads as) accept it as they did, so they replay as they ran."""

from __future__ import annotations

import numpy as np
import pytest

import algorithms
from algorithms._pool import finite, squares_finite, step_into, step_into_checked
from algorithms.base import bind_layout, state_arrays_equal
from protocol.messages import Error, ErrorCode, Hello, Job, JobKind, Ready, Reply
from ps.core.commands import Send
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore

LAYOUT = (("w", (4, 5)), ("b", (4,)))  # a matrix block for the Muon methods, a vector block
D = 24
ATTACK = 3.4e38  # finite in float32; its square is not
NAMES = sorted(algorithms.ALGORITHMS) + ["asgd+clip", "ordered-momentum+wd"]
WRAPPED = {"snapshot-vr": ("snapshot-vr", {"num_samples": 8}), "asgd+clip": ("asgd", {"clip_norm": 1.0}),
           "ordered-momentum+wd": ("ordered-momentum", {"weight_decay": 0.01})}


# Round methods whose round steps with no reply in it: the refusal frees the worker's credit,
# the dispatch that follows runs a demand-driven round (version + 1, "applied" 0) and the
# momentum moves x; exactly as after a NaN's refusal, which the test checks they equal.
LOSS_MOVES = {"storm-vr", "snapshot-vr"}


def build(name: str):
    base, settings = WRAPPED.get(name, (name, {}))
    return bind_layout(algorithms.build(base, settings, max_steps=1000), LAYOUT)


def deal(held: dict, cmds: list) -> None:
    """Hand each Job in ``cmds`` to the worker it is for."""
    for c in cmds:
        if isinstance(c, Send) and isinstance(c.msg, Job):
            held[c.worker_id].append(c.msg)


def reply_to(job: Job, value: float) -> Reply:
    n = 1 if job.kind == JobKind.FULL_GRAD else len(job.iterate_ids)
    count = job.shard[1] - job.shard[0] if job.shard else 0
    return Reply(job.job_id, job.created_at, tuple(np.full(D, value, np.float32) for _ in range(n)),
                 loss=1.0, count=count)


def observed(core: ServerCore) -> tuple:
    """Everything the refusal may not change: the iterate, the algorithm's state, the ledger."""
    return (core.params().tobytes(), core.version, core.alg.to_state_dict(core.state),
            sorted((e.job_id, e.worker_id, e.created_at, e.received) for e in core.ledger.values()))


def attacked(name: str, value: float, refuse: bool = True) -> tuple:
    """A core with two workers: honest replies until w2 holds a job, then w2 answers it with
    ``value`` everywhere. Returns (state before the bad reply, after it, its commands, counters, events)."""
    core = ServerCore(build(name), np.linspace(-1, 1, D).astype(np.float32),
                      CoreConfig(min_workers=2, liveness_timeout_s=1e9, refuse_overflow=refuse))
    held: dict[str, list[Job]] = {"w1": [], "w2": []}
    for w in held:
        deal(held, core.handle(w, Hello(worker_id=w, boot=1, credit=2), 0.0))
    for w in held:
        deal(held, core.handle(w, Ready(credit=2), 0.0))
    t = 1.0
    for _ in range(6):  # a few honest steps first: momentum, accumulators and rounds are not at zero
        w = "w1" if held["w1"] else "w2"
        job = held[w].pop(0)
        deal(held, core.handle(w, reply_to(job, 0.25), t))
        t += 1.0
    live = [j for j in held["w2"] if j.job_id in core.ledger and not core.ledger[j.job_id].received]
    assert live, name
    core.drain_events()
    before = observed(core)
    counters = core.counters.as_dict()
    cmds = core.handle("w2", reply_to(live[-1], value), t)
    events = [{k: v for k, v in e.items() if k not in ("t", "message")} for e in core.drain_events()]
    return before, observed(core), cmds, counters, core.counters.as_dict(), events


def same_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and state_arrays_equal(a[2], b[2]) and a[3] == b[3]


@pytest.mark.parametrize("name", NAMES)
def test_a_gradient_of_3_4e38_is_refused_as_a_nan_is_and_changes_nothing(name):
    before, after, cmds, c0, c1, events = attacked(name, ATTACK)
    errors = [c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, Error)]
    assert [e.code for e in errors] == [ErrorCode.NON_FINITE], (name, cmds)
    assert "square overflows float32" in errors[0].message and "\n" not in errors[0].message
    assert np.isfinite(np.frombuffer(after[0], np.float32)).all()
    assert c1["rejected"] == c0["rejected"] + 1, name
    # The control: a NaN's refusal (today's rule) leaves the very same core, events and counters.
    nb, na, ncmds, n0, n1, nevents = attacked(name, float("nan"))
    assert same_state(before, nb) and same_state(after, na), f"{name}: not the state a NaN's refusal leaves"
    assert (c0, c1, events) == (n0, n1, nevents), name
    assert [type(c.msg).__name__ for c in cmds] == [type(c.msg).__name__ for c in ncmds]
    if name not in LOSS_MOVES:
        assert before[0] == after[0] and before[1] == after[1], f"{name}: the iterate moved"
        assert state_arrays_equal(before[2], after[2]), f"{name}: the algorithm's state changed"
        assert c1["applied"] == c0["applied"], name


@pytest.mark.parametrize("name", ["asgd", "ordered-momentum", "rennala", "adam", "storm-vr"])
def test_a_run_of_an_earlier_version_accepts_it_as_it_did(name):
    """``refuse_overflow`` False (an old run.json): the reply is not refused, so the test above
    observes the new rule, and old journals replay as they ran."""
    before, after, cmds, c0, c1, _ = attacked(name, ATTACK, refuse=False)
    assert not [c for c in cmds if isinstance(c, Send) and isinstance(c.msg, Error)], name
    assert c1["rejected"] == c0["rejected"]


def test_squares_finite_is_exact_at_the_bound():
    big = np.float32(np.sqrt(np.finfo(np.float32).max))
    below, above = np.nextafter(big, np.float32(0)), np.nextafter(big, np.float32(np.inf))
    while np.isfinite(above * above) is np.True_ and above < 2 * big:
        above = np.nextafter(above, np.float32(np.inf))
    while not np.isfinite(below * below):
        below = np.nextafter(below, np.float32(0))
    for d in (5, 300_000):  # a sum of squares that overflows with every square finite: accepted
        g = np.full(d, below, np.float32)
        assert squares_finite(g) and finite(g)
        g[d // 2] = above
        assert not squares_finite(g) and finite(g)
        g[d // 2] = np.nan
        assert not squares_finite(g) and not finite(g)


@pytest.mark.parametrize("d", [8, 300_000])  # whole-array and cache-blocked (algorithms/_pool.py BLOCK)
def test_the_fused_step_refuses_what_squares_finite_refuses_and_else_steps_bit_for_bit(d):
    x = np.linspace(-1, 1, d).astype(np.float32)
    g = np.full(d, 0.5, np.float32)
    assert step_into_checked(x, 0.1, g, squares=True).tobytes() == step_into(x, 0.1, g).tobytes()
    for where in (0, d - 1):
        h = g.copy()
        h[where] = ATTACK
        assert step_into_checked(x, 0.1, h, squares=True) is None, where
        assert step_into_checked(x, 0.1, h) is not None, "without squares: the old rule (finite) steps"


def test_a_new_state_directory_pins_the_rule_and_an_old_run_json_reads_without_it(tmp_path):
    """run.json of a new run says ``refuse_overflow: true`` (its core refuses); the same core
    section without the key (a run of an earlier version) gives a core that accepts as it did."""
    from ps.core.spec import TrainingSpec
    from ps.drivers.server import StateOptions
    from ps.drivers.server import open_state as _open_state
    from ps.journal.runfile import core_config, read_run

    d = str(tmp_path / "state")
    spec = TrainingSpec(problem="quadratic", problem_options={"d": 8}, algorithm="asgd", settings={"lr": 0.1})
    core, _, pers, _ = _open_state(StateOptions(d, checkpoint_every=0, checkpoint_interval_s=0, fsync="never"),
                                   spec, boot=1, batch_size=4, liveness_timeout=2.0, heartbeat_interval=0.5,
                                   min_workers=1, round_period=0.0, seed=0)
    pers.close()
    run = read_run(d)
    assert run["core"]["refuse_overflow"] is True and core.cfg.refuse_overflow is True
    old = {**run, "core": {k: v for k, v in run["core"].items() if k != "refuse_overflow"}}
    assert core_config(old).refuse_overflow is False
