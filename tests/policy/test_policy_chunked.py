"""`Policy.logprobs_tensor(..., chunk_tokens=)` and `Policy.logprobs(..., chunk_tokens=)`: the head
and log-softmax over a few response tokens at a time equal the full-logits path (the independent
path: one [B, T, V] log-softmax) in fp32, values within 1e-6 and gradients within 1e-6 of their
largest magnitude (`assert_grads_close`: the tied embedding's reach ~12), under every sampling
setting (temperature, top_k, top_p, each applied per position as without chunks), on left-padded
rows of different lengths."""

import pytest
import torch
from _train_helpers import assert_grads_close

from posttrain.policy import Policy

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = [[257, 72, 105], [257, *range(40, 60)], [1]]
SETTINGS = [{"temperature": 1.0}, {"temperature": 1.3, "top_k": 7, "top_p": 0.8}]


@pytest.fixture(scope="module")
def policy():
    return Policy.from_spec("tiny-1m", seed=0)


def _rows(policy, settings):
    """Left-padded rows of each prompt and a completion sampled under `settings` (so every scored
    token is inside the top-k / top-p set: finite log-probs)."""
    completions = policy.generate(PROMPTS, max_new_tokens=6, seed=0, **settings)
    pairs = [(c.prompt_ids, c.token_ids) for c in completions]
    T = max(len(p) + len(r) for p, r in pairs)
    ids_BT = torch.zeros(len(pairs), T, dtype=torch.long)
    attention_BT = torch.zeros(len(pairs), T, dtype=torch.bool)
    response_BT = torch.zeros(len(pairs), T, dtype=torch.bool)
    for b, (p, r) in enumerate(pairs):
        ids_BT[b, T - len(p) - len(r) :] = torch.tensor([*p, *r])
        attention_BT[b, T - len(p) - len(r) :] = True
        response_BT[b, T - len(r) :] = True
    return pairs, ids_BT, attention_BT, response_BT


def _values_and_grads(policy, rows, settings, chunk_tokens):
    _, ids_BT, attention_BT, response_BT = rows
    policy.model.zero_grad(set_to_none=True)
    logprobs_BT = policy.logprobs_tensor(
        ids_BT, attention_BT, response_BT, chunk_tokens=chunk_tokens, **settings
    )
    weights_BT = torch.linspace(-1.0, 2.0, logprobs_BT.numel()).reshape(logprobs_BT.shape)
    (logprobs_BT * weights_BT).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    return logprobs_BT.detach(), grads


@pytest.mark.parametrize(
    "settings", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items())
)
def test_chunked_logprobs_and_gradients_equal_the_full_logits(policy, settings):
    rows = _rows(policy, settings)
    response_BT = rows[3]
    full, full_grads = _values_and_grads(policy, rows, settings, None)
    assert torch.isfinite(full[response_BT]).all() and (full[~response_BT] == 0).all()
    for chunk in (1, 4):  # one token a chunk, chunks that cut rows
        got, grads = _values_and_grads(policy, rows, settings, chunk)
        torch.testing.assert_close(got, full, atol=1e-6, rtol=0)
        assert_grads_close(list(full_grads.values()), list(grads.values()))
    pairs = rows[0]
    prompts, responses = [p for p, _ in pairs], [r for _, r in pairs]
    listed = policy.logprobs(prompts, responses, chunk_tokens=3, **settings)
    for b, lp in enumerate(policy.logprobs(prompts, responses, **settings)):
        torch.testing.assert_close(listed[b], lp, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_chunk_tokens_is_refused_by_name(policy, bad):
    ids_BT = torch.tensor([[1, 2, 3]])
    mask_BT = torch.tensor([[False, True, True]])
    with pytest.raises(ValueError, match=r"^chunk_tokens=.*None .* integer >= 1"):
        policy.logprobs_tensor(ids_BT, torch.ones_like(mask_BT), mask_BT, chunk_tokens=bad)
    with pytest.raises(ValueError, match=r"^chunk_tokens="):
        policy.logprobs([[1]], [[2, 3]], chunk_tokens=bad)
