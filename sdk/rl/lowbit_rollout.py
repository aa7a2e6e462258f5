"""A sampler that is not the trained policy: a low-bit (torchao weight-only) copy of the policy
samples the rollouts, the full-precision policy trains; the train/infer mismatch this causes is
measured every step and can be corrected by truncated importance sampling.

Notation: B = trajectories of the step, T = padded tokens per row (prompt + completion).

One `RLTrainer` step with `rollout_quantization="int8"` (or an `algo.rollout_correction`, or
`rollout_engine="vllm"`, where the vLLM server is the sampler: `posttrain.rl.engine_rollout`):

    sampler      = quantized_rollout_copy(policy, "int8")    # refreshed before each rollout,
                                                             # from the current weights
    groups       = collect_groups(sampler, ...)              # rollout_logprobs_BT: sampler's
    old_logprobs = the full-precision policy's, recomputed without grad (eval mode, the same
                   temperature / top-p): the PPO ratio compares the trained policy with itself
    metrics      = sampler_mismatch_metrics(old, rollout)    # rollout_kl_mean, _delta_max/mean
    weights      = rollout_correction_weights(old, rollout)  # algo.rollout_correction != "none"
                   multiply each token's policy loss (verl's `rollout_is_weights`)

This is verl's "decoupled" rollout correction (three policies: sampler, old, current; verl 0.9.1
`verl/trainer/ppo/rollout_corr_helper.py`). Under a `ParallelPlan` the quantised copy is made
from the plan's gathered plain copy (`posttrain.rl.parallel`), and the old log-probs come from
the split policy. The default path (no quantised sampler, no correction) recomputes nothing: the
old log-probs are the sampler's own, its metrics row has none of these columns.

Example:
    >>> from posttrain.models import build_model, get_preset
    >>> copy_, report = quantized_rollout_copy(build_model(get_preset("tiny-1m"), seed=0), "int8")
    >>> copy_.layers[0].attn.q_proj.weight.qdata.dtype, len(report.converted)
    (torch.int8, 28)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from posttrain.models.conversion import ConversionReport
from posttrain.policy.policy import Policy
from posttrain.rl.config import RLAlgorithm
from posttrain.rl.verl_registry import _VERL_ROLLOUT_IS, ROLLOUT_CORRECTIONS

__all__ = [
    "ROLLOUT_QUANTIZATIONS",
    "SAMPLER_METRICS",
    "ROLLOUT_IS_METRICS",
    "check_rollout_quantization",
    "quantized_rollout_copy",
    "quantized_sampler",
    "scores_apart_from_sampler",
    "frozen_logprobs",
    "sampler_mismatch_metrics",
    "rollout_correction_weights",
    "decouple_sampler",
]

ROLLOUT_QUANTIZATIONS = ("int8",)
"""Weight-only quantisations of the rollout copy (torchao 0.15, CPU and GPU):

  * "int8": `Int8WeightOnlyConfig(version=2)`, per-output-channel symmetric int8 weights
    (`Int8Tensor`, int8 `qdata` + float scale), activations stay in the model's dtype.

Left out because they do not run on torch 2.13 CPU + torchao 0.15: "int4"
(`Int4WeightOnlyConfig` version 2 needs fbgemm-gpu-genai for its plain layout and has no CPU
kernel for plain_int32; only the deprecated version 1 with `Int4CPULayout` runs, and only on a
bfloat16 copy) and "fp8" (`Float8WeightOnlyConfig` quantises and runs a no-grad forward, but
its linear fails inside `torch.inference_mode`, where the KV-cache sampler runs: "Cannot set
version_counter for inference tensor")."""

SAMPLER_METRICS = ("rollout_kl_mean", "rollout_logprob_delta_max", "rollout_logprob_delta_mean")
"""Train/infer mismatch columns of a step's metrics row (`sampler_mismatch_metrics`)."""

ROLLOUT_IS_METRICS = (
    "rollout_is_mean",
    "rollout_is_max",
    "rollout_is_min",
    "rollout_is_ratio_fraction_high",
    "rollout_is_eff_sample_size",
)
"""verl's names of the weight statistics `rollout_correction_weights` reports: mean, max and min
of the truncated weights over response tokens (sequence mode: max and min of the raw sequence
weights), the fraction above the threshold (the truncated share: of tokens, or of sequences in
sequence mode) and the effective sample size 1 / mean((w / mean w)^2)."""


def check_rollout_quantization(name: str | None, *, top_p: float = 1.0) -> str | None:
    """`name` itself when it is None or one of `ROLLOUT_QUANTIZATIONS` (then with top_p == 1).

    Raises:
        ValueError: for any other name, listing the allowed ones; a quantised sampler with
            top_p < 1 (a token inside the sampler's top-p set but outside the trained policy's
            has log-prob -inf under the policy: an infinite importance ratio).
    """
    if name is not None and name not in ROLLOUT_QUANTIZATIONS:
        raise ValueError(
            f"rollout_quantization={name!r}; allowed: None (sample with the policy "
            f"itself) or {', '.join(map(repr, ROLLOUT_QUANTIZATIONS))} (int4 and "
            "fp8 weight-only do not run on this stack's CPU kernels: see "
            "posttrain.rl.lowbit_rollout.ROLLOUT_QUANTIZATIONS)"
        )
    if name is not None and top_p != 1.0:
        raise ValueError(
            f"top_p={top_p!r} with rollout_quantization={name!r}: a token in the "
            "quantised sampler's top-p set but outside the policy's has log-prob "
            "-inf under the policy (an infinite ratio); allowed: top_p=1.0"
        )
    return name


def quantized_rollout_copy(model: nn.Module, name: str) -> tuple[nn.Module, ConversionReport]:
    """A deep copy of `model` in eval mode, without grad, whose linear layers hold torchao
    weight-only low-bit weights (`torchao.quantization.quantize_`); `model` is not changed.

    Left in full precision, and listed in the report's `skipped`: the output projection
    (`output`; with tied embeddings it is torchtune's `TiedLinear` over the embedding table, not
    an `nn.Linear`, and the embedding is never quantised), and LoRA adapter matrices (`lora_a`,
    `lora_b`; a torchtune `LoRALinear`'s base weight is a plain parameter, not an `nn.Linear`, so
    it stays in full precision too).

    Args:
        model: a torchtune decoder (plain, not split by a plan).
        name: one of `ROLLOUT_QUANTIZATIONS`.

    Returns:
        (the quantised copy, a `ConversionReport` named "rollout_<name>").

    Raises:
        ValueError: for an unknown `name` (listing the allowed ones).
    """
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if check_rollout_quantization(name) is None:
        raise ValueError(f"name={name!r}; allowed: {', '.join(ROLLOUT_QUANTIZATIONS)}")
    configs = {"int8": lambda: Int8WeightOnlyConfig(version=2)}
    quantised = copy.deepcopy(model).eval().requires_grad_(False)
    converted: list[str] = []
    skipped: dict[str, str] = {}

    def pick(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        leaf = fqn.rsplit(".", 1)[-1]
        if fqn == "output":
            skipped[fqn] = "the output projection stays in full precision"
        elif leaf in ("lora_a", "lora_b"):
            skipped[fqn] = "LoRA adapters stay in full precision"
        else:
            converted.append(fqn)
            return True
        return False

    quantize_(quantised, configs[name](), filter_fn=pick)
    if hasattr(quantised, "output") and not isinstance(quantised.output, nn.Linear):
        skipped["output"] = "tied to the token embedding, which stays in full precision"
    return quantised, ConversionReport(
        name=f"rollout_{name}", converted=tuple(converted), skipped=skipped
    )


def quantized_sampler(source: Policy, name: str) -> tuple[Policy, ConversionReport]:
    """A new `Policy` whose model is `quantized_rollout_copy(source.model, name)` (the weights
    of `source` now), with `source`'s tokenizer and spec, and the conversion's report: what a
    step's rollouts sample with under `rollout_quantization=name`."""
    model, report = quantized_rollout_copy(source.model, name)
    return Policy(model, source.tokenizer, source.spec), report


def scores_apart_from_sampler(
    rollout_quantization: str | None, algo: RLAlgorithm, *, engine_apart: bool = False
) -> bool:
    """Whether the trainer recomputes the old log-probs with the trained policy instead of
    taking the sampler's: with a quantised sampler, a rollout engine apart from the policy
    (`engine_apart`, e.g. vLLM: `posttrain.rl.engine_rollout`), or when a rollout correction is
    asked for (the correction then weighs the policy against its own sampler: weights 1 up to
    float rounding)."""
    return rollout_quantization is not None or engine_apart or algo.rollout_correction != "none"


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)


@torch.no_grad()
def frozen_logprobs(
    score: Callable[[nn.Module], Tensor], model: nn.Module, *, base: bool = False
) -> Tensor:
    """`score(model)` ([B, T] log-probs of a batch, e.g. the trainer's `_forward`) without grad
    and in eval mode (no dropout, no random draws), the model's mode restored after. With
    `base`, inside `posttrain.models.lora.adapters_disabled(model)`: the log-probs of a LoRA
    policy's frozen base, its reference policy (no second model in memory).

    Raises:
        ValueError: `base` on a model without adapters.
    """
    from posttrain.models.lora import adapters_disabled

    with _eval_mode(model), adapters_disabled(model) if base else contextlib.nullcontext():
        return score(model)


def sampler_mismatch_metrics(
    logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, response_mask_BT: Tensor
) -> dict[str, float]:
    """Train/infer mismatch of one batch, over its response tokens (d = logprobs - rollout):

        rollout_kl_mean            mean of exp(d) - d - 1, verl's "k3_kl"
                                   (`rollout_corr_helper.compute_offpolicy_metrics`): the k3
                                   estimator (Schulman 2020, http://joschu.net/blog/kl-approx.html)
                                   of KL(pi_sampler || pi_trainer) on the sampler's tokens, >= 0
        rollout_logprob_delta_max  max |d|
        rollout_logprob_delta_mean mean |d|

    Args:
        logprobs_BT: [B, T] float, the trained policy's log-probs of the sampled tokens.
        rollout_logprobs_BT: [B, T] float, the sampler's.
        response_mask_BT: [B, T] bool/int, 1 on response tokens.

    Returns:
        {name: float} for `SAMPLER_METRICS`.

    Raises:
        ValueError: shapes that differ, or a mask without response tokens.
    """
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    mask_BT = _check_pair(logprobs_BT, rollout_logprobs_BT, response_mask_BT)
    delta = (logprobs_BT - rollout_logprobs_BT).detach().abs()[mask_BT]
    verl_metrics = compute_offpolicy_metrics(
        old_log_prob=logprobs_BT.detach(),
        rollout_log_prob=rollout_logprobs_BT.detach(),
        response_mask=mask_BT.to(logprobs_BT.dtype),
    )
    return {
        "rollout_kl_mean": float(verl_metrics["k3_kl"]),
        "rollout_logprob_delta_max": float(delta.max()),
        "rollout_logprob_delta_mean": float(delta.mean()),
    }


def rollout_correction_weights(
    logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    correction: str,
    threshold: float,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance-sampling weights of a sampler that is not the trained policy:
    verl's `compute_rollout_correction_weights` (verl 0.9.1 `rollout_corr_helper`; TIS, Yao et
    al. 2025, https://fengyao.notion.site/off-policy-rl) on log pi_trainer - log pi_sampler:

        "token_tis":    w_bt = min(exp(logprobs_bt - rollout_logprobs_bt), threshold)
        "sequence_tis": w_bt = min(exp(sum_t' (logprobs_bt' - rollout_logprobs_bt')), threshold)
                        the same for every t of row b (sum over its response tokens)
    verl clamps the exponent to [-20, 20]; weights are 0 off the response mask.

    Args:
        logprobs_BT: [B, T] float, the trained (full-precision) policy's log-probs of the
            sampled tokens.
        rollout_logprobs_BT: [B, T] float, the sampler's log-probs of the same tokens.
        response_mask_BT: [B, T] bool/int, 1 on response tokens.
        correction: "token_tis" or "sequence_tis" (`ROLLOUT_CORRECTIONS` but "none").
        threshold: the truncation bound, >= 1.

    Returns:
        (weights_BT, detached, in the log-probs' dtype; {name: float} for `ROLLOUT_IS_METRICS`).

    Raises:
        ValueError: an unknown correction or "none" (listing the allowed ones), a threshold
            below 1, shapes that differ, or a mask without response tokens.
    """
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    allowed = [name for name in ROLLOUT_CORRECTIONS if name != "none"]
    if correction not in allowed:
        raise ValueError(f"correction={correction!r}; allowed: {', '.join(allowed)}")
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not threshold >= 1.0
    ):
        raise ValueError(f"threshold={threshold!r}; must be a number >= 1")
    mask_BT = _check_pair(logprobs_BT, rollout_logprobs_BT, response_mask_BT)
    weights_BT, verl_metrics = compute_rollout_correction_weights(
        log_ratio=(logprobs_BT - rollout_logprobs_BT).detach(),
        response_mask=mask_BT.to(logprobs_BT.dtype),
        rollout_is=_VERL_ROLLOUT_IS[correction],
        rollout_is_threshold=float(threshold),
    )
    return weights_BT, {k: float(verl_metrics[k]) for k in ROLLOUT_IS_METRICS}


def decouple_sampler(batch: dict[str, Tensor], algo: RLAlgorithm) -> dict[str, float]:
    """When `batch` holds "trainer_logprobs_BT" (the trained policy's recomputed log-probs):
    the sampler's "old_logprobs_BT" become "rollout_logprobs_BT", the trained policy's become
    "old_logprobs_BT", and with `algo.rollout_correction` the weights are stored as
    "rollout_is_weights_BT" ([B, T]), in place. Returns the step's `SAMPLER_METRICS` (and
    `ROLLOUT_IS_METRICS` with a correction); {} and no change without "trainer_logprobs_BT"."""
    if "trainer_logprobs_BT" not in batch:
        return {}
    batch["rollout_logprobs_BT"] = batch["old_logprobs_BT"]
    batch["old_logprobs_BT"] = batch.pop("trainer_logprobs_BT")
    args = (batch["old_logprobs_BT"], batch["rollout_logprobs_BT"], batch["response_mask_BT"])
    metrics = sampler_mismatch_metrics(*args)
    if algo.rollout_correction != "none":
        batch["rollout_is_weights_BT"], is_metrics = rollout_correction_weights(
            *args, correction=algo.rollout_correction, threshold=algo.rollout_is_threshold
        )
        metrics.update(is_metrics)
    return metrics


def _check_pair(
    logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, response_mask_BT: Tensor
) -> Tensor:
    if logprobs_BT.dim() != 2 or not (
        logprobs_BT.shape == rollout_logprobs_BT.shape == response_mask_BT.shape
    ):
        raise ValueError(
            f"logprobs_BT {tuple(logprobs_BT.shape)}, rollout_logprobs_BT "
            f"{tuple(rollout_logprobs_BT.shape)} and response_mask_BT "
            f"{tuple(response_mask_BT.shape)} must share one [B, T] shape"
        )
    mask_BT = response_mask_BT != 0
    if not bool(mask_BT.any()):
        raise ValueError("response_mask_BT selects no token; there is nothing to compare")
    return mask_BT
