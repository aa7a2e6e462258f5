"""Qwen2-MoE HF checkpoints against transformers' own `Qwen2MoeForCausalLM`: loading matches its
logits, a saved checkpoint loads in transformers and round-trips, the tiny-moe preset saves for
transformers, absent MoE keys take Qwen2MoeConfig's defaults, and unsupported configs or a
missing expert raise naming what is wrong. The MoE layer and spec: tests/models/test_moe.py.

Shapes: B = batch, T = tokens, V = vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.models import (
    PRESETS,
    build_model,
    hf_config_from_spec,
    load_hf_checkpoint,
    save_hf_checkpoint,
    spec_from_hf_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MOE = PRESETS["tiny-moe"]
ATOL = 1e-4  # as tests/models/test_models_hf.py


try:
    import transformers

    HAS_QWEN2_MOE = hasattr(transformers, "Qwen2MoeForCausalLM")
except ImportError:  # pragma: no cover
    transformers = None
    HAS_QWEN2_MOE = False
needs_qwen2_moe = pytest.mark.skipif(
    not HAS_QWEN2_MOE, reason="transformers without Qwen2MoeForCausalLM"
)

_HF_DIMS = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-3,
    max_position_embeddings=128,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    router_aux_loss_coef=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 3e4},
)
HF_KINDS = {
    "shared-untied": dict(_HF_DIMS, shared_expert_intermediate_size=48, tie_word_embeddings=False),
    "shared-tied-normtopk": dict(
        _HF_DIMS, shared_expert_intermediate_size=48, tie_word_embeddings=True, norm_topk_prob=True
    ),
    "no-shared-top1": dict(
        _HF_DIMS, shared_expert_intermediate_size=0, tie_word_embeddings=True, num_experts_per_tok=1
    ),
}
T = 100


def _tokens_BT(vocab_size: int = 300, length: int = T) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


def _randomise(model: torch.nn.Module, std: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture(scope="module")
def hf_moe_checkpoints(tmp_path_factory):
    """kind -> (folder written by transformers' save_pretrained, its logits [B, T, V])."""
    out = {}
    for kind, kwargs in HF_KINDS.items():
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kwargs)).eval()
        _randomise(model)
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        with torch.no_grad():
            out[kind] = (folder, model(_tokens_BT()).logits)
    return out


@needs_qwen2_moe
@pytest.mark.parametrize("kind", sorted(HF_KINDS))
def test_load_matches_transformers_qwen2_moe(hf_moe_checkpoints, kind):
    folder, ref_BTV = hf_moe_checkpoints[kind]
    model, spec = load_hf_checkpoint(folder)
    kwargs = HF_KINDS[kind]
    assert (spec.num_experts, spec.experts_per_token) == (4, kwargs["num_experts_per_tok"])
    assert spec.shared_expert_dim == kwargs["shared_expert_intermediate_size"]
    assert spec.norm_topk_prob == kwargs.get("norm_topk_prob", False)
    assert (spec.rope_base, spec.norm_eps, spec.router_aux_loss_coef) == (3e4, 1e-3, 0.02)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():
        logits_BTV = model(_tokens_BT())
    assert logits_BTV.shape == ref_BTV.shape == (2, T, 300)
    assert (logits_BTV - ref_BTV).abs().max().item() <= ATOL


@needs_qwen2_moe
@pytest.mark.parametrize("kind", sorted(HF_KINDS))
def test_save_loads_in_transformers_and_round_trips(hf_moe_checkpoints, kind, tmp_path):
    folder, ref_BTV = hf_moe_checkpoints[kind]
    model, spec = load_hf_checkpoint(folder)
    out = save_hf_checkpoint(model, spec, tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe"
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert spec_from_hf_config(config) == spec
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == "Qwen2MoeForCausalLM"
    with torch.no_grad():
        assert (hf_model(_tokens_BT()).logits - ref_BTV).abs().max().item() <= ATOL
    reloaded, respec = load_hf_checkpoint(out)  # tune -> HF -> tune is bitwise
    assert respec == spec
    a, b = model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@needs_qwen2_moe
def test_tiny_moe_preset_saves_for_transformers(tmp_path):
    model = build_model(MOE, seed=0)
    _randomise(model, std=0.2)
    out = save_hf_checkpoint(model, MOE, tmp_path / "tiny-moe")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens_BT = _tokens_BT(MOE.vocab_size, length=40)
    with torch.no_grad():
        diff = (hf_model(tokens_BT).logits - model(tokens_BT)).abs().max().item()
    assert diff <= ATOL
    c = transformers.AutoConfig.for_model(**hf_config_from_spec(MOE))
    assert (
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size,
        c.norm_topk_prob,
        c.router_aux_loss_coef,
    ) == (4, 2, 64, 64, False, MOE.router_aux_loss_coef)


@needs_qwen2_moe
def test_absent_moe_keys_take_qwen2moeconfig_defaults():
    spec = spec_from_hf_config({"model_type": "qwen2_moe"})
    c = transformers.Qwen2MoeConfig()
    assert (
        spec.num_experts,
        spec.experts_per_token,
        spec.moe_intermediate_dim,
        spec.shared_expert_dim,
        spec.norm_topk_prob,
        spec.router_aux_loss_coef,
    ) == (
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size,
        c.norm_topk_prob,
        c.router_aux_loss_coef,
    )
    assert (
        spec.embed_dim,
        spec.intermediate_dim,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.vocab_size,
        spec.tie_word_embeddings,
    ) == (
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
        c.tie_word_embeddings,
    )


@pytest.mark.parametrize(
    "config, match",
    [
        ({"model_type": "qwen2_moe", "decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"model_type": "qwen2_moe", "mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"model_type": "qwen2_moe", "qkv_bias": False}, "qkv_bias"),
        ({"model_type": "qwen2_moe", "num_experts": 0}, "num_experts"),
        (
            {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 8},
            "experts_per_token",
        ),
        ({"model_type": "qwen2_moe", "use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_qwen2_moe_configs_raise(config, match):
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(config)


@needs_qwen2_moe
def test_load_names_a_missing_expert(hf_moe_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = hf_moe_checkpoints["shared-untied"]
    dest = tmp_path / "ckpt"
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dest / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.1.mlp.experts.3.up_proj"):
        load_hf_checkpoint(dest)
