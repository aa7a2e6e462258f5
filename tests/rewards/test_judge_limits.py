"""What the judge server accepts, and how long one request may hold its judge.

A body over `max_body_bytes` is 413 before anything parses it (a declared Content-Length and a
chunked body alike); more completions than `max_request_completions` is 422 naming the limit;
text that is not valid Unicode (a lone surrogate anywhere, bytes that are not UTF-8) and an item
without a string question are 422 naming where. A request larger than a batch is judged in
pieces between other requests' batches, and what is left of a request nobody waits for any more
(its deadline passed) is dropped, so one client holds the others up by one batch at most.

The judge is the real tiny `RewardModelJudge`; `Gated` holds a batch in it until the test opens the
gate, so every order below is forced, never timed. `rm_judge` is tests/rewards/conftest.py's.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _judge_helpers import HTTP_TIMEOUT_S, ITEM, Gated, post, scores
from _waits import wait_for

from posttrain.rewards import Outcome
from posttrain.rewards.judge_client import JudgeClient
from posttrain.rewards.judge_server import JUDGE_PATH, serve_judge

LIMIT = 4096  # bytes of body this module's server takes
CAP = 4  # completions per request it takes
HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(rm_judge):
    with serve_judge(
        rm_judge, max_wait_s=0.0, max_body_bytes=LIMIT, max_request_completions=CAP
    ) as server:
        yield server


def body_of(n_bytes: int, request_id: str = "fits") -> bytes:
    """A valid request (one completion) padded in an extra item field to exactly `n_bytes`."""
    base = json.dumps(
        {"request_id": request_id, "completions": ["12"], "items": [{**ITEM, "pad": ""}]}
    ).encode()
    body = base.replace(b'"pad": ""', b'"pad": "' + b"x" * (n_bytes - len(base)) + b'"')
    assert len(body) == n_bytes
    return body


# --------------------------------------------------------------------------------------------
# Size and count
# --------------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_parsed(server):
    """LIMIT bytes pass and LIMIT + 1 do not; an oversized body that is not even JSON gets 413,
    not 422 (nothing parsed it); a chunked body (no Content-Length) is counted as it arrives,
    and one within the limit is judged; the client's connection serves the next request."""
    before = server.stats()
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as http:
        url = server.url + JUDGE_PATH
        assert http.post(url, content=body_of(LIMIT), headers=HEADERS).status_code == 200
        over = http.post(url, content=body_of(LIMIT + 1, "over"), headers=HEADERS)
        assert over.status_code == 413 and over.json()["max_body_bytes"] == LIMIT
        assert over.json()["detail"] == (
            f"request body too large: Content-Length is {LIMIT + 1} bytes; this server takes "
            f"at most {LIMIT} bytes (ServerSettings.max_body_bytes)"
        )
        not_json = http.post(url, content=b"{" * (10 * LIMIT), headers=HEADERS)
        assert not_json.status_code == 413
        chunked = http.post(url, content=iter([b"[" * 1000] * 50), headers=HEADERS)
        assert chunked.request.headers["transfer-encoding"] == "chunked"
        assert chunked.status_code == 413 and "read so far" in chunked.json()["detail"]
        fits = body_of(LIMIT, "chunked-fits")
        within = http.post(url, content=iter([fits[:100], fits[100:]]), headers=HEADERS)
        assert within.request.headers["transfer-encoding"] == "chunked"
        assert within.status_code == 200 and within.json()["request_id"] == "chunked-fits"
        assert http.post(url, content=body_of(200, "next"), headers=HEADERS).status_code == 200
    after = server.stats()
    assert after["rejected_too_large"] - before["rejected_too_large"] == 3
    assert after["requests"] - before["requests"] == 3


def test_more_completions_than_the_cap_is_422_naming_it(server):
    """CAP + 1 completions are refused before the rest of the body is looked at (here it has no
    items at all); CAP are judged; the client reports the refusal as an error naming the cap."""
    too_many = httpx.post(
        server.url + JUDGE_PATH,
        json={"request_id": "many", "completions": ["1"] * (CAP + 1)},
        timeout=HTTP_TIMEOUT_S,
    )
    assert too_many.status_code == 422
    [error] = too_many.json()["detail"]
    assert error["loc"] == ["body", "completions"] and error["type"] == "too_many_completions"
    assert error["msg"].startswith(
        f"{CAP + 1} completions in one request; this server takes at "
        f"most {CAP} (ServerSettings.max_request_completions)"
    )
    assert post(server.url, "cap", ["1"] * CAP).status_code == 200
    results = server.client(timeout_s=HTTP_TIMEOUT_S).judge(["1"] * (CAP + 1), [ITEM] * (CAP + 1))
    assert [r.outcome for r in results] == [Outcome.ERROR] * (CAP + 1)
    assert "HTTP 422: body.completions: 5 completions in one request" in results[0].reason


# --------------------------------------------------------------------------------------------
# Text and items
# --------------------------------------------------------------------------------------------


def _body(completion='"12"', item='{"question": "5 + 7 ="}', request_id='"r"') -> bytes:
    return (
        f'{{"request_id": {request_id}, "completions": [{completion}], "items": [{item}]}}'
    ).encode()


BAD = {  # body -> (loc, type) of the one error
    "lone high surrogate": (_body(r'"12\ud800"'), ["body", "completions", 0], "lone_surrogate"),
    "lone low surrogate": (_body(r'"\udc00"'), ["body", "completions", 0], "lone_surrogate"),
    "pair reversed": (_body(r'"\udc00\ud800"'), ["body", "completions", 0], "lone_surrogate"),
    "the first of several": (
        _body(r'"ok", "x\udc00", "\ud800"'),
        ["body", "completions", 1],
        "lone_surrogate",
    ),
    "in the question": (
        _body(item=r'{"question": "5 + \ud800"}'),
        ["body", "items", 0, "question"],
        "lone_surrogate",
    ),
    "in a nested item value": (
        _body(item=r'{"question": "q", "meta": {"a": ["ok", "\ud83d"]}}'),
        ["body", "items", 0, "meta", "a", 1],
        "lone_surrogate",
    ),
    "in an item key": (
        _body(item=r'{"question": "q", "\ud800": 1}'),
        ["body", "items", 0, "(key)"],
        "lone_surrogate",
    ),
    "in the request id": (_body(request_id=r'"r\udfff"'), ["body", "request_id"], "lone_surrogate"),
    "surrogate as UTF-8 bytes": (_body().replace(b"12", b"\xed\xa0\x80"), ["body"], "utf8_invalid"),
    "not UTF-8": (_body().replace(b"12", b"1\xff"), ["body"], "utf8_invalid"),
    "question a number": (
        _body(item='{"question": 5}'),
        ["body", "items", 0, "question"],
        "string_type",
    ),
    "question null": (
        _body(item='{"question": null}'),
        ["body", "items", 0, "question"],
        "string_type",
    ),
    "question a list": (
        _body(item='{"question": ["q"]}'),
        ["body", "items", 0, "question"],
        "string_type",
    ),
    "no question": (
        _body(item='{"answer": "12"}'),
        ["body", "items", 0, "question"],
        "string_type",
    ),
    "item not an object": (_body(item='"q"'), ["body", "items", 0], "dict_type"),
    "nested 1,500 deep": (
        _body(item='{"question": "q", "x": ' + "[" * 1500 + "]" * 1500 + "}"),
        ["body"],
        "json_too_deep",
    ),  # json.loads' RecursionError was a 500
}


@pytest.mark.parametrize("name", BAD)
def test_text_that_is_not_unicode_or_an_item_without_a_string_question_is_422(server, name):
    body, loc, kind = BAD[name]
    before = server.stats()
    response = httpx.post(
        server.url + JUDGE_PATH, content=body, headers=HEADERS, timeout=HTTP_TIMEOUT_S
    )
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert (error["loc"], error["type"]) == (loc, kind)
    after = server.stats()
    assert after["rejected_invalid"] - before["rejected_invalid"] == 1
    assert after["requests"] == before["requests"]  # nothing was judged


def test_a_surrogate_pair_is_valid_text_and_judged_as_in_process(server, rm_judge):
    """The escaped pair \\ud83d\\ude00 is one character (U+1F600), and an escaped backslash
    before "ud800" is those six characters: both are judged, equal to the judge in this process
    on that text. The client sends a lone surrogate escaped; it is refused."""
    for i, (escaped, text) in enumerate(
        ((r'"ok \ud83d\ude00"', "ok \U0001f600"), (r'"\\ud800"', "\\ud800"))
    ):
        answer = httpx.post(
            server.url + JUDGE_PATH,
            content=_body(escaped, request_id=f'"p{i}"'),
            headers=HEADERS,
            timeout=HTTP_TIMEOUT_S,
        )
        assert answer.status_code == 200
        [local] = rm_judge.judge([text], [{"question": "5 + 7 ="}])
        assert answer.json()["results"][0]["score"] == pytest.approx(local.score, abs=1e-5)
    [refused] = JudgeClient(server.url, timeout_s=HTTP_TIMEOUT_S).judge(["a\ud800"], [ITEM])
    assert refused.outcome is Outcome.ERROR
    assert "HTTP 422: body.completions.0: a lone surrogate at character 1" in refused.reason


# --------------------------------------------------------------------------------------------
# Pieces and deadlines
# --------------------------------------------------------------------------------------------


def test_a_large_request_is_judged_in_pieces_between_other_requests(rm_judge):
    """max_batch_size 4: "big" (10 completions) starts with a piece of 4; "small" arrives while
    that piece is in the judge and goes next, before the rest of big (4, then 2). Big's results
    are the in-process judge's on all 10, in order; its answer names its last piece's batch."""
    gated = Gated(rm_judge)
    big, small = [f"{i} + 1" for i in range(10)], ["12"]
    with (
        serve_judge(gated, max_batch_size=4, max_wait_s=0.0) as server,
        ThreadPoolExecutor(2) as pool,
    ):
        big_answer = pool.submit(post, server.url, "big", big)
        wait_for(lambda: gated.calls, what="big's first piece in the judge")
        small_answer = pool.submit(post, server.url, "small", small)
        wait_for(lambda: server.stats()["queue_depth"] == 1, what="small queued")
        gated.gate.set()
        big_json, small_json = big_answer.result().json(), small_answer.result().json()
        stats = server.stats()
    assert gated.calls == [big[0:4], small, big[4:8], big[8:10]]
    local = rm_judge.judge(big, [ITEM] * 10)
    assert [r["score"] for r in big_json["results"]] == pytest.approx(scores(local), abs=1e-5)
    assert big_json["batch"] == {"id": 4, "requests": 1, "completions": 2}
    assert small_json["batch"] == {"id": 2, "requests": 1, "completions": 1}
    assert stats["requests"] == 2 and stats["completions"] == 11
    assert stats["batch_completions"] == {4: 2, 1: 1, 2: 1} and stats["expired"] == 0


def test_what_is_left_of_a_request_whose_deadline_passed_is_dropped(rm_judge):
    """max_batch_size 2: "late" (6 completions, timeout 0.5 s) has its first piece in the judge
    and "queued" waits behind it, both until their 504s; the judge then takes "next", never the
    other 4 of late nor queued: the next client waited one batch, not four."""
    gated = Gated(rm_judge)
    late = [f"{i} + 1" for i in range(6)]
    with (
        serve_judge(gated, max_batch_size=2, max_wait_s=0.0) as server,
        ThreadPoolExecutor(3) as pool,
    ):
        late_answer = pool.submit(post, server.url, "late", late, timeout_s=0.5)
        wait_for(lambda: gated.calls, what="late's first piece in the judge")
        queued_answer = pool.submit(post, server.url, "queued", ["99"], timeout_s=0.5)
        assert late_answer.result().status_code == 504  # the gate is shut: nothing is judged
        assert queued_answer.result().status_code == 504
        next_answer = pool.submit(post, server.url, "next", ["12"])
        wait_for(lambda: server.stats()["queue_depth"] == 2, what="next queued behind queued")
        gated.gate.set()
        assert next_answer.result().status_code == 200
        stats = server.stats()
    assert gated.calls == [late[0:2], ["12"]]
    assert stats["expired"] == 2 and stats["expired_completions"] == 4 + 1
    assert stats["timed_out"] == 2 and stats["requests"] == 1


def test_a_retry_that_joins_a_request_moves_its_deadline(rm_judge):
    """The first try of "joined" gets its 504 with its first piece in the judge; the retry
    (same id, a later deadline) joins it, so the rest is judged and the retry gets all of it."""
    gated = Gated(rm_judge)
    texts = ["1", "2", "3", "4"]
    with (
        serve_judge(
            gated, max_batch_size=2, max_wait_s=0.0, request_timeout_s=HTTP_TIMEOUT_S
        ) as server,
        ThreadPoolExecutor(2) as pool,
    ):
        first = pool.submit(post, server.url, "joined", texts, timeout_s=0.5)
        wait_for(lambda: gated.calls, what="the first piece in the judge")
        assert first.result().status_code == 504
        retry = pool.submit(post, server.url, "joined", texts)
        wait_for(lambda: server.stats()["joined"] == 1, what="the retry to join the request")
        gated.gate.set()
        answer = retry.result()
        stats = server.stats()
    assert answer.status_code == 200 and gated.calls == [texts[0:2], texts[2:4]]
    local = rm_judge.judge(texts, [ITEM] * 4)
    assert [r["score"] for r in answer.json()["results"]] == pytest.approx(scores(local), abs=1e-5)
    assert stats["expired"] == 0 and stats["requests"] == 1
