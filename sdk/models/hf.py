"""Hugging Face checkpoints <-> torchtune models: safetensors load/save.

A HF checkpoint folder holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). This module turns `config.json` into a `ModelSpec` (with
`posttrain.models.hf_config`, which holds the config.json conversion and its traps), builds the
torchtune model with `posttrain.models.specs.build_model`, and converts the weights with torchtune's
own key maps (`torchtune.models.convert_weights.hf_to_tune` / `tune_to_hf` for Llama and Mistral,
which permute q/k between HF's rotate-half RoPE and torchtune's interleaved RoPE; the key map of
`qwen2_hf_to_tune` / `qwen2_tune_to_hf` for Qwen2, which needs no permutation because torchtune's
Qwen2 RoPE is rotate-half already; for Qwen3 the key map of `posttrain.models.qwen3`: Qwen2's
without biases, plus the per-head q/k norms, no permutation). Which one a family takes is its
`FamilyTraits` (`interleaved_rope`, `qk_norm`). torchtune's are the functions
`torchtune.training.FullModelHFCheckpointer` calls;
the checkpointer itself is not used because it creates its output folder on load, does not read
`rope_theta` / `rms_norm_eps`, and on save writes `epoch_N/` with a copy of the *input*
`config.json` (stale if the dimensions changed).

An MoE spec reads and writes a Qwen2-MoE folder (`Qwen2MoeForCausalLM`, family "qwen2") or a
Qwen3-MoE one (`Qwen3MoeForCausalLM`, family "qwen3"): attention, norms and embeddings take the
dense family's key map, the MoE layers `posttrain.models.hf_moe`'s (per-expert tensors on disk,
stacked [E, ...] parameters in the model).

Traps handled here (those of config.json are listed in `posttrain.models.hf_config`):
  * Tied embeddings: the safetensors hold no `lm_head.weight` (one found anyway is ignored, as HF
    re-ties it to the embedding).

Example:
    >>> model, spec = load_hf_checkpoint("checkpoints/qwen2.5-0.5b")     # doctest: +SKIP
    >>> save_hf_checkpoint(model, spec, "out/sft-final")                  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.models import hf_moe
from posttrain.models.hf_config import hf_config_from_spec, spec_from_hf_config
from posttrain.models.specs import ModelSpec, build_model

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"


# ---------------------------------------------------------------------------------------------
# Weight conversion (torchtune's key maps)


def _hf_to_tune(sd: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    if spec.is_moe:
        rest = {k: v for k, v in sd.items() if not hf_moe.is_hf_moe_key(k)}
        return {**_dense_hf_to_tune(rest, spec), **hf_moe.moe_hf_to_tune(sd, spec)}
    return _dense_hf_to_tune(sd, spec)


def _tune_to_hf(sd: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    if spec.is_moe:
        rest = {k: v for k, v in sd.items() if not hf_moe.is_tune_moe_key(k)}
        return {**_dense_tune_to_hf(rest, spec), **hf_moe.moe_tune_to_hf(sd, spec)}
    return _dense_tune_to_hf(sd, spec)


def _attention_dims(spec: ModelSpec) -> dict[str, int]:
    """The keywords torchtune's weight converters take to reshape q/k/v (both directions)."""
    return dict(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        dim=spec.embed_dim,
        head_dim=spec.head_dim,
    )


def _dense_hf_to_tune(sd: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    if spec.traits.interleaved_rope:  # Llama, Mistral: permute q/k rows
        from torchtune.models.convert_weights import hf_to_tune

        return hf_to_tune(sd, **_attention_dims(spec))
    from torchtune.models.convert_weights import get_mapped_key

    from_hf = _from_hf(spec)
    return {get_mapped_key(key, from_hf): value for key, value in sd.items()}


def _dense_tune_to_hf(sd: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    if spec.traits.interleaved_rope:
        from torchtune.models.convert_weights import tune_to_hf

        return tune_to_hf(sd, **_attention_dims(spec))
    key_map = _hf_key_map(spec, sd)
    return {key_map[key]: value for key, value in sd.items()}


def _from_hf(spec: ModelSpec) -> dict[str, str | None]:
    """HF key -> torchtune key ("{}" for the layer index) of `spec`'s family."""
    if spec.traits.qk_norm:
        from posttrain.models.qwen3 import FROM_HF

        return FROM_HF
    if spec.traits.interleaved_rope:
        from torchtune.models.convert_weights import _FROM_HF
    else:
        from torchtune.models.qwen2._convert_weights import _FROM_HF
    return dict(_FROM_HF)


def _hf_key_map(spec: ModelSpec, tune_keys: Iterable[str]) -> dict[str, str]:
    """torchtune key -> HF key for each of `tune_keys`."""
    from torchtune.models.convert_weights import get_mapped_key

    to_hf = {tune: hf for hf, tune in _from_hf(spec).items() if tune is not None}
    return {key: get_mapped_key(key, to_hf) for key in tune_keys}


def _expected_hf_shapes(spec: ModelSpec) -> dict[str, torch.Size]:
    """HF key -> shape of every tensor a checkpoint of `spec` must hold."""
    expected = _expected_tune_shapes(spec)
    if spec.is_moe:
        expected = {k: v for k, v in expected.items() if not hf_moe.is_tune_moe_key(k)}
    key_map = _hf_key_map(spec, expected)
    shapes = {key_map[k]: shape for k, shape in expected.items()}
    if spec.is_moe:
        shapes.update(hf_moe.expected_hf_moe_shapes(spec))
    return shapes


def _expected_tune_shapes(spec: ModelSpec) -> dict[str, torch.Size]:
    model = build_model(spec, device="meta")
    return {key: value.shape for key, value in model.state_dict().items()}


def _check_keys(
    found: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], what: str, against: str
) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(
        f"{k}: {tuple(found[k].shape)} != expected {tuple(expected[k])}"
        for k in set(found) & set(expected)
        if found[k].shape != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if wrong:
        problems.append(f"wrong shapes {wrong}")
    if problems:
        raise ValueError(f"{what} do not match {against}: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# Load


def load_hf_checkpoint(
    folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, ModelSpec]:
    """Load a HF Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE / Llama / Mistral checkpoint folder as a
    torchtune `TransformerDecoder` (MoE layers: `posttrain.models.moe.MoEFeedForward`).

    The model is built on the meta device and the checkpoint tensors are assigned into it (no
    random initialisation, one copy of the weights in memory); RoPE caches are then built on CPU.

    Args:
        folder: holds config.json and model.safetensors, or shards listed in
            model.safetensors.index.json (any *.safetensors files are read when neither exists).
        dtype: parameter dtype (fp32 on CPU: no bf16 instructions there).

    Returns:
        (model, spec): the model maps token ids `[B, T]` (int64) to logits `[B, T, vocab_size]`;
        `spec` is `spec_from_hf_config` of config.json.

    Raises:
        FileNotFoundError: no config.json, no safetensors file, or a shard named by the index is
            absent.
        ValueError: config.json unsupported (see `spec_from_hf_config`), or the weights' keys or
            shapes do not match it (missing / unexpected / mis-shaped keys are listed).
    """
    folder = Path(folder)
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(
            f"no {CONFIG_NAME} in {folder} (a HF checkpoint folder holds "
            f"{CONFIG_NAME} and *.safetensors)"
        )
    spec = spec_from_hf_config(json.loads(config_path.read_text()))
    hf_sd = _read_safetensors(folder)
    for key in [k for k in hf_sd if k.endswith("rotary_emb.inv_freq")]:
        del hf_sd[key]  # a RoPE buffer some old checkpoints saved; recomputed from rope_theta
    if spec.tie_word_embeddings:
        hf_sd.pop("lm_head.weight", None)  # HF re-ties it to the embedding as well
    if spec.is_moe:
        hf_moe.drop_absent_shared_expert(hf_sd, spec)
    _check_keys(hf_sd, _expected_hf_shapes(spec), f"the safetensors in {folder}", "its config.json")
    tune_sd = {k: v.to(dtype) for k, v in _hf_to_tune(hf_sd, spec).items()}
    del hf_sd

    model = build_model(spec, device="meta", dtype=dtype)
    model.load_state_dict(tune_sd, strict=True, assign=True)
    _init_rope_buffers(model)
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not on_meta, f"tensors left on the meta device after loading: {on_meta}"
    return model, spec


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index_path = folder / WEIGHTS_INDEX_NAME
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index_path} names shards that are absent: {absent}")
    elif (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        present = sorted(p.name for p in folder.iterdir())
        raise FileNotFoundError(
            f"no *.safetensors in {folder} (found {present}; pytorch_model.bin "
            "checkpoints are not supported)"
        )
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        shard = load_file(path, device="cpu")
        duplicated = sorted(set(shard) & set(state_dict))
        if duplicated:
            raise ValueError(f"keys {duplicated} appear in more than one file in {folder}")
        state_dict.update(shard)
    return state_dict


def _init_rope_buffers(model: nn.Module) -> None:
    """Build the (non-persistent) RoPE caches that a meta-device build left empty."""
    seen: set[int] = set()
    with torch.device("cpu"):
        for module in model.modules():
            rope_init = getattr(module, "rope_init", None)
            if callable(rope_init) and id(module) not in seen:
                seen.add(id(module))
                rope_init()


# ---------------------------------------------------------------------------------------------
# Save


def save_hf_checkpoint(
    model: nn.Module,
    spec: ModelSpec,
    folder: str | os.PathLike,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generation_config: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, str | bytes | os.PathLike] | None = None,
) -> Path:
    """Write `model` as a HF checkpoint folder that `AutoModelForCausalLM.from_pretrained` loads.

    Writes config.json (fresh from `spec`, see `hf_config_from_spec`), model.safetensors (HF key
    names, contiguous CPU tensors in the model's dtype, no lm_head when embeddings are tied),
    generation_config.json when `generation_config` is given, and `extra_files`. Everything is
    written into a temporary folder beside `folder` and renamed into place, so a reader never sees
    a half-written checkpoint; an existing checkpoint folder at `folder` is replaced whole.

    Args:
        model: a torchtune model built for `spec` (e.g. by `build_model` or `load_hf_checkpoint`).
        spec: its architecture.
        folder: destination folder.
        bos_token_id, eos_token_id, pad_token_id: written into config.json when given.
        generation_config: contents of generation_config.json.
        extra_files: relative file name -> contents (`str` is written as UTF-8 text, `bytes` as
            is) or a `pathlib.Path` (`os.PathLike`) of a file to copy, e.g. tokenizer files.

    Returns:
        The destination folder.

    Raises:
        ValueError: the model's state dict does not match `spec` (keys listed), or an extra file
            name is absolute, contains "..", or clashes with config.json / model.safetensors.
        FileExistsError: `folder` exists but is not a folder, or is a non-empty folder without
            config.json or *.safetensors (refusing to delete something that is not a checkpoint).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    hf = hf_state_dict(model, spec)
    dtypes = {v.dtype for v in hf.values()}
    if len(dtypes) != 1:
        raise ValueError(
            f"the model's parameters have mixed dtypes {sorted(map(str, dtypes))}; "
            "cast it to one dtype before saving"
        )
    hf_sd = {k: v.to("cpu").contiguous() for k, v in hf.items()}
    config = hf_config_from_spec(
        spec,
        dtype=dtypes.pop(),
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    extra = _check_extra_files(extra_files or {})
    _check_replaceable(folder)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        save_file(hf_sd, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if generation_config is not None:
            (tmp / GENERATION_CONFIG_NAME).write_text(
                json.dumps(dict(generation_config), indent=2, sort_keys=True) + "\n"
            )
        for name, content in extra.items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                target.write_bytes(content)
            elif isinstance(content, str):
                target.write_text(content, encoding="utf-8")
            else:
                shutil.copyfile(content, target)
        _replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def hf_state_dict(model: nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """`model`'s weights under HF key names, detached, on the model's device and in its dtype:
    the tensors `save_hf_checkpoint` writes (no lm_head when embeddings are tied).

    Raises:
        ValueError: the model's state dict does not match `spec` (keys listed), or a parameter
            is not a plain tensor (named).
    """
    state_dict = {k: _plain_tensor(k, v) for k, v in model.state_dict().items()}
    _check_keys(state_dict, _expected_tune_shapes(spec), "the model's parameters", "`spec`")
    return {k: v.detach() for k, v in _tune_to_hf(state_dict, spec).items()}


def _plain_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor for safetensors: an FP8-training weight (torchao float8's
    `WeightWithDynamicFloat8CastTensor`, a high-precision tensor in a wrapper) is unwrapped; a
    quantised weight (NF4, int8, int4) is refused, naming it, since a HF folder holds plain
    weights (merge adapters with `posttrain.models.lora.merge_lora`; save a QAT model before
    `convert_qat`)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t
    inner = getattr(t, "_tensor", None)
    if type(t).__name__ == "WeightWithDynamicFloat8CastTensor" and isinstance(inner, torch.Tensor):
        return inner
    raise ValueError(
        f"parameter {name} is a {type(t).__name__}, not a plain tensor; a HF folder "
        "holds plain weights: merge adapters first (merge_lora), and save a QAT "
        "model before converting it"
    )


def _check_extra_files(extra: Mapping[str, Any]) -> dict[str, Any]:
    reserved = {CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME}
    for name, content in extra.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise ValueError(f"extra_files name {name!r} must be a relative path without '..'")
        if name in reserved:
            raise ValueError(
                f"extra_files name {name!r} clashes with a file the checkpoint writes "
                f"({', '.join(sorted(reserved))})"
            )
        if not isinstance(content, (str, bytes, os.PathLike)):
            raise TypeError(
                f"extra_files[{name!r}] must be str, bytes or a path, got {type(content).__name__}"
            )
    return dict(extra)


def _check_replaceable(folder: Path) -> None:
    if not folder.exists():
        return
    if not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder")
    entries = list(folder.iterdir())
    looks_like_checkpoint = (folder / CONFIG_NAME).is_file() or any(folder.glob("*.safetensors"))
    if entries and not looks_like_checkpoint:
        raise FileExistsError(
            f"{folder} is a non-empty folder without {CONFIG_NAME} or "
            "*.safetensors; refusing to replace it (remove it or pick another)"
        )


def _replace_folder(tmp: Path, folder: Path) -> None:
    """Rename `tmp` to `folder`; an existing `folder` is moved aside first and then deleted."""
    if not folder.exists():
        os.replace(tmp, folder)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
    os.replace(folder, old / folder.name)
    try:
        os.replace(tmp, folder)
    except BaseException:
        os.replace(old / folder.name, folder)  # put the previous checkpoint back
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
