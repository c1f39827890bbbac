"""The core's configuration: :class:`CoreConfig` (driver-independent settings), the per-worker
credit cap and the restart grace a resumed server gives its restored workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import HEARTBEAT_INTERVAL_S, HELLO_BACKOFF_MAX_S, LIVENESS_TIMEOUT_S, RECONNECT_IVL_MAX_S

MAX_CREDIT = 64  # jobs one worker may hold at once, whatever credit it asks for (`latecomer work --credit` <= 64)


def restart_grace_s(liveness_timeout_s: float) -> float:
    """How long a resumed server waits for a restored worker to say hello again.

    A worker that heard nothing from the crashed server reconnects; from the moment the new
    server listens, libzmq's next connection attempt may be up to ``RECONNECT_IVL_MAX_S`` away
    and, once connected, the worker's next hello up to ``HELLO_BACKOFF_MAX_S`` (both caps of the
    reference worker's backoff, protocol/messages.py, PROTOCOL.md 8.10). The grace is those two
    plus a liveness timeout (the margin any worker gets): 5 + 4 + 3 = 12 s at the defaults."""
    return liveness_timeout_s + RECONNECT_IVL_MAX_S + HELLO_BACKOFF_MAX_S


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Driver-independent settings of the core.

    Attributes:
        problem: problem spec announced to workers in Welcome.
        problem_options: its options (msgpack-able scalars).
        batch_size: default minibatch per job (an algorithm's JobSpec may override it).
        heartbeat_interval_s: announced to workers; the daemon sends at this period too.
        liveness_timeout_s: a worker silent for longer is declared dead.
        min_workers: issue no job until this many workers are ready (then never wait again).
        max_bad_replies: quarantine a worker after this many invalid replies in a row (0: never).
        max_failed_jobs: bench a worker (no more jobs) after this many failed jobs in a row
            with no accepted reply between (0: never).
        quarantine_s: how long a quarantined worker id is refused.
        max_workers: refuse new workers beyond this many (bounds the worker table; the daemon
            refuses beyond its own ``serve --max-workers``, default 10,000, first).
        max_resends_per_job, max_resends: ``err MISSING_ITERATE`` makes the server send a job's
            iterates again (a 52-byte err, a whole iterate back): at most this many times per job,
            and per worker without an accepted reply between. Past either bound the job is
            written off (lost, reason "resends", a ``cancel`` tells the worker) and the err counts
            as an invalid reply (``max_bad_replies`` of them in a row: quarantine).
        max_credit: a worker holds at most this many jobs at once, whatever credit it asks for
            (bounds the ledger at max_workers * max_credit entries; a hoarder that never answers
            holds no more).
        round_period_s: round-mode algorithms: None = demand-driven rounds (a round whenever a
            worker is ready for a job); a number = a round every period on the driver's clock.
        seed: seeds the job sample seeds.
        run_id: this training run's id, announced in Welcome (kept when a run is resumed).
        restart_grace_s: after a restart (:meth:`ps.core.server_core.ServerCore.rebase_clock`), how long each
            restored worker has to say hello again before it is written off; None (the default):
            :func:`restart_grace_s` of ``liveness_timeout_s``. Never less than the liveness timeout.
        await_hello: after a restart, a restored worker gets no job and no ``cancel`` until its
            hello (it has no connection yet: PROTOCOL.md 8.11). Pinned in a run's run.json (True for
            runs created since); False replays a run of an earlier version as it ran.
        refuse_overflow: a reply with a gradient value whose square overflows the run's dtype
            (|g_i| >= ~1.8e19 in float32) is refused as NON_FINITE, like a NaN (issue 29: a finite
            3.4e38 would step the iterate to where honest gradients overflow). Pinned in run.json
            like ``await_hello`` (True for runs created since); False replays an earlier run as it ran.
    """

    problem: str = "quadratic"
    problem_options: dict = field(default_factory=dict)
    batch_size: int = 1
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    liveness_timeout_s: float = LIVENESS_TIMEOUT_S
    min_workers: int = 1
    max_bad_replies: int = 5
    max_failed_jobs: int = 5
    quarantine_s: float = 300.0
    max_workers: int = 65536
    max_resends_per_job: int = 2
    max_resends: int = 4
    max_credit: int = MAX_CREDIT
    round_period_s: float | None = None
    seed: int = 0
    run_id: int = 0
    restart_grace_s: float | None = None
    await_hello: bool = False
    refuse_overflow: bool = False

    @property
    def restart_grace(self) -> float:
        """The grace of a restored worker (``restart_grace_s`` resolved)."""
        g = restart_grace_s(self.liveness_timeout_s) if self.restart_grace_s is None else self.restart_grace_s
        return max(g, self.liveness_timeout_s)
