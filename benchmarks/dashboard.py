"""How fast the dashboard loads and updates against a local node, in a real browser.

    python benchmarks/dashboard.py                    # a 3-node demo swarm, 10 loads, 10 updates
    python benchmarks/dashboard.py --json
    python benchmarks/dashboard.py --screenshot docs/dashboard.png --rounds 40

Starts ``p2ploco demo --status-port 0`` (a bootstrap peer and 3 nodes training on loopback; node0 serves the page)
and ``p2ploco dashboard --from`` node0 (the same page served by a second process that reads node0), then opens
each page in headless Chromium (``browser.py``) ``--loads`` times in a fresh tab. The page measures itself
(``window.p2plocoDashboard.timings``, ``performance.now()``):

- **first load**: from the navigation's start to the end of the first full render: the HTML, its scripts and
  styles, the three documents (``/api/v1/peers``, ``/api/v1/rounds``, ``/api/v1/run``), charts and tables drawn;
- **update**: one refresh every 2 s, from its start to the end of its render: the peers and the rounds after the
  newest held, charts and tables drawn again.

The swarm trains all along (on the same cores as the browser). Medians and maxima over the loads and the updates
of every load after its first. ``--screenshot`` saves the page (node0's) once ``--rounds`` rounds are drawn.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from browser import Browser, find_browser

REPO = Path(__file__).resolve().parents[1]
URL = re.compile(r"(http://\S+/)")
STARTUP_SECONDS = 120


def start(argv: list[str], pattern: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A p2ploco process whose output goes to ``log``, and the URL it prints on its line matching ``pattern``."""
    process = subprocess.Popen([sys.executable, "-m", "p2ploco.cli", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = log.open("a")
    for line in process.stdout:
        out.write(line)
        if pattern in line and (match := URL.search(line)):
            # the rest to the log as it comes: a full pipe would stop the demo's round lines, and the demo with them
            threading.Thread(target=lambda: (out.writelines(process.stdout), out.close()), daemon=True).start()
            return process, match.group(1)
    out.close()
    raise SystemExit(f"{' '.join(argv[:2])} ended before it served a page (see {log})")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)  # the demo stops its nodes, as on Ctrl-C
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def measure(browser: Browser, url: str, loads: int, updates: int, tab: str) -> dict:
    """Timings of ``loads`` loads of the page at ``url``, each in a new tab (``tab`` "new": a renderer process
    started for it) or again in one tab ("same"), and of the first ``updates`` updates after each."""
    first, each = [], []
    ready = (f"window.p2plocoDashboard && p2plocoDashboard.timings.updates.length >= {updates}"
             f" && p2plocoDashboard.timings")
    if tab == "same":
        browser.open(url)
        browser.wait_for(ready, 60 + 3 * updates)
    for _ in range(loads):
        if tab == "new":
            browser.open(url)
        else:
            browser.send("Page.navigate", {"url": url})  # answered once the new page is committed
        timings = browser.wait_for(ready, 60 + 3 * updates)
        first.append(timings["firstLoad"])
        each.extend(timings["updates"])
        if tab == "new":
            browser.close_page()
    if tab == "same":
        browser.close_page()
    return {"first_load_ms_median": statistics.median(first), "first_load_ms_max": max(first),
            "update_ms_median": statistics.median(each), "update_ms_max": max(each), "loads": loads,
            "updates": len(each)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1, help="Nodes of the demo swarm (node0 serves the page).")
    parser.add_argument("--loads", type=int, default=10, help="Fresh page loads per server.")
    parser.add_argument("--updates", type=int, default=1, help="Updates timed per load (one every 2 s).")
    parser.add_argument("--screenshot", type=Path, help="Save node0's page here as a PNG.")
    parser.add_argument("--rounds", type=int, default=12, help="Rounds drawn before the screenshot.")
    parser.add_argument("--json", action="store_true", help="Print the rows as JSON.")
    args = parser.parse_args()
    executable = find_browser()
    if executable is None:
        raise SystemExit("no Chromium here: apt-get install chromium")
    workdir = Path(tempfile.mkdtemp(prefix="p2ploco-dashboard-"))
    log = workdir / "processes.log"
    processes = []
    try:
        demo, page = start(["demo", "--replicas", str(args.replicas), "--rounds", "100000", "--status-port", "0",
                            "--workdir", str(workdir / "demo")], "dashboard:", log)
        processes.append(demo)
        node = page.removeprefix("http://").rstrip("/")
        relay, relayed = start(["dashboard", "--from", node, "--port", "0"], "dashboard of run", log)
        processes.append(relay)
        rows = []
        with Browser(executable) as browser:
            if args.screenshot:
                browser.open(page)
                browser.wait_for(f"window.p2plocoDashboard && p2plocoDashboard.rounds.length >= {args.rounds}",
                                 30 + 5 * args.rounds)
                browser.screenshot(args.screenshot)
                browser.close_page()
            for where, url in (("node0's status port", page), ("p2ploco dashboard --from node0", relayed)):
                for tab in ("new", "same"):
                    rows.append({"served_by": where, "tab": tab,
                                 **measure(browser, url, args.loads, args.updates, tab)})
    finally:
        for process in reversed(processes):
            stop(process)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'served by':32} {'tab':>4} {'loads':>5} {'first load ms (median / max)':>29} {'updates':>7} "
          f"{'update ms (median / max)':>25}")
    for r in rows:
        print(f"{r['served_by']:32} {r['tab']:>4} {r['loads']:>5} {r['first_load_ms_median']:>19.0f} / "
              f"{r['first_load_ms_max']:<7.0f} {r['updates']:>7} {r['update_ms_median']:>15.0f} / "
              f"{r['update_ms_max']:<7.0f}")
    if args.screenshot:
        print(f"screenshot: {args.screenshot}")


if __name__ == "__main__":
    main()
