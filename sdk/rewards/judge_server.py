"""A judge served over HTTP (FastAPI + uvicorn): dynamic batching, a bounded queue with
backpressure, per-request timeouts, health and readiness, and a graceful shutdown that drains
the queue.

`serve_judge(judge)` starts a server on a thread of this process (a notebook cell) and returns a
`JudgeServer` handle with `url`, `stats()`, `stop()` and a table in the notebook;
`serve_until_stopped(spec)` is the same server as a job (`posttrain.launch.judge.launch_judge`
runs it locally or on Slurm; it writes its URL to a file and serves until a stop file appears).
`posttrain.rewards.judge_client.JudgeClient` is the client: a verifier for RL.

What it answers (the endpoints, request ids judged once, deadlines, judge failures as results)
is its HTTP application, `posttrain.rewards.judge_app.build_app`; this module hosts it: a
listening socket, uvicorn, start-up, the drain on shutdown, and the job's loop.

Shutdown (`JudgeServer.stop`, or the stop file of a job): /ready turns 503 and new requests get
503 + Retry-After; every queued request is judged and answered; then uvicorn closes. Requests
not answered after `drain_timeout_s` (queued, or in a judge call that takes longer) get 503:
never silently dropped. A judge call still running then ends in the background.

Example (a reward-model judge on 127.0.0.1, a port the system picks):
    >>> from posttrain.models import ByteTokenizer
    >>> from posttrain.rewards.judges import RewardModelJudge
    >>> from posttrain.rewards.reward_model import RewardModel
    >>> judge = RewardModelJudge(RewardModel.from_spec("tiny-1m", seed=0), ByteTokenizer())
    >>> with serve_judge(judge, max_wait_s=0.001) as server:
    ...     [served] = server.client(timeout_s=60).judge(["12"], [{"question": "5 + 7 ="}])
    ...     [local] = judge.judge(["12"], [{"question": "5 + 7 ="}])
    ...     abs(served.score - local.score) < 1e-6, server.stats()["requests"]
    (True, 1)
"""

from __future__ import annotations

import html
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.core.checks import check_int, require_positive
from posttrain.rewards.judge_app import build_app
from posttrain.rewards.judge_client import JUDGE_PATH, JudgeClient
from posttrain.rewards.judge_limits import ServerSettings, check_address

if TYPE_CHECKING:
    from posttrain.rewards.judge_protocol import Judge

__all__ = [
    "ServerSettings",
    "JudgeServer",
    "serve_judge",
    "build_app",
    "JudgeJobSpec",
    "serve_until_stopped",
    "check_address",
    "JUDGE_PATH",
]


class JudgeServer:
    """A running judge server on a thread of this process (what `serve_judge` returns).

    Attributes:
        url: "http://HOST:PORT" (the advertised host).
        host, port: where it listens.
        settings: its `ServerSettings`.
    """

    def __init__(
        self,
        judge: Judge,
        *,
        host: str,
        port: int,
        settings: ServerSettings,
        advertise_host: str | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        import uvicorn

        self.settings = settings
        self._app, self._batcher = build_app(judge, settings)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
        # socket says TCP; without it each response waits ~40 ms for a delayed ACK (Nagle).
        self._socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise OSError(f"cannot listen on {host}:{port}: {exc}") from None
        self.host, self.port = host, self._socket.getsockname()[1]
        shown = advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::") else host)
        self.url = f"http://{f'[{shown}]' if ':' in shown else shown}:{self.port}"
        # timeout_graceful_shutdown: uvicorn waits with asyncio, so float seconds work too
        drain_s: Any = settings.drain_timeout_s
        config = uvicorn.Config(
            self._app,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=drain_s,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._serve, daemon=True, name=f"posttrain-judge-server-{self.port}"
        )
        self._final_stats: dict | None = None
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                self._socket.close()
                raise RuntimeError(
                    f"the judge server on {host}:{self.port} did not start "
                    f"within {startup_timeout_s:g} s (see the log above)"
                )
            time.sleep(0.01)

    def _serve(self) -> None:
        """The server thread: uvicorn until it exits; however it ends, the listening socket is
        closed, so clients see "connection refused" at once rather than wait out a deadline."""
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._socket.close()

    @property
    def running(self) -> bool:
        """True while the server thread serves (until `stop` returns, or it died)."""
        return self._thread.is_alive()

    @property
    def state(self) -> str:
        """ "ready", "draining", "failed" (the batcher died: every request gets 503) or
        "stopped"."""
        if not self.running:
            return "stopped"
        if self._batcher.failed is not None:
            return "failed"
        return "draining" if self._batcher.draining else "ready"

    def stats(self) -> dict[str, Any]:
        """The server's counters (as GET /stats); the final ones after `stop`."""
        if self._final_stats is not None:
            return dict(self._final_stats)
        return {**self._batcher.stats(), **self._app.state.counters}

    def stop(self, drain: bool = True, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop serving: refuse new requests (503), judge and answer what is queued (at most
        `timeout_s`, default `settings.drain_timeout_s`; every request not answered by then,
        queued or in the judge, gets 503), close. `drain=False` answers them 503 at once.
        Returns the final `stats()` once the server thread has ended (`state` is then
        "stopped"); calling it again does nothing.

        Raises:
            RuntimeError: if the server thread has not ended `timeout_s` + `drain_timeout_s` +
                60 s after the stop began (uvicorn's own graceful close is bounded by
                `drain_timeout_s`; the rest is a generous margin for a loaded machine).
        """
        if self._final_stats is not None:
            return dict(self._final_stats)
        timeout_s = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        if self.running:
            self._batcher.begin_drain()
            deadline = time.monotonic() + (timeout_s if drain else 0.0)
            while not self._batcher.idle() and time.monotonic() < deadline:
                time.sleep(0.005)
            if not self._batcher.idle():
                self._batcher.fail_pending()
            self._server.should_exit = True  # uvicorn lets responses in progress finish
            limit = timeout_s + self.settings.drain_timeout_s + 60.0
            self._thread.join(limit)
            if self._thread.is_alive():
                raise RuntimeError(
                    f"the judge server at {self.url} did not end within "
                    f"{limit:g} s of stop() (see the log above)"
                )
        self._final_stats = self.stats()
        return dict(self._final_stats)

    def client(self, **options: Any) -> JudgeClient:
        """A `posttrain.rewards.judge_client.JudgeClient` for this server (`options`: its
        keywords, e.g. `timeout_s`, `retries`)."""
        return JudgeClient(self.url, **options)

    def __enter__(self) -> JudgeServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"JudgeServer(url={self.url!r}, state={self.state!r}, requests={s['requests']}, "
            f"batches={s['batches']}, queue_depth={s['queue_depth']})"
        )

    def _repr_html_(self) -> str:
        s = self.stats()
        mean = s["completions"] / s["batches"] if s["batches"] else 0.0
        cells = {
            "url": self.url,
            "state": self.state,
            "requests": s["requests"],
            "completions": s["completions"],
            "batches": s["batches"],
            "mean batch": f"{mean:.1f}",
            "queue": f"{s['queue_depth']}/{self.settings.max_queue}",
            "429": s["rejected_full"],
            "504": s["timed_out"],
            "expired": s["expired"],
            "judge failures": s["judge_failures"],
        }
        head = "".join(f"<th>{html.escape(str(k))}</th>" for k in cells)
        body = "".join(f"<td>{html.escape(str(v))}</td>" for v in cells.values())
        return f"<table><tr>{head}</tr><tr>{body}</tr></table>"


def serve_judge(
    judge: Judge,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    settings: ServerSettings | None = None,
    **options: Any,
) -> JudgeServer:
    """Serve `judge` over HTTP from this process (a daemon thread); returns a `JudgeServer`.

    Args:
        judge: a `posttrain.rewards.judges.Judge` (`LLMJudge`, `RewardModelJudge`, your class).
        host: the address to listen on: 127.0.0.1 (default, this machine only) or 0.0.0.0 (every
            interface: anyone who reaches the port may use the judge).
        port: the TCP port; 0 lets the system pick a free one (see `.port` / `.url`).
        advertise_host: the host name put in `url` (default: `host`, or this machine's name when
            listening on every interface).
        settings: a `ServerSettings`; or pass its fields as keywords (`max_batch_size=32`, ...).

    Raises:
        TypeError: if `judge` has no `judge(completions, items)` method.
        ValueError: for bad settings, host or port (named), or both `settings` and keywords.
        OSError: if the address cannot be bound (port in use).
        RuntimeError: if the server does not start.
    """
    if not callable(getattr(judge, "judge", None)):
        raise TypeError(
            f"judge must have a judge(completions, items) method; got {type(judge).__name__}"
        )
    check_address(host, port, advertise_host)
    if settings is not None and not isinstance(settings, ServerSettings):
        raise TypeError(f"settings must be a ServerSettings; got {type(settings).__name__}")
    if settings is not None and options:
        raise ValueError(
            f"pass either settings= or its fields as keywords, not both ({sorted(options)})"
        )
    if settings is None:
        unknown = set(options) - set(ServerSettings.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown server options {sorted(unknown)}; allowed: "
                f"{sorted(ServerSettings.__dataclass_fields__)}"
            )
        settings = ServerSettings(**options)
    return JudgeServer(
        judge, host=host, port=port, settings=settings, advertise_host=advertise_host
    )


# --------------------------------------------------------------------------------------------
# As a job: serve until a stop file appears
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class JudgeJobSpec:
    """What a judge-server job runs (`serve_until_stopped`); pickles when the judge does.

    Raises:
        TypeError / ValueError: for a field outside its range (named), checked before the job
            is submitted.

    Attributes:
        judge: the judge to serve.
        url_file: where the job writes {"url", "host", "port", "node", "pid"} once it serves.
        stop_file: the job drains and ends once this file exists.
        host, port, advertise_host, settings: as in `serve_judge`.
        poll_s: how often the job looks for the stop file.
        torch_threads: `torch.set_num_threads` in the job (None: torch's default, one per
            core). Give it the job's CPUs: more intra-op threads than free cores make every
            forward wait for descheduled threads (7 ms -> 80 ms per call measured on a loaded
            2-core machine).
    """

    judge: Judge
    url_file: str
    stop_file: str
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    settings: ServerSettings = field(default_factory=ServerSettings)
    poll_s: float = 0.1
    torch_threads: int | None = None

    def __post_init__(self) -> None:
        if not callable(getattr(self.judge, "judge", None)):
            raise TypeError(
                f"JudgeJobSpec.judge must have a judge(completions, items) method; "
                f"got {type(self.judge).__name__}"
            )
        if not isinstance(self.settings, ServerSettings):
            raise TypeError(
                f"JudgeJobSpec.settings must be a ServerSettings; got "
                f"{type(self.settings).__name__}"
            )
        for name in ("url_file", "stop_file"):
            if not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise ValueError(f"JudgeJobSpec.{name}={getattr(self, name)!r}; must be a path")
        check_address(self.host, self.port, self.advertise_host)
        require_positive(self, ("poll_s",))
        check_int("torch_threads", self.torch_threads, minimum=1, optional=True)


def serve_until_stopped(spec: JudgeJobSpec) -> dict[str, Any]:
    """Serve `spec.judge` until `spec.stop_file` exists, then drain and return the final stats
    (the job's result). The URL file is written atomically once the server is ready.

    Raises:
        RuntimeError: if the server thread ends or its batcher fails by itself (the job then
            fails, with the log).
    """
    if spec.torch_threads is not None:
        import torch

        torch.set_num_threads(spec.torch_threads)
    server = serve_judge(
        spec.judge,
        host=spec.host,
        port=spec.port,
        advertise_host=spec.advertise_host,
        settings=spec.settings,
    )
    record = {
        "url": server.url,
        "host": server.host,
        "port": server.port,
        "node": socket.gethostname(),
        "pid": os.getpid(),
    }
    path = Path(spec.url_file)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    print(f"posttrain judge server: serving {server.url}", flush=True)
    try:
        while not Path(spec.stop_file).exists():
            if server.state in ("stopped", "failed"):
                raise RuntimeError(
                    f"the judge server at {server.url} {server.state} by itself"
                    f" ({server._batcher.failed or 'see the log'})"
                )
            time.sleep(spec.poll_s)
    finally:
        stats = server.stop()
    print(f"posttrain judge server: stopped after {stats['requests']} requests", flush=True)
    return stats
