"""What a `Run` reads about its job besides submitit's Job: whether a "local" job's controller
still runs, which Slurm states are not final, why Slurm keeps a job pending (squeue) and which
of its reasons never clear, a task's outcome from its result pickle without loading the result,
the end of a log file, the last row of a metrics.jsonl, the short forms of that row a `Run`
shows (its repr and notebook table), and the refresh loop that `Run.watch` and `Sweep.watch`
share (`watch_until_done`). The launch record in run.json is `posttrain.launch.run_record`.
"""

from __future__ import annotations

import functools
import html
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from submitit.core.utils import pickle_load

from posttrain.launch.live_view import LiveHTML


def _controller_alive(pid: int) -> bool:
    """True if process `pid` runs and (where /proc tells) is a submitit job controller."""
    try:
        return b"submitit" in Path(f"/proc/{pid}/cmdline").read_bytes()  # a zombie has none
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# Slurm states (sacct) in which a job may still run or run again; every other state is final.
_ACTIVE = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "COMPLETING",
    "PREEMPTED",
    "CONFIGURING",
    "SUSPENDED",
    "RESIZING",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
    "READY",
    "UNKNOWN",
}

# squeue reasons (%r) that keep a job PENDING until it is cancelled: its request exceeds what the
# partition, account or QOS allows, which no other job ending will change.
_NEVER_STARTS = {
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
}


def _squeue_reason(job_id: str) -> str | None:
    """Why Slurm keeps `job_id` pending (`squeue -h -j ID -o %r`), None if squeue says none."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    reason = lines[0].strip() if lines else ""
    return None if reason in ("", "None") else reason


def _peek_outcome(path: Path) -> str | None:
    """ "success" / "error" from submitit's result pickle without loading the result; None if
    the file does not exist (yet)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except FileNotFoundError:
        return None
    if b"\x8c\x07success" in head:
        return "success"
    if b"\x8c\x05error" in head:
        return "error"
    return pickle_load(path)[0]


def _tail(path: Path, lines: int | None) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        if lines is None:
            return f.read().decode("utf-8", "replace")
        f.seek(0, os.SEEK_END)
        size, chunk, data = f.tell(), 1 << 14, b""
        while size > 0 and data.count(b"\n") <= lines:
            step = min(chunk, size)
            size -= step
            f.seek(size)
            data = f.read(step) + data
    text = data.decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:]) if lines else ""


def last_metrics_row(path: Path | None) -> dict[str, Any]:
    """The last complete JSON object of a metrics.jsonl file (a line being written is skipped);
    {} when there is none or `path` is None / missing."""
    if path is None or not path.exists():
        return {}
    for line in reversed(_tail(path, 4).splitlines()):
        try:
            row = json.loads(line)
            if isinstance(row, dict):
                return row
        except json.JSONDecodeError:
            continue
    return {}


def _no_metrics(note: str):
    frame = _no_metrics_class()()
    frame.note = note
    return frame


@functools.cache
def _no_metrics_class():
    import pandas as pd

    class NoMetrics(pd.DataFrame):
        """An empty DataFrame that says why it is empty."""

        _metadata = ["note"]

        @property
        def _constructor(self):
            return pd.DataFrame

        def __repr__(self) -> str:
            return f"<no metrics yet: {self.note}>"

        def _repr_html_(self) -> str:
            return f"<p><i>no metrics yet: {html.escape(self.note)}</i></p>"

    return NoMetrics


def _headline(row: dict[str, Any], limit: int = 2) -> dict[str, Any]:
    """step, loss and the next few numeric metrics of a metrics row."""
    out: dict[str, Any] = {k: row[k] for k in ("step", "loss") if k in row}
    for k, v in row.items():
        if len(out) >= limit + 1:
            break
        if k not in out and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
    return out


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def watch_until_done(
    done: Callable[[], bool],
    *,
    as_html: Callable[[], str],
    as_text: Callable[[], str],
    every_s: float,
    timeout: float | None,
    stopped: str,
) -> bool:
    """Show a state until `done()` or `timeout` seconds: in a Jupyter kernel one HTML widget
    (`as_html()`, a `posttrain.launch.live_view.LiveHTML`) updated in place every `every_s` s,
    elsewhere `as_text()` printed whenever it changes. Ctrl-C / a kernel interrupt stops
    watching (prints `stopped`), not what is watched. Returns whether it ended with `done()`
    True."""
    view = LiveHTML(as_html)
    view.update()
    start, last = time.monotonic(), None
    try:
        while True:
            ended = done()
            if view.widget is not None:
                view.update()
            elif (text := as_text()) != last:
                print(last := text, flush=True)
            if ended or (timeout is not None and time.monotonic() - start >= timeout):
                return ended
            time.sleep(every_s)
    except KeyboardInterrupt:
        print(stopped)
        return False
