"""Updates/s of every backend against d, one panel per worker count, from a bench JSON file.

    python -m benchmarks.plot benchmarks/RESULTS.json docs/img/bench.png
"""

from __future__ import annotations

import json
import sys

STYLE = {  # backend -> (colour, marker, line style)
    "raw-zmq": ("black", "o", "--"),
    "latecomer": ("tab:blue", "o", "-"),
    "latecomer-relay": ("tab:blue", "o", ":"),
    "latecomer-shm": ("tab:green", "s", "-"),
    "latecomer-c4": ("tab:cyan", "^", "-"),
    "latecomer-bf16": ("tab:purple", "v", ":"),
    "latecomer-curve": ("tab:gray", "D", "-"),
    "latecomer-curve-gcm": ("tab:gray", "D", ":"),
    "latecomer-curvezmq": ("tab:brown", "d", ":"),
    "torch-rpc": ("tab:orange", "x", "-."),
    "ray": ("tab:red", "+", "-."),
}


def plot(rows: list[dict], out: str, title: str = "", cipher_gbps: dict | None = None) -> None:
    """``cipher_gbps`` (construction -> GB/s per core): with it, each panel holding secure rows
    shows the updates/s at which their payload would move at each cipher's one-core limit
    (XSalsa20-Poly1305: CurveZMQ's; AES-256-GCM through OpenSSL and AEGIS-256X4 through libaegis:
    the sealed data connection's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("skipped") and r["backend"] in STYLE and r["updates_per_s"] > 0]
    workers = sorted({r["workers"] for r in ok})
    fig, axes = plt.subplots(1, len(workers), figsize=(4.6 * len(workers), 4.2), sharey=True, squeeze=False)
    for ax, w in zip(axes[0], workers, strict=True):
        for b, (c, m, ls) in STYLE.items():
            pts = sorted((r["d"], r["updates_per_s"]) for r in ok if r["backend"] == b and r["workers"] == w)
            if pts:
                ax.plot(*zip(*pts, strict=True), color=c, marker=m, linestyle=ls, label=b)
        secure = sorted((r["d"], r["bytes_per_update"]) for r in ok
                        if r["backend"] == "latecomer-curve" and r["workers"] == w)
        for name, colour, label in (("xsalsa20poly1305", "tab:brown", "XSalsa20 limit, 1 core"),
                                    ("aes256gcm-openssl", "tab:gray", "AES-GCM limit, 1 core"),
                                    ("aegis256x4", "tab:olive", "AEGIS-256X4 limit, 1 core")):
            gbps = (cipher_gbps or {}).get(name)
            if gbps and secure:
                ax.plot([d for d, _ in secure], [gbps * 1e9 / b for _, b in secure], color=colour, linestyle="-",
                        alpha=0.35, linewidth=3, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("d (float32 parameters)")
        ax.set_title(f"{w} worker{'s' if w > 1 else ''}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("applied updates / s")
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    order = [b for b in STYLE if b in handles] + [k for k in handles if k not in STYLE]
    fig.legend([handles[b] for b in order], order, fontsize=8, loc="center right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.87, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python -m benchmarks.plot RESULTS.json OUT.png")
    with open(argv[0], encoding="utf-8") as f:
        data = json.load(f)
    plot(data["rows"], argv[1], "latecomer bench: same workload (x -= lr*g), loopback, 2 cores",
         cipher_gbps=data.get("cipher_gbps"))


if __name__ == "__main__":
    main(sys.argv[1:])
