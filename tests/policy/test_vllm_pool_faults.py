"""The vLLM pool's routing, retries and syncs (posttrain.policy.vllm_pool) against stand-in
servers (tests/_vllm_fake.py): real processes started by `VLLMServer.start` under the watchdog,
answering like vLLM with samples a test computes itself (`expected_ids`). They need no vLLM venv
and start in a second; tests/policy/test_vllm_pool.py runs the same pool on real vLLM servers.
"""

import os
import signal
import threading

import pytest
from _vllm_fake import expected_ids, fake_venv
from _waits import WAIT_S, wait_for

import posttrain.policy.vllm_pool as vllm_pool
from posttrain.policy import Policy
from posttrain.policy.vllm_pool import VLLMPool
from posttrain.policy.vllm_process import VLLMRequestError, VLLMServerError, group_alive

PROMPTS = [[1, 2, 3], [40, 41], [7] * 9, [100, 3, 5, 9]]


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy.from_spec("tiny-1m", seed=0)


@pytest.fixture
def pool(policy, tmp_path):
    venv = fake_venv(tmp_path / "venv")
    with VLLMPool.start(policy, tmp_path / "run", servers=2, venv=venv, max_concurrency=4) as pool:
        yield pool


def _digest(pool, k):
    """The weights digest server k answers with (the first sampled id), asked of it alone."""
    return pool.servers[k].generate([[1]], max_new_tokens=1, temperature=0)[0].token_ids[0]


def _expected(prompts, *, seed, n, temperature, max_new_tokens, digest):
    return [
        expected_ids(p, seed + i * n + j, temperature, max_new_tokens, digest)
        for i, p in enumerate(prompts)
        for j in range(n)
    ]


def _control(pool, k, name, text=""):
    (pool.servers[k].log_path.parent / name).write_text(text)


def test_a_call_is_spread_over_the_servers_and_answered_in_prompt_major_order(pool):
    digest = _digest(pool, 0)
    assert _digest(pool, 1) == digest  # both hold the same weights
    out = pool.generate(PROMPTS, n=3, max_new_tokens=5, temperature=1.0, seed=11)
    assert [(c.prompt_index, c.sample_index) for c in out] == [
        (i, j) for i in range(len(PROMPTS)) for j in range(3)
    ]
    assert [c.token_ids for c in out] == _expected(
        PROMPTS, seed=11, n=3, temperature=1.0, max_new_tokens=5, digest=digest
    )
    assert [c.prompt_ids for c in out] == [p for p in PROMPTS for _ in range(3)]
    assert {c.weight_version for c in out} == {0}
    assert pool.served[0] > 0 and pool.served[1] > 0 and sum(pool.served) == 12
    assert pool.stats == {
        "servers": 2, "live": 2, "dead": 0, "out_of_rotation": 0, "retries": 0,
        "sync_failures": 0, "requests": 12,
    }  # fmt: skip
    text = pool._repr_html_()
    assert text.count("<td>live</td>") == 2 and str(pool.servers[1].log_path) in text


def test_a_server_killed_during_a_call_has_its_requests_answered_by_the_other(pool):
    digest = _digest(pool, 0)
    _control(pool, 1, "delay_s", "600")  # server 1 holds every request it gets
    received = pool.servers[1].log_path.parent / "received"
    received.unlink(missing_ok=True)
    pgid = pool.servers[1].pgid

    def kill_when_busy():
        wait_for(received.exists, what="server 1 to receive a request", timeout=WAIT_S)
        os.killpg(pgid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    out = pool.generate(PROMPTS, n=4, max_new_tokens=6, temperature=0.7, seed=3)
    killer.join()
    assert [c.token_ids for c in out] == _expected(
        PROMPTS, seed=3, n=4, temperature=0.7, max_new_tokens=6, digest=digest
    )
    stats = pool.stats
    assert stats["dead"] == 1 and stats["live"] == 1 and stats["retries"] >= 1
    assert pool.served == [16, 0] and stats["requests"] == 16
    wait_for(lambda: not group_alive(pgid), what=f"process group {pgid} gone", timeout=WAIT_S)
    later = pool.generate(PROMPTS, max_new_tokens=3, temperature=0)  # later calls: server 0 only
    assert [c.token_ids for c in later] == _expected(
        PROMPTS, seed=0, n=1, temperature=0, max_new_tokens=3, digest=digest
    )
    assert "dead: " in pool._repr_html_() and "1 dead" in repr(pool)


def test_a_server_dead_between_calls_is_skipped_and_the_last_one_named_when_all_died(pool):
    os.killpg(pool.servers[0].pgid, signal.SIGKILL)
    wait_for(lambda: not pool.servers[0].alive, what="server 0 to exit", timeout=WAIT_S)
    out = pool.generate(PROMPTS, n=2, max_new_tokens=3, temperature=1.0, seed=5)
    assert len(out) == 8 and pool.served == [0, 8] and pool.stats["dead"] == 1
    os.killpg(pool.servers[1].pgid, signal.SIGKILL)
    with pytest.raises(VLLMServerError, match="all 2 vLLM servers of the pool died") as err:
        pool.generate(PROMPTS, max_new_tokens=3)
    for server in pool.servers:
        assert server.url in str(err.value) and str(server.log_path) in str(err.value)
    with pytest.raises(VLLMServerError, match="all 2 vLLM servers"):
        pool.sync_weights(Policy.from_spec("tiny-1m", seed=1))


def test_a_request_a_live_server_refuses_is_not_retried_and_is_named(pool, monkeypatch):
    real = vllm_pool.call_requests

    def one_bad_body(*args, **kwargs):
        prompt_ids, bodies = real(*args, **kwargs)
        bodies[3]["max_tokens"] = 0  # prompt 1, sample 1: vLLM answers 400
        return prompt_ids, bodies

    monkeypatch.setattr(vllm_pool, "call_requests", one_bad_body)
    with pytest.raises(VLLMRequestError, match=r"prompts\[1\] sample 1 failed on server") as err:
        pool.generate(PROMPTS, n=2, max_new_tokens=4)
    assert err.value.status == 400 and "max_tokens must be at least 1" in str(err.value)
    monkeypatch.setattr(vllm_pool, "call_requests", real)
    _control(pool, 0, "fail_500")  # an internal error on a server whose /health answers
    with pytest.raises(VLLMRequestError, match="which is up, so it was not retried") as err:
        pool.generate(PROMPTS, max_new_tokens=4)
    assert err.value.status == 500
    assert pool.stats["retries"] == 0 and pool.stats["live"] == 2


def test_an_answer_that_is_not_json_fails_the_call_and_frees_its_servers_slots(pool):
    _control(pool, 0, "garbage")
    _control(pool, 1, "garbage")
    failed, done = [], []

    def calls():  # a slot left taken would make a later call wait forever
        for _ in range(3):  # more failed requests than the servers' 2 x 4 slots
            with pytest.raises(ValueError):
                pool.generate(PROMPTS, n=2, max_new_tokens=2)
            failed.append(1)
        for k in (0, 1):
            (pool.servers[k].log_path.parent / "garbage").unlink()
        done.append(pool.generate(PROMPTS, n=4))

    thread = threading.Thread(target=calls, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert len(failed) == 3 and done, f"{len(failed)} failed calls, then no answer in {WAIT_S} s"
    assert len(done[0]) == 16 and pool.stats["live"] == 2 and pool.stats["retries"] == 0


def test_a_server_whose_sync_failed_is_never_sampled_until_a_sync_succeeds(pool):
    before = pool.generate(PROMPTS, max_new_tokens=4, temperature=0)
    _control(pool, 1, "fail_reload")
    sync = pool.sync_weights(Policy.from_spec("tiny-1m", seed=1))
    assert sync.version == pool.weight_version == 1
    assert sorted(sync.syncs) == [0] and "HTTP 500" in sync.failed[1]
    assert pool.stats["out_of_rotation"] == 1 and pool.stats["sync_failures"] == 1
    served_1 = pool.served[1]
    after = pool.generate(PROMPTS, n=4, max_new_tokens=4, temperature=0)
    assert pool.served[1] == served_1  # the stale server drew nothing
    digest = _digest(pool, 0)
    assert [c.token_ids for c in after] == _expected(
        PROMPTS, seed=0, n=4, temperature=0, max_new_tokens=4, digest=digest
    )
    assert after[0].token_ids != before[0].token_ids and {c.weight_version for c in after} == {1}
    assert "out of rotation: sync_weights failed" in pool._repr_html_()
    (pool.servers[1].log_path.parent / "fail_reload").unlink()
    assert pool.sync_weights(Policy.from_spec("tiny-1m", seed=1)).version == 2
    assert _digest(pool, 1) == _digest(pool, 0) and pool.stats["live"] == 2
    pool.generate(PROMPTS, n=4, max_new_tokens=4, temperature=0)
    assert pool.served[1] > served_1


def test_a_sync_that_failed_everywhere_stops_sampling(pool):
    _control(pool, 0, "fail_reload")
    _control(pool, 1, "fail_reload")
    with pytest.raises(VLLMServerError, match="sync_weights failed on every server"):
        pool.sync_weights(Policy.from_spec("tiny-1m", seed=2))
    assert pool.weight_version == 0
    with pytest.raises(VLLMServerError, match="no vLLM server of the pool holds the current"):
        pool.generate(PROMPTS, max_new_tokens=2)


def test_bad_arguments_are_refused_by_name(pool, policy, tmp_path):
    with pytest.raises(ValueError, match="differs from the served spec"):
        pool.sync_weights(Policy.from_spec("tiny-2m"))
    assert pool.stats["sync_failures"] == 0 and pool.weight_version == 0
    with pytest.raises(ValueError, match="repetition_penalty"):
        pool.generate(PROMPTS, repetition_penalty=1.1)
    with pytest.raises(ValueError, match="servers=0"):
        VLLMPool.start(policy, tmp_path, servers=0)
    with pytest.raises(ValueError, match="port"):
        VLLMPool.start(policy, tmp_path, port=8000)
    with pytest.raises(ValueError, match="servers is empty"):
        VLLMPool([])


def test_close_stops_every_server(pool):
    pgids = [s.pgid for s in pool.servers]
    pool.close()
    wait_for(
        lambda: not any(map(group_alive, pgids)),
        what=f"process groups {pgids} gone",
        timeout=WAIT_S,
    )
    with pytest.raises(VLLMServerError, match="closed"):
        pool.generate(PROMPTS)
