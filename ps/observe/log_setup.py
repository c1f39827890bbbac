"""How a latecomer process logs: one handler on stderr, text or one JSON object per line.

The commands (ps/cli/) and the Python API's forked server and workers (latecomer/api.py) set
their process's logging up here, so that neither depends on the other for it."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, fmt: str = "text") -> None:
    """The root logger at ``level`` (debug, info, warning, error), writing to stderr in ``fmt``
    (text, or json: ps/observe/metrics.py ``JsonFormatter``); replaces any handler set before."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from ps.observe.metrics import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
