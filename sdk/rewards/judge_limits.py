"""What the judge server (`posttrain.rewards.judge_server`) accepts: its `ServerSettings` (the
batching, queue, time and size limits), the address it listens on (`check_address`), and each
request, checked before any work is queued: the size of its body, counted while it is read and
before any of it is parsed; then valid UTF-8 JSON of the right shape; at most
`max_request_completions` completions; an item with a string `question` for each completion;
and text that is valid Unicode throughout.

Why each limit exists:

- Body size (413). Parsing JSON costs far more memory than its bytes: a 50 MB body of short
  strings took ~1 GB of server memory as Python objects before anything looked at it. So the
  bytes are counted as they arrive (`BodyLimit`, an ASGI middleware in front of the app): a
  declared `Content-Length` over the limit is refused without reading, a chunked body is refused
  at the first chunk that passes it, and at most the limit plus one chunk is ever held.
- Completions per request (422). One request is judged in pieces of `max_batch_size`, each
  between other requests' batches (`posttrain.rewards.judge_batcher`), so a large one cannot
  hold the judge; the cap bounds the memory and the queue time one request may claim.
- Unicode (422). JSON can spell a lone surrogate (`"\\ud800"`), which Python decodes into a str
  that no UTF-8 encoder takes: a judge's tokenizer fails on it and the answer can fail to
  encode. Such text is refused with where it is, never judged as an error outcome with 200.
  Only a `\\uD800`-`\\uDFFF` escape can put one in a strictly decoded body, so a body without
  one is not searched; one with one is checked in C and searched by bisection.

Every refusal names the field (`loc`, as FastAPI does: ["body", "items", 3, "question"]) and
the limit or the allowed values, and never echoes the input (it may not encode).

Example:
    >>> body = parse_request(b'{"request_id": "r1", "completions": ["12"], '
    ...                      b'"items": [{"question": "5 + 7 ="}]}', max_request_completions=8)
    >>> body.request_id, body.completions, body.items[0]["question"]
    ('r1', ['12'], '5 + 7 =')
    >>> try:
    ...     parse_request(b'{"request_id": "r2", "completions": ["\\\\ud800"], '
    ...                   b'"items": [{"question": "q"}]}', max_request_completions=8)
    ... except RequestValidationError as exc:
    ...     [error] = exc.errors()
    >>> error["loc"], error["type"]
    (['body', 'completions', 0], 'lone_surrogate')
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from posttrain.core.checks import check_fields, require_int, require_positive

__all__ = [
    "ServerSettings",
    "check_address",
    "BodyLimit",
    "JudgeBody",
    "parse_request",
    "validation_error_response",
]

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a surrogate code point. Strict UTF-8 decoding refuses encoded surrogates, so
only such an escape can put one in the parsed body: without one, no string need be searched."""


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """How the judge server batches, queues and times out.

    Attributes:
        max_batch_size: completions per judge call (a request that fits, e.g. a group of G, is
            never split; a larger one is judged in pieces of this size).
        max_wait_s: a batch waits for more requests until this many seconds after its first
            one arrived (the latency cost of batching; 0 = take what is queued and go).
        max_queue: requests that may wait for a batch; beyond it, 429 + Retry-After.
        request_timeout_s: most seconds a request waits for its judgement (a request may ask for
            less with `timeout_s`); beyond it, 504.
        drain_timeout_s: at shutdown, seconds to finish what is queued before refusing it (503).
        replay_cache: answers kept by request id for retries (>= 1).
        max_body_bytes: largest request body in bytes, counted while it is read, before it is
            parsed; beyond it, 413 (default 8 MiB: JSON takes ~20x its size in memory once
            parsed).
        max_request_completions: most completions in one request; beyond it, 422 (send them in
            several requests).

    Raises:
        ValueError: naming the field, the value and its range, for a value outside the range
            or not a number (then a `posttrain.core.checks.FieldTypeError`, a TypeError too).
    """

    max_batch_size: int = 64
    max_wait_s: float = 0.005
    max_queue: int = 256
    request_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    replay_cache: int = 4096
    max_body_bytes: int = 8 * 2**20
    max_request_completions: int = 1024

    def __post_init__(self) -> None:
        require_int(
            self,
            (
                "max_batch_size",
                "max_queue",
                "replay_cache",
                "max_body_bytes",
                "max_request_completions",
            ),
            minimum=1,
        )
        require_positive(self, ("request_timeout_s", "drain_timeout_s"))
        check_fields(self, ("max_wait_s",), low=0, note="seconds")


def _surrogate_at(text: str) -> int:
    """Index of the first lone surrogate in `text`, which `_encodes` found to hold one."""
    found = _SURROGATE.search(text)
    assert found is not None, "the text encodes; no surrogate to point at"
    return found.start()


def check_address(host: Any, port: Any, advertise_host: Any = None) -> None:
    """Raise TypeError/ValueError, naming the argument, unless `host` is a non-empty str,
    `port` an int in 0..65535 (0: the system picks) and `advertise_host` None or a non-empty
    str. Used by `serve_judge` and `JudgeJobSpec` (so a job is checked before it is queued)."""
    for name, value, optional in (("host", host, False), ("advertise_host", advertise_host, True)):
        if optional and value is None:
            continue
        if not isinstance(value, str):
            raise TypeError(
                f"{name}={value!r}; must be a str such as '127.0.0.1' or '0.0.0.0'"
                + (" or None" if optional else "")
            )
        if not value.strip():
            raise ValueError(f"{name}={value!r}; must be a non-empty host name or address")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r}; must be an integer in 0..65535 (0: a free port)")


class JudgeBody(BaseModel):
    """The body of POST /v1/judge once it has passed `parse_request`."""

    request_id: str = Field(min_length=1, max_length=200)
    completions: list[str]
    items: list[dict[str, Any]]
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


def _refuse(loc: list, msg: str, kind: str) -> RequestValidationError:
    return RequestValidationError([{"loc": loc, "msg": msg, "type": kind}])


def parse_request(raw: bytes, *, max_request_completions: int) -> JudgeBody:
    """Parse and check the raw body of a judge request (its size was checked by `BodyLimit`).

    Args:
        raw: the body's bytes (UTF-8 JSON).
        max_request_completions: most completions one request may carry.

    Returns:
        The `JudgeBody`: one item (a JSON object with a string `question`) per completion, every
        string valid Unicode.

    Raises:
        RequestValidationError: (422) with one error {loc, msg, type}: not UTF-8, not JSON
            (nested too deeply included),
            more completions than `max_request_completions` (type "too_many_completions",
            checked before the rest of the body), a lone surrogate anywhere ("lone_surrogate"),
            a field of the wrong type or range (pydantic's), completions and items of different
            lengths, or an item without a string `question`.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(
            ["body"],
            f"not UTF-8: byte {exc.start} ({raw[exc.start]:#04x}) cannot be decoded",
            "utf8_invalid",
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _refuse(["body", exc.pos], f"JSON decode error: {exc.msg}", "json_invalid") from None
    except RecursionError:  # arrays or objects nested ~1,000 deep: a few KB of "[[[["
        raise _refuse(["body"], "JSON nested too deeply to decode", "json_too_deep") from None
    completions = data.get("completions") if isinstance(data, dict) else None
    if isinstance(completions, list) and len(completions) > max_request_completions:
        raise _refuse(
            ["body", "completions"],
            f"{len(completions)} completions in one request; this server takes at most "
            f"{max_request_completions} (ServerSettings.max_request_completions): send "
            "them in several requests",
            "too_many_completions",
        )
    try:
        where = _lone_surrogate(data, ["body"]) if _SURROGATE_ESCAPE.search(text) else None
    except RecursionError:  # decoded near the limit, then one level deeper to serialise
        raise _refuse(["body"], "JSON nested too deeply to check", "json_too_deep") from None
    if where is not None:
        loc, index = where
        raise _refuse(
            loc,
            f"a lone surrogate at character {index}: text must be valid Unicode "
            "(a surrogate pair's halves must come together)",
            "lone_surrogate",
        )
    try:
        body = JudgeBody.model_validate(data)
    except RecursionError:
        raise _refuse(["body"], "JSON nested too deeply to check", "json_too_deep") from None
    except ValidationError as exc:
        raise RequestValidationError(
            [{"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        ) from None
    if len(body.completions) != len(body.items):
        raise _refuse(
            ["body", "items"],
            f"{len(body.completions)} completions but "
            f"{len(body.items)} items; need one item per completion",
            "length_mismatch",
        )
    for i, item in enumerate(body.items):
        question = item.get("question")
        if not isinstance(question, str):
            raise _refuse(
                ["body", "items", i, "question"],
                f"must be a string (the question the completion answers); got "
                f"{'nothing' if question is None else type(question).__name__}",
                "string_type",
            )
    return body


def _encodes(data: Any) -> bool:
    """True when every string of the parsed JSON `data` encodes as UTF-8 (checked in C)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_failing(values: list) -> int:
    """Index of the first element of `values` that does not encode (there is one): bisection,
    each half checked by `_encodes`, so about twice one serialisation, in C."""
    lo, hi = 0, len(values)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _encodes(values[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def _lone_surrogate(value: Any, loc: list) -> tuple[list, int] | None:
    """(where, character index) of the first surrogate code point in any string of the parsed
    JSON `value` (object keys included), or None. In a Python str every surrogate is a lone one:
    a pair decodes to one character."""
    if _encodes(value):
        return None
    while not isinstance(value, str):
        if isinstance(value, dict):
            keys = list(value)
            if not _encodes(keys):
                key = keys[_first_failing(keys)]
                return [*loc, "(key)"], _surrogate_at(key)
            key = keys[_first_failing([value[k] for k in keys])]
            value, loc = value[key], [*loc, key]
        else:
            index = _first_failing(value)
            value, loc = value[index], [*loc, index]
    return loc, _surrogate_at(value)


def validation_error_response(request: Any, exc: RequestValidationError) -> JSONResponse:
    """422 for a malformed body: where and what, without echoing the input (it may hold NaN,
    Infinity or a lone surrogate, which JSON cannot send). Keys that are not valid Unicode are
    shown escaped."""

    def part(p: Any) -> Any:
        return p if isinstance(p, int) else str(p).encode("utf-8", "backslashreplace").decode()

    errors = [
        {
            "loc": [part(p) for p in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    return JSONResponse({"detail": errors}, status_code=422)


class BodyLimit:
    """ASGI middleware: a request whose body is over `max_body_bytes` gets 413 before the app
    (and any JSON parser) sees a byte of it.

    A declared `Content-Length` over the limit is refused at once, unread; any other body
    (chunked too) is read and counted chunk by chunk, and refused at the chunk that passes the
    limit, so at most `max_body_bytes` plus one chunk is held. A body within the limit is handed
    to the app whole. The 413 keeps the connection open: uvicorn (h11) reads and drops the rest
    of an answered request's body without holding it, so the client reads the 413 instead of a
    reset connection.

    Args:
        app: the ASGI app behind it.
        max_body_bytes: the largest body accepted, in bytes (>= 1).
        on_refuse: called (no arguments) for each 413, e.g. to count them.
    """

    def __init__(
        self, app: Any, max_body_bytes: int, on_refuse: Callable[[], None] | None = None
    ) -> None:
        self.app, self.max_body_bytes, self.on_refuse = app, max_body_bytes, on_refuse

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send, f"Content-Length is {int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body ended: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send, f"{size} bytes read so far")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        handed = False

        async def replay() -> dict:
            nonlocal handed
            if handed:
                return await receive()  # http.disconnect, when the client goes
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any, seen: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse()
        detail = (
            f"request body too large: {seen}; this server takes at most "
            f"{self.max_body_bytes} bytes (ServerSettings.max_body_bytes)"
        )
        await JSONResponse(
            {"detail": detail, "max_body_bytes": self.max_body_bytes}, status_code=413
        )(scope, receive, send)
