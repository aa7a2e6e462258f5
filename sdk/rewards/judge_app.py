"""The judge server's HTTP application (FastAPI): the endpoints, a request id judged once, and
the answers it gives, over a `Batcher` (`posttrain.rewards.judge_batcher`). It knows nothing of
where it runs: `posttrain.rewards.judge_server` hosts it (uvicorn on a thread of this process,
or as a job) and stops it.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from posttrain.rewards.judge_batcher import Batcher, JudgeRequest, ServerShutDown
from posttrain.rewards.judge_client import JUDGE_PATH
from posttrain.rewards.judge_limits import (
    BodyLimit,
    ServerSettings,
    parse_request,
    validation_error_response,
)

if TYPE_CHECKING:
    from posttrain.rewards.judge_protocol import Judge

__all__ = ["build_app"]


def _refusal(status: int, detail: str, retry_after_s: float) -> JSONResponse:
    return JSONResponse(
        {"detail": detail, "retry_after_s": round(retry_after_s, 3)},
        status_code=status,
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


def _response(request_id: str, output: Any) -> dict:
    return {
        "request_id": request_id,
        "results": output.results,
        "batch": {
            "id": output.batch_id,
            "requests": output.batch_requests,
            "completions": output.batch_completions,
        },
        "queue_s": round(output.queue_s, 6),
        "judge_s": round(output.judge_s, 6),
    }


def build_app(judge: Judge, settings: ServerSettings = ServerSettings()) -> tuple[FastAPI, Batcher]:
    """The FastAPI app serving `judge` (the HTTP API of the module docstring) and its `Batcher`
    (started and closed by the app's lifespan)."""
    batcher = Batcher(
        judge,
        max_batch_size=settings.max_batch_size,
        max_wait_s=settings.max_wait_s,
        max_queue=settings.max_queue,
    )
    answered: OrderedDict[str, dict] = OrderedDict()  # request id -> response body
    in_flight: dict[str, JudgeRequest] = {}
    state = {"ready": False}
    counters = {
        "replayed": 0,
        "joined": 0,
        "timed_out": 0,
        "rejected_too_large": 0,
        "rejected_invalid": 0,
    }

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
        body = parse_request(
            await http.body(), max_request_completions=settings.max_request_completions
        )
        if body.request_id in answered:
            counters["replayed"] += 1
            return {**answered[body.request_id], "replayed": True}
        timeout_s = min(settings.request_timeout_s, body.timeout_s or math.inf)
        deadline = time.monotonic() + timeout_s
        request = in_flight.get(body.request_id)
        if request is not None:  # a retry waits for the same judgement, and as long
            counters["joined"] += 1
            request.deadline = max(request.deadline, deadline)
        else:
            request = JudgeRequest(body.request_id, body.completions, body.items, deadline=deadline)
            refused = batcher.offer(request)
            if refused is not None:
                why, retry_after_s = refused
                detail = {
                    "draining": "the judge server is shutting down",
                    "failed": f"the judge batcher failed ({batcher.failed})",
                    "full": f"the judge queue is full ({settings.max_queue} requests wait)",
                }[why]
                return _refusal(429 if why == "full" else 503, detail, retry_after_s)
            in_flight[body.request_id] = request
            request.future.add_done_callback(functools.partial(remember, body.request_id))
        request.waiters += 1
        try:
            output = await asyncio.wait_for(asyncio.shield(request.future), timeout_s)
        except TimeoutError:
            if request.waiters == 1 and not batcher.is_judging(request):
                request.future.cancel()  # still queued and nobody else waits: drop it now
            return timed_out(timeout_s)  # (between two pieces, the batcher drops the rest)
        except asyncio.CancelledError:
            if not request.future.cancelled():  # this handler itself is being cancelled
                raise
            return timed_out(timeout_s)  # the batcher dropped it as its deadline passed
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
        status = (
            "failed"
            if batcher.failed is not None
            else "draining"
            if batcher.draining
            else "starting"
        )
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/stats")
    async def stats() -> dict:
        return {**batcher.stats(), **counters}

    app.state.batcher, app.state.counters = batcher, counters
    return app, batcher
