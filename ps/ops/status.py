"""``latecomer status``: ask a running server for its figures and render them as a table."""

from __future__ import annotations

import secrets

import zmq

from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.messages import Status, StatusRequest
from ps.net.endpoints import needs_ipv6
from worker.keys import client_keys


def fetch_status(server: str, *, timeout_s: float = 5.0, key_secret: str | None = None,
                 server_key: str | None = None) -> Status:
    """One status round trip over the server's own protocol (CurveZMQ when keys are given)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if key_secret and server_key:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = client_keys(key_secret, server_key)
        sock.ipv6 = needs_ipv6(server)
        sock.connect(server)
        token = secrets.randbits(63)
        sock.send_multipart(encode(StatusRequest(token=token)))
        deadline_ms = int(timeout_s * 1000)
        while sock.poll(deadline_ms):
            try:
                msg = decode(sock.recv_multipart())
            except RemoteProtocolError:
                continue
            if isinstance(msg, Status) and msg.token == token:
                return msg
        raise TimeoutError(f"no answer from {server} within {timeout_s:g} s")
    finally:
        sock.close(linger=0)
        ctx.term()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_status(st: Status) -> str:
    """The figures as a person reads them: a few summary lines, one table row per worker, and
    one line per worker with an error (its state, failed jobs and last error text)."""
    i = st.info
    c = {k[len("counter."):]: v for k, v in i.items() if k.startswith("counter.")}
    lines = [f"latecomer server: {i.get('algorithm')} on {i.get('problem')}, step {i.get('version')}, "
             f"{i.get('step_rate', 0):.1f} steps/s, up {i.get('uptime_s', 0):.0f} s",
             f"jobs: issued {c.get('issued')}, applied {c.get('applied')}, dropped {c.get('dropped')}, "
             f"lost {c.get('lost')}, failed {c.get('failed', 0)}, cancelled {c.get('cancelled')}, "
             f"rejected {c.get('rejected')}, late {c.get('late')}, outstanding {i.get('outstanding')}"
             + (f" (oldest age {i['outstanding.max_age']})" if "outstanding.max_age" in i else "")]
    if "paused" in i:  # the server cannot write its state directory (disk full): it accepts nothing
        lines.append(f"PAUSED for {i.get('paused_s', 0):.0f} s, no jobs issued: {i['paused']}")
    shards = sorted((k, v) for k, v in i.items() if k.startswith("shard."))
    if shards:  # a sharded server: a line per shard (ps/sharded/hub.py ShardHub.figures)
        held = f"; HOLDING the issuing of jobs: {i['held']}" if i.get("held") else ""
        lines.append(f"shards: {len(shards)}{held}")
        lines += [f"  {k}: {v}" for k, v in shards]
    if "age.p50" in i:
        lines.append(f"ages of applied replies: mean {i['age.mean']:.2f}, median {i['age.p50']:.0f}, "
                     f"p90 {i['age.p90']:.0f}, max {i['age.max']}")
    evals = {k[5:]: v for k, v in i.items() if k.startswith("eval.") and k not in ("eval.t", "eval.version")}
    if evals:
        lines.append("evaluation: " + ", ".join(f"{k} {_fmt(v)}" for k, v in evals.items()))
    alg = {k[4:]: v for k, v in i.items() if k.startswith("alg.")}
    if alg:
        lines.append("algorithm: " + ", ".join(f"{k} {_fmt(v)}" for k, v in alg.items()))
    if st.rows:
        shown = [j for j, col in enumerate(st.columns) if col != "last_error"]  # errors get lines of their own
        widths = {j: max(len(st.columns[j]), *(len(_fmt(r[j])) for r in st.rows)) for j in shown}
        lines.append("")
        lines.append("  ".join(st.columns[j].ljust(widths[j]) for j in shown).rstrip())
        for r in st.rows:
            lines.append("  ".join(_fmt(r[j]).ljust(widths[j]) for j in shown).rstrip())
        col = {name: j for j, name in enumerate(st.columns)}
        errors = [r for r in st.rows if "last_error" in col and r[col["last_error"]]]
        if errors:
            lines.append("")
            lines.append("worker errors:")
            for r in errors:
                lines.append(f"  {r[col['worker']]} ({r[col['state']]}, {r[col['failed']]} failed jobs): "
                             f"{r[col['last_error']]}")
    else:
        lines.append("no workers")
    return "\n".join(lines)
