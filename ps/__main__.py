"""``python -m ps`` is the ``latecomer`` command."""

from ps.cli.main import main

main()
