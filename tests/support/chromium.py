"""Opening an HTML file in headless Chromium, as a reader's browser would: a screenshot,
the rendered DOM, and the page's console messages.

    browser = find_chromium()               # the path, or pytest.skip saying how to install it
    shot = screenshot(browser, html, png)   # Rendered(stdout, console): the PNG written at `png`
    dom = dump_dom(browser, html)           # Rendered(stdout: the DOM after rendering, console)

Chromium logs every console message of a page on stderr with --enable-logging=stderr, all
at level INFO ("...:INFO:CONSOLE:1] "Uncaught ReferenceError: ...", source: file://...");
the level cannot tell an error from a console.log, so `console` holds every such line, and a
page without script (the HTML report) must have none. tests/engine/monitor/test_report.py
puts a deliberately broken page through the same check, to show it catches one.

Nothing is fetched: the flags turn off Chromium's own background traffic (updates, sync,
QUIC), and each call has a fresh profile folder.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import pytest

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
TIMEOUT_S = 120
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0")


@dataclass
class Rendered:
    stdout: str
    console: list[str]      # the page's console messages (Chromium's CONSOLE log lines)


def find_chromium() -> str:
    """Chromium's path, or skip the test saying how to get it."""
    for path in CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    pytest.skip("headless Chromium is not installed (the HTML report is checked in a real browser); install it "
                "with `apt-get install -y chromium` (as root; tests/run_all.sh and .ci/run do it)")


def _run(browser: str, html_path: str, *extra: str) -> Rendered:
    with tempfile.TemporaryDirectory(prefix="ringpipe-chromium-") as profile:
        cmd = [browser, *FLAGS, f"--user-data-dir={profile}", *extra, "file://" + os.path.abspath(html_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise AssertionError(f"chromium exited {done.returncode}: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return Rendered(done.stdout, console)


def screenshot(browser: str, html_path: str, png_path: str, width: int = 1280, height: int = 4000) -> Rendered:
    """The page drawn into `png_path` at width x height pixels."""
    return _run(browser, html_path, f"--screenshot={os.path.abspath(png_path)}", f"--window-size={width},{height}")


def dump_dom(browser: str, html_path: str) -> Rendered:
    """The page's DOM after the browser parsed and rendered it (stdout)."""
    return _run(browser, html_path, "--dump-dom")
