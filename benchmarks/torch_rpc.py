"""(c) torch.distributed.rpc parameter server, written as the PyTorch tutorials do it
("Implementing Batch RPC Processing" / "Parameter Server Using Distributed RPC"): rank 0 owns a
``ParameterServer`` behind an RRef with a lock and drives the trainers with ``rpc_async``; each
trainer calls ``rpc_sync(ps_rref.owner(), ParameterServer.update_and_fetch, (ps_rref, g))``.
TensorPipe backend on 127.0.0.1 (it may pick its shared-memory channel between local processes)."""

from __future__ import annotations

import os

from benchmarks.common import LR, run_mp_cell, worker_loop

_ENV = {"MASTER_ADDR": "127.0.0.1", "TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
_TRAINER: dict = {}  # per trainer process: ctrl, queue, index, d


class ParameterServer:
    def __init__(self, d: int) -> None:
        import threading

        import torch

        self.x = torch.zeros(d, dtype=torch.float32)
        self.lock = threading.Lock()

    @staticmethod
    def update_and_fetch(ps_rref, g):
        self = ps_rref.local_value()
        with self.lock:
            self.x = self.x - LR * g  # a new tensor: the reply being serialised is never updated in place
            return self.x


def run_trainer(ps_rref, d: int) -> None:
    import pickle

    import torch
    import torch.distributed.rpc as rpc

    q, ctrl, i = _TRAINER["q"], _TRAINER["ctrl"], _TRAINER["i"]
    try:
        g = torch.full((d,), 1e-3, dtype=torch.float32)
        owner = ps_rref.owner()

        def step():
            rpc.rpc_sync(owner, ParameterServer.update_and_fetch, args=(ps_rref, g))

        step()
        nbytes = 2 * len(pickle.dumps(g, protocol=pickle.HIGHEST_PROTOCOL))
        q.put(("ready", i))
        ts, rt = worker_loop(step, ctrl)
        q.put(("done", i, ts, rt, nbytes))
    except Exception as e:  # noqa: BLE001
        q.put(("error", f"{type(e).__name__}: {e}"))


def _options(port: int):
    import torch.distributed.rpc as rpc

    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, init_method=f"tcp://127.0.0.1:{port}",
                                           rpc_timeout=120)


def server(d: int, workers: int, port: int, q_srv) -> None:
    os.environ.update(_ENV)
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    q_srv.put(("up", os.getpid(), port))
    rpc.init_rpc("ps", rank=0, world_size=workers + 1, rpc_backend_options=_options(port))
    ps_rref = rpc.RRef(ParameterServer(d))
    futs = [rpc.rpc_async(f"trainer{i}", run_trainer, args=(ps_rref, d), timeout=0) for i in range(workers)]
    for f in futs:
        f.wait()
    rpc.shutdown()


def worker(i: int, port: int, d: int, workers: int, ctrl, q) -> None:
    os.environ.update(_ENV)
    try:
        import torch
        import torch.distributed.rpc as rpc

        torch.set_num_threads(1)
        _TRAINER.update(q=q, ctrl=ctrl, i=i)
        rpc.init_rpc(f"trainer{i}", rank=i + 1, world_size=workers + 1, rpc_backend_options=_options(port))
        rpc.shutdown()  # returns once the PS has run this trainer's loop and every rank is done
    except Exception as e:  # noqa: BLE001
        q.put(("error", f"{type(e).__name__}: {e}"))


def run(d: int, workers: int, seconds: float, warmup: float):
    from benchmarks.common import free_port

    port = free_port()
    return run_mp_cell("torch-rpc", server, (d, workers, port), worker, (d, workers), d, workers, seconds, warmup,
                       note="bytes: pickled tensors")
