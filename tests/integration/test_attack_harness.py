"""The attack harness measures what it claims: a harmless attack (well-behaved status polling)
passes every check, and the figures it reports are live."""

from __future__ import annotations

import time

import pytest
import zmq

from protocol.codec import decode, encode
from protocol.messages import StatusRequest
from tests.integration.attack import Victim

pytestmark = [pytest.mark.slow, pytest.mark.attack]


def polite_status_poller(endpoint, running):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(endpoint)
    n = 0
    try:
        while running() and n < 50:
            s.send_multipart(encode(StatusRequest(token=n)))
            assert s.poll(5000), "no status answer"
            decode(s.recv_multipart())
            n += 1
            time.sleep(0.02)  # a polite client's own pace
    finally:
        s.close(0)
        ctx.term()
    return {"answers": n}


def test_a_harmless_client_passes_every_check(procs, tmp_path):
    victim = Victim(procs, tmp_path)
    report = victim.measure(polite_status_poller, seconds=3)
    print(report.summary())
    report.check(rss_bound_mb=30)
    assert report.rate_before > 10 and report.attack["answers"] > 0
    summary = victim.finish()
    assert summary["counters"]["applied"] >= 150
