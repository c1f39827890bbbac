"""The Python API's pieces that need no process (latecomer/api.py): local factory names in the
loader and the trust checks (a local name from the network is refused), and the one-line
errors of bad arguments, raised before anything starts. The real runs are in
tests/integration/test_api.py."""

from __future__ import annotations

import psutil
import pytest

import latecomer
from problems.loader import is_local, load_problem, register_local
from problems.quadratic import make_quadratic
from problems.trust import Allowed, check_run, worker_refusal
from protocol.messages import ErrorCode, Welcome


def make_small(d: int = 4, device: str = "cpu"):
    return make_quadratic(d=d)


# --------------------------------------------------------------------------- the loader and trust

def test_a_registered_factory_loads_by_its_local_name_and_keeps_it():
    name = register_local(make_small)
    assert is_local(name) and name.startswith("<local>:make_small#")
    assert register_local(make_small) == name  # the same callable: the same name
    assert register_local(lambda d=3: make_quadratic(d=d)) != name
    p = load_problem(name, {"d": "6"})
    assert p.dim == 6 and p.spec == name and p.options == {"d": 6}


def test_a_local_name_not_registered_here_loads_nothing_one_line():
    with pytest.raises(ValueError) as e:
        load_problem("<local>:make#999")
    msg = str(e.value)
    assert "\n" not in msg and "'<local>:make#999'" in msg and "another process" in msg
    with pytest.raises(ValueError, match="expected a spec string or a callable"):
        register_local(42)


def test_no_pattern_trusts_a_local_name_only_the_exact_name_does():
    name = register_local(make_small)
    assert not Allowed().problem_ok(name)
    assert not Allowed(problems=("*", "<local>*", "*:*")).problem_ok(name)  # even patterns check_pattern refuses
    assert Allowed().naming(problem=name).problem_ok(name)
    assert not Allowed().naming(problem=name).problem_ok("<local>:make_small#0")
    refusal = worker_refusal(name, Allowed(problems=("mymodel:*",)))
    assert refusal.startswith(f"problem {name!r}: not allowed here") and "\n" not in refusal
    with pytest.raises(ValueError, match="names the problem"):
        check_run({"problem": name}, Allowed(problems=("m:*",)), "run.json")


def test_a_worker_refuses_a_local_name_a_server_sends_unless_it_was_forked_to_load_it(monkeypatch):
    """A welcome naming a local name (registered in this very process) is refused before the
    factory is called by a worker not started by the API to load it; the one that was loads it."""
    from worker.link import Worker, WorkerConfig

    calls = []

    def factory(device="cpu"):
        calls.append(device)
        return make_quadratic(d=4)

    name = register_local(factory)
    w = Worker(WorkerConfig(server="tcp://127.0.0.1:1", worker_id="t", allow_problems=("mymodel:*",)))
    sent = []
    monkeypatch.setattr(w, "_send", lambda msg: sent.append(msg) or True)
    w._on_welcome(Welcome(server_boot=1, version=1, problem=name, run_id=3))
    assert calls == [] and w.compute is None and not w.loaded
    assert [(type(m).__name__, m.code) for m in sent] == [("Error", ErrorCode.PROBLEM_UNAVAILABLE)]
    assert w.failure.startswith(f"cannot load problem {name}: not allowed here")
    w.ctx.term()

    trusted = Worker(WorkerConfig(server="tcp://127.0.0.1:1", worker_id="u", local_problems=(name,)))
    monkeypatch.setattr(trusted, "_send", lambda msg: True)
    trusted._on_welcome(Welcome(server_boot=1, version=1, problem=name, run_id=3))
    assert trusted.compute is not None and trusted.failure is None
    trusted.compute.close()
    assert calls == ["cpu"]
    trusted.ctx.term()
    with pytest.raises(ValueError, match="not a local name"):
        Worker(WorkerConfig(server="tcp://127.0.0.1:1", worker_id="v", local_problems=("os:system",)))


# --------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("kwargs, message", [
    ({"problem": 3}, "problem: expected a spec string"),
    ({"problem": "<local>:make#1"}, "problem: expected a built-in name"),
    ({"workers": -1}, "workers: expected an integer >= 0"),
    ({"workers": 1.5}, "workers: expected an integer >= 0"),
    ({"steps": 0}, "steps: expected an integer >= 1"),
    ({"max_time": float("nan")}, "max_time: expected a finite number > 0"),
    ({"target_loss": "low"}, "target_loss: expected a finite number"),
    ({"batch_size": 0}, "batch_size: expected an integer >= 1"),
    ({"eval_every": -5}, "eval_every: expected an integer >= 0"),
    ({"server": "cluster"}, "server: expected one of thread, process"),
    ({"bind": "tcp://127.0.0.1"}, "tcp://127.0.0.1"),
    ({"bind": "tcp://0.0.0.0:0"}, "without keys= would let anyone"),
    ({"delays": [0.1, -1]}, "delays: expected seconds >= 0"),
    ({"delays": "slow"}, "delays: expected"),
    ({"settings": {"lr": [1]}}, "settings: 'lr': values must be"),
    ({"settings": "lr=1"}, "settings: expected a dict"),
    ({"algorithm": ""}, "algorithm: expected a name"),
    ({"frobnicate": 1}, "unknown option 'frobnicate'"),
    ({"heartbeat_interval": 5.0}, "heartbeat_interval: must be smaller than liveness_timeout"),
    ({"shm": "maybe"}, "shm: expected one of auto, any, off"),
    ({"keys": "/nonexistent/keys"}, "keys: expected an existing directory"),
    ({"log_to": [3]}, "log_to: expected logger specs"),
])
def test_bad_arguments_are_one_line_errors_before_anything_starts(kwargs, message):
    kw = {"problem": "quadratic", "steps": 10, **kwargs}
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError) as e:
        latecomer.start(kw.pop("problem"), **kw)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_a_problem_or_algorithm_that_does_not_load_is_one_line_and_no_worker_is_left():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for kw, message in (({"algorithm": "no-such-algorithm"}, "no-such-algorithm"),
                        ({"problem_options": {"d": "many"}}, "invalid value 'many' for option 'd'")):
        with pytest.raises(ValueError) as e:
            latecomer.start(make_small, steps=10, workers=2, **kw)
        assert message in str(e.value) and "\n" not in str(e.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_train_needs_a_stop_condition_and_connect_a_well_formed_endpoint(tmp_path):
    with pytest.raises(ValueError, match="give steps=, max_time= or target_loss="):
        latecomer.train("quadratic")
    with pytest.raises(ValueError, match="tcp://"):
        latecomer.connect("localhost:5555")
    with pytest.raises(ValueError, match="keys: expected"):
        latecomer.connect("tcp://127.0.0.1:5555", keys=(str(tmp_path / "a"), str(tmp_path / "b")))
    with pytest.raises(TimeoutError, match="no answer"):
        latecomer.connect("tcp://127.0.0.1:1").status(timeout=0.2)


def test_the_api_is_exported_lazily():
    assert {"start", "train", "connect", "Run", "Client"} <= set(latecomer.__all__)
    assert latecomer.start.__module__ == "latecomer.api"


def test_a_bad_logger_spec_is_one_line_before_anything_starts():
    pytest.importorskip("ps.observe.loggers")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError) as e:
        latecomer.start(make_small, steps=10, workers=2, log_to=["nosuch:x"])
    assert "nosuch:x" in str(e.value) and "\n" not in str(e.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
