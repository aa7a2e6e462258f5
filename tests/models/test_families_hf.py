"""Qwen3 (dense) and Mistral beside Qwen2 and Llama 3: checkpoints written by transformers load
with its logits, save back into transformers, the Qwen3 q/k norms sit before RoPE, KV-cache
decoding of the Qwen3 attention equals full recomputation, and LoRA adapters of every family
export to PEFT in the order the HF weights are written.

Each checkpoint keeps the real head geometry and shrinks the rest so that a forward takes
milliseconds; randomised weights (linears N(0, 4 / fan_in), every norm scale 1 + N(0, 0.25),
including Qwen3's q/k norms) keep the logits O(10) so fp32 rounding stays far below 1e-4:
  * Qwen3-0.6B: real head_dim 128 = 2 x hidden / heads, 2 query heads per kv head, tied
    embeddings, no biases; reduced hidden 1024 -> 128 (16 -> 2 heads, 8 -> 1 kv), 28 -> 2
    layers, intermediate 3072 -> 192, vocab 151,936 -> 300.
  * Mistral-7B-v0.3: real head_dim 128 = hidden / heads, 4 query heads per kv head, untied,
    sliding_window null; reduced hidden 4096 -> 512 (32 -> 4 heads, 8 -> 1 kv), 32 -> 2 layers,
    intermediate 14336 -> 256, vocab 32,768 -> 300.

Shapes: B = batch, T = tokens, V = vocabulary.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _lora_helpers import SPECS, random_base, randomise_adapters  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from posttrain.models import (  # noqa: E402
    ModelSpec,
    build_model,
    get_preset,
    load_hf_checkpoint,
    save_hf_checkpoint,
    spec_from_hf_config,
)
from posttrain.models.hf import hf_state_dict  # noqa: E402
from posttrain.models.lora import LoRAConfig, apply_lora, merge_lora, save_peft_adapter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ATOL = 1e-4
T = 100
_ROPE = {"rope_type": "default", "rope_theta": 3e4}
KINDS = {
    "qwen3-0.6b-heads": (
        transformers.Qwen3Config,
        dict(
            vocab_size=300,
            hidden_size=128,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            max_position_embeddings=128,
            rms_norm_eps=1e-3,
            tie_word_embeddings=True,
            rope_parameters=_ROPE,
        ),
    ),
    "mistral-7b-heads": (
        transformers.MistralConfig,
        dict(
            vocab_size=300,
            hidden_size=512,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=128,
            rms_norm_eps=1e-3,
            sliding_window=None,
            tie_word_embeddings=False,
            rope_parameters=_ROPE,
        ),
    ),
}


def _randomise(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.5 * noise if p.dim() == 1 else 2 * noise / p.shape[-1] ** 0.5)


def _tokens_BT(vocab_size: int = 300, length: int = T) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens_BT)
    return getattr(out, "logits", out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (folder written by save_pretrained, reference logits [B, T, V])."""
    out = {}
    for kind, (config_cls, kwargs) in KINDS.items():
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()
        _randomise(model)
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        out[kind] = (folder, _logits(model, _tokens_BT()))
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_load_matches_transformers(checkpoints, kind):
    folder, ref_BTV = checkpoints[kind]
    model, spec = load_hf_checkpoint(folder)
    kwargs = KINDS[kind][1]
    assert spec.family == kind.split("-")[0]
    assert spec.head_dim == 128 and spec.num_heads // spec.num_kv_heads == (
        kwargs["num_attention_heads"] // kwargs["num_key_value_heads"]
    )
    assert spec.attention_head_dim == (128 if spec.family == "qwen3" else None)
    assert spec.tie_word_embeddings == kwargs["tie_word_embeddings"]
    assert (spec.rope_base, spec.norm_eps) == (3e4, 1e-3)
    logits_BTV = _logits(model, _tokens_BT())
    assert logits_BTV.shape == ref_BTV.shape == (2, T, 300)
    assert (logits_BTV - ref_BTV).abs().max().item() <= ATOL


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_save_loads_in_transformers(checkpoints, kind, tmp_path):
    folder, ref_BTV = checkpoints[kind]
    model, spec = load_hf_checkpoint(folder)
    out = save_hf_checkpoint(model, spec, tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    assert spec_from_hf_config(config) == spec
    assert config["head_dim"] == 128 and config["sliding_window"] is None
    assert set(load_file(out / "model.safetensors")) == set(load_file(folder / "model.safetensors"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == config["architectures"][0]
    assert (_logits(hf_model, _tokens_BT()) - ref_BTV).abs().max().item() <= ATOL
    reloaded, _ = load_hf_checkpoint(out)  # tune -> HF -> tune is bitwise
    a, b = model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_qwen3_norms_apply_before_rope(checkpoints):
    """torchtune's own MultiHeadAttention applies q_norm / k_norm after RoPE. RoPE rotates pairs
    of coordinates, which keeps a head's RMS but moves each coordinate under another scale
    entry: with HF's trained (here random) scales the order changes the logits; with unit
    scales both orders agree to rounding."""
    from torchtune.modules import MultiHeadAttention

    folder, ref_BTV = checkpoints["qwen3-0.6b-heads"]
    model, _ = load_hf_checkpoint(folder)
    after = copy.deepcopy(model)
    for layer in after.layers:
        layer.attn.__class__ = MultiHeadAttention  # torchtune's order, same modules
    tokens_BT = _tokens_BT()
    assert (_logits(after, tokens_BT) - ref_BTV).abs().max().item() > 1e-2
    with torch.no_grad():
        for m in (model, after):
            for layer in m.layers:
                layer.attn.q_norm.scale.fill_(1.0)
                layer.attn.k_norm.scale.fill_(1.0)
    diff = (_logits(after, tokens_BT) - _logits(model, tokens_BT)).abs().max().item()
    assert diff <= ATOL


@pytest.mark.parametrize("preset", ["tiny-qwen3-1m", "tiny-mistral-1m"])
def test_tiny_presets_save_for_transformers(preset, tmp_path):
    spec = get_preset(preset)
    model = build_model(spec, seed=0)
    _randomise(model)
    out = save_hf_checkpoint(model, spec, tmp_path / preset)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens_BT = _tokens_BT(spec.vocab_size, length=40)
    assert (_logits(hf_model, tokens_BT) - _logits(model, tokens_BT)).abs().max().item() <= ATOL


def test_qwen3_kv_cache_generation_equals_full_recomputation():
    """Greedy decoding with posttrain's KV cache (which runs the attention with num_kv_heads set
    to num_heads and its own cache) == one full forward per step, for mixed-length prompts."""
    from posttrain.policy import Policy

    policy = Policy.from_spec("tiny-qwen3-1m", seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(policy.model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if name.endswith("scale") else 0.1 * noise)
    completions = policy.generate(
        ["Hello world", "ab", "12 + 34 ="], max_new_tokens=10, temperature=0
    )
    for c in completions:
        ids = list(c.prompt_ids)
        with torch.no_grad():
            for token in c.token_ids:
                assert int(policy.model(torch.tensor([ids]))[0, -1].argmax()) == token
                ids.append(token)
    assert len({tuple(c.token_ids) for c in completions}) > 1


_NEW_SPECS = {
    "qwen3": ModelSpec(**{**SPECS["qwen2"].to_dict(), "family": "qwen3", "attention_head_dim": 32}),
    "mistral": ModelSpec(**{**SPECS["llama3"].to_dict(), "family": "mistral"}),
}


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3", "mistral"])
def test_peft_adapter_rows_follow_the_hf_weights(family, tmp_path):
    """For each adapted HF weight W: merged W == base W + (alpha / r) B @ A with the PEFT
    folder's A and B, all three in HF's layout (the q/k rows of Llama and Mistral permuted from
    torchtune's interleaved RoPE order, as the checkpoint writer permutes them)."""
    spec = {**SPECS, **_NEW_SPECS}[family]
    base = random_base(spec)
    model = copy.deepcopy(base)
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "w1")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, modules=modules), spec=spec)
    randomise_adapters(model)
    peft = load_file(
        save_peft_adapter(model, tmp_path / "adapter", spec=spec) / "adapter_model.safetensors"
    )
    merged, before = hf_state_dict(merge_lora(model), spec), hf_state_dict(base, spec)
    adapted = 0
    for key, a in peft.items():
        if ".lora_A." not in key:
            continue
        b = peft[key.replace(".lora_A.", ".lora_B.")]
        hf_key = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        expected = before[hf_key] + (8.0 / 4) * b @ a
        assert (merged[hf_key] - expected).abs().max().item() <= 1e-6, hf_key
        assert (merged[hf_key] - before[hf_key]).abs().max().item() > 1e-3
        adapted += 1
    assert adapted == spec.num_layers * len(modules)
