"""The deployment recipes started for real (``make test-deploy``): a SLURM cluster of two
``slurmd`` on this host, the container image under podman and podman-compose, and the Kubernetes
manifests rendered and validated. What these tests need is installed by ``tests/deploy/install_*.sh``
(called by ``make test-deploy``); a missing tool fails the test with one line naming the script,
it never skips silently."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)


def require(tool: str, script: str) -> str:
    """The path of ``tool`` (on PATH or beside this Python), or the test fails with one line."""
    path = shutil.which(tool) or shutil.which(tool, path=VENV_BIN)
    if not path:
        pytest.fail(f"{tool} is not installed: run `make test-deploy` (it runs tests/deploy/{script})",
                    pytrace=False)
    return path
