"""CLI parsing: bad arguments give one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from ps.cli.main import main


@pytest.fixture
def cli():
    return CliRunner()


@pytest.mark.parametrize("args,needle", [
    (["serve", "--algorithm", "nope"], "unknown algorithm 'nope'"),
    (["serve", "--set", "lr=-1"], "Invalid lr"),
    (["serve", "--set", "lr"], "expected KEY=VALUE"),
    (["serve", "--set", "momentum=0.9"], "unknown hyper-parameter 'momentum'"),
    (["serve", "--problem", "nope"], "nope"),
    (["serve", "--problem", "quadratic", "--problem-opt", "d=abc"], "d"),
    (["serve", "--liveness-timeout", "0"], "must be > 0"),
    (["serve", "--heartbeat-interval", "5", "--liveness-timeout", "3"], "smaller than --liveness-timeout"),
    (["serve", "--config", "/nonexistent.toml"], "cannot read"),
    (["work"], "Missing option '--server'"),
    (["work", "--server", "localhost:5555"], "expected tcp://HOST:PORT"),
    (["work", "--server", "tcp://127.0.0.1:1", "--credit", "0"], "--credit"),
    (["work", "--server", "tcp://127.0.0.1:1", "--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["run", "--delays", "a,b"], "expected numbers"),
    (["run", "--delays", "-1"], "delays must be finite numbers >= 0"),
    (["simulate", "--crash", "x"], "expected WORKER@TIME"),
    (["simulate", "--workers", "2", "--crash", "5@1"], "out of range"),
])
def test_cli_bad_arguments(cli, args, needle):
    r = cli.invoke(main, args)
    assert r.exit_code != 0
    assert needle in r.output, r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_cli_bad_toml(cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[algorithm\nname=")
    r = cli.invoke(main, ["serve", "--config", str(cfg)])
    assert r.exit_code == 2 and "not valid TOML" in r.output
    cfg.write_text("[optimizer]\nlr=1\n")
    r = cli.invoke(main, ["serve", "--config", str(cfg)])
    assert r.exit_code == 2 and "unknown section" in r.output


def test_cli_toml_and_flags_merge(tmp_path):
    from ps.cli.options import training_spec

    cfg = tmp_path / "c.toml"
    cfg.write_text('[problem]\nname = "quadratic"\nd = 8\n[algorithm]\nname = "ringmaster"\nlr = 0.2\nR = 3\n')
    spec = training_spec(None, ("d=12",), None, ("R=5",), str(cfg), default_problem="digits",
                         default_algorithm="asgd")
    assert spec.problem == "quadratic" and spec.problem_options == {"d": "12"}
    assert spec.algorithm == "ringmaster" and spec.settings == {"lr": 0.2, "R": "5"}
    problem, alg = spec.build()
    assert problem.dim == 12 and alg.R == 5 and alg.lr == 0.2


def test_cli_lists_algorithms(cli):
    import algorithms

    r = cli.invoke(main, ["algorithms"])
    assert r.exit_code == 0
    for name in algorithms.ALGORITHMS:
        assert name in r.output


def test_cli_simulate_writes_trace_and_plot(cli, tmp_path):
    out = tmp_path / "sim"
    r = cli.invoke(main, ["simulate", "--workers", "4", "--time", "40", "--problem-opt", "d=8", "--set", "lr=0.3",
                          "--crash", "1@10+5", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "trace.csv").stat().st_size > 100 and (out / "convergence.png").stat().st_size > 1000
    assert "loss:" in r.output


def test_cli_entry_point_runs_as_module():
    r = subprocess.run([sys.executable, "-m", "ps", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "serve" in r.stdout and "simulate" in r.stdout


def test_cli_simulate_wire_dtype(cli, tmp_path):
    import json

    r = cli.invoke(main, ["simulate", "--wire-dtype", "fp8"])
    assert r.exit_code == 2 and "fp8" in r.output and "Traceback" not in r.output
    finals = {}
    for wire in ("f32", "bf16"):
        out = tmp_path / wire
        r = cli.invoke(main, ["simulate", "--workers", "4", "--time", "40", "--problem-opt", "d=8", "--set", "lr=0.3",
                              "--wire-dtype", wire, "--out", str(out)])
        assert r.exit_code == 0, r.output
        assert f"wire dtype {wire}" in r.output
        summary = json.loads((out / "summary.json").read_text())
        assert summary["wire_dtype"] == wire
        finals[wire] = summary["points"][-1]["loss"]
    assert finals["f32"] != finals["bf16"]


def test_runs_progress_bar_says_what_the_first_step_waits_for():
    from types import SimpleNamespace as NS

    from ps.drivers.server import waiting_for

    def daemon(*ready: bool, wanted: int = 2):
        workers = {f"w{i}": NS(ready=r) for i, r in enumerate(ready)}
        return NS(core=NS(workers=workers, cfg=NS(min_workers=wanted)))

    assert waiting_for(daemon()) == "workers starting"
    assert waiting_for(daemon(False, True)) == "1 loading the problem"
    assert waiting_for(daemon(True)) == "1 more worker" and waiting_for(daemon(True, wanted=3)) == "2 more workers"
    assert waiting_for(daemon(True, True)) == "first replies"


def test_serve_shows_a_progress_bar_on_a_terminal_only():
    import io

    from ps.drivers.server import want_progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert want_progress(None, Tty(), "text") and not want_progress(None, io.StringIO(), "text")
    assert not want_progress(None, Tty(), "json")  # a JSON log is read by programs
    assert want_progress(True, io.StringIO(), "json") and not want_progress(False, Tty(), "text")


def test_serves_progress_bar_shows_steps_rate_workers_lost_and_the_last_evaluation(caplog):
    import io
    import logging
    from types import SimpleNamespace as NS

    from ps.drivers.server import ServeBar

    out = io.StringIO()
    bar = ServeBar(1000, out)
    workers = {"w0": NS(ready=True), "w1": NS(ready=False)}
    d = NS(core=NS(version=0, workers=workers, cfg=NS(min_workers=2), counters=NS(lost=0, applied=0)),
           evaluations=[], step_rate=lambda now: 0.0, clock=lambda: 0.0)
    bar(d, None)
    assert "0/1000" in out.getvalue() and "waiting=1 loading the problem" in out.getvalue()
    ev = {"version": 250, "t": 3.0, "loss": 0.123456, "accuracy": 0.9}
    d.core.version, d.core.counters.lost, d.evaluations = 250, 2, [ev]
    d.step_rate = lambda now: 81.25
    with caplog.at_level(logging.INFO, "latecomer.server"):
        bar(d, ev)
    text = out.getvalue().rsplit("\r", 1)[-1]
    assert "250/1000" in text and "rate=81.2/s" in text and "workers=2" in text and "lost=2" in text
    assert "loss=0.1235" in text and "accuracy=0.9" in text and "waiting" not in text
    assert any(r.getMessage().startswith("step 250  loss 0.1235") for r in caplog.records)  # still logged
    bar.close()


def test_the_jobs_batch_size_is_the_problems_own_unless_serve_says_another(caplog):
    """issue 25: ``TorchProblem(batch_size=128)`` served without ``--batch-size`` gives jobs of 128
    samples (it gave the server's default 32); ``--batch-size`` wins, with a warning when it
    differs; a problem without one gets 32."""
    import logging
    from types import SimpleNamespace as NS

    from ps.drivers.server import resolve_batch_size

    with caplog.at_level(logging.INFO, "latecomer.server"):
        assert resolve_batch_size(None, NS(batch_size=128)) == 128
        assert resolve_batch_size(None, NS()) == 32 and resolve_batch_size(None, NS(batch_size=True)) == 32
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert resolve_batch_size(64, NS(batch_size=64)) == 64
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert resolve_batch_size(64, NS(batch_size=128)) == 64
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["--batch-size 64 differs from the problem's batch_size 128: jobs use 64; the problem's is for "
                      "its BatchNorm re-estimation and full-gradient chunks"]
    assert "jobs of 128 samples (the problem's batch_size)" in caplog.text


def test_serve_without_batch_size_records_the_problems_in_run_json(tmp_path):
    from ps.cli.options import training_spec
    from ps.drivers.server import ServeOptions, StateOptions, make_daemon
    from ps.journal.runfile import read_run

    spec = training_spec("quadratic", (), "asgd", ("lr=0.1",), None, default_problem="quadratic",
                         default_algorithm="asgd")
    daemon = make_daemon(spec, "tcp://127.0.0.1:0", ServeOptions(batch_size=None, max_steps=1),
                         state=StateOptions(str(tmp_path / "state")))
    try:
        assert daemon.core.cfg.batch_size == 32 == read_run(str(tmp_path / "state"))["core"]["batch_size"]
    finally:
        daemon.persist.close()
        daemon.close()


def test_a_bind_on_a_busy_port_leaves_no_half_made_state_directory(tmp_path):
    """issue 25: ``Address already in use`` left run.json and a journal behind (then ``export``
    said the directory held a run with no checkpoint); now the new run's files go, and the next
    start on a free port is a new run. A resumed run's directory keeps all it held."""
    import click
    import zmq

    from ps.cli.options import training_spec
    from ps.drivers.server import ServeOptions, StateOptions, make_daemon

    ctx = zmq.Context()
    busy = ctx.socket(zmq.ROUTER)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    spec = training_spec("quadratic", (), "asgd", ("lr=0.1",), None, default_problem="quadratic",
                         default_algorithm="asgd")
    opts = ServeOptions(max_steps=1)
    try:
        fresh, empty = tmp_path / "fresh", tmp_path / "empty"
        empty.mkdir()
        (empty / "notes.txt").write_text("mine")
        for d in (fresh, empty):
            with pytest.raises(click.ClickException, match=f"cannot bind tcp://127.0.0.1:{port}"):
                make_daemon(spec, f"tcp://127.0.0.1:{port}", opts, state=StateOptions(str(d)))
        assert not fresh.exists()
        assert sorted(p.name for p in empty.iterdir()) == ["notes.txt"]
        daemon = make_daemon(spec, "tcp://127.0.0.1:0", opts, state=StateOptions(str(empty)))  # a new run
        daemon.persist.close()
        daemon.close()
        held = sorted(p.name for p in empty.iterdir())
        assert "run.json" in held
        with pytest.raises(click.ClickException, match="cannot bind"):
            make_daemon(spec, f"tcp://127.0.0.1:{port}", opts, state=StateOptions(str(empty)))  # resumed
        assert set(held) <= {p.name for p in empty.iterdir()}  # nothing of the run goes (its restart is journaled)
    finally:
        busy.close(0)
        ctx.term()


def test_a_late_reply_is_logged_with_what_it_means(caplog):
    """issue 25: ``late w1`` alone left users guessing; the line says the reply came after its
    job was settled, how the job was settled, and that nothing was lost."""
    import logging

    from ps.cli.options import training_spec
    from ps.drivers.server import ServeOptions, make_daemon

    spec = training_spec("quadratic", (), "asgd", ("lr=0.1",), None, default_problem="quadratic",
                         default_algorithm="asgd")
    daemon = make_daemon(spec, "tcp://127.0.0.1:0", ServeOptions(max_steps=1))
    try:
        daemon.core.events.append({"ev": "late", "job_id": 7, "worker_id": "w1", "was": "lost", "t": 0.0})
        with caplog.at_level(logging.INFO, "latecomer.events"):
            daemon._flush_events()
    finally:
        daemon.close()
    assert [r.getMessage() for r in caplog.records if r.name == "latecomer.events"] == [
        "late w1: its reply to job 7 came after the job was settled (lost): ignored, nothing lost (a slow or "
        "frozen worker whose job was written off or cancelled, or a repeat)"]


def test_a_ready_worker_before_the_first_job_hears_how_many_more_min_workers_waits_for(caplog):
    """A compose run whose LATECOMER_WORKERS (the server's --min-workers) exceeds the workers started
    made no step and said nothing about why: each ready worker before the first job now logs how
    many more the server waits for; the line stops once jobs are handed out."""
    import logging

    from protocol.messages import Hello, Ready
    from ps.cli.options import training_spec
    from ps.drivers.server import ServeOptions, make_daemon

    spec = training_spec("quadratic", (), "asgd", ("lr=0.1",), None, default_problem="quadratic",
                         default_algorithm="asgd")
    daemon = make_daemon(spec, "tcp://127.0.0.1:0", ServeOptions(max_steps=10, min_workers=3))
    lines = []
    try:
        for wid in ("w1", "w2", "w3", "w4"):
            caplog.clear()
            with caplog.at_level(logging.INFO, "latecomer.events"):
                daemon.core.handle(wid, Hello(worker_id=wid, boot=1, credit=1), 0.0)
                daemon.core.handle(wid, Ready(credit=1), 0.0)
                daemon._flush_events()
            lines.append([r.getMessage() for r in caplog.records if r.name == "latecomer.events"])
            # the fields --log-format json writes beside the line
            waiting = [r.event for r in caplog.records if getattr(r, "event", {}).get("ev") == "waiting"]
            assert waiting == ([{"ev": "waiting", "more": 3 - len(lines), "min_workers": 3}] if len(lines) < 3 else [])
    finally:
        daemon.close()
    wait = "waiting for {} before the first job (--min-workers 3)"
    assert lines == [["joined w1", "ready w1", wait.format("2 more workers")],
                     ["joined w2", "ready w2", wait.format("1 more worker")],
                     ["joined w3", "ready w3"], ["joined w4", "ready w4"]]


def test_the_server_says_which_blocks_get_muon_and_in_what_arithmetic():
    from types import SimpleNamespace as NS

    import algorithms
    from ps.drivers.server import muon_blocks_text

    layout = (("emb", (50, 64)), ("attn", (256, 128)), ("attn.b", (256,)), ("mlp", (64, 32)))
    problem = NS(layout=layout, lmo_mask=(False, True, False, True))
    text = muon_blocks_text(algorithms.build("ringmaster-lmo", {"lmo": "muon"}), problem)
    assert text == ("Muon: Newton-Schulz on 2 of 4 blocks (attn 256x128 bfloat16, mlp 64x32 float32); the other 2 "
                    "take the momentum step (the problem's lmo_mask)")
    assert "on 3 of 4" in muon_blocks_text(algorithms.build("rennala-muon", {}), NS(layout=layout))  # rank rule
    assert muon_blocks_text(algorithms.build("ringmaster-lmo", {"lmo": "sign"}), problem) is None
    assert muon_blocks_text(algorithms.build("asgd", {}), problem) is None
