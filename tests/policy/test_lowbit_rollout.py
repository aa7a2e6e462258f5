"""Low-bit rollout in RL: an int8 weight-only copy samples while the full-precision policy trains,
the train/infer mismatch is measured, truncated importance sampling weighs the policy loss, and
a LoRA policy's reference is its own base (no second model).

Notation: B = rows, T = tokens per row.
"""

import copy
import dataclasses
import math

import pytest
import torch
from _rl_helpers import ToyTask, is_int8, toy_trainer
from torch import nn

from posttrain.core.checkpoint import load_checkpoint, resolve_checkpoint
from posttrain.models import build_model, get_preset
from posttrain.policy import Policy
from posttrain.policy.sampling import token_logprobs
from posttrain.rl import (
    ROLLOUT_QUANTIZATIONS,
    RLAlgorithm,
    RLTrainer,
    make_batch,
    policy_loss,
    quantized_rollout_copy,
    rollout_correction_weights,
    sampler_mismatch_metrics,
)

MISMATCH = ("rollout_kl_mean", "rollout_logprob_delta_max", "rollout_logprob_delta_mean")


def _plain(weight) -> bool:
    return type(weight) is nn.Parameter and weight.dtype == torch.float32


# --------------------------------------------------------------------------------- the copy


def test_int8_copy_quantises_the_linears_and_leaves_the_model_alone():
    """tiny-1m: 4 layers x (q, k, v, output_proj, w1, w2, w3) = 28 linears become int8; the
    tied output projection is not an nn.Linear and stays; the source model is untouched."""
    model = build_model(get_preset("tiny-1m"), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantised, report = quantized_rollout_copy(model, "int8")
    assert len(report.converted) == 28 and "output" in report.skipped
    assert all(is_int8(quantised.get_submodule(name).weight) for name in report.converted)
    assert not quantised.training and not any(p.requires_grad for p in quantised.parameters())
    assert all(_plain(p) for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_untied_output_projection_is_skipped():
    spec = dataclasses.replace(get_preset("tiny-1m"), tie_word_embeddings=False)
    quantised, report = quantized_rollout_copy(build_model(spec, seed=0), "int8")
    assert "output" not in report.converted and "output" in report.skipped
    assert _plain(quantised.output.weight) and is_int8(quantised.layers[0].mlp.w1.weight)


# ------------------------------------------------------------------------------ the trainer


def test_int8_rollout_trains_full_precision_and_reports_the_mismatch():
    """The step's sampler is an int8 copy of the weights at rollout time; the policy trains in
    full precision. The mismatch metrics equal an independent rescoring of the sampled tokens:
    Policy.logprobs with the int8 copy and with a copy of the pre-step policy (the generation's
    own log-probs differ from teacher-forced scoring by float rounding, < 1e-5).

    Measured on tiny-1m (seed 0, 3 new tokens): delta max 0.0066, delta mean 0.0025, k3 KL
    4.9e-6; the bounds below are ~8x and ~20x those."""
    trainer = toy_trainer(rollout_quantization="int8", lr=3e-3)
    at_rollout = copy.deepcopy(trainer.policy.model)
    row = trainer.step()
    sampler = trainer.sampler_policy
    assert sampler is not trainer.policy and trainer.rollout_report.name == "rollout_int8"
    assert is_int8(sampler.model.layers[0].attn.q_proj.weight)
    assert all(_plain(p) for p in trainer.policy.model.parameters())
    moved = [
        not torch.equal(p, q)
        for p, q in zip(trainer.policy.model.parameters(), at_rollout.parameters())
    ]
    assert any(moved) and row["grad_norm"] > 0

    assert all(math.isfinite(row[k]) and row[k] > 0 for k in MISMATCH)
    assert row["rollout_logprob_delta_max"] < 0.05 and row["rollout_kl_mean"] < 1e-4
    assert row["rollout_logprob_delta_mean"] <= row["rollout_logprob_delta_max"]
    rows = [t for g in trainer.last_groups for t in g]
    prompts, completions = [t.prompt_ids for t in rows], [t.completion_ids for t in rows]
    full = Policy(at_rollout, trainer.policy.tokenizer, trainer.policy.spec)
    d = torch.cat(
        [
            a - b
            for a, b in zip(
                full.logprobs(prompts, completions), sampler.logprobs(prompts, completions)
            )
        ]
    )
    assert abs(d.abs().max().item() - row["rollout_logprob_delta_max"]) < 1e-5
    assert abs(d.abs().mean().item() - row["rollout_logprob_delta_mean"]) < 1e-5
    k3 = (d.exp() - d - 1).mean().item()  # KL(sampler || policy), k3 estimator
    assert abs(k3 - row["rollout_kl_mean"]) < 1e-6
    assert abs(row["first_ratio_mean"] - 1.0) < 1e-6  # old log-probs are the policy's own


def test_default_path_has_no_mismatch_columns_and_correction_alone_gives_unit_weights():
    """No quantised sampler, no correction: the sampler's log-probs are the old ones and the row
    has no rollout_* columns but rollout_s. A correction without a quantised sampler recomputes
    the policy's log-probs: its weights are 1 up to float rounding (measured: 4.8e-7)."""
    row = toy_trainer().step()
    assert [k for k in row if k.startswith("rollout_")] == ["rollout_s"]
    algo = RLAlgorithm.grpo(group_size=4, kl_coef=0.0, rollout_correction="token_tis")
    row = toy_trainer(algo=algo).step()
    assert row["rollout_logprob_delta_max"] < 1e-5
    assert abs(row["rollout_is_mean"] - 1.0) < 1e-5 and row["rollout_is_ratio_fraction_high"] == 0


def test_bad_names_and_thresholds_raise():
    with pytest.raises(ValueError, match="rollout_quantization='int4'.*'int8'"):
        toy_trainer(rollout_quantization="int4")
    with pytest.raises(ValueError, match="top_p=0.9 with rollout_quantization"):
        toy_trainer(rollout_quantization="int8", top_p=0.9)
    with pytest.raises(ValueError, match="rollout_quantization='fp8'.*'int8'"):
        quantized_rollout_copy(build_model(get_preset("tiny-1m"), seed=0), "fp8")
    with pytest.raises(
        ValueError, match="unknown rollout_correction 'tis'; valid: none, token_tis, sequence_tis"
    ):
        RLAlgorithm(rollout_correction="tis")
    with pytest.raises(ValueError, match="rollout_is_threshold=0.5; must be >= 1.0"):
        RLAlgorithm(rollout_correction="token_tis", rollout_is_threshold=0.5)
    with pytest.raises(ValueError, match="correction='none'; allowed: token_tis, sequence_tis"):
        rollout_correction_weights(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), correction="none", threshold=2.0
        )
    assert ROLLOUT_QUANTIZATIONS == ("int8",)


# ----------------------------------------------------------------------- weights by hand


def _pair():
    """Three rows, d = logprobs - rollout on the response tokens (mask 1):
    row 0: d = [1, -1, 0] (4th token padding), row 1: d = [0.3, 0], row 2: d = [0.5, 0.5]."""
    logprobs = torch.tensor(
        [[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.3, 0.0, 0.0], [-1.0, -1.0, 0.0, 0.0]]
    )
    rollout = torch.tensor(
        [[-2.0, -1.0, -0.5, -9.0], [-0.5, -0.3, 0.0, 0.0], [-1.5, -1.5, 0.0, 0.0]]
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    return logprobs, rollout, mask


def test_token_tis_weights_by_hand():
    """w = min(exp(d), 2): row 0 [min(e, 2) = 2, e^-1 = 0.367879, 1, 0], row 1 [e^0.3 = 1.349859,
    1], row 2 [e^0.5 = 1.648721] x 2. Mean over the 7 tokens 9.015181 / 7 = 1.287883; one token
    of 7 above the threshold."""
    weights, metrics = rollout_correction_weights(*_pair(), correction="token_tis", threshold=2.0)
    want = torch.tensor(
        [[2.0, 0.367879, 1.0, 0.0], [1.349859, 1.0, 0.0, 0.0], [1.648721, 1.648721, 0.0, 0.0]]
    )
    torch.testing.assert_close(weights, want, atol=1e-6, rtol=0)
    assert not weights.requires_grad
    assert abs(metrics["rollout_is_mean"] - 1.287883) < 1e-6
    assert abs(metrics["rollout_is_ratio_fraction_high"] - 1 / 7) < 1e-7


def test_sequence_tis_weights_by_hand():
    """w_b = min(exp(sum_t d_bt), 2) on every response token of row b: row 0 exp(0) = 1, row 1
    e^0.3 = 1.349859, row 2 min(e^1, 2) = 2; one row of 3 above the threshold."""
    weights, metrics = rollout_correction_weights(
        *_pair(), correction="sequence_tis", threshold=2.0
    )
    want = torch.tensor(
        [[1.0, 1.0, 1.0, 0.0], [1.349859, 1.349859, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(weights, want, atol=1e-6, rtol=0)
    assert abs(metrics["rollout_is_ratio_fraction_high"] - 1 / 3) < 1e-7


def test_mismatch_metrics_by_hand():
    """|d| over the 7 tokens: [1, 1, 0, 0.3, 0, 0.5, 0.5]: max 1, mean 3.3 / 7 = 0.471429;
    k3 = mean(e^d - d - 1) = (0.718282 + 0.367879 + 0.049859 + 2 x 0.148721) / 7 = 0.204780."""
    metrics = sampler_mismatch_metrics(*_pair())
    assert metrics["rollout_logprob_delta_max"] == 1.0
    assert abs(metrics["rollout_logprob_delta_mean"] - 0.471429) < 1e-6
    assert abs(metrics["rollout_kl_mean"] - 0.204780) < 1e-6


def test_weights_multiply_the_policy_loss_per_token():
    """On-policy (ratio 1), advantage 1 per token, PPO clip, token-mean: the loss is
    -sum(w M) / sum(M) = -9.015181 / 7 = -1.287883 with the token weights, -1 without."""
    logprobs, rollout, mask = _pair()
    weights, _ = rollout_correction_weights(
        logprobs, rollout, mask, correction="token_tis", threshold=2.0
    )
    algo = RLAlgorithm(loss_agg_mode="token-mean")
    current = logprobs.clone().requires_grad_(True)
    args = (current, logprobs, torch.ones_like(logprobs), mask)
    weighted, _ = policy_loss(*args, algo=algo, rollout_is_weights_BT=weights)
    plain, _ = policy_loss(*args, algo=algo)
    assert abs(weighted.item() + 1.287883) < 1e-6 and abs(plain.item() + 1.0) < 1e-6


# --------------------------------------------------------------------------------- resume


def _run(run_dir, steps, resume=False):
    policy = Policy.from_spec("tiny-1m", seed=0)
    algo = RLAlgorithm.grpo(
        group_size=4, kl_coef=0.04, minibatch_size=8, rollout_correction="token_tis"
    )
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-3),
        task=ToyTask(),
        algo=algo,
        prompts_per_step=4,
        max_new_tokens=3,
        run_dir=run_dir,
        checkpoint_every=1,
        keep_last=None,
        progress=False,
        seed=7,
        resume=resume,
        rollout_quantization="int8",
    )
    trainer.fit(steps)
    return trainer


def test_resume_with_int8_rollout_is_bitwise_equal_to_uninterrupted(tmp_path, deterministic):
    full = _run(tmp_path / "full", 3)
    _run(tmp_path / "cut", 2)
    resumed = _run(tmp_path / "cut", 3, resume=True)
    for (name, a), b in zip(
        full.policy.model.state_dict().items(), resumed.policy.model.state_dict().values()
    ):
        assert torch.equal(a, b), name
    for column in ("reward_mean", "rollout_kl_mean", "rollout_is_mean", "pg_loss"):
        assert full.metrics[column].tolist() == resumed.metrics[column].tolist(), column
    assert len(resumed.metrics) == 3


# ---------------------------------------------------------------------------- LoRA reference


def _lora_policy(rank=4):
    """tiny-1m with torchtune LoRALinear on every q_proj and v_proj (base weights copied,
    lora_b zero: the same function at the start), everything but the adapters frozen."""
    from torchtune.modules.peft import LoRALinear, get_adapter_params, set_trainable_params

    policy = Policy.from_spec("tiny-1m", seed=0)
    original = copy.deepcopy(policy.model).eval().requires_grad_(False)
    for layer in policy.model.layers:
        for name in ("q_proj", "v_proj"):
            base = getattr(layer.attn, name)
            lora = LoRALinear(base.in_features, base.out_features, rank=rank, alpha=2 * rank)
            lora.weight.data.copy_(base.weight.data)
            setattr(layer.attn, name, lora)
    set_trainable_params(policy.model, get_adapter_params(policy.model))
    return policy, original


def test_lora_reference_is_the_base_with_adapters_disabled(tmp_path):
    """With kl_coef > 0 a LoRA policy gets no reference copy and checkpoints hold only the
    policy; after training, the reference log-probs equal those of a frozen copy of the original
    model, while the policy's own have moved away from them."""
    policy, original = _lora_policy()
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(trainable, lr=3e-2),
        task=ToyTask(),
        algo=RLAlgorithm.grpo(group_size=4, kl_coef=0.04),
        prompts_per_step=4,
        max_new_tokens=3,
        progress=False,
        run_dir=tmp_path,
        checkpoint_every=2,
    )
    assert trainer.reference is None
    rows = [trainer.step() for _ in range(2)]
    assert rows[-1]["kl"] > 0
    batch = make_batch(trainer.last_groups, policy.tokenizer.pad_id)
    policy.model.train()
    reference = trainer._frozen_forward(batch)["ref_logprobs_BT"]
    assert policy.model.training  # the mode is restored
    args = (batch["input_ids_BT"], batch["attention_mask_BT"], batch["response_mask_BT"])
    with torch.no_grad():
        want = token_logprobs(original, *args)
        own = token_logprobs(policy.model, *args)
    torch.testing.assert_close(reference, want, atol=1e-6, rtol=1e-6)  # log-probs ~ -5.6
    assert (own - want).abs().max() > 1e-3
    saved = load_checkpoint(resolve_checkpoint(tmp_path))["model_state"]
    assert set(saved) == {"policy"}


# ------------------------------------------------------------------------------ under a plan


@pytest.mark.slow  # ~20 s: two fresh processes import torch, torchtune, torchao and verl
def test_int8_rollout_under_dp_shard_2_quantises_the_gathered_copy(tmp_path):
    """2 gloo ranks, dp_shard=2: each data rank samples its prompts with an int8 copy of the
    gathered plain copy, which itself stays in full precision; the old log-probs come from the
    split policy (first ratio 1), and the mismatch metrics equal a rescoring of the global
    groups with the pre-step weights and an int8 copy of them, on both ranks (measured: delta
    max 0.0070 on both, rescored 0.0070, difference 5e-7)."""
    import lowbit_rollout_run as worker
    from _ranks import run_ranks

    run_ranks(worker.__file__, 2, tmp_path, str(tmp_path), log_prefix="plan")
    results = [torch.load(tmp_path / f"plan-rank{r}.pt") for r in range(2)]
    for result in results:
        assert result["sampler_int8"] and result["gathered_plain"]
        assert abs(result["first_ratio_mean"] - 1.0) < 1e-6
        assert 0 < result["delta_max"] < 0.05 and result["rollout_is_mean"] > 0
        assert abs(result["rescored_delta_max"] - result["delta_max"]) < 1e-5
    assert results[0]["delta_max"] == results[1]["delta_max"]
