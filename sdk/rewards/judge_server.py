"""A judge served over HTTP (FastAPI + uvicorn): dynamic batching, a bounded queue with
backpressure, per-request timeouts, health and readiness, and a graceful shutdown that drains
the queue.

`serve_judge(judge)` starts a server on a thread of this process (a notebook cell) and returns a
`JudgeServer` handle with `url`, `stats()`, `stop()` and a table in the notebook;
`serve_until_stopped(spec)` is the same server as a job (`posttrain.launch.judge.launch_judge`
runs it locally or on Slurm; it writes its URL to a file and serves until a stop file appears).
`posttrain.rewards.judge_client.JudgeClient` is the client: a verifier for RL.

HTTP API (JSON bodies):

    =========================  ==============================================================
    POST /v1/judge             {request_id, completions: [str], items: [{question: str, ...}],
                               timeout_s?} -> 200 {request_id, results: [{score, outcome,
                               reason, raw, raw_score}], batch: {id, requests, completions},
                               queue_s, judge_s, replayed}
                               413 body over max_body_bytes (counted as it is read, before
                               parsing); 422 malformed body, named by `loc`: not UTF-8 JSON,
                               more than max_request_completions completions, a lone
                               surrogate in any string, an item without a string question,
                               timeout_s not finite and > 0 (`posttrain.rewards.judge_limits`);
                               429 queue full and 503 shutting down, both with Retry-After
                               (header: whole seconds; body `retry_after_s`: the estimate);
                               504 not judged within min(request_timeout_s, timeout_s); 503
                               also when the drain time ran out before it was judged
    GET /health                200 {"status": "alive"} while the process serves (liveness)
    GET /ready                 200 {"status": "ready"}; 503 "starting" / "draining" /
                               "failed" (the batcher died; requests then get 503)
    GET /stats                 counters and the batch-size histograms (`Batcher.stats`)
    =========================  ==============================================================

Request ids: a request is judged once per `request_id`. A retry of a request that is still
queued or being judged waits for the same judgement; a retry of one already answered gets the
same answer again (`replayed: true`) from a cache of the last `replay_cache` answers. So a
client that retries after a lost response (or a 504) never makes the judge work twice, and
every id gets exactly one judgement.

Deadlines: a request is judged in batches of at most `max_batch_size` completions (a larger one in
pieces, between other requests' batches); once no client waits for it any more (its deadline,
moved later by a retry that joins it, has passed), what is left of it is dropped, not judged for
nobody (`posttrain.rewards.judge_batcher`). So one client stalls the others by one batch at most.

Judge failures are results, not HTTP errors: a judge that raises (SystemExit included) or returns
what cannot be sent (a non-numeric `raw_score`) gives outcome `error` for the
completions of that request only (`posttrain.rewards.judge_batcher`), and an unparsable verdict
is `error` as in-process (`posttrain.rewards.judges`).

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

import asyncio
import contextlib
import functools
import html
import json
import math
import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from posttrain.core.checks import check_int, require_positive
from posttrain.rewards.judge_batcher import Batcher, JudgeRequest, ServerShutDown
from posttrain.rewards.judge_client import JUDGE_PATH, JudgeClient
from posttrain.rewards.judge_limits import (
    BodyLimit,
    ServerSettings,
    check_address,
    parse_request,
    validation_error_response,
)

if TYPE_CHECKING:
    from posttrain.rewards.judges import Judge

__all__ = ["ServerSettings", "JudgeServer", "serve_judge", "build_app", "JudgeJobSpec",
           "serve_until_stopped", "check_address", "JUDGE_PATH"]

def _refusal(status: int, detail: str, retry_after_s: float) -> JSONResponse:
    return JSONResponse({"detail": detail, "retry_after_s": round(retry_after_s, 3)},
                        status_code=status,
                        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def _response(request_id: str, output: Any) -> dict:
    return {"request_id": request_id, "results": output.results,
            "batch": {"id": output.batch_id, "requests": output.batch_requests,
                      "completions": output.batch_completions},
            "queue_s": round(output.queue_s, 6), "judge_s": round(output.judge_s, 6)}


def build_app(
    judge: Judge, settings: ServerSettings = ServerSettings()
) -> tuple[FastAPI, Batcher]:
    """The FastAPI app serving `judge` (the HTTP API of the module docstring) and its `Batcher`
    (started and closed by the app's lifespan)."""
    batcher = Batcher(judge, max_batch_size=settings.max_batch_size,
                      max_wait_s=settings.max_wait_s, max_queue=settings.max_queue)
    answered: OrderedDict[str, dict] = OrderedDict()   # request id -> response body
    in_flight: dict[str, JudgeRequest] = {}
    state = {"ready": False}
    counters = {"replayed": 0, "joined": 0, "timed_out": 0, "rejected_too_large": 0,
                "rejected_invalid": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        state["ready"] = True
        yield
        state["ready"] = False
        await batcher.close()

    app = FastAPI(title="posttrain judge", lifespan=lifespan)

    def invalid(request: Any, exc: Exception) -> JSONResponse:
        counters["rejected_invalid"] += 1
        assert isinstance(exc, RequestValidationError)  # the only class it handles
        return validation_error_response(request, exc)

    def too_large() -> None:
        counters["rejected_too_large"] += 1

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes, on_refuse=too_large)

    def remember(request_id: str, future: asyncio.Future) -> None:
        """Done callback: the request leaves `in_flight`; a judgement is kept for retries."""
        in_flight.pop(request_id, None)
        if not future.cancelled() and future.exception() is None:
            answered[request_id] = _response(request_id, future.result())
            while len(answered) > settings.replay_cache:
                answered.popitem(last=False)

    def timed_out(timeout_s: float) -> JSONResponse:
        counters["timed_out"] += 1
        return JSONResponse({"detail": f"not judged within {timeout_s:g} s"}, status_code=504)

    @app.post(JUDGE_PATH)
    async def judge_endpoint(http: Request) -> Any:
        body = parse_request(await http.body(),
                             max_request_completions=settings.max_request_completions)
        if body.request_id in answered:
            counters["replayed"] += 1
            return {**answered[body.request_id], "replayed": True}
        timeout_s = min(settings.request_timeout_s, body.timeout_s or math.inf)
        deadline = time.monotonic() + timeout_s
        request = in_flight.get(body.request_id)
        if request is not None:          # a retry waits for the same judgement, and as long
            counters["joined"] += 1
            request.deadline = max(request.deadline, deadline)
        else:
            request = JudgeRequest(body.request_id, body.completions, body.items,
                                   deadline=deadline)
            refused = batcher.offer(request)
            if refused is not None:
                why, retry_after_s = refused
                detail = {"draining": "the judge server is shutting down",
                          "failed": f"the judge batcher failed ({batcher.failed})",
                          "full": f"the judge queue is full ({settings.max_queue} requests "
                                  "wait)"}[why]
                return _refusal(429 if why == "full" else 503, detail, retry_after_s)
            in_flight[body.request_id] = request
            request.future.add_done_callback(functools.partial(remember, body.request_id))
        request.waiters += 1
        try:
            output = await asyncio.wait_for(asyncio.shield(request.future), timeout_s)
        except TimeoutError:
            if request.waiters == 1 and not batcher.is_judging(request):
                request.future.cancel()   # still queued and nobody else waits: drop it now
            return timed_out(timeout_s)   # (between two pieces, the batcher drops the rest)
        except asyncio.CancelledError:
            if not request.future.cancelled():   # this handler itself is being cancelled
                raise
            return timed_out(timeout_s)   # the batcher dropped it as its deadline passed
        except ServerShutDown as exc:
            return _refusal(503, str(exc), 1.0)
        finally:
            request.waiters -= 1
        return {**_response(body.request_id, output), "replayed": False}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> Any:
        if state["ready"] and not batcher.draining and batcher.failed is None:
            return {"status": "ready"}
        status = ("failed" if batcher.failed is not None else
                  "draining" if batcher.draining else "starting")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/stats")
    async def stats() -> dict:
        return {**batcher.stats(), **counters}

    app.state.batcher, app.state.counters = batcher, counters
    return app, batcher


class JudgeServer:
    """A running judge server on a thread of this process (what `serve_judge` returns).

    Attributes:
        url: "http://HOST:PORT" (the advertised host).
        host, port: where it listens.
        settings: its `ServerSettings`.
    """

    def __init__(self, judge: Judge, *, host: str, port: int, settings: ServerSettings,
                 advertise_host: str | None = None, startup_timeout_s: float = 120.0) -> None:
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
        config = uvicorn.Config(self._app, log_config=None, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=drain_s)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"posttrain-judge-server-{self.port}")
        self._final_stats: dict | None = None
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                self._socket.close()
                raise RuntimeError(f"the judge server on {host}:{self.port} did not start "
                                   f"within {startup_timeout_s:g} s (see the log above)")
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
        """"ready", "draining", "failed" (the batcher died: every request gets 503) or
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
            self._server.should_exit = True   # uvicorn lets responses in progress finish
            limit = timeout_s + self.settings.drain_timeout_s + 60.0
            self._thread.join(limit)
            if self._thread.is_alive():
                raise RuntimeError(f"the judge server at {self.url} did not end within "
                                   f"{limit:g} s of stop() (see the log above)")
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
        return (f"JudgeServer(url={self.url!r}, state={self.state!r}, requests={s['requests']}, "
                f"batches={s['batches']}, queue_depth={s['queue_depth']})")

    def _repr_html_(self) -> str:
        s = self.stats()
        mean = s["completions"] / s["batches"] if s["batches"] else 0.0
        cells = {"url": self.url, "state": self.state, "requests": s["requests"],
                 "completions": s["completions"], "batches": s["batches"],
                 "mean batch": f"{mean:.1f}", "queue": f"{s['queue_depth']}/"
                 f"{self.settings.max_queue}", "429": s["rejected_full"], "504": s["timed_out"],
                 "expired": s["expired"],
                 "judge failures": s["judge_failures"]}
        head = "".join(f"<th>{html.escape(str(k))}</th>" for k in cells)
        body = "".join(f"<td>{html.escape(str(v))}</td>" for v in cells.values())
        return f"<table><tr>{head}</tr><tr>{body}</tr></table>"


def serve_judge(judge: Judge, *, host: str = "127.0.0.1", port: int = 0,
                advertise_host: str | None = None, settings: ServerSettings | None = None,
                **options: Any) -> JudgeServer:
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
        raise TypeError(f"judge must have a judge(completions, items) method; got "
                        f"{type(judge).__name__}")
    check_address(host, port, advertise_host)
    if settings is not None and not isinstance(settings, ServerSettings):
        raise TypeError(f"settings must be a ServerSettings; got {type(settings).__name__}")
    if settings is not None and options:
        raise ValueError(f"pass either settings= or its fields as keywords, not both "
                         f"({sorted(options)})")
    if settings is None:
        unknown = set(options) - set(ServerSettings.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown server options {sorted(unknown)}; allowed: "
                             f"{sorted(ServerSettings.__dataclass_fields__)}")
        settings = ServerSettings(**options)
    return JudgeServer(judge, host=host, port=port, settings=settings,
                       advertise_host=advertise_host)


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
            raise TypeError(f"JudgeJobSpec.judge must have a judge(completions, items) method; "
                            f"got {type(self.judge).__name__}")
        if not isinstance(self.settings, ServerSettings):
            raise TypeError(f"JudgeJobSpec.settings must be a ServerSettings; got "
                            f"{type(self.settings).__name__}")
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
    server = serve_judge(spec.judge, host=spec.host, port=spec.port,
                         advertise_host=spec.advertise_host, settings=spec.settings)
    record = {"url": server.url, "host": server.host, "port": server.port,
              "node": socket.gethostname(), "pid": os.getpid()}
    path = Path(spec.url_file)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    print(f"posttrain judge server: serving {server.url}", flush=True)
    try:
        while not Path(spec.stop_file).exists():
            if server.state in ("stopped", "failed"):
                raise RuntimeError(f"the judge server at {server.url} {server.state} by itself"
                                   f" ({server._batcher.failed or 'see the log'})")
            time.sleep(spec.poll_s)
    finally:
        stats = server.stop()
    print(f"posttrain judge server: stopped after {stats['requests']} requests", flush=True)
    return stats
