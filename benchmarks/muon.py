"""The Muon server step against ``torch.optim.Muon``'s on the same blocks (issue 24).

For each layout (built the way ``TorchProblem`` builds one: the model's trainable parameters in
``named_parameters()`` order, flagged for Newton–Schulz by ``default_lmo_rule``, on the meta device
so that nothing is allocated for the model itself) and in one process, it times:

* one server step of ``ringmaster-lmo`` with ``lmo=muon``: ``alg.apply(state, [result])`` on the
  flat float32 vector, as the server's core calls it (momentum, Nesterov blend, Newton–Schulz of
  every flagged block, the momentum fallback of the others, the new iterate), for each
  ``ns_dtype`` asked for (``--dtypes``; the code before ``ns_dtype`` existed runs its one form);
* ``torch.optim.Muon.step()`` over the 2-D views (out, in·k·k) of the same flagged blocks, with
  the same settings (5 NS steps of Keller Jordan's triple, Nesterov, momentum 0.95 = 1 − alpha,
  lr 0.04 scaled by √max(1, rows/cols), no weight decay); latecomer runs ``ns=classic`` to match
  (Polar Express costs the same: same products, other coefficients). torch.optim.Muon runs its
  iteration in bfloat16;
* ``torch.optim.SGD(momentum=0.95, nesterov=True).step()`` over the other blocks, which a torch
  user would step with another optimizer (latecomer's step does them too: the ``torch Muon+SGD``
  column is the whole of d);
* ``ringmaster-lmo`` with ``lmo=sign`` and ``lmo=l2``, and ``asgd``, on the same d (reference);
* Newton–Schulz alone over the flagged blocks (``newton_schulz`` in each dtype), to split the step
  into NS and the passes over d.

Repetitions are round-robin over the variants (a load change on a shared machine touches all of
them alike); the figure is the median, in milliseconds. ``--threads`` (default 1) sets both torch's
intra-op threads and the BLAS threads (threadpoolctl): 1 is what the server gives torch
(ps/drivers/server.py ``deterministic_oracle``) and the only setting that is stable on a shared 2-core
machine, where multi-threaded BLAS waits on a busy core.

``--json`` writes the figures; ``--before FILE`` reads such a file, written by this benchmark on an
earlier commit, for the *before* columns of ``--out`` (a Markdown report, benchmarks/RESULTS-muon.md).

    python -m benchmarks.muon [--quick] [--layouts gpt2:384:6,gpt2:768:4,resnet18:64] [--reps 5]
        [--dtypes auto,bfloat16,float64] [--threads 1] [--json F] [--before F] [--out F]

Layouts: ``gpt2:D:L`` (GPT-2-like: d_model D, L layers, vocabulary 8192 as NanoChat's, context
1024, head tied to the token embedding) and ``resnet18:W`` (ResNet-18-like, base width W, 1000
classes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Callable

import numpy as np
import torch
from torch import nn

from algorithms import build
from algorithms.base import Result, bind_layout
from algorithms.lmo import CLASSIC_NS5, newton_schulz, ns_dtype_for
from problems.torch_problem import default_lmo_rule
from protocol.messages import JobKind

LR, ALPHA = 0.04, 0.05  # momentum 0.95 in torch.optim.Muon's terms
DEFAULT_LAYOUTS = "gpt2:384:6,gpt2:768:4,resnet18:64"
QUICK_LAYOUTS = "gpt2:256:2,resnet18:16"


# ---- the layouts, as TorchProblem builds them


class _GPT2Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)  # qkv, output projection
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class GPT2Like(nn.Module):
    """Parameters of a GPT-2 (nn.Linear's (out, in) weights), the head tied to the token embedding."""

    def __init__(self, d: int, layers: int, vocab: int = 8192, ctx: int = 1024) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(_GPT2Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one block in the layout, an embedding's


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)


class ResNet18Like(nn.Module):
    """Parameters of torchvision's ResNet-18 (base width w), in its order."""

    def __init__(self, w: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w)
        widths, cin = (w, 2 * w, 4 * w, 8 * w), w
        for i, cout in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(_Basic(cin, cout, stride), _Basic(cout, cout, 1)))
            cin = cout
        self.fc = nn.Linear(8 * w, classes)


@dataclasses.dataclass
class Layout:
    name: str
    layout: tuple
    mask: tuple[bool, ...]

    @property
    def d(self) -> int:
        return sum(math.prod(s) for _, s in self.layout)

    def matrices(self) -> list[tuple[int, int]]:
        """The (rows, rest) views of the flagged blocks, as muon_direction sees them."""
        return [(s[0], math.prod(s) // s[0]) for (_, s), m in zip(self.layout, self.mask, strict=True) if m]


def make_layout(spec: str) -> Layout:
    kind, *args = spec.split(":")
    with torch.device("meta"):
        if kind == "gpt2":
            d, layers = (int(a) for a in args)
            model: nn.Module = GPT2Like(d, layers)
        elif kind == "resnet18":
            model = ResNet18Like(int(args[0]) if args else 64)
        else:
            raise SystemExit(f"unknown layout {spec!r} (gpt2:D:L or resnet18:W)")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rule = default_lmo_rule(model)
    return Layout(spec, tuple((n, tuple(p.shape)) for n, p in params), tuple(bool(rule(n, p)) for n, p in params))


# ---- the variants


def has_ns_dtype() -> bool:
    return any(f.name == "ns_dtype" for f in dataclasses.fields(build("ringmaster-lmo", {})))


def latecomer_step(name: str, hyper: dict, lay: Layout, x0: np.ndarray, grads: list[np.ndarray],
                   mask: tuple[bool, ...] | None = None) -> Callable:
    alg = bind_layout(build(name, hyper), lay.layout, lay.mask if mask is None else mask)
    box = [alg.init(x0, seed=0)[0]]
    count = [0]

    def step() -> None:
        state = box[0]
        i = count[0]
        count[0] += 1
        r = Result(job_id=i, worker_id="w", created_at=state.version, kind=JobKind.GRAD,
                   iterate_ids=(state.version,), grads=(grads[i % len(grads)],))
        box[0], outcome = alg.apply(state, [r])
        assert outcome.applied == (i,)

    return step


def torch_steps(lay: Layout, x0: np.ndarray, grads: list[np.ndarray]) -> tuple[Callable, Callable]:
    """torch.optim.Muon over the flagged blocks' 2-D views; SGD with Nesterov momentum over the rest."""
    muon_p, rest_p, muon_g, rest_g = [], [], [], []
    off = 0
    for (_, shape), flagged in zip(lay.layout, lay.mask, strict=True):
        size = math.prod(shape)
        view = (shape[0], size // shape[0]) if flagged else (size,)
        p = nn.Parameter(torch.from_numpy(x0[off:off + size].copy()).reshape(view))
        gs = [torch.from_numpy(g[off:off + size].copy()).reshape(view) for g in grads]
        (muon_p if flagged else rest_p).append(p)
        (muon_g if flagged else rest_g).append(gs)
        off += size
    muon = torch.optim.Muon(muon_p, lr=LR, weight_decay=0.0, momentum=1 - ALPHA, nesterov=True,
                            ns_coefficients=CLASSIC_NS5[0], eps=1e-7, ns_steps=5, adjust_lr_fn="original")
    sgd = torch.optim.SGD(rest_p, lr=LR, momentum=1 - ALPHA, nesterov=True)

    def stepper(opt: torch.optim.Optimizer, params: list, gs: list) -> Callable:
        count = [0]

        def step() -> None:
            i = count[0]
            count[0] += 1
            for p, g in zip(params, gs, strict=True):
                p.grad = g[i % len(g)]
            opt.step()

        return step

    return stepper(muon, muon_p, muon_g), stepper(sgd, rest_p, rest_g)


def ns_alone(lay: Layout, u: np.ndarray, dtype: str | None) -> Callable:
    mats, off = [], 0
    for (_, shape), flagged in zip(lay.layout, lay.mask, strict=True):
        size = math.prod(shape)
        if flagged:
            mats.append(u[off:off + size].reshape(shape[0], size // shape[0]))
        off += size

    def run() -> None:
        for m in mats:  # "auto": each block's own arithmetic, as the step chooses it
            kw = {} if dtype is None else {"dtype": ns_dtype_for(dtype, m.dtype, m.shape)}
            newton_schulz(m, CLASSIC_NS5, 5, **kw)

    return run


def measure(variants: dict[str, Callable], reps: int, warm: int = 2) -> dict[str, float]:
    for f in variants.values():
        for _ in range(warm):
            f()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for k, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def run_layout(lay: Layout, dtypes: list[str], reps: int, others: bool) -> dict:
    rng = np.random.default_rng(0)
    x0 = (0.02 * rng.standard_normal(lay.d)).astype(np.float32)
    grads = [rng.standard_normal(lay.d).astype(np.float32) for _ in range(2)]
    base = {"lr": LR, "alpha": ALPHA, "ns": "classic", "ns_steps": 5, "nesterov": True}
    variants: dict[str, Callable] = {}
    new = has_ns_dtype()
    for dt in (dtypes if new else ["float64"]):
        hyper = {**base, "lmo": "muon", **({"ns_dtype": dt} if new else {})}
        variants[f"muon {dt}"] = latecomer_step("ringmaster-lmo", hyper, lay, x0, grads)
    # the same step with every block on the momentum fallback: its passes over d without Newton–Schulz
    variants["no NS blocks"] = latecomer_step("ringmaster-lmo", {**base, "lmo": "muon"}, lay, x0, grads,
                                            (False,) * len(lay.layout))
    variants["torch Muon"], variants["torch SGD rest"] = torch_steps(lay, x0, grads)
    if others:
        for lmo in ("sign", "l2"):
            variants[f"lmo {lmo}"] = latecomer_step("ringmaster-lmo", {**base, "lmo": lmo}, lay, x0, grads)
        variants["asgd"] = latecomer_step("asgd", {"lr": LR}, lay, x0, grads)
    for dt in (dtypes if new else [None]):
        variants[f"NS alone {'float64' if dt is None else dt}"] = ns_alone(lay, grads[0], dt)
    ms = measure(variants, reps)
    return {"d": lay.d, "blocks": len(lay.layout), "ns_blocks": sum(lay.mask), "matrices": lay.matrices(),
            "ms": ms}


# ---- the report


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} logical cores; Python {platform.python_version()}, numpy {np.__version__}, "
            f"torch {torch.__version__}; load average at start {load:.2f}")


def _fmt(v: float | None) -> str:
    return "–" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def report(res: dict, before: dict | None) -> str:
    lines = [
        "# The Muon server step against torch.optim.Muon (issue 24)", "",
        f"`python -m benchmarks.muon {res['argv']}` on {res['date']}.", "",
        f"Machine: {res['machine']}. Threads: {res['threads']} (torch and BLAS). Median of {res['reps']} "
        "round-robin repetitions, milliseconds per step, float32 vectors.",
    ]
    if before:
        lines += ["", f"*Before*: the same benchmark on {before['commit']} ({before['date']}, load average "
                  f"{before['machine'].rsplit(' ', 1)[-1]}), whose Newton–Schulz ran in float64 only."]
    lines += [
        "", "*latecomer*: `ringmaster-lmo lmo=muon ns=classic` (Nesterov, alpha 0.05), one `apply` of one reply on "
        "the whole flat vector; *torch Muon*: `torch.optim.Muon.step()` on the 2-D views of the same Newton–Schulz "
        "blocks (bfloat16 iteration, Keller Jordan's triple, 5 steps, momentum 0.95, Nesterov); *+SGD*: with "
        "`torch.optim.SGD(momentum=0.95, nesterov=True).step()` over the other blocks (what latecomer's step "
        "also covers). Ratio: latecomer / torch Muon (the issue's target: at most 1.5x).", "",
        "| layout | d | NS blocks / blocks | torch Muon | torch Muon+SGD | before: latecomer | before: torch Muon "
        "| before: ratio | auto (default) | ratio | float32 | ratio | bfloat16 | ratio | float64 | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["layouts"].items():
        ms = r["ms"]
        torch_ms = ms["torch Muon"]
        b = (before or {}).get("layouts", {}).get(name, {}).get("ms", {})
        b_lat, b_torch = b.get("muon float64"), b.get("torch Muon")
        row = [name, f"{r['d']:,}", f"{r['ns_blocks']} / {r['blocks']}", _fmt(torch_ms),
               _fmt(torch_ms + ms["torch SGD rest"]), _fmt(b_lat), _fmt(b_torch), _ratio(b_lat, b_torch)]
        for dt in ("auto", "float32", "bfloat16", "float64"):
            v = ms.get(f"muon {dt}")
            row += [_fmt(v), _ratio(v, torch_ms)]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "", "The other steps on the same d (ms; *x asgd*: against this run's asgd step):", "",
        "| layout | asgd | lmo sign | x asgd | lmo l2 | x asgd | before: asgd | before: sign | before: l2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["layouts"].items():
        ms = r["ms"]
        if "asgd" not in ms:
            continue
        b = (before or {}).get("layouts", {}).get(name, {}).get("ms", {})
        cells = [name, _fmt(ms["asgd"]), _fmt(ms["lmo sign"]), _ratio(ms["lmo sign"], ms["asgd"]), _fmt(ms["lmo l2"]),
                 _ratio(ms["lmo l2"], ms["asgd"]), _fmt(b.get("asgd")), _fmt(b.get("lmo sign")), _fmt(b.get("lmo l2"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "", "Where the Muon step goes: *NS alone*, `newton_schulz` of each flagged block's 2-D view (no step); "
        "*no NS*: the same step with every block on the momentum fallback (`lmo_mask` all False), i.e. its "
        "passes over d (momentum, Nesterov blend, direction, new iterate) without Newton–Schulz:", "",
        "| layout | dtype | step | NS alone | before: step | before: NS alone |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res["layouts"].items():
        ms = r["ms"]
        b = (before or {}).get("layouts", {}).get(name, {}).get("ms", {})
        for dt in ("auto", "float32", "bfloat16", "float64"):
            step, ns = ms.get(f"muon {dt}"), ms.get(f"NS alone {dt}")
            if step is None or ns is None:
                continue
            bs, bn = (b.get("muon float64"), b.get("NS alone float64")) if dt == "float64" else (None, None)
            lines.append("| " + " | ".join([name, dt, _fmt(step), _fmt(ns), _fmt(bs), _fmt(bn)]) + " |")
    lines += ["", "| layout | no NS (passes over d) | asgd | x asgd | before: no NS | before: x asgd |",
              "|---|---|---|---|---|---|"]
    for name, r in res["layouts"].items():
        ms = r["ms"]
        b = (before or {}).get("layouts", {}).get(name, {}).get("ms", {})
        if "no NS blocks" in ms and "asgd" in ms:
            lines.append("| " + " | ".join([name, _fmt(ms["no NS blocks"]), _fmt(ms["asgd"]),
                                            _ratio(ms["no NS blocks"], ms["asgd"]), _fmt(b.get("no NS blocks")),
                                            _ratio(b.get("no NS blocks"), b.get("asgd"))]) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.muon", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=None, help=f"comma-separated (default {DEFAULT_LAYOUTS})")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5, 3 with --quick)")
    ap.add_argument("--dtypes", default="auto,float32,bfloat16",
                    help="ns_dtype values to time (auto,float32,float64,bfloat16)")
    ap.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (default 1)")
    ap.add_argument("--quick", action="store_true", help=f"small layouts ({QUICK_LAYOUTS}), 3 repetitions")
    ap.add_argument("--no-others", action="store_true", help="skip the sign, l2 and asgd steps")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--before", help="figures of an earlier commit (a --json file) for the report's before columns")
    ap.add_argument("--commit", default="", help="what --json records as the commit measured")
    ap.add_argument("--out", help="write the Markdown report here (e.g. benchmarks/RESULTS-muon.md)")
    args = ap.parse_args(argv)
    layouts = args.layouts or (QUICK_LAYOUTS if args.quick else DEFAULT_LAYOUTS)
    reps = args.reps or (3 if args.quick else 5)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    torch.set_num_threads(args.threads)
    try:
        from threadpoolctl import threadpool_limits
        limits = threadpool_limits(args.threads)
    except ImportError:  # a dependency of scikit-learn; without it BLAS keeps its own thread count
        limits = nullcontext()
    res = {"argv": " ".join(argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
           "machine": machine(), "threads": args.threads, "reps": reps, "commit": args.commit, "layouts": {}}
    with limits:
        for spec in layouts.split(","):
            lay = make_layout(spec.strip())
            t0 = time.perf_counter()
            r = run_layout(lay, dtypes, reps, not args.no_others)
            res["layouts"][lay.name] = r
            ms = r["ms"]
            took = time.perf_counter() - t0
            print(f"{lay.name}: d={r['d']:,}, {r['ns_blocks']}/{r['blocks']} NS blocks ({took:.0f} s)")
            for k, v in ms.items():
                extra = f"  {v / ms['torch Muon']:.2f}x torch Muon" if k.startswith("muon ") else ""
                print(f"  {k:<20} {v:10.2f} ms{extra}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    if args.out:
        before = None
        if args.before:
            with open(args.before, encoding="utf-8") as f:
                before = json.load(f)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report(res, before))


if __name__ == "__main__":
    main()
