"""The README's dashboard picture (docs/img/dashboard.png): a real ``serve --dashboard-port 0``
on digits with four workers of different speeds, one killed with SIGKILL part way (its lane and
row turn lost), and a headless Chromium's screenshot of the page mid-run.

    python -m benchmarks.dashboard_shot [--out docs/img/dashboard.png] [--seconds 25]

Needs Debian's chromium and chromium-driver and selenium (as tests/integration/test_dashboard_browser.py).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ps.ops.children import reap, spawn


def _wait_log(path: str, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, encoding="utf-8", errors="replace") as f:
            m = re.search(pattern, f.read())
        if m:
            return m.group(1)
        time.sleep(0.2)
    raise SystemExit(f"no {pattern!r} in {path} after {timeout} s")


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("google-chrome") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1440,1420",
                "--hide-scrollbars", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                            options=opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/img/dashboard.png")
    ap.add_argument("--seconds", type=float, default=25.0, help="Run time before the picture.")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="latecomer-shot-")
    log_path = os.path.join(tmp, "serve.log")
    procs: list[subprocess.Popen] = []
    with open(log_path, "wb") as log:
        procs.append(spawn("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "digits", "--algorithm",
                           "delay-adaptive", "--set", "lr=0.3", "--set", "n_workers=4", "--eval-every", "50",
                           "--max-time", str(args.seconds + 60), "--liveness-timeout", "3", "--dashboard-port", "0",
                           stdout=log, stderr=subprocess.STDOUT))
    driver = None
    try:
        url = _wait_log(log_path, r"dashboard on (http://\S+/)", 60)
        endpoint = _wait_log(log_path, r"listening on (tcp://\S+)", 60)
        workers = {wid: spawn("work", "--server", endpoint, "--worker-id", wid, "--delay", d)
                   for wid, d in (("gpu-box", "0"), ("laptop", "0.004"), ("old-desktop", "0.012"),
                                  ("spot-vm", "0.006"))}
        procs += workers.values()
        driver = _browser()
        driver.get(url)
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            if time.monotonic() - t0 > args.seconds * 0.7 and workers["spot-vm"].poll() is None:
                os.kill(workers["spot-vm"].pid, signal.SIGKILL)  # a preempted machine
            time.sleep(0.5)
        driver.save_screenshot(args.out)
        print(f"{args.out} written ({url})")
    finally:
        if driver is not None:
            driver.quit()
        reap(procs, 10.0)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
