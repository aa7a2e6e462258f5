"""tests/notebook/browser: what the browser tests share, and the fixture notebook under notebook/,
which the dashboard test opens (not collected as a test itself, e.g. by nbval).

Fixtures (pytest finds them here; test modules do not import this file):
- `chromium`: the Chromium binary at ${POSTTRAIN_CHROMIUM:-/usr/bin/chromium}
  (`scripts/browser-up.sh` installs Debian's package; Playwright's own browser download is not
  used); skips the test when it, or Playwright, is missing.
- `page`: a Playwright page in headless Chromium (a fresh temporary profile per launch),
  1280x1400; the page's console and errors go to tmp_path/console.log.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

collect_ignore_glob = ["*.ipynb"]

CHROMIUM = Path(os.environ.get("POSTTRAIN_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def chromium() -> Path:
    """The browser binary; skips before anything starts when it (or Playwright) is missing."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/browser-up.sh (needs root and apt)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (dev extra)")
    return CHROMIUM


@pytest.fixture
def page(chromium, tmp_path):
    """A Playwright page in headless Chromium; the console goes to tmp_path/console.log."""
    from playwright.sync_api import sync_playwright

    console = open(tmp_path / "console.log", "w")  # noqa: SIM115 (closed after the browser)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.on("console", lambda m: console.write(f"{m.type}: {m.text}\n"))
            page.on("pageerror", lambda e: console.write(f"pageerror: {e}\n"))
            yield page
        finally:
            browser.close()
            console.close()
