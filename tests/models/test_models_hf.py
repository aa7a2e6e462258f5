"""HF checkpoints <-> torchtune: equal logits to transformers' own forward, errors on load, and
how a save replaces a checkpoint. Reading config.json (the traps of defaults): test_hf_config.py.

Each tiny checkpoint is made by transformers itself (`save_pretrained`) with every parameter
randomised (biases and norm scales too) and with rope_theta / rms_norm_eps away from every default,
so a wrong default or a missing q/k permutation shows up in the logits.

Shapes: B = batch, T = tokens, V = vocabulary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from posttrain.models import (  # noqa: E402
    PRESETS,
    RopeScaling,
    build_model,
    load_hf_checkpoint,
    save_hf_checkpoint,
    spec_from_hf_config,
)

ATOL = 1e-4
_DIMS = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-3,
)
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=5000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
KINDS = {
    "qwen2-tied": (
        transformers.Qwen2Config,
        dict(
            _DIMS,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 3e4},
        ),
    ),
    "qwen2-untied": (
        transformers.Qwen2Config,
        dict(
            _DIMS,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 3e4},
        ),
    ),
    "llama-untied": (
        transformers.LlamaConfig,
        dict(
            _DIMS,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 2e4},
        ),
    ),
    "llama-tied": (
        transformers.LlamaConfig,
        dict(
            _DIMS,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 2e4},
        ),
    ),
    # Llama 3.1 RoPE scaling; T = 100 > original_max_position_embeddings = 64.
    "llama3-scaled": (
        transformers.LlamaConfig,
        dict(
            _DIMS,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            rope_parameters=dict(_LLAMA3_ROPE),
        ),
    ),
}
T = 100


def _randomise(model: torch.nn.Module, std: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _tokens_BT(vocab_size: int = 300, batch: int = 2, length: int = T) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))


def _hf_logits(model, tokens_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens_BT).logits


def _tune_logits(model, tokens_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens_BT)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """kind -> (folder written by save_pretrained, reference logits [B, T, V])."""
    out = {}
    tokens_BT = _tokens_BT()
    for kind, (config_cls, kwargs) in KINDS.items():
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()
        _randomise(model)
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        out[kind] = (folder, _hf_logits(model, tokens_BT))
    return out


def _safetensors_keys(folder: Path) -> set[str]:
    return {k for f in folder.glob("*.safetensors") for k in load_file(f)}


# ---------------------------------------------------------------------------- load / save logits


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_load_matches_transformers(hf_checkpoints, kind):
    folder, ref_BTV = hf_checkpoints[kind]
    model, spec = load_hf_checkpoint(folder)
    kwargs = KINDS[kind][1]
    assert spec.rope_base == kwargs["rope_parameters"]["rope_theta"]
    assert spec.norm_eps == 1e-3
    assert spec.tie_word_embeddings == kwargs["tie_word_embeddings"]
    assert ("lm_head.weight" in _safetensors_keys(folder)) == (not spec.tie_word_embeddings)
    if spec.tie_word_embeddings:
        assert model.output.tied_module is model.tok_embeddings
    tensors = [*model.parameters(), *model.buffers()]
    assert not any(t.is_meta for t in tensors)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())

    logits_BTV = _tune_logits(model, _tokens_BT())
    assert logits_BTV.shape == ref_BTV.shape == (2, T, 300)
    assert (logits_BTV - ref_BTV).abs().max().item() <= ATOL


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_save_loads_in_transformers(hf_checkpoints, kind, tmp_path):
    folder, ref_BTV = hf_checkpoints[kind]
    model, spec = load_hf_checkpoint(folder)
    out = save_hf_checkpoint(model, spec, tmp_path / "saved", eos_token_id=7)

    config = json.loads((out / "config.json").read_text())
    assert spec_from_hf_config(config) == spec
    assert config["eos_token_id"] == 7 and config["bos_token_id"] is None
    assert ("lm_head.weight" in _safetensors_keys(out)) == (not spec.tie_word_embeddings)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf_model.dtype == torch.float32
    assert (_hf_logits(hf_model, _tokens_BT()) - ref_BTV).abs().max().item() <= ATOL

    reloaded, respec = load_hf_checkpoint(out)  # tune -> HF -> tune is bitwise
    assert respec == spec
    a, b = model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_llama3_scaling_exercises_all_three_frequency_bands():
    """Wavelengths 2*pi*theta^(2i/hd) for hd = 16, theta = 5000: 6.3 (< 64/4: kept), 18.3 and
    53.5 (between 16 and 64: smoothed), 156 and above (> 64: divided by factor 8)."""
    theta, hd = _LLAMA3_ROPE["rope_theta"], _DIMS["hidden_size"] // _DIMS["num_attention_heads"]
    wavelengths = [2 * math.pi * theta ** (2 * i / hd) for i in range(hd // 2)]
    old = _LLAMA3_ROPE["original_max_position_embeddings"]
    high, low = old / _LLAMA3_ROPE["high_freq_factor"], old / _LLAMA3_ROPE["low_freq_factor"]
    assert any(w < high for w in wavelengths)
    assert any(high <= w <= low for w in wavelengths)
    assert any(w > low for w in wavelengths)
    assert old < T


def test_torchtune_defaults_would_not_match(hf_checkpoints):
    """The traps are real: the same weights with torchtune's builder defaults (rope_base 1e6,
    norm_eps 1e-5) instead of the config's values give visibly different logits."""
    folder, ref_BTV = hf_checkpoints["qwen2-untied"]
    model, spec = load_hf_checkpoint(folder)
    wrong = build_model(spec.replace(rope_base=1e6, norm_eps=1e-5))
    wrong.load_state_dict(model.state_dict())
    assert (_tune_logits(wrong, _tokens_BT()) - ref_BTV).abs().max().item() > 1e-2


def test_sharded_checkpoint(tmp_path):
    config_cls, kwargs = KINDS["qwen2-untied"]
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()
    _randomise(model)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded, _ = load_hf_checkpoint(tmp_path)
    tokens_BT = _tokens_BT()
    diff = (_tune_logits(loaded, tokens_BT) - _hf_logits(model, tokens_BT)).abs().max().item()
    assert diff <= ATOL


def test_transformers4_style_config(hf_checkpoints, tmp_path):
    """Top-level rope_theta + rope_scaling with the legacy `type` key, as 4.x wrote them."""
    folder, ref_BTV = hf_checkpoints["llama3-scaled"]
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, spec = load_hf_checkpoint(tmp_path)
    assert spec.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    assert (_tune_logits(model, _tokens_BT()) - ref_BTV).abs().max().item() <= ATOL


@pytest.mark.parametrize("preset", ["tiny-1m", "tiny-llama-1m"])
def test_preset_model_saves_for_transformers(preset, tmp_path):
    spec = PRESETS[preset]
    model = build_model(spec, seed=0)
    _randomise(model, std=0.2)
    out = save_hf_checkpoint(model, spec, tmp_path / preset)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens_BT = _tokens_BT(spec.vocab_size, length=40)
    ref_BTV = _tune_logits(model, tokens_BT)
    assert (_hf_logits(hf_model, tokens_BT) - ref_BTV).abs().max().item() <= ATOL


# ------------------------------------------------------------------------------------ load errors


@pytest.mark.parametrize(
    "config, match",
    [
        ({"model_type": "gemma2"}, "'gemma2'.*llama, mistral, qwen2, qwen2_moe, qwen3"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"model_type": "qwen2", "rope_parameters": dict(_LLAMA3_ROPE)}, "only supported for"),
        (
            {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "low_freq_factor, high_freq_factor",
        ),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
        ({"model_type": "llama", "head_dim": 256}, "head_dim=256"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "llama", "rms_norm_eps": None}, "rms_norm_eps"),
    ],
)
def test_unsupported_configs_raise(config, match):
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(config)


def _copy(folder: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_load_without_config_or_weights(hf_checkpoints, tmp_path):
    folder, _ = hf_checkpoints["qwen2-tied"]
    no_config = _copy(folder, tmp_path / "a")
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(no_config)
    no_weights = _copy(folder, tmp_path / "b")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_checkpoint(no_weights)


def test_load_lists_missing_unexpected_and_misshaped_keys(hf_checkpoints, tmp_path):
    folder = _copy(hf_checkpoints["qwen2-untied"][0], tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as excinfo:
        load_hf_checkpoint(folder)
    message = str(excinfo.value)
    assert "missing keys ['model.layers.1.mlp.up_proj.weight']" in message
    assert "unexpected keys ['model.layers.0.self_attn.q_norm.weight']" in message
    assert "model.norm.weight: (65,) != expected (64,)" in message


# ------------------------------------------------------------------------------------ save details


def test_save_replaces_checkpoint_atomically_with_fresh_config(tmp_path):
    small = PRESETS["tiny-1m"]
    wide = small.replace(embed_dim=64, intermediate_dim=96, num_layers=1)
    dest = tmp_path / "ckpt"
    save_hf_checkpoint(
        build_model(small, seed=0), small, dest, extra_files={"stale.txt": "old run"}
    )
    save_hf_checkpoint(
        build_model(wide, seed=0),
        wide,
        dest,
        generation_config={"eos_token_id": 3, "max_new_tokens": 8},
        extra_files={
            "tokenizer.json": "{}",
            "raw.bin": b"\x00\x01",
            "copied.txt": dest / "stale.txt",
        },
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp folders left
    assert sorted(p.name for p in dest.iterdir()) == [
        "config.json",
        "copied.txt",
        "generation_config.json",
        "model.safetensors",
        "raw.bin",
        "tokenizer.json",
    ]
    assert spec_from_hf_config(json.loads((dest / "config.json").read_text())) == wide
    assert (dest / "copied.txt").read_text() == "old run"
    assert (dest / "raw.bin").read_bytes() == b"\x00\x01"
    gen = transformers.GenerationConfig.from_pretrained(dest)
    assert (gen.eos_token_id, gen.max_new_tokens) == (3, 8)


def test_failed_save_leaves_previous_checkpoint(tmp_path):
    spec = PRESETS["tiny-1m"]
    dest = save_hf_checkpoint(build_model(spec, seed=0), spec, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    with pytest.raises(FileNotFoundError):
        save_hf_checkpoint(
            build_model(spec, seed=1),
            spec,
            dest,
            extra_files={"x.json": tmp_path / "does-not-exist"},
        )
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path):
    spec = PRESETS["tiny-1m"]
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="refusing"):
        save_hf_checkpoint(build_model(spec, seed=0), spec, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("name", ["../escape.txt", "/abs.txt", "config.json"])
def test_save_rejects_bad_extra_file_names(tmp_path, name):
    spec = PRESETS["tiny-1m"]
    with pytest.raises(ValueError, match="extra_files"):
        save_hf_checkpoint(build_model(spec, seed=0), spec, tmp_path / "c", extra_files={name: "x"})
    assert not (tmp_path / "c").exists()


def test_save_rejects_model_that_does_not_match_spec(tmp_path):
    spec = PRESETS["tiny-1m"]
    with pytest.raises(ValueError, match="missing keys"):
        save_hf_checkpoint(
            build_model(spec, seed=0), spec.replace(tie_word_embeddings=False), tmp_path / "c"
        )
