"""The judge server (FastAPI + uvicorn on 127.0.0.1) and its client verifier: served results
equal the in-process judge's, dynamic batching, 429 + Retry-After on a full queue, 504 and the
client's `timeout`, graceful shutdown that drains the queue, request ids judged once, typed
client failures, one request per GRPO group; bad input (a judge that returns garbage or raises
anything, a non-finite timeout, bad launch arguments or URLs) is a typed outcome or a named error.
(Load, and the server as a local or Slurm job: test_judge_server_jobs.py.)

The judge is real and tiny: `RewardModelJudge` on the `tiny-1m` reward model (`rm_judge`,
tests/rewards/conftest.py), or `LLMJudge` on an untrained tiny policy. `Gated` holds a real
judge back until the test opens its gate, so that queues can be filled at will; `Misbehaves` is
a judge that breaks its contract. Nothing is mocked, except the one internal bug that shows a
dead batcher answers rather than hangs.

No assertion is on elapsed time or on a transient state read without waiting: a test waits for
a state with `conftest.wait_for` (a generous deadline, a message naming the state), and every
deadline that is not the thing tested is generous (`HTTP_TIMEOUT_S`), so the tests pass on a
heavily loaded machine. That a failure comes at once rather than after a deadline is shown by what
the answer says (its outcome and reason), not by a clock."""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import httpx
import pytest
from _judge_helpers import HTTP_TIMEOUT_S, ITEM, Gated, post, scores
from _waits import wait_for

from posttrain.envs import JudgedGroupBuilder, chain_sum_task
from posttrain.launch.judge import launch_judge
from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.rewards import (
    JudgeResult,
    JudgeVerifier,
    LLMJudge,
    Outcome,
    RewardModel,
    RewardModelJudge,
    run_verifier,
)
from posttrain.rewards.judge_client import JudgeClient
from posttrain.rewards.judge_server import JUDGE_PATH, ServerSettings, serve_judge
from posttrain.rl import collect_groups

# The jobs cannot import this test module: its classes travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class RaisesOn:
    """A real judge that raises when it is asked about `bad`."""

    def __init__(self, inner, bad):
        self.inner, self.bad = inner, bad

    def judge(self, completions, items):
        if self.bad in completions:
            raise RuntimeError(f"cannot judge {self.bad!r}")
        return self.inner.judge(completions, items)


@pytest.fixture(scope="module")
def server(rm_judge):
    with serve_judge(rm_judge, max_wait_s=0.002) as server:
        yield server


# --------------------------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------------------------


def test_served_results_are_the_in_process_judges(server, rm_judge):
    texts = ["12", "13", "twelve", ""]
    served = server.client().judge(texts, [ITEM] * 4)
    local = rm_judge.judge(texts, [ITEM] * 4)
    assert scores(served) == pytest.approx(scores(local), abs=1e-5)
    assert [r.outcome for r in served] == [r.outcome for r in local]
    assert [r.raw_score for r in served] == pytest.approx([r.raw_score for r in local], abs=1e-5)
    [too_long] = server.client().judge(["x" * 600], [ITEM])  # a per-row error travels as is
    assert too_long.outcome is Outcome.ERROR and "max_seq_len is 512" in too_long.reason


def test_health_ready_and_stats_endpoints(server):
    assert httpx.get(server.url + "/health").json() == {"status": "alive"}
    assert httpx.get(server.url + "/ready").json() == {"status": "ready"}
    before = httpx.get(server.url + "/stats").json()["requests"]
    assert post(server.url, "stats-1", ["12", "13"]).status_code == 200
    stats = httpx.get(server.url + "/stats").json()
    assert stats["requests"] == before + 1 and stats["queue_depth"] == 0
    assert "<table>" in server._repr_html_() and server.url in repr(server)


def test_concurrent_requests_are_batched_and_each_gets_its_own_results(rm_judge):
    gated = Gated(rm_judge)
    work = [[f"{i}{j}" for j in range(3)] for i in range(6)]
    with (
        serve_judge(gated, max_batch_size=64, max_wait_s=0.0) as server,
        ThreadPoolExecutor(6) as pool,
    ):
        futures = [pool.submit(post, server.url, "batch-0", work[0])]
        wait_for(lambda: gated.calls, what="the first request in the judge")
        futures += [
            pool.submit(post, server.url, f"batch-{i}", texts)
            for i, texts in enumerate(work[1:], 1)
        ]
        wait_for(lambda: server.stats()["queue_depth"] == 5, what="the other five queued")
        gated.gate.set()
        answers = [f.result().json() for f in futures]
        stats = server.stats()
    for texts, answer in zip(work, answers):
        local = rm_judge.judge(texts, [ITEM] * 3)
        assert [r["score"] for r in answer["results"]] == pytest.approx(scores(local), abs=1e-5)
    assert max(a["batch"]["requests"] for a in answers) == 5  # the five waiting ones
    assert stats["batch_requests"] == {1: 1, 5: 1} and stats["batch_completions"] == {3: 1, 15: 1}
    assert [len(c) for c in gated.calls] == [3, 15]


def test_a_full_queue_answers_429_with_retry_after_and_the_client_retries(rm_judge):
    gated = Gated(rm_judge)
    with serve_judge(gated, max_queue=2, max_wait_s=0.0) as server, ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, server.url, "q0", ["12"])
        wait_for(lambda: gated.calls, what="q0 in the judge")
        queued = [pool.submit(post, server.url, f"q{i}", ["12"]) for i in (1, 2)]
        wait_for(lambda: server.stats()["queue_depth"] == 2, what="q1 and q2 queued")
        refused = post(server.url, "q3", ["12"])
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["retry_after_s"] > 0 and "queue is full" in refused.json()["detail"]
        retrying = pool.submit(
            JudgeClient(server.url, timeout_s=HTTP_TIMEOUT_S, retries=1000, backoff_s=0.02).judge,
            ["13"],
            [ITEM],
        )
        wait_for(
            lambda: server.stats()["rejected_full"] >= 2,
            what="the client's first try refused with 429 (after q3)",
        )
        gated.gate.set()
        assert [f.result().status_code for f in [first, *queued]] == [200, 200, 200]
        [result] = retrying.result()
        assert result.outcome in (Outcome.OK, Outcome.WRONG)


def test_per_request_timeout_is_504_and_the_clients_timeout_outcome(rm_judge):
    gated = Gated(rm_judge)
    with serve_judge(gated, max_wait_s=0.0) as server:  # the gate stays shut: nothing
        late = post(server.url, "slow", ["12"], timeout_s=0.3)  # is judged before it opens
        assert late.status_code == 504 and "not judged within 0.3 s" in late.json()["detail"]
        results = JudgeClient(server.url, timeout_s=0.5).judge(["12", "13"], [ITEM] * 2)
        assert [r.outcome for r in results] == [Outcome.TIMEOUT] * 2
        assert all("gave no judgement within 0.5 s" in r.reason and r.score == 0.0 for r in results)
        gated.gate.set()
        [after] = server.client(timeout_s=HTTP_TIMEOUT_S).judge(["12"], [ITEM])
        assert after.outcome in (Outcome.OK, Outcome.WRONG)


def test_graceful_shutdown_drains_the_queue(rm_judge):
    gated = Gated(rm_judge)
    server = serve_judge(gated, max_wait_s=0.0)
    with ThreadPoolExecutor(5) as pool:
        queued = [pool.submit(post, server.url, "d0", ["12", "13"])]
        wait_for(lambda: gated.calls, what="d0 in the judge")
        queued += [pool.submit(post, server.url, f"d{i}", ["12", "13"]) for i in (1, 2)]
        wait_for(lambda: server.stats()["queue_depth"] == 2, what="d1 and d2 queued")
        stopping = pool.submit(server.stop)
        wait_for(
            lambda: server.state == "draining",
            what="the server to start draining",
            detail=lambda: f"state {server.state!r}",
        )
        assert httpx.get(server.url + "/ready").json() == {"status": "draining"}
        refused = post(server.url, "late", ["12"])
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        gated.gate.set()
        assert [f.result().status_code for f in queued] == [200, 200, 200]
        final = stopping.result()
    assert final["requests"] == 3 and final["rejected_draining"] == 1
    assert server.state == "stopped"  # stop() returns once the server thread has ended
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


def test_requests_left_when_the_drain_time_runs_out_get_503(rm_judge):
    gated = Gated(rm_judge)
    server = serve_judge(gated, max_wait_s=0.0, drain_timeout_s=0.5)
    with ThreadPoolExecutor(3) as pool:
        queued = [pool.submit(post, server.url, "left0", ["12"])]
        wait_for(lambda: gated.calls, what="left0 in the judge")
        queued += [pool.submit(post, server.url, f"left{i}", ["12"]) for i in (1, 2)]
        wait_for(lambda: server.stats()["queue_depth"] == 2, what="left1 and left2 queued")
        final = server.stop()  # the gate is shut: nothing moves within the drain time
        answers = [f.result() for f in queued]
    gated.gate.set()
    assert [a.status_code for a in answers] == [503, 503, 503]
    assert all("stopped before judging" in a.json()["detail"] for a in answers)
    assert final["shut_down"] == 3 and final["requests"] == 0


def test_a_request_id_is_judged_once(server, rm_judge):
    before = server.stats()["requests"]
    first = post(server.url, "same-id", ["12", "13"]).json()
    again = post(server.url, "same-id", ["12", "13"]).json()
    assert first["replayed"] is False and again["replayed"] is True
    assert again["results"] == first["results"] and server.stats()["requests"] == before + 1
    client = server.client()
    assert scores(client.judge(["14"], [ITEM], request_id="same-id-2")) == scores(
        client.judge(["14"], [ITEM], request_id="same-id-2")
    )
    assert server.stats()["requests"] == before + 2


def test_a_raising_judge_fails_only_its_own_request(rm_judge):
    """r0 holds the judge while r1 (with "boom") and r2 queue; they then share one batch, which
    raises, and each is judged again alone."""
    gated = Gated(RaisesOn(rm_judge, "boom"))
    with serve_judge(gated, max_wait_s=0.0) as server, ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, server.url, "r0", ["12"])]
        wait_for(lambda: gated.calls, what="r0 in the judge")
        futures += [
            pool.submit(post, server.url, f"r{i}", texts)
            for i, texts in ((1, ["boom", "13"]), (2, ["14"]))
        ]
        wait_for(lambda: server.stats()["queue_depth"] == 2, what="r1 and r2 queued")
        gated.gate.set()
        answers = [f.result().json()["results"] for f in futures]
        assert server.stats()["judge_failures"] == 1
    assert sorted(gated.calls[1]) == ["13", "14", "boom"]  # one batch (in arrival order),
    assert len(gated.calls) == 4  # then each request alone
    assert [r["outcome"] for r in answers[1]] == ["error", "error"]
    assert answers[1][0]["reason"] == "judge raised RuntimeError: cannot judge 'boom'"
    assert {answers[0][0]["outcome"], answers[2][0]["outcome"]} <= {"ok", "wrong"}


def test_an_unparsable_verdict_is_error_in_process_and_served_alike():
    judge = LLMJudge(Policy.from_spec("tiny-1m", seed=0), "Is it correct?", max_new_tokens=6)
    local = judge.judge(["12", "13"], [ITEM] * 2)
    with serve_judge(judge) as server:
        served = server.client(timeout_s=HTTP_TIMEOUT_S).judge(["12", "13"], [ITEM] * 2)
    for r in (*local, *served):
        assert r.outcome is Outcome.ERROR and r.score == 0.0  # the judge's failure
        assert r.reason.startswith("no score found in judge output")
    assert [r.raw for r in served] == [r.raw for r in local]  # greedy: the same verdicts


def test_client_failures_are_typed_outcomes(server):
    with serve_judge(
        RewardModelJudge(RewardModel.from_spec("tiny-1m", seed=1), ByteTokenizer())
    ) as gone:
        url = gone.url
    [down] = JudgeClient(url, timeout_s=HTTP_TIMEOUT_S, retries=2, backoff_s=0.01).judge(
        ["12"], [ITEM]
    )
    assert down.outcome is Outcome.ERROR and "failed 3 attempts" in down.reason  # not a
    assert "ConnectError" in down.reason  # timeout: refused, and said so
    [refused] = JudgeClient(server.url, timeout_s=HTTP_TIMEOUT_S).judge([None], [ITEM])
    assert refused.outcome is Outcome.ERROR and "refused the request: HTTP 422" in refused.reason
    assert "body.completions.0: Input should be a valid string" in refused.reason  # not retried
    [bad_url] = JudgeClient("http://127.0.0.1:9", timeout_s=HTTP_TIMEOUT_S, retries=0).judge(
        ["1"], [ITEM]
    )
    assert bad_url.outcome is Outcome.ERROR and "ConnectError" in bad_url.reason
    with pytest.raises(ValueError, match="one item per completion"):
        JudgeClient(server.url).judge(["a", "b"], [ITEM])
    with pytest.raises(ValueError, match="url="):
        JudgeClient("127.0.0.1:80")
    with pytest.raises(ValueError, match="timeout_s=0"):
        JudgeClient(server.url, timeout_s=0)


def test_client_is_a_thread_isolated_picklable_verifier(server, rm_judge):
    client = server.client(timeout_s=HTTP_TIMEOUT_S)
    assert client.isolation == "thread" and JudgeVerifier.isolation == "thread"
    client.judge(["12"], [ITEM])  # opens its connection pool
    copy = pickle.loads(cloudpickle.dumps(client))
    result = run_verifier(copy, "12", ITEM, timeout_s=2 * HTTP_TIMEOUT_S)
    assert result.score == pytest.approx(rm_judge.judge(["12"], [ITEM])[0].score, abs=1e-5)


def test_a_grpo_group_is_one_request(server, rm_judge):
    builder = functools.partial(JudgedGroupBuilder, judge=server.client(timeout_s=HTTP_TIMEOUT_S))
    task = chain_sum_task(size=8, held_out_size=2, builder=builder)
    before = server.stats()
    groups = collect_groups(
        Policy.from_spec("tiny-1m", seed=0),
        task.builders(0, 2),
        group_size=4,
        max_new_tokens=4,
        seed=0,
    )
    after = server.stats()
    assert after["requests"] - before["requests"] == 2  # one per group
    assert after["completions"] - before["completions"] == 8
    for group, item in zip(groups, task.train_items[:2]):
        local = rm_judge.judge([t.text for t in group], [item] * 4)
        assert group.rewards == pytest.approx(scores(local), abs=1e-5)
        assert group.outcomes == [r.outcome.value for r in local]


def test_settings_are_validated_naming_the_field(rm_judge):
    with pytest.raises(ValueError, match=r"ServerSettings.max_batch_size=0; must be an integer"):
        ServerSettings(max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_s=-1"):
        ServerSettings(max_wait_s=-1)
    with pytest.raises(ValueError, match=r"ServerSettings.max_body_bytes=0; must be an integer"):
        ServerSettings(max_body_bytes=0)
    with pytest.raises(ValueError, match=r"ServerSettings.max_request_completions=1.5; must be"):
        ServerSettings(max_request_completions=1.5)
    with pytest.raises(ValueError, match=r"unknown server options \['batch'\]"):
        serve_judge(rm_judge, batch=3)
    with pytest.raises(TypeError, match="judge"):
        serve_judge(lambda c, i: 1.0)
    with pytest.raises(TypeError, match="judge"):
        JudgedGroupBuilder(ITEM, judge="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="executor='debug'"):
        launch_judge(rm_judge, executor="debug")


# --------------------------------------------------------------------------------------------
# Bad input: whatever a judge returns or raises, and malformed arguments
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Misbehaves:
    """A judge that raises `exc`, or else returns `JudgeResult(0.5, "wrong", raw_score=...)`."""

    raw_score: object = None
    exc: BaseException | None = None

    def judge(self, completions, items):
        if self.exc is not None:
            raise self.exc
        return [JudgeResult(0.5, "wrong", raw="x", raw_score=self.raw_score) for _ in completions]


@pytest.mark.parametrize(
    "judge",
    [
        Misbehaves("high"),
        Misbehaves(math.nan),
        Misbehaves(math.inf),
        Misbehaves([1.0]),
        Misbehaves(exc=SystemExit(3)),
        Misbehaves(exc=BaseException("x")),
        Misbehaves(exc=KeyboardInterrupt()),
    ],
    ids=repr,
)
def test_a_judge_that_returns_garbage_or_raises_anything_fails_only_that_request(judge):
    with serve_judge(judge, max_wait_s=0.0) as server:
        for _ in range(2):  # the batcher lives on: a second request is answered too
            results = server.client(timeout_s=HTTP_TIMEOUT_S, retries=0).judge(
                ["a", "b"], [ITEM] * 2
            )
            assert [r.outcome for r in results] == [Outcome.ERROR] * 2
            assert all(r.score == 0.0 and r.reason for r in results)
        assert server.state == "ready"
        assert httpx.get(server.url + "/ready").json() == {"status": "ready"}
        assert server.stats()["judge_failures"] == (0 if judge.exc is None else 2)
        assert ("raw_score=" if judge.exc is None else "judge raised") in results[0].reason
    assert server.state == "stopped"  # stop() returns once the server thread has ended
    with pytest.raises(httpx.ConnectError):  # the socket is closed
        httpx.get(server.url + "/health")


def test_a_dead_batcher_is_not_ready_and_answers_503_never_a_hang(monkeypatch):
    """An internal bug after a judge call (here `_record` raising) ends the batching task:
    the request in it and every later one get 503 at once, /ready says "failed"."""
    with serve_judge(Misbehaves(1.0), max_wait_s=0.0) as server:
        monkeypatch.setattr(server._batcher, "_record", lambda *a: 1 / 0)
        [lost] = server.client(timeout_s=HTTP_TIMEOUT_S, retries=0).judge(["12"], [ITEM])
        assert lost.outcome is Outcome.ERROR and "batcher failed" in lost.reason  # not timeout
        assert "ZeroDivisionError" in lost.reason
        later = post(server.url, "after", ["12"])
        assert later.status_code == 503 and "batcher failed" in later.json()["detail"]
        assert server.state == "failed"
        assert httpx.get(server.url + "/ready").json() == {"status": "failed"}
        final = server.stop()
    assert final["rejected_failed"] == 1 and final["shut_down"] == 1


@pytest.mark.parametrize("timeout", ["NaN", "Infinity", "-Infinity", "0", "-1", '"x"'])
def test_a_non_finite_or_non_positive_timeout_is_422(server, timeout):
    body = f'{{"request_id": "t", "completions": ["x"], "items": [{{}}], "timeout_s": {timeout}}}'
    response = httpx.post(
        server.url + JUDGE_PATH, content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert any(e["loc"][-1] == "timeout_s" for e in response.json()["detail"])
    nan_echo = '{"request_id": "t", "completions": [NaN], "items": [{}]}'  # input not echoed
    assert (
        httpx.post(
            server.url + JUDGE_PATH, content=nan_echo, headers={"content-type": "application/json"}
        ).status_code
        == 422
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"judge": lambda c, i: 1.0}, TypeError, "judge must have a judge"),
        ({"torch_threads": 0}, ValueError, "torch_threads=0"),
        ({"port": 70000}, ValueError, r"port=70000; must be an integer in 0..65535"),
        ({"port": -1}, ValueError, "port=-1"),
        ({"port": "80"}, ValueError, "port='80'"),
        ({"host": 0}, TypeError, "host=0"),
        ({"advertise_host": ""}, ValueError, "advertise_host"),
        ({"cpus_per_task": 0}, ValueError, "cpus_per_task=0"),
        ({"settings": {"max_queue": 1}}, TypeError, "settings must be a ServerSettings"),
        ({"batch": 3}, ValueError, r"unknown server options \['batch'\]"),
    ],
)
def test_launch_judge_checks_its_arguments_before_submitting(
    rm_judge, tmp_path, kwargs, error, match
):
    kwargs = {"judge": rm_judge, **kwargs}
    with pytest.raises(error, match=match):
        launch_judge(kwargs.pop("judge"), folder=tmp_path / "job", **kwargs)
    assert not (tmp_path / "job").exists()  # nothing was submitted
    if {"port", "host", "advertise_host"} & set(kwargs):
        with pytest.raises(error, match=match):
            serve_judge(rm_judge, **kwargs)


@pytest.mark.parametrize(
    "url, match",
    [
        ("http://[::1", "cannot be parsed"),
        ("http://no-port", "names no port"),
        ("http://127.0.0.1:0", "names no port"),
        ("http://h:99999", "cannot be parsed"),
        ("ftp://h:1", "must be the server's"),
        ("http://:80", "must be the server's"),
        ("http://h:1/?q=1", "query"),
        (None, "must be the server's"),
    ],
)
def test_client_rejects_a_url_it_could_not_call(url, match):
    with pytest.raises(ValueError, match=match):
        JudgeClient(url)
    assert JudgeClient("http://[::1]:8000/").url == "http://[::1]:8000"
