"""Policy: KV-cache sampling vs an independent no-cache loop, sampler vs scorer log-probs, stop
handling, seeding and input validation.

Shape legend: B = batch, T = tokens, V = vocabulary.

`drawn_policy` (tests/_policy_helpers.py) draws every parameter itself (std 0.1; RMSNorm scales
1), so the tests do not depend on `build_model`'s initialisation: varied greedy outputs, sampled
tokens of 3-5 nats, logits small enough that float32 rounding between the KV-cache and
full-sequence paths stays below 1e-5.
"""

import math

import pytest
import torch
from _policy_helpers import drawn_policy

from posttrain.models import ByteTokenizer
from posttrain.policy import Completion, Policy, sampling_logprobs

EOS, END = ByteTokenizer.EOS, ByteTokenizer.END
PROMPTS = [
    "Hello world",
    "ab",
    [ByteTokenizer.BOS, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def policy() -> Policy:
    return drawn_policy()


def _naive_greedy(policy: Policy, prompt_ids: list[int], max_new_tokens: int):
    """Independent reference: one unpadded sequence, full forward every step, no KV cache."""
    ids, logprobs = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits_V = policy.model(torch.tensor([ids]))[0, -1]
            token = int(logits_V.argmax())
            logprobs.append(float(torch.log_softmax(logits_V, -1)[token]))
            ids.append(token)
            if token in policy.tokenizer.stop_ids:
                break
    return ids[len(prompt_ids) :], logprobs


def test_sampling_logprobs_hand_computed():
    """logits [2, 0], T=0.5 -> [4, 0] -> -log(1 + e^-4) = -0.018150 (untempered: -0.126928).
    probs [.5, .3, .2], top_p=0.7 keeps {.5, .3}: log(.5/.8) = -0.470004, log(.3/.8) = -0.980829.
    top_p=0.5 keeps only the first token (mass before the second already reaches 0.5)."""
    logits = torch.tensor([2.0, 0.0])
    tempered = sampling_logprobs(logits, temperature=0.5)
    assert tempered[0].item() == pytest.approx(-0.018150, abs=1e-6)
    assert sampling_logprobs(logits)[0].item() == pytest.approx(-0.126928, abs=1e-6)
    # greedy reports the untempered distribution
    assert sampling_logprobs(logits, temperature=0)[0].item() == pytest.approx(-0.126928, abs=1e-6)
    assert sampling_logprobs(logits, top_k=1).tolist() == [0.0, -math.inf]

    logits_V = torch.tensor([0.5, 0.3, 0.2]).log()
    nucleus = sampling_logprobs(logits_V, top_p=0.7)
    assert nucleus[:2].tolist() == pytest.approx([-0.470004, -0.980829], abs=1e-6)
    assert nucleus[2].item() == -math.inf
    assert sampling_logprobs(logits_V, top_p=0.5).tolist() == [0.0, -math.inf, -math.inf]
    # top-k then top-p, on a batch: shape kept, rows independent
    logits_2V = torch.stack([logits_V, logits_V.flip(0)])
    both = sampling_logprobs(logits_2V, top_k=2, top_p=0.9)
    assert both.shape == (2, 3) and both.dtype == torch.float32
    assert both[0].exp()[:2].tolist() == pytest.approx([0.625, 0.375])
    assert both[1].flip(0).tolist() == both[0].tolist()


def test_greedy_kv_cache_equals_naive_loop(policy):
    """Mixed-length, left-padded prompts with a KV cache == one-at-a-time full recomputation."""
    completions = policy.generate(PROMPTS, max_new_tokens=12, temperature=0)
    for c in completions:
        tokens, logprobs = _naive_greedy(policy, c.prompt_ids, 12)
        assert c.token_ids == tokens
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(logprobs), atol=1e-5)
        assert c.finish_reason == ("eos" if tokens[-1] in (EOS, END) else "length")


def test_shared_prompts_are_prefilled_once_and_each_row_decodes_its_own_prompt(policy):
    """Prefix sharing: n samples of a prompt, and the same prompt given twice among others,
    share one prefill; every row still equals the one-at-a-time full recomputation of its own
    prompt (a row mapped to another prompt's cache would not)."""
    prompts = ["ab", "12345 + 6 =", "ab", "x"]
    completions = policy.generate(prompts, n=2, max_new_tokens=8, temperature=0)
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert completions[0].prompt_ids == completions[4].prompt_ids != completions[2].prompt_ids
    for c in completions:
        tokens, logprobs = _naive_greedy(policy, c.prompt_ids, 8)
        assert c.token_ids == tokens
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(logprobs), atol=1e-5)


def test_greedy_batched_equals_unbatched(policy):
    """Same completions alone or in a batch, also when rows finish early and leave the batch."""
    prompts = PROMPTS + ["x", "zz top", "12345678901234567890"]
    kwargs = dict(max_new_tokens=16, temperature=0, stop=["A", ";"])
    batched = policy.generate(prompts, **kwargs)
    alone = [policy.generate([p], **kwargs)[0] for p in prompts]
    lengths = [len(c.token_ids) for c in batched]
    # rows stop early at different steps, so finished rows leave the batch (KV-cache compaction)
    assert len({n for n in lengths if n < 16}) >= 2 and max(lengths) == 16
    for b, a in zip(batched, alone):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5)


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=40, top_p=0.9), dict(temperature=0)],
)
def test_sampler_logprobs_equal_recomputation(policy, settings):
    """On-policy the PPO/GRPO ratio is exactly 1: scorer == sampler <= 1e-5."""
    completions = policy.generate(PROMPTS, n=3, max_new_tokens=10, seed=7, **settings)
    assert len(completions) == 12
    recomputed = policy.logprobs(
        [c.prompt_ids for c in completions], [c.token_ids for c in completions], **settings
    )
    for c, lp in zip(completions, recomputed):
        assert lp.dtype == torch.float32 and lp.shape == (len(c.token_ids),)
        assert torch.isfinite(lp).all()
        assert (lp - torch.tensor(c.logprobs)).abs().max() <= 1e-5


def test_logprobs_batched_equal_unbatched_and_tensor_variant_keeps_graph(policy):
    prompt_ids = [[257, 72, 105], [257] + list(range(40, 60)), [1]]
    response_ids = [[101, 102, 103, 104], [33], [5, 6, 7, 8, 9, 10, 11]]
    batched = policy.logprobs(prompt_ids, response_ids, temperature=0.8, top_k=50)
    for p, r, lp in zip(prompt_ids, response_ids, batched):
        [alone] = policy.logprobs([p], [r], temperature=0.8, top_k=50)
        assert torch.allclose(lp, alone, atol=1e-5)
    assert policy.logprobs([[1, 2]], [[]])[0].shape == (0,)

    # differentiable variant, left-padded layout (exercises the padding-mask path)
    T = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    input_ids_BT = torch.zeros(3, T, dtype=torch.long)
    attention_BT = torch.zeros(3, T, dtype=torch.bool)
    response_BT = torch.zeros(3, T, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        start = T - len(p) - len(r)
        input_ids_BT[b, start:] = torch.tensor(p + r)
        attention_BT[b, start:] = True
        response_BT[b, T - len(r) :] = True
    logprobs_BT = policy.logprobs_tensor(
        input_ids_BT, attention_BT, response_BT, temperature=0.8, top_k=50
    )
    assert logprobs_BT.shape == (3, T) and logprobs_BT.requires_grad
    assert (logprobs_BT[~response_BT] == 0).all()
    for b, r in enumerate(response_ids):
        assert torch.allclose(logprobs_BT[b, T - len(r) :].detach(), batched[b], atol=1e-5)
    logprobs_BT.sum().backward()
    assert policy.model.tok_embeddings.weight.grad.abs().sum() > 0
    policy.model.zero_grad(set_to_none=True)


def _counting_policy(eos_after: str = "f") -> Policy:
    """A policy whose model deterministically continues each byte with the next byte ('a' -> 'b'),
    and `eos_after` with EOS: a forward hook overwrites the logits."""
    policy = Policy.from_spec("tiny-1m", seed=0)

    def hook(module, args, kwargs, logits_BTV):
        tokens_BT = args[0]
        nxt_BT = torch.where(tokens_BT == ord(eos_after), EOS, (tokens_BT + 1) % 256)
        out = torch.zeros_like(logits_BTV)
        return out.scatter(-1, nxt_BT[..., None], 30.0)

    policy.model.register_forward_hook(hook, with_kwargs=True)
    return policy


def test_finish_reasons_eos_stop_length():
    policy = _counting_policy()
    eos, stop, length, at_limit = policy.generate(
        ["a", "hi", "w", [1] * (policy.spec.max_seq_len - 3)],
        max_new_tokens=8,
        temperature=1.0,
        stop=["lm", "zzz"],
        seed=0,
    )
    # 'a' -> b c d e f <eos>: the stop token is kept in token_ids, dropped from text
    assert eos.token_ids == [98, 99, 100, 101, 102, EOS]
    assert (eos.text, eos.finish_reason) == ("bcdef", "eos")
    # 'hi' -> j k l m: stop string "lm" completes on 'm'; text cut before it, tokens kept
    assert stop.token_ids == list(b"jklm")
    assert (stop.text, stop.finish_reason) == ("jk", "stop")
    assert (length.text, length.finish_reason) == ("xyz{|}~\x7f", "length")
    # prompt + new tokens never exceed max_seq_len
    assert (len(at_limit.token_ids), at_limit.finish_reason) == (3, "length")
    for c in (eos, stop, length, at_limit):
        assert len(c.logprobs) == len(c.token_ids)  # finished sequences are no longer scored
        assert all(abs(x) < 1e-5 for x in c.logprobs)  # logit 30 vs 0: p ~ 1


def test_prompt_major_order_and_completion_fields(policy):
    completions = policy.generate(["a", [257, 98]], n=3, max_new_tokens=3, seed=1)
    assert [(c.prompt_index, c.sample_index) for c in completions] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert completions[0].prompt_ids == [ByteTokenizer.BOS, 97]  # str prompts get BOS
    assert completions[3].prompt_ids == [257, 98]  # token ids taken as they are
    assert isinstance(completions[0], Completion)
    with pytest.raises(AttributeError):
        completions[0].text = "x"  # frozen


def test_seed_reproducible_and_global_rng_untouched(policy):
    state = torch.get_rng_state()
    a = policy.generate(PROMPTS, n=2, max_new_tokens=8, seed=123)
    b = policy.generate(PROMPTS, n=2, max_new_tokens=8, seed=123)
    c = policy.generate(PROMPTS, n=2, max_new_tokens=8, seed=124)
    assert torch.equal(torch.get_rng_state(), state)
    assert a == b
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # seed=None follows the global RNG
    torch.manual_seed(5)
    d = policy.generate(PROMPTS, max_new_tokens=8)
    torch.manual_seed(5)
    assert policy.generate(PROMPTS, max_new_tokens=8) == d


def _attention_state(model):
    return [
        (a.num_kv_heads, a._attention_call, a.kv_cache, a.cache_enabled)
        for a in (layer.attn for layer in model.layers)
    ]


def test_restores_model_state_also_after_an_error():
    policy = drawn_policy()
    before = _attention_state(policy.model)
    policy.model.train()
    policy.generate(["a"], max_new_tokens=2)
    policy.logprobs([[1]], [[2]])
    assert policy.model.training and _attention_state(policy.model) == before
    policy.model.eval()
    policy.generate(["a"], max_new_tokens=2)
    assert not policy.model.training

    calls = []

    def fail_on_third_call(module, args, output):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")

    handle = policy.model.register_forward_hook(fail_on_third_call)
    policy.model.train()
    with pytest.raises(RuntimeError, match="boom"):
        policy.generate(["a", "bc"], max_new_tokens=5)
    handle.remove()
    assert policy.model.training and _attention_state(policy.model) == before
    assert not policy.model.caches_are_setup()
    policy.generate(["a"], max_new_tokens=2)  # usable again


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[]), "prompts"),
        (dict(prompts="hello"), "prompts"),
        (dict(prompts=[""]), r"prompts\[0\]"),
        (dict(prompts=["a", []]), r"prompts\[1\]"),
        (dict(prompts=[[1, 999]]), r"prompts\[0\].*999"),
        (dict(prompts=[[1] * 512]), r"prompts\[0\] has 512 tokens.*511"),
        (dict(temperature=-0.1), "temperature=-0.1"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=0), "top_k=0"),
        (dict(n=0), "n=0"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(stop=[""]), "stop"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_generate_bad_input(policy, kwargs, match):
    kwargs = {"prompts": ["hi"], **kwargs}
    with pytest.raises(ValueError, match=match):
        policy.generate(kwargs.pop("prompts"), **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([[1]], [[2], [3]]), {}, "len"),
        (([], []), {}, "empty"),
        (([[]], [[2]]), {}, r"prompt_ids\[0\]"),
        (([[1]], [[2] * 512]), {}, "max_seq_len"),
        (([[1]], [[2]]), dict(top_p=0), "top_p"),
        (([[1]], [[2]]), dict(temperature=-1), "temperature"),
    ],
)
def test_logprobs_bad_input(policy, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        policy.logprobs(*args, **kwargs)


def test_repr_save_and_from_pretrained(policy, tmp_path):
    assert repr(policy) == (
        "Policy(family=qwen2, params=1.02M, vocab=272, layers=4, device=cpu, dtype=float32)"
    )
    assert policy.num_parameters() == policy.spec.num_parameters()
    policy.save(tmp_path)
    loaded = Policy.from_pretrained(tmp_path)
    assert loaded.spec == policy.spec and isinstance(loaded.tokenizer, ByteTokenizer)
    a = policy.generate(PROMPTS, max_new_tokens=6, temperature=0)
    b = loaded.generate(PROMPTS, max_new_tokens=6, temperature=0)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    # transformers opens the folder's tokenizer with the byte tokenizer's ids (utf-8 bytes,
    # special ids 257 <|bos|>, 260 <|user|>, 262 <|end|>, 261 <|assistant|>).
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert auto.encode("héllo", add_special_tokens=False) == list("héllo".encode())
    chat = auto.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=True
    )
    assert list(chat["input_ids"]) == [257, 260, 104, 105, 262, 261]
