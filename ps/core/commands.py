"""The commands the core returns to its driver (the ZeroMQ daemon or the simulator), which carries
them out: send a message to a worker, or forget a worker at the transport level."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to ``worker_id``."""

    worker_id: str
    msg: Any


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Forget this worker at the transport level (quarantine); a Bye was already queued."""

    worker_id: str
    reason: str


Command = Send | Disconnect
