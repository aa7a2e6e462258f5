"""RL algorithm choices: the `RLAlgorithm` config, its presets, and the names it accepts.

The names come from verl's registries (`verl.trainer.ppo.core_algos`, verl 0.9.1), read when a
config is validated (verl is imported then, on first use, not with this module), so an estimator
or loss registered with `register_advantage_estimator` / `register_policy_loss` (or verl's own
decorators) is accepted like a built-in one. This module and `posttrain.rl.verl_registry` (the
names, and the registering; importable from here too) are the one place that decides what a name
means; `posttrain.rl.algorithms` only calls what it resolves.

    >>> algo = RLAlgorithm.grpo(group_size=4)
    >>> algo.advantage_estimator, algo.policy_loss, algo.loss_agg_mode, algo.kl_estimator
    ('grpo', 'vanilla', 'seq-mean-token-mean', 'k3')
    >>> RLAlgorithm.grpo(group_size=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: advantage_estimator='grpo' normalises rewards within a group, so group_size ...
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from posttrain.core.checks import check_int
from posttrain.rl.verl_registry import (  # the names it accepts; importable from here too
    _VERL_ROLLOUT_IS,
    FIXED_AGG_MODE,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    ROLLOUT_CORRECTIONS,
    _estimator_fn,
    _kl_penalty,
    _required_params,
    advantage_estimators,
    core_algos,
    is_group_estimator,
    policy_losses,
    register_advantage_estimator,
    register_policy_loss,
    verl_algo_config,
)

if TYPE_CHECKING:
    from verl.workers.config.actor import ActorConfig

__all__ = [
    "RLAlgorithm",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "advantage_estimators",
    "policy_losses",
    "is_group_estimator",
    "register_advantage_estimator",
    "register_policy_loss",
    "verl_actor_config",
    "verl_algo_config",
]


@dataclass(kw_only=True)
class RLAlgorithm:
    """Every algorithmic choice of an RL step, validated when built.

    Attributes:
        advantage_estimator: verl estimator name (`advantage_estimators()`): grpo, rloo,
            reinforce_plus_plus, gae (needs a value head), ...
        policy_loss: verl policy-loss name (`policy_losses()`): vanilla (PPO clip), gspo, cispo,
            sapo, dppo_tv, ...
        loss_agg_mode: how a [B, T] loss matrix becomes a scalar (`LOSS_AGG_MODES`); the same
            mode aggregates the KL and value terms. Normalised over the whole optimizer step.
        kl_coef: beta of the KL-to-reference loss term (0 disables it; then no reference
            log-probabilities are needed).
        kl_estimator: `KL_ESTIMATORS` name (Schulman 2020, http://joschu.net/blog/kl-approx.html).
            As a loss on samples of the policy: k2's gradient is that of KL(pi || ref), k3's that
            of KL(ref || pi); k1's expected gradient is zero (use k1+ or k3+ to keep k1's or k3's
            value with k2's gradient).
        clip_ratio_low, clip_ratio_high: ratio clip range [1 - low, 1 + high] (PPO eps; DAPO's
            clip-higher when high > low). low = 1 means no lower clip.
        clip_ratio_c: dual-clip bound for negative advantages (Ye et al. 2019), > 1.
        group_size: completions sampled per prompt. Group estimators need >= 2.
        use_value_head: the policy has a value head (PPO with GAE).
        value_coef: weight of the value loss in the total loss (> 0 exactly with a value head).
        value_clip: clip range of the value prediction around the old value.
        entropy_coef: weight of an entropy bonus (subtracted from the loss) when entropies are
            given.
        gamma, lam: discount and GAE lambda, in [0, 1].
        norm_adv_by_std: GRPO divides by the group std (False: Dr. GRPO, Liu et al. 2025).
        ppo_epochs: passes over each batch of trajectories.
        minibatch_size: trajectories per optimizer step (None: the whole batch).
        loss_scale_factor: constant divisor of 'seq-mean-token-sum-norm' (required for it: verl
            otherwise uses the padded length of each micro-batch, which differs between them).
        policy_loss_options: fields of verl's `PolicyLossConfig` (e.g. dro_beta, clip_cov_ratio,
            kl_cov_ratio, ppo_kl_coef).
        rollout_correction: `ROLLOUT_CORRECTIONS` name. With w = pi_trainer / pi_sampler on a
            sampled token (the full-precision policy's log-prob, recomputed before the update,
            minus the sampler's), "token_tis" weights each token's policy loss by
            min(w_t, rollout_is_threshold), "sequence_tis" every token of a row by
            min(prod_t w_t, rollout_is_threshold); weights are detached. "none": no weights.
            Without a quantised sampler the weights are 1 up to float rounding (the sampler is
            the policy itself); the trainer then still recomputes the log-probs and reports them.
        filter_groups: DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2, the constraint
            0 < |{o_i correct}| < G of eq. 11; verl's `algorithm.filter_groups` on the reward):
            a step drops the groups whose rewards are all equal and samples further batches of
            `prompts_per_step` prompts until that many groups with mixed rewards are kept or
            `max_num_gen_batches` batches were sampled; then it trains on the groups it has
            (the first `prompts_per_step` kept, in sampling order; fewer, or none, when the
            batches ran out, counted as `groups_filtered` and `gen_batches`).
        max_num_gen_batches: the most batches one step samples with `filter_groups`, >= 1.
        overlong_buffer_len, overlong_penalty_factor: DAPO's soft overlong punishment (Yu et
            al. 2025, sec. 3.4, eq. 13; verl's `reward_model.overlong_buffer`): a completion
            whose longest sampled turn has L tokens gains
            min(-(L - (max_new_tokens - overlong_buffer_len)) / overlong_buffer_len
            * overlong_penalty_factor, 0) on its reward: 0 up to max_new_tokens - buffer tokens,
            -factor at the length limit (`posttrain.rl.rollout.overlong_penalty`). Buffer 0
            (the default): off; the buffer must be <= the trainer's max_new_tokens.
        rollout_is_threshold: the truncation bound of those weights, >= 1 (verl accepts any
            positive bound; below 1 every weight, even of a token both policies agree on, would
            be capped under 1, which shrinks the whole update instead of truncating the rare
            large ratios, and verl's metrics take 1 / threshold as the lower bound).

    Raises:
        ValueError: on an unknown name (listing the valid ones), an out-of-range number, or a
            combination that cannot work (see `__post_init__`).
    """

    advantage_estimator: str = "grpo"
    policy_loss: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    group_size: int = 8
    use_value_head: bool = False
    value_coef: float = 0.0
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    ppo_epochs: int = 1
    minibatch_size: int | None = None
    loss_scale_factor: int | None = None
    policy_loss_options: dict[str, Any] = field(default_factory=dict)
    rollout_correction: str = "none"
    rollout_is_threshold: float = 2.0
    filter_groups: bool = False
    max_num_gen_batches: int = 4
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0

    PRESETS: ClassVar[tuple[str, ...]] = (
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "ppo",
        "gspo",
        "cispo",
    )

    def __post_init__(self) -> None:
        if self.policy_loss not in policy_losses():
            raise ValueError(
                f"unknown policy_loss {self.policy_loss!r}; valid: {', '.join(policy_losses())}"
            )
        estimator = _estimator_fn(self.advantage_estimator)
        _one_of("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for name in ("kl_coef", "value_coef", "entropy_coef"):
            _number(name, getattr(self, name), low=0.0)
        for name in ("gamma", "lam"):
            _number(name, getattr(self, name), low=0.0, high=1.0)
        _number("clip_ratio_low", self.clip_ratio_low, low=0.0, high=1.0, low_open=True)
        _number("clip_ratio_high", self.clip_ratio_high, low=0.0, low_open=True)
        _number("value_clip", self.value_clip, low=0.0, low_open=True)
        if not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c!r}; the dual-clip bound must be > 1")
        check_int("group_size", self.group_size, minimum=1)
        check_int("ppo_epochs", self.ppo_epochs, minimum=1)
        check_int("max_num_gen_batches", self.max_num_gen_batches, minimum=1)
        check_int("overlong_buffer_len", self.overlong_buffer_len, minimum=0)
        _number("overlong_penalty_factor", self.overlong_penalty_factor, low=0.0)
        if not isinstance(self.filter_groups, bool):
            raise ValueError(f"filter_groups={self.filter_groups!r}; must be True or False")
        if self.minibatch_size is not None:
            check_int("minibatch_size", self.minibatch_size, minimum=1)

        group = "index" in inspect.signature(estimator).parameters
        if group and self.group_size < 2:
            plain = [n for n in advantage_estimators() if not is_group_estimator(n)]
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} normalises "
                f"rewards within a group, so group_size must be at least 2 (got "
                f"{self.group_size}); verl would give a group of one its raw reward "
                f"as advantage. Use group_size >= 2, or an estimator without "
                f"groups: {', '.join(plain)}"
            )
        needs_values = "values" in _required_params(estimator)
        if needs_values and not self.use_value_head:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} needs value "
                "estimates: set use_value_head=True (and value_coef > 0), or choose "
                "grpo, rloo or reinforce_plus_plus"
            )
        if self.use_value_head and not needs_values:
            raise ValueError(
                f"use_value_head=True but advantage_estimator="
                f"{self.advantage_estimator!r} does not use values; use 'gae' or "
                "set use_value_head=False"
            )
        if self.use_value_head != (self.value_coef > 0):
            raise ValueError(
                f"value_coef={self.value_coef!r} with use_value_head="
                f"{self.use_value_head}: a value head needs value_coef > 0, and "
                "value_coef > 0 needs a value head"
            )
        fixed = FIXED_AGG_MODE.get(self.policy_loss)
        if fixed is not None and self.loss_agg_mode != fixed:
            raise ValueError(
                f"policy_loss={self.policy_loss!r} always aggregates as {fixed!r} "
                f"(it ignores loss_agg_mode); set loss_agg_mode={fixed!r} so the "
                "step normaliser and the KL term agree with it"
            )
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' needs a constant "
                "loss_scale_factor (e.g. the maximum response length)"
            )
        from verl.workers.config.actor import PolicyLossConfig

        allowed = [f.name for f in dataclasses.fields(PolicyLossConfig) if f.name != "loss_mode"]
        unknown = sorted(set(self.policy_loss_options) - set(allowed))
        if unknown:
            raise ValueError(
                f"policy_loss_options has unknown keys {unknown}; allowed (fields of "
                f"verl's PolicyLossConfig): {', '.join(allowed)}"
            )
        _one_of("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        _number("rollout_is_threshold", self.rollout_is_threshold, low=1.0)
        self._dry_run()

    @property
    def rollout_is(self) -> str | None:
        """verl's `rollout_is` level of `rollout_correction` ("token", "sequence"; None for
        "none")."""
        return _VERL_ROLLOUT_IS.get(self.rollout_correction)

    def _dry_run(self) -> None:
        """Call the verl loss once on a 1 x 2 case, so that verl's own checks (e.g. dro needs
        dro_beta) fail here, at config time, not in the middle of a run."""
        logprob = torch.zeros(1, 2)
        try:
            core_algos().get_policy_loss_fn(self.policy_loss)(
                old_log_prob=logprob,
                log_prob=logprob,
                advantages=torch.ones(1, 2),
                response_mask=torch.ones(1, 2),
                loss_agg_mode=self.loss_agg_mode,
                config=verl_actor_config(self),
                rollout_is_weights=None,
            )
            _kl_penalty(logprob, logprob, self.kl_estimator)
        except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
            raise ValueError(
                f"verl rejects policy_loss={self.policy_loss!r} with these settings "
                f"({type(e).__name__}: {e}); check policy_loss_options"
            ) from e

    # ---------------------------------------------------------------------------------------
    # Presets. Each takes keyword overrides: RLAlgorithm.grpo(group_size=16, kl_coef=0.0).
    # ---------------------------------------------------------------------------------------

    @classmethod
    def grpo(cls, **overrides: Any) -> RLAlgorithm:
        """GRPO (Shao et al. 2024, DeepSeekMath, eq. 3): group-normalised outcome advantages,
        PPO clip, per-sequence token mean (1/G sum_i 1/|o_i| sum_t), k3 KL to the reference with
        beta 0.04."""
        return cls(
            **{
                "advantage_estimator": "grpo",
                "policy_loss": "vanilla",
                "loss_agg_mode": "seq-mean-token-mean",
                "kl_coef": 0.04,
                "kl_estimator": "k3",
                "group_size": 8,
                **overrides,
            }
        )

    @classmethod
    def rloo(cls, **overrides: Any) -> RLAlgorithm:
        """RLOO (Ahmadian et al. 2024): leave-one-out baseline within the group, REINFORCE on the
        sequence log-probability (token sum per sequence). The paper puts the KL penalty in the
        reward; here KL is a loss term, off by default."""
        return cls(
            **{
                "advantage_estimator": "rloo",
                "policy_loss": "vanilla",
                "loss_agg_mode": "seq-mean-token-sum",
                "group_size": 8,
                **overrides,
            }
        )

    @classmethod
    def reinforce_plus_plus(cls, **overrides: Any) -> RLAlgorithm:
        """REINFORCE++ (Hu 2025): discounted returns whitened over the whole batch (no critic,
        no group baseline, so group_size 1 works), PPO clip, token mean. KL loss off by
        default (the paper puts it in the reward)."""
        return cls(
            **{
                "advantage_estimator": "reinforce_plus_plus",
                "policy_loss": "vanilla",
                "loss_agg_mode": "token-mean",
                "group_size": 1,
                **overrides,
            }
        )

    @classmethod
    def ppo(cls, **overrides: Any) -> RLAlgorithm:
        """PPO (Schulman et al. 2017, eq. 7) with a value head and GAE (Schulman et al. 2016,
        lambda 0.95), clipped value loss with coefficient 0.5, several epochs per batch so that
        clipping matters."""
        return cls(
            **{
                "advantage_estimator": "gae",
                "policy_loss": "vanilla",
                "loss_agg_mode": "token-mean",
                "use_value_head": True,
                "value_coef": 0.5,
                "lam": 0.95,
                "group_size": 1,
                "ppo_epochs": 4,
                **overrides,
            }
        )

    @classmethod
    def gspo(cls, **overrides: Any) -> RLAlgorithm:
        """GSPO (Zheng et al. 2025): sequence-level importance ratio (geometric mean of token
        ratios) with the paper's clip range 3e-4 / 4e-4, group advantages, sequence mean."""
        return cls(
            **{
                "advantage_estimator": "grpo",
                "policy_loss": "gspo",
                "loss_agg_mode": "seq-mean-token-mean",
                "clip_ratio_low": 3e-4,
                "clip_ratio_high": 4e-4,
                "group_size": 8,
                **overrides,
            }
        )

    @classmethod
    def cispo(cls, **overrides: Any) -> RLAlgorithm:
        """CISPO (MiniMax-M1, 2025): clipped, stop-gradient importance weight times A log pi, so
        no token's gradient is dropped. The paper sets no lower bound (clip_ratio_low=1) and
        tunes only the upper one; 0.28 here is a starting point, not the paper's value."""
        return cls(
            **{
                "advantage_estimator": "grpo",
                "policy_loss": "cispo",
                "loss_agg_mode": "token-mean",
                "clip_ratio_low": 1.0,
                "clip_ratio_high": 0.28,
                "group_size": 8,
                **overrides,
            }
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> RLAlgorithm:
        """The preset called `name` (one of `RLAlgorithm.PRESETS`), with overrides.

        Raises:
            ValueError: for an unknown preset name (listing the valid ones).
        """
        if name not in cls.PRESETS:
            raise ValueError(f"unknown RL preset {name!r}; valid: {', '.join(cls.PRESETS)}")
        return getattr(cls, name)(**overrides)


def verl_actor_config(algo: RLAlgorithm, **global_batch_info: Any) -> ActorConfig:
    """A verl `ActorConfig` carrying `algo`'s clip settings, for verl's policy-loss functions.

    Built fresh on each call (~30 us): verl reads the step normaliser from the config's mutable
    `global_batch_info` dict, so a shared config would be shared state. `strategy`, `rollout_n`
    and the micro-batch size are required by its constructor but unused by the losses.
    """
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=algo.group_size,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=algo.clip_ratio_high,
        clip_ratio_low=algo.clip_ratio_low,
        clip_ratio_high=algo.clip_ratio_high,
        clip_ratio_c=algo.clip_ratio_c,
        loss_agg_mode=algo.loss_agg_mode,
        loss_scale_factor=algo.loss_scale_factor,
        policy_loss=PolicyLossConfig(loss_mode=algo.policy_loss, **algo.policy_loss_options),
    )
    config.global_batch_info.update(global_batch_info)
    return config


def _one_of(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


def _number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}; must be a number")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r}; must be a finite number")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name}={value!r}; must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value!r}; must be <= {high}")
