"""Hugging Face `config.json` <-> `ModelSpec`: parsing with transformers' defaults and precedence.

`spec_from_hf_config` turns a parsed Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE / Llama / Mistral
`config.json` into the `ModelSpec` of the model `AutoModelForCausalLM` would build;
`hf_config_from_spec` writes the config.json dict that transformers loads as the same model.
Checkpoint folders (safetensors load/save) are in `posttrain.models.hf`. The MoE keys of
Qwen2-MoE and Qwen3-MoE (model_type qwen2_moe, qwen3_moe) are in `posttrain.models.hf_moe`.

Traps handled (transformers 5.10 semantics, checked in tests/models/test_hf_config.py):
  * Absent keys take the HF config class defaults, not torchtune's: rope_theta 1e4 (torchtune
    qwen2 builder: 1e6; llama3: 5e5), rms_norm_eps 1e-6 (torchtune: 1e-5). Qwen2Config's
    num_key_value_heads defaults to 32 when the key is absent (LlamaConfig: num_attention_heads).
  * transformers 5 writes RoPE settings in `rope_parameters`; 4.x configs write top-level
    `rope_theta` and a `rope_scaling` dict (legacy `type` for `rope_type`). A non-null
    `rope_scaling` wins over `rope_parameters`, and `rope_theta` inside the dict wins over the
    top-level key, as in `RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`.
  * Qwen3Config's head_dim defaults to 128 whatever the hidden size (MistralConfig's and
    LlamaConfig's to hidden_size / num_attention_heads): a Qwen3 config without the key has
    128-wide heads.
  * MistralConfig's sliding_window defaults to 4096 when the key is absent (Mistral 7B v0.1 uses
    it; v0.2+ write null): a window shorter than max_position_embeddings is refused, since
    torchtune's attention is full.

Example:
    >>> from posttrain.models.specs import get_preset
    >>> spec = get_preset("tiny-1m")
    >>> spec_from_hf_config(hf_config_from_spec(spec)) == spec
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from posttrain.models import hf_moe
from posttrain.models.specs import Family, ModelSpec, RopeScaling

# model_type in config.json -> ModelSpec.family, HF architecture class (of a dense spec; an MoE
# spec is written as its family's hf_moe.HF_NAMES).
_FAMILY_OF_MODEL_TYPE: dict[str, Family] = {
    "qwen2": "qwen2",
    "llama": "llama3",
    "qwen3": "qwen3",
    "mistral": "mistral",
    hf_moe.MODEL_TYPE: "qwen2",
    hf_moe.QWEN3_MODEL_TYPE: "qwen3",
}
_ARCHITECTURE = {
    "qwen2": "Qwen2ForCausalLM",
    "llama3": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
_MODEL_TYPE_OF_FAMILY = {
    "qwen2": "qwen2",
    "llama3": "llama",
    "qwen3": "qwen3",
    "mistral": "mistral",
}

# Defaults of transformers 5.10 Qwen2Config / LlamaConfig for keys absent from config.json
# (pinned against the classes in tests/models/test_hf_config.py). num_key_value_heads None means
# "equal to num_attention_heads".
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        sliding_window=4096,
    ),
    hf_moe.MODEL_TYPE: hf_moe.HF_DEFAULTS,
    hf_moe.QWEN3_MODEL_TYPE: hf_moe.QWEN3_HF_DEFAULTS,
}
_HF_DEFAULT_ROPE_THETA = 10_000.0  # RotaryEmbeddingConfigMixin.default_theta
_SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def spec_from_hf_config(config: Mapping[str, Any]) -> ModelSpec:
    """The `ModelSpec` of a HF `config.json` (already parsed into a dict).

    Keys absent from `config` take the transformers 5.10 config-class defaults (rope_theta 1e4,
    rms_norm_eps 1e-6, ...), so the spec describes the model `AutoModelForCausalLM` would build.

    Args:
        config: the config.json dict; `model_type` must be "qwen2", "qwen2_moe", "qwen3",
            "qwen3_moe", "llama" or "mistral".

    Returns:
        A validated `ModelSpec` (family "qwen2", "qwen3", "llama3" or "mistral"; qwen2_moe
        gives a "qwen2" spec with num_experts > 0, qwen3_moe a "qwen3" one, see
        `posttrain.models.hf_moe`).

    Raises:
        ValueError: unknown `model_type`; a RoPE type other than default/llama3, or llama3 scaling
            with keys missing; a feature torchtune's builders cannot express (sliding-window
            attention, a non-silu activation, Llama / Mistral / Qwen3 attention or MLP biases,
            outside Qwen3 a head_dim other than hidden_size / num_attention_heads, partial rotary
            embeddings, MoE dense layers, Qwen2-MoE without q/k/v biases); or dimensions that
            `ModelSpec` rejects.
    """
    model_type = config.get("model_type")
    if model_type not in _FAMILY_OF_MODEL_TYPE:
        raise ValueError(
            f"config.json model_type={model_type!r} is not supported; allowed: "
            f"{', '.join(sorted(_FAMILY_OF_MODEL_TYPE))}"
        )
    family = _FAMILY_OF_MODEL_TYPE[model_type]
    merged = {**_HF_DEFAULTS[model_type], **config}

    def get(key: str) -> Any:  # a missing key is None; ModelSpec names it
        return merged.get(key)

    num_heads = get("num_attention_heads")
    num_kv_heads = get("num_key_value_heads")
    if num_kv_heads is None:
        num_kv_heads = num_heads
    hidden = get("hidden_size")
    _check_supported_features(merged, model_type, hidden, num_heads)
    head_dim = get("head_dim")
    if (
        isinstance(hidden, int)
        and isinstance(num_heads, int)
        and num_heads > 0
        and (head_dim == hidden // num_heads)
    ):
        head_dim = None  # the default width: ModelSpec.attention_head_dim None
    max_seq_len = get("max_position_embeddings")
    rope_base, rope_scaling = _rope_from_hf_config(config, family, max_seq_len)
    norm_eps = _as_float(get("rms_norm_eps"), "rms_norm_eps")
    moe = hf_moe.moe_fields_from_hf_config(config) if model_type in hf_moe.MODEL_TYPES else {}
    try:
        return ModelSpec(
            family=family,
            vocab_size=get("vocab_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            embed_dim=hidden,
            intermediate_dim=get("intermediate_size"),
            max_seq_len=max_seq_len,
            rope_base=rope_base,
            norm_eps=norm_eps,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            rope_scaling=rope_scaling,
            attention_head_dim=head_dim if family == "qwen3" else None,
            **moe,
        )
    except ValueError as e:
        raise ValueError(
            f"config.json (model_type {model_type!r}) describes an invalid model: {e}"
        ) from e


def _as_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json {key}={value!r}; must be a number")
    return float(value)


def _check_supported_features(
    config: Mapping[str, Any], model_type: str, hidden: int, num_heads: int
) -> None:
    where = f"config.json (model_type {model_type!r})"
    family = _FAMILY_OF_MODEL_TYPE[model_type]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where} hidden_act={act!r}; only 'silu' is supported")
    head_dim = config.get("head_dim")
    if (
        family != "qwen3"  # Qwen3 sets its head width explicitly (ModelSpec.attention_head_dim)
        and head_dim is not None
        and isinstance(hidden, int)
        and isinstance(num_heads, int)
        and num_heads > 0
        and head_dim != hidden // num_heads
    ):
        raise ValueError(
            f"{where} head_dim={head_dim} differs from hidden_size / "
            f"num_attention_heads = {hidden // num_heads}; not supported for this model_type "
            "(only 'qwen3', 'qwen3_moe')"
        )
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"{where} partial_rotary_factor={config['partial_rotary_factor']}; "
            "only 1.0 is supported"
        )
    biases = {"llama3": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",)}
    for key in biases.get(family, ()):
        if config.get(key):
            raise ValueError(f"{where} {key}=true is not supported (these blocks have no biases)")
    if family in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        raise ValueError(
            f"{where} use_sliding_window=true is not supported (posttrain's attention is full "
            "attention only)"
        )
    window, max_len = config.get("sliding_window"), config.get("max_position_embeddings")
    if (
        model_type == "mistral"
        and window is not None
        and not (isinstance(max_len, int) and isinstance(window, int) and window >= max_len)
    ):
        raise ValueError(
            f"{where} sliding_window={window!r} (max_position_embeddings={max_len!r}; 4096 when "
            "the key is absent) is not supported: posttrain's attention is full attention only "
            "(Mistral 7B v0.2+ configs write sliding_window: null)"
        )
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{where} layer_types={sorted(set(layer_types))}; only 'full_attention' is supported"
        )


def _rope_from_hf_config(
    config: Mapping[str, Any], family: str, max_seq_len: int
) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None), with transformers 5's precedence rules."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"config.json rope_parameters / rope_scaling must be a dict, got {rope!r}")
    nested = [v for v in rope.values() if isinstance(v, Mapping)]
    if nested:  # per-layer-type parameters, e.g. {"full_attention": {...}}
        if any(v != nested[0] for v in nested) or len(nested) != len(rope):
            raise ValueError(
                f"config.json has different RoPE parameters per layer type: {rope!r}; not supported"
            )
        rope = nested[0]
    theta = rope.get("rope_theta")
    if theta is None:
        theta = config.get("rope_theta", _HF_DEFAULT_ROPE_THETA)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope_type={rope_type!r} is not supported; allowed: "
            f"{', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    theta = _as_float(theta, "rope_theta")
    if rope_type == "default":
        return theta, None
    if family != "llama3":
        raise ValueError(
            f"config.json rope_type='llama3' is only supported for model_type "
            f"'llama', got {_MODEL_TYPE_OF_FAMILY[family]!r}"
        )
    missing = [k for k in _LLAMA3_ROPE_KEYS if rope.get(k) is None]
    if missing:
        raise ValueError(f"config.json llama3 RoPE scaling lacks {', '.join(missing)}: {rope!r}")
    original = rope.get("original_max_position_embeddings")
    if original is None:  # as HF standardize_rope_params does
        original = max_seq_len
    return theta, RopeScaling(
        factor=_as_float(rope["factor"], "factor"),
        low_freq_factor=_as_float(rope["low_freq_factor"], "low_freq_factor"),
        high_freq_factor=_as_float(rope["high_freq_factor"], "high_freq_factor"),
        original_max_position_embeddings=original,
    )


def hf_config_from_spec(
    spec: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """A config.json dict for `spec` that transformers loads as the same model (model_type
    qwen2, qwen3, llama or mistral; an MoE spec as model_type qwen2_moe, `Qwen2MoeForCausalLM`,
    or qwen3_moe, `Qwen3MoeForCausalLM`, see `posttrain.models.hf_moe`).

    RoPE settings are written both ways: `rope_parameters` (what transformers 5 reads and writes;
    tested with 5.10) and top-level `rope_theta` + `rope_scaling` (what 4.x reads); transformers 5
    gives the same result from either. The dtype is written as `dtype` (5.x) and `torch_dtype`
    (4.x).

    Args:
        spec: the architecture.
        dtype: dtype of the saved weights, written as `dtype` and `torch_dtype`.
        bos_token_id, eos_token_id, pad_token_id: special token ids; None is written as null
            (not omitted, so transformers does not fill in its class defaults).

    Returns:
        A JSON-serialisable dict; `spec_from_hf_config` of it returns `spec`.

    Raises:
        ValueError: an MoE spec that its HF MoE model cannot hold (`hf_moe.hf_moe_config_fields`).
    """
    theta = float(spec.rope_base)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    rope_scaling = None
    if spec.rope_scaling is not None:
        rs = spec.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
        rope_parameters = {**rope_scaling, "rope_theta": theta}
    dtype_name = str(dtype).removeprefix("torch.")
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURE[spec.family]],
        "model_type": _MODEL_TYPE_OF_FAMILY[spec.family],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.embed_dim,
        "intermediate_size": spec.intermediate_dim,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    if spec.family == "qwen2":  # q/k/v biases are built into Qwen2Attention (no config key)
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers
        )
    elif spec.family == "qwen3":
        config.update(
            head_dim=spec.head_dim,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=spec.num_layers,
        )
    elif spec.family == "mistral":  # null: MistralConfig's default is a 4096-token window
        config.update(head_dim=spec.head_dim, sliding_window=None)
    else:
        config.update(
            head_dim=spec.head_dim, attention_bias=False, mlp_bias=False, pretraining_tp=1
        )
    if spec.is_moe:
        config.update(hf_moe.hf_moe_config_fields(spec))
    # Written even when None: an absent key would take the config class default (LlamaConfig:
    # bos 1, eos 2), which is some other tokenizer's ids.
    config.update(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return config
