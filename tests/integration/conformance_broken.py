"""The reference worker broken on purpose, one way per conformance case (tests/integration/test_conformance.py).

    python tests/integration/conformance_broken.py BREAK work --server ENDPOINT

monkeypatches the worker for BREAK, then runs ``latecomer`` with the remaining arguments. No
fault hook lives in production code: each break replaces a function or a name of worker/.
"""

from __future__ import annotations

import os
import sys
import types


def _compute(kind_name: str, change) -> None:
    import worker.runner as runner
    from protocol.messages import JobKind

    real = runner.compute_grads

    def broken(job, points, problem, *args):
        grads, loss, count = real(job, points, problem, *args)
        if job.kind == JobKind[kind_name]:
            return change(grads, loss, count)
        return grads, loss, count
    runner.compute_grads = broken


def _hello(**changes) -> None:
    import worker.link as link
    from protocol.messages import Hello

    changes = {k: v for k, v in changes.items() if k in Hello.__slots__}
    link.Hello = lambda **kw: Hello(**{**kw, **changes})


def _handshake() -> None:
    _hello(seen=7)  # a first hello must say seen -1 (§6.1)


def _cache() -> None:
    from worker.runner import IterateCache

    real = IterateCache.put
    IterateCache.put = lambda self, iid, x: real(self, iid + 1, x)  # cached under the wrong id


def _cancel() -> None:
    import worker.session as session
    session.Cancel = type("NotCancel", (), {})  # a cancel is never recognised: the job stays in busy


def _unknown_worker() -> None:
    import worker.session as session
    from protocol.messages import ErrorCode
    session.ErrorCode = types.SimpleNamespace(UNKNOWN_WORKER=-1, UNSUPPORTED_VERSION=ErrorCode.UNSUPPORTED_VERSION,
                                              REFUSED=ErrorCode.REFUSED)


def _new_boot() -> None:
    import worker.session as session
    session.Heartbeat = type("NotHeartbeat", (), {})  # a server's hb is never looked at


def _bad_input() -> None:
    import worker.session as session
    from protocol.errors import RemoteProtocolError
    real = session.decode

    def fragile(frames, **kw):
        try:
            return real(frames, **kw)
        except RemoteProtocolError:
            os._exit(5)  # a worker that dies on garbage
    session.decode = fragile


def _restart() -> None:
    from worker.link import Worker
    real = Worker._busy
    Worker._busy = lambda self, recent=False: real(self)  # forgets the replies it just sent


def _restart_fresh() -> None:
    from worker.session import ServerSession
    real = ServerSession._settle_run

    def keeps_seen(self, w):
        seen = self.seen
        real(self, w)
        self.seen = seen  # a new run_id does not reset seen
    ServerSession._settle_run = keeps_seen


def _parts() -> None:
    import worker.link as link
    from protocol.chunks import Chunking
    link.chunking = lambda encrypted: Chunking(1 << 62, 1 << 22)  # says parts in its hello, never sends any


def _bye() -> None:
    import worker.session as session
    session.Bye = type("NotBye", (), {})


def _shard_fetch() -> None:
    import worker.link as link
    link.header_only = lambda r: r  # the coordinator gets the whole gradients


def _shard_unknown_job() -> None:
    from worker.shards import ShardLinks
    real = ShardLinks.receive
    ShardLinks.receive = lambda self, i: [(w, x) for w, x in real(self, i) if w != "gone"]


def _shard_refetch() -> None:
    from worker.shards import ShardLinks
    ShardLinks.refetch = lambda self, now: None


BREAKS = {
    "handshake": _handshake,
    "job-grad": lambda: _compute("GRAD", lambda g, loss, n: ((g[0] * 1.5,), loss, n)),
    "job-pair": lambda: _compute("GRAD_PAIR", lambda g, loss, n: ((g[1], g[0]), loss, n)),
    "job-full": lambda: _compute("FULL_GRAD", lambda g, loss, n: ((g[0] / max(n, 1),), loss, n)),  # mean, not sum
    "iterate-cache": _cache,
    "cancel": _cancel,
    "unknown-worker": _unknown_worker,
    "new-boot": _new_boot,
    "bad-input": _bad_input,
    "restart-grad": _restart,
    "restart-pair": _restart,
    "restart-full": _restart,
    "restart-fresh": _restart_fresh,
    "parts": _parts,
    "bye": _bye,
    "shard-handshake": lambda: _hello(shards=False),
    "shard-fetch": _shard_fetch,
    "shard-unknown-job": _shard_unknown_job,
    "shard-refetch": _shard_refetch,
    "shard-restart-grad": _restart,
    "shard-restart-pair": _restart,
}

if __name__ == "__main__":
    BREAKS[sys.argv[1]]()
    from ps.cli.main import main
    main(sys.argv[2:], prog_name="latecomer")
