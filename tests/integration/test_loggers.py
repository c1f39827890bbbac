"""``--log-to``: a real ``latecomer serve`` (or ``run``) with real worker processes logs to
TensorBoard, W&B (offline) and MLflow (a file store); each is read back with its own reader and
holds the run's loss curve equal, value for value at the same steps, to the server's own
evaluations (summary.json from ``--out``), the run's settings, and the tick figures (step rate,
ages, per-worker throughput) checked against the event log. A logger that cannot write does
not stop the run.

Each test skips where its package is not installed, naming the extra (``pip install
latecomer[tensorboard|wandb|mlflow]``; the ``test`` extra installs all three)."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.integration.util import read_events, wait_line

pytestmark = pytest.mark.slow

STEPS, EVAL_EVERY, LR, BATCH = 300, 50, 0.05, 16


def _need(module: str, extra: str):
    return pytest.importorskip(module, reason=f"needs pip install latecomer[{extra}] (or latecomer[test])")


def clean_env(tmp_path, **extra: str) -> dict[str, str]:
    """This environment without W&B/MLflow settings or keys, HOME in ``tmp_path`` (no ~/.netrc)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_")) and k != "NETRC"}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(home / "wbcfg"),
               WANDB_CACHE_DIR=str(home / "wbcache"), WANDB_DATA_DIR=str(home / "wbdata"), **extra)
    return env


def start(procs, env, *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "ps", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                         stdout=stdout, stderr=stderr, start_new_session=True)
    procs.children.append(p)
    return p


def serve_run(tmp_path, procs, *log_to: str, env=None, algorithm="asgd") -> tuple[dict, list[dict], str]:
    """A 300-step run on quadratic, two workers of different speeds, ``--log-to`` each spec.
    Returns summary.json, the event log and the server's stderr."""
    env = env or clean_env(tmp_path)
    out, events, err_path = tmp_path / "out", tmp_path / "events.jsonl", tmp_path / "serve.err"
    with open(err_path, "wb") as err:
        server = start(procs, env, "serve", "--bind", "tcp://127.0.0.1:0", "-p", "quadratic", "--problem-opt", "d=20",
                       "-a", algorithm, "--set", f"lr={LR}", "--batch-size", str(BATCH), "--max-steps", str(STEPS),
                       "--eval-every", str(EVAL_EVERY), "--min-workers", "2", "--out", str(out),
                       "--events", str(events), *[a for s in log_to for a in ("--log-to", s)],
                       stdout=subprocess.PIPE, stderr=err)
        endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
        workers = [start(procs, env, "work", "--server", endpoint, "--worker-id", f"w{i}", "--delay", d)
                   for i, d in ((1, "0.003"), (2, "0.009"))]
        rc = server.wait(timeout=120)
        for w in workers:
            w.wait(timeout=30)
    stderr = err_path.read_text()
    assert rc == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] == STEPS and summary["evaluations"][-1]["version"] == STEPS
    return summary, read_events(str(events)), stderr


def expected_losses(summary: dict) -> list[tuple[int, float]]:
    return [(int(e["version"]), float(e["loss"])) for e in summary["evaluations"]]


def check_ticks(series: dict[str, list[tuple[int, float]]], summary: dict, events: list[dict]) -> None:
    """The tick figures against the event log: every applied age within the logged maxima, the
    largest one logged, the totals, both workers' throughput, the final tick at the last step."""
    ages = [e["age"] for e in events if e["ev"] == "applied"]
    assert len(ages) == STEPS
    logged_max = [v for _, v in series["age/max"]]
    assert max(logged_max) == max(ages)
    assert all(0 <= v <= max(ages) for _, v in series["age/mean"])
    assert series["server/step_rate"][-1][0] == STEPS  # the final tick, at close
    assert series["jobs/lost"][-1][1] == summary["counters"]["lost"]
    for wid in ("w1", "w2"):
        rates = [v for _, v in series.get(f"worker/{wid}/jobs_per_s", [])]
        assert rates and max(rates) > 0, (wid, sorted(series))
    steps = [s for s, _ in series["server/step_rate"]]
    assert steps == sorted(steps) and all(0 <= s <= STEPS for s in steps)


# --------------------------------------------------------------------------- TensorBoard

def read_tensorboard(log_dir) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    hparams = {k: (v.string_value if v.HasField("string_value") else v.number_value if v.HasField("number_value")
                   else v.bool_value) for k, v in info.hparams.items()}
    return series, hparams


def test_tensorboard_holds_the_servers_loss_curve_and_settings(tmp_path, procs):
    _need("tensorboard", "tensorboard")
    tb = tmp_path / "tb"
    summary, events, stderr = serve_run(tmp_path, procs, f"tensorboard:{tb}")
    assert f"tensorboard: logging to {tb}" in stderr
    series, hparams = read_tensorboard(tb)
    want = expected_losses(summary)
    assert len(want) == STEPS // EVAL_EVERY + 1
    # TensorBoard keeps scalars as float32: the same values, rounded as it stores them
    assert series["eval/loss"] == [(v, float(np.float32(loss))) for v, loss in want]
    assert [s for s, _ in series["eval/grad_norm_sq"]] == [v for v, _ in want]
    assert hparams["algorithm"] == "asgd" and hparams["alg.lr"] == pytest.approx(LR)
    assert hparams["batch_size"] == BATCH and hparams["problem"] == "quadratic" and hparams["problem.d"] == 20
    check_ticks(series, summary, events)


# --------------------------------------------------------------------------- W&B (offline)

def wandb_records(path: str):
    """The records of a .wandb file (W&B's LevelDB-style log: a 7-byte header ``:W&B`` + magic +
    version, then 32 KiB blocks of chunks with a 7-byte header: CRC-32C, length, type FULL=1,
    FIRST=2, MIDDLE=3, LAST=4), each a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def read_wandb(run_dir: str) -> tuple[dict[str, list[tuple[int, float]]], dict, str]:
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    series: dict[str, list[tuple[int, float]]] = {}
    config: dict = {}
    project = ""
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "metric" and r.metric.glob_name == "*":
            config["_x_axis"] = r.metric.step_metric
        elif kind == "run":
            project = r.run.project
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for k, v in row.items():
                if not k.startswith("_") and k != "version":
                    series.setdefault(k, []).append((int(row["version"]), v))
    return series, config, project


def test_wandb_goes_offline_without_a_key_and_its_run_file_holds_the_loss_curve(tmp_path, procs):
    _need("wandb", "wandb")
    summary, events, stderr = serve_run(tmp_path, procs, "wandb:latecomer-test")
    line = [ln for ln in stderr.splitlines() if "wandb: offline run in " in ln]
    assert len(line) == 1, stderr[-3000:]
    run_dir = line[0].split("wandb: offline run in ", 1)[1].split(" (", 1)[0]
    assert run_dir.startswith(str(tmp_path)) and os.path.isdir(run_dir)
    series, config, project = read_wandb(run_dir)
    assert project == "latecomer-test"
    assert series["eval/loss"] == expected_losses(summary)  # JSON floats: bit for bit
    assert config["algorithm"] == "asgd" and config["alg.lr"] == LR and config["batch_size"] == BATCH
    assert config["_x_axis"] == "version"  # every chart against the server's step, not W&B's own
    check_ticks(series, summary, events)


def test_wandb_mode_wins_over_a_configured_key(tmp_path, procs):
    """An API key would mean online; WANDB_MODE=offline keeps the run here (no network needed)."""
    _need("wandb", "wandb")
    env = clean_env(tmp_path, WANDB_MODE="offline", WANDB_API_KEY="0" * 40)
    summary, _, stderr = serve_run(tmp_path, procs, "wandb", env=env)
    (line,) = [ln for ln in stderr.splitlines() if "wandb: offline run in " in ln]
    run_dir = line.split("wandb: offline run in ", 1)[1].split(" (", 1)[0]
    series, _, project = read_wandb(run_dir)
    assert project == "latecomer" and series["eval/loss"] == expected_losses(summary)


# --------------------------------------------------------------------------- MLflow (file store)

def read_mlflow(uri: str) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("latecomer")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    series = {}
    for name in run.data.metrics:
        hist = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: (m.timestamp, m.step))
        series[name] = [(m.step, m.value) for m in hist]
    return series, dict(run.data.params)


def test_mlflow_file_store_holds_the_loss_curve_and_params(tmp_path, procs, monkeypatch):
    _need("mlflow", "mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    summary, events, stderr = serve_run(tmp_path, procs, f"mlflow:{store}", algorithm="delay-adaptive")
    assert f"at {store.as_uri()}" in stderr
    series, params = read_mlflow(store.as_uri())
    want = expected_losses(summary)
    assert sorted(series["eval/loss"]) == want
    assert params["algorithm"] == "delay-adaptive" and float(params["alg.lr"]) == LR
    assert params["batch_size"] == str(BATCH) and params["alg.n_workers"] == "1"
    check_ticks({k: sorted(v) for k, v in series.items()}, summary, events)
    # delay-adaptive reports the step size of its latest reply, lr * min(1, n/age) with n = 1: lr logged as it
    lrs = [v for _, v in series["lr"]]
    assert lrs and series["lr"] == series["alg/lr"] and all(0 < v <= LR for v in lrs)
    assert all(LR / v == pytest.approx(round(LR / v)) for v in lrs)  # lr / age for an integer age >= 1


def test_latecomer_run_logs_too(tmp_path, procs, monkeypatch):
    """``latecomer run`` (server in-process, local workers) with a ``file:`` MLflow URI."""
    _need("mlflow", "mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "store").as_uri()
    p = start(procs, clean_env(tmp_path), "run", "-p", "quadratic", "--problem-opt", "d=20", "-a", "asgd", "--set",
              f"lr={LR}", "--steps", "200", "--eval-every", "50", "--workers", "2", "--delays", "0.002,0.006",
              "--batch-size", str(BATCH), "--out", str(tmp_path / "out"), "--no-progress", "--log-to",
              f"mlflow:{uri}", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-3000:]
    assert f"in experiment 'latecomer' at {uri}" in err.decode()  # said though `run` logs at warning level
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    series, params = read_mlflow(uri)
    assert sorted(series["eval/loss"]) == expected_losses(summary) and summary["version"] == 200
    assert params["algorithm"] == "asgd" and float(params["alg.lr"]) == LR


def mlflow_server_python() -> str:
    """A Python with the full mlflow package (``mlflow server`` needs it; mlflow-skinny, the
    extra's package, has the client only): LATECOMER_TEST_MLFLOW_PYTHON, else this one."""
    py = os.environ.get("LATECOMER_TEST_MLFLOW_PYTHON") or sys.executable
    try:
        ok = subprocess.run([py, "-c", "import mlflow.server.handlers, sqlalchemy"], capture_output=True,
                            timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("needs a tracking server: the full mlflow package (pip install mlflow, about 1 GB, not in the "
                    "test extra) here or in LATECOMER_TEST_MLFLOW_PYTHON")
    return py


def test_mlflow_tracking_server(tmp_path, procs):
    """``mlflow:http://...``: a real ``mlflow server`` on loopback; read back over HTTP."""
    import signal
    import socket
    import time
    import urllib.request

    _need("mlflow", "mlflow")
    py = mlflow_server_python()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(tmp_path / "mlflow-server.log", "wb") as log:
        server = subprocess.Popen([py, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                   "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path}/mlflow.db",
                                   "--default-artifact-root", str(tmp_path / "artifacts")],
                                  cwd=tmp_path, env=clean_env(tmp_path), stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=log, start_new_session=True)
    procs.children.append(server)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "mlflow-server.log").read_text()
            time.sleep(0.2)  # polling interval of a bounded wait
        summary, events, stderr = serve_run(tmp_path, procs, f"mlflow:{uri}")
        assert f"at {uri}" in stderr
        series, params = read_mlflow(uri)
        assert sorted(series["eval/loss"]) == expected_losses(summary)
        assert params["algorithm"] == "asgd" and float(params["alg.lr"]) == LR
        check_ticks({k: sorted(v) for k, v in series.items()}, summary, events)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn worker
            server.wait(timeout=30)


# --------------------------------------------------------------------------- a logger that fails

def test_a_logger_that_cannot_write_does_not_stop_the_run(tmp_path, procs, monkeypatch):
    """TensorBoard pointed at a regular file (its directory cannot be made, root or not) next to a
    working MLflow logger: the run reaches its steps, the failure is one warning, MLflow has it all."""
    _need("tensorboard", "tensorboard")
    _need("mlflow", "mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the log directory should be")
    store = tmp_path / "mlruns"
    summary, _, stderr = serve_run(tmp_path, procs, f"tensorboard:{blocker}", f"mlflow:{store}")
    assert sum("tensorboard logger could not start" in ln for ln in stderr.splitlines()) == 1, stderr[-3000:]
    assert blocker.read_text().startswith("a file")
    series, _ = read_mlflow(store.as_uri())
    assert sorted(series["eval/loss"]) == expected_losses(summary)
