"""What the daemon's run tells the outside: its events, status answers, metrics and summary.

Owns the core's events as they leave the loop (a log line per lifecycle event or failure, the
ages of applied replies, the step-rate samples, the observers' batches, the JSON-lines event
log), the figures of a status answer and of the metrics endpoint, the run's summary, and
:func:`write_outputs` (summary.json, final_x.npy, problem.json). It reads the daemon
(ps/drivers/daemon.py) and its core; it gives the core no input.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from collections import deque
from typing import Any

import numpy as np

from protocol.codec import encode, error_text
from protocol.errors import LocalProtocolError
from protocol.messages import Status
from ps.journal.events import EventLog

WORKER_COLUMNS = ("worker", "device", "jobs_done", "mean_job_s", "last_seen_s_ago", "holding", "oldest_age",
                  "state", "failed", "last_error")
EVENTS_FLUSH_S = 0.05  # the event log is written at most this often (and at the end)
STATUS_ERROR_CHARS = 200  # a worker's last error as status rows carry it
LIFECYCLE = {"joined", "ready", "left", "lost", "quarantined", "late", "rejected"}
# Worker failures: one warning line each (the event's fields ride along as with LIFECYCLE). A
# failed job is logged for the first failure of each worker only; the rest are in the event
# log, `latecomer status` and the counters.
FAILURE_LINES = {
    "problem_unavailable": "worker {worker_id} cannot load problem {problem}: {message}",
    "failed": "worker {worker_id}: job {job_id} failed: {message}",
    "benched": "worker {worker_id} benched: {in_a_row} jobs in a row failed (last: {message}); it gets no jobs "
               "until it says hello again",
    "unbenched": "worker {worker_id} gets jobs again ({reason})",
}
# Lifecycle events whose bare "KIND WORKER" line would not say what happened.
LIFECYCLE_LINES = {
    "late": "late {worker_id}: its reply to job {job_id} came after the job was settled ({was}): ignored, "
            "nothing lost (a slow or frozen worker whose job was written off or cancelled, or a repeat)",
}


class RunOutputs:
    """The daemon's outputs (see the module's docstring).

    Args:
        daemon: the daemon whose core, connections, transport and evaluations are reported.
        events_path: append every core event as a JSON line here (None: don't).
    """

    def __init__(self, daemon: Any, events_path: str | None) -> None:
        self.daemon = daemon
        self.recent_ages: deque[int] = deque(maxlen=4096)  # ages of the latest applied replies
        self.age_counts: dict[int, int] = {}  # age -> applied replies (all run long), for histograms
        self.versions: deque[tuple[float, int]] = deque(maxlen=256)  # (time, version) for the step rate
        self.lifecycle = logging.getLogger("latecomer.events")
        self.metrics = None  # a SnapshotCollector when --metrics-port is given
        self.next_publish = 0.0
        self.events_file = EventLog(events_path) if events_path else None  # a full disk drops events, no crash
        self.events_dirty = False
        self.events_flushed_at = 0.0  # time.monotonic() of the event log's last flush

    # ------------------------------------------------------------------ events
    def flush_events(self) -> None:
        """The core's events since the last call: log lines, ages, step-rate samples, observers,
        the event log (written here, flushed once per pass of the loop: :meth:`flush_event_log`)."""
        d = self.daemon
        core = d.core
        events = core.drain_events()
        for ev in events:
            kind = ev["ev"]
            if kind == "applied":
                self.recent_ages.append(ev["age"])
                self.age_counts[ev["age"]] = self.age_counts.get(ev["age"], 0) + 1
            elif kind in LIFECYCLE:  # one log line per lifecycle event (JSON with --log-format json)
                if kind == "left" and ev.get("worker_id") not in core.workers:
                    d.conns.release(ev.get("worker_id", ""), d.clock())  # idle from now: it expires
                text = LIFECYCLE_LINES.get(kind)
                if text is not None:
                    self.lifecycle.info(text.format_map(collections.defaultdict(str, ev)), extra={"event": ev})
                else:
                    self.lifecycle.info("%s %s", kind, ev.get("worker_id", ""), extra={"event": ev})
                if kind == "ready" and not core.started:
                    self.log_waiting(core)
            elif kind in FAILURE_LINES and (kind != "failed" or ev.get("worker_failed") == 1):
                self.lifecycle.warning(FAILURE_LINES[kind].format_map(ev), extra={"event": ev})
        if events:
            now = d.clock()
            if not self.versions or now - self.versions[-1][0] >= 0.1:
                self.versions.append((now, core.version))
        if d.observers and events:
            d.observers.call("on_events", events, d.clock())
        if self.events_file and events:
            self.events_file.write_events(list(events))  # observers get the list: theirs to change
            self.events_dirty = True  # flushed by the loop (flush_event_log)

    def log_waiting(self, core: Any) -> None:
        """A worker is ready before the first job: say how many more ``--min-workers`` waits for."""
        more = core.cfg.min_workers - len(core._eligible)
        if more > 0:
            self.lifecycle.info("waiting for %d more worker%s before the first job (--min-workers %d)",
                                more, "s" if more > 1 else "", core.cfg.min_workers,
                                extra={"event": {"ev": "waiting", "more": more, "min_workers": core.cfg.min_workers}})

    def flush_event_log(self) -> None:
        """After a pass of the loop (a batch of messages), at most every EVENTS_FLUSH_S: in lockstep a
        pass is one update, and a write (and its fstat) per update was 4 % of the daemon's time at
        d = 1,000. The loop waits at most that long while events wait (Daemon._timeout_ms)."""
        if self.events_dirty:
            t = time.monotonic()
            if t - self.events_flushed_at >= EVENTS_FLUSH_S or len(self.events_file.pending) >= 1024:
                self.events_file.flush()
                self.events_dirty = False
                self.events_flushed_at = t

    # ------------------------------------------------------------------ figures
    def settings(self) -> dict[str, Any]:
        """The run's settings as flat scalars (what a logger records as hyper-parameters)."""
        d = self.daemon
        cfg, alg = d.core.cfg, d.core.alg
        out: dict[str, Any] = {"problem": cfg.problem, "algorithm": alg.name, "batch_size": cfg.batch_size,
                               "seed": cfg.seed, "run_id": cfg.run_id, "min_workers": cfg.min_workers,
                               "eval_every": d.eval_every, "liveness_timeout_s": cfg.liveness_timeout_s}
        out.update({f"problem.{k}": v for k, v in cfg.problem_options.items()})
        if dataclasses.is_dataclass(alg):
            for f in dataclasses.fields(alg):
                v = getattr(alg, f.name, None)
                if isinstance(v, (bool, int, float, str)) and not f.name.startswith("_"):
                    out[f"alg.{f.name}"] = v
        return out

    def status_info(self) -> dict[str, Any]:
        """Flat figures for a status request (what `latecomer status` shows)."""
        d = self.daemon
        core = d.core
        now = d.clock()
        info: dict[str, Any] = {f"counter.{k}": v for k, v in core.counters.as_dict().items()
                                if k not in ("updates", "missing_iterates")}
        info.update({"version": core.version, "workers": len(core.workers), "outstanding": core.outstanding,
                     "workers_benched": sum(w.benched for w in core.workers.values()),
                     "uptime_s": now - d.started_at, "step_rate": self.step_rate(now),
                     "algorithm": core.alg.name, "problem": core.cfg.problem, "wire_dtype": d.wire_dtype,
                     "shm_workers": sum(c.shm_ready and c.live for c in d.conns.bound())})
        info.update({f"loop.{k}": v for k, v in self.busy_poll().items()})
        info.update(d.conns.figures())  # the connection table: records, transfers, rates (ps/net/connections.py)
        if d.persist is not None:
            info.update(d.persist.status())  # journal bytes; paused (disk full): why, for how long
        if self.recent_ages:
            ages = np.array(self.recent_ages)
            info.update({"age.mean": float(ages.mean()), "age.p50": float(np.median(ages)),
                         "age.p90": float(np.percentile(ages, 90)), "age.max": int(ages.max())})
        ages = core.outstanding_ages()  # indexed: a status answer does not scan the ledger
        if ages is not None:
            info.update({"outstanding.max_age": ages[0], "outstanding.mean_age": ages[1]})
        if d.evaluations:
            info.update({f"eval.{k}": float(v) for k, v in d.evaluations[-1].items()})
        info.update({f"alg.{k}": float(v) for k, v in core.last_metrics.items()})
        if d.hub is not None:  # first: the cap below must not cut them off
            info = {"held": core.held, **d.hub.figures(), **info}
        return dict(list(info.items())[:64])  # the map cap of the protocol

    def enable_metrics(self, port: int, addr: str = "127.0.0.1") -> None:
        from ps.observe.metrics import serve_metrics

        self.metrics = serve_metrics(port, addr)
        self.publish_metrics()

    def publish_metrics(self) -> None:
        """Hand the HTTP thread an immutable snapshot of the figures."""
        d = self.daemon
        core = d.core
        figures = {}
        if d.evaluations:
            last = d.evaluations[-1]
            figures.update({f"eval_{k}": float(v) for k, v in last.items() if k not in ("t", "version")})
        figures.update({f"alg_{k}": float(v) for k, v in core.last_metrics.items()})
        self.metrics.publish({"counters": core.counters.as_dict(), "version": core.version,
                              "workers": len(core.workers), "outstanding": core.outstanding,
                              "benched": sum(w.benched for w in core.workers.values()),
                              "step_rate": self.step_rate(d.clock()), "age_counts": dict(self.age_counts),
                              "figures": figures,
                              "paused": int(d.persist is not None and d.persist.paused is not None),
                              "shards": d.hub.summary() if d.hub is not None else ()})

    def publish_due(self, now: float) -> None:
        """The metrics endpoint's figures, at most every 0.5 s."""
        if self.metrics is not None and now >= self.next_publish:
            self.publish_metrics()
            self.next_publish = now + 0.5

    def step_rate(self, now: float) -> float:
        """Updates per second over the last ~10 s."""
        old = [(t, v) for t, v in self.versions if now - t <= 10.0]
        if len(old) < 2 or old[-1][0] <= old[0][0]:
            return 0.0
        return (old[-1][1] - old[0][1]) / (old[-1][0] - old[0][0])

    def worker_rows(self, error_chars: int = STATUS_ERROR_CHARS) -> tuple[tuple[str, ...], tuple[tuple, ...]]:
        """One row per worker for status: id, device, jobs done, mean job time, last seen, jobs held,
        the oldest held job's age, its state (``loading``: no ready yet; ``ok``; ``failing``: its
        latest job failed; ``benched``), its failed jobs and its last error (cut to ``error_chars``)."""
        core = self.daemon.core
        now, v = self.daemon.clock(), core.version
        rows = []
        for w in list(core.workers.values())[:256]:
            ages = [v - core.ledger[j].created_at for j in w.outstanding if j in core.ledger]
            state = "benched" if w.benched else "loading" if not w.ready else "failing" if w.failed_in_a_row else "ok"
            rows.append((w.worker_id, w.device, w.jobs_done, w.compute_s / w.jobs_done if w.jobs_done else 0.0,
                         max(0.0, now - w.last_seen), len(w.outstanding), max(ages) if ages else 0, state, w.failed,
                         error_text(w.last_error, error_chars) if w.last_error and error_chars else ""))
        return WORKER_COLUMNS, tuple(rows)

    def status_frames(self, token: int) -> list:
        """The encoded answer to a status request. Should 256 rows with long ids and errors not fit
        the protocol's header cap, the error texts are cut shorter, then left out."""
        info = self.status_info()
        for chars in (STATUS_ERROR_CHARS, 40, 0):
            columns, rows = self.worker_rows(chars)
            try:
                return encode(Status(token=token, info=info, columns=columns, rows=rows))
            except LocalProtocolError:
                continue
        return encode(Status(token=token, info=info, columns=columns, rows=rows[:64]))

    def busy_poll(self) -> dict[str, Any]:
        """``serve --busy-poll-us``'s figures (ps/net/loopwait.py): its setting, whether it polls
        now, the busy polls, those that caught a message, the window now; under ``auto`` the CPUs
        and the run's processes on this host it decided on; {} when it is 0."""
        d, wait = self.daemon, self.daemon.loop_wait
        if not d.busy_poll.bound_us or wait is None:
            return {}
        return {"busy_poll": str(d.busy_poll), "busy_poll_on": bool(wait.spin_max),
                **({"busy_poll_cpus": d.busy_cpus, "busy_poll_local_processes": d.busy_local}
                   if d.busy_poll.auto else {}),
                "busy_polls": wait.spins, "busy_poll_hits": wait.spin_hits,
                "busy_poll_window_us": round(wait.spin * 1e6, 1)}

    def summary(self) -> dict[str, Any]:
        """Counters, evaluations and age statistics of the run (JSON-able)."""
        d = self.daemon
        core = d.core
        c = core.counters.as_dict()
        end = getattr(d, "stopped_at", None) or d.clock()
        return {"endpoint": d.endpoint, "version": core.version, "stopped": d.stopping,
                "elapsed_s": end - d.started_at, "counters": c, "outstanding": core.outstanding,
                "accounted": core.accounted(), "evaluations": d.evaluations,
                "invalid_messages": d.transport.invalid_messages, "send_failures": d.transport.send_failures,
                "connections": {k[len("conn."):]: v for k, v in d.conns.figures().items()},
                "store_peak": core.store_peak,
                "transport": d.transport.figures(),
                **({"loop": loop} if (loop := self.busy_poll()) else {}),
                **({"shards": d.hub.summary(), "blocks_timed_out": d.hub.blocks_timed_out}
                   if d.hub is not None else {})}

    def close(self) -> None:
        if self.events_file:
            self.events_file.close()
            self.events_file = None
        if self.metrics is not None:
            self.metrics.close()


def write_outputs(out_dir: str, daemon: Any) -> None:
    """Write summary.json, final_x.npy and problem.json (the problem's spec and options, which
    ``latecomer export`` rebuilds it from) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "problem.json"), "w", encoding="utf-8") as f:
        json.dump({"problem": daemon.core.cfg.problem, "problem_options": dict(daemon.core.cfg.problem_options)}, f,
                  indent=1)
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(daemon.summary(), f, indent=1)
    params = getattr(daemon, "params", None)  # a sharded server's are gathered from its shards
    np.save(os.path.join(out_dir, "final_x.npy"), np.asarray(params() if params else daemon.core.params()))
