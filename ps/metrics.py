"""Prometheus endpoint and JSON log lines for the daemon.

The daemon's loop owns all state; every ~0.5 s it publishes an immutable snapshot (a plain dict)
that the HTTP thread of ``prometheus_client`` reads at scrape time (STYLE.md §4: other threads
get immutable snapshots, never the live tables).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

AGE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
OUTCOMES = ("applied", "dropped", "lost", "failed", "cancelled", "rejected")
MESSAGES = ("late", "unknown", "invalid", "stray", "refused", "worker_errors")


class SnapshotCollector:
    """Renders the latest published snapshot as Prometheus metric families."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def publish(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot  # one reference swap: atomic for the reading thread

    def collect(self):
        s = self.snapshot
        if not s:
            return
        c = s["counters"]
        jobs = CounterMetricFamily("latecomer_jobs", "Jobs settled, by outcome", labels=["outcome"])
        for o in OUTCOMES:
            jobs.add_metric([o], c[o])
        yield jobs
        yield CounterMetricFamily("latecomer_jobs_issued", "Jobs issued", value=c["issued"])
        msgs = CounterMetricFamily("latecomer_bad_messages", "Messages refused or ignored, by kind", labels=["kind"])
        for k in MESSAGES:
            msgs.add_metric([k], c[k])
        yield msgs
        yield CounterMetricFamily("latecomer_workers_joined", "Worker joins", value=c["workers_joined"])
        yield CounterMetricFamily("latecomer_workers_lost", "Workers declared dead", value=c["workers_lost"])
        yield CounterMetricFamily("latecomer_quarantined", "Workers quarantined", value=c["quarantined"])
        yield CounterMetricFamily("latecomer_benched", "Workers benched (their jobs kept failing)", value=c["benched"])
        yield GaugeMetricFamily("latecomer_version", "Server step (model updates applied)", value=s["version"])
        yield GaugeMetricFamily("latecomer_workers_alive", "Workers in the table", value=s["workers"])
        yield GaugeMetricFamily("latecomer_workers_benched", "Workers benched now (given no jobs)",
                                value=s.get("benched", 0))
        yield GaugeMetricFamily("latecomer_jobs_outstanding", "Jobs issued and not settled", value=s["outstanding"])
        yield GaugeMetricFamily("latecomer_step_rate", "Updates per second (last 10 s)", value=s["step_rate"])
        for name, value in sorted(s.get("figures", {}).items()):
            yield GaugeMetricFamily(f"latecomer_{name}", f"Latest {name}", value=value)
        counts = s["age_counts"]
        buckets = [(str(b), sum(n for a, n in counts.items() if a <= b)) for b in AGE_BUCKETS]
        buckets.append(("+Inf", sum(counts.values())))
        yield HistogramMetricFamily("latecomer_staleness", "Age (steps) of applied replies", buckets=buckets,
                                    sum_value=float(sum(a * n for a, n in counts.items())))


def serve_metrics(port: int, addr: str = "127.0.0.1") -> SnapshotCollector:
    """Start the HTTP endpoint; returns the collector to publish snapshots to."""
    registry = CollectorRegistry()
    collector = SnapshotCollector()
    registry.register(collector)
    start_http_server(port, addr=addr, registry=registry)
    return collector


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the event's fields if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": record.created, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            out.update({k: v for k, v in event.items() if k not in out})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)
