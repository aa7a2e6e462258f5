"""The DPO-family recipe's config (`PreferenceRunConfig`; `recipes/dpo.py`) and its loss names
and defaults, apart from the run (`posttrain.workflows.preference`, which imports torch) so that
the recipe's config imports without the training stack: `posttrain run dpo optim.lrr=1`
answers before torch loads. The checks that need the losses themselves (the DPO loss types and
f-divergences, the options a loss refuses) are deferred inside
`posttrain.workflows.stack_checks.defer_stack_checks()`. Every name is importable from
`posttrain.workflows.preference` too.

Example:
    >>> PreferenceRunConfig(loss="ipo", label_smoothing=0.1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Config.label_smoothing=0.1; must be 0: it is used by dpo and simpo only, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from posttrain.workflows.config import (
    BatchOptimConfig,
    CheckpointConfig,
    RLEvalConfig,
    choice,
    fail,
    finite,
    flags,
    ints,
    positive,
    run_fields,
)
from posttrain.workflows.data_config import DataConfig
from posttrain.workflows.pairs_config import PairsRunConfig
from posttrain.workflows.parallel import plan_of
from posttrain.workflows.stack_checks import stack_checks_deferred
from posttrain.workflows.task_checks import check_gym_task, check_seq_len

if TYPE_CHECKING:
    from posttrain.train import TrainingLoss

__all__ = ["PreferenceRunConfig", "LOSSES", "DEFAULT_BETA", "LOSS_OPTIONS"]

LOSSES = ("dpo", "ipo", "simpo", "kto", "orpo")
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "kto": 0.1, "orpo": 0.1}
"""beta when `Config.beta` is None (SimPO's scale is that of per-token averages)."""
LOSS_OPTIONS = {
    "beta": "beta",
    "label_smoothing": "label_smoothing",
    "loss_type": "dpo_loss_type",
    "f_divergence_type": "f_divergence_type",
    "f_alpha_divergence_coef": "f_alpha_divergence_coef",
    "gamma": "simpo_gamma",
    "length_normalize": "ipo_length_normalize",
    "desirable_weight": "kto_desirable_weight",
    "undesirable_weight": "kto_undesirable_weight",
}
"""The options `build_loss` passes to the loss, and the `Config` field each comes from."""


@dataclass(kw_only=True)
class PreferenceRunConfig(PairsRunConfig):
    """SFT -> rejection-sampled pairs -> preference optimisation -> evaluation: the config of
    `recipes/dpo.py`: the loss, over the stages of a `PairsRunConfig` (the starting policy is
    also the reference; the last val_pairs pairs are kept out of training). Every field has a
    default that runs (~10 min on 2 shared CPU cores). Raises ValueError in `__post_init__`
    naming the dotted field and what is allowed."""

    loss: str = "dpo"  # dpo | ipo | simpo | kto | orpo
    beta: float | None = None  # None: DEFAULT_BETA[loss]
    label_smoothing: float = 0.0  # dpo (cDPO) and simpo
    # loss=dpo only: any DPOTrainer loss_type of TRL 1.16 or "dpop", and its f-divergence
    # (posttrain.preference.dpo_family), so a loss ablation is one config key
    dpo_loss_type: str = "sigmoid"
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    simpo_gamma: float = 1.0  # SimPO's target reward margin (>= 0)
    ipo_length_normalize: bool = True  # IPO log-ratios per token, as TRL
    kto_desirable_weight: float = 1.0  # KTO's weights of desirable / undesirable rows (> 0)
    kto_undesirable_weight: float = 1.0
    # eval.samples k > 0: sampled pass@1 / pass@k of the start and the trained policy as well
    eval: RLEvalConfig = field(
        default_factory=lambda: RLEvalConfig(max_new_tokens=16, every=25, samples=0)
    )
    # own pairs instead of sampled ones (then task, pairs, sampling, val_pairs are unused)
    data: DataConfig = field(default_factory=DataConfig)
    val_pairs: int = 64
    optim: BatchOptimConfig = field(
        default_factory=lambda: BatchOptimConfig(steps=150, lr=1e-4, warmup_steps=10, batch_size=32)
    )
    max_seq_len: int = 128
    # seconds (None: none): stop training at the first step boundary where the pairs' sampling,
    # the reference log-probs and the summed step seconds reach it, as an RL run's rl_train_s
    # sums its steps with their rollouts (the equal-compute baseline); one process only
    budget_s: float | None = None
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every=50))
    out_dir: str = "runs/dpo"

    def check(self, at: str) -> None:
        choice(f"{at}.loss", self.loss, LOSSES)
        run_fields(self, at)
        if not self.data.given:
            check_gym_task(self, at)
        elif self.rollout.engine != "builtin":
            raise fail(
                f"{at}.rollout.engine",
                self.rollout.engine,
                "builtin with data.train (a run on own pairs samples nothing)",
            )
        check_seq_len(self, at)
        ints(self, at, ("val_pairs",), minimum=1)
        positive(self, at, ("budget_s",), optional=True)
        if self.budget_s is not None and plan_of(self) is not None:
            raise fail(f"{at}.budget_s", self.budget_s, "None under a parallel plan")
        prompts = min(self.pairs.num_prompts, self.task.train_size)
        if self.val_pairs >= prompts and not self.data.given:
            which = "pairs.num_prompts" if prompts == self.pairs.num_prompts else "task.train_size"
            raise ValueError(
                f"{at}.val_pairs={self.val_pairs} must be below {at}.{which}="
                f"{prompts}: the pairs come from that many training questions, "
                "each giving at most one pair"
            )
        finite(self, at, ("label_smoothing",))
        finite(self, at, ("simpo_gamma",), low=0.0)  # SimPO's target reward margin
        positive(self, at, ("kto_desirable_weight", "kto_undesirable_weight"))
        flags(self, at, ("ipo_length_normalize",))
        self.rollout.refuse(  # the held-out evaluations sample the converted policy
            at, [("quantization.training", self.quantization.training, ("none",))], planned=False
        )
        deferred = stack_checks_deferred()  # the loss's names and options need torch
        if not deferred:
            from posttrain.preference.dpo_family import DPO_LOSS_TYPES, F_DIVERGENCE_TYPES

            choice(f"{at}.dpo_loss_type", self.dpo_loss_type, DPO_LOSS_TYPES)
            choice(f"{at}.f_divergence_type", self.f_divergence_type, F_DIVERGENCE_TYPES)
        for name, default in (
            ("dpo_loss_type", "sigmoid"),
            ("f_divergence_type", "reverse_kl"),
            ("f_alpha_divergence_coef", 0.5),
        ):
            if self.loss != "dpo" and getattr(self, name) != default:
                raise fail(
                    f"{at}.{name}",
                    getattr(self, name),
                    f"{default!r}: it is read by loss='dpo' only, not {self.loss!r}",
                )
        if self.label_smoothing and self.loss not in ("dpo", "simpo"):
            raise fail(
                f"{at}.label_smoothing",
                self.label_smoothing,
                f"0: it is used by dpo and simpo only, and loss={self.loss!r} would ignore it",
            )
        try:
            if not deferred:
                self.build_loss()
        except ValueError as e:  # "beta=0.0; must be ..." -> "Config.beta=0.0; must be ..."
            message = str(e)
            for option, name in LOSS_OPTIONS.items():
                if message.startswith(f"{option}="):
                    message = f"{at}.{name}{message.removeprefix(option)}"
                    break
            else:
                message = f"{at}: {message}"
            raise ValueError(f"{message} (loss={self.loss!r})") from None
        self.check_split(at, unsupported=("pp",))  # the split policy scores the reference

    def check_own_data(self, tokenizer: Any) -> None:
        """Own pairs (`data.train`) read and tokenised as the run reads them (`own_pairs`),
        before it writes anything (`check_task_fits` calls this).

        Raises:
            ValueError: naming `data.train` / `data.eval` (see `own_pairs`)."""
        from posttrain.workflows.own_pairs import own_pairs

        own_pairs(self.data, tokenizer, max_seq_len=self.max_seq_len, kto=self.loss == "kto")

    def build_loss(self) -> TrainingLoss:
        """The `TrainingLoss` these settings describe (`posttrain.train.get_loss`).

        Raises:
            ValueError: for an option the loss refuses (its message names the option)."""
        from posttrain.train import get_loss

        beta = DEFAULT_BETA[self.loss] if self.beta is None else self.beta
        dpo: dict[str, Any] = {
            "loss_type": self.dpo_loss_type,
            "f_divergence_type": self.f_divergence_type,
        }
        if self.f_alpha_divergence_coef != 0.5:  # an error unless the divergence reads it
            dpo["f_alpha_divergence_coef"] = self.f_alpha_divergence_coef
        options: dict[str, Any] = {
            "dpo": {"label_smoothing": self.label_smoothing, **dpo},
            "ipo": {"length_normalize": self.ipo_length_normalize},
            "simpo": {"gamma": self.simpo_gamma, "label_smoothing": self.label_smoothing},
            "kto": {
                "desirable_weight": self.kto_desirable_weight,
                "undesirable_weight": self.kto_undesirable_weight,
            },
            "orpo": {},
        }[self.loss]
        return get_loss(
            self.loss, beta=beta, loss_chunk_tokens=self.optim.loss_chunk_tokens, **options
        )
