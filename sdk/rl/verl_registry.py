"""The names an `RLAlgorithm` accepts, read from verl's registries (`verl.trainer.ppo.core_algos`,
verl 0.9.1): advantage estimators and policy losses (and registering new ones, refusing
duplicates), aggregation modes, KL estimators and rollout corrections, and the small verl calls
and configs that take these names.

verl (and ray, which verl's package imports: ~20 s of wall time on a loaded 2-core machine) is
imported on first use, through `core_algos()`, not when this module is: importing posttrain.rl,
its trainer or the CLI does not load it. Until then the names are verl 0.9.1's built-in ones
(`BUILTIN_ADVANTAGE_ESTIMATORS`, `BUILTIN_POLICY_LOSSES`, a test checks that they equal verl's
registries); once verl is loaded they are read from its registries, so a name registered with
`register_advantage_estimator` / `register_policy_loss` (which load verl, as do verl's own
decorators) is accepted like a built-in one. `posttrain.rl.config` (`RLAlgorithm`) validates a
config against them and exports them too.

    >>> "grpo" in advantage_estimators(), "vanilla" in policy_losses()
    (True, True)
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from verl.trainer.config import AlgoConfig

__all__ = [
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "FIXED_AGG_MODE",
    "BUILTIN_ADVANTAGE_ESTIMATORS",
    "BUILTIN_POLICY_LOSSES",
    "core_algos",
    "advantage_estimators",
    "policy_losses",
    "is_group_estimator",
    "register_advantage_estimator",
    "register_policy_loss",
    "verl_algo_config",
]

_CORE_ALGOS = "verl.trainer.ppo.core_algos"

BUILTIN_ADVANTAGE_ESTIMATORS = (
    "gae",
    "gdpo",
    "gpg",
    "grpo",
    "grpo_passk",
    "grpo_vectorized",
    "opo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "rloo_vectorized",
)
"""`advantage_estimators()` before verl is loaded: verl 0.9.1's registered estimators that
posttrain can call (sorted)."""

BUILTIN_POLICY_LOSSES = (
    "bypass_mode",
    "cispo",
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "geo_mean",
    "gpg",
    "gspo",
    "kl_cov",
    "sapo",
    "vanilla",
)
"""`policy_losses()` before verl is loaded: verl 0.9.1's registered policy losses (sorted)."""


@functools.cache
def core_algos() -> ModuleType:
    """verl's `verl.trainer.ppo.core_algos`, imported on the first call (with verl's package and
    ray: ~20 s of wall time on a loaded 2-core machine, 4-8 s on a quiet one)."""
    import verl.trainer.ppo.core_algos as module

    return module


LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""Aggregation modes of verl's `agg_loss` (verl 0.9.1 lists them only inside ActorConfig)."""

KL_ESTIMATORS = (
    "k1",
    "k2",
    "k3",
    "kl",
    "mse",
    "low_var_kl",
    "abs",
    "k1+",
    "k3+",
    "kl+",
    "low_var_kl+",
    "abs+",
)
"""Names verl's `kl_penalty` accepts (verl has no registry for them). k1 = kl, k2 = mse,
k3 = low_var_kl; a `+` suffix keeps the forward value and takes the gradient of k2."""

ROLLOUT_CORRECTIONS = ("none", "token_tis", "sequence_tis")
"""Truncated importance-sampling corrections of a sampler that is not the trained policy (verl
0.9.1 `rollout_corr_helper.compute_rollout_correction_weights`; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"): "token_tis" is verl's
rollout_is="token", "sequence_tis" its rollout_is="sequence"."""

_VERL_ROLLOUT_IS = {"token_tis": "token", "sequence_tis": "sequence"}  # "none": no correction

# Inputs posttrain can give an advantage estimator; an estimator needing anything else (remax's
# reward_baselines, optimal_token_baseline's sum_pi_squared) is not offered.
_ADV_INPUTS = frozenset(
    {
        "token_level_rewards",
        "response_mask",
        "index",
        "values",
        "gamma",
        "lam",
        "config",
        "epsilon",
        "norm_adv_by_std_in_grpo",
    }
)

# Losses that ignore `loss_agg_mode`: the mode they use instead (verl 0.9.1 source).
FIXED_AGG_MODE = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def _required_params(fn: Callable) -> set[str]:
    return {
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def advantage_estimators() -> tuple[str, ...]:
    """Names of verl's registered advantage estimators that posttrain can call (sorted);
    `BUILTIN_ADVANTAGE_ESTIMATORS` while verl is not loaded yet (nothing else can be registered
    before it is)."""
    if _CORE_ALGOS not in sys.modules:
        return BUILTIN_ADVANTAGE_ESTIMATORS
    return tuple(
        sorted(
            name
            for name, fn in core_algos().ADV_ESTIMATOR_REGISTRY.items()
            if _required_params(fn) <= _ADV_INPUTS
        )
    )


def policy_losses() -> tuple[str, ...]:
    """Names of verl's registered policy losses (sorted); `BUILTIN_POLICY_LOSSES` while verl is
    not loaded yet."""
    if _CORE_ALGOS not in sys.modules:
        return BUILTIN_POLICY_LOSSES
    return tuple(sorted(core_algos().POLICY_LOSS_REGISTRY))


def is_group_estimator(name: str) -> bool:
    """Whether the estimator computes advantages relative to a group (it takes verl's `index`).

    Raises:
        ValueError: if `name` is not a usable estimator.
    """
    return "index" in inspect.signature(_estimator_fn(name)).parameters


def _estimator_fn(name: str) -> Callable:
    if name not in advantage_estimators():
        raise ValueError(
            f"unknown advantage_estimator {name!r}; valid: {', '.join(advantage_estimators())}"
        )
    return core_algos().get_adv_estimator_fn(name)


def register_advantage_estimator(name: str) -> Callable[[Callable], Callable]:
    """Register an advantage estimator in verl's registry under `name`, refusing duplicates.

    The function takes verl's arguments (`token_level_rewards`, `response_mask` and any of
    `index`, `values`, `gamma`, `lam`, `norm_adv_by_std_in_grpo`, `config`) and returns
    `(advantages_BT, returns_BT)`. Taking `index` makes it a group estimator.

    Raises:
        ValueError: if `name` is already registered.
    """
    if name in core_algos().ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"advantage estimator {name!r} is already registered; choose another name")
    return core_algos().register_adv_est(name)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Register a policy loss in verl's registry under `name`, refusing duplicates (verl's own
    decorator silently replaces an existing entry).

    The function has verl's `PolicyLossFn` signature: (old_log_prob, log_prob, advantages,
    response_mask, loss_agg_mode, config: ActorConfig, rollout_is_weights) -> (loss, metrics),
    and should aggregate with `agg_loss(..., **config.global_batch_info)`.

    Raises:
        ValueError: if `name` is already registered.
    """
    if name in core_algos().POLICY_LOSS_REGISTRY:
        raise ValueError(f"policy loss {name!r} is already registered; choose another name")
    return core_algos().register_policy_loss(name)


def _kl_penalty(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, estimator: str) -> Tensor:
    """verl's `kl_penalty(logprob, ref_logprob, estimator)`: the per-token KL estimate [B, T]."""
    return core_algos().kl_penalty(logprobs_BT, ref_logprobs_BT, estimator)


def verl_algo_config(*, gamma: float, lam: float, norm_adv_by_std_in_grpo: bool) -> AlgoConfig:
    """A verl `AlgoConfig` for the estimators that read `config.gamma` (reinforce_plus_plus) or
    `config.norm_adv_by_std_in_grpo` (grpo_passk)."""
    from verl.trainer.config import AlgoConfig

    return AlgoConfig(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
