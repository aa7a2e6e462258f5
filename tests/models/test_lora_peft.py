"""LoRA adapters in the PEFT format, with peft 0.21.2 as the reference (`PeftModel.from_pretrained`,
`get_peft_model`): an adapter saved here loads in peft with the same logits, one saved by peft
loads here, and unsupported configs or adapters that do not fit the model are refused naming
what is wrong.

Shapes: B = batch, T = tokens, V = vocabulary."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from _lora_helpers import (
    HF_NAMES,
    SPECS,
    logits_of,
    random_base,
    random_tokens_BT,
    randomise_adapters,
)

from posttrain.models import build_model, get_preset, save_hf_checkpoint
from posttrain.models.lora import (
    LoRAConfig,
    apply_lora,
    has_adapters,
    load_peft_adapter,
    save_peft_adapter,
)

# peft 0.21.2 refuses torchao < 0.16 when it creates LoRA layers (`dispatch_torchao` raises
# ImportError), and torchtune 0.6.1 needs torchao <= 0.15. peft treats torchao as optional, so
# the reference runs in a child process in which torchao is absent (`sys.modules["torchao"] =
# None` makes `importlib.util.find_spec` report it missing).
_PEFT_SCRIPT = r"""
import json, sys
sys.modules["torchao"] = None
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

def hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

for task in json.loads(sys.argv[1]):
    tokens = torch.load(task["tokens"])
    with torch.no_grad():
        ours = PeftModel.from_pretrained(hf(task["base"]), task["ours"]).eval()
        torch.save(ours(tokens).logits, task["ours_logits"])
        torch.manual_seed(0)
        made = get_peft_model(hf(task["base"]), LoraConfig(
            r=4, lora_alpha=8, target_modules=task["targets"], init_lora_weights=False)).eval()
        made.save_pretrained(task["made"])
        torch.save(made(tokens).logits, task["made_logits"])
"""


@pytest.fixture(scope="module")
def peft_reference(tmp_path_factory):
    """family -> dict of: spec, base (posttrain model), tokens_BT, adapted (posttrain logits with
    random adapters, saved by save_peft_adapter to `ours`), ours_logits (peft's logits with that
    folder on the HF base), made (a folder peft's save_pretrained wrote, random A and B) and
    made_logits (peft's logits with it)."""
    import subprocess
    import sys

    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("peft")
    out, tasks = {}, []
    for family, spec in SPECS.items():
        base = random_base(spec)
        save_hf_checkpoint(base, spec, root / f"base-{family}")
        model = copy.deepcopy(base)
        apply_lora(
            model,
            LoRAConfig(
                rank=4,
                alpha=8.0,
                dropout=0.1,
                modules=("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"),
            ),
            spec=spec,
        )
        randomise_adapters(model)
        model.eval()
        tokens_BT = random_tokens_BT(spec.vocab_size)
        save_peft_adapter(
            model,
            root / f"ours-{family}",
            spec=spec,
            base_model_name_or_path=str(root / f"base-{family}"),
        )
        torch.save(tokens_BT, root / f"tokens-{family}.pt")
        tasks.append(
            {
                "base": str(root / f"base-{family}"),
                "ours": str(root / f"ours-{family}"),
                "tokens": str(root / f"tokens-{family}.pt"),
                "targets": HF_NAMES,
                "ours_logits": str(root / f"ours-{family}.pt"),
                "made": str(root / f"made-{family}"),
                "made_logits": str(root / f"made-{family}.pt"),
            }
        )
        out[family] = dict(
            spec=spec,
            base=base,
            tokens_BT=tokens_BT,
            adapted=logits_of(model, tokens_BT),
            ours=root / f"ours-{family}",
            made=root / f"made-{family}",
        )
    subprocess.run(
        [sys.executable, "-c", _PEFT_SCRIPT, json.dumps(tasks)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    for family in SPECS:
        out[family]["ours_logits"] = torch.load(root / f"ours-{family}.pt")
        out[family]["made_logits"] = torch.load(root / f"made-{family}.pt")
    return out


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_saved_adapter_loads_in_peft(family, peft_reference):
    ref = peft_reference[family]
    config = json.loads((ref["ours"] / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["lora_dropout"] == 0.1
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert sorted(config["target_modules"]) == sorted(HF_NAMES)
    assert (ref["adapted"] - logits_of(ref["base"], ref["tokens_BT"])).abs().max() > 0.1
    torch.testing.assert_close(ref["ours_logits"], ref["adapted"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_peft_saved_adapter_loads_onto_posttrain(family, peft_reference):
    ref = peft_reference[family]
    model = copy.deepcopy(ref["base"])
    report = load_peft_adapter(model, ref["made"], spec=ref["spec"])
    assert report.name == "lora" and len(report.converted) == 2 * 7
    model.eval()
    assert (ref["made_logits"] - logits_of(ref["base"], ref["tokens_BT"])).abs().max() > 0.1
    torch.testing.assert_close(
        logits_of(model, ref["tokens_BT"]), ref["made_logits"], atol=1e-5, rtol=0
    )


@pytest.fixture(scope="module")
def qwen2_adapter_folder(tmp_path_factory):
    spec = SPECS["qwen2"]
    model = build_model(spec, seed=0)
    apply_lora(model, LoRAConfig(rank=4, modules=("q_proj", "w1")), spec=spec)
    return save_peft_adapter(model, tmp_path_factory.mktemp("adapter"), spec=spec)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("peft_type", "PREFIX_TUNING", "peft_type='PREFIX_TUNING'; only 'LORA'"),
        ("use_dora", True, "use_dora=True; only plain LoRA"),
        ("use_rslora", True, "use_rslora=True"),
        ("modules_to_save", ["lm_head"], "modules_to_save=\\['lm_head'\\]"),
        ("layers_to_transform", [0], "layers_to_transform=\\[0\\]"),
        ("rank_pattern", {"q_proj": 2}, "rank_pattern="),
        ("alpha_pattern", {"q_proj": 2}, "alpha_pattern="),
        ("bias", "all", "bias='all'"),
        ("target_modules", ["q_proj", "lm_head"], "target_modules=.*'lm_head' is not supported"),
        ("target_modules", "all-linear", "target_modules='all-linear'"),
        ("r", 0, "r=0"),
    ],
)
def test_load_rejects_unsupported_configs(field, value, message, qwen2_adapter_folder, tmp_path):
    folder = tmp_path / "edited"
    shutil.copytree(qwen2_adapter_folder, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config[field] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))
    model = build_model(SPECS["qwen2"], seed=0)
    with pytest.raises(ValueError, match=f"adapter_config.json {message}"):
        load_peft_adapter(model, folder, spec=SPECS["qwen2"])
    assert not has_adapters(model)


def test_load_rejects_adapters_that_do_not_fit_the_model(qwen2_adapter_folder):
    wide = SPECS["qwen2"].replace(embed_dim=128)
    model = build_model(wide, seed=0)
    with pytest.raises(
        ValueError,
        match=r"lora_a\.weight in .* has shape \(4, 64\) but the model "
        r"needs \(4, 128\)",
    ):
        load_peft_adapter(model, qwen2_adapter_folder, spec=wide)
    deeper = SPECS["qwen2"].replace(num_layers=3)
    with pytest.raises(ValueError, match=r"missing \['layers\.2\.attn\.q_proj\.lora_a\.weight'"):
        load_peft_adapter(build_model(deeper, seed=0), qwen2_adapter_folder, spec=deeper)
    moe_spec = get_preset("tiny-moe")
    moe = build_model(moe_spec, seed=0)
    with pytest.raises(
        ValueError,
        match="target_modules names 'gate_proj'.*it has: q_proj, k_proj, v_proj, o_proj$",
    ):
        load_peft_adapter(moe, qwen2_adapter_folder, spec=moe_spec)
    assert not has_adapters(model) and not has_adapters(moe)
