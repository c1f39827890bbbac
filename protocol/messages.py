"""Message types of the latecomer wire protocol (version 1).

Every message is a frozen, slotted dataclass. Arrays travel as raw frames after a
msgpack header (see ``protocol/codec.py`` and ``protocol/PROTOCOL.md``); the
dataclasses hold them as numpy arrays. Constants shared by both sides live here
and nowhere else (zguide ``MDP.py`` style).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

PROTOCOL_VERSION = 1
PROTOCOL_VERSION_MIN = 1

# Heartbeats and liveness (seconds; the server's values win, announced in Welcome).
HEARTBEAT_INTERVAL_S = 0.5
LIVENESS_TIMEOUT_S = 3.0

# The reference worker's reconnect backoff (PROTOCOL.md 8.10): a hello at once, then after
# HELLO_BACKOFF_S doubling to HELLO_BACKOFF_MAX_S; libzmq's own reconnect attempts after
# RECONNECT_IVL_S doubling to RECONNECT_IVL_MAX_S. A resumed server gives its restored workers
# the sum of the two caps on top of a liveness timeout to say hello again (ps.core.config.restart_grace_s).
HELLO_BACKOFF_S = 0.25
HELLO_BACKOFF_MAX_S = 4.0
RECONNECT_IVL_S = 0.1
RECONNECT_IVL_MAX_S = 5.0

# Validation caps (the decoder enforces these on everything it receives).
MAX_HEADER_BYTES = 64 * 1024
MAX_ARRAYS = 16
MAX_NDIM = 4
MAX_STR_LEN = 1024
MAX_ID_LEN = 64
MAX_LIST_LEN = 256
MAX_MAP_LEN = 64
DEFAULT_MAX_ARRAY_BYTES = 1 << 31  # 2 GiB per array frame; the daemon lowers it to the problem size

# dtype allow-list: explicit little-endian strings only; np.dtype() is never called on peer input.
ALLOWED_DTYPES: dict[str, np.dtype] = {
    "<f4": np.dtype("<f4"),
    "<f8": np.dtype("<f8"),
    "<f2": np.dtype("<f2"),
    "<u2": np.dtype("<u2"),  # bfloat16 bits (issue 7: --wire-dtype bf16)
}


# Large messages travel in parts (PROTOCOL.md §6.13): array bytes above CHUNK_THRESHOLD go as
# `part` messages of at most CHUNK_BYTES (more when a message would need over MAX_PARTS parts).
CHUNK_THRESHOLD = 16 << 20
CHUNK_BYTES = 4 << 20
# Under CurveZMQ, from 1 MiB, in parts of 1 MiB (at most 16 a message): libzmq seals and opens
# each frame whole, into fresh zeroed buffers, so in parts the sender seals the next while the
# receiver opens the last (benchmarks/PROFILE.md, "The encrypted path": 1.17-1.29x one frame at
# d = 10^6; 256 KiB and 64 KiB parts cost more per part than they gain).
# Welcome.seal (§6.15, protocol/seal.py): a session's two 32-byte keys and its 32-byte token.
SEAL_SESSION_BYTES = 96
# Welcome.seal_cipher's names (§6.15, protocol/seal.py): AES-256-GCM (also ""), AEGIS-256X4.
SEAL_CIPHERS = ("aes256gcm", "aegis256x4")
CURVE_CHUNK_THRESHOLD = 1 << 20
CURVE_CHUNK_BYTES = 1 << 20
CURVE_MAX_PARTS = 16
MAX_PARTS = 64
MAX_SPIN_US = 100_000  # Job.spin_us's largest value (§6.4)

# How iterates and gradients may travel in frames (Welcome.wire_dtype; protocol/wire.py converts).
WIRE_DTYPES = ("f32", "f16", "bf16")


class JobKind(IntEnum):
    """What a job asks the worker to compute."""

    GRAD = 1  # gradient at one iterate on one seeded minibatch
    GRAD_PAIR = 2  # gradients at (x_new, x_old) on the same seeded minibatch
    FULL_GRAD = 3  # sum of component gradients over a shard [lo, hi) at one iterate


class ErrorCode(IntEnum):
    """Codes carried by :class:`Error`; stable across versions."""

    MALFORMED = 1  # could not decode the message
    UNSUPPORTED_VERSION = 2
    UNKNOWN_WORKER = 3  # message before hello (the worker should say hello again)
    UNKNOWN_JOB = 4  # job id not outstanding for this worker (late, duplicate, cancelled, written off)
    BAD_SHAPE = 5  # grads do not match the job (count, dtype or shape)
    NON_FINITE = 6  # NaN or Inf in a gradient
    REFUSED = 7  # refused (e.g. quarantined, shutting down)
    MISSING_ITERATE = 8  # worker lacks an iterate the job references (worker -> server)
    COMPUTE_FAILED = 9  # the worker could not compute the job: its problem raised (worker -> server)
    PROBLEM_UNAVAILABLE = 10  # the worker cannot load the welcome's problem; it is leaving (worker -> server)


# How an ``err REFUSED`` answering a hello starts when that hello's (worker_id, boot) was replaced by
# a newer boot and spoke again: two live processes share the id (PROTOCOL.md 8.1). A worker whose id
# was chosen by default takes another one; one given its id by the user stops.
ID_IN_USE = "worker id in use"

# Error texts a peer composes from exceptions are made printable and cut to this many characters.
MAX_ERROR_TEXT = 1000


@dataclass(frozen=True, slots=True)
class Hello:
    """Worker -> server, first message of every connection (and after a server restart)."""

    worker_id: str
    boot: int  # random u64 per worker process start (incarnation)
    credit: int  # how many jobs the worker may hold at once (>= 1)
    vmin: int = PROTOCOL_VERSION_MIN
    vmax: int = PROTOCOL_VERSION
    device: str = "cpu"
    host_id: str = ""
    holds: tuple[int, ...] = ()  # iterate ids in the worker's cache
    busy: tuple[int, ...] = ()  # job ids it holds unanswered (after a reconnect: still computing)
    seen: int = -1  # highest job id received from run ``run_id``
    run_id: int = 0  # the run the worker last worked for (0: none)
    shm: bool = False  # the worker can use the same-host shared-memory path (PROTOCOL.md §6.11)
    parts: bool = False  # the worker sends and receives large arrays in `part` messages (§6.13)
    shards: bool = False  # the worker follows Welcome.shards (§12): a sharded server refuses a hello without it
    seal: bool = False  # under CurveZMQ the worker can move to a sealed data connection (§6.15)
    seal_segments: bool = False  # ... and opens sealed frames in segments (§6.15)
    seal_ciphers: tuple[str, ...] = ()  # ... and can seal with these besides AES-256-GCM (§6.15: "aegis256x4")
    cpus: int = 0  # the CPUs the worker may run on (affinity, cgroup quota); 0: not said (§6.1, busy polling)


@dataclass(frozen=True, slots=True)
class Welcome:
    """Server -> worker, answer to Hello: the chosen version and what to load."""

    server_boot: int  # random u64 per server process start
    version: int  # chosen protocol version
    problem: str  # problem spec: a built-in name or "module:callable"
    run_id: int = 0  # random u64 per training run; a resumed run (--state) keeps it
    problem_options: dict = field(default_factory=dict)  # msgpack-able: str -> str|int|float|bool
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    liveness_timeout_s: float = LIVENESS_TIMEOUT_S
    wire_dtype: str = "f32"  # how iterates and gradients travel in frames: f32, f16 or bf16 (§6.12)
    shm: str = ""  # same-host path offered: the shared-memory name prefix ("": TCP only)
    parts: bool = False  # the server sends and accepts large arrays in `part` messages (§6.13)
    # A sharded server (§12): per shard (its data endpoint, the [lo, hi) range of the flat vector it
    # owns). Jobs then carry no iterate values: they are fetched from the shards, and gradients go there.
    shards: tuple[tuple[str, int, int], ...] = ()
    # Under CurveZMQ, to a hello with ``seal``: the session's keys (up, down) and its data connection's
    # token (protocol/seal.py, §6.15), in hex (headers carry no binary); "": none offered.
    seal: str = ""
    seal_segments: bool = False  # with a session: the server opens sealed frames in segments (§6.15)
    seal_cipher: str = ""  # with a session: its cipher, one the hello offered ("": AES-256-GCM; §6.15)


@dataclass(frozen=True, slots=True)
class Ready:
    """Worker -> server: ready for (more) work; updates credit and the cached iterate ids."""

    credit: int
    holds: tuple[int, ...] = ()
    shm: bool = False  # the worker opened the server's shared memory (answer to Welcome.shm)


@dataclass(frozen=True, slots=True)
class Job:
    """Server -> worker: one unit of work.

    ``points`` holds arrays only for the iterate ids the worker does not already hold:
    ``point_ids`` names them, in the same order. The other ids of ``iterate_ids`` must be
    in the worker's cache (otherwise it answers ``Error(MISSING_ITERATE)``).
    """

    job_id: int
    kind: JobKind
    created_at: int  # server version (or round) at creation
    iterate_ids: tuple[int, ...]  # GRAD: (k,)  GRAD_PAIR: (new, old)  FULL_GRAD: (anchor,)
    seed: int  # picks the minibatch; identical for both points of a pair
    batch_size: int = 1
    shard: tuple[int, int] | None = None  # FULL_GRAD: component range [lo, hi)
    deadline: int | None = None  # FULL_GRAD: last round at which the result may be used
    point_ids: tuple[int, ...] = ()
    points: tuple[np.ndarray, ...] = ()
    refs: tuple[int, ...] = ()  # same-host path: shared-memory slot of each iterate id, same order
    grad_slots: tuple[int, ...] = ()  # same-host path: slots the gradients are to be written into
    xfer: int = 0  # the array bytes came before, in the `part` messages of this transfer (0: in frames)
    spin_us: int = 0  # the server's advice: busy-poll up to this long for the next message (§6.4; 0: do not)


@dataclass(frozen=True, slots=True)
class Reply:
    """Worker -> server: the result of a job. One gradient per iterate id, same order.

    For FULL_GRAD, ``grads[0]`` is the *sum* of the component gradients over the shard and
    ``count`` the number of components.
    """

    job_id: int
    created_at: int  # echoed from the job; must equal the ledger's (guards against another run's replies)
    grads: tuple[np.ndarray, ...]
    loss: float | None = None
    count: int = 0
    compute_s: float = 0.0
    holds: tuple[int, ...] = ()
    in_shm: bool = False  # the gradients are in the job's grad_slots (then ``grads`` is empty)
    xfer: int = 0  # the array bytes came before, in the `part` messages of this transfer (0: in frames)
    # Never on the wire: a sharded coordinator's per-block squared norms of grads[0], gathered from
    # its shards' `have`s and journaled with the reply (algorithms.base.Result.block_sq).
    block_sq: tuple[float, ...] | None = None
    # Never on the wire either: the shards' per-block squared norms of the vector of state whose whole
    # norm the step divides by (lmo='l2'), gathered per reply (algorithms.base.Result.step_sq).
    step_sq: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Both directions. Worker -> server carries credit and the jobs in progress."""

    boot: int  # sender's incarnation (worker boot or server boot)
    credit: int = 0
    busy: tuple[int, ...] = ()  # job ids received and not yet answered (worker -> server)
    seen: int = -1  # highest job id the worker has received in this run (worker -> server); -1: none


@dataclass(frozen=True, slots=True)
class Cancel:
    """Server -> worker: stop these jobs; their results will not be used."""

    job_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Bye:
    """Either direction: the sender is leaving (worker) or shutting down (server)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Error:
    """Either direction: the previous message was refused. ``job_id`` names the job if any."""

    code: ErrorCode
    message: str = ""
    job_id: int | None = None
    iterate_ids: tuple[int, ...] = ()  # MISSING_ITERATE: the ids the worker lacks


@dataclass(frozen=True, slots=True)
class Part:
    """Either direction: piece ``index`` of ``count`` of the array bytes of the next ``job`` or
    ``reply`` on this connection (the one whose ``xfer`` is this ``xfer``). ``data`` is the raw
    frame (a zero-copy buffer when decoded)."""

    xfer: int
    index: int
    count: int
    data: object = b""


@dataclass(frozen=True, slots=True)
class Fetch:
    """Worker -> shard of a sharded server (§12): the shard's slice of these iterates of a job.
    Answered with a ``job`` (its header, ``point_ids`` = ``iterate_ids`` asked for, their slices),
    or ``err`` UNKNOWN_JOB when the job is not outstanding there (settled, or never issued)."""

    job_id: int
    created_at: int
    iterate_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """Any peer -> server: a read-only request for the server's figures (answered in order:
    every message sent before it on the same connection has been handled)."""

    token: int = 0  # echoed in the answer


@dataclass(frozen=True, slots=True)
class Status:
    """Server -> the asker: flat figures (counters, version, workers, outstanding jobs, ...)."""

    token: int = 0
    info: dict = field(default_factory=dict)  # str -> str|int|float|bool
    columns: tuple[str, ...] = ()  # names of the row fields (e.g. one row per worker)
    rows: tuple[tuple, ...] = ()  # each a tuple of str|int|float|bool, len(columns) long


Message = (Hello | Welcome | Ready | Job | Reply | Heartbeat | Cancel | Bye | Error | Part | Fetch | StatusRequest
           | Status)

# Wire names of the message types ("t" in the header).
TYPE_NAMES: dict[type, str] = {
    Hello: "hello",
    Welcome: "welcome",
    Ready: "ready",
    Job: "job",
    Reply: "reply",
    Heartbeat: "hb",
    Cancel: "cancel",
    Bye: "bye",
    Error: "err",
    Part: "part",
    Fetch: "fetch",
    StatusRequest: "status?",
    Status: "status",
}
TYPES_BY_NAME: dict[str, type] = {v: k for k, v in TYPE_NAMES.items()}
