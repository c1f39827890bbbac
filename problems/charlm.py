"""A small character-level transformer language model on Python's own standard-library sources.

The text is the ``.py`` files of one standard-library package (``json`` by default: about 48 KB),
read in sorted file order and concatenated; nothing is downloaded. The vocabulary is the set of
characters present (sorted), the first ``1 - val_frac`` of the text is the training split and
the rest the validation split (a fixed split).

Model: token and position embeddings, ``layers`` pre-norm blocks (causal multi-head attention
and a 4×-wide ReLU² MLP, as NanoChat), a final norm and an untied output matrix. Norms are
parameter-free RMS norms and no matrix has a bias, so every block of the layout is a 2-D weight
matrix. ``lmo_mask`` follows the official NanoChat code (Muon only on the transformer's hidden
matrices): the ``h*`` blocks get Newton–Schulz steps, the token and position embeddings and the
output head the momentum fallback. Parameters are one flat float32 vector; ``grad`` copies it
to the device once and takes the matrices as views.

``grad(x, seed, batch)`` draws ``batch`` windows of ``context + 1`` characters from the training
split with ``np.random.default_rng(seed)`` and returns the mean next-character cross-entropy
and its gradient. ``evaluate(x)``: ``loss`` is the validation cross-entropy (nats per character)
on a fixed set of ``eval_windows`` windows, ``train_loss`` the same on fixed training windows.
Thread settings are the caller's business (this module never calls ``torch.set_num_threads``).
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig

import numpy as np
import torch
import torch.nn.functional as F

from problems.base import GradResult, Layout, Problem


def read_package_text(package: str) -> str:
    """The concatenated ``.py`` sources of standard-library package ``package`` (sorted by name).

    The files are read from the standard library's own folder (``sysconfig``'s ``stdlib``
    path) without importing anything: ``package`` comes from the server's ``welcome`` too, and
    a server must not be able to make a worker import a module or read the sources of any
    other package installed there (SECURITY.md, trust model).

    Raises:
        ValueError: not a standard-library package, or no ``.py`` file in it.
    """
    names = package.split(".") if isinstance(package, str) else []
    if not names or not all(n.isidentifier() for n in names) or names[0] not in sys.stdlib_module_names:
        raise ValueError(f"charlm: package {package!r} is not a standard-library package (the text is read from "
                         "the standard library only)")
    folder = os.path.join(sysconfig.get_paths()["stdlib"], *names)
    if not os.path.isfile(os.path.join(folder, "__init__.py")):
        raise ValueError(f"charlm: {package!r} is not a package with source files")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    texts = []
    for name in files:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            texts.append(f.read())
    return "\n".join(texts)


class CharLM(Problem):
    """Next-character cross-entropy of a small causal transformer.

    Args:
        package: standard-library package whose ``.py`` files are the text (``"json"``, ``"email"``).
        layers: number of transformer blocks (>= 1).
        d_model: width (divisible by ``heads``).
        heads: attention heads.
        context: window length in characters (>= 2).
        val_frac: fraction of the text (its end) held out for validation, in (0, 0.5].
        eval_windows: windows of each split scored by ``evaluate`` (>= 1).
        device: torch device.

    Raises:
        ValueError: an option out of range, or a text too short for the context.
    """

    fresh_gradients = True  # every call returns new arrays

    def __init__(self, package: str = "json", layers: int = 2, d_model: int = 32, heads: int = 2, context: int = 32,
                 val_frac: float = 0.1, eval_windows: int = 64, device: str = "cpu"):
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        if d_model < 1 or heads < 1 or d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of heads ({heads})")
        if context < 2:
            raise ValueError(f"context must be >= 2, got {context}")
        if not 0.0 < val_frac <= 0.5:
            raise ValueError(f"val_frac must be in (0, 0.5], got {val_frac}")
        if eval_windows < 1:
            raise ValueError(f"eval_windows must be >= 1, got {eval_windows}")
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"invalid device {device!r}: {e}") from None
        text = read_package_text(package)
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([lookup[c] for c in text], dtype=np.int64)
        cut = int(round(len(ids) * (1.0 - val_frac)))
        self.train_ids, self.val_ids = ids[:cut], ids[cut:]
        if len(self.val_ids) <= context + 1:
            raise ValueError(f"charlm: validation split of {len(self.val_ids)} characters is too short "
                             f"for context {context}")
        self.vocab, self.layers, self.d_model = len(self.chars), layers, d_model
        self.heads, self.context = heads, context
        v, d = self.vocab, d_model
        blocks: list[tuple[str, tuple[int, ...]]] = [("wte", (v, d)), ("wpe", (context, d))]
        for i in range(layers):
            blocks += [(f"h{i}.attn.qkv", (3 * d, d)), (f"h{i}.attn.proj", (d, d)),
                       (f"h{i}.mlp.fc", (4 * d, d)), (f"h{i}.mlp.proj", (d, 4 * d))]
        blocks.append(("lm_head", (v, d)))
        self.layout: Layout = tuple(blocks)
        # NanoChat's rule: name.startswith("transformer.h") and ndim >= 2; embeddings and head: fallback
        self.lmo_mask: tuple[bool, ...] = tuple(name.startswith("h") and len(shape) >= 2 for name, shape in blocks)
        self._train = torch.as_tensor(self.train_ids, device=self.device)
        self._val = torch.as_tensor(self.val_ids, device=self.device)
        rng = np.random.default_rng(12345)  # fixed evaluation windows, independent of any run seed
        self._eval_train = self._windows(self._train, rng.integers(0, len(self.train_ids) - context, eval_windows))
        self._eval_val = self._windows(self._val, rng.integers(0, len(self.val_ids) - context, eval_windows))
        self._mask = torch.ones(context, context, dtype=torch.bool, device=self.device).tril()

    # -- data -----------------------------------------------------------------------------------
    def _windows(self, data: torch.Tensor, starts: np.ndarray) -> torch.Tensor:
        """(len(starts), context + 1) windows of ``data``."""
        offs = torch.as_tensor(np.asarray(starts, np.int64)[:, None] + np.arange(self.context + 1), device=self.device)
        return data[offs]

    def batch_starts(self, seed: int, batch_size: int) -> np.ndarray:
        """Start offsets (in the training split) of the windows picked by ``seed``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return np.random.default_rng(seed).integers(0, len(self.train_ids) - self.context, batch_size)

    # -- model ----------------------------------------------------------------------------------
    def _blocks(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out, off = {}, 0
        for name, shape in self.layout:
            n = math.prod(shape)
            out[name] = w[off:off + n].view(shape)
            off += n
        return out

    def _loss(self, w: torch.Tensor, win: torch.Tensor) -> torch.Tensor:
        """Mean next-character cross-entropy over the windows ``win`` of shape (B, context + 1)."""
        p = self._blocks(w)
        inp, tgt = win[:, :-1], win[:, 1:]
        b, t = inp.shape
        d, h = self.d_model, self.heads

        def norm(z: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(z, (d,))

        z = p["wte"][inp] + p["wpe"][:t]
        for i in range(self.layers):
            q, k, v = F.linear(norm(z), p[f"h{i}.attn.qkv"]).split(d, dim=-1)
            q, k, v = (a.view(b, t, h, d // h).transpose(1, 2) for a in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
            att = att.masked_fill(~self._mask[:t, :t], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            z = z + F.linear(y, p[f"h{i}.attn.proj"])
            z = z + F.linear(F.relu(F.linear(norm(z), p[f"h{i}.mlp.fc"])).square(), p[f"h{i}.mlp.proj"])
        logits = F.linear(norm(z), p["lm_head"])
        return F.cross_entropy(logits.reshape(b * t, -1), tgt.reshape(b * t))

    def _to_tensor(self, x: np.ndarray) -> torch.Tensor:
        if x.shape != (self.dim,):
            raise ValueError(f"parameter vector of shape {x.shape}, expected ({self.dim},)")
        return torch.tensor(np.asarray(x, dtype=np.float32), device=self.device)

    def init_params(self, seed: int) -> np.ndarray:
        """Embeddings ~ N(0, 1); matrices ~ N(0, 1/fan_in); output projections and ``lm_head``
        zero (as NanoChat), so the initial model predicts the uniform distribution."""
        rng = np.random.default_rng(seed)
        parts = []
        for name, shape in self.layout:
            if name in ("wte", "wpe"):
                a = rng.standard_normal(shape)
            elif name.endswith("proj") or name == "lm_head":
                a = np.zeros(shape)
            else:
                a = rng.standard_normal(shape) / math.sqrt(shape[1])
            parts.append(a.ravel())
        return np.concatenate(parts).astype(np.float32)

    def grad(self, x: np.ndarray, seed: int, batch_size: int) -> GradResult:
        """Mean cross-entropy gradient on the ``batch_size`` training windows picked by ``seed``."""
        win = self._windows(self._train, self.batch_starts(seed, batch_size))
        w = self._to_tensor(x).requires_grad_(True)
        loss = self._loss(w, win)
        (g,) = torch.autograd.grad(loss, w)
        return GradResult(grad=g.detach().cpu().numpy().astype(np.float32, copy=False), loss=float(loss.detach()))

    @torch.no_grad()
    def evaluate(self, x: np.ndarray) -> dict[str, float]:
        """Validation ``loss`` and ``train_loss`` (nats per character) on the fixed windows."""
        w = self._to_tensor(x)
        return {"loss": float(self._loss(w, self._eval_val)), "train_loss": float(self._loss(w, self._eval_train))}


def make_charlm(package: str = "json", layers: int = 2, d_model: int = 32, heads: int = 2, context: int = 32,
                val_frac: float = 0.1, eval_windows: int = 64, device: str = "cpu") -> CharLM:
    """Factory for ``--problem charlm`` (see :class:`CharLM`)."""
    return CharLM(package=package, layers=layers, d_model=d_model, heads=heads, context=context,
                  val_frac=val_frac, eval_windows=eval_windows, device=device)
