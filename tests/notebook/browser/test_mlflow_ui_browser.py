"""The MLflow UI shows what a recipe's mlflow tracker logged: a tiny SFT run (tiny-1m, 2 steps)
with `logging.trackers=[mlflow]` writes its local store (`<out_dir>/mlflow/mlflow.db`);
`scripts/mlflow-up.sh` serves it; headless Chromium opens the run's page and the test reads the
Overview tab's Metrics and Parameters tables (rows `[role=row]`, "name" then "value"):
    - the metric "loss" shows the last step's loss of metrics.jsonl (MLflow shows a metric's
      latest value),
    - the parameters show the resolved config under its dotted keys ("optim.lr", "task.name",
      "logging.trackers") with the values of config.json.
`scripts/mlflow-down.sh` stops the server afterwards (also on failure).

Needs Chromium (the `chromium` and `page` fixtures of conftest.py) and the MLflow server's venv
(`scripts/mlflow-up.sh --build`, 165 s once on a loaded 2-core machine; `make test` builds it
when missing), and skips without either. CPU time once the venv exists, measured on a 2-core
machine at load 12-15: the run ~14 s (imports, MLflow creating its SQLite tables, 2 steps,
plots, the policy), the server ~10 s to answer (two processes importing mlflow), the page ~4 s
(a 4.4 MB script bundle); wall clock there 165-185 s, of which the page 17-33 s.

Output in the test's tmp_path: `mlflow-run.png` (the page, also on failure), `console.log`, and
the server's log at `run/mlflow/server.log`. With POSTTRAIN_BROWSER_ARTIFACTS=1 the screenshot
is also copied to tests/notebook/browser/output/ (git-ignored).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(480)]

HERE = Path(__file__).parent
SCRIPTS = HERE.parents[2] / "scripts"
SERVER_UP_S = 240  # mlflow-up.sh waits up to 180 s for /health
PAGE_S = 120  # the UI's bundle parses slowly on a loaded machine


@pytest.fixture(scope="module")
def mlflow_server_venv(chromium) -> None:
    """Skip before the run when the server's venv is not built (or Chromium is missing)."""
    check = subprocess.run([SCRIPTS / "mlflow-up.sh", "--check"], capture_output=True)
    if check.returncode != 0:
        pytest.skip(
            "no MLflow server venv: run scripts/mlflow-up.sh --build (~3 min once, ~860 MB)"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served_run(mlflow_server_venv, tmp_path) -> Iterator[tuple[Path, str]]:
    """(run folder, the UI's URL): a finished tiny SFT run whose MLflow store is served."""
    from posttrain.workflows.config import BatchOptimConfig, TaskConfig
    from posttrain.workflows.logging_config import LoggingConfig
    from posttrain.workflows.sft import SFTConfig, run_sft

    out = tmp_path / "run"
    run_sft(
        SFTConfig(
            task=TaskConfig(train_size=64, eval_size=0),
            optim=BatchOptimConfig(steps=2, batch_size=4, warmup_steps=0),
            logging=LoggingConfig(trackers=["mlflow"], experiment="ui"),
            out_dir=str(out),
            progress=False,
        )
    )
    port = _free_port()
    try:
        up = subprocess.run(
            [SCRIPTS / "mlflow-up.sh", out, str(port)],
            capture_output=True,
            text=True,
            timeout=SERVER_UP_S,
        )
        assert up.returncode == 0, f"mlflow-up.sh failed:\n{up.stdout}{up.stderr}"
        yield out, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([SCRIPTS / "mlflow-down.sh", out], capture_output=True, timeout=60)


def test_mlflow_ui_shows_the_runs_metrics_and_config(served_run, page, tmp_path):
    from mlflow.tracking import MlflowClient

    out, url = served_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ui")
    (run,) = client.search_runs([experiment.experiment_id])
    screenshot = tmp_path / "mlflow-run.png"
    try:
        page.goto(f"{url}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}")
        page.get_by_role("row").filter(has_text="optim.lr").wait_for(timeout=PAGE_S * 1000)
        shown = {}
        for text in page.get_by_role("row").all_inner_texts():
            name, _, value = text.strip().partition("\n")
            shown[name.strip()] = value.strip()
    finally:
        try:
            page.screenshot(path=str(screenshot), full_page=True)
        except Exception:  # noqa: BLE001 - a screenshot must not hide the real failure
            pass
        if os.environ.get("POSTTRAIN_BROWSER_ARTIFACTS") and screenshot.exists():
            (HERE / "output").mkdir(exist_ok=True)
            shutil.copy(screenshot, HERE / "output" / screenshot.name)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "loss" in shown, f"no loss row in the page's tables: {sorted(shown)}"
    assert float(shown["loss"]) == pytest.approx(rows[-1]["loss"], rel=1e-9)
    saved = json.loads((out / "config.json").read_text())
    assert float(shown["optim.lr"]) == saved["optim"]["lr"]
    assert shown["task.name"] == saved["task"]["name"] == "chain_sum"
    assert shown["logging.trackers"] == "['mlflow']"
