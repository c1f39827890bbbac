"""The ``latecomer bench`` command (registered in ps/cli/main.py with ``main.add_command(bench)``)."""

from benchmarks.bench import bench

__all__ = ["bench"]
