"""The dashboard in a real headless Chromium: a real ``serve --dashboard-port 0`` with three real
worker processes, the page read back through its own JS data and its DOM, compared with the
server's /api/state, ``latecomer status`` and the event log; a worker killed with kill -9 shows
as lost. Then ``latecomer dashboard DIR`` of a finished run, in the same browser.

Needs Debian's ``chromium`` and ``chromium-driver`` and selenium (PyPI); without them it skips,
unless LATECOMER_REQUIRE_BROWSER=1 (CI), when it fails. LATECOMER_DASHBOARD_SHOT=PATH saves the
mid-run screenshot there (docs/img/dashboard.png is made so); else it goes to the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.integration.util import read_events, wait_events, wait_line

pytestmark = [pytest.mark.slow, pytest.mark.browser]

REQUIRE = os.environ.get("LATECOMER_REQUIRE_BROWSER") == "1"


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if not _chromium():
        return "no chromium (apt-get install -y chromium chromium-driver)"
    if not _driver():
        return "no chromedriver (apt-get install -y chromium-driver)"
    return None


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _driver() -> str | None:
    return shutil.which("chromedriver") or next((p for p in ("/usr/bin/chromedriver",
                                                              "/usr/lib/chromium/chromedriver") if os.path.exists(p)),
                                                None)


@pytest.fixture
def browser():
    why = _missing()
    if why:
        if REQUIRE:
            pytest.fail(f"LATECOMER_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = _chromium()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1440,1560",
                "--hide-scrollbars", "--force-device-scale-factor=1", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver's explicit path: Selenium Manager downloads nothing.
    driver = webdriver.Chrome(service=Service(executable_path=_driver()), options=opts)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


def poll(cond, timeout: float, what: str, every: float = 0.2):
    """Call ``cond`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def page_state(driver) -> dict:
    return driver.execute_script("return window.latecomerDash && window.latecomerDash.state")


def api_state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/state", timeout=10) as r:
        return json.loads(r.read())


def status_json(endpoint: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "ps", "status", "--server", endpoint, "--json"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def dom_rows(driver) -> dict[str, tuple[str, str]]:
    """worker -> (its row's class, its state cell's text), from the page's worker table."""
    return {r["w"]: (r["cls"], r["state"]) for r in driver.execute_script(
        "return [...document.querySelectorAll('#workers-table tr[data-worker]')].map(tr => ({w: tr.dataset.worker, "
        "cls: tr.className, state: (tr.querySelector('td.state') || {}).textContent}))")}


def wait_log(path, pattern: str, timeout: float) -> re.Match:
    """Poll a log file until a line matches ``pattern``; fail after ``timeout`` seconds."""
    rx = re.compile(pattern)

    def found():
        with open(path, encoding="utf-8", errors="replace") as f:
            return next((m for m in map(rx.search, f) if m), None)
    return poll(found, timeout, f"a line matching {pattern!r} in {path}")


def start_server(procs, tmp_path, *extra: str):
    events, log_path = str(tmp_path / "events.jsonl"), tmp_path / "serve.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: the log of a minute of run never blocks the server
        procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=32",
                    "--algorithm", "delay-adaptive", "--set", "lr=0.05", "--set", "n_workers=3",
                    "--events", events, "--eval-every", "25", "--liveness-timeout", "3",
                    "--dashboard-port", "0", *extra, stdout=log, stderr=subprocess.STDOUT)
    url = wait_log(log_path, r"dashboard on (http://\S+/)", timeout=60).group(1)
    endpoint = wait_log(log_path, r"listening on (tcp://\S+)", timeout=60).group(1)
    return endpoint, url, events


def test_the_live_page_shows_the_run_updates_and_marks_a_killed_worker_lost(procs, tmp_path, browser):
    endpoint, url, events = start_server(procs, tmp_path, "--max-time", "120")
    # w3 holds two jobs (one prefetched): when it is killed it holds at least one, which is lost
    workers = {wid: procs.start("work", "--server", endpoint, "--worker-id", wid, "--delay", delay, "--credit", credit)
               for wid, delay, credit in (("w1", "0.004", "1"), ("w2", "0.012", "1"), ("w3", "0.03", "2"))}
    browser.get(url)
    first = poll(lambda: (s := page_state(browser)) and s["header"]["step"] > 0 and len(s["workers"]["rows"]) == 3
                 and len(s["evaluations"]) >= 2 and s, 60, "the page to show three workers and two evaluations")
    api, st = api_state(url), status_json(endpoint)
    # the page's data are the server's: the page is at most one poll older than /api/state and status
    assert first["header"]["algorithm"] == "delay-adaptive" and first["header"]["problem"] == "quadratic"
    assert first["header"]["step"] <= api["header"]["step"] <= st["info"]["version"]
    assert first["evaluations"] == api["evaluations"][:len(first["evaluations"])]
    assert [e["version"] for e in first["evaluations"]] == sorted({e["version"] for e in first["evaluations"]})
    assert {r[0] for r in first["workers"]["rows"]} == {r[0] for r in st["rows"]} == set(workers)
    assert set(first["figures"]) == {k for k in st["info"] if k.startswith("alg.")} and first["figures"]["alg.lr"]
    applied = sum(n for _, _, n in api["ages"])
    assert 0 < applied <= st["info"]["counter.applied"]
    lanes = first["timeline"]["lanes"]
    assert set(lanes) <= set(workers) and all(j[2] == "a" for js in lanes.values() for j in js)
    # the DOM shows the state the page holds
    shown = browser.execute_script("const s = window.latecomerDash.state; return [s.header.step, "
                                   "document.getElementById('step').textContent]")
    assert str(shown[0]) == shown[1] and browser.execute_script("return window.latecomerDash.drawn") >= 1
    assert set(dom_rows(browser)) == set(workers)
    # it updates while the run goes
    step0 = int(browser.find_element("id", "step").text)
    poll(lambda: int(browser.find_element("id", "step").text) > step0, 30, "the shown step to increase")

    os.kill(workers["w3"].pid, signal.SIGKILL)
    workers["w3"].wait(timeout=10)
    lost = poll(lambda: (s := page_state(browser)) and s["workers"]["gone"].get("w3", {}).get("state") == "lost"
                and s, 30, "the page to mark w3 lost")
    poll(lambda: dom_rows(browser).get("w3", ("", ""))[0] == "lost", 10, "w3's row to be marked lost")
    assert dom_rows(browser)["w3"][1] == "lost"
    ev = wait_events(events, lambda e: [x for x in e if x["ev"] == "left" and x["worker_id"] == "w3"], timeout=20)
    assert ev[0]["reason"] in ("timeout", "unreachable")
    lost_ids = {x["job_id"] for x in read_events(events) if x["ev"] == "lost" and x["worker_id"] == "w3"}
    page_lost = [j for j in lost["timeline"]["lanes"].get("w3", []) if j[2] == "l"]
    assert sum(j[3] for j in page_lost) == len(lost_ids) >= 1, (page_lost, lost_ids)  # its jobs coloured lost
    # the others go on: the page keeps updating; then the picture
    step1 = lost["header"]["step"]
    poll(lambda: page_state(browser)["header"]["step"] > step1 + 50, 30, "the run to go on after the kill")
    browser.execute_script("window.scrollTo(0, 0)")
    shot = os.environ.get("LATECOMER_DASHBOARD_SHOT") or str(tmp_path / "dashboard.png")
    assert browser.save_screenshot(shot)
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    errors = console_errors(browser)
    assert not errors, errors


def test_the_dashboard_of_a_finished_run_shows_its_recorded_evaluations(procs, tmp_path, browser):
    state = tmp_path / "state"
    server = procs.start("serve", "--bind", "tcp://127.0.0.1:0", "--problem", "quadratic", "--problem-opt", "d=16",
                         "--algorithm", "asgd", "--set", "lr=0.05", "--state", str(state), "--max-steps", "200",
                         "--eval-every", "25", "--no-supervise", stderr=subprocess.STDOUT)
    endpoint = wait_line(server, r"listening on (tcp://\S+)", timeout=60).group(1)
    procs.start("work", "--server", endpoint, "--worker-id", "a", "--delay", "0.002")
    procs.start("work", "--server", endpoint, "--worker-id", "b", "--delay", "0.005")
    assert server.wait(timeout=60) == 0
    with open(state / "summary.json", encoding="utf-8") as f:
        recorded = json.load(f)["evaluations"]
    assert len(recorded) >= 8 and recorded[-1]["version"] == 200
    dash = procs.start("dashboard", str(state), "--port", "0")
    url = wait_line(dash, r"on (http://\S+/)", timeout=30).group(1)
    browser.get(url)
    shown = poll(lambda: page_state(browser), 30, "the page's first state")
    assert shown["evaluations"] == recorded  # every recorded evaluation, each field equal
    assert shown["header"]["step"] == 200 and shown["header"]["finished"] is True
    assert shown["header"]["algorithm"] == "asgd" and shown["header"]["loss"] == recorded[-1]["loss"]
    applied = sum(e["ev"] == "applied" for e in read_events(str(state / "events.jsonl")))
    assert sum(n for _, _, n in shown["ages"]) == applied
    assert re.fullmatch(r"\d+", browser.find_element("id", "step").text) and browser.find_element("id", "step").text \
        == "200"
    # the page's number format: no digit of an integer part dropped, no exponent below a million
    assert browser.execute_script("return [fmt(480.2, 3), fmt(0.012345), fmt(2.5), fmt(1234.5, 3), fmt(100.0), "
                                  "fmt(0.5), fmt(null)]") == ["480", "0.01235", "2.5", "1235", "100", "0.5", "\u2013"]
    errors = console_errors(browser)
    assert not errors, errors
    dash.send_signal(signal.SIGINT)
    assert dash.wait(timeout=15) == 0
