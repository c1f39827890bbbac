"""(a) raw pyzmq: ROUTER server, DEALER workers; msgpack header + one zero-copy float32 frame each way.

The server keeps x immutable (x = x - lr*g makes a new array) so a zero-copy send of x never sees
a later update (the same rule latecomer follows for iterates)."""

from __future__ import annotations

from benchmarks.common import LR, run_mp_cell, worker_loop


def server(d: int, q_srv) -> None:
    import os

    import msgpack
    import numpy as np
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    s.sndhwm = s.rcvhwm = 0
    s.bind("tcp://127.0.0.1:0")
    q_srv.put(("up", os.getpid(), s.getsockopt_string(zmq.LAST_ENDPOINT)))
    x = np.zeros(d, np.float32)
    version = 0
    try:
        while True:
            ident, head, frame = s.recv_multipart(copy=False)
            h = msgpack.unpackb(head.bytes)
            if h.get("op") == "stop":
                break
            g = np.frombuffer(frame.buffer, dtype="<f4")
            if g.size != d:
                raise ValueError("bad gradient size")
            x = x - np.float32(LR) * g
            version += 1
            s.send_multipart([ident, msgpack.packb({"v": version, "dtype": "<f4", "shape": [d]}), x], copy=False)
    finally:
        s.close()
        ctx.term()


def worker(i: int, endpoint: str, d: int, ctrl, q) -> None:
    import msgpack
    import numpy as np
    import zmq

    try:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.sndhwm = s.rcvhwm = 0
        s.connect(endpoint)
        g = np.full(d, 1e-3, np.float32)
        nbytes = [0]

        def step():
            head = msgpack.packb({"w": i, "dtype": "<f4", "shape": [d]})
            s.send_multipart([head, g], copy=False)
            rhead, frame = s.recv_multipart(copy=False)
            x = np.frombuffer(frame.buffer, dtype="<f4")
            nbytes[0] = len(head) + g.nbytes + len(rhead.bytes) + x.nbytes

        step()
        q.put(("ready", i))
        ts, rt = worker_loop(step, ctrl)
        q.put(("done", i, ts, rt, nbytes[0]))
        s.close()
        ctx.term()
    except Exception as e:  # noqa: BLE001
        q.put(("error", f"{type(e).__name__}: {e}"))


def run(d: int, workers: int, seconds: float, warmup: float):
    return run_mp_cell("raw-zmq", server, (d,), worker, (d,), d, workers, seconds, warmup, server_grace=0.2)
