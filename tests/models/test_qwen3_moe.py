"""Qwen3-MoE HF checkpoints (`model_type: qwen3_moe`) against transformers' own
`Qwen3MoeForCausalLM`: loading matches its logits, a saved checkpoint holds the same HF tensors
and loads in transformers with the same logits, absent keys take Qwen3MoeConfig's defaults (head
width hidden_size / num_attention_heads, not Qwen3Config's 128), and what a Qwen3-MoE checkpoint
cannot hold is refused by name. Qwen2-MoE: tests/models/test_moe_hf.py.

Shapes: B = batch, T = tokens, V = vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.models import (
    build_model,
    hf_config_from_spec,
    load_hf_checkpoint,
    save_hf_checkpoint,
    spec_from_hf_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ATOL = 1e-4  # fp32, as tests/models/test_models_hf.py
V, T = 256, 48

try:
    import transformers

    HAS_QWEN3_MOE = hasattr(transformers, "Qwen3MoeForCausalLM")
except ImportError:  # pragma: no cover
    transformers = None
    HAS_QWEN3_MOE = False
needs_qwen3_moe = pytest.mark.skipif(
    not HAS_QWEN3_MOE, reason="transformers without Qwen3MoeForCausalLM"
)

_HF_DIMS = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-3,
    max_position_embeddings=64,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    router_aux_loss_coef=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 3e4},
)
HF_KINDS = {
    # head_dim 32 != 64 / 4 (as Qwen3-30B-A3B: 128 != 2048 / 32); the released configs' routing
    "headdim32-normtopk-untied": dict(
        _HF_DIMS, head_dim=32, norm_topk_prob=True, tie_word_embeddings=False
    ),
    # no head_dim key: 64 / 4 = 16; Qwen3MoeConfig's default routing (no renormalisation)
    "default-headdim-tied": dict(_HF_DIMS, tie_word_embeddings=True),
}


def _tokens_BT(length: int = T) -> torch.Tensor:
    return torch.randint(0, V, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """kind -> (folder written by transformers' save_pretrained, its logits [B, T, V])."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for kind, kwargs in HF_KINDS.items():
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs)).eval()
        with torch.no_grad():  # std 0.5 (not HF's 0.02) so routing and q/k norms matter
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        with torch.no_grad():
            out[kind] = (folder, model(_tokens_BT()).logits)
    return out


@needs_qwen3_moe
@pytest.mark.parametrize("kind", sorted(HF_KINDS))
def test_load_matches_transformers_qwen3_moe(hf_checkpoints, kind):
    folder, ref_BTV = hf_checkpoints[kind]
    model, spec = load_hf_checkpoint(folder)
    kwargs = HF_KINDS[kind]
    assert spec.family == "qwen3" and spec.is_moe
    assert spec.head_dim == kwargs.get("head_dim", 64 // 4)
    assert (spec.num_experts, spec.experts_per_token, spec.moe_intermediate_dim) == (4, 2, 32)
    assert (spec.shared_expert_dim, spec.norm_topk_prob) == (0, kwargs.get("norm_topk_prob", False))
    assert (spec.rope_base, spec.norm_eps, spec.router_aux_loss_coef) == (3e4, 1e-3, 0.02)
    assert type(model.layers[0].mlp).__name__ == "MoEFeedForward"
    assert tuple(model.layers[0].attn.q_norm.scale.shape) == (spec.head_dim,)
    with torch.no_grad():
        logits_BTV = model(_tokens_BT())
    assert logits_BTV.shape == ref_BTV.shape == (2, T, V)
    assert (logits_BTV - ref_BTV).abs().max().item() <= ATOL


@needs_qwen3_moe
@pytest.mark.parametrize("kind", sorted(HF_KINDS))
def test_save_holds_the_hf_tensors_and_loads_in_transformers(hf_checkpoints, kind, tmp_path):
    from safetensors.torch import load_file

    folder, ref_BTV = hf_checkpoints[kind]
    model, spec = load_hf_checkpoint(folder)
    out = save_hf_checkpoint(model, spec, tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    assert spec_from_hf_config(config) == spec
    # HF -> posttrain -> HF: the same tensors under the same names, bitwise
    theirs, ours = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        assert (hf_model(_tokens_BT()).logits - ref_BTV).abs().max().item() <= ATOL


@needs_qwen3_moe
def test_spec_built_model_saves_for_transformers(tmp_path):
    """A Qwen3-MoE spec trained from scratch (no HF folder in) saves as transformers' model."""
    spec = spec_from_hf_config({"model_type": "qwen3_moe", **HF_KINDS["default-headdim-tied"]})
    model = build_model(spec, seed=0, init_std=0.3).eval()
    out = save_hf_checkpoint(model, spec, tmp_path / "scratch")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens_BT = _tokens_BT(length=20)
    with torch.no_grad():
        assert (hf_model(tokens_BT).logits - model(tokens_BT)).abs().max().item() <= ATOL


@needs_qwen3_moe
def test_absent_keys_take_qwen3moeconfig_defaults():
    spec = spec_from_hf_config({"model_type": "qwen3_moe"})
    c = transformers.Qwen3MoeConfig()
    assert (
        spec.num_experts,
        spec.experts_per_token,
        spec.moe_intermediate_dim,
        spec.norm_topk_prob,
        spec.router_aux_loss_coef,
        spec.embed_dim,
        spec.intermediate_dim,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.vocab_size,
        spec.tie_word_embeddings,
        spec.shared_expert_dim,
    ) == (
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.norm_topk_prob,
        c.router_aux_loss_coef,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
        c.tie_word_embeddings,
        0,
    )
    # no head_dim key: transformers' attention falls back to hidden_size / num_attention_heads
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    attn = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention(
        transformers.Qwen3MoeConfig(**small), layer_idx=0
    )
    assert spec_from_hf_config({"model_type": "qwen3_moe", **small}).head_dim == attn.head_dim
    assert attn.head_dim == 16


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\]"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_experts": 0}, "num_experts=0.*'qwen3'"),
        ({"num_experts_per_tok": 8}, "experts_per_token"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_qwen3_moe_configs_raise_naming_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config({"model_type": "qwen3_moe", **_HF_DIMS, **changes})


def test_a_shared_expert_is_refused_for_qwen3_moe():
    spec = spec_from_hf_config({"model_type": "qwen3_moe", **_HF_DIMS})
    with pytest.raises(ValueError, match="shared_expert_dim=16.*qwen3_moe"):
        hf_config_from_spec(spec.replace(shared_expert_dim=16))


@needs_qwen3_moe
def test_load_names_a_missing_expert_and_a_stray_shared_expert(hf_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = hf_checkpoints["default-headdim-tied"]
    tensors = load_file(folder / "model.safetensors")
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_bytes((folder / "config.json").read_bytes())
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"},
        missing / "model.safetensors",
    )
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.1.mlp.experts.3.up_proj"):
        load_hf_checkpoint(missing)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "config.json").write_bytes((folder / "config.json").read_bytes())
    gate = {"model.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, 64)}
    save_file({**tensors, **gate}, stray / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"unexpected keys \['model.layers.0.mlp.shared_expert_gate"
    ):
        load_hf_checkpoint(stray)


def test_num_local_experts_is_read_and_a_disagreeing_pair_refused():
    """transformers 5.10 writes the expert count as num_local_experts, Qwen3-30B-A3B's
    config.json as num_experts; both name the same field."""
    config = {"model_type": "qwen3_moe", **_HF_DIMS}
    del config["num_experts"]
    assert spec_from_hf_config({**config, "num_local_experts": 4}).num_experts == 4
    with pytest.raises(ValueError, match="num_experts=4 and num_local_experts=6"):
        spec_from_hf_config({**config, "num_experts": 4, "num_local_experts": 6})
