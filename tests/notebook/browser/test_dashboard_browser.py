"""The live dashboard in a real browser: JupyterLab + headless Chromium (Playwright).

The unit tests (tests/notebook/test_dashboard.py) check the widget *state* in Python. This test
checks what a researcher sees: it starts JupyterLab from this venv on a temporary copy of
`notebook/`, opens
`dashboard_live.ipynb` (a tiny seeded SFT run with `LiveDashboard(min_interval_s=0.2)`) in
headless Chromium, runs all cells from the Run menu, and checks in the page that
    - the plot <img> changed its `src` while the run went (live redraws, not only a final one)
      and rendered (naturalWidth > 0),
    - the progress bar (`.widget-hprogress .progress-bar`, ipywidgets 8) reached 100%,
    - the header shows the final step "step 30/30".
A page-side sampler (every 50 ms) records header, bar width and image src while the run goes.

Needs Chromium (the `chromium` and `page` fixtures of conftest.py) and skips without it. Takes
~15-25 s: JupyterLab ~2.5 s, page + kernel ~3 s, imports in the kernel ~3-5 s, the run ~4 s.

Output in the test's tmp_path: `dashboard.png` (the page, also on failure),
`dashboard-widget.png` (the dashboard alone), `jupyterlab.log`, `console.log` (the page's
console) and `samples.json` (what the sampler saw). With POSTTRAIN_BROWSER_ARTIFACTS=1 the
screenshots are also copied to tests/notebook/browser/output/ (git-ignored).
Teardown (also on failure) deletes the kernel sessions through the REST API, stops the
JupyterLab process this test started, and then the kernel by the PID the notebook wrote, if it is
still alive.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

HERE = Path(__file__).parent
NOTEBOOK_DIR = HERE / "notebook"
NOTEBOOK = "dashboard_live.ipynb"
STEPS = 30  # trainer.fit(STEPS) in the notebook
SERVER_START_S = 60  # JupyterLab answers in ~2.5 s when the machine is quiet
KERNEL_READY_S = 90  # page load, extensions, kernel start
RUN_S = 180  # imports + 30 steps in the kernel

# The dashboard's VBox is the one that holds the progress bar; its first HTML child is the header.
SAMPLER_JS = """() => {
  window.__dashSamples = [];
  window.__dashSampler = setInterval(() => {
    const bar = document.querySelector('.widget-hprogress .progress-bar');
    if (!bar) return;
    const box = bar.closest('.widget-vbox');
    const header = box.querySelector('.widget-html-content');
    const img = box.querySelector('img.widget-image');
    window.__dashSamples.push({
      t: performance.now(), header: header ? header.textContent : null,
      width: bar.style.width, src: img ? img.getAttribute('src') : null});
  }, 50);
}"""

DASHBOARD_JS = """() => {
  const bar = document.querySelector('.widget-hprogress .progress-bar');
  const box = bar.closest('.widget-vbox');
  const img = box.querySelector('img.widget-image');
  return {
    header: box.querySelector('.widget-html-content').textContent,
    width: bar.style.width, barClass: bar.className,
    barPx: bar.getBoundingClientRect().width,
    trackPx: bar.parentElement.getBoundingClientRect().width,
    src: img.getAttribute('src'), naturalWidth: img.naturalWidth,
    naturalHeight: img.naturalHeight, shownPx: img.getBoundingClientRect().width,
    complete: img.complete};
}"""


@pytest.fixture(scope="module", autouse=True)
def needs_chromium(chromium):
    """Skip before JupyterLab starts when the browser (or Playwright) is missing (conftest.py)."""


# ------------------------------------------------------------------ JupyterLab


@dataclass
class Lab:
    """A JupyterLab server started by this test: base URL, token, served folder, log file."""

    url: str
    token: str
    root: Path
    log: Path

    def api(self, method: str, path: str) -> object:
        request = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with _LOCAL.open(request, timeout=10) as answer:
            body = answer.read()
        return json.loads(body) if body else None

    def delete_sessions(self) -> None:
        """Shut down every kernel session (and any kernel without one): a closed browser
        leaves its kernel running."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM the process we started (JupyterLab then shuts its kernels down), SIGKILL if it
    does not exit in time."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)


def _stop_kernel(pid_file: Path) -> None:
    """Kill the notebook's kernel by the PID it wrote, if it outlived the server (checked to be
    an ipykernel process, so a recycled PID is left alone)."""
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if b"ipykernel" in cmdline:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def jupyter_lab(tmp_path) -> Iterator[Lab]:
    """JupyterLab from this venv on a copy of notebook/, with its config, data, runtime and
    IPython dirs under tmp_path (no ~/.jupyter state is read or written)."""
    root = tmp_path / "root"
    shutil.copytree(NOTEBOOK_DIR, root)
    home = tmp_path / "jupyter"
    settings = home / "config/lab/user-settings/@jupyterlab/apputils-extension"
    settings.mkdir(parents=True)
    # No "get notified about Jupyter news?" toast over the page (and no network attempt).
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "IPYTHONDIR": str(home / "ipython"),
        "OMP_NUM_THREADS": "1",
    }
    port, token = _free_port(), secrets.token_hex(16)
    lab = Lab(
        url=f"http://127.0.0.1:{port}", token=token, root=root, log=tmp_path / "jupyterlab.log"
    )
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False",
        "--allow-root",
    ]
    with open(lab.log, "wb") as log:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=root,
        )
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"JupyterLab exited with {process.returncode}:\n{lab.log_tail()}")
            try:
                lab.api("GET", "/api/status")
                break
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"JupyterLab did not answer in {SERVER_START_S} s:\n{lab.log_tail()}"
                    )
                time.sleep(0.1)
        lab.delete_sessions()
        yield lab
    finally:
        try:
            if process.poll() is None:
                lab.delete_sessions()
        except (OSError, urllib.error.URLError, ValueError):
            pass  # the server is stopped next anyway
        _stop(process)
        _stop_kernel(root / "kernel.pid")


# ------------------------------------------------------------------ the test


def test_live_dashboard_updates_in_the_browser(jupyter_lab: Lab, page, tmp_path):
    from playwright.sync_api import expect

    screenshot = tmp_path / "dashboard.png"
    try:
        page.goto(f"{jupyter_lab.url}/lab/tree/{NOTEBOOK}?token={jupyter_lab.token}")
        # The status bar's kernel item reads "Python 3 (ipykernel) | Idle" once the kernel is
        # connected (the toolbar indicator says "idle" earlier, before a kernel exists).
        kernel_status = page.locator(".jp-StatusBar-TextItem[title^='Change kernel']")
        expect(kernel_status).to_have_text(re.compile(r"\| Idle$"), timeout=KERNEL_READY_S * 1000)
        page.evaluate(SAMPLER_JS)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

        page.locator(".widget-hprogress").wait_for(timeout=RUN_S * 1000)
        page.locator(".widget-hprogress").scroll_into_view_if_needed()
        done = page.locator(".jp-OutputArea-output", has_text=f"finished {STEPS} steps")
        expect(done).to_have_count(1, timeout=RUN_S * 1000)
        # Widget updates apply asynchronously in the page (and a blob: PNG decodes
        # asynchronously): wait for the final header and a decoded image before reading them.
        page.wait_for_function(
            """([steps]) => { const bar = document.querySelector('.widget-hprogress');
               const box = bar.closest('.widget-vbox');
               const img = box.querySelector('img.widget-image');
               return box.querySelector('.widget-html-content').textContent
                        .includes(`step ${steps}/${steps}`)
                      && img.complete && img.naturalWidth > 0; }""",
            arg=[STEPS],
            timeout=10_000,
        )
        samples = page.evaluate(
            "() => { clearInterval(window.__dashSampler); return window.__dashSamples; }"
        )
        final = page.evaluate(DASHBOARD_JS)
        (tmp_path / "samples.json").write_text(json.dumps({"samples": samples, "final": final}))
    finally:
        shots = [screenshot, tmp_path / "dashboard-widget.png"]
        try:
            page.screenshot(path=str(shots[0]))
            page.locator(".widget-vbox:has(.widget-hprogress)").screenshot(
                path=str(shots[1]), timeout=5_000
            )
        except Exception:  # noqa: BLE001 - a screenshot must not hide the real failure
            pass
        if os.environ.get("POSTTRAIN_BROWSER_ARTIFACTS"):
            (HERE / "output").mkdir(exist_ok=True)
            for shot in shots:
                if shot.exists():
                    shutil.copy(shot, HERE / "output" / shot.name)

    summary = done.text_content()
    assert "errors []" in summary, f"the dashboard reported redraw errors: {summary}"

    # Live: while the run went (header at a step before the last), the image was replaced at
    # least twice, seen in at least two samples. Samples from before the first step (header
    # "waiting for the first step"; the empty image already has a blob: src) do not count.
    def step_of(sample) -> int | None:
        match = re.search(r"step (\d+)/\d+", sample["header"] or "")
        return int(match.group(1)) if match else None

    running = [s for s in samples if s["src"] and step_of(s) is not None and step_of(s) < STEPS]
    srcs_while_running = list(dict.fromkeys(s["src"] for s in running))
    steps_seen = sorted({step_of(s) for s in running})
    assert len(running) >= 2 and len(srcs_while_running) >= 2, (
        f"the plot did not update live: {len(running)} samples while running, "
        f"{len(srcs_while_running)} distinct src, steps seen {steps_seen}"
    )
    assert final["src"] != srcs_while_running[0]

    # Final state: header, progress bar at its max, plot rendered.
    assert f"step {STEPS}/{STEPS}" in final["header"], final["header"]
    assert final["width"] == "100%", final
    assert final["barPx"] == pytest.approx(final["trackPx"], abs=1), final
    assert "progress-bar-success" in final["barClass"], final
    assert final["naturalWidth"] > 0 and final["naturalHeight"] > 0, final
    assert final["shownPx"] <= final["naturalWidth"] + 1, final  # not stretched (blurry)
    assert screenshot.stat().st_size > 0
