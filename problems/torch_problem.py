"""Bring your own PyTorch model: :class:`TorchProblem` wraps an ``nn.Module``, a loss and datasets.

A user's problem module needs a factory that returns one, e.g. ``mymodel.py``::

    def make(device="cpu"):
        return latecomer.TorchProblem(Net, torch.nn.functional.cross_entropy, train, test, device=device)

and then ``latecomer serve --problem mymodel:make`` (from the folder that holds ``mymodel.py``).

How the model becomes a latecomer problem:

- **Parameters.** The layout is the model's trainable ``named_parameters()`` in order, with their
  real names and shapes (so Muon steps real matrices). Frozen parameters (``requires_grad``
  False) and buffers do not travel: they keep the values the module was built with.
  ``lmo_mask`` says per block whether an LMO/Muon step applies (see :func:`default_lmo_rule`).
- **Gradients.** ``grad(x, seed, batch_size)`` is a pure function of its arguments on CPU: a
  ``torch.Generator`` seeded from ``seed`` picks ``batch_size`` distinct training indices (a
  ``randperm`` prefix); then torch's global RNG is forked (CUDA included on a CUDA device) and
  seeded from ``seed``, so Dropout and random transforms in a dataset's ``__getitem__`` that
  draw from torch's RNG are reproduced exactly (by other workers, by ``latecomer replay``).
  Transforms that draw from ``numpy.random`` or ``random`` are *not* reproducible: seed your
  own generator from :func:`job_seed` (the current job's seed) instead. The flat vector is
  copied to the device once per point (through pinned memory on CUDA); each block is a
  separate leaf tensor viewing that copy (``torch.func.functional_call``), so the backward
  costs what a plain ``loss.backward()`` costs, and the blocks' gradients are gathered into one
  new flat float32 vector (one copy; on CUDA one more, into pinned memory). The model is in
  train mode. On CUDA the Dropout masks come from the CUDA generator, so they differ from the
  CPU's (gradients agree in distribution, not bit for bit).
- **Full gradients** (``snapshot-vr``): ``full_grad(x, lo, hi)`` sums the gradients of the
  training positions ``[lo, hi)`` in chunks of ``batch_size`` (each chunk's mean loss counted
  ``len(chunk)`` times); ``num_samples`` is the training set's size.
- **BatchNorm and other buffers.** Workers compute gradients in train mode with batch
  statistics and never change the module's buffers (each job works on copies). Before each
  ``evaluate(x)`` the running statistics are re-estimated at ``x`` ("precise BN", as fvcore
  does): every ``_BatchNorm`` module that tracks running stats is reset, its momentum set to
  None (a cumulative average), ``bn_batches`` fixed, seeded training batches of ``batch_size``
  are run forward in train mode without gradients under a seeded forked RNG, the momentum is
  restored, and the model is evaluated in eval mode with these statistics. :meth:`state_dict`
  (``latecomer export``) runs the same procedure, so an exported model carries exactly the
  buffers its evaluation used. Models without BatchNorm skip all of this.
- **Evaluation.** ``loss`` on the test set (or the held-out part of ``train``); for
  classification (2-D logits, integer targets) also ``accuracy`` and macro-``f1``; plus the
  user's ``metrics``. Batched by ``eval_batch_size``, without gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import Subset, TensorDataset, default_collate

from algorithms._pool import ArrayPool
from problems.base import GradResult, Layout, Problem, layout_size

_JOB_SEED: contextvars.ContextVar[int] = contextvars.ContextVar("latecomer_job_seed")

# Streams derived from one seed (SeedSequence([seed, stream])): independent generators for the
# batch indices, the RNG seen while fetching the batch, and the RNG seen by the forward pass.
_INDEX, _FETCH, _FORWARD, _HOLDOUT, _BN, _EVAL = range(6)
_FULL = 1 << 32  # + a chunk's start: the streams of full_grad's chunks


def job_seed() -> int:
    """The seed of the job a :class:`TorchProblem` is computing right now (in ``__getitem__``,
    the model and the loss). Seed your own numpy/``random`` generators from it to make a
    transform reproducible; torch's own RNG is already seeded for you.

    During ``evaluate`` and the BatchNorm re-estimation it is a fixed seed derived from the
    problem's ``seed``.

    Raises:
        RuntimeError: called outside a TorchProblem computation.
    """
    try:
        return _JOB_SEED.get()
    except LookupError:
        raise RuntimeError("latecomer.job_seed() is only set while a TorchProblem computes "
                           "(a gradient, an evaluation, the BatchNorm re-estimation)") from None


def derive_seed(seed: int, stream: int) -> int:
    """A 64-bit seed for ``stream`` of ``seed`` (``numpy.random.SeedSequence``): same in every process."""
    return int(np.random.SeedSequence([int(seed) & (2**64 - 1), stream]).generate_state(1, np.uint64)[0])


def default_lmo_rule(model: nn.Module) -> Callable[[str, nn.Parameter], bool]:
    """The default LMO/Muon rule: a parameter gets an LMO step when it is at least 2-D, does not
    belong to an ``nn.Embedding`` and does not belong to the output layer (the last module in
    ``named_modules()`` order that holds a 2-D ``weight``)."""
    owner: dict[int, nn.Module] = {}
    head: nn.Module | None = None
    for _, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
        w = module._parameters.get("weight")
        if isinstance(w, torch.Tensor) and w.ndim == 2:
            head = module

    def rule(name: str, param: nn.Parameter) -> bool:
        module = owner.get(id(param))
        return param.ndim >= 2 and not isinstance(module, nn.Embedding) and module is not head

    return rule


class _Source:
    """A map-style dataset (optionally a subset of it) that yields collated batches by position."""

    def __init__(self, dataset: Any, index: torch.Tensor | None, collate: Callable[[list], Any] | None):
        self.collate = collate or default_collate
        # Fast path: a TensorDataset (or Subsets of one) with the default collation is indexed at
        # once: same values as collating the items one by one.
        base, base_index = dataset, index
        while collate is None and isinstance(base, Subset):
            sub = torch.as_tensor(list(base.indices), dtype=torch.int64)
            base_index = sub if base_index is None else sub[base_index]
            base = base.dataset
        if collate is None and isinstance(base, TensorDataset):
            self.dataset, self.index, self.tensors = base, base_index, base.tensors
        else:
            self.dataset, self.index, self.tensors = dataset, index, None
        self.size = len(index) if index is not None else len(dataset)

    def __len__(self) -> int:
        return self.size

    def fetch(self, positions: torch.Tensor) -> Any:
        idx = positions if self.index is None else self.index[positions]
        if self.tensors is not None:
            return [t[idx] for t in self.tensors]
        return self.collate([self.dataset[int(i)] for i in idx])


class _LossOf(nn.Module):
    """``forward(batch)`` = the loss of the wrapped model on ``batch``, so one functional_call
    swaps in the parameters for the user's whole loss computation."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, compute_loss: Callable | None):
        super().__init__()
        self.model = model
        self.loss_fn, self.compute_loss = loss_fn, compute_loss

    def forward(self, batch: Any) -> Any:
        if self.compute_loss is not None:
            return self.compute_loss(self.model, batch), None, None
        inputs, target = _split_pair(batch)
        out = self.model(inputs)
        return self.loss_fn(out, target), out, target


def _split_pair(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise ValueError(f"loss_fn needs (input, target) batches, the dataset gives {_describe(batch)}: "
                         "pass compute_loss=(model, batch) -> loss instead")
    return batch[0], batch[1]


def _describe(batch: Any) -> str:
    if isinstance(batch, (list, tuple)):
        return f"a {type(batch).__name__} of {len(batch)}"
    return f"a {type(batch).__name__}"


def _to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a collated batch on ``device``; floating tensors as float32 (the model's dtype)."""
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point() and batch.dtype != torch.float32:
            batch = batch.to(torch.float32)
        return batch.to(device, non_blocking=True) if batch.device != device else batch
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _is_classification(out: Any, target: Any) -> bool:
    """2-D logits and 1-D integer targets."""
    return (isinstance(out, torch.Tensor) and out.ndim == 2 and isinstance(target, torch.Tensor)
            and target.ndim == 1 and target.dtype in (torch.int64, torch.int32, torch.int16, torch.int8,
                                                       torch.uint8))


def _check_dataset(name: str, ds: Any) -> None:
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise ValueError(f"TorchProblem: {name} must be a map-style dataset (__getitem__ and __len__), "
                         f"got a {type(ds).__name__}")
    if len(ds) == 0:
        raise ValueError(f"TorchProblem: {name} dataset is empty")


class TorchProblem(Problem):
    """A latecomer problem made of a PyTorch model, a loss and map-style datasets.

    Args:
        model: an ``nn.Module``, or a zero-argument callable that returns one (e.g. the class
            itself). Cast to float32 and moved to ``device``. With a callable, ``init_params(seed)``
            rebuilds the model under ``torch.manual_seed(seed)``, so x0 depends on the run's seed
            only; with a module, ``init_params`` returns the module's parameters as they are,
            whatever the seed: build it deterministically (``torch.manual_seed`` first), or
            resuming and ``latecomer replay`` in another process start from another x0.
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` for datasets of
            ``(input, target)`` items; the model is called as ``model(input)``.
        train: the training dataset (``__getitem__`` and ``__len__``), collated with
            ``torch.utils.data.default_collate`` or ``collate_fn``.
        test: the evaluation dataset. None: hold out ``holdout`` of ``train`` (a fixed split
            from ``seed``) and train on the rest.
        batch_size: batch size of the BatchNorm re-estimation (use the run's ``--batch-size``).
        metrics: extra figures of ``evaluate``, ``{"name": fn(output, target) -> float}``, called
            once on the whole test set's outputs and targets (needs ``loss_fn``).
        device: torch device of the model and the batches (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        compute_loss: ``compute_loss(model, batch) -> scalar tensor`` for any other kind of
            batch (instead of ``loss_fn``; exactly one of the two). ``evaluate`` then reports
            the batch-size-weighted mean loss only.
        collate_fn: turns a list of items into a batch (default ``default_collate``).
        holdout: share of ``train`` held out for evaluation when ``test`` is None, in (0, 1).
        bn_batches: training batches run to re-estimate BatchNorm statistics before each
            evaluation and export (0: keep the module's own running statistics).
        eval_batch_size: batch size of ``evaluate``.
        lmo: which blocks get an LMO/Muon step (``lmo_mask``): a callable
            ``(name, param) -> bool`` or a collection of parameter names; None: the default
            rule (:func:`default_lmo_rule`).
        seed: seeds the model built from a callable, the holdout split, the BatchNorm batches
            and the RNG of evaluation.

    Attributes:
        model: the module (its parameters are only the template; values travel in ``x``).
        layout: ``((name, shape), ...)`` of the trainable parameters.
        lmo_mask: one bool per layout block, True where an LMO/Muon step applies.
        buffer_names: names of the module's buffers, in ``named_buffers()`` order.

    Raises:
        ValueError: neither or both of ``loss_fn``/``compute_loss``, a model without trainable
            parameters or with non-float ones, an unusable dataset, device or option.
    """

    fresh_gradients = True  # its buffers come back only once nobody holds them (ArrayPool)

    def __init__(self, model: nn.Module | Callable[[], nn.Module], loss_fn: Callable | None = None,
                 train: Any = None, test: Any = None, *, batch_size: int = 32,
                 metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], float]] | None = None,
                 device: str = "cpu", compute_loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                 collate_fn: Callable[[list], Any] | None = None, holdout: float = 0.1, bn_batches: int = 16,
                 eval_batch_size: int = 1024,
                 lmo: Callable[[str, nn.Parameter], bool] | Collection[str] | None = None, seed: int = 0):
        if (loss_fn is None) == (compute_loss is None):
            raise ValueError("TorchProblem: give exactly one of loss_fn(output, target) and "
                             "compute_loss(model, batch)")
        for name, fn in (("loss_fn", loss_fn), ("compute_loss", compute_loss), ("collate_fn", collate_fn)):
            if fn is not None and not callable(fn):
                raise ValueError(f"TorchProblem: {name} must be callable, got a {type(fn).__name__}")
        if train is None:
            raise ValueError("TorchProblem: a train dataset is required")
        _check_dataset("train", train)
        if test is not None:
            _check_dataset("test", test)
        elif not 0.0 < holdout < 1.0:
            raise ValueError(f"TorchProblem: holdout must be in (0, 1), got {holdout}")
        for name, value, lo in (("batch_size", batch_size, 1), ("bn_batches", bn_batches, 0),
                                ("eval_batch_size", eval_batch_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"TorchProblem: {name} must be an integer >= {lo}, got {value!r}")
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not callable(fn):
                raise ValueError(f"TorchProblem: metric {name!r} is not callable")
            if name in ("loss", "accuracy", "f1"):
                raise ValueError(f"TorchProblem: metric name {name!r} is taken (loss, accuracy, f1 are built in)")
        if metrics and loss_fn is None:
            raise ValueError("TorchProblem: metrics=(output, target) need loss_fn and (input, target) batches")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"TorchProblem: invalid device {device!r}: {e}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"TorchProblem: device {device!r}: CUDA is not available on this machine")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"TorchProblem: device {device!r}: only cpu and cuda are supported")
        self._rng_devices: list[int] = []
        if self.device.type == "cuda":
            torch.cuda.init()
            self._rng_devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()]
        self.seed = int(seed)
        self.batch_size, self.bn_batches, self.eval_batch_size = batch_size, bn_batches, eval_batch_size
        self.metrics = metrics
        self.loss_fn, self.compute_loss = loss_fn, compute_loss

        # -- the model
        self._factory = None if isinstance(model, nn.Module) else model
        if self._factory is not None and not callable(self._factory):
            raise ValueError(f"TorchProblem: model must be an nn.Module or a callable returning one, "
                             f"got a {type(model).__name__}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            module = self._build() if self._factory is not None else model
        self.model = module.to(device=self.device, dtype=torch.float32)
        self._trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        for n, p in self.model.named_parameters():
            if not p.is_floating_point():
                raise ValueError(f"TorchProblem: parameter {n!r} is {p.dtype}: only real floating-point "
                                 "parameters can be trained")
        if not self._trainable:
            raise ValueError("TorchProblem: the model has no trainable parameters")
        self.layout: Layout = tuple((n, tuple(int(s) for s in p.shape)) for n, p in self._trainable)
        self._sizes = [p.numel() for _, p in self._trainable]
        self._init = torch.cat([p.detach().reshape(-1).cpu() for _, p in self._trainable]).numpy().copy()
        rule = _lmo_rule(lmo, self.model, {n for n, _ in self._trainable})
        self.lmo_mask: tuple[bool, ...] = tuple(bool(rule(n, p)) for n, p in self._trainable)
        self.buffer_names = tuple(n for n, _ in self.model.named_buffers())
        self._bn = [(name, m) for name, m in self.model.named_modules()
                    if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None]
        self._caller = _LossOf(self.model, loss_fn, compute_loss)

        # -- the data
        if test is None:
            n = len(train)
            n_hold = min(n - 1, max(1, round(holdout * n)))
            if n < 2:
                raise ValueError("TorchProblem: a holdout needs at least 2 training items (or give test=)")
            g = torch.Generator().manual_seed(derive_seed(self.seed, _HOLDOUT))
            perm = torch.randperm(n, generator=g)
            self._train = _Source(train, perm[n_hold:].sort().values, collate_fn)
            self._test = _Source(train, perm[:n_hold].sort().values, collate_fn)
        else:
            self._train = _Source(train, None, collate_fn)
            self._test = _Source(test, None, collate_fn)
        self.num_train, self.num_test = len(self._train), len(self._test)
        self.num_samples = self.num_train  # full_grad's positions
        # d-sized host buffers (the copy of x, the flat gradient), reused once nobody holds them: a
        # fresh 30-45 MB array per call costs page faults (one thread computes at a time)
        self._buffers = ArrayPool()

    # ------------------------------------------------------------------ helpers
    def _build(self) -> nn.Module:
        module = self._factory()
        if not isinstance(module, nn.Module):
            raise ValueError(f"TorchProblem: the model callable returned a {type(module).__name__}, "
                             "not an nn.Module")
        return module

    @contextlib.contextmanager
    def _seeded(self, seed: int, stream: int) -> Iterator[None]:
        """Fork torch's RNG (this device's too), seed it for ``stream`` of ``seed``, and set
        :func:`job_seed`."""
        token = _JOB_SEED.set(int(seed))
        try:
            with torch.random.fork_rng(devices=self._rng_devices, device_type="cuda"):
                self._seed_rng(derive_seed(seed, stream))
                yield
        finally:
            _JOB_SEED.reset(token)

    def _seed_rng(self, s: int) -> None:
        """``torch.manual_seed(s)`` for the CPU and this problem's device only (the full call
        walks every backend, at about 1 ms a call)."""
        torch.default_generator.manual_seed(s)
        if self._rng_devices:
            torch.cuda.default_generators[self._rng_devices[0]].manual_seed(s)

    def _flat(self, x: np.ndarray) -> torch.Tensor:
        """``x`` as a new float32 tensor on the device: one copy (through pinned memory on CUDA,
        the transfer asynchronous). A copy, so read-only buffers (zero-copy network frames,
        shared memory the server writes) are fine."""
        x = np.asarray(x)
        if x.shape != (self.dim,):
            raise ValueError(f"parameter vector of shape {x.shape}, expected ({self.dim},)")
        if self.device.type == "cuda":
            staged = torch.empty(self.dim, dtype=torch.float32, pin_memory=True)  # torch's cached pinned blocks
            staged.numpy()[...] = x
            return staged.to(self.device, non_blocking=True)
        host = self._buffers.empty((self.dim,), np.float32)
        host[...] = x
        return torch.from_numpy(host)

    def _views(self, flat: torch.Tensor, prefix: str = "") -> dict[str, torch.Tensor]:
        """The blocks of ``flat`` as views, by name (``prefix`` + parameter name)."""
        return {prefix + name: t.view(shape)
                for (name, shape), t in zip(self.layout, flat.split(self._sizes), strict=True)}

    def _leaves(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The blocks of ``flat`` as separate leaf tensors that share its memory and require a
        gradient: autograd then gives each block its own gradient (the cost of a plain
        backward), where one leaf seen through a slice per block built a full-size gradient per
        block (blocks x d)."""
        return [t.detach().view(shape).requires_grad_(True)
                for (_, shape), t in zip(self.layout, flat.split(self._sizes), strict=True)]

    def _gather(self, grads: list[torch.Tensor]) -> np.ndarray:
        """The blocks' gradients as one flat float32 numpy vector: one copy (on CUDA, one copy on
        the device and one into pinned host memory). The vector is the caller's for as long as
        it holds it (or a view of it): only then is its buffer used again."""
        flat = [g.reshape(-1) for g in grads]
        if self.device.type == "cuda":
            dev = torch.cat(flat)
            host = torch.empty(self.dim, dtype=torch.float32, pin_memory=True)
            host.copy_(dev, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            return host.numpy()
        out = self._buffers.empty((self.dim,), np.float32)
        torch.cat(flat, out=torch.from_numpy(out))
        return out

    def _buffer_copies(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Copies of the module's buffers: a job may update them (BatchNorm in train mode), the
        module's own stay as built."""
        return {prefix + n: b.clone() for n, b in self.model.named_buffers()}

    def batch_positions(self, seed: int, batch_size: int) -> torch.Tensor:
        """Positions in the training set of the batch ``seed`` picks: the first ``batch_size``
        of a permutation from a ``torch.Generator`` seeded from ``seed`` (clipped to the set)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        g = torch.Generator().manual_seed(derive_seed(seed, _INDEX))
        return torch.randperm(self.num_train, generator=g)[:batch_size]

    def _loss_at(self, params: Mapping[str, torch.Tensor], batch: Any, seed: int) -> tuple[torch.Tensor, Any, Any]:
        """The loss (and output, target) with ``params`` (``model.``-prefixed names) on
        ``batch``, forward RNG from ``seed``."""
        self._seed_rng(derive_seed(seed, _FORWARD))
        state = {**params, **self._buffer_copies("model.")}
        loss, out, target = torch.func.functional_call(self._caller, state, (batch,))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"TorchProblem: the loss must be a scalar tensor, got {what}")
        return loss.reshape(()), out, target

    def _backward(self, x: np.ndarray, batch: Any, seed: int, scale: float = 1.0) -> tuple[list[torch.Tensor], float]:
        """The loss at ``x`` on ``batch`` (times ``scale``) and its gradient, one tensor per
        block: ``x`` copied to the device once, its blocks separate leaves (:meth:`_leaves`), a
        block the loss does not reach gets zeros."""
        leaves = self._leaves(self._flat(x))
        params = {"model." + name: t for (name, _), t in zip(self.layout, leaves, strict=True)}
        loss, _, _ = self._loss_at(params, batch, seed)
        if not loss.requires_grad:
            raise ValueError("TorchProblem: the loss does not depend on the model's parameters")
        if scale != 1.0:
            loss = loss * scale
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
        return list(grads), float(loss.detach())

    def _grad_at(self, x: np.ndarray, batch: Any, seed: int) -> GradResult:
        grads, loss = self._backward(x, batch, seed)
        return GradResult(grad=self._gather(grads), loss=loss)

    def _train_batch(self, seed: int, batch_size: int) -> Any:
        positions = self.batch_positions(seed, batch_size)
        self._seed_rng(derive_seed(seed, _FETCH))
        return _to_device(self._train.fetch(positions), self.device)

    # ------------------------------------------------------------------ the problem interface
    def init_params(self, seed: int) -> np.ndarray:
        """x0: the model's own initialisation under ``torch.manual_seed(seed)`` when the model was
        given as a callable; otherwise the module's parameters as given (any seed)."""
        if self._factory is None:
            return self._init.copy()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            module = self._build().to(dtype=torch.float32)
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        got = tuple((n, tuple(int(s) for s in p.shape)) for n, p in params)
        if got != self.layout:
            raise ValueError("TorchProblem: the model callable built a model with another set of parameters "
                             "than the first time")
        return torch.cat([p.detach().reshape(-1).cpu() for _, p in params]).numpy().astype(np.float32)

    def grad(self, x: np.ndarray, seed: int, batch_size: int) -> GradResult:
        """The loss and its gradient at ``x`` on the training batch picked by ``seed`` (train mode).

        Args:
            x: flat float32 parameters (layout order).
            seed: picks the batch and seeds torch's RNG (Dropout, random transforms).
            batch_size: items in the batch (clipped to the training set).

        Returns:
            The float32 gradient (CPU numpy, shape (dim,)) and the batch loss.
        """
        self.model.train()
        with self._seeded(seed, _FETCH):
            batch = self._train_batch(seed, batch_size)
            return self._grad_at(x, batch, seed)

    def grad_pair(self, x_new: np.ndarray, x_old: np.ndarray, seed: int,
                  batch_size: int) -> tuple[GradResult, GradResult]:
        """Gradients at two points on the same batch with the same RNG (same Dropout masks)."""
        self.model.train()
        with self._seeded(seed, _FETCH):
            batch = self._train_batch(seed, batch_size)
            return self._grad_at(x_new, batch, seed), self._grad_at(x_old, batch, seed)

    def full_grad(self, x: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int, float]:
        """The sum over training positions ``[lo, hi)`` of the items' gradients, the count and
        the summed loss (``num_samples`` = the training set's size; ``snapshot-vr``'s full
        gradient is the sum of its shards over N).

        The positions are taken in chunks of ``batch_size`` from ``lo``; each chunk's loss,
        taken to be the mean over its items (as ``loss_fn`` and ``compute_loss`` should give
        it), counts ``len(chunk)`` times. Train mode, like :meth:`grad` (BatchNorm uses the
        chunk's statistics), with the forward RNG of each chunk seeded from the problem's seed
        and the chunk's start, so the result is a pure function of ``(x, lo, hi)`` on CPU."""
        if not 0 <= lo <= hi <= self.num_train:
            raise ValueError(f"shard [{lo}, {hi}) is not inside [0, {self.num_train})")
        if hi == lo:
            return np.zeros(self.dim, np.float32), 0, 0.0
        self.model.train()
        total: list[torch.Tensor] | None = None
        loss_sum = 0.0
        for at in range(lo, hi, self.batch_size):
            positions = torch.arange(at, min(at + self.batch_size, hi))
            seed = derive_seed(self.seed, _FULL + at)
            with self._seeded(seed, _FETCH):
                batch = _to_device(self._train.fetch(positions), self.device)
                grads, loss = self._backward(x, batch, seed, scale=float(len(positions)))
            loss_sum += loss
            if total is None:
                total = grads
            else:
                for t, g in zip(total, grads, strict=True):
                    t.add_(g)
        return self._gather(total), hi - lo, loss_sum

    @torch.no_grad()
    def estimate_buffers(self, x: np.ndarray) -> dict[str, torch.Tensor]:
        """The buffers evaluation uses at ``x``: BatchNorm running statistics re-estimated on
        ``bn_batches`` fixed training batches (see the module docstring), every other buffer
        as the module holds it. Keys are ``named_buffers()`` names; tensors on the device."""
        buffers = self._buffer_copies()
        if not self._bn or self.bn_batches == 0:
            return buffers
        for name, m in self._bn:
            p = f"{name}." if name else ""
            buffers[p + "running_mean"].zero_()
            buffers[p + "running_var"].fill_(1.0)
            if m.num_batches_tracked is not None:
                buffers[p + "num_batches_tracked"].zero_()
        state = {**self._views(self._flat(x), "model."), **{"model." + k: v for k, v in buffers.items()}}
        momenta = [m.momentum for _, m in self._bn]
        was_training = self.model.training
        try:
            for _, m in self._bn:
                m.momentum = None  # cumulative average over the batches
            self.model.train()
            with self._seeded(self.seed, _BN):
                g = torch.Generator().manual_seed(derive_seed(self.seed, _BN))
                n, bs = self.num_train, min(self.batch_size, self.num_train)
                perm, at = torch.randperm(n, generator=g), 0
                for _ in range(self.bn_batches):
                    if at + bs > n:
                        perm, at = torch.randperm(n, generator=g), 0
                    batch = _to_device(self._train.fetch(perm[at:at + bs]), self.device)
                    at += bs
                    torch.func.functional_call(self._caller, state, (batch,))
        finally:
            for (_, m), mom in zip(self._bn, momenta, strict=True):
                m.momentum = mom
            self.model.train(was_training)
        return buffers

    @torch.no_grad()
    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        """Test ``loss`` (mean over items), and for classification ``accuracy`` and macro-``f1``,
        plus the user's ``metrics``; eval mode with re-estimated BatchNorm statistics."""
        buffers = self.estimate_buffers(x)
        state = {**self._views(self._flat(x), "model."), **{"model." + k: v for k, v in buffers.items()}}
        total, count = 0.0, 0
        preds, targets, outputs, classify, num_classes = [], [], [], True, 0
        was_training = self.model.training
        self.model.eval()
        try:
            with self._seeded(self.seed, _EVAL):
                for lo in range(0, self.num_test, self.eval_batch_size):
                    positions = torch.arange(lo, min(lo + self.eval_batch_size, self.num_test))
                    batch = _to_device(self._test.fetch(positions), self.device)
                    loss, out, target = torch.func.functional_call(self._caller, state, (batch,))
                    total += float(loss) * len(positions)
                    count += len(positions)
                    classify = classify and _is_classification(out, target)
                    if self.metrics or classify:
                        targets.append(target.detach().cpu())
                    if self.metrics:
                        outputs.append(out.detach().cpu())
                    if classify:
                        num_classes = int(out.shape[1])
                        preds.append(out.argmax(dim=1).cpu())
        finally:
            self.model.train(was_training)
        figures = {"loss": total / count}
        if self.loss_fn is not None and classify and preds:
            from problems.mlp import macro_f1_and_recall

            y_pred = torch.cat(preds).numpy().astype(np.int64)
            y_true = torch.cat(targets).numpy().astype(np.int64)
            num_classes = max(num_classes, int(y_true.max()) + 1)
            figures["accuracy"] = float(np.mean(y_pred == y_true))
            figures["f1"] = macro_f1_and_recall(y_true, y_pred, num_classes)[0]
        if self.metrics:
            all_out, all_target = torch.cat(outputs), torch.cat(targets)
            for name, fn in self.metrics.items():
                figures[name] = float(fn(all_out, all_target))
        return figures

    def state_dict(self, x: np.ndarray) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` at ``x``: parameters from ``x``, buffers as
        :meth:`estimate_buffers` gives them (CPU tensors), so
        ``model.load_state_dict(problem.state_dict(x))`` reproduces what ``evaluate(x)`` scored."""
        values: dict[int, torch.Tensor] = {}
        flat = self._flat(x)
        for (_, p), t in zip(self._trainable, self._views(flat).values(), strict=True):
            values[id(p)] = t
        buffers = self.estimate_buffers(x)
        for name, b in self.model.named_buffers():
            values[id(b)] = buffers[name]
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            v = values.get(id(t), t)
            out[key] = v.detach().to("cpu", copy=True).contiguous()
        return out


def _lmo_rule(lmo: Any, model: nn.Module, names: set[str]) -> Callable[[str, nn.Parameter], bool]:
    if lmo is None:
        return default_lmo_rule(model)
    if callable(lmo):
        return lmo
    if isinstance(lmo, str) or not isinstance(lmo, Collection):
        raise ValueError("TorchProblem: lmo must be a callable (name, param) -> bool or a collection of "
                         f"parameter names, got {lmo!r}")
    unknown = sorted(set(lmo) - names)
    if unknown:
        raise ValueError(f"TorchProblem: lmo names unknown parameter(s) {', '.join(map(repr, unknown))}")
    chosen = set(lmo)
    return lambda name, param: name in chosen


def flat_state(problem: Problem, x: np.ndarray) -> dict[str, np.ndarray]:
    """A state dict of any problem at ``x``: a TorchProblem's own (parameters and buffers, numpy
    float32), else the layout's blocks by name (copies)."""
    if isinstance(problem, TorchProblem):
        return {k: v.numpy() for k, v in problem.state_dict(x).items()}
    if np.asarray(x).shape != (layout_size(problem.layout),):
        raise ValueError(f"parameter vector of shape {np.asarray(x).shape} does not match the problem's layout "
                         f"of size {layout_size(problem.layout)}")
    if not problem.layout:
        return {"x": np.array(x, dtype=np.float32)}
    out, off = {}, 0
    for name, shape in problem.layout:
        n = math.prod(shape)
        out[name] = np.array(x[off:off + n], dtype=np.float32).reshape(shape)
        off += n
    return out


__all__ = ["TorchProblem", "default_lmo_rule", "derive_seed", "flat_state", "job_seed"]
