"""The client of a judge server (`posttrain.rewards.judge_server`): a `Judge` and a `Verifier`
with retries and a deadline, whose failures are typed outcomes.

`JudgeClient(url)` sends `judge(completions, items)` as ONE request (a GRPO group of G
completions is one request, `posttrain.envs.JudgedGroupBuilder`) and returns one
`JudgeResult` per completion, as the served judge gave it. It never raises for a server
problem; every completion of a request that could not be judged gets the same failure:

    ==================================  =====================  ==========================
    what happened                       retried?               outcome
    ==================================  =====================  ==========================
    connection refused / reset / lost   yes, with backoff      error (after the retries)
    429 queue full, 503 shutting down   yes, after Retry-After error (after the retries)
    other 5xx                           yes, with backoff      error (after the retries)
    the deadline passes first           no more tries          timeout
    504 (server: not judged in time)    while time remains     timeout
    413, 422, other 4xx; bad answer     no                     error
    ==================================  =====================  ==========================

Both failures are the checker's, never the policy's: RL excludes a group with an `error` or
`timeout` member and counts it (`posttrain.rl.trainer`). A judge's unparsable verdict comes
back as `error` too (`posttrain.rewards.judges`).

Retries reuse the request's id, so a retry after a lost response is answered from the server's
replay cache instead of judging again (`posttrain.rewards.judge_server`). The deadline
`timeout_s` covers the whole call, every attempt and wait included; the server is told what is
left of it, so it answers 504 rather than judge for nobody. Backoff: `backoff_s` x 2^k (k = 0,
1, ...), capped at `max_backoff_s`, times a random factor in [0.5, 1] ("full jitter" halved,
Brooker 2015, "Exponential Backoff And Jitter", AWS Architecture Blog), never past the deadline.

`isolation = "thread"`: `run_verifier` calls it on a thread (network I/O with its own deadline), not
in a worker process; there the smaller of `run_verifier`'s `timeout_s` and the client's deadline
applies (give the client the smaller one: its reason says what happened). It pickles (only the URL
and settings; each process opens its own connection pool), so it travels to Slurm jobs inside a
task's group builders.

Example (a server on 127.0.0.1; then the same client once the server is gone):
    >>> from posttrain.models import ByteTokenizer
    >>> from posttrain.rewards.judges import RewardModelJudge
    >>> from posttrain.rewards.judge_server import serve_judge
    >>> from posttrain.rewards.reward_model import RewardModel
    >>> server = serve_judge(RewardModelJudge(RewardModel.from_spec("tiny-1m", seed=0),
    ...                                       ByteTokenizer()))
    >>> client = JudgeClient(server.url, timeout_s=60.0, retries=1, backoff_s=0.01)
    >>> results = client.judge(["12", "13"], [{"question": "5+7="}] * 2)   # one request
    >>> [r.outcome.value in ("ok", "wrong") for r in results]
    [True, True]
    >>> _ = server.stop()
    >>> r = client("12", {"question": "5+7="})
    >>> r.outcome.value, r.score, r.reason.startswith("judge server at http://127.0.0.1:")
    ('error', 0.0, True)
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from posttrain.core.checks import check_int
from posttrain.rewards.judge_protocol import JudgeResult, _check_lengths
from posttrain.rewards.verifier import Outcome, VerifierResult

__all__ = ["JudgeClient", "JUDGE_PATH"]

JUDGE_PATH = "/v1/judge"
"""The judge server's endpoint (`posttrain.rewards.judge_server` serves it)."""

_RETRIED = {429, 500, 502, 503}


class JudgeClient:
    """Judges completions with a judge server (see the module docstring for the outcomes).

    Args:
        url: the server's base URL ("http://host:port", e.g. `JudgeServer.url` or
            `posttrain.launch.judge.JudgeJob.url`).
        timeout_s: deadline of one `judge` call in seconds, all attempts included (> 0).
        retries: attempts after the first (>= 0).
        backoff_s, max_backoff_s: the first wait between attempts and its cap, in seconds.
        connect_timeout_s: most seconds to open a connection, per attempt.

    Raises:
        ValueError: for a URL that is not http(s)://host:port (a host, a port 1..65535, no
            query or fragment; a path prefix is kept) or a setting out of range.
    """

    isolation = "thread"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        retries: int = 5,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        _check_url(url)
        check_int("retries", retries, minimum=0)
        for name, value in (
            ("timeout_s", timeout_s),
            ("backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
            ("connect_timeout_s", connect_timeout_s),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 < value < math.inf
            ):
                raise ValueError(f"{name}={value!r}; must be a finite number of seconds > 0")
        self.url = url.rstrip("/")
        self.timeout_s, self.retries = float(timeout_s), retries
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self._local()

    def _local(self) -> None:
        self._http: httpx.Client | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._random = random.Random()

    def __getstate__(self) -> dict:
        return {
            k: v for k, v in self.__dict__.items() if k not in ("_http", "_pid", "_lock", "_random")
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local()

    def _client(self) -> httpx.Client:
        with self._lock:
            if self._http is None or self._pid != os.getpid():
                self._http, self._pid = httpx.Client(), os.getpid()
            return self._http

    # ---------------------------------------------------------------- Judge and Verifier
    def judge(
        self,
        completions: Sequence[str],
        items: Sequence[Mapping[str, Any]],
        *,
        request_id: str | None = None,
    ) -> list[VerifierResult]:
        """One request for all completions; one result per completion, in order.

        `items` travel as JSON; a value JSON cannot hold is sent as its `str()`. `request_id`
        (default: a fresh UUID) names the request: the server judges an id once, so a caller
        that repeats a call with the same id gets the first judgement back.

        Raises:
            ValueError: if the two sequences differ in length (a bug of the caller), or
                `request_id` is not a str of 1 to 200 characters.
        """
        _check_lengths(completions, items)
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not (isinstance(request_id, str) and 1 <= len(request_id) <= 200):
            raise ValueError(f"request_id={request_id!r}; must be a str of 1 to 200 characters")
        if not completions:
            return []
        payload = {
            "request_id": request_id,
            "completions": list(completions),
            "items": [dict(item) if isinstance(item, Mapping) else item for item in items],
        }
        outcome, why = self._post(payload, len(completions))
        if isinstance(outcome, list):
            return outcome
        return [JudgeResult.failure(outcome, why)] * len(completions)

    def __call__(self, completion: str, item: Mapping[str, Any]) -> VerifierResult:
        """The `Verifier` protocol: judge one completion."""
        return self.judge([completion], [item])[0]

    # ---------------------------------------------------------------- the exchange
    def _post(self, payload: dict, n: int) -> tuple[Any, str]:
        """(results, "") or (Outcome.TIMEOUT | Outcome.ERROR, why)."""
        deadline = time.monotonic() + self.timeout_s
        http, endpoint = self._client(), self.url + JUDGE_PATH
        last, attempts = "no attempt", 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Outcome.TIMEOUT, (
                    f"judge server at {self.url} gave no judgement within "
                    f"{self.timeout_s:g} s ({attempts} attempts; last: "
                    f"{last})"
                )
            attempts += 1
            wait = self._backoff(attempts)
            body = json.dumps({**payload, "timeout_s": max(1e-3, 0.95 * remaining)}, default=str)
            try:
                response = http.post(
                    endpoint,
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=httpx.Timeout(
                        remaining, connect=min(self.connect_timeout_s, remaining)
                    ),
                )
            except httpx.TimeoutException as exc:
                last = f"{type(exc).__name__} after {remaining:.3g} s"
                if time.monotonic() >= deadline:
                    continue  # the loop reports the timeout
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status == 200:
                    return self._results(response, payload["request_id"], n), ""
                detail = _detail(response)
                last = f"HTTP {status}: {detail}"
                if status == 504:
                    continue
                if status not in _RETRIED:
                    return Outcome.ERROR, (
                        f"judge server at {self.url} refused the request: {last}"
                    )
                if status in (429, 503):
                    wait = max(wait, _retry_after(response))
            if attempts > self.retries:
                return Outcome.ERROR, (
                    f"judge server at {self.url} failed {attempts} attempts; last: {last}"
                )
            time.sleep(max(0.0, min(wait, deadline - time.monotonic())))

    def _backoff(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return base * (0.5 + 0.5 * self._random.random())

    def _results(self, response: httpx.Response, request_id: str, n: int) -> list:
        """The results of a 200 answer; every completion `error` when the answer is malformed."""

        def failed(why: str) -> list:
            return [
                JudgeResult.failure(
                    Outcome.ERROR, f"judge server at {self.url} sent a malformed answer: {why}"
                )
            ] * n

        try:
            answer = response.json()
            results = answer["results"]
        except (ValueError, KeyError, TypeError) as exc:
            return failed(f"{type(exc).__name__}: {exc}")
        if answer.get("request_id") != request_id:
            return failed(f"it answers request {answer.get('request_id')!r}, not {request_id!r}")
        if not isinstance(results, list) or len(results) != n:
            return failed(
                f"{len(results) if isinstance(results, list) else results!r} results "
                f"for {n} completions"
            )
        out = []
        for r in results:
            try:
                out.append(
                    JudgeResult(
                        r["score"],
                        r["outcome"],
                        r.get("reason", ""),
                        raw=r.get("raw", ""),
                        raw_score=r.get("raw_score"),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                out.append(JudgeResult.failure(Outcome.ERROR, f"malformed result {r!r:.80}: {exc}"))
        return out

    # ---------------------------------------------------------------- probes
    def ready(self, timeout_s: float = 2.0) -> bool:
        """True when the server answers GET /ready with 200 within `timeout_s`."""
        try:
            return self._client().get(self.url + "/ready", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def stats(self, timeout_s: float = 5.0) -> dict:
        """The server's GET /stats (raises httpx.HTTPError if it cannot be read)."""
        response = self._client().get(self.url + "/stats", timeout=timeout_s)
        response.raise_for_status()
        return response.json()

    def __repr__(self) -> str:
        return f"JudgeClient({self.url!r}, timeout_s={self.timeout_s:g}, retries={self.retries})"


def _check_url(url: Any) -> None:
    """Raise ValueError unless `url` is http(s)://host:port[/path], parsed as httpx will."""
    must = "must be the server's http://host:port (e.g. JudgeServer.url)"
    if not isinstance(url, str):
        raise ValueError(f"url={url!r}; {must}")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        raise ValueError(f"url={url!r} cannot be parsed ({exc}); {must}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url={url!r}; {must}")
    if port is None or port == 0:
        raise ValueError(f"url={url!r} names no port (1..65535); {must}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"url={url!r} has a query, fragment or user; {must}")


def _detail(response: httpx.Response) -> str:
    """The server's `detail`; a 422's list of errors as "body.items.3.question: msg; ..."."""
    try:
        detail = response.json().get("detail", "")
    except (ValueError, AttributeError):
        detail = response.text
    if isinstance(detail, list):
        try:
            detail = "; ".join(".".join(str(p) for p in e["loc"]) + f": {e['msg']}" for e in detail)
        except (KeyError, TypeError):
            pass
    return str(detail)[:300]


def _retry_after(response: httpx.Response) -> float:
    """Seconds the server asks to wait: the body's `retry_after_s` estimate, else the
    Retry-After header (whole seconds), else 0."""
    try:
        return float(response.json()["retry_after_s"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        return float(response.headers.get("retry-after", 0))
    except ValueError:
        return 0.0
