"""The daemon's event log (JSON lines, :class:`EventLog`): written a batch of whole lines at a
time, and never the reason a server stops (a full disk drops events, counted)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import msgspec

log = logging.getLogger("latecomer.persist")  # one logger for the state directory (its name predates the split)

try:  # json.dumps(ev) without building an encoder per call (what dumps does): the same text, in half the time
    from json.encoder import c_make_encoder as _c_make_encoder
    from json.encoder import encode_basestring_ascii as _ascii

    _ENCODE = _c_make_encoder(None, None, _ascii, None, ":", ",", False, False, True)

    def event_line(ev: dict[str, Any]) -> str:
        """``json.dumps(ev, separators=(",", ":"))``, exactly (flat events: no circular check)."""
        return "".join(_ENCODE(ev, 0))
except ImportError:  # an interpreter without the C accelerator
    def event_line(ev: dict[str, Any]) -> str:
        return json.dumps(ev, separators=(",", ":"))

_LINES = msgspec.json.Encoder().encode_lines


def event_lines(events: list[dict[str, Any]]) -> bytes:
    """The events as JSON lines (compact: no spaces after ``:`` and ``,``), each of which
    ``json.loads`` reads back to the event. msgspec writes a batch in one call, about a tenth of
    the json module's time (0.3 against 3.7 µs for an update's two events); a batch it cannot
    write as the json module would goes through that module instead: one holding NaN or an
    infinity (msgspec writes ``null``; json ``NaN``, which Python reads back), None (the same
    text either way, not worth telling apart from a NaN), anything outside ASCII (json escapes
    it, so no line holds a byte that a reader splitting lines might take for a line break, such
    as U+2028), or a value msgspec refuses (a float or int subclass of numpy's)."""
    try:
        data = _LINES(events)
    except Exception:  # noqa: BLE001 (whatever msgspec refuses, json decides: it may refuse too, as before)
        data = None
    if data is None or b"null" in data or not data.isascii():
        return "".join([event_line(ev) + "\n" for ev in events]).encode()
    return data


class EventLog:
    """The daemon's event log (JSON lines), appended a batch of whole lines at a time. A write the
    OS refuses (disk full) is cut back to the last whole line and its events dropped: counted, one
    warning when it starts and one when the log is written again. Never raises on a write."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.pending: list[str | list[dict[str, Any]]] = []  # text, or batches of events to serialize
        self.dropped = 0
        self.failing = False

    def write(self, text: str) -> None:
        self.pending.append(text)

    def write_events(self, events: list[dict[str, Any]]) -> None:
        """A batch of events, one JSON line each, serialized at the flush: in one go there, not
        one at a time between two updates with the caches of the rest of the loop. The dicts
        must not change meanwhile (the core makes a new one per event)."""
        self.pending.append(events)

    def _data(self) -> bytes:
        out: list[bytes] = []
        run: list[dict[str, Any]] = []  # the events since the last text: one call for them all
        for item in self.pending:
            if isinstance(item, str):
                if run:
                    out.append(event_lines(run))
                    run = []
                out.append(item.encode())
            else:
                run += item
        if run:
            out.append(event_lines(run))
        return b"".join(out)

    def flush(self) -> None:
        if not self.pending or self.fd < 0:
            return
        data = self._data()
        self.pending = []
        start = -1
        try:
            start = os.fstat(self.fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            if start >= 0:
                try:
                    os.ftruncate(self.fd, start)
                except OSError:
                    pass
            self.dropped += data.count(b"\n")
            if not self.failing:
                self.failing = True
                log.error("cannot write the event log %s (%s): events are dropped until it can be written",
                          self.path, e.strerror or e)
            return
        if self.failing:
            self.failing = False
            log.warning("the event log %s is written again (%d events were dropped)", self.path, self.dropped)

    def close(self) -> None:
        self.flush()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
