"""LoRA / QLoRA on torchtune decoders: exact start, freezing, merge precision, PEFT round trips.

References: peft 0.21.2 (`PeftModel.from_pretrained`, `get_peft_model`) and transformers for the
adapter format; float64 arithmetic for merge precision; hand-computed parameter counts and NF4
byte counts (torchao 0.15 `NF4Tensor` layout).

Shapes: B = batch, T = tokens, V = vocabulary, O = out features, I = in features, R = rank.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from torch import nn

from posttrain.models import ModelSpec, build_model, get_preset, save_hf_checkpoint
from posttrain.models.lora import (
    LORA_MODULES,
    LoRAConfig,
    adapter_state_dict,
    adapters_disabled,
    apply_lora,
    has_adapters,
    load_peft_adapter,
    merge_into,
    merge_lora,
    parameter_bytes,
    save_peft_adapter,
)

SPECS = {  # small enough for a fast forward, wide enough for GQA (num_kv_heads < num_heads)
    "qwen2": ModelSpec(
        family="qwen2",
        vocab_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        intermediate_dim=128,
        max_seq_len=64,
        rope_base=3e4,
        norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama3": ModelSpec(
        family="llama3",
        vocab_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        intermediate_dim=128,
        max_seq_len=64,
        rope_base=2e4,
        norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
# Every targeted weight's numel divides by 16,384: q/k/v/o 256 x 256, w1/w3 512 x 256, w2 256 x 512.
QLORA_SPEC = ModelSpec(
    family="qwen2",
    vocab_size=272,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    embed_dim=256,
    intermediate_dim=512,
    max_seq_len=128,
    rope_base=1e6,
    norm_eps=1e-6,
    tie_word_embeddings=True,
)
HF_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tokens_BT(vocab: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens_BT):
    with torch.no_grad():
        out = model(tokens_BT)
    return getattr(out, "logits", out)


def _random_base(spec: ModelSpec) -> nn.Module:
    """A model with every parameter random (biases and norm scales too), std 0.1 / around 1."""
    model = build_model(spec, seed=0)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("scale") else 0.1 * noise)
    return model


def _randomise_adapters(model: nn.Module, std: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in adapter_state_dict(model).values():
            p.copy_(std * torch.randn(p.shape, generator=gen))


def _next_token_loss(model, tokens_BT):
    logits_BTV = model(tokens_BT[:, :-1])
    return nn.functional.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten())


# ---------------------------------------------------------------------------------------------
# Config and errors


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rank", 0, "LoRAConfig.rank=0; must be an integer >= 1"),
        ("rank", 2.0, "LoRAConfig.rank=2.0"),
        ("rank", True, "LoRAConfig.rank=True"),
        ("alpha", 0.0, "LoRAConfig.alpha=0.0"),
        ("alpha", float("inf"), "LoRAConfig.alpha=inf"),
        ("dropout", 1.0, "LoRAConfig.dropout=1.0"),
        ("dropout", -0.1, "LoRAConfig.dropout=-0.1"),
        ("modules", (), "LoRAConfig.modules=()"),
        ("modules", "q_proj", "LoRAConfig.modules='q_proj'"),
        ("modules", ("q_proj", "lm_head"), "LoRAConfig.modules names 'lm_head'"),
        ("modules", ("o_proj", "output_proj"), "names 'output_proj' twice"),
        ("quantize_base", 1, "LoRAConfig.quantize_base=1"),
    ],
)
def test_config_rejects_bad_fields(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LoRAConfig(**{field: value})


def test_config_aliases_and_converter():
    config = LoRAConfig(modules=("o_proj", "gate_proj", "down_proj", "up_proj", "q_proj"))
    assert config.modules == ("output_proj", "w1", "w2", "w3", "q_proj")
    assert config.converter == "lora" and LoRAConfig(quantize_base=True).converter == "qlora"


def test_apply_errors_leave_the_model_unchanged():
    moe = build_model(get_preset("tiny-moe"), seed=0)
    with pytest.raises(
        ValueError,
        match=r"LoRAConfig.modules names 'w1'.*MoEFeedForward.*has: "
        r"q_proj, k_proj, v_proj, output_proj$",
    ):
        apply_lora(moe, LoRAConfig(modules=("q_proj", "w1")))
    assert not has_adapters(moe)

    # tiny-1m: num_kv_heads=2, width 128 -> k_proj [64, 128], 8,192 elements (q_proj fits: 16,384)
    model = build_model(get_preset("tiny-1m"), seed=0)
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.attn\.k_proj: weight shape \(64, 128\), "
        r"numel 8192; .*multiple of 64 \* 256 = 16,384",
    ):
        apply_lora(model, LoRAConfig(quantize_base=True))
    assert not has_adapters(model)

    apply_lora(model, LoRAConfig(rank=2))
    with pytest.raises(ValueError, match="has LoRA adapters already"):
        apply_lora(model, LoRAConfig(rank=2))
    with pytest.raises(ValueError, match="merge_lora needs a model with LoRA adapters"):
        merge_lora(build_model(get_preset("tiny-1m"), seed=0))


def test_adapter_functions_refuse_a_plain_model(tmp_path):
    spec = get_preset("tiny-1m")
    plain = build_model(spec, seed=0)
    for call in (
        lambda: adapter_state_dict(plain),
        lambda: merge_lora(plain),
        lambda: save_peft_adapter(plain, tmp_path / "a", spec=spec),
    ):
        with pytest.raises(ValueError, match="needs a model with LoRA adapters"):
            call()
    with (
        pytest.raises(ValueError, match="adapters_disabled needs a model with LoRA adapters"),
        adapters_disabled(plain),
    ):
        pass
    with pytest.raises(FileNotFoundError, match="no adapter_config.json in"):
        load_peft_adapter(plain, tmp_path, spec=spec)
    with pytest.raises(TypeError, match="apply_lora needs a LoRAConfig"):
        apply_lora(plain, {"rank": 4})


def test_merge_into_rejects_an_adapter_of_another_width():
    small = build_model(get_preset("tiny-1m"), seed=0)
    config = LoRAConfig(rank=4, modules=("q_proj",))
    apply_lora(small, config)
    wide_sd = build_model(get_preset("tiny-2m"), seed=0).state_dict()
    with pytest.raises(
        ValueError,
        match=r"adapter of layers\.0\.attn\.q_proj is for a weight of "
        r"shape \(128, 128\).*base weight has shape \(192, 192\)",
    ):
        merge_into(wide_sd, adapter_state_dict(small), config)


# ---------------------------------------------------------------------------------------------
# LoRA: start, freezing, training, disabling, merging


def test_converted_model_starts_exactly_and_trains_only_adapters():
    spec = get_preset("tiny-1m")
    model = build_model(spec, seed=0)
    tokens_BT = _tokens_BT(spec.vocab_size)
    before = _logits(model, tokens_BT)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    total = sum(p.numel() for p in model.parameters())

    report = apply_lora(model, LoRAConfig(rank=4, modules=LORA_MODULES), spec=spec)
    assert torch.equal(_logits(model, tokens_BT), before)
    # rank 4 x (in + out) per linear: q 128+128, k 128+64, v 128+64, o 128+128, w1/w3 128+512,
    # w2 512+128 -> 4 * 2,816 = 11,264 per layer, 4 layers.
    assert report.trainable_parameters == 4 * 11_264
    assert report.total_parameters == total + 4 * 11_264
    assert len(report.converted) == 4 * 7 and report.name == "lora"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a.weight", "lora_b.weight")) for n in trainable)
    assert len(trainable) == 2 * 4 * 7

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        _next_token_loss(model, tokens_BT).backward()
        optimizer.step()
    after = model.state_dict()
    changed = {
        k for k in after if not torch.equal(after[k], base.get(k, torch.zeros(after[k].shape)))
    }
    assert changed == {k for k in after if "lora_" in k}  # every A and B moved, nothing else
    with adapters_disabled(model):
        assert torch.equal(_logits(model, tokens_BT), before)
    assert not torch.allclose(_logits(model, tokens_BT), before, atol=1e-4)


def test_conversion_is_deterministic_and_leaves_the_global_rng_alone():
    """Two conversions of the same model give the same A (torchtune's Kaiming-uniform draw:
    bound 1 / sqrt(in) for a = sqrt(5)), whatever the global RNG state, which is not advanced."""
    spec = get_preset("tiny-1m")
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first, second = build_model(spec, seed=0), build_model(spec, seed=0)
    apply_lora(first, LoRAConfig(rank=4))
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.rand(5)
    apply_lora(second, LoRAConfig(rank=4))
    a, b = adapter_state_dict(first), adapter_state_dict(second)
    assert all(torch.equal(a[k], b[k]) for k in a)
    a_RI = a["layers.0.attn.q_proj.lora_a.weight"]
    assert a_RI.abs().max() <= 128**-0.5 and a_RI.abs().max() > 0.9 * 128**-0.5
    assert not torch.equal(a_RI, a["layers.1.attn.q_proj.lora_a.weight"])


def test_merge_gives_the_adapted_logits_and_exports_to_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = SPECS["qwen2"]
    model = _random_base(spec)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, modules=LORA_MODULES), spec=spec)
    _randomise_adapters(model)
    tokens_BT = _tokens_BT(spec.vocab_size)
    adapted = _logits(model, tokens_BT)

    assert merge_lora(model) is model and not has_adapters(model)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith("q_proj"))
    torch.testing.assert_close(_logits(model, tokens_BT), adapted, atol=1e-5, rtol=0)
    save_hf_checkpoint(model, spec, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(_logits(hf, tokens_BT), adapted, atol=1e-5, rtol=0)


def _bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers (8 significant bits) around float64 `ref`: 2^(e - 8) where
    |ref| = m * 2^e with m in [0.5, 1) (torch.frexp)."""
    _, exponent = torch.frexp(ref)
    return torch.pow(2.0, (exponent - 8).double())


def test_merge_rounds_once_to_bf16():
    """A bf16 base plus fp32 adapters: every merged element is within half a bf16 ulp of the
    float64 W + s B A (round to nearest; the 2^-8 ulp slack covers fp32's own rounding at
    near-ties), while merging in bf16 arithmetic misses that bound."""
    gen = torch.Generator().manual_seed(0)
    w_OI = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    a_RI = torch.randn(8, 64, generator=gen) * 0.3
    b_OR = torch.randn(96, 8, generator=gen) * 0.3
    config = LoRAConfig(rank=8, alpha=4.0)  # s = 0.5: s B A is about as large as W
    merged = merge_into(
        {"m.weight": w_OI}, {"m.lora_a.weight": a_RI, "m.lora_b.weight": b_OR}, config
    )["m.weight"]
    assert merged.dtype == torch.bfloat16
    ref = w_OI.double() + 0.5 * (b_OR.double() @ a_RI.double())
    bound = 0.5 * _bf16_ulp(ref) * (1 + 2**-8)
    assert ((merged.double() - ref).abs() <= bound).all()

    naive = w_OI + 0.5 * (b_OR.to(torch.bfloat16) @ a_RI.to(torch.bfloat16))
    assert ((naive.double() - ref).abs() > bound).float().mean() > 0.05

    # merge_lora on a bf16 model: adapters are bf16 there (exact in float64 too)
    model = build_model(SPECS["llama3"], seed=0, dtype=torch.bfloat16)
    apply_lora(model, LoRAConfig(rank=8, alpha=4.0, modules=("v_proj",)))
    _randomise_adapters(model, std=0.3)
    lora = model.layers[1].attn.v_proj
    w, a, b = (t.detach().double() for t in (lora.weight, lora.lora_a.weight, lora.lora_b.weight))
    ref = w + 0.5 * (b @ a)
    merge_lora(model)
    out = model.layers[1].attn.v_proj.weight
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).abs() <= 0.5 * _bf16_ulp(ref) * (1 + 2**-8)).all()


# ---------------------------------------------------------------------------------------------
# QLoRA


def test_qlora_base_is_nf4_smaller_and_trains():
    from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4

    spec = QLORA_SPEC
    model = build_model(spec, seed=0)
    fp32_bytes = parameter_bytes(model)
    assert fp32_bytes == 4 * sum(p.numel() for p in model.parameters())
    tokens_BT = _tokens_BT(spec.vocab_size, batch=4, length=32)
    reference = copy.deepcopy(model)  # the same base with each targeted weight dequantised
    with torch.no_grad():
        for layer in reference.layers:
            for linear in (
                layer.attn.q_proj,
                layer.attn.k_proj,
                layer.attn.v_proj,
                layer.attn.output_proj,
                layer.mlp.w1,
                layer.mlp.w2,
                layer.mlp.w3,
            ):
                linear.weight.copy_(to_nf4(linear.weight.detach()).get_original_weight())

    report = apply_lora(model, LoRAConfig(rank=4, modules=LORA_MODULES, quantize_base=True))
    assert report.name == "qlora"
    bases = [m.weight for n, m in model.named_modules() if hasattr(m, "lora_a")]
    assert len(bases) == 14 and all(isinstance(w, NF4Tensor) for w in bases)
    torch.testing.assert_close(
        _logits(model, tokens_BT), _logits(reference, tokens_BT), atol=1e-5, rtol=0
    )

    # Quantised: 2 layers x (4 x 65,536 + 3 x 131,072) = 1,310,720 elements, 14 weights. NF4
    # holds numel / 2 bytes of codes + numel / 64 int8 scales + numel / 16,384 fp32 factors, and
    # per weight one fp32 mean and a 16-entry fp32 code table.
    quantised = 1_310_720
    nf4 = quantised // 2 + quantised // 64 + 4 * quantised // 16_384 + 14 * (4 + 16 * 4)
    adapters = 4 * report.trainable_parameters
    assert parameter_bytes(model) == fp32_bytes - 4 * quantised + nf4 + adapters
    lora_fp32 = build_model(spec, seed=0)
    apply_lora(lora_fp32, LoRAConfig(rank=4, modules=LORA_MODULES))
    assert parameter_bytes(lora_fp32) == fp32_bytes + adapters  # 5,671,936 bytes
    assert parameter_bytes(model) < 0.2 * parameter_bytes(lora_fp32)  # 1,106,168 bytes

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = _next_token_loss(model, tokens_BT)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05
    assert all(isinstance(w, NF4Tensor) for w in bases)  # still NF4 after training

    adapted = _logits(model, tokens_BT)
    merge_lora(model)
    assert all(
        m.weight.dtype == torch.float32 and type(m.weight) is nn.Parameter
        for n, m in model.named_modules()
        if n.endswith("q_proj")
    )
    torch.testing.assert_close(_logits(model, tokens_BT), adapted, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# PEFT format, with peft as the reference


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
        base = _random_base(spec)
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
        _randomise_adapters(model)
        model.eval()
        tokens_BT = _tokens_BT(spec.vocab_size)
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
            adapted=_logits(model, tokens_BT),
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
    assert (ref["adapted"] - _logits(ref["base"], ref["tokens_BT"])).abs().max() > 0.1
    torch.testing.assert_close(ref["ours_logits"], ref["adapted"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_peft_saved_adapter_loads_onto_posttrain(family, peft_reference):
    ref = peft_reference[family]
    model = copy.deepcopy(ref["base"])
    report = load_peft_adapter(model, ref["made"], spec=ref["spec"])
    assert report.name == "lora" and len(report.converted) == 2 * 7
    model.eval()
    assert (ref["made_logits"] - _logits(ref["base"], ref["tokens_BT"])).abs().max() > 0.1
    torch.testing.assert_close(
        _logits(model, ref["tokens_BT"]), ref["made_logits"], atol=1e-5, rtol=0
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
