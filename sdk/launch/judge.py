"""A judge server as a job: local processes or Slurm, found by the URL the job writes.

`launch_judge(judge)` submits `posttrain.rewards.judge_server.serve_until_stopped` through
`posttrain.launch.submit.launch` and returns a `JudgeJob`. The job starts the server, writes
{"url", "host", "port", "node", "pid"} to a file of its own in the launch folder, and serves until
`JudgeJob.stop()` drops a stop file next to it (then it drains its queue and ends COMPLETED with
the server's final stats as its result) or it is cancelled (`kill()`: SIGKILL locally, scancel
on Slurm). The folder must be one the notebook and the job both see (a shared file system on a
cluster). `JudgeJob.url` waits for the file and for GET /ready; a job that ends before it serves
raises `JobFailedError` with the end of its log.

Host: 127.0.0.1 serves this machine only (tests; Slurm nodes emulated on one host). On a real
cluster pass host="0.0.0.0": the URL then names the node (`advertise_host` overrides it), and
anyone who can reach the port can use the judge.

Example (a job on this machine):
    >>> import tempfile
    >>> from posttrain.models import ByteTokenizer
    >>> from posttrain.rewards import RewardModel, RewardModelJudge
    >>> judge = RewardModelJudge(RewardModel.from_spec("tiny-1m", seed=0), ByteTokenizer())
    >>> job = launch_judge(judge, folder=tempfile.mkdtemp() + "/judge")
    >>> job.url.startswith("http://127.0.0.1:")
    True
    >>> [r] = job.client().judge(["12"], [{"question": "5 + 7 ="}])
    >>> r.outcome.value in ("ok", "wrong"), job.stop()["requests"], job.run.state
    (True, 1, 'COMPLETED')
"""

from __future__ import annotations

import datetime
import html
import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.core.checks import check_int
from posttrain.launch.run import JobFailedError, Run
from posttrain.launch.submit import launch
from posttrain.rewards.judge_client import JudgeClient
from posttrain.rewards.judge_server import JudgeJobSpec, ServerSettings, serve_until_stopped

if TYPE_CHECKING:
    from posttrain.rewards.judge_protocol import Judge

__all__ = ["launch_judge", "JudgeJob"]


def launch_judge(
    judge: Judge,
    *,
    executor: str = "local",
    folder: str | os.PathLike | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    settings: ServerSettings | None = None,
    timeout_min: float = 60,
    name: str = "judge_server",
    cpus_per_task: int = 1,
    gpus_per_node: int = 0,
    torch_threads: int | None = None,
    partition: str | None = None,
    slurm_kwargs: dict[str, Any] | None = None,
    **server_options: Any,
) -> JudgeJob:
    """Serve `judge` from a job; returns its `JudgeJob` at once (the job may still start).

    Args:
        judge: the judge to serve (it travels to the job with cloudpickle).
        executor: "local" or "slurm" ("debug" would block this process: use
            `posttrain.rewards.judge_server.serve_judge` in a notebook instead).
        folder: the launch folder (default `runs/launch/judge_server-<timestamp>`); see
            `posttrain.launch.submit.launch`.
        host, port, advertise_host: where the server listens and the host its URL names (see
            `serve_judge`; port 0 picks a free one, a fixed port lets a restarted server keep
            its URL).
        settings: a `ServerSettings`, or its fields as keywords (`max_batch_size=...`).
        timeout_min, name, cpus_per_task, gpus_per_node, partition, slurm_kwargs: as in `launch`.
        torch_threads: intra-op threads of the judge in the job (default `cpus_per_task`, also
            for "local", where no scheduler enforces it: more threads than free cores slow every
            forward down, see `JudgeJobSpec`).

    Raises:
        TypeError: if `judge` has no `judge(completions, items)` method, or a host or
            `settings` of the wrong type.
        ValueError: executor "debug", bad server settings, host, port or `torch_threads`
            (named; all checked before anything is submitted), or what `launch` refuses.
    """
    if executor == "debug":
        raise ValueError(
            "executor='debug' would serve in this process until stopped, blocking "
            "the cell; use posttrain.rewards.judge_server.serve_judge(judge) here, "
            "or executor='local' / 'slurm'"
        )
    if settings is None:
        unknown = set(server_options) - set(ServerSettings.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown server options {sorted(unknown)}; allowed: "
                f"{sorted(ServerSettings.__dataclass_fields__)}"
            )
        settings = ServerSettings(**server_options)
    elif server_options:
        raise ValueError(
            f"pass either settings= or its fields as keywords, not both ({sorted(server_options)})"
        )
    check_int("cpus_per_task", cpus_per_task, minimum=1)
    if folder is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = Path("runs", "launch", f"{name}-{stamp}")
    folder = Path(folder).expanduser().absolute()
    tag = uuid.uuid4().hex[:8]  # files of this launch only: a stale URL is never read
    # JudgeJobSpec checks the judge, host, port and torch_threads here, before the queue wait.
    spec = JudgeJobSpec(
        judge=judge,
        url_file=str(folder / f"judge_server-{tag}.json"),
        stop_file=str(folder / f"judge_server-{tag}.stop"),
        host=host,
        port=port,
        advertise_host=advertise_host,
        settings=settings,
        torch_threads=cpus_per_task if torch_threads is None else torch_threads,
    )
    run = launch(
        serve_until_stopped,
        spec,
        executor=executor,
        folder=folder,
        name=name,
        timeout_min=timeout_min,
        cpus_per_task=cpus_per_task,
        gpus_per_node=gpus_per_node,
        partition=partition,
        slurm_kwargs=slurm_kwargs,
    )
    return JudgeJob(run, Path(spec.url_file), Path(spec.stop_file))


class JudgeJob:
    """A judge server running as a job (what `launch_judge` returns).

    Attributes:
        run: the job's `posttrain.launch.run.Run` (state, logs, cancel).
        url_file, stop_file: the files the job writes its URL to and watches for.
    """

    def __init__(self, run: Run, url_file: Path, stop_file: Path) -> None:
        self.run, self.url_file, self.stop_file = run, url_file, stop_file
        self._url: str | None = None

    @property
    def url(self) -> str:
        """The server's URL, once it is ready (waits up to 300 s: `wait_ready`)."""
        return self._url or self.wait_ready()

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.2) -> str:
        """Wait until the job has written its URL and answers GET /ready; returns the URL.

        Raises:
            JobFailedError: the job ended before it served (with the end of its log).
            TimeoutError: not ready after `timeout_s` seconds (the job keeps running).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.url_file.is_file():
                url = json.loads(self.url_file.read_text())["url"]
                if JudgeClient(url).ready(timeout_s=min(10.0, timeout_s)):
                    self._url = url
                    return url
            if self.run.done():
                raise JobFailedError(
                    f"judge server job {self.run.job_id} ended ({self.run.state}) before it "
                    f"served. End of its log:\n{self.run.logs(20, stream='stderr')}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"judge server job {self.run.job_id} is {self.run.state} but "
                    f"not ready after {timeout_s:g} s (its URL file: "
                    f"{self.url_file}); it keeps running (kill() stops it)"
                )
            time.sleep(poll_s)

    def client(self, **options: Any) -> JudgeClient:
        """A `JudgeClient` for the server (waits until it is ready); `options` as JudgeClient's."""
        return JudgeClient(self.url, **options)

    def stop(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Drain and end the server; returns its final stats (the job's result).

        Raises:
            TimeoutError: the job has not ended after `timeout_s` (it keeps running; `kill()`).
            JobFailedError: the job failed (e.g. its server died before the stop).
        """
        self.stop_file.parent.mkdir(parents=True, exist_ok=True)
        self.stop_file.write_text(datetime.datetime.now().isoformat() + "\n")
        self.run.wait(timeout=timeout_s)
        return self.run.result()

    def kill(self) -> None:
        """End the job now, without draining (SIGKILL locally, scancel on Slurm)."""
        self.run.cancel()

    def __repr__(self) -> str:
        return f"JudgeJob(job_id={self.run.job_id!r}, state={self.run.state!r}, url={self._url!r})"

    def _repr_html_(self) -> str:
        cells = {
            "job": self.run.job_id,
            "executor": self.run.executor,
            "state": self.run.state,
            "url": self._url or "(not ready yet)",
            "folder": str(self.url_file.parent),
        }
        head = "".join(f"<th>{html.escape(str(k))}</th>" for k in cells)
        body = "".join(f"<td>{html.escape(str(v))}</td>" for v in cells.values())
        return f"<table><tr>{head}</tr><tr>{body}</tr></table>"
