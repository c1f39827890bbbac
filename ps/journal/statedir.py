"""What every file of a state directory shares: the error a directory that cannot be used
raises (:class:`StateError`), and making a new, renamed or removed file's name durable
(:func:`fsync_dir`). The lowest module of ps/journal: it imports no other."""

from __future__ import annotations

import os


class StateError(ValueError):
    """A state directory that cannot be used as it is: damaged, unexpected, or in use. The text
    is one line naming the file (and the byte offset, for a journal record) and what to do."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
