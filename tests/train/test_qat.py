"""QAT and PTQ on torchao (posttrain.train.qat): the fake quantisation against a hand-written
round trip, prepare -> train -> convert, PTQ, what is skipped, Trainer and generation with a
prepared model, the refused inputs, and the accuracy benchmark's --quick run."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _ranks import run_script
from _train_helpers import sft_loader
from _waits import RUN_S
from torch import nn

from posttrain.models import ByteTokenizer, build_model, get_preset
from posttrain.policy import Policy
from posttrain.train import Trainer
from posttrain.train.qat import (
    GPU_SCHEMES,
    QAT_SCHEMES,
    QATConfig,
    convert_qat,
    has_quantized_weights,
    is_qat_prepared,
    parameter_bytes,
    prepare_qat,
    quantize_post_training,
)

ROOT = Path(__file__).resolve().parents[2]
SPEC = get_preset("tiny-1m")
EPS = torch.finfo(torch.float32).eps


def weight_fq(w: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Per-group symmetric round trip, written from torchao 0.15's choose_qparams_affine
    (SYMMETRIC) and _quantize_affine: s = max(max|w_g|, eps) / ((qmax - qmin) / 2),
    q = clamp(round(w * (1/s)), qmin, qmax), w_fq = q * s."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    g = w.reshape(w.shape[0], -1, group)
    s = (g.abs().amax(-1, keepdim=True) / ((qmax - qmin) / 2)).clamp(min=EPS)
    return (torch.clamp(torch.round(g * (1.0 / s)), qmin, qmax) * s).reshape(w.shape)


def token_fq(x: torch.Tensor) -> torch.Tensor:
    """Per-token asymmetric int8 round trip (choose_qparams_affine ASYMMETRIC):
    lo = min(min x, 0), hi = max(max x, 0), s = max((hi - lo) / 255, eps),
    z = clamp(-128 - round(lo / s), -128, 127), x_fq = (clamp(round(x/s) + z, -128, 127) - z) s."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 255).clamp(min=EPS)
    z = torch.clamp(-128 - torch.round(lo / s), -128, 127)
    return (torch.clamp(torch.round(x * (1.0 / s)) + z, -128, 127) - z) * s


def one_linear(in_features: int = 64, out_features: int = 24, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, out_features))


# ------------------------------------------------------------------ the fake quantisation


def test_int4_group_round_trip_by_hand():
    """One row, one group of 4, int4 weight-only: s = 1.5 / 7.5 = 0.2, w / s = [7.5, -3.75,
    1, 0.25] -> round (half to even) [8, -4, 1, 0] -> clamp to [-8, 7]: [7, -4, 1, 0], so
    w_fq = [1.4, -0.8, 0.2, 0.0] (the largest magnitude is clipped: torchao divides by 7.5,
    not 7)."""
    model = one_linear(4, 1)
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.5, -0.75, 0.2, 0.05]]))
        model[0].bias.zero_()
    prepare_qat(model, QATConfig(scheme="int4w", group_size=4))
    out = model(torch.eye(4))  # row i of the output is w_fq[:, i]
    torch.testing.assert_close(out.T, torch.tensor([[1.4, -0.8, 0.2, 0.0]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "scheme,bits,acts",
    [
        ("int8da_int4w", 4, True),
        ("int8da_int8w", 8, True),
        ("int4w", 4, False),
        ("int8w", 8, False),
    ],
)
def test_fake_quantized_linear_matches_reference(scheme, bits, acts):
    model = one_linear()
    w, b = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)) * 2
    prepare_qat(model, QATConfig(scheme=scheme, group_size=16))
    expected = F.linear(token_fq(x) if acts else x, weight_fq(w, 16, bits), b)
    assert (model(x) - expected).abs().max().item() <= 1e-6
    assert (F.linear(x, w, b) - expected).abs().max().item() > 1e-3  # it does round


# ------------------------------------------------------------------ prepare -> train -> convert


def test_prepare_train_convert_tiny_model():
    """3 AdamW steps at lr 1e-2 in fp32 under fake quantisation, then convert: the converted
    logits equal the fake-quantised ones to 1e-5 (measured 0.0: torchao's int kernels on CPU
    dequantise with the same scales), and no fake-quantised module remains."""
    model = build_model(SPEC, seed=0)
    config = QATConfig(scheme="int8da_int4w", group_size=32)
    report = prepare_qat(model, config, spec=SPEC)
    assert report.name == "qat" and len(report.converted) == 7 * SPEC.num_layers
    assert set(report.skipped) == {"tok_embeddings", "output"}
    assert report.trainable_parameters == report.total_parameters == SPEC.num_parameters()
    assert is_qat_prepared(model) and not has_quantized_weights(model)
    before = model.layers[0].mlp.w1.weight.detach().clone()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    metrics = Trainer(model, optimizer, data=sft_loader(16, batch_size=8), progress=False).fit(3)
    assert metrics["loss"].iloc[-1] < metrics["loss"].iloc[0]
    weight = model.layers[0].mlp.w1.weight
    assert weight.dtype == torch.float32 and (weight - before).abs().max() > 1e-3

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake = model(ids)
    after = convert_qat(model, config)
    assert after.converted == report.converted and after.skipped == report.skipped
    with torch.no_grad():
        real = model(ids)
    assert (real - fake).abs().max().item() <= 1e-5
    assert not is_qat_prepared(model) and has_quantized_weights(model)


def _storage(t: torch.Tensor) -> list[torch.Tensor]:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [leaf for name in t.__tensor_flatten__()[0] for leaf in _storage(getattr(t, name))]


def test_converted_weights_are_integers_and_smaller():
    """int8da_int4w on tiny-1m: each converted [out, in] weight stores out*in int8 values in
    [-8, 7] plus an fp32 scale and an fp32 zero point per group of 32: out*in + 8*out*in/32
    bytes, against 4*out*in in fp32; everything else stays fp32."""
    model = build_model(SPEC, seed=0)
    fp32_bytes = parameter_bytes(model)
    assert fp32_bytes == 4 * SPEC.num_parameters()
    linears = {n: m.weight.shape for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    prepare_qat(model, QATConfig())
    convert_qat(model, QATConfig())
    saved = sum(4 * o * i - (o * i + 8 * o * i // 32) for o, i in linears.values())
    assert parameter_bytes(model) == fp32_bytes - saved
    assert parameter_bytes(model) < 0.4 * fp32_bytes
    weight = model.layers[0].attn.q_proj.weight
    ints = [t for t in _storage(weight) if t.dtype == torch.int8]
    assert len(ints) == 1 and ints[0].shape == weight.shape
    assert ints[0].min() >= -8 and ints[0].max() <= 7 and not weight.requires_grad


@pytest.mark.parametrize("scheme", QAT_SCHEMES)
def test_ptq_equals_fake_quantized_forward(scheme):
    """PTQ of a float model (no QAT) gives the logits of the same weights fake-quantised."""
    plain, fake = build_model(SPEC, seed=0), build_model(SPEC, seed=0)
    report = quantize_post_training(plain, QATConfig(scheme=scheme))
    prepare_qat(fake, QATConfig(scheme=scheme))
    assert len(report.converted) == 28 and has_quantized_weights(plain)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (plain(ids) - fake(ids)).abs().max().item() <= 1e-5
        assert (plain(ids) - build_model(SPEC, seed=0)(ids)).abs().max().item() > 1e-4


def test_untied_output_projection_is_skipped():
    spec = dataclasses.replace(SPEC, tie_word_embeddings=False)
    model = build_model(spec, seed=0)
    report = prepare_qat(model, QATConfig(), spec=spec)
    assert "output" not in report.converted and "vocabulary" in report.skipped["output"]
    assert type(model.output) is nn.Linear


# ------------------------------------------------------------------ Trainer and generation


def test_prepared_model_checkpoints_and_resumes(tmp_path):
    """A prepared model's state dict has the plain model's keys; a run resumed from its
    checkpoint into a freshly prepared model continues with bitwise-equal weights."""

    def run(steps, resume):
        model = build_model(SPEC, seed=0)
        prepare_qat(model, QATConfig())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        trainer = Trainer(
            model,
            opt,
            data=sft_loader(16, batch_size=4),
            progress=False,
            run_dir=tmp_path / ("a" if steps == 4 and not resume else "b"),
            checkpoint_every=2,
            resume=resume,
        )
        trainer.fit(steps)
        return model

    straight = run(4, False)
    assert set(straight.state_dict()) == set(build_model(SPEC, seed=0).state_dict())
    run(2, False)  # into b, then resume b to 4 steps
    resumed = run(4, True)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def _greedy_without_cache(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, len(prompt) :].tolist()


def test_generate_with_prepared_and_converted_model():
    """Policy.generate (KV cache) on a prepared model gives the tokens of an uncached greedy
    loop (per-token activation scales do not depend on the other tokens), and the converted
    model generates the same tokens."""
    model = build_model(SPEC, seed=3)
    prepare_qat(model, QATConfig())
    policy = Policy(model, ByteTokenizer(), SPEC)
    prompts = [[1, 72, 101, 108], [1, 50, 43, 51, 61]]
    cached = [c.token_ids for c in policy.generate(prompts, max_new_tokens=8, temperature=0)]
    for prompt, tokens in zip(prompts, cached):
        assert tokens and tokens == _greedy_without_cache(model, prompt, len(tokens))
    convert_qat(model, QATConfig())
    assert [
        c.token_ids for c in policy.generate(prompts, max_new_tokens=8, temperature=0)
    ] == cached


# ------------------------------------------------------------------ refused inputs


def test_config_validation():
    with pytest.raises(ValueError, match=r"QATConfig.scheme='int3'; allowed: int8da_int4w, "):
        QATConfig(scheme="int3")
    with pytest.raises(ValueError, match=r"group_size=1; must be an int >= 2"):
        QATConfig(group_size=1)
    with pytest.raises(TypeError, match=r"group_size=True"):
        QATConfig(group_size=True)
    with pytest.raises(ValueError, match=r"group_size=32 with scheme 'int4w_fbgemm'; must be 128"):
        QATConfig(scheme="int4w_fbgemm", group_size=32)
    assert QATConfig().converter == "qat" and set(QAT_SCHEMES).isdisjoint(GPU_SCHEMES)


def test_group_size_must_divide_every_converted_layer():
    model = build_model(SPEC, seed=0)
    with pytest.raises(
        ValueError,
        match=r"group_size=48 does not divide "
        r"layers\.0\.attn\.q_proj\.in_features=128",
    ):
        prepare_qat(model, QATConfig(group_size=48))
    assert not is_qat_prepared(model)  # checked before anything changed
    with pytest.raises(ValueError, match=r"group_size=256 does not divide .*in_features=128"):
        quantize_post_training(model, QATConfig(group_size=256))
    assert not has_quantized_weights(model)


def test_refused_sequences():
    model = build_model(SPEC, seed=0)
    with pytest.raises(ValueError, match="not prepared for QAT.*quantize_post_training"):
        convert_qat(model, QATConfig())
    prepare_qat(model, QATConfig())
    with pytest.raises(ValueError, match="prepared for QAT already"):
        prepare_qat(model, QATConfig())
    with pytest.raises(ValueError, match="prepared for QAT; convert it with convert_qat"):
        quantize_post_training(model, QATConfig())
    with pytest.raises(ValueError, match="prepared with QATConfig\\(scheme='int8da_int4w'"):
        convert_qat(model, QATConfig(scheme="int8da_int8w"))
    convert_qat(model, QATConfig())
    with pytest.raises(ValueError, match="holds quantised weights already"):
        prepare_qat(model, QATConfig())
    with pytest.raises(ValueError, match="holds quantised weights already"):
        quantize_post_training(model, QATConfig())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_gpu_schemes_refused_on_cpu_with_the_reason():
    model = build_model(SPEC, seed=0)
    with pytest.raises(ValueError, match="'float8' cannot run on this machine: .*CUDA device"):
        prepare_qat(model, QATConfig(scheme="float8"))
    with pytest.raises(ValueError, match="'int4w_fbgemm' cannot run.*(fbgemm-gpu-genai|CUDA)"):
        quantize_post_training(model, QATConfig(scheme="int4w_fbgemm", group_size=128))
    assert not is_qat_prepared(model) and not has_quantized_weights(model)


def test_wrong_types_and_spec():
    model = build_model(SPEC, seed=0)
    with pytest.raises(TypeError, match="config must be a posttrain.train.qat.QATConfig"):
        prepare_qat(model, {"scheme": "int8da_int4w"})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        quantize_post_training("model", QATConfig())
    untied = dataclasses.replace(SPEC, tie_word_embeddings=False)
    with pytest.raises(
        ValueError, match="spec.tie_word_embeddings=False but the model's output projection is tied"
    ):
        prepare_qat(model, QATConfig(), spec=untied)
    with pytest.raises(ValueError, match="no nn.Linear layer"):
        prepare_qat(nn.Sequential(nn.ReLU()), QATConfig())


# ------------------------------------------------------------------ the benchmark


@pytest.mark.slow
def test_qat_accuracy_benchmark_quick(tmp_path):
    out = tmp_path / "qat.md"
    script = ROOT / "benchmarks" / "qat_accuracy.py"
    proc = run_script(script, ["--quick", "--out", str(out)], tmp_path, timeout_s=RUN_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| ([^|]+?) \| ([0-9.]+) \| \[([0-9.]+), ([0-9.]+)\] \| (\d+) \|", line)
        if m:
            rows[m.group(1)] = [float(v) for v in m.groups()[1:4]]
    for label in (
        "(a) fp32, no QAT",
        "(b) fp32 + PTQ int8da_int4w",
        "(c) QAT, fake-quantised",
        "(d) QAT, converted int8da_int4w",
    ):
        assert label in rows, (label, text)
        accuracy, low, high = rows[label]
        assert 0.0 <= low <= accuracy <= high <= 1.0
