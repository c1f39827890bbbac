"""``python -m ps`` is the ``latecomer`` command."""

from ps.cli import main

main()
