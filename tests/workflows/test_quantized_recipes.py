"""The adapters / quantization presets (sft_lora, sft_qlora, dpo_lora, grpo_lora, sft_fp8) run at
tiny size, and the recipes' `adapters` / `quantization` sections refuse bad values by their
dotted names before anything is written."""

import json

import pytest
import torch

from posttrain import cli
from posttrain.models.lora import has_adapters
from posttrain.policy import Policy
from posttrain.workflows import override

PRESET_DIR = cli.recipe_dirs()[1] / "presets"
NEW_PRESETS = ["sft_lora", "sft_qlora", "dpo_lora", "grpo_lora", "sft_fp8"]


def _run_preset(name, tmp_path, monkeypatch, **extra):
    monkeypatch.chdir(tmp_path)
    path = PRESET_DIR / f"{name}.yaml"
    recipe = path.read_text().splitlines()[0].removeprefix("# recipe: ").strip()
    module = cli.load_recipe(recipe)
    cfg = cli.load_config_file(module.Config(), str(path))
    cfg = override(cfg, {**getattr(module, "TINY", {}), "out_dir": str(tmp_path / "run"), **extra})
    return cfg, module.main(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft_lora", "sft_qlora", "dpo_lora", "grpo_lora"])
def test_adapter_preset_runs_and_exports_peft_and_merged(name, tmp_path, monkeypatch):
    cfg, results = _run_preset(name, tmp_path, monkeypatch)
    run = tmp_path / "run"
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == cfg.adapters.rank
    assert config["lora_alpha"] == cfg.adapters.alpha
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert results["adapters"]["method"] == cfg.adapters.method
    merged = Policy.from_pretrained(run / "policy")  # a plain HF folder: the merged model
    assert not has_adapters(merged.model)
    assert any("lora" in line for line in results["converters"])


@pytest.mark.slow
def test_fp8_preset_trains_float8_linears(tmp_path, monkeypatch):
    _, results = _run_preset("sft_fp8", tmp_path, monkeypatch)
    assert results["converters"][0].startswith("float8:")
    assert torch.isfinite(torch.tensor(results["final_loss"]))
    assert Policy.from_pretrained(tmp_path / "run" / "policy").num_parameters() > 0


def test_presets_listed_here_exist():
    assert {p.stem for p in PRESET_DIR.glob("*.yaml")} >= set(NEW_PRESETS)


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        (
            "sft",
            {"adapters.method": "dora"},
            r"Config\.adapters\.method='dora'; must be one of none, "
            r"lora, qlora",
        ),
        ("sft", {"adapters.method": "lora", "adapters.rank": 0}, r"Config\.adapters\.rank=0"),
        (
            "sft",
            {"adapters.method": "lora", "adapters.modules": ["q_proj", "attn"]},
            r"Config\.adapters\.modules",
        ),
        ("sft", {"quantization.training": "int3"}, r"Config\.quantization\.training='int3'"),
        (
            "sft",
            {"quantization.training": "fp8", "quantization.fp8_recipe": "blockwise"},
            r"Config\.quantization\.fp8_recipe='blockwise'",
        ),
        (
            "dpo",
            {"quantization.training": "qat"},
            r"Config\.quantization\.training='qat'; must be "
            r"one of none, fp8 in this recipe",
        ),
        (
            "sft",
            {"adapters.method": "qlora", "quantization.training": "fp8"},
            r"Config\.adapters\.method=.qlora. with Config\.quantization\.training=.fp8.: "
            r"a QLoRA base",
        ),
        ("sft", {"adapters.method": "lora", "parallel.dp_shard": 2}, r"Config\.parallel="),
        ("grpo", {"quantization.rollout": "int1"}, r"Config\.quantization\.rollout='int1'"),
        (
            "grpo",
            {"quantization.rollout_correction": "is"},
            r"Config\.quantization\.rollout_correction='is'",
        ),
    ],
)
def test_bad_converter_settings_fail_by_dotted_name(recipe, overrides, message):
    module = cli.load_recipe(recipe)
    with pytest.raises(ValueError, match=message):
        override(module.Config(), overrides)


@pytest.mark.slow
def test_sft_recipe_runs_qat_prepare_train_convert(tmp_path, monkeypatch):
    """QAT inside the SFT recipe: prepared before the optimizer, trained fake-quantised,
    evaluated as trained and converted to real int4 weights (eval_after_converted.csv)."""
    monkeypatch.chdir(tmp_path)
    module = cli.load_recipe("sft")
    cfg = override(
        module.Config(),
        {**module.TINY, "out_dir": str(tmp_path / "run"), "quantization.training": "qat"},
    )
    results = module.main(cfg)
    assert results["converters"][0].startswith("qat:")
    assert results["qat"]["scheme"] == "int8da_int4w"
    assert 0.0 <= results["after_converted"]["accuracy"] <= 1.0
    assert (tmp_path / "run" / "eval_after_converted.csv").is_file()
    assert Policy.from_pretrained(tmp_path / "run" / "policy").num_parameters() > 0
