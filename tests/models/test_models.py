"""ModelSpec validation, preset sizes pinned by hand-computed formulas, and build_model.

Shapes: B = batch, T = tokens, V = vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.models import PRESETS, ModelSpec, RopeScaling, build_model, get_preset


def _count_by_formula(spec: ModelSpec) -> int:
    """Parameters of a Llama/Qwen2 decoder, counted from its dimensions.

    Per layer: q (E x H*hd), k and v (E x KV*hd each), o (H*hd x E), with q/k/v biases for Qwen2;
    MLP gate/up/down (3 x E x I); two RMSNorm scales (2E). Plus the embedding (V x E), the final
    norm (E) and, when not tied, the output projection (V x E). An MoE spec has instead of the MLP
    a router (X x E) and X experts of 3 x E x moe_intermediate_dim, plus a shared expert
    (3 x E x shared_expert_dim) with its gate (E) when shared_expert_dim > 0.
    """
    E, H, KV, I, V, L = (  # noqa: E741 (I: the intermediate dim, as in the docstring)
        spec.embed_dim,
        spec.num_heads,
        spec.num_kv_heads,
        spec.intermediate_dim,
        spec.vocab_size,
        spec.num_layers,
    )
    hd = E // H
    bias = spec.family == "qwen2"
    q = E * H * hd + (H * hd if bias else 0)
    k_and_v = 2 * (E * KV * hd + (KV * hd if bias else 0))
    o = H * hd * E
    mlp = 3 * E * I
    if spec.num_experts:
        X = spec.num_experts
        mlp = X * E + X * 3 * E * spec.moe_intermediate_dim
        if spec.shared_expert_dim:
            mlp += 3 * E * spec.shared_expert_dim + E
    norms = 2 * E
    per_layer = q + k_and_v + o + mlp + norms
    output = 0 if spec.tie_word_embeddings else V * E
    return V * E + L * per_layer + E + output


# ------------------------------------------------------------------------------------- ModelSpec

_BASE = PRESETS["tiny-llama-1m"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("family", "gpt2"),
        ("vocab_size", 0),
        ("num_layers", -1),
        ("num_heads", 4.0),
        ("num_kv_heads", 3),  # 4 query heads do not divide into 3 groups
        ("embed_dim", 130),  # not divisible by 4 heads
        ("intermediate_dim", 0),
        ("max_seq_len", True),  # bool is not an int here
        ("rope_base", 0.0),
        ("rope_base", math.inf),
        ("rope_base", "5e5"),
        ("norm_eps", 1.0),
        ("norm_eps", "1e-5"),
        ("tie_word_embeddings", "yes"),
        ("rope_scaling", {"factor": 8.0}),
    ],
)
def test_model_spec_rejects_bad_field_and_names_it(field, value):
    with pytest.raises(ValueError, match=field):
        _BASE.replace(**{field: value})


def test_model_spec_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim=3"):
        _BASE.replace(embed_dim=12, num_heads=4, num_kv_heads=2)


def test_rope_scaling_only_for_llama3():
    with pytest.raises(ValueError, match="rope_scaling"):
        PRESETS["tiny-1m"].replace(rope_scaling=RopeScaling())


@pytest.mark.parametrize(
    "field, value",
    [
        ("factor", 0.0),
        ("low_freq_factor", -1.0),
        ("high_freq_factor", 1.0),  # must exceed low_freq_factor = 1
        ("original_max_position_embeddings", 0),
    ],
)
def test_rope_scaling_rejects_bad_field_and_names_it(field, value):
    with pytest.raises(ValueError, match=field):
        RopeScaling(**{field: value})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_spec_dict_round_trip(name):
    spec = PRESETS[name]
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_get_preset_unknown_lists_valid_names():
    with pytest.raises(ValueError, match="qwen2.5-0.5b") as excinfo:
        get_preset("gpt-5")
    assert "tiny-1m" in str(excinfo.value)


# ---------------------------------------------------------------------------- sizes (meta device)


def test_published_sizes_match_formula():
    """Qwen2.5-0.5B: 494,032,768 parameters; Llama-3.2-1B: 1,235,814,400 (both tied).

    Qwen2.5-0.5B by hand: per layer q 896*896+896 = 803,712; k, v 896*128+128 = 114,816 each;
    o 802,816; MLP 3*896*4864 = 13,074,432; norms 1,792 -> 14,912,384; x24 = 357,897,216; plus
    embedding 151,936*896 = 136,134,656 and final norm 896.
    """
    assert _count_by_formula(PRESETS["qwen2.5-0.5b"]) == 494_032_768
    assert _count_by_formula(PRESETS["llama3.2-1b"]) == 1_235_814_400


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tied", [True, False])
def test_preset_parameter_count_matches_formula_on_meta(name, tied):
    spec = PRESETS[name].replace(tie_word_embeddings=tied)
    model = build_model(spec, device="meta")
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == _count_by_formula(spec)
    assert spec.num_parameters() == _count_by_formula(spec)
    assert ("output.weight" in model.state_dict()) == (not tied)


# ------------------------------------------------------------------------------------ build_model


def test_build_model_forward_shape_and_tying():
    spec = PRESETS["tiny-llama-1m"]
    model = build_model(spec, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(0, spec.vocab_size, (2, 7), generator=gen)
    with torch.no_grad():
        logits_BTV = model(tokens_BT)
    assert logits_BTV.shape == (2, 7, spec.vocab_size)
    assert logits_BTV.dtype == torch.float32
    assert model.output.tied_module is model.tok_embeddings


def test_build_model_seed_is_deterministic_and_leaves_global_rng_alone():
    spec = PRESETS["tiny-1m"]
    state = torch.get_rng_state()
    a = build_model(spec, seed=1).state_dict()
    b = build_model(spec, seed=1).state_dict()
    c = build_model(spec, seed=2).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])
    build_model(spec)  # without a seed the global RNG is used: the check above is sensitive
    assert not torch.equal(torch.get_rng_state(), state)
