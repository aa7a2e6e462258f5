"""The QAT / PTQ config (`QATConfig`) and its schemes: one registry, scheme name -> the torchao
post-training quantisation config it builds, whether its weights are quantised in groups, and
what the machine needs to run it. `posttrain.train.qat` prepares, converts and quantises with
them.

Schemes (`QAT_SCHEMES`, each prepares and converts on a CPU-only torch 2.13 / torchao 0.15):

    int8da_int4w  int8 dynamic per-token asymmetric activations, int4 per-group symmetric
                  weights (torchao Int8DynamicActivationInt4WeightConfig)
    int8da_int8w  the same with int8 per-group symmetric weights
                  (Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8))
    int4w         int4 per-group symmetric weights, activations unquantised
                  (IntxWeightOnlyConfig(weight_dtype=torch.int4))
    int8w         int8 per-group symmetric weights, activations unquantised

`GPU_SCHEMES` are known to torchao but do not convert here; asking for one on a machine without
what it needs raises ValueError saying what is missing (they were not run on a GPU for this
project): "int4w_fbgemm" (Int4WeightOnlyConfig: needs fbgemm-gpu-genai >= 1.2.0 and CUDA; its
QAT fake-quantises with group 128 whatever the config says, so group_size must be 128) and
"float8" (Float8DynamicActivationFloat8WeightConfig: needs CUDA compute capability >= 8.9).

Example:
    >>> QATConfig(scheme="int8w", group_size=16)
    QATConfig(scheme='int8w', group_size=16)
    >>> SCHEMES["int8w"].grouped, SCHEMES["float8"].grouped
    (True, False)
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchao.core.config import AOBaseConfig

__all__ = ["QAT_SCHEMES", "GPU_SCHEMES", "SCHEMES", "Scheme", "QATConfig"]


@dataclass(frozen=True)
class Scheme:
    """One scheme of `SCHEMES`: how to build its torchao config, whether it quantises weights
    in groups, and why it cannot run on a device (None when it can)."""

    build: Callable[[int], AOBaseConfig]  # group_size -> torchao config
    grouped: bool  # weights quantised in groups of group_size inputs
    problem: Callable[[torch.device], str | None] = lambda device: None  # why it cannot run


def _int8da_int4w(group_size: int) -> AOBaseConfig:
    from torchao.quantization import Int8DynamicActivationInt4WeightConfig

    with warnings.catch_warnings():  # torchao's note that the config moves to prototype later
        warnings.filterwarnings("ignore", message=".*moving to prototype.*")
        # set_inductor_config=False: do not change torch._inductor's global settings
        return Int8DynamicActivationInt4WeightConfig(
            group_size=group_size, set_inductor_config=False
        )


def _intx(dtype: torch.dtype, *, activations: bool) -> Callable[[int], AOBaseConfig]:
    def build(group_size: int) -> AOBaseConfig:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup

        if activations:
            return Int8DynamicActivationIntxWeightConfig(
                weight_dtype=dtype, weight_granularity=PerGroup(group_size)
            )
        return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=PerGroup(group_size))

    return build


def _gpu_only(name: str) -> Callable[[int], AOBaseConfig]:
    def build(group_size: int) -> AOBaseConfig:
        import torchao.quantization as tq

        if name == "Int4WeightOnlyConfig":
            return tq.Int4WeightOnlyConfig(group_size=group_size)
        return getattr(tq, name)()

    return build


def _fbgemm_problem(device: torch.device) -> str | None:
    if importlib.util.find_spec("fbgemm_gpu") is None:
        return "torchao's Int4WeightOnlyConfig needs fbgemm-gpu-genai >= 1.2.0, not installed"
    if device.type != "cuda":
        return f"fbgemm's int4 kernels need a CUDA device; the model is on {device}"
    return None


def _float8_problem(device: torch.device) -> str | None:
    if device.type != "cuda":
        return (
            "torchao's float8 dynamic activation quantisation needs a CUDA device of compute "
            f"capability >= 8.9 (or MI300+); the model is on {device}"
        )
    if torch.cuda.get_device_capability(device) < (8, 9):
        return (
            f"torchao's float8 dynamic activation quantisation needs CUDA compute capability "
            f">= 8.9; {torch.cuda.get_device_name(device)} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
        )
    return None


SCHEMES: dict[str, Scheme] = {
    "int8da_int4w": Scheme(_int8da_int4w, grouped=True),
    "int8da_int8w": Scheme(_intx(torch.int8, activations=True), grouped=True),
    "int4w": Scheme(
        _intx(torch.int4, activations=False),  # type: ignore[attr-defined]  # torch's stub lacks int4
        grouped=True,
    ),
    "int8w": Scheme(_intx(torch.int8, activations=False), grouped=True),
    "int4w_fbgemm": Scheme(
        _gpu_only("Int4WeightOnlyConfig"), grouped=True, problem=_fbgemm_problem
    ),
    "float8": Scheme(
        _gpu_only("Float8DynamicActivationFloat8WeightConfig"),
        grouped=False,
        problem=_float8_problem,
    ),
}

QAT_SCHEMES = ("int8da_int4w", "int8da_int8w", "int4w", "int8w")
"""Schemes that prepare (fake quantisation) and convert (integer weights) on CPU here."""

GPU_SCHEMES = ("int4w_fbgemm", "float8")
"""Schemes torchao has that do not convert on CPU; each raises ValueError with the reason when
what it needs is missing."""

_FBGEMM_QAT_GROUP = 128  # torchao 0.15 `_infer_fake_quantize_configs`: Int4WeightOnlyConfig v2


@dataclass(kw_only=True, frozen=True)
class QATConfig:
    """Which quantisation QAT simulates and PTQ / convert applies (the "qat" converter).

    Attributes:
        scheme: one of `QAT_SCHEMES` (or `GPU_SCHEMES` on a machine that has what they need).
        group_size: inputs per weight-quantisation group (one fp32 scale per group of each output
            row); must be >= 2 and divide the `in_features` of every converted linear (checked by
            `prepare_qat` / `quantize_post_training`, which name the module that does not).
            Unused by "float8" (per-tensor scales); "int4w_fbgemm" needs 128.

    Raises:
        ValueError: for an unknown scheme (listing `QAT_SCHEMES` and `GPU_SCHEMES`), a
            group_size below 2, or "int4w_fbgemm" with a group_size other than 128.
        TypeError: for a scheme that is not a str or a group_size that is not an int.
    """

    scheme: str = "int8da_int4w"
    group_size: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, str):
            raise TypeError(
                f"QATConfig.scheme={self.scheme!r}; must be a str, one of {', '.join(QAT_SCHEMES)}"
            )
        if self.scheme not in SCHEMES:
            raise ValueError(
                f"QATConfig.scheme={self.scheme!r}; allowed: {', '.join(QAT_SCHEMES)} "
                f"(and on GPUs that have what they need: {', '.join(GPU_SCHEMES)})"
            )
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise TypeError(f"QATConfig.group_size={self.group_size!r}; must be an int >= 2")
        if self.group_size < 2:
            raise ValueError(
                f"QATConfig.group_size={self.group_size}; must be an int >= 2 "
                "(torchao's per-group quantisation needs groups of two or more)"
            )
        if self.scheme == "int4w_fbgemm" and self.group_size != _FBGEMM_QAT_GROUP:
            raise ValueError(
                f"QATConfig.group_size={self.group_size} with scheme "
                f"'int4w_fbgemm'; must be {_FBGEMM_QAT_GROUP}: torchao 0.15 "
                f"fake-quantises Int4WeightOnlyConfig with groups of "
                f"{_FBGEMM_QAT_GROUP} whatever its group_size"
            )

    @property
    def converter(self) -> str:
        """The registered converter name (`posttrain.train.converters`): "qat"."""
        return "qat"

    def torchao_config(self) -> AOBaseConfig:
        """The torchao base (post-training quantisation) config of this scheme."""
        return SCHEMES[self.scheme].build(self.group_size)
