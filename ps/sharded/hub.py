"""The coordinator's side of a sharded server: its shards, the records they are sent, and the
replies that wait for their gradient blocks (PROTOCOL.md §12, docs/ALGORITHMS.md §14).

The coordinator is the ordinary daemon (ps/drivers/daemon.py) around a core whose algorithm is
``Sharded.coordinator``: bound to no blocks, it holds an empty iterate, so every job, reply
and journal record it handles is a header. Its journal orders everything; each shard runs a
core of its own over its blocks and is fed that journal's records in LSN order
(ps/sharded/shard.py). :class:`ShardHub` is what the daemon adds:

* **Records.** Every record the journal writes is tapped (``Journal.tap``) and shipped to each
  shard once durable under the fsync policy (``Journal.durable_lsn``), never past it, so a
  coordinator that crashes and recovers never finds a shard ahead of its journal. A shard
  that (re)joins gets the records after its own last one, from the tap or, when it is further
  behind, read back from the journal's segments; at most ``WINDOW`` records are in flight
  beyond what it has applied. The journal keeps the segments the shards' oldest checkpoints
  still need (``Persistence.retain_from``). ps/sharded/hub_records.py.
* **Replies.** A worker's reply header is held (:meth:`take_reply`) until every shard has said
  ``have`` for its job: the block journaled (durable), or refused (shape, NaN: the reply is then
  refused with that reason, as the unsharded server would refuse it). Only then does the core
  see it, so a reply counts only when all its blocks have arrived. The blocks travel on the
  worker's own connections to the shards, so while the worker lives (its liveness is the
  daemon's, over the headers-only coordinator link) and every shard is up, they are on their
  way, however slow the shard's link: the header waits. It is discarded, and the job written
  off at the worker's next heartbeat (it is no longer among the jobs the daemon reports busy
  for it), the same way on every shard since they follow the journal, when a shard that has
  not said it has the block rejoined since the header came (a restarted shard lost what it
  had not journaled) and ``2 × liveness`` passed after that, or after ``BLOCK_WAIT_MAX_S`` in
  any case (a connection that dropped under the block). A worker that dies takes its held
  headers with it: its jobs are written off, and a header of a settled job is counted late.
* **Admission.** A ``shello`` must carry the run's shard token (without ``--keys``), and a slot
  whose holder lives is never handed to another peer (ps/sharded/hub_admit.py).
* **Shards gone.** A shard silent for the liveness timeout is gone; while any is gone, or not
  yet joined, or its slot has no agreeing holder, the daemon holds the issuing of jobs (a
  journaled ``hold`` record; ``release`` once all are back), and workers' fetches from the
  missing shard wait.
* **Agreement.** A shard that has applied the journal up to its end reports its version and
  applied count, which must be the coordinator's; else one error names the shard, it is sent
  ``refuse`` and its connection dropped, and the run is held until a shard whose figures agree
  holds that slot (the same shard restarted, or another). A shard that says ``refuse`` (it
  cannot go on) is dropped the same way.
* **Parameters.** :meth:`request_params` asks every shard for its slice after a given record;
  the concatenation is the iterate the coordinator evaluates and writes as ``final_x.npy``
  (ps/sharded/hub_gathers.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from protocol.messages import ErrorCode
from ps.journal.segments import first_journal_lsn
from ps.sharded.control import ControlError, pack, unpack
from ps.sharded.hub_admit import ShardGate, peer_name, run_token
from ps.sharded.hub_gathers import ParamsGathers
from ps.sharded.hub_records import RecordStream
from ps.sharded.hub_table import SHARDS_FILE, ShardTable, Slot

log = logging.getLogger("latecomer.shards")

BLOCK_WAIT_MAX_S = 120.0  # the longest a reply header waits for its blocks (at least 2 x liveness)


@dataclass
class Pending:
    item: Any = None  # the reply's Inbound (None: only haves so far)
    at: float = 0.0  # when the header came
    rejoined: float = -math.inf  # when a shard whose block is missing last rejoined
    haves: dict = field(default_factory=dict)  # shard index -> None (journaled) or (code, text)
    bsq: dict = field(default_factory=dict)  # shard index -> its blocks' squared norms (clip_norm), if sent


class ShardHub:
    """The coordinator's control socket to its shards and what it carries: joins, progress and
    agreement, the haves that release held replies, the step-norm reductions, and the hold
    reason. Its parts: the slots (:class:`ShardTable`, ps/sharded/hub_table.py), the records
    shipped (:class:`RecordStream`, ps/sharded/hub_records.py) and the iterates gathered
    (:class:`ParamsGathers`, ps/sharded/hub_gathers.py)."""

    def __init__(self, ctx: zmq.Context, bind: str, n_shards: int, *, core: Any, persist: Any,
                 ranges: tuple, clock: Any, security: Any = None) -> None:
        if persist is None:
            raise ValueError("a sharded server needs a state directory (its journal feeds the shards)")
        self.n = n_shards
        self.core, self.persist, self.ranges, self.clock = core, persist, tuple(ranges), clock
        self.state_dir = persist.state_dir
        self.liveness_s = core.cfg.liveness_timeout_s
        self.block_wait_s = 2 * self.liveness_s  # after a shard missing a block rejoined
        self.block_wait_max_s = max(BLOCK_WAIT_MAX_S, self.block_wait_s)  # in any case
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.sndhwm = self.sock.rcvhwm = 10_000
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(hi - lo for lo, hi in self.ranges) * 8 + (1 << 20))
        if security is not None:  # only a holder of the server's secret key is a shard (ps/net/security.py)
            security.apply_shard_server(self.sock)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.table = ShardTable(n_shards, self.ranges, self.state_dir)  # the slots (ps/sharded/hub_table.py)
        self.token = run_token(self.state_dir, SHARDS_FILE)  # the run's shard token (ps/sharded/hub_admit.py)
        # With --keys the CURVE key pair is the shards' credential; else the token (SECURITY.md)
        self.gate = ShardGate(None if security is not None else self.token, self.liveness_s, self._up)
        self.records = RecordStream(persist, self._send)  # the journal to the shards (ps/sharded/hub_records.py)
        self.pending: dict[int, Pending] = {}
        self.gathers = ParamsGathers(n_shards, self.ranges, core.dtype, self._send)  # (ps/sharded/hub_gathers.py)
        self.next_token = 1
        self.blocks_timed_out = 0
        self.bad_control = 0
        # lmo='l2': a norm over every shard's state, gathered per reply before the core sees it, one
        # reply at a time (no other reply passes meanwhile, so each shard's state is the one the step sees)
        from algorithms.wrappers import needs_step_norms

        self.step_norms = needs_step_norms(core.alg)
        self.reducing: dict | None = None  # {token, jid, item, after, bsq, parts: {shard: figures}}
        self.reductions = 0
        self.table.load_endpoints()

    # The table's slots, and their index by routing id, which every message handler here reads.
    slots = property(lambda self: self.table.slots)
    by_rid = property(lambda self: self.table.by_rid)

    def shards_map(self) -> tuple:
        """What Welcome.shards tells workers (ShardTable.shards_map): () until every shard is ready."""
        return self.table.shards_map()

    # ------------------------------------------------------------------ control messages
    def receive(self, now: float) -> None:
        for _ in range(4096):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                self.bad_control += 1
                continue
            rid = frames[0].bytes
            try:
                m = unpack(frames[1], ("shello", "have", "progress", "params", "reduce", "refuse"))
            except ControlError as e:
                self.bad_control += 1
                if self.bad_control == 1 or self.bad_control % 1000 == 0:  # a flood is not a flood of lines
                    log.warning("bad control message from %r (%d so far): %s", rid[:40], self.bad_control, e)
                continue
            if m["t"] == "shello":
                self._on_hello(rid, m, now)
                continue
            slot = self.by_rid.get(rid)
            if slot is None:
                continue  # a shard of an earlier coordinator process: it says shello again when we stay silent
            slot.last_seen = now
            if not slot.connected:  # silent a while (busy loading?), the same process: it goes on from its progress
                if m["t"] != "progress":
                    continue
                slot.connected, slot.reader, slot.peek = True, None, None
                slot.next = m["applied"] + 1
                log.info("shard %d is back", slot.index)
                r = self.reducing
                if r is not None and slot.index not in r["parts"]:  # asked while it was gone, or the question lost
                    self._send(rid, self._reduce_header(r))
            if m["t"] == "progress":
                self._on_progress(slot, m, now)
            elif m["t"] == "have":
                self._on_haves(slot, m["jobs"], now)
            elif m["t"] == "params":
                self.gathers.on_params(slot, m, frames[2:])
            elif m["t"] == "reduce":
                r = self.reducing
                if r is not None and m["token"] == r["token"] and m["job_id"] == r["jid"]:
                    r["parts"][slot.index] = m["bsq"]
            elif m["t"] == "refuse":
                self._drop(slot, f"shard {slot.index} cannot go on: {m['message']}", now, tell=False)

    def _refuse(self, rid: bytes, why: str, now: float, kind: str = "refused") -> None:
        self.gate.warn(kind, now, "shard refused: %s", why)
        self._send(rid, pack("refuse", message=why[:1000]))

    def _drop(self, slot: Slot, why: str, now: float, *, tell: bool) -> None:
        """Shard ``slot``'s holder disagrees or cannot go on: one error naming it, its connection
        dropped (told ``refuse`` if ``tell``); its slot holds the run until a holder agrees."""
        if not slot.disagrees:
            log.error("%s: its connection is dropped, and jobs are held until a shard that agrees holds slot %d",
                      why, slot.index)
        else:
            self.gate.warn("disagrees", now, "%s (again)", why)
        slot.disagrees = why
        if tell:
            self._send(slot.rid, pack("refuse", message=why[:1000]))
        self.by_rid.pop(slot.rid, None)
        slot.rid, slot.connected = None, False

    def _on_hello(self, rid: bytes, m: dict, now: float) -> None:
        core, journal = self.core, self.persist.journal
        if not self.gate.token_ok(m["token"]):  # first: a peer without the token learns nothing
            return self._refuse(rid, f"{peer_name(rid, m['endpoint'])} gave {'a wrong' if m['token'] else 'no'} "
                                     f"shard token (latecomer shard --token-file: a copy of the coordinator's "
                                     f"<state>/shard.token)", now, "bad_token")
        if m["run_id"] and m["run_id"] != core.cfg.run_id:
            return self._refuse(rid, f"this shard's state is of run {m['run_id']:x}, the coordinator serves run "
                                     f"{core.cfg.run_id:x}", now)
        if m["index"] >= self.n:
            return self._refuse(rid, f"slot {m['index']}: the run has {self.n} shards", now)
        if m["index"] >= 0:
            slot = self.slots[m["index"]]
        else:
            free = [s for s in self.slots if not s.endpoint and not s.connected and not s.joins]
            if not free:
                return self._refuse(rid, f"all {self.n} shard slots are taken", now)
            slot = free[0]
        # Never handed over while its holder lives (heard from, connection up), whatever the newcomer
        # says: not answered (a restarted shard asks again each second, and gets it once the old is gone).
        if self.gate.holder_alive(slot, rid, now):
            return self.gate.warn("slot_live", now, "shard %s asked for slot %d, which a live shard holds: not "
                                  "answered", peer_name(rid, m["endpoint"]), slot.index)
        if m["applied"] > journal.durable_lsn:
            return self._refuse(rid, f"the shard has applied record {m['applied']}, past the end of the coordinator's "
                                     f"journal ({journal.durable_lsn}): records were lost (--fsync never and a machine "
                                     f"crash?); start the shard afresh", now)
        start = m["applied"] + 1
        first = first_journal_lsn(self.state_dir)
        if first is not None and first > start:
            return self._refuse(rid, f"the shard needs records from {start}, and the journal starts at {first}: "
                                     f"start the shard from its newest checkpoint, or afresh before training starts",
                                now)
        if slot.rid is not None:
            self.by_rid.pop(slot.rid, None)
        slot.rid, slot.boot, slot.connected = rid, m["boot"], True
        slot.applied, slot.ckpt, slot.next, slot.last_seen = m["applied"], m["ckpt"], start, now
        slot.reader, slot.peek, slot.joins = None, None, slot.joins + 1
        self.by_rid[rid] = slot
        self.table.set_endpoint(slot, m["endpoint"])
        self._rejoined(slot, now)
        log.info("shard %d joined from %s (%s): records from %d", slot.index, m["endpoint"],
                 "afresh" if m["applied"] < 0 else f"after record {m['applied']}", start)
        lo, hi = self.ranges[slot.index]
        self._send(rid, pack("swelcome", index=slot.index, shards=self.n, run_id=core.cfg.run_id, lo=lo, hi=hi,
                             **{"from": start}))
        # Questions it may not have answered, asked again after the welcome (a shard reads nothing but a
        # welcome until it is welcomed).
        self.gathers.ask_again(slot)
        r = self.reducing
        if r is not None:  # a restarted shard lost the question (or its answer)
            r["parts"].pop(slot.index, None)
            self._send(rid, self._reduce_header(r))

    def _rejoined(self, slot: Slot, now: float) -> None:
        """Shard ``slot`` (re)joined: a block it had not journaled is gone with its old process,
        so the headers still missing its block wait ``block_wait_s`` more at most."""
        for p in self.pending.values():
            if slot.index not in p.haves:
                p.rejoined = now

    def _on_progress(self, slot: Slot, m: dict, now: float) -> None:
        slot.applied, slot.ckpt, slot.version = m["applied"], m["ckpt"], m["version"]
        self.table.set_endpoint(slot, m["endpoint"])
        slot.built = slot.built or slot.applied >= 0
        slot.applied_count, slot.rss, slot.blocks, slot.records_s = (m["applied_count"], m["rss"], m["blocks"],
                                                                     m["records_s"])
        core = self.core
        if slot.applied == self.persist.journal.next_lsn - 1:  # at the journal's end: its figures are ours
            if (slot.version, slot.applied_count) != (core.version, core.counters.applied):
                return self._drop(slot, f"shard {slot.index} disagrees with the coordinator after record "
                                        f"{slot.applied}: version {slot.version} and {slot.applied_count} applied, "
                                        f"the coordinator {core.version} and {core.counters.applied}", now, tell=True)
            if slot.disagrees:
                log.info("shard %d agrees with the coordinator after record %d: its slot no longer holds the run",
                         slot.index, slot.applied)
                slot.disagrees = ""
        self.records.retain(self.slots)

    def _on_haves(self, slot: Slot, haves: list, now: float) -> None:
        ledger = self.core.ledger
        for have in haves:  # (job_id, created_at, code, text) or (..., bsq) (ps/sharded/control.py)
            jid, created_at, code, text = have[:4]
            bsq = have[4] if len(have) > 4 else None
            entry = ledger.get(jid)
            if entry is None or entry.received or entry.created_at != created_at:
                continue
            p = self.pending.get(jid)
            if p is None:
                p = self.pending[jid] = Pending(at=now)
            if code == 0:
                p.haves[slot.index] = None
                if bsq is not None:
                    p.bsq[slot.index] = bsq
            else:
                try:
                    p.haves[slot.index] = (ErrorCode(code), f"shard {slot.index}: {text}")
                except ValueError:
                    p.haves[slot.index] = (ErrorCode.BAD_SHAPE, f"shard {slot.index}: {text}")

    # ------------------------------------------------------------------ sending
    def _send(self, rid: bytes, header: bytes, frames: tuple | list = ()) -> bool:
        try:
            self.sock.send_multipart([rid, header, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def _up(self, rid: bytes) -> bool:
        """Whether ``rid``'s connection is up: an empty ``recs`` (which a shard ignores) sent to it;
        ROUTER_MANDATORY fails it at once if the peer is gone (EHOSTUNREACH), a full pipe is a peer there."""
        try:
            self.sock.send_multipart([rid, pack("recs", first=0, count=0)], flags=zmq.NOBLOCK)
        except zmq.Again:
            return True
        except zmq.ZMQError:
            return False
        return True

    def ship(self, now: float) -> None:
        """Records up to the journal's durable LSN to every shard that has joined (its window allowing)."""
        durable = self.persist.journal.durable_lsn
        for slot in self.slots:
            # Silent for the liveness timeout: gone. One that has not built its core yet (loading the
            # problem blocks its loop) gets ten times as long.
            if slot.connected and now - slot.last_seen > self.liveness_s * (1 if slot.applied >= 0 else 10):
                slot.connected = False
                log.warning("shard %d is gone (silent for %.1f s): jobs are held until it is back", slot.index,
                            now - slot.last_seen)
            if slot.connected:
                self.records.ship_to(slot, now, durable)
        self.records.trim(self.slots)

    # ------------------------------------------------------------------ replies and the hold
    def take_reply(self, item: Any, now: float) -> bool:
        """Hold a worker's reply header until its blocks are at every shard. False: not held (its
        job is not outstanding: the core hands it on as late or unknown at once)."""
        jid = item.msg.job_id
        entry = self.core.ledger.get(jid)
        if entry is None or entry.received or entry.worker_id != item.wid:
            return False
        p = self.pending.get(jid)
        if p is None:
            p = self.pending[jid] = Pending()
        p.item, p.at = item, now
        return True

    def ready_replies(self, now: float) -> list[tuple[Any, Any]]:
        """(reply Inbound, refusal or None) whose blocks every shard has (or refused); headers
        whose blocks are lost are dropped (see the module's docstring), haves of settled jobs
        forgotten. lmo='l2': a reply whose blocks are all in waits for its step's norms (one
        reduction at a time; a new one starts only once the core has taken the last one's reply,
        so that its journal record is among the records the shards apply first)."""
        out, ledger, up = self._reduced(), self.core.ledger, all(s.connected for s in self.slots)
        hold_reductions = bool(out)
        for jid in list(self.pending):
            p = self.pending[jid]
            entry = ledger.get(jid)
            if entry is None or entry.received:
                del self.pending[jid]
                if p.item is not None:
                    out.append((p.item, None))  # the core counts it late
                continue
            if p.item is None:
                continue
            if len(p.haves) == self.n:
                refusal = next((p.haves[i] for i in range(self.n) if p.haves[i] is not None), None)
                item = p.item
                if refusal is None and len(p.bsq) == self.n:  # the norm over every block (clip_norm)
                    item = copy.copy(item)
                    item.msg = dataclasses.replace(item.msg, block_sq=tuple(v for i in range(self.n)
                                                                            for v in p.bsq[i]))
                if refusal is None and self.step_norms:  # its step's norm first: one reply at a time
                    if self.reducing is not None or hold_reductions:
                        continue
                    del self.pending[jid]
                    self._start_reduction(jid, item)
                    continue
                del self.pending[jid]
                out.append((item, refusal))
            elif up and self._lost(p, now):
                del self.pending[jid]
                self.blocks_timed_out += 1
                missing = [i for i in range(self.n) if i not in p.haves]
                why = (f"within {self.block_wait_s:g} s of the shard's restart" if p.rejoined > p.at
                       else f"within {self.block_wait_max_s:g} s")
                log.warning("job %d: the gradient blocks of shard(s) %s did not arrive %s: its reply is dropped, "
                            "and the job written off", jid, ",".join(map(str, missing)), why)
        return out

    def _reduce_header(self, r: dict) -> bytes:
        return pack("reduce?", token=r["token"], job_id=r["jid"], created_at=r["created_at"], after=r["after"],
                    bsq=list(r["item"].msg.block_sq or ()))

    def _start_reduction(self, jid: int, item: Any) -> None:
        """Ask every shard for its figures of the step ``item``'s reply makes once the records
        journaled so far are applied there."""
        token = self.next_token
        self.next_token += 1
        self.reducing = r = {"token": token, "jid": jid, "item": item, "created_at": item.msg.created_at,
                             "after": self.persist.journal.next_lsn - 1, "parts": {}}
        for s in self.slots:
            if s.connected:
                self._send(s.rid, self._reduce_header(r))

    def _reduced(self) -> list[tuple[Any, Any]]:
        """The reply whose step norms every shard has given (with them), or whose job was settled
        meanwhile (the core counts it late); [] while the shards have not all answered."""
        r = self.reducing
        if r is None:
            return []
        entry = self.core.ledger.get(r["jid"])
        item = r["item"]
        if entry is None or entry.received or entry.created_at != r["created_at"]:
            self.reducing = None
            return [(item, None)]
        if len(r["parts"]) < self.n:
            return []
        self.reducing = None
        self.reductions += 1
        figures = tuple(v for i in range(self.n) for v in r["parts"][i])
        item = copy.copy(item)
        item.msg = dataclasses.replace(item.msg, step_sq=figures or None)
        return [(item, None)]

    def _lost(self, p: Pending, now: float) -> bool:
        if p.rejoined > p.at and now - p.rejoined > self.block_wait_s:
            return True
        return now - p.at > self.block_wait_max_s

    def pending_for(self, wid: str) -> list[int]:
        """Jobs of ``wid`` whose reply is held here: still busy, as far as the core's reconciliation goes."""
        held = [j for j, p in self.pending.items() if p.item is not None and p.item.wid == wid]
        r = self.reducing
        return held + [r["jid"]] if r is not None and r["item"].wid == wid else held

    def hold_reason(self) -> str:
        """Why jobs must not be issued now ("": they may)."""
        held = [s.disagrees for s in self.slots if s.disagrees]
        if held:
            return "; ".join(held) + " (held until a shard that agrees holds the slot)"
        missing = [s.index for s in self.slots if not s.connected or s.applied < 0]
        if missing:
            return f"shard(s) {','.join(map(str, missing))} not connected"
        return ""

    # ------------------------------------------------------------------ parameters, stop, figures
    def request_params(self, lsn: int) -> int:
        """Ask every shard for its slice after record ``lsn`` (ps/sharded/hub_gathers.py); the token
        names the iterate among :meth:`take_params`."""
        token = self.next_token
        self.next_token += 1
        self.gathers.request(token, lsn, self.slots)
        return token

    def take_params(self) -> list[tuple[int, int, int, np.ndarray]]:
        """The iterates gathered since the last call: (token, lsn, version, x)."""
        return self.gathers.take()

    def stop(self, reason: str) -> None:
        for s in self.slots:
            if s.connected:
                self._send(s.rid, pack("stop", reason=reason[:1000]))

    def caught_up(self, lsn: int) -> bool:
        return all(s.connected and s.applied >= lsn for s in self.slots)

    def figures(self) -> dict[str, Any]:
        return self.table.figures(self.persist.journal.next_lsn - 1)

    def summary(self) -> list[dict[str, Any]]:
        return self.table.summary(self.persist.journal.next_lsn - 1)

    def close(self) -> None:
        self.records.close()
        self.sock.close(linger=500)
