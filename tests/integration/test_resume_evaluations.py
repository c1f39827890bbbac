"""issue 25: a resumed run's summary.json (and so ``latecomer report``) holds the evaluations of
every session, not only the last one's; the summary's elapsed time is one figure however late it
is asked. Real daemons on one state directory, a real worker process per session."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps.cli.options import training_spec
from ps.drivers.evaluator import EvalLog
from ps.drivers.outputs import write_outputs
from ps.drivers.server import ServeOptions, StateOptions, make_daemon

pytestmark = pytest.mark.slow


def session(state: str, steps: int, procs) -> dict:
    spec = training_spec("quadratic", ("d=20",), "asgd", ("lr=0.05",), None, default_problem="quadratic",
                         default_algorithm="asgd")
    daemon = make_daemon(spec, "tcp://127.0.0.1:0", ServeOptions(max_steps=steps, eval_every=50, seed=1),
                         state=StateOptions(state, checkpoint_every=50))
    worker = subprocess.Popen([sys.executable, "-m", "ps", "work", "--server", daemon.endpoint, "--give-up", "20"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    procs.children.append(worker)
    try:
        daemon.run()
        write_outputs(state, daemon)
        first = daemon.summary()["elapsed_s"]
    finally:
        daemon.persist.close()
        daemon.close()
    assert daemon.summary()["elapsed_s"] == first  # frozen at the stop, not the time it is asked
    with open(f"{state}/summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["elapsed_s"] == first
    return summary


def test_a_resumed_runs_summary_holds_every_sessions_evaluations(tmp_path, procs):
    state = str(tmp_path / "state")
    one = session(state, 200, procs)
    assert [e["version"] for e in one["evaluations"]] == [0, 50, 100, 150, 200]
    two = session(state, 400, procs)
    versions = [e["version"] for e in two["evaluations"]]
    assert versions == [0, 50, 100, 150, 200, 250, 300, 350, 400], versions  # 200 once: this session's
    assert two["evaluations"][:4] == one["evaluations"][:4]  # the first session's, as recorded
    ts = [e["t"] for e in two["evaluations"]]
    assert ts == sorted(ts) and ts[-1] > one["evaluations"][-1]["t"] - 1e-9  # t goes on, training time
    losses = [e["loss"] for e in two["evaluations"]]
    assert losses[-1] < losses[4] < losses[0]


def test_the_evaluation_log_skips_a_torn_line_and_keeps_the_versions_before(tmp_path):
    log = EvalLog(str(tmp_path))
    for v in (0, 50, 100):
        log.append({"version": v, "t": v / 10, "loss": 1.0 / (v + 1)})
    log.close()
    with open(log.path, "a", encoding="utf-8") as f:
        f.write('{"version": 150, "t": 15.0, "lo')  # a crash mid-line
    again = EvalLog(str(tmp_path))
    assert [e["version"] for e in again.load(100)] == [0, 50] and again.skipped == 1
    assert [e["version"] for e in EvalLog(str(tmp_path)).load(10**9)] == [0, 50, 100]
