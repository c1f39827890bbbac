"""latecomer export / latecomer.state_dict / load_state_dict: state and out directories, formats, mistakes."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
import types

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import algorithms
from problems.trust import Allowed
from ps.cli.main import main
from ps.core.config import CoreConfig
from ps.core.server_core import ServerCore
from ps.journal.checkpoints import write_checkpoint
from ps.journal.runfile import write_run
from ps.ops.export import load_state_dict, locate, state_dict

torch.set_num_threads(1)

USER_MODULE = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

import latecomer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=g) + 2.0
    return TensorDataset(x, (x.sum(1) > 8).long() + (x[:, 0] > 2).long())


def make(device="cpu"):
    return latecomer.TorchProblem(Net, nn.functional.cross_entropy, data(), data(), bn_batches=4, device=device)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's problem module in the working directory (found there, as `latecomer serve` finds it)."""
    name = f"exportmod_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def state_dir(path, spec: str, xs: dict[int, np.ndarray], options=None):
    """A --state directory of an asgd run on ``spec`` with one checkpoint per LSN -> iterate."""
    path.mkdir()
    core_cfg = CoreConfig(problem=spec, problem_options=dict(options or {}), batch_size=8, seed=0, run_id=1)
    run = {"problem": spec, "problem_options": dict(options or {}), "algorithm": "asgd", "settings": {"lr": 0.1},
           "format": 1, "wire_dtype": "f32", "core": dataclasses.asdict(core_cfg)}
    write_run(str(path), run)
    for lsn, x in xs.items():
        core = ServerCore(algorithms.build("asgd", {"lr": 0.1}), x, core_cfg)
        write_checkpoint(str(path), lsn, core.snapshot())
    return str(path)


def test_state_dir_exports_the_newest_checkpoint_and_another_by_lsn(tmp_path):
    d = state_dir(tmp_path / "state", "quadratic", {3: np.full(4, 1, np.float32), 9: np.full(4, 2, np.float32)},
                  {"d": 4})
    assert locate(d).x.tolist() == [2.0] * 4 and locate(d).source.startswith("ckpt-000000000009.bin")
    assert locate(d, 3).x.tolist() == [1.0] * 4
    assert locate(d, str(tmp_path / "state" / "ckpt-000000000003.bin")).x.tolist() == [1.0] * 4
    with pytest.raises(ValueError, match=r"no checkpoint at LSN 5 \(have: 3, 9\)"):
        locate(d, 5)
    sd = state_dict(d)
    assert list(sd) == ["x"] and sd["x"].tolist() == [2.0] * 4  # layout names of a non-torch problem


def test_export_cli_torch_state_dict_loads_into_a_fresh_module(tmp_path, user_module):
    from problems import load_problem

    problem = load_problem(f"{user_module}:make")
    x = problem.init_params(0) * 1.5
    d = state_dir(tmp_path / "state", f"{user_module}:make", {4: x})
    out = tmp_path / "model.pt"
    r = CliRunner().invoke(main, ["export", d, "-o", str(out)])  # run.json names code: the command line must too
    assert r.exit_code == 1 and f"add --allow-problem {user_module}:make" in r.output and not out.exists(), r.output
    r = CliRunner().invoke(main, ["export", d, "-o", str(out), "--allow-problem", f"{user_module}:make"])
    assert r.exit_code == 0, r.output
    assert f"of {user_module}:make" in r.output and "from ckpt-000000000004.bin (LSN 4)" in r.output
    sd = torch.load(out)
    module = sys.modules[user_module]
    net = module.Net()
    net.load_state_dict(sd)  # parameters and buffers, by the model's own names
    assert set(sd) == set(net.state_dict()) and "bn.running_mean" in sd
    expected = problem.state_dict(x)
    assert all(torch.equal(sd[k], expected[k]) for k in expected)
    assert int(sd["bn.num_batches_tracked"]) == 4  # re-estimated, as evaluate does
    net.eval()
    xs, ys = module.data().tensors
    with torch.no_grad():
        acc = float(np.mean((net(xs).argmax(1) == ys).numpy()))
    assert acc == problem.evaluate(x)["accuracy"]
    fresh = load_state_dict(module.Net(), d)  # the module that defines the model's class is trusted
    assert all(torch.equal(fresh.state_dict()[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match=f'pass allow_problem="{user_module}:make"') as e:
        state_dict(d)  # a Python call is told the keyword, not the command line's flag
    assert "--allow-problem" not in str(e.value)
    with pytest.raises(ValueError, match=f'pass allow_problem="{user_module}:make"'):
        load_state_dict(torch.nn.Linear(2, 2), d)  # a model class from a library: the same one line
    assert set(state_dict(d, allow_problem=f"{user_module}:*")) == set(sd)


def test_out_dir_exports_final_x_with_problem_json(tmp_path, user_module):
    from problems import load_problem
    from ps.drivers.outputs import write_outputs

    problem = load_problem(f"{user_module}:make")
    x = problem.init_params(1)
    core = types.SimpleNamespace(params=lambda: x, cfg=CoreConfig(problem=f"{user_module}:make"))
    daemon = types.SimpleNamespace(core=core, summary=lambda: {"version": 17})
    out = tmp_path / "out"
    write_outputs(str(out), daemon)
    assert json.loads((out / "problem.json").read_text()) == {"problem": f"{user_module}:make",
                                                              "problem_options": {}}
    point = locate(str(out), allowed=Allowed(named_problems=frozenset({f"{user_module}:make"})))
    assert point.version == 17 and point.source == "final_x.npy" and point.x.tobytes() == x.tobytes()
    r = CliRunner().invoke(main, ["export", str(out), "--format", "npy", "-o", str(tmp_path / "m.npz")])
    assert r.exit_code == 1 and "problem.json names the problem" in r.output, r.output
    r = CliRunner().invoke(main, ["export", str(out), "--format", "npy", "-o", str(tmp_path / "m.npz"),
                                  "--allow-problem", user_module])
    assert r.exit_code == 0, r.output
    assert "at step 17 from final_x.npy" in r.output
    with np.load(tmp_path / "m.npz") as z:
        expected = problem.state_dict(x)
        assert sorted(z.files) == sorted(expected)
        assert all(np.array_equal(z[k], expected[k].numpy()) for k in expected)
    r = CliRunner().invoke(main, ["export", str(out), "--checkpoint", "3", "-o", str(tmp_path / "m.pt")])
    assert r.exit_code == 1 and "--checkpoint needs a --state directory" in r.output


def test_safetensors_without_the_package_is_a_one_line_error(tmp_path, monkeypatch):
    d = state_dir(tmp_path / "state", "quadratic", {1: np.zeros(3, np.float32)}, {"d": 3})
    monkeypatch.setitem(sys.modules, "safetensors", None)  # not importable, installed or not
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    r = CliRunner().invoke(main, ["export", d, "--format", "safetensors", "-o", str(tmp_path / "m.st")])
    assert r.exit_code == 1
    assert r.output.strip() == "Error: --format safetensors needs the safetensors package: pip install safetensors " \
                               "(or pip install 'latecomer[export]')"


def test_safetensors_when_installed(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    d = state_dir(tmp_path / "state", "quadratic", {1: np.arange(3, dtype=np.float32)}, {"d": 3})
    r = CliRunner().invoke(main, ["export", d, "--format", "safetensors", "-o", str(tmp_path / "m.st")])
    assert r.exit_code == 0, r.output
    assert st.load_file(str(tmp_path / "m.st"))["x"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("make_dir, message", [
    (lambda p: p, "is not a run directory (no run.json, no final_x.npy)"),
    (lambda p: (np.save(p / "final_x.npy", np.zeros(2, np.float32)), p)[1], "no problem.json"),
    (lambda p: (write_run(str(p), {"problem": "quadratic", "problem_options": {}}), p)[1],
     "holds a run but no checkpoint and no final_x.npy"),
])
def test_mistakes_are_one_line_click_errors(tmp_path, make_dir, message):
    d = tmp_path / "d"
    d.mkdir()
    r = CliRunner().invoke(main, ["export", str(make_dir(d)), "-o", str(tmp_path / "m.pt")])
    assert r.exit_code == 1 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_load_state_dict_into_the_wrong_module_is_a_one_line_error(tmp_path, user_module):
    from problems import load_problem

    x = load_problem(f"{user_module}:make").init_params(0)
    d = state_dir(tmp_path / "state", f"{user_module}:make", {2: x})
    with pytest.raises(ValueError) as info:
        load_state_dict(torch.nn.Linear(2, 2), d, allow_problem=f"{user_module}:*")
    assert "does not fit this module" in str(info.value) and "\n" not in str(info.value)


TIED_MODULE = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

import latecomer


class Tied(nn.Module):
    """An embedding and an output head that share one weight (GPT-2's form)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.wte(x))))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 7, (64,), generator=g)
    return TensorDataset(x, (x + 1) % 7)


def make(device="cpu"):
    return latecomer.TorchProblem(Tied, nn.functional.cross_entropy, data(), data(), device=device)
'''


def test_safetensors_of_a_tied_model_load_with_safetensors_load_model_and_get_the_usual_mode(tmp_path, monkeypatch):
    """issue 25: the export is in ``safetensors.torch.save_model``'s form, so ``load_model(net, file)``
    loads it into a fresh tied module (it failed with 'Unexpected key(s)'), and the file's mode is
    what a new file gets here (0644 under umask 022), as the .pt's, not 0600."""
    st = pytest.importorskip("safetensors.torch")
    from problems import load_problem

    (tmp_path / "tiedmod.py").write_text(TIED_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tiedmod", None)
    problem = load_problem("tiedmod:make")
    x = np.random.default_rng(0).standard_normal(problem.dim).astype(np.float32)
    d = state_dir(tmp_path / "state", "tiedmod:make", {5: x})
    old = os.umask(0o022)
    try:
        for fmt, name in (("safetensors", "m.safetensors"), ("torch", "m.pt")):
            r = CliRunner().invoke(main, ["export", d, "--format", fmt, "-o", str(tmp_path / name),
                                          "--allow-problem", "tiedmod:make"])
            assert r.exit_code == 0, r.output
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, fmt
    finally:
        os.umask(old)
    module = sys.modules["tiedmod"]
    net = module.Tied()
    missing, unexpected = st.load_model(net, str(tmp_path / "m.safetensors"))
    assert not missing and not unexpected
    want = problem.state_dict(x)
    assert all(torch.equal(net.state_dict()[k], want[k]) for k in want)
    assert net.head.weight is net.wte.weight  # still tied
    sys.modules.pop("tiedmod", None)
