"""User problem modules: found in the working directory, worker-local options and their merge rule."""

from __future__ import annotations

import sys

import pytest

from problems.loader import load_problem, merge_worker_options, resolve_factory, worker_local, worker_local_options

TOY = '''
import numpy as np
import latecomer


class Toy(latecomer.Problem):
    layout = (("w", (2,)),)

    def __init__(self, where):
        self.where = where

    def init_params(self, seed):
        return np.zeros(2, np.float32)

    def grad(self, x, seed, batch_size):
        return latecomer.GradResult(grad=(x - 1).astype(np.float32), loss=float(((x - 1) ** 2).sum()))

    def evaluate(self, x):
        return {"loss": float(((x - 1) ** 2).sum())}


@latecomer.worker_local("where")
def make(where: str = "server", scale: float = 1.0, device: str = "cpu"):
    return Toy(where)
'''


@pytest.fixture
def toy_in_cwd(tmp_path, monkeypatch):
    name = f"toymod_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TOY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the cwd the loader appends goes away after the test
    yield name
    sys.modules.pop(name, None)


def test_a_user_module_is_found_in_the_working_directory(toy_in_cwd, tmp_path):
    p = load_problem(f"{toy_in_cwd}:make", {"where": "here"})
    assert p.where == "here" and p.spec == f"{toy_in_cwd}:make"
    assert str(tmp_path) == sys.path[-1]  # appended: never shadows an installed module


def test_a_missing_user_module_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ValueError) as info:
        resolve_factory("not_here_mod:make")
    msg = str(info.value)
    assert "run from the folder that holds not_here_mod.py (or its package not_here_mod/), or add that folder " \
           "to PYTHONPATH" in msg and "\n" not in msg


def test_a_user_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_mod_x.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "raising_mod_x.py").write_text("raise RuntimeError('bad config')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ValueError, match=r"importing module 'broken_mod_x' failed: No module named "
                                         r"'no_such_dependency_xyz'$"):
        resolve_factory("broken_mod_x:make")
    with pytest.raises(ValueError, match=r"importing module 'raising_mod_x' failed: RuntimeError: bad config$"):
        resolve_factory("raising_mod_x:make")


def test_worker_overrides_merge_only_worker_local_options(toy_in_cwd):
    spec = f"{toy_in_cwd}:make"
    server = {"where": "/server/data", "scale": 2.0}
    assert merge_worker_options(spec, server, {}) == server
    assert merge_worker_options(spec, server, {"where": "/local"}) == {"where": "/local", "scale": 2.0}
    assert merge_worker_options(spec, {}, {"where": "/local"}) == {"where": "/local"}
    with pytest.raises(ValueError) as info:
        merge_worker_options(spec, server, {"scale": "3", "where": "/local"})
    assert str(info.value) == (f"problem '{spec}': --problem-opt scale: not a worker-local option, the server sets "
                               "it (worker-local: where)")


def test_builtins_declare_nothing_but_mnist_paths():
    with pytest.raises(ValueError, match="worker-local: none"):
        merge_worker_options("digits", {}, {"hidden": "8"})
    assert worker_local_options(resolve_factory("mnist")) == {"images", "labels", "test_images", "test_labels"}


def test_worker_local_decorator_accumulates_and_checks_names():
    @worker_local("b")
    @worker_local("a")
    def make(a="", b="", device="cpu"):
        return None

    assert worker_local_options(make) == {"a", "b"}
    with pytest.raises(ValueError, match="'device' is always the worker's own"):
        worker_local("device")
    with pytest.raises(ValueError, match="must be identifiers"):
        worker_local("data dir")
