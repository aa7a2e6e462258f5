"""ModelSpec validation, preset sizes pinned by hand-computed formulas, and build_model.

Shapes: B = batch, T = tokens, V = vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.models import PRESETS, ModelSpec, RopeScaling, build_model, get_preset


def _count_by_formula(spec: ModelSpec) -> int:
    """Parameters of a Llama/Qwen2/Qwen3/Mistral decoder, counted from its dimensions.

    Per layer: q (E x H*hd), k and v (E x KV*hd each), o (H*hd x E), with q/k/v biases for Qwen2
    and the per-head q/k norm scales (2 hd) for Qwen3; MLP gate/up/down (3 x E x I); two RMSNorm
    scales (2E). hd = E / H, or the spec's attention_head_dim (Qwen3). Plus the embedding
    (V x E), the final norm (E) and, when not tied, the output projection (V x E). An MoE spec
    has instead of the MLP a router (X x E) and X experts of 3 x E x moe_intermediate_dim, plus
    a shared expert (3 x E x shared_expert_dim) with its gate (E) when shared_expert_dim > 0.
    """
    E, H, KV, I, V, L = (  # noqa: E741 (I: the intermediate dim, as in the docstring)
        spec.embed_dim,
        spec.num_heads,
        spec.num_kv_heads,
        spec.intermediate_dim,
        spec.vocab_size,
        spec.num_layers,
    )
    hd = spec.attention_head_dim or E // H
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
    norms = 2 * E + (2 * hd if spec.family == "qwen3" else 0)
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


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(attention_head_dim=64), "attention_head_dim=64 is only supported for family 'qwen3'"),
        (dict(family="qwen3", attention_head_dim=33), "head_dim=33 \\(attention_head_dim\\)"),
        (dict(family="qwen3", attention_head_dim=0), "attention_head_dim=0"),
        (dict(family="qwen3", attention_head_dim=64.0), "attention_head_dim=64.0"),
        (dict(family="mistral", rope_scaling=RopeScaling()), "rope_scaling.*'llama3'"),
        (dict(family="llama3", num_experts=4, moe_intermediate_dim=8), "num_experts=4 \\(MoE\\)"),
    ],
)
def test_model_spec_rejects_what_a_family_cannot_hold(changes, match):
    with pytest.raises(ValueError, match=match):
        _BASE.replace(**changes)


def test_explicit_head_dim_sets_the_attention_shapes():
    """A Qwen3 spec with 4 heads of 64 over embed_dim 128 (as Qwen3-0.6B: twice E / H)."""
    spec = PRESETS["tiny-qwen3-1m"]
    assert (spec.embed_dim // spec.num_heads, spec.head_dim) == (32, 64)
    attn = build_model(spec, device="meta").layers[0].attn
    assert tuple(attn.q_proj.weight.shape) == (4 * 64, 128)
    assert tuple(attn.k_proj.weight.shape) == (2 * 64, 128)
    assert tuple(attn.output_proj.weight.shape) == (128, 4 * 64)
    assert tuple(attn.q_norm.scale.shape) == tuple(attn.k_norm.scale.shape) == (64,)
    assert spec.replace(attention_head_dim=None).head_dim == 32


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


def test_published_qwen3_and_mistral_sizes_match_formula():
    """Qwen3-0.6B: 596,049,920 parameters (tied; the model card's "0.6B, non-embedding 0.44B");
    Mistral-7B-v0.3: 7,248,023,552 (untied).

    Qwen3-0.6B by hand (head_dim 128, 16 heads, 8 kv heads, hidden 1024): per layer q
    1024*2048 = 2,097,152; k, v 1024*1024 = 1,048,576 each; o 2,097,152; MLP 3*1024*3072 =
    9,437,184; norms 2*1024 + q/k norms 2*128 = 2,304 -> 15,730,944; x28 = 440,466,432; plus the
    embedding 151,936*1024 = 155,582,464 and the final norm 1,024.
    Mistral-7B-v0.3 by hand: per layer q and o 4096^2 = 16,777,216 each; k, v 4096*1024 =
    4,194,304 each; MLP 3*4096*14336 = 176,160,768; norms 8,192 -> 218,112,000; x32 =
    6,979,584,000; plus embedding and lm_head 2*32,768*4096 = 268,435,456 and the final norm 4,096.
    """
    assert PRESETS["qwen3-0.6b"].num_parameters() == 596_049_920
    assert 440_466_432 + 155_582_464 + 1_024 == 596_049_920
    assert PRESETS["mistral-7b"].num_parameters() == 7_248_023_552
    assert 6_979_584_000 + 268_435_456 + 4_096 == 7_248_023_552


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
