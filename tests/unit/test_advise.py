"""`latecomer advise` (ps/ops/advise.py, ps/cli/advise.py) on synthetic traces, each checked
against an expectation computed independently: by hand, or in closed form."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from ps.ops import advise as A

DURATIONS = {"w1": 0.01, "w2": 0.02, "w3": 0.05}


def synthetic_events(durations=DURATIONS, jobs=20, lost=(), leave=None):
    """An event log of constant-duration workers: each issues its next job when the last replies."""
    evs = [{"ev": "joined", "worker_id": w, "device": "cpu", "t": 100.0} for w in durations]
    jid = 0
    for w, d in durations.items():
        for k in range(jobs):
            evs.append({"ev": "issued", "job_id": jid, "worker_id": w, "kind": 1, "created_at": 0, "t": 100.0 + k * d})
            how = "lost" if (w, k) in lost else "applied"
            evs.append({"ev": how, "job_id": jid, "worker_id": w, "created_at": 0, "age": 0, "t": 100.0 + (k + 1) * d})
            jid += 1
    if leave:
        w, t = leave
        evs.append({"ev": "left", "worker_id": w, "reason": "bye", "lost": 0, "t": 100.0 + t})
    return sorted(evs, key=lambda e: e["t"])


def test_fit_trace_reads_durations_losses_and_presence():
    tr = A.fit_trace(synthetic_events(lost={("w3", 4)}, leave=("w2", 0.3)))
    assert tr.ids == ["w1", "w2", "w3"]
    by = {w.worker_id: w for w in tr.workers}
    assert by["w1"].durations == pytest.approx([0.01] * 20)
    assert len(by["w3"].durations) == 19 and by["w3"].lost == 1, "a lost job has no duration: it is counted"
    assert by["w2"].present == [(0.0, pytest.approx(0.3))] and by["w1"].present == [(0.0, None)]
    with pytest.raises(ValueError, match="no job"):
        A.fit_trace([{"ev": "joined", "worker_id": "w1", "t": 1.0}])


def test_what_ifs_change_exactly_the_named_workers():
    tr = A.fit_trace(synthetic_events())
    assert A.drop_slowest(tr, 1).ids == ["w1", "w2"], "removes exactly the slowest (w3, 50 ms)"
    assert A.drop_slowest(tr, 2).ids == ["w1"]
    more = A.add_workers(tr, 2, "w1")
    assert more.ids == ["w1", "w2", "w3", "w1+1", "w1+2"] and more.workers[-1].mean == pytest.approx(0.01)
    assert A.only_workers(tr, ["w3", "w1"]).ids == ["w1", "w3"]
    for bad in (lambda: A.drop_slowest(tr, 3), lambda: A.add_workers(tr, 1, "w9"), lambda: A.only_workers(tr, ["x"])):
        with pytest.raises(ValueError):
            bad()


def _proxy(sigma=0.0):
    return A.ProxyQuadratic(d=4, h=1.0, sigma=sigma, scale0=1.0)  # loss 0.5·‖x‖², starts at 2


def test_synchronous_time_is_rounds_times_the_slowest_worker():
    """Deterministic proxy, lr 0.1: x_k = 0.9^k x_0, loss 2·0.81^k; the target 0.05 is reached at
    round K = ceil(log(0.025)/log(0.81)) = 18, and each round waits for w3's 50 ms."""
    tr = A.fit_trace(synthetic_events())
    pred = A.predict_sync(_proxy(), tr, 0.1, 1, A.Target("loss", 0.05), horizon=100.0, seed=0, eval_every=1)
    k = math.ceil(math.log(0.05 / 2.0) / math.log(0.81))
    assert pred.steps == [k] and pred.times == [pytest.approx(k * 0.05)]


def test_asgd_applies_every_reply_of_the_played_back_trace():
    """Constant durations: by time H each worker replied floor(H/d_i) times, every reply an update."""
    from ps.core.config import CoreConfig

    tr = A.fit_trace(synthetic_events())
    horizon = 1.001
    pred = A.predict(A.Candidate("asgd", {"lr": 0.01}), _proxy(), tr, CoreConfig(), A.Target("loss", -1.0),
                     horizon, 0)
    assert pred.steps == [sum(math.floor(horizon / d) for d in DURATIONS.values())]
    assert pred.times == [math.inf], "an unreachable target is 'not reached', not a time"


def test_joins_leaves_and_crashes_are_replayed_when_they_happened():
    """w1 (10 ms jobs) crashes at 0.205 s and is back at 0.5 s; w2 (20 ms) joins at 0.5 s. By
    1.011 s: w1 replied 20 times before its crash and 51 times after, w2 25 times."""
    from ps.core.config import CoreConfig

    tr = A.ClusterTrace([A.WorkerTrace("w1", [0.01], [(0.0, 0.205), (0.5, None)]),
                         A.WorkerTrace("w2", [0.02], [(0.5, None)])])
    pred = A.predict(A.Candidate("asgd", {"lr": 0.01}), _proxy(), tr, CoreConfig(), A.Target("loss", -1.0), 1.011, 0)
    assert pred.steps == [20 + 51 + 25]


def test_the_proxy_fit_recovers_a_known_loss_curve():
    ks = np.arange(0, 400, 10)
    fit = A.fit_proxy(list(zip(ks, 0.2 + 5.0 * np.exp(-0.015 * ks), strict=True)))
    assert fit.floor == pytest.approx(0.2, rel=0.02) and fit.rate == pytest.approx(0.015, rel=0.02)
    assert fit.l0 == pytest.approx(5.2, rel=0.02)
    # A noiseless fit (floor 0): SGD at the recorded lr on the proxy follows l0·exp(−rate·k) exactly.
    q = A.ProxyQuadratic.from_fit(A.ProxyFit(l0=4.0, floor=0.0, rate=0.02), lr=0.1, batch_size=1)
    x = q.init_params(0)
    for _ in range(100):
        x = x - 0.1 * q.grad(x, 0, 1).grad
    assert q.sigma == 0 and q.evaluate(x)["loss"] == pytest.approx(4.0 * math.exp(-0.02 * 100), rel=1e-4)
    with pytest.raises(ValueError, match="does not fall"):
        A.fit_proxy([(0, 1.0), (10, 1.0), (20, 1.0)])


def test_grid_states_its_knobs_and_skips_what_does_not_apply():
    cands, skipped = A.grid(["rennala", "asgd", "ringmaster-lmo", "snapshot-vr"], _proxy(), 4, 0.2)
    assert sorted({c.settings["B"] for c in cands if c.algorithm == "rennala"}) == [2, 4, 8]
    assert sorted(c.settings["lr"] for c in cands if c.algorithm == "asgd") == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert set(skipped) == {"ringmaster-lmo", "snapshot-vr"}


def test_kendall_tau_and_ranking():
    assert A.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert A.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert A.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    a, b = A.Prediction(A.Candidate("a", {}), times=[2.0, 3.0]), A.Prediction(A.Candidate("b", {}), times=[1.0])
    c = A.Prediction(A.Candidate("a", {"lr": 1}), times=[math.inf])
    assert [p.candidate.algorithm for p in A.best_per_algorithm([a, b, c])] == ["b", "a"]


@pytest.fixture
def out_dir(tmp_path):
    """An --out directory as `latecomer run` writes it: events, problem.json, summary's evaluations."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in synthetic_events(jobs=40)))
    (d / "problem.json").write_text(json.dumps({"problem": "quadratic", "problem_options": {"d": 8}}))
    evals = [{"t": 0.05 * k, "version": 5.0 * k, "loss": 3.0 * 0.8 ** k} for k in range(12)]
    (d / "summary.json").write_text(json.dumps({"version": 60, "counters": {}, "evaluations": evals}))
    return d


def test_cli_table_json_plot_and_one_line_errors(out_dir, tmp_path):
    from ps.cli.main import main

    out = tmp_path / "adv"
    args = ["advise", str(out_dir), "--algorithms", "asgd,rennala", "--seeds", "2", "--budget", "20", "--out", str(out)]
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {row["algorithm"] for row in d["ranking"]} == {"asgd", "rennala"}
    assert d["oracle"].startswith("exact") and d["grid"]["seeds"] == 2
    assert d["synchronous"]["algorithm"] == "synchronous"
    assert d["command"].startswith("latecomer serve --problem quadratic --problem-opt d=8 --algorithm ")
    assert (out / "advise.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(main, [*args, "--drop-slowest", "1"])
    assert r.exit_code == 0 and "without the 1 slowest (w3)" in r.stdout and "winner:" in r.stdout, r.output
    for bad, msg in ((["advise"], "give a run directory or --live"),
                     (["advise", str(tmp_path)], "has no events.jsonl"),
                     ([*args, "--drop-slowest", "3"], "at least one must stay"),
                     ([*args, "--target-loss", "nan"], "must be a finite number"),
                     ([*args, "--budget", "inf"], "must be a finite number"),
                     ([*args, "--add-workers", "2"], "needs --like"),
                     ([*args[:2], "--algorithms", "snapshot-vr"], "none of the algorithms applies"),
                     ([*args, "--oracle", "proxy"], "needs the recorded run's step size")):
        r = CliRunner().invoke(main, bad)
        assert r.exit_code in (1, 2) and msg in r.output and "Traceback" not in r.output, r.output
