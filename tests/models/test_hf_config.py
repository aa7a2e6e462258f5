"""HF config.json <-> ModelSpec: `spec_from_hf_config` agrees with the model transformers builds
from the same config (real Qwen2.5-0.5B and Llama-3.2-1B configs among them), absent keys take
transformers' defaults and not torchtune's (Qwen3's head_dim 128, Mistral's 4096-token sliding
window), old and new style rope_theta, real Qwen3-0.6B and Mistral-7B-v0.3 configs, and
`hf_config_from_spec` round-trips through transformers for every preset. Checkpoints and their
logits: test_models_hf.py."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from posttrain.models import (  # noqa: E402
    PRESETS,
    ModelSpec,
    RopeScaling,
    hf_config_from_spec,
    spec_from_hf_config,
)

_QWEN25_05B_CONFIG = {  # Qwen/Qwen2.5-0.5B config.json (written by transformers 4.x)
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_LLAMA32_1B_CONFIG = {  # meta-llama/Llama-3.2-1B config.json (written by transformers 4.x)
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

_QWEN3_06B_CONFIG = {  # Qwen/Qwen3-0.6B config.json (written by transformers 4.51)
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_MISTRAL_7B_V03_CONFIG = {  # mistralai/Mistral-7B-v0.3 config.json
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32768,
}

_CONFIGS = {
    "qwen2-all-defaults": {"model_type": "qwen2"},
    "llama-all-defaults": {"model_type": "llama"},
    "qwen3-all-defaults": {"model_type": "qwen3"},
    # Qwen3Config's head_dim is 128 when absent, not hidden_size / heads = 64
    "qwen3-absent-head-dim": {
        "model_type": "qwen3",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "qwen3-0.6b": _QWEN3_06B_CONFIG,
    "mistral-7b-v0.3": _MISTRAL_7B_V03_CONFIG,
    # a window as long as every position is full attention
    "mistral-window-covers-all": {"model_type": "mistral", "max_position_embeddings": 4096},
    "qwen2.5-0.5b-old-style": _QWEN25_05B_CONFIG,
    "llama3.2-1b-old-style": _LLAMA32_1B_CONFIG,
    "new-style-rope-parameters": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 7e5},
    },
    "dict-theta-beats-top-level": {
        "model_type": "qwen2",
        "rope_theta": 5.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 7.0},
    },
    "top-level-theta-fills-dict": {
        "model_type": "llama",
        "rope_theta": 5e5,
        "rope_parameters": {"rope_type": "default"},
    },
    "rope-scaling-beats-rope-parameters": {
        "model_type": "llama",
        "rope_theta": 9e4,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        "rope_scaling": {
            "type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
        },
    },
    "kv-heads-null": {"model_type": "qwen2", "num_key_value_heads": None},
}


def _spec_via_transformers(config: dict) -> ModelSpec:
    """What transformers itself makes of `config`, as a ModelSpec."""
    cls = {
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }
    c = cls[config["model_type"]].from_dict(dict(config))
    if c.model_type == "mistral":
        assert c.sliding_window is None or c.sliding_window >= c.max_position_embeddings
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rp = c.rope_parameters
    scaling = (
        None
        if rp["rope_type"] == "default"
        else RopeScaling(
            factor=rp["factor"],
            low_freq_factor=rp["low_freq_factor"],
            high_freq_factor=rp["high_freq_factor"],
            original_max_position_embeddings=rp["original_max_position_embeddings"],
        )
    )
    moe = (
        {}
        if c.model_type != "qwen2_moe"
        else dict(
            num_experts=c.num_experts,
            experts_per_token=c.num_experts_per_tok,
            moe_intermediate_dim=c.moe_intermediate_size,
            shared_expert_dim=c.shared_expert_intermediate_size,
            norm_topk_prob=c.norm_topk_prob,
            router_aux_loss_coef=c.router_aux_loss_coef,
        )
    )
    return ModelSpec(
        family={"qwen2": "qwen2", "llama": "llama3", "qwen2_moe": "qwen2"}.get(
            c.model_type, c.model_type
        ),
        vocab_size=c.vocab_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        embed_dim=c.hidden_size,
        intermediate_dim=c.intermediate_size,
        max_seq_len=c.max_position_embeddings,
        rope_base=float(rp["rope_theta"]),
        norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_scaling=scaling,
        attention_head_dim=None if head_dim == c.hidden_size // c.num_attention_heads else head_dim,
        **moe,
    )


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_spec_from_hf_config_agrees_with_transformers(name):
    assert spec_from_hf_config(_CONFIGS[name]) == _spec_via_transformers(_CONFIGS[name])


def test_real_configs_give_presets():
    assert spec_from_hf_config(_QWEN25_05B_CONFIG) == PRESETS["qwen2.5-0.5b"]
    assert spec_from_hf_config(_LLAMA32_1B_CONFIG) == PRESETS["llama3.2-1b"]
    assert spec_from_hf_config(_QWEN3_06B_CONFIG) == PRESETS["qwen3-0.6b"]
    assert spec_from_hf_config(_MISTRAL_7B_V03_CONFIG) == PRESETS["mistral-7b"]


def test_absent_keys_take_hf_defaults_not_torchtune():
    """transformers: rope_theta 1e4, rms_norm_eps 1e-6 (torchtune qwen2: 1e6, 1e-5). Qwen2Config's
    num_key_value_heads defaults to 32; LlamaConfig's to num_attention_heads."""
    qwen = spec_from_hf_config(
        {"model_type": "qwen2", "num_attention_heads": 64, "hidden_size": 256}
    )
    llama = spec_from_hf_config(
        {"model_type": "llama", "num_attention_heads": 16, "hidden_size": 256}
    )
    assert (qwen.rope_base, qwen.norm_eps) == (1e4, 1e-6)
    assert (llama.rope_base, llama.norm_eps) == (1e4, 1e-6)
    assert (qwen.num_kv_heads, llama.num_kv_heads) == (32, 16)
    with pytest.raises(ValueError, match="num_kv_heads=32"):  # 16 heads cannot share 32 kv heads
        spec_from_hf_config({"model_type": "qwen2", "num_attention_heads": 16})


def test_absent_head_dim_and_sliding_window_take_hf_defaults():
    """Qwen3Config: head_dim 128 whatever hidden_size / heads is (here 256 / 4 = 64); an explicit
    head_dim equal to hidden_size / heads is the default width (attention_head_dim None).
    MistralConfig: sliding_window 4096 when absent, a window torchtune's full attention cannot
    express for max_position_embeddings 32768, so refused naming the key."""
    spec = spec_from_hf_config(_CONFIGS["qwen3-absent-head-dim"])
    assert (spec.attention_head_dim, spec.head_dim) == (128, 128)
    spec = spec_from_hf_config(dict(_QWEN3_06B_CONFIG, hidden_size=2048))  # 2048 / 16 = 128
    assert (spec.attention_head_dim, spec.head_dim) == (None, 128)
    absent = {k: v for k, v in _MISTRAL_7B_V03_CONFIG.items() if k != "sliding_window"}
    assert transformers.MistralConfig.from_dict(absent).sliding_window == 4096
    with pytest.raises(ValueError, match="sliding_window=4096 .*max_position_embeddings=32768"):
        spec_from_hf_config(absent)


def test_old_and_new_style_rope_theta():
    old = dict(_QWEN25_05B_CONFIG, rope_theta=1e6, rope_scaling=None)
    new = {k: v for k, v in _QWEN25_05B_CONFIG.items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    assert spec_from_hf_config(old).rope_base == spec_from_hf_config(new).rope_base == 1e6


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_from_spec_round_trips_through_transformers(name):
    spec = PRESETS[name]
    config = hf_config_from_spec(spec, bos_token_id=1, eos_token_id=[2, 3])
    assert json.loads(json.dumps(config)) == config
    assert spec_from_hf_config(config) == spec
    assert _spec_via_transformers(config) == spec
    c = transformers.AutoConfig.for_model(**config)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, [2, 3], None)
    assert c.dtype == torch.float32
