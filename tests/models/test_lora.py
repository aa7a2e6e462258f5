"""LoRA / QLoRA on torchtune decoders: config and errors, exact start, freezing, training only
the adapters, merge precision, and the NF4 QLoRA base. The PEFT adapter format, with peft as the
reference: tests/models/test_lora_peft.py.

References: float64 arithmetic for merge precision; transformers for the merged export;
hand-computed parameter counts and NF4 byte counts (torchao 0.15 `NF4Tensor` layout).

Shapes: B = batch, T = tokens, V = vocabulary, O = out features, I = in features, R = rank."""

from __future__ import annotations

import copy

import pytest
import torch
from _lora_helpers import SPECS, logits_of, random_base, random_tokens_BT, randomise_adapters
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
    tokens_BT = random_tokens_BT(spec.vocab_size)
    before = logits_of(model, tokens_BT)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    total = sum(p.numel() for p in model.parameters())

    report = apply_lora(model, LoRAConfig(rank=4, modules=LORA_MODULES), spec=spec)
    assert torch.equal(logits_of(model, tokens_BT), before)
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
        assert torch.equal(logits_of(model, tokens_BT), before)
    assert not torch.allclose(logits_of(model, tokens_BT), before, atol=1e-4)


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
    model = random_base(spec)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, modules=LORA_MODULES), spec=spec)
    randomise_adapters(model)
    tokens_BT = random_tokens_BT(spec.vocab_size)
    adapted = logits_of(model, tokens_BT)

    assert merge_lora(model) is model and not has_adapters(model)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith("q_proj"))
    torch.testing.assert_close(logits_of(model, tokens_BT), adapted, atol=1e-5, rtol=0)
    save_hf_checkpoint(model, spec, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(logits_of(hf, tokens_BT), adapted, atol=1e-5, rtol=0)


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
    randomise_adapters(model, std=0.3)
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
    tokens_BT = random_tokens_BT(spec.vocab_size, batch=4, length=32)
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
        logits_of(model, tokens_BT), logits_of(reference, tokens_BT), atol=1e-5, rtol=0
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

    adapted = logits_of(model, tokens_BT)
    merge_lora(model)
    assert all(
        m.weight.dtype == torch.float32 and type(m.weight) is nn.Parameter
        for n, m in model.named_modules()
        if n.endswith("q_proj")
    )
    torch.testing.assert_close(logits_of(model, tokens_BT), adapted, atol=1e-5, rtol=0)
