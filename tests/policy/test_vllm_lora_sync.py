"""A LoRA or QLoRA policy served by vLLM (posttrain.policy.vllm_servable.served_policy, used by
`VLLMServer.start` and `sync_weights`): the server gets W + (alpha / rank) * B @ A as new tensors,
the trained model is left bit for bit as it was, and nothing saved aliases an adapter that a
later optimizer step changes.

References are independent of the merge: the merged weights against the formula written out
here, and the server's greedy tokens and sampled log-probs against the LoRA policy's own
`Policy.generate` / `Policy.logprobs` (its unmerged forward, W x + s B (A x)). The adapters are
drawn nonzero (B ~ N(0, 0.1^2), scale alpha / rank = 2), so the LoRA policy's greedy outputs
differ from its base's and a server left on the base would fail. The server tests use the
session's shared tiny-1m server (`vllm_server` in tests/conftest.py).
"""

import copy

import pytest
import torch
from _policy_helpers import drawn_policy

from posttrain.models.lora import LoRAConfig
from posttrain.policy import Policy
from posttrain.policy.vllm_servable import served_policy
from posttrain.train.converters import convert_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Hello world", "ab", "The quick brown fox", "1 + 1 =", [1, 2, 3, 4, 5, 6, 7, 8, 9]]
MODULES = ("q_proj", "v_proj", "w1")
QLORA_MODULES = ("q_proj", "output_proj")  # NF4 takes weights of 16,384k elements (not v_proj)
RANK, ALPHA = 4, 8.0  # scale 2


def lora_policy(seed: int = 0, *, quantize_base: bool = False) -> Policy:
    """drawn_policy(seed) converted as a trainer converts it (`convert_model`), adapters drawn
    nonzero from a generator of their own."""
    policy = drawn_policy(seed)
    modules = QLORA_MODULES if quantize_base else MODULES
    config = LoRAConfig(rank=RANK, alpha=ALPHA, modules=modules, quantize_base=quantize_base)
    convert_model(policy.model, [config], spec=policy.spec)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in sorted(policy.model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy


def snapshot(policy: Policy) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict, cloned (an NF4 base dequantised)."""
    return {
        k: (v.get_original_weight() if hasattr(v, "get_original_weight") else v).clone()
        for k, v in policy.model.state_dict().items()
    }


def adam_step_on_adapters(policy: Policy) -> None:
    """One AdamW step on the adapters (the parameters that train) against a real loss."""
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.05)
    logits = policy.model(torch.tensor([[1, 5, 9, 13, 17, 21]]))
    logits.float().logsumexp(-1).mean().backward()
    optimizer.step()


# ----------------------------------------------------------------------------- without a server
def test_merged_weights_follow_the_formula_as_new_tensors():
    policy = lora_policy(0)
    before = snapshot(policy)
    served = served_policy(policy)
    merged = served.model.state_dict()
    assert not any("lora_" in k for k in merged)
    adapter_ptrs = {p.data_ptr() for n, p in policy.model.named_parameters() if "lora_" in n}
    for i in range(policy.spec.num_layers):
        for module in ("attn.q_proj", "attn.v_proj", "mlp.w1"):
            name = f"layers.{i}.{module}"
            a, b = before[f"{name}.lora_a.weight"], before[f"{name}.lora_b.weight"]
            expected = before[f"{name}.weight"] + (ALPHA / RANK) * (b @ a)
            torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
            assert (
                merged[f"{name}.weight"].data_ptr()
                != policy.model.get_submodule(name).weight.data_ptr()
            )
    assert not {t.data_ptr() for t in merged.values()} & adapter_ptrs
    after = snapshot(policy)  # the trained model: bit for bit as before
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (merged["layers.0.attn.q_proj.weight"] != before["layers.0.attn.q_proj.weight"]).any()


def test_the_merged_forward_equals_the_lora_forward():
    policy = lora_policy(0)
    tokens = torch.tensor([[1, 5, 9, 13, 17, 21, 3, 7]])
    with torch.no_grad():
        lora_logits = policy.model(tokens)
        merged_logits = served_policy(policy).model(tokens)
        base_logits = drawn_policy(0).model(tokens)
    torch.testing.assert_close(merged_logits, lora_logits, rtol=0, atol=1e-5)
    assert (merged_logits - base_logits).abs().max() > 0.1  # the adapters matter


def test_an_optimizer_step_after_the_merge_leaves_the_merged_weights():
    policy = lora_policy(0)
    served = served_policy(policy)
    kept = {k: v.clone() for k, v in served.model.state_dict().items()}
    base = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" not in k}
    adapters = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" in k}
    adam_step_on_adapters(policy)
    assert any(not torch.equal(adapters[k], v) for k, v in policy.model.state_dict().items()
               if "lora_" in k)  # fmt: skip
    assert all(torch.equal(kept[k], v) for k, v in served.model.state_dict().items())
    assert all(torch.equal(base[k], policy.model.state_dict()[k]) for k in base)


def test_a_qlora_base_is_dequantised_to_the_policy_dtype():
    policy = lora_policy(0, quantize_base=True)
    served = served_policy(policy)
    merged = served.model.state_dict()
    assert {type(v) for v in merged.values()} == {torch.Tensor}
    assert {v.dtype for v in merged.values()} == {torch.float32}
    q = policy.model.layers[0].attn.q_proj
    expected = q.weight.get_original_weight() + (ALPHA / RANK) * (
        q.lora_b.weight.detach() @ q.lora_a.weight.detach()
    )
    torch.testing.assert_close(merged["layers.0.attn.q_proj.weight"], expected, rtol=0, atol=1e-6)
    tokens = torch.tensor([[1, 5, 9, 13, 17, 21, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(served.model(tokens), policy.model(tokens), rtol=0, atol=1e-5)


def test_a_plain_policy_is_served_as_it_is_and_other_converters_are_refused():
    plain = drawn_policy(0)
    assert served_policy(plain) is plain
    from posttrain.train.qat_config import QATConfig

    qat = drawn_policy(0)
    convert_model(qat.model, [QATConfig()], spec=qat.spec)
    with pytest.raises(ValueError, match=r"converters \['qat'\].*lora, qlora"):
        served_policy(qat)


# ------------------------------------------------------------------------- the shared server
def test_the_server_samples_the_synced_lora_policy(vllm_server):
    policy = lora_policy(0)
    base = snapshot(policy)
    sync = vllm_server.sync_weights(policy)
    assert sync.version == vllm_server.weight_version
    assert all(torch.equal(base[k], v) for k, v in snapshot(policy).items())  # untouched
    served = vllm_server.generate(PROMPTS, max_new_tokens=24, temperature=0)
    builtin = policy.generate(PROMPTS, max_new_tokens=24, temperature=0)
    assert [c.token_ids for c in served] == [c.token_ids for c in builtin]
    plain = drawn_policy(0).generate(PROMPTS, max_new_tokens=24, temperature=0)
    assert [c.token_ids for c in builtin] != [c.token_ids for c in plain]  # adapters matter
    sampled = vllm_server.generate(PROMPTS, n=2, max_new_tokens=16, temperature=1.0, seed=3)
    ref = policy.logprobs([c.prompt_ids for c in sampled], [c.token_ids for c in sampled])
    for c, r in zip(sampled, ref):
        assert c.weight_version == sync.version
        torch.testing.assert_close(torch.tensor(c.logprobs), r, rtol=0, atol=1e-4)


def test_a_step_after_the_sync_does_not_reach_the_server_until_the_next_sync(vllm_server):
    policy = lora_policy(1)
    vllm_server.sync_weights(policy)
    synced = copy.deepcopy(policy)
    adam_step_on_adapters(policy)
    stepped = policy.generate(PROMPTS, max_new_tokens=24, temperature=0)
    expected = synced.generate(PROMPTS, max_new_tokens=24, temperature=0)
    assert [c.token_ids for c in stepped] != [c.token_ids for c in expected]  # the step matters
    served = vllm_server.generate(PROMPTS, max_new_tokens=24, temperature=0)
    assert [c.token_ids for c in served] == [c.token_ids for c in expected]
    vllm_server.sync_weights(policy)
    served = vllm_server.generate(PROMPTS, max_new_tokens=24, temperature=0)
    assert [c.token_ids for c in served] == [c.token_ids for c in stepped]


def test_the_server_samples_a_synced_qlora_policy(vllm_server):
    policy = lora_policy(2, quantize_base=True)
    vllm_server.sync_weights(policy)
    served = vllm_server.generate(PROMPTS, max_new_tokens=24, temperature=0)
    builtin = policy.generate(PROMPTS, max_new_tokens=24, temperature=0)
    assert [c.token_ids for c in served] == [c.token_ids for c in builtin]
    sampled = vllm_server.generate(PROMPTS[:3], n=2, max_new_tokens=12, temperature=1.0, seed=4)
    ref = policy.logprobs([c.prompt_ids for c in sampled], [c.token_ids for c in sampled])
    for c, r in zip(sampled, ref):
        torch.testing.assert_close(torch.tensor(c.logprobs), r, rtol=0, atol=1e-4)


def test_the_nccl_path_sends_the_merged_weights_the_reload_path_saves():
    """`vllm_nccl.hf_weights` (what a GPU sync broadcasts) of a LoRA policy: the merged weights,
    no adapter keys (a CPU check; NCCL itself needs GPUs)."""
    from posttrain.policy.vllm_nccl import hf_weights

    policy = lora_policy(0)
    before = snapshot(policy)
    sent = dict(hf_weights(policy))
    assert not any("lora" in k for k in sent)
    a, b = before["layers.1.mlp.w1.lora_a.weight"], before["layers.1.mlp.w1.lora_b.weight"]
    expected = before["layers.1.mlp.w1.weight"] + (ALPHA / RANK) * (b @ a)  # HF gate_proj
    torch.testing.assert_close(
        sent["model.layers.1.mlp.gate_proj.weight"], expected, rtol=0, atol=1e-6
    )
