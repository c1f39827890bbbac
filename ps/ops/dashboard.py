"""The live dashboard: an observer (ps/observe/observer.py) that keeps bounded histories of a run, and a
small HTTP server that shows them as one self-contained page (ps/ops/dashboard_page.py).

The loop's thread feeds :class:`Dashboard` (``on_events``, ``on_evaluation``, ``on_tick``) and,
at most every :data:`PUBLISH_S` seconds, publishes an immutable JSON-able snapshot (a fresh dict
of fresh lists, never touched again); the HTTP thread only reads that reference (STYLE.md §4).

Memory is bounded whatever the run's length:

- every time series (evaluations, step rate, each algorithm figure) keeps at most
  :data:`MAX_POINTS` + 1 points: when full, every other point is dropped and from then on only
  every other new one is kept (the stride doubles), the latest point always shown;
- the job timeline keeps, per worker, the last :data:`MAX_BARS` bars (a bar is a settled job, or
  several consecutive jobs of one outcome, each following the one before within
  :data:`MERGE_GAP_S`, together at most :data:`MERGE_MAX_S` long: a pixel or two of the page's
  :data:`WINDOW_S` seconds), for at most :data:`MAX_LANES` workers (the one idle the longest
  goes), and at most :data:`MAX_OPEN_JOBS` jobs in flight;
- at most :data:`MAX_SERIES` algorithm figures, :data:`MAX_GONE` departed workers;
- the ages histogram has :data:`EXACT_AGES` one-age bars, then one bar per power of two.

``latecomer dashboard DIR`` feeds the same observer from a finished run's records
(:func:`load_recorded`): events.jsonl, summary.json's evaluations, run.json.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import logging
import math
import os
import socket
import threading
from collections import deque
from typing import Any

from ps.observe.observer import Observer

log = logging.getLogger("latecomer.server")

PUBLISH_S = 0.5  # the snapshot the page reads is at most this old
MAX_POINTS = 1000  # points per time series (decimated beyond)
MAX_BARS = 600  # bars kept per worker's lane of the timeline
MAX_LANES = 32  # lanes (workers) of the timeline
MERGE_GAP_S = 0.005  # consecutive jobs closer than this ...
MERGE_MAX_S = 0.1  # ... are one bar, up to this long
WINDOW_S = 60.0  # the timeline shows the last this many seconds
MAX_OPEN_JOBS = 10_000  # jobs in flight tracked (issued, not yet settled)
MAX_SERIES = 32  # algorithm figures kept as series
MAX_GONE = 256  # departed workers remembered in the table
EXACT_AGES = 32  # ages 0..EXACT_AGES-1 get a bar each; then [32, 63], [64, 127], ...
SETTLED = {"applied": "a", "lost": "l", "failed": "f", "dropped": "d", "cancelled": "c", "rejected": "r"}
LOST_REASONS = ("timeout", "unreachable", "quarantined")  # a worker that left this way shows as lost
HTTP_TIMEOUT_S = 5.0  # a request's socket timeout: a slow client cannot hold a thread longer
MAX_CLIENTS = 16  # requests served at once; more are closed at once


def num(v: Any) -> Any:
    """A JSON-safe number: non-finite floats become None (JSON has no NaN)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None


class Series:
    """A bounded time series: at most ``cap`` + 1 points (see the module docstring)."""

    def __init__(self, cap: int = MAX_POINTS) -> None:
        self.cap = cap - cap % 2 or 2
        self.points: list[Any] = []
        self.stride = 1
        self.seen = 0
        self.last: Any = None

    def add(self, point: Any) -> None:
        self.last = point
        self.seen += 1
        if (self.seen - 1) % self.stride:
            return
        self.points.append(point)
        if len(self.points) > self.cap:
            self.points = self.points[::2]
            self.stride *= 2

    def values(self) -> list[Any]:
        out = list(self.points)
        if self.last is not None and (not out or out[-1] is not self.last):
            out.append(self.last)
        return out

    def __len__(self) -> int:
        return len(self.points)


def age_bins(age_counts: dict[Any, int]) -> list[list[int]]:
    """``[lo, hi, count]`` bars of an age histogram: one per age below :data:`EXACT_AGES`, then
    one per power of two; empty bars above the largest age are left out."""
    bins: dict[tuple[int, int], int] = {}
    for a, n in age_counts.items():
        a = int(a)
        if a < EXACT_AGES:
            lo = hi = max(a, 0)
        else:
            lo = 1 << (a.bit_length() - 1)
            hi = 2 * lo - 1
        bins[(lo, hi)] = bins.get((lo, hi), 0) + int(n)
    if not bins:
        return []
    top = max(hi for _, hi in bins)
    out, lo = [], 0
    while lo <= top:
        hi = lo if lo < EXACT_AGES else 2 * lo - 1
        out.append([lo, hi, bins.get((lo, hi), 0)])
        lo = hi + 1
    return out


class Dashboard(Observer):
    """The dashboard's observer: bounded histories of a run, published as :attr:`state`."""

    wants_issued = True

    def __init__(self) -> None:
        self.t0: float | None = None
        self.now = 0.0
        self.settings: dict[str, Any] = {}
        self.evaluations = Series()
        self.rate = Series()  # [t, step, steps/s]
        self.figures: dict[str, Series] = {}  # alg.* -> [t, step, value]
        self.lanes: dict[str, deque[list]] = {}  # worker -> bars [t issued, t settled, outcome code, jobs]
        self.open: dict[Any, tuple[str, float]] = {}  # job id -> (worker, t issued)
        self.gone: dict[str, dict[str, Any]] = {}  # worker -> {"state", "reason", "t"}
        self.last: dict[str, Any] = {}  # the latest tick's snapshot
        self.next_publish = -math.inf
        self.finished = False
        self.state: dict[str, Any] = self.build()
        self.http: DashboardServer | None = None

    # ------------------------------------------------------------------ the loop's side
    def _t(self, now: float) -> float:
        if self.t0 is None:
            self.t0 = now
        self.now = max(self.now, now - self.t0)
        return now - self.t0

    def on_start(self, settings: dict[str, Any]) -> None:
        self.settings = {k: num(v) for k, v in list(settings.items())[:256]}

    def on_events(self, events: list[dict[str, Any]], now: float) -> None:
        if self.t0 is None:  # the clock starts at the first event (a batch comes after its events)
            self.t0 = min([now, *(e["t"] for e in events if isinstance(e.get("t"), (int, float)))])
        self._t(now)
        for e in events:
            kind = e.get("ev")
            t = float(e["t"]) - self.t0 if isinstance(e.get("t"), (int, float)) else self.now
            if kind == "issued":
                if len(self.open) >= MAX_OPEN_JOBS:
                    self.open.pop(next(iter(self.open)))
                self.open[e.get("job_id")] = (str(e.get("worker_id", "")), t)
            elif kind in SETTLED:
                start = self.open.pop(e.get("job_id"), None)
                if start is not None:
                    self._settle(start[0], round(start[1], 4), round(t, 4), SETTLED[kind])
            elif kind == "joined":
                self.gone.pop(str(e.get("worker_id", "")), None)
            elif kind == "left":
                self._left(str(e.get("worker_id", "")), str(e.get("reason", "")), t)

    def _settle(self, wid: str, a: float, b: float, code: str) -> None:
        lane = self.lanes.get(wid)
        if lane is None:
            if len(self.lanes) >= MAX_LANES:
                del self.lanes[min(self.lanes, key=lambda w: self.lanes[w][-1][1] if self.lanes[w] else -math.inf)]
            lane = self.lanes[wid] = deque(maxlen=MAX_BARS)
        last = lane[-1] if lane else None
        if last is not None and last[2] == code and 0 <= a - last[1] <= MERGE_GAP_S and b - last[0] <= MERGE_MAX_S:
            last[1] = max(last[1], b)
            last[3] += 1
        else:
            lane.append([a, b, code, 1])

    def _left(self, wid: str, reason: str, t: float) -> None:
        self.gone.pop(wid, None)
        if len(self.gone) >= MAX_GONE:
            self.gone.pop(next(iter(self.gone)))
        self.gone[wid] = {"state": "lost" if reason in LOST_REASONS else "left", "reason": reason, "t": round(t, 3)}

    def on_evaluation(self, ev: dict[str, float]) -> None:
        self.evaluations.add({k: num(v) for k, v in ev.items()})

    def on_tick(self, snapshot: dict[str, Any], now: float) -> None:
        t = self._t(now)
        self.last = snapshot
        info = snapshot.get("info", {})
        version = info.get("version", 0)
        if "step_rate" in info:
            self.rate.add([round(t, 3), version, num(info["step_rate"])])
        for k, v in info.items():
            if k.startswith("alg.") and (k in self.figures or len(self.figures) < MAX_SERIES):
                self.figures.setdefault(k, Series()).add([round(t, 3), version, num(v)])
        if now >= self.next_publish:
            self.next_publish = now + PUBLISH_S
            self.state = self.build()

    def close(self) -> None:
        self.finished = True
        self.state = self.build()
        if self.http is not None:
            self.http.close()
            self.http = None

    # ------------------------------------------------------------------ the snapshot
    def build(self) -> dict[str, Any]:
        """A fresh JSON-able snapshot of everything the page shows (nothing in it is shared)."""
        snap = self.last or {}
        info = {k: num(v) for k, v in (snap.get("info") or {}).items()}
        evals = self.evaluations.values()
        header = {"algorithm": info.get("algorithm", self.settings.get("algorithm", "")),
                  "problem": info.get("problem", self.settings.get("problem", "")),
                  "step": info.get("version", 0), "rate": info.get("step_rate"), "workers": info.get("workers", 0),
                  "elapsed_s": round(self.now, 3), "loss": evals[-1].get("loss") if evals else None,
                  "finished": self.finished}
        return {"header": header, "info": info, "settings": dict(self.settings), "evaluations": evals,
                "rate": self.rate.values(), "figures": {k: s.values() for k, s in self.figures.items()},
                "ages": age_bins(snap.get("age_counts") or {}), "timeline": self._timeline(),
                "workers": self._workers(snap), "shards": [{k: num(v) for k, v in dict(s).items()}
                                                           for s in snap.get("shards") or ()],
                "bounds": {"points": MAX_POINTS, "bars": MAX_BARS, "lanes": MAX_LANES, "window_s": WINDOW_S,
                           "figures": MAX_SERIES}}

    def _timeline(self) -> dict[str, Any]:
        """The last :data:`WINDOW_S` seconds of every lane (copies: the published state is never
        touched again), and the jobs in flight (at most 64 a worker)."""
        # from where every lane is complete: a full lane (a fast worker's) has lost its oldest bars
        full = [lane[0][0] for lane in self.lanes.values() if len(lane) == MAX_BARS]
        since = max([self.now - WINDOW_S, *full])
        lanes = {w: [list(bar) for bar in lane if bar[0] >= since] for w, lane in self.lanes.items()}
        in_flight: dict[str, list] = {}
        for wid, a in self.open.values():
            if len(in_flight.setdefault(wid, [])) < 64:  # one issued before `since` is drawn from there
                in_flight[wid].append(round(a, 4))
        return {"now": round(self.now, 3), "since": round(since, 4), "window_s": WINDOW_S,
                "lanes": {w: v for w, v in lanes.items() if v},
                "in_flight": in_flight}

    def _workers(self, snap: dict[str, Any]) -> dict[str, Any]:
        columns = list(snap.get("columns") or ())
        rows = sorted(([num(v) for v in r] for r in snap.get("rows") or ()), key=lambda r: str(r[0] if r else ""))
        ids = {r[0] for r in rows if r}
        state_at = columns.index("state") if "state" in columns else None
        for wid, g in self.gone.items():
            if wid not in ids and columns:
                row: list[Any] = [None] * len(columns)
                row[0] = wid
                if state_at is not None:
                    row[state_at] = g["state"]
                if "last_error" in columns:
                    row[columns.index("last_error")] = f"{g['state']} at {g['t']:.1f} s ({g['reason']})"
                rows.append(row)
        return {"columns": columns, "rows": rows, "gone": dict(self.gone)}

    def json_bytes(self) -> bytes:
        return json.dumps(self.state, separators=(",", ":"), allow_nan=False).encode()


# --------------------------------------------------------------------------- HTTP


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET / (the page) and GET /api/state (the JSON); bodies are never read."""

    timeout = HTTP_TIMEOUT_S
    server_version = "latecomer-dashboard"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            from ps.ops.dashboard_page import PAGE

            self._send(200, "text/html; charset=utf-8", PAGE.encode())
        elif path == "/api/state":
            self._send(200, "application/json", self.server.cached_json())
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def do_HEAD(self) -> None:  # noqa: N802
        self._send(200 if self.path.split("?", 1)[0] in ("/", "/api/state") else 404, "text/plain", b"", head=True)

    def _refuse(self) -> None:
        self.close_connection = True
        self._send(405, "text/plain; charset=utf-8", b"read-only\n")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    def _send(self, code: int, ctype: str, body: bytes, head: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; "
                         "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:")
        self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("dashboard: " + format, *args)


class DashboardServer(http.server.ThreadingHTTPServer):
    """The dashboard's HTTP server on a daemon thread: at most :data:`MAX_CLIENTS` requests at
    once (more are closed unanswered), each with a :data:`HTTP_TIMEOUT_S` socket timeout."""

    daemon_threads = True
    request_queue_size = 32

    def __init__(self, dash: Dashboard, addr: str, port: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        super().__init__((addr, port), _Handler)
        self.dash = dash
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.active = 0  # requests being served now (tests read it)
        self._lock = threading.Lock()
        self._cache: tuple[Any, bytes] = (None, b"")
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="latecomer-dashboard", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = self.server_address[0]
        return f"http://[{host}]:{self.port}/" if ":" in host else f"http://{host}:{self.port}/"

    def cached_json(self) -> bytes:
        state, cache = self.dash.state, self._cache
        if cache[0] is not state:
            cache = (state, json.dumps(state, separators=(",", ":"), allow_nan=False).encode())
            self._cache = cache
        return cache[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # every slot taken: closed unanswered
            return
        self._count(1)
        try:
            super().process_request(request, client_address)
        except Exception:
            self._count(-1)
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._count(-1)
            self.slots.release()

    def _count(self, d: int) -> None:
        with self._lock:
            self.active += d

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def check_addr(addr: str) -> bool:
    """Whether ``addr`` is a loopback address (``localhost`` counts). Raises ValueError if it is
    not an IP address or ``localhost``."""
    if addr == "localhost":
        return True
    return ipaddress.ip_address(addr.strip("[]")).is_loopback


def serve_dashboard(dash: Dashboard, port: int, addr: str = "127.0.0.1") -> DashboardServer:
    """Start the HTTP server of ``dash`` on ``addr:port`` (port 0: the OS's choice); log its
    address, and a warning when it is reachable from outside this host. Raises OSError (the
    port is taken, the address is not this host's) or ValueError (not an address)."""
    loopback = check_addr(addr)
    srv = DashboardServer(dash, addr.strip("[]"), port)
    dash.http = srv
    log.info("dashboard on %s", srv.url)
    if not loopback:
        log.warning("the dashboard on %s is reachable from the network: it shows this run (read-only) to anyone "
                    "who can reach it", addr)
    return srv


def attach(daemon: Any, port: int, addr: str = "127.0.0.1") -> Dashboard:
    """``--dashboard-port``: a :class:`Dashboard` observing ``daemon`` and its HTTP server."""
    dash = Dashboard()
    serve_dashboard(dash, port, addr)
    daemon.add_observer(dash)
    return dash


# --------------------------------------------------------------------------- a finished run


def _recorded_settings(run_dir: str) -> dict[str, Any]:
    """The run's problem, algorithm and hyper-parameters from run.json (serve --state) or
    problem.json (an --out directory), as on_start's settings."""
    from ps.journal.statefiles import read_json

    out: dict[str, Any] = {}
    for name in ("problem.json", "run.json"):
        path = os.path.join(run_dir, name)
        try:  # the checked reader (bounded size and depth); a damaged file only loses its labels
            doc = read_json(path, "a run description") if os.path.exists(path) else None
        except ValueError:
            continue
        if isinstance(doc, dict):
            for k in ("problem", "algorithm"):
                if isinstance(doc.get(k), str):
                    out[k] = doc[k]
            for k, v in (doc.get("settings") or {}).items() if isinstance(doc.get("settings"), dict) else ():
                out[f"alg.{k}"] = v
    return out


def _shifted(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of every server session on one clock: each session's own clock (a new
    process's monotonic clock) is shifted to start where the one before ended."""
    from ps.ops.report import split_sessions

    out, end = [], None
    for evs in split_sessions(events):
        ts = [float(e["t"]) for e in evs if "t" in e]
        shift = 0.0 if end is None or not ts else end - min(ts)
        for e in evs:
            out.append({**e, "t": float(e["t"]) + shift} if "t" in e else e)
        if ts:
            end = max(ts) + shift
    return out


class _Replay:
    """Feeds a :class:`Dashboard` a recorded event log as the daemon would have: batches of
    events and a tick per :data:`PUBLISH_S` seconds of the log's time, with the figures a tick
    carries rebuilt from the events (step, step rate over 10 s, ages, the algorithm's figures)."""

    def __init__(self, dash: Dashboard, settings: dict[str, Any]) -> None:
        self.dash, self.settings = dash, settings
        self.batch: list[dict[str, Any]] = []
        self.next_t: float | None = None
        self.t = 0.0
        self.version = 0
        self.versions: deque[tuple[float, int]] = deque(maxlen=256)
        self.ages: dict[int, int] = {}
        self.metrics: dict[str, float] = {}
        self.counters = {k: 0 for k in ("issued", *SETTLED)}
        self.workers: set[str] = set()

    def event(self, e: dict[str, Any]) -> None:
        t = e.get("t")
        if isinstance(t, (int, float)):
            if self.next_t is None:
                self.next_t = t
            if t >= self.next_t:
                self.flush(max(self.t, t))
                self.next_t = t + PUBLISH_S
            self.t = max(self.t, float(t))
        self.batch.append(e)
        kind = e.get("ev")
        if kind in self.counters:
            self.counters[kind] += 1
        if kind == "applied":
            self.version = max(self.version, int(e.get("version", self.version + 1)))
            self.ages[e["age"]] = self.ages.get(e["age"], 0) + 1
            if not self.versions or self.t - self.versions[-1][0] >= 0.1:
                self.versions.append((self.t, self.version))
        elif kind == "resumed" and isinstance(e.get("version"), int):
            self.version = e["version"]
        elif kind == "metrics":
            self.metrics = {k: v for k, v in e.items() if k not in ("ev", "version", "t")}
        elif kind == "joined":
            self.workers.add(str(e.get("worker_id")))
        elif kind == "left":
            self.workers.discard(str(e.get("worker_id")))

    def info(self) -> dict[str, Any]:
        recent = [(t, v) for t, v in self.versions if self.t - t <= 10.0]
        rate = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]) \
            if len(recent) >= 2 and recent[-1][0] > recent[0][0] else 0.0
        info = {"version": self.version, "step_rate": rate, "workers": len(self.workers),
                "algorithm": self.settings.get("algorithm", ""), "problem": self.settings.get("problem", ""),
                **{f"counter.{k}": v for k, v in self.counters.items()}}
        info.update({f"alg.{k}": v for k, v in self.metrics.items() if isinstance(v, (int, float))})
        return info

    def flush(self, t: float, **extra: Any) -> None:
        if self.batch:
            self.dash.on_events(self.batch, t)
            self.batch = []
        self.dash.on_tick({"info": self.info(), "age_counts": dict(self.ages), **extra}, t)


RECORDED_COLUMNS = ("worker", "device", "joins", "issued", "applied", "lost", "failed", "mean_job_s", "busy",
                    "state", "last_error")


def _recorded_rows(events: list[dict[str, Any]], gone: dict[str, dict[str, Any]]) -> list[tuple]:
    from ps.ops.report import worker_table

    rows = []
    for wid, r in list(worker_table(events).items())[:256]:
        times = r["job_times"]
        g = gone.get(wid)
        rows.append((wid, r["device"], r["joins"], r["issued"], r["applied"], r["lost"], r["failed"],
                     sum(times) / len(times) if times else 0.0, r["busy_s"] / r["span_s"] if r["span_s"] else 0.0,
                     g["state"] if g else "joined", r["last_error"][:200]))
    return rows


def load_recorded(run_dir: str) -> Dashboard:
    """A :class:`Dashboard` holding a finished run's records: ``run_dir`` is a ``serve --state``
    directory or an ``--out`` directory (events.jsonl, summary.json's evaluations, run.json or
    problem.json); the sessions of a restarted run follow each other on one clock.

    Raises:
        ValueError: ``run_dir`` holds neither events.jsonl nor summary.json.
    """
    from ps.ops.report import _read_summary, read_events

    events_path = os.path.join(run_dir, "events.jsonl")
    summary = _read_summary(run_dir)
    if not os.path.exists(events_path) and summary is None:
        raise ValueError(f"{run_dir} holds neither events.jsonl nor summary.json: give a `serve --state` "
                         "directory or an --out directory")
    events = _shifted(read_events(events_path))
    settings = _recorded_settings(run_dir)
    dash = Dashboard()
    dash.on_start(settings)
    feed = _Replay(dash, settings)
    for e in events:
        feed.event(e)
    for ev in (summary or {}).get("evaluations") or ():
        dash.on_evaluation(ev)
    if summary is not None:
        feed.version = max(feed.version, int(summary.get("version", 0)))
    feed.flush(feed.t)  # the last events first: the table reads who left
    feed.flush(feed.t, columns=RECORDED_COLUMNS, rows=_recorded_rows(events, dash.gone),
               shards=(summary or {}).get("shards") or ())
    dash.now = max(dash.now, float((summary or {}).get("elapsed_s", 0.0)) if dash.t0 is None else dash.now)
    dash.close()
    return dash


def serve_recorded(run_dir: str, port: int, addr: str, echo: Any) -> None:
    """``latecomer dashboard DIR``: serve a finished run's page until SIGINT or SIGTERM."""
    import signal

    dash = load_recorded(run_dir)
    srv = serve_dashboard(dash, port, addr)
    echo(f"dashboard of {run_dir} on {srv.url} (Ctrl-C to stop)")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
