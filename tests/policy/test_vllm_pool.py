"""The vLLM pool (posttrain.policy.vllm_pool) on two real vLLM servers of the tiny model: one
pool for the module, over the suite's shared server (`vllm_server`, attached: `VLLMServer.attach`)
as server 0 and a server the module starts as server 1 (it is killed: a fault the shared server
must not take; ~1-2 minutes on a loaded 2-core machine, mostly imports). The tests run in file
order: the last two take the servers out one by one (server 1 killed; server 0's handle pointed
at the dead server's port, which is how a server started elsewhere that died looks to the pool),
and closing the pool leaves the shared server running.

Skipped without the vLLM venv (run scripts/vllm-up.sh). References are independent of the pool:
greedy tokens from `Policy.generate`, sampled tokens from one server alone with the same seed,
log-probs from `Policy.logprobs`. tests/policy/test_vllm_pool_faults.py covers the same logic on
stand-in servers in seconds.
"""

import os
import signal
import threading

import pytest
import torch
from _policy_helpers import drawn_policy
from _waits import WAIT_S, wait_for

import posttrain.policy.vllm_pool as vllm_pool
from posttrain.policy import Policy
from posttrain.policy.vllm_pool import VLLMPool
from posttrain.policy.vllm_process import (
    VLLMRequestError,
    VLLMServerError,
    group_alive,
    vllm_unavailable_reason,
)
from posttrain.policy.vllm_server import VLLMServer

REASON = vllm_unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

PROMPTS = ["Hello world", "ab", "The quick brown fox", "1 + 1 =", [1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def policy() -> Policy:
    return drawn_policy(0)


@pytest.fixture(scope="module")
def pool(policy, vllm_server, tmp_path_factory):
    shared = VLLMServer.attach(vllm_server.url, policy)  # loads policy's weights: version 0
    try:
        own = VLLMServer.start(policy, tmp_path_factory.mktemp("run") / "server-1")
    except BaseException:
        shared.close()
        raise
    with VLLMPool([shared, own]) as pool:
        yield pool


def _ids(completions):
    return [c.token_ids for c in completions]


def test_results_equal_one_servers_for_the_same_seeds(pool, policy):
    greedy = pool.generate(PROMPTS, max_new_tokens=16, temperature=0)
    assert _ids(greedy) == _ids(policy.generate(PROMPTS, max_new_tokens=16, temperature=0))
    settings = {"n": 3, "max_new_tokens": 12, "temperature": 1.0, "seed": 7}
    sampled = pool.generate(PROMPTS, **settings)
    assert pool.served[0] > 0 and pool.served[1] > 0  # the call was spread
    for server in pool.servers:
        assert _ids(sampled) == _ids(server.generate(PROMPTS, **settings))
    assert len({tuple(ids) for ids in _ids(sampled)}) > len(PROMPTS)  # the n samples differ
    ref = policy.logprobs([c.prompt_ids for c in sampled], _ids(sampled), temperature=1.0)
    for c, r in zip(sampled, ref):
        torch.testing.assert_close(torch.tensor(c.logprobs), r, rtol=0, atol=1e-4)
    assert "server-1" in pool._repr_html_() and "2 live" in repr(pool)


def test_a_failed_sync_takes_a_server_out_until_a_sync_succeeds(pool, monkeypatch):
    new = drawn_policy(1)
    expected = _ids(new.generate(PROMPTS, max_new_tokens=12, temperature=0))
    real_post = pool.servers[1]._post

    def failing_reload(path, body):
        if path == "/collective_rpc":
            raise VLLMServerError("reload refused")
        return real_post(path, body)

    monkeypatch.setattr(pool.servers[1], "_post", failing_reload)
    sync = pool.sync_weights(new)
    assert sync.version == pool.weight_version == 1 and sorted(sync.syncs) == [0]
    assert "reload refused" in sync.failed[1] and pool.stats["out_of_rotation"] == 1
    served_1 = pool.served[1]
    out = pool.generate(PROMPTS, max_new_tokens=12, temperature=0)
    assert _ids(out) == expected and {c.weight_version for c in out} == {1}
    assert pool.served[1] == served_1  # never sampled with the old weights
    monkeypatch.setattr(pool.servers[1], "_post", real_post)
    assert pool.sync_weights(new).version == 2 and pool.stats["live"] == 2
    out = pool.generate(PROMPTS * 2, max_new_tokens=12, temperature=0)
    assert _ids(out) == expected * 2 and pool.served[1] > served_1


def test_a_request_a_server_refuses_is_not_retried(pool, monkeypatch):
    real = vllm_pool.call_requests

    def one_bad_body(*args, **kwargs):
        prompt_ids, bodies = real(*args, **kwargs)
        bodies[1]["max_tokens"] = 0
        return prompt_ids, bodies

    monkeypatch.setattr(vllm_pool, "call_requests", one_bad_body)
    with pytest.raises(VLLMRequestError, match=r"prompts\[0\] sample 1 failed on server") as err:
        pool.generate(PROMPTS, n=2, max_new_tokens=4)
    assert err.value.status == 400
    assert pool.stats["retries"] == 0 and pool.stats["live"] == 2


def test_a_server_killed_during_a_call_has_its_requests_retried_on_the_other(pool):
    settings = {"n": 4, "max_new_tokens": 48, "temperature": 1.0, "seed": 21}
    alone = pool.servers[0].generate(PROMPTS * 2, **settings)
    pgid = pool.servers[1].pgid

    def kill_when_busy():
        # pool._outstanding: requests in flight per server, read to kill server 1 mid-call
        wait_for(lambda: pool._outstanding[1] >= 2, what="server 1 busy", timeout=WAIT_S)
        os.killpg(pgid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    out = pool.generate(PROMPTS * 2, **settings)
    killer.join()
    assert _ids(out) == _ids(alone)
    assert [(c.prompt_index, c.sample_index) for c in out] == [
        (i, j) for i in range(2 * len(PROMPTS)) for j in range(4)
    ]
    stats = pool.stats
    assert stats["dead"] == 1 and stats["live"] == 1 and stats["retries"] >= 1
    wait_for(lambda: not group_alive(pgid), what=f"process group {pgid} gone", timeout=WAIT_S)


def test_when_every_server_died_the_error_names_them_and_their_logs(pool, policy, monkeypatch):
    """Server 1 died in the test above. Server 0 is the shared server, attached: the pool knows
    it by its URL alone, so it dies to the pool as a URL nothing answers (server 1's dead port).
    Closing the pool stops what it started and leaves the attached shared server running."""
    dead_url = pool.servers[1].url
    monkeypatch.setattr(pool.servers[0], "url", dead_url)
    with pytest.raises(VLLMServerError, match="all 2 vLLM servers of the pool died") as err:
        pool.generate(PROMPTS, max_new_tokens=4)
    assert str(pool.servers[1].log_path) in str(err.value)
    assert f"started elsewhere (attached at {dead_url}): its log is there" in str(err.value)
    assert pool.stats["dead"] == 2 and "where it was started" in pool._repr_html_()
    shared = pool.servers[0]
    monkeypatch.undo()
    pool.close()
    assert shared.attached and not shared.alive  # the handle closed ...
    with VLLMServer.attach(shared.url, policy) as again:  # ... the server still answers
        greedy = again.generate(PROMPTS, max_new_tokens=8, temperature=0)
    assert _ids(greedy) == _ids(policy.generate(PROMPTS, max_new_tokens=8, temperature=0))
