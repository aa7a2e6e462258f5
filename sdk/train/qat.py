"""Quantisation-aware training (QAT) and post-training quantisation (PTQ) of a built torchtune
decoder, on torchao 0.15 (`torchao.quantization.qat.QATConfig`, `torchao.quantization.quantize_`).

    report = prepare_qat(model, QATConfig(scheme="int8da_int4w", group_size=32))  # fake quant
    ... train in fp32 (posttrain.train.Trainer): the forward rounds weights and activations ...
    report = convert_qat(model, config)          # real int weights; inference only from here
    # or, for a model trained without QAT:
    report = quantize_post_training(model, config)

`prepare_qat` is the "qat" converter of `posttrain.train.converters`; `convert_qat` and
`quantize_post_training` run after training, before evaluation or export.

Schemes: `posttrain.train.qat_config` (`QAT_SCHEMES` prepare and convert on a CPU-only torch
2.13 / torchao 0.15; `GPU_SCHEMES` need what their docstring says).

The fake quantisation (torchao `IntxFakeQuantizer`; `quant_primitives.choose_qparams_affine`
and `_fake_quantize_affine`), for a weight row split into groups g of `group_size` inputs and
b-bit signed integers [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1]:

    s_g = max(max|w_g|, eps) / ((qmax - qmin) / 2)   # int4: max|w_g| / 7.5, eps = fp32 eps
    w_fq = clamp(round(w * (1 / s_g)), qmin, qmax) * s_g        # round half to even

and, per token (row of the last dimension) for int8 activations [qmin, qmax] = [-128, 127]:

    lo = min(min x, 0), hi = max(max x, 0), s = max((hi - lo) / 255, eps)
    z = clamp(qmin - round(lo / s), qmin, qmax)
    x_fq = (clamp(round(x * (1 / s)) + z, qmin, qmax) - z) * s

Rounding passes gradients straight through (torchao `_Round`; Bengio et al. 2013). After
`convert_qat` the same numbers are stored as integer tensors (int8 storage, int4 values
unpacked on these CPU paths) with fp32 scales, inside torchao tensor subclasses; the logits of
the converted model equal the fake-quantised ones (measured difference 0.0 on tiny-1m,
tests/train/test_qat.py).

What is converted: every `nn.Linear` of the decoder except the output projection (untied:
kept in full precision; tied: it is the token embedding, never an `nn.Linear`), the token
embedding, the linears of LoRA adapters, and an MoE layer's router and shared-expert gate; the
routed experts' grouped [E, H, D] parameters are not `nn.Linear` and stay in full precision.
The report lists each skipped module with its reason.

Checked behaviour (tests/train/test_qat.py): a prepared model trains under `posttrain.train.Trainer`
(checkpoints and exact resume: its state dict has the plain model's keys) and generates with
`posttrain.policy.Policy.generate` (KV cache; per-token activation scales make cached and
uncached decoding agree). A converted model generates, but `Policy.save` cannot write its
tensor subclasses to safetensors (torch raises "Attempted to access the data pointer on an
invalid python storage"); save the QAT-trained fp32 weights before `convert_qat` and convert
after loading.

Example:
    >>> from posttrain.models import build_model, get_preset
    >>> model = build_model(get_preset("tiny-1m"), seed=0)
    >>> print(prepare_qat(model, QATConfig()))  # doctest: +NORMALIZE_WHITESPACE
    qat: 28 modules converted, 2 skipped (tok_embeddings: the token embedding stays in full
    precision (QAT here quantises nn.Linear layers); output: the output projection is tied to
    tok_embeddings and stays in full precision); 1,020,032 of 1,020,032 parameters train
    (100.00%)
    >>> is_qat_prepared(model)
    True
    >>> print(convert_qat(model, QATConfig()).converted[0])
    layers.0.attn.q_proj
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from posttrain.models.conversion import ConversionReport
from posttrain.train.qat_config import GPU_SCHEMES, QAT_SCHEMES, SCHEMES, QATConfig

if TYPE_CHECKING:
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    from posttrain.models.specs import ModelSpec

__all__ = [
    "QAT_SCHEMES",
    "GPU_SCHEMES",
    "QATConfig",
    "prepare_qat",
    "convert_qat",
    "quantize_post_training",
    "is_qat_prepared",
    "has_quantized_weights",
    "parameter_bytes",
]

_CONFIG_ATTR = "_posttrain_qat_config"


# ---------------------------------------------------------------------------- queries


def _fake_quantized_types() -> tuple[type, ...]:
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear

    return FakeQuantizedLinear, FakeQuantizedEmbedding


def is_qat_prepared(model: nn.Module) -> bool:
    """True when `model` holds torchao fake-quantised modules (`prepare_qat` ran, and
    `convert_qat` has not)."""
    kinds = _fake_quantized_types()
    return any(isinstance(m, kinds) for m in model.modules())


def _is_quantized_tensor(t: torch.Tensor) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def has_quantized_weights(model: nn.Module) -> bool:
    """True when a parameter of `model` is a torchao quantised tensor (`TorchAOBaseTensor`,
    after `convert_qat` or `quantize_post_training`; a QLoRA NF4 base does not count)."""
    from torchao.utils import TorchAOBaseTensor

    return any(isinstance(p, TorchAOBaseTensor) for p in model.parameters())


def _tensor_bytes(t: torch.Tensor) -> int:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):  # a quantised tensor (`_is_quantized_tensor`)
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by the parameters of `model` (each shared parameter once). A quantised tensor
    subclass counts the tensors it stores (integer data, scales, zero points), not its logical
    fp32 shape: a [128, 128] int4 weight with group 32 holds 16,384 int8 bytes + 2 x 512 fp32
    (scale, zero point) = 20,480 bytes against 65,536 in fp32."""
    return sum(_tensor_bytes(p) for p in model.parameters())


# ---------------------------------------------------------------------------- which modules


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def _check_model(model: nn.Module, config: QATConfig, spec: ModelSpec | None, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what}: model must be a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(config, QATConfig):
        raise TypeError(
            f"{what}: config must be a posttrain.train.qat.QATConfig; got {type(config).__name__}"
        )
    problem = SCHEMES[config.scheme].problem(_device(model))
    if problem is not None:
        raise ValueError(
            f"{what}: QATConfig.scheme={config.scheme!r} cannot run on this "
            f"machine: {problem}; use one of {', '.join(QAT_SCHEMES)}"
        )
    if spec is not None:
        from posttrain.models.specs import ModelSpec

        if not isinstance(spec, ModelSpec):
            raise TypeError(f"{what}: spec must be a ModelSpec or None; got {type(spec).__name__}")
        tied = _is_tied(model)
        if spec.tie_word_embeddings != tied:
            raise ValueError(
                f"{what}: spec.tie_word_embeddings={spec.tie_word_embeddings} but "
                f"the model's output projection is {'tied' if tied else 'untied'}; "
                "pass the spec the model was built from"
            )


def _is_tied(model: nn.Module) -> bool:
    from torchtune.modules import TiedLinear

    return isinstance(getattr(model, "output", None), TiedLinear)


def _classify(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """(names of the linears to quantise, skipped module -> reason), from the model's structure
    alone (a fake-quantised linear is an nn.Linear too, so a prepared model gives the same)."""
    from posttrain.models.moe import MoEFeedForward

    skipped: dict[str, str] = {}
    if isinstance(getattr(model, "tok_embeddings", None), nn.Embedding):
        skipped["tok_embeddings"] = (
            "the token embedding stays in full precision (QAT here quantises nn.Linear layers)"
        )
    if _is_tied(model):
        skipped["output"] = (
            "the output projection is tied to tok_embeddings and stays in full precision"
        )
    adapters: list[str] = []
    targets = []
    for name, module in model.named_modules():
        if callable(getattr(module, "adapter_params", None)):  # torchtune's AdapterModule
            adapters.append(name)
            skipped[name] = "a LoRA layer: its frozen base and adapters stay as they are"
        elif isinstance(module, MoEFeedForward):
            skipped[f"{name}.experts"] = (
                "routed experts are grouped [E, H, D] parameters, not "
                "nn.Linear; kept in full precision"
            )
        if not isinstance(module, nn.Linear) or any(name.startswith(a + ".") for a in adapters):
            continue
        last = name.rpartition(".")[2]
        if name == "output":
            skipped[name] = "the output projection (vocabulary logits) stays in full precision"
        elif last in ("router", "shared_expert_gate"):
            skipped[name] = f"an MoE {last.replace('_', ' ')} stays in full precision"
        else:
            targets.append(name)
    return targets, skipped


def _select(model: nn.Module, config: QATConfig, what: str) -> tuple[list[str], dict[str, str]]:
    """`_classify`, then check the selected linears: ValueError for none, or for one whose
    in_features group_size does not divide (named); TypeError for a non-float weight."""
    targets, skipped = _classify(model)
    if not targets:
        raise ValueError(f"{what}: the model has no nn.Linear layer to quantise")
    modules = dict(model.named_modules())
    for name in targets:
        weight = modules[name].weight
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"{what}: {name}.weight has dtype {weight.dtype}; QAT and PTQ take "
                "float32, bfloat16 or float16 weights"
            )
        in_features = modules[name].in_features
        if SCHEMES[config.scheme].grouped and in_features % config.group_size:
            ok = [
                g
                for g in (16, 32, 64, 128, 256)
                if all(modules[t].in_features % g == 0 for t in targets)
            ]
            raise ValueError(
                f"{what}: QATConfig.group_size={config.group_size} does not divide "
                f"{name}.in_features={in_features}; choose a group size that "
                f"divides every converted layer's in_features (e.g. "
                f"{', '.join(map(str, ok)) or 'a common divisor'})"
            )
    return targets, skipped


def _report(model: nn.Module, converted: list[str], skipped: dict[str, str]) -> ConversionReport:
    params = list(model.parameters())
    return ConversionReport(
        name="qat",
        converted=tuple(converted),
        skipped=skipped,
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
        total_parameters=sum(p.numel() for p in params),
    )


def _torchao_qat(config: QATConfig, step: str) -> TorchaoQATConfig:
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    return TorchaoQATConfig(config.torchao_config(), step=step)


# ---------------------------------------------------------------------------- prepare, convert, PTQ


def prepare_qat(
    model: nn.Module, config: QATConfig, *, spec: ModelSpec | None = None
) -> ConversionReport:
    """Swap the selected linears of `model` (in place) for torchao `FakeQuantizedLinear`s: the
    weights stay fp32 parameters that the optimizer updates, and every forward rounds weights
    (and, for the int8da schemes, input activations) as the module docstring states.

    Args:
        model: a built torchtune decoder (dtype of its linears float32 for training here).
        config: the `QATConfig`; keep it for `convert_qat`.
        spec: the model's `ModelSpec` (optional; checked against the model's output tying).

    Returns:
        A `ConversionReport` named "qat": the fake-quantised linears and each skipped module
        with its reason; every parameter still trains.

    Raises:
        ValueError: the model is prepared already, holds quantised weights already, has no
            linear to convert, a layer's in_features that group_size does not divide (named),
            a scheme that cannot run on this machine (saying what is missing), or a spec that
            does not match the model.
        TypeError: a model, config or spec of the wrong type, or non-float weights.
    """
    _check_model(model, config, spec, "prepare_qat")
    if is_qat_prepared(model):
        raise ValueError(
            "prepare_qat: the model is prepared for QAT already (it holds "
            "FakeQuantizedLinear modules); prepare once, then convert_qat"
        )
    if has_quantized_weights(model):
        raise ValueError(
            "prepare_qat: the model holds quantised weights already (convert_qat "
            "or quantize_post_training ran); QAT needs the float model"
        )
    targets, skipped = _select(model, config, "prepare_qat")
    from torchao.quantization import quantize_

    chosen = set(targets)
    quantize_(model, _torchao_qat(config, "prepare"), filter_fn=lambda m, fqn: fqn in chosen)
    setattr(model, _CONFIG_ATTR, config)
    kinds = _fake_quantized_types()
    modules = dict(model.named_modules())
    assert all(isinstance(modules[n], kinds) for n in targets), "torchao left a linear unprepared"
    return _report(model, targets, skipped)


def convert_qat(model: nn.Module, config: QATConfig) -> ConversionReport:
    """Replace the fake quantisation of a prepared `model` (in place) by quantised weights:
    each `FakeQuantizedLinear` becomes an `nn.Linear` whose weight is a torchao tensor subclass
    holding integer values and fp32 scales (the same rounding as the fake-quantised forward),
    with activations quantised on the fly for the int8da schemes. No fake-quantised module
    remains; the quantised weights do not train (requires_grad False).

    Args:
        model: a model that `prepare_qat` prepared (and that was then trained).
        config: the same `QATConfig` it was prepared with.

    Returns:
        A `ConversionReport` named "qat" listing the converted linears and the skipped modules.

    Raises:
        ValueError: the model was not prepared (use `quantize_post_training` for a model
            trained without QAT), `config` differs from the one it was prepared with, or the
            scheme cannot run on this machine (saying what is missing).
        TypeError: a model or config of the wrong type.
    """
    _check_model(model, config, None, "convert_qat")
    if not is_qat_prepared(model):
        raise ValueError(
            "convert_qat: the model is not prepared for QAT (no FakeQuantizedLinear "
            "module); call prepare_qat before training, or quantize_post_training "
            "for a model trained without QAT"
        )
    prepared_with = getattr(model, _CONFIG_ATTR, None)
    if prepared_with is not None and prepared_with != config:
        raise ValueError(
            f"convert_qat: the model was prepared with {prepared_with}, not "
            f"{config}; convert with the config it was trained with"
        )
    kinds = _fake_quantized_types()
    targets = [n for n, m in model.named_modules() if isinstance(m, kinds)]
    skipped = _classify(model)[1]
    from torchao.quantization import quantize_

    quantize_(model, _torchao_qat(config, "convert"), filter_fn=lambda m, fqn: isinstance(m, kinds))
    _check_quantized(model, targets, "convert_qat")
    if hasattr(model, _CONFIG_ATTR):
        delattr(model, _CONFIG_ATTR)
    return _report(model, targets, skipped)


def quantize_post_training(model: nn.Module, config: QATConfig) -> ConversionReport:
    """Post-training quantisation (PTQ, no training) of a float `model` in place with the
    scheme of `config`: the same linears `prepare_qat` would select get torchao quantised
    weights (torchao `quantize_` with the scheme's base config).

    Returns:
        A `ConversionReport` named "qat" (converted linears, skipped modules with reasons).

    Raises:
        ValueError: the model is prepared for QAT (use `convert_qat`), holds quantised weights
            already, has a layer whose in_features group_size does not divide (named), or the
            scheme cannot run on this machine (saying what is missing).
        TypeError: a model or config of the wrong type, or non-float weights.
    """
    _check_model(model, config, None, "quantize_post_training")
    if is_qat_prepared(model):
        raise ValueError(
            "quantize_post_training: the model is prepared for QAT; convert it "
            "with convert_qat (which keeps what QAT learnt)"
        )
    if has_quantized_weights(model):
        raise ValueError(
            "quantize_post_training: the model holds quantised weights already; "
            "quantise the float model once"
        )
    targets, skipped = _select(model, config, "quantize_post_training")
    from torchao.quantization import quantize_

    chosen = set(targets)
    quantize_(model, config.torchao_config(), filter_fn=lambda m, fqn: fqn in chosen)
    _check_quantized(model, targets, "quantize_post_training")
    return _report(model, targets, skipped)


def _check_quantized(model: nn.Module, targets: list[str], what: str) -> None:
    """torchao returns a module unchanged where a config does not apply; refuse that."""
    modules = dict(model.named_modules())
    kinds = _fake_quantized_types()
    left = [
        n
        for n in targets
        if isinstance(modules[n], kinds) or not _is_quantized_tensor(modules[n].weight)
    ]
    if left:
        raise RuntimeError(
            f"{what}: torchao left {left[0]} unquantised ({len(left)} layers); "
            "the model is partly converted"
        )
