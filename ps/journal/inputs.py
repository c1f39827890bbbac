"""The journaling core: every input the :class:`~ps.core.server_core.ServerCore` is fed, recorded first.

The core is a deterministic function of its inputs: the messages it handles (with their
``now``), its ticks, the workers the daemon removes (revoked, unreachable), the messages that
only count, the end of issuing, a restart or a resume (clock rebases). :class:`CoreInputs` is
the one place that feeds them: live, each method writes its journal record (ps/journal/persistence.py)
and then feeds the core; :meth:`CoreInputs.apply` turns a journal record back into the same
call, without writing. Recovery and ``latecomer replay`` go through :meth:`apply`, the daemon
through the methods, so the three cannot drift: what the core does with an input is written
once, here.

A method returns the core's commands, or None when the input could not be journaled (the
state directory cannot be written: the input is not accepted, the core never sees it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from protocol.codec import decode
from ps.journal.records import journaled_norms
from ps.journal.replies import recompute_reply, reply_from_wire


class CoreInputs:
    """Feed ``core``, journaling each input to ``persist`` first (None: no journal; replay)."""

    def __init__(self, core: Any, persist: Any = None) -> None:
        self.core = core
        self.persist = persist

    def _journal(self, op: str, **body: Any) -> bool:
        return self.persist is None or self.persist.append(op, **body)

    # ------------------------------------------------------------------ live inputs
    def message(self, wid: str, msg: Any, now: float, key: str = "", refusal: Any = None, *,
                frames: Any = (), wire: str | None = None, keep_refusal: bool = False) -> list | None:
        """A message from worker ``wid``. ``frames``: what the journal keeps of it (see
        ``Persistence.record_message``); ``wire``: the dtype its gradients travelled in, when
        not the run's; ``refusal``: why the transport refuses its gradients; ``keep_refusal``:
        the record keeps the refusal itself (a sharded server: the shards refused the reply's
        blocks, which the record does not hold)."""
        if self.persist is not None and not self.persist.record_message(
                self.core, wid, msg, frames, now, key, wire=wire, refused=refusal is not None,
                refusal=refusal if keep_refusal else None):
            return None
        return self.core.handle(wid, msg, now, key, refusal)

    def hold(self, now: float, reason: str) -> list | None:
        """A sharded server holds the issuing of jobs (a shard is missing; ps/sharded/hub.py)."""
        if not self._journal("hold", now=now, reason=reason):
            return None
        self.core.held = reason
        return []

    def release(self, now: float) -> list | None:
        """... and issues again (every shard is back): the jobs the workers' credit allows go out."""
        if not self._journal("release", now=now):
            return None
        self.core.held = ""
        return self.core.dispatch(now)

    def tick(self, now: float) -> list | None:
        """The clock reached one of the core's deadlines (liveness, rounds)."""
        return self.core.on_tick(now) if self._journal("tick", now=now) else None

    def remove(self, wid: str, now: float, reason: str) -> list | None:
        """The daemon removes a worker (its key revoked, its connection gone)."""
        if not self._journal("remove", wid=wid, now=now, reason=reason):
            return None
        return self.core.remove_worker(wid, now, reason=reason)

    def count(self, kind: str) -> bool:
        """A message that never reaches the core still counts (``invalid``, ``stray``, ``refused``)."""
        counts = self.core.counters.as_dict()
        if kind not in counts:
            raise ValueError(f"no counter {kind!r:.40}")
        if not self._journal("count", kind=kind):
            return False
        setattr(self.core.counters, kind, counts[kind] + 1)
        return True

    def stop_issuing(self) -> None:
        """The run is over: no more jobs (journaled when it can be; it is the last input)."""
        self._journal("stop_issuing")
        self.core.issuing = False

    # The two clock rebases are journaled by their callers (the state directory's opening,
    # Persistence's resume), which write the record before anything else can be written.
    def restarted(self, now: float) -> None:
        """A new server process resumed the run (its ``restart`` record is written): it issues
        again and the core's clock moves to this process's (restored workers get their grace)."""
        self.core.issuing = True
        self.core.rebase_clock(now)

    def resumed(self, now: float) -> None:
        """The state directory could be written again after a pause (its ``resume`` record is written):
        the same process, its workers' connections still bound."""
        self.core.rebase_clock(now, restart=False)

    # ------------------------------------------------------------------ replay
    # How a journaled reply gets its gradients back. Here (the server, recovery, replay): an
    # accepted reply journaled without them is recomputed from its seed; one journaled whole is
    # taken as it is. A sharded server's coordinator and shards substitute their own (ps/sharded/shard.py).
    @staticmethod
    def recompute(core: Any, wid: str, fields: dict, problem: Any, wire: str) -> Any:
        return recompute_reply(core, wid, fields, problem, wire)

    def payload(self, msg: Any, wid: str, problem: Any, wire_dtype: str) -> Any:
        return msg

    def apply(self, rec: Any, problem: Any, wire_dtype: str = "f32") -> list:
        """Feed one journal record to the core, exactly as the live run did (not journaled).

        ``wire_dtype``: the run's; journaled reply frames are converted from it and recomputed
        gradients are quantized to it, as on the live run."""
        from protocol.messages import ErrorCode, Reply

        b, op, core = rec.body, rec.op, self.core
        if op == "msg":
            msg, refusal = reply_from_wire(decode(b["frames"]), b.get("wire", wire_dtype))
            kept = b.get("refusal")
            if kept is not None:
                refusal = (ErrorCode(kept[0]), kept[1])
            elif type(msg) is Reply:
                msg = self.payload(msg, b["wid"], problem, wire_dtype)
                block_sq, step_sq = journaled_norms(b)  # a sharded coordinator's, from its shards
                if block_sq is not None or step_sq is not None:
                    msg = dataclasses.replace(msg, block_sq=block_sq, step_sq=step_sq)
            return self.message(b["wid"], msg, b["now"], b.get("key", ""), refusal) or []
        if op == "reply":  # accepted replies are journaled without gradients: recomputed from the seed
            wire = b["reply"].get("wire", wire_dtype)
            return self.message(b["wid"], self.recompute(core, b["wid"], b["reply"], problem, wire), b["now"]) or []
        if op == "tick":
            return self.tick(b["now"]) or []
        if op == "remove":
            return self.remove(b["wid"], b["now"], b["reason"]) or []
        if op == "count":
            self.count(b["kind"])
        elif op == "invalid":  # older journals
            self.count("invalid")
        elif op == "stop_issuing":
            self.stop_issuing()
        elif op == "restart":
            self.restarted(b["now"])
        elif op == "resume":
            self.resumed(b["now"])
        elif op == "hold":
            self.hold(b["now"], b["reason"])
        elif op == "release":
            return self.release(b["now"]) or []
        elif op not in ("start", "checkpoint"):
            raise ValueError(f"unknown journal record {op!r} at LSN {rec.lsn}")
        return []
