"""Bradley-Terry reward model: a policy backbone with a scalar head, its loss, accuracy, save/load.

Notation: B = pairs (or sequences), T = tokens per row, D = hidden size.

`RewardModel` is a torchtune `TransformerDecoder` whose output projection is replaced by the
identity, so its forward returns the final-norm hidden states `[B, T, D]` (the tensor
`posttrain.rl.trainer.ValueHead` reads with a hook on `model.norm`; the RM owns its backbone, so
it skips the `[B, T, V]` logits instead), plus `head = nn.Linear(D, 1)`. The reward of a sequence
is the head at its last real token (prompt + response; padding is by position, never by id).

Training (Bradley & Terry 1952; Ouyang et al. 2022, "Training language models to follow
instructions with human feedback", eq. 1):

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin)

with the optional margin of Touvron et al. 2023 (Llama 2, eq. 2). The training objective,
`posttrain.preference.reward_model.BradleyTerryLoss` (the `TrainingLoss` registered as
"bradley_terry"), lives in the higher preference layer.

Sequences are rendered by `render_pair` (the question as a user turn, the response as the
assistant turn, the tokenizer's chat template), the same for training pairs and for
`posttrain.rewards.judges.RewardModelJudge`.

Example:
    >>> import torch
    >>> rm = RewardModel.from_spec("tiny-1m", seed=0)
    >>> ids_BT = torch.tensor([[257, 50, 51, 262], [257, 50, 262, 0]])
    >>> mask_BT = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    >>> rm(ids_BT, mask_BT).shape
    torch.Size([2])
    >>> round(float(bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]))[0]), 6)
    0.313262
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.data.collate import right_pad
from posttrain.models.specs import ModelSpec, build_model, get_preset
from posttrain.rewards.evaluation import wilson_interval

if TYPE_CHECKING:
    from torchtune.modules import TransformerDecoder

__all__ = [
    "RewardModel",
    "render_pair",
    "bradley_terry_loss",
    "PairwiseAccuracy",
    "accuracy_from_rewards",
    "pairwise_accuracy",
    "load_reward_model",
    "RM_CONFIG_FILE",
    "RM_WEIGHTS_FILE",
]

RM_CONFIG_FILE = "reward_model.json"
RM_WEIGHTS_FILE = "reward_model.safetensors"
_FORMAT = {"kind": "posttrain_reward_model", "version": 1}


def render_pair(tokenizer, question: str, response: str) -> list[int]:
    """Token ids of (question, response) as the reward model reads them, the same ids as
    `posttrain.data.preference.PreferenceDataset` (chat=True) renders a pair: a user turn and an
    assistant turn with the tokenizer's chat template, plus EOS when the last trained token of
    the turn is not a stop token. The reward is read at the last of these tokens.

    Example:
        >>> from posttrain.models import ByteTokenizer
        >>> render_pair(ByteTokenizer(), "1+1", "2")   # <bos><user>1+1<end><assistant>2<end>
        [257, 260, 49, 43, 49, 262, 261, 50, 262]
    """
    from posttrain.data.preference import render_response

    return render_response(tokenizer, question, response, chat=True)[0]


class RewardModel(nn.Module):
    """A transformer backbone with a scalar head: `reward = head(h_last)`.

    Args:
        backbone: a torchtune `TransformerDecoder` for `spec` (taken over: its output projection
            is replaced by `nn.Identity`, so it returns final-norm hidden states).
        spec: the backbone's `ModelSpec`.
        seed: seeds the head's initialisation (global RNG untouched).

    The head is `nn.Linear(D, 1, bias=False)` (a bias cancels in the Bradley-Terry loss),
    initialised N(0, 1 / (D + 1)) as OpenRLHF's reward models (`init_value_head`), so the
    first rewards are small and the first loss is close to log 2.

    Use `from_policy` (a copy of an SFT policy's backbone, the usual start: Ouyang et al. 2022,
    section 3.5) or `from_spec` (fresh weights).

    Example:
        >>> from posttrain.policy import Policy
        >>> policy = Policy.from_spec("tiny-1m", seed=0)
        >>> rm = RewardModel.from_policy(policy)
        >>> ids = [render_pair(policy.tokenizer, "1 + 2 =", a) for a in ("3", "4")]
        >>> [type(r) for r in rm.score(ids)]       # one float reward per sequence
        [<class 'float'>, <class 'float'>]
    """

    def __init__(self, backbone: TransformerDecoder, spec: ModelSpec, *, seed: int = 0) -> None:
        super().__init__()
        backbone.output = nn.Identity()
        backbone.num_output_chunks = 0
        self.backbone = backbone
        self.spec = spec
        param = next(backbone.parameters())
        self.head = nn.Linear(spec.embed_dim, 1, bias=False, device=param.device, dtype=param.dtype)
        generator = torch.Generator(device=param.device).manual_seed(seed)
        with torch.no_grad():
            nn.init.normal_(self.head.weight, std=1.0 / (spec.embed_dim + 1), generator=generator)

    @classmethod
    def from_policy(cls, policy, *, seed: int = 0) -> RewardModel:
        """A reward model on a deep copy of `policy.model` (the policy is left untouched)."""
        return cls(copy.deepcopy(policy.model), policy.spec, seed=seed)

    @classmethod
    def from_spec(
        cls, spec: ModelSpec | str, *, seed: int = 0, device: str | torch.device | None = None
    ) -> RewardModel:
        """A freshly initialised reward model (`spec` may be a preset name)."""
        spec = get_preset(spec) if isinstance(spec, str) else spec
        return cls(build_model(spec, device=device, seed=seed), spec, seed=seed)

    def forward(self, input_ids_BT: Tensor, attention_mask_BT: Tensor | None = None) -> Tensor:
        """Rewards `[B]` (float32, differentiable), read at each row's last real token.

        Args:
            input_ids_BT: int64 token ids.
            attention_mask_BT: bool/int, 1 on real tokens; None = all real. Right padding takes
                the plain causal path; other layouts (left padding) get a padding-aware causal
                mask and position ids, as in `posttrain.policy.sampling.token_logprobs`.

        Raises:
            ValueError: for shape mismatches, an empty batch, a row without a real token, or a
                token id outside [0, spec.vocab_size).
        """
        if input_ids_BT.ndim != 2:
            raise ValueError(f"input_ids_BT must be [B, T]; got {tuple(input_ids_BT.shape)}")
        B, T = input_ids_BT.shape
        if B == 0 or T == 0:
            raise ValueError(
                f"input_ids_BT is empty (shape {(B, T)}); a reward needs at least "
                "one sequence of at least one token"
            )
        V = self.spec.vocab_size
        if bool(((input_ids_BT < 0) | (input_ids_BT >= V)).any()):
            raise ValueError(
                f"input_ids_BT holds token ids in [{int(input_ids_BT.min())}, "
                f"{int(input_ids_BT.max())}]; the model's vocabulary is [0, {V}) "
                "(spec.vocab_size): was it tokenised with another tokenizer?"
            )
        if attention_mask_BT is None:
            valid_BT = torch.ones(B, T, dtype=torch.bool, device=input_ids_BT.device)
        else:
            if attention_mask_BT.shape != input_ids_BT.shape:
                raise ValueError(
                    f"attention_mask_BT has shape {tuple(attention_mask_BT.shape)}; "
                    f"must equal input_ids_BT's {(B, T)}"
                )
            valid_BT = attention_mask_BT.bool()
        lengths_B = valid_BT.sum(-1)
        if bool((lengths_B == 0).any()):
            raise ValueError(
                "a row of attention_mask_BT has no real token; every sequence needs at least one"
            )
        positions_T = torch.arange(T, device=valid_BT.device)
        if bool((valid_BT == (positions_T < lengths_B[:, None])).all()):
            hidden = self.backbone(input_ids_BT)
        else:
            from torchtune.generation import (
                get_causal_mask_from_padding_mask,
                get_position_ids_from_padding_mask,
            )

            hidden = self.backbone(
                input_ids_BT,
                mask=get_causal_mask_from_padding_mask(valid_BT),
                input_pos=get_position_ids_from_padding_mask(valid_BT),
            )
        hidden_BTD = torch.cat(hidden, dim=1) if isinstance(hidden, list) else hidden
        last_B = (positions_T * valid_BT).argmax(-1)  # the last real position of each row
        hidden_BD = hidden_BTD[torch.arange(B, device=hidden_BTD.device), last_B]
        return self.head(hidden_BD.to(self.head.weight.dtype)).squeeze(-1).float()

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], *, batch_size: int = 32) -> list[float]:
        """Reward of each token-id sequence, in eval mode without gradients (right-padded
        batches of `batch_size`; the training mode is restored after).

        Raises:
            ValueError: for an empty sequence or one longer than `spec.max_seq_len`, or a
                `batch_size` that is not an integer >= 1.
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}; must be an integer >= 1")
        for i, ids in enumerate(sequences):
            if not 1 <= len(ids) <= self.spec.max_seq_len:
                raise ValueError(
                    f"sequences[{i}] has {len(ids)} tokens; need 1.."
                    f"{self.spec.max_seq_len} (spec.max_seq_len)"
                )
        device, was_training, out = self.head.weight.device, self.training, []
        self.eval()
        try:
            for start in range(0, len(sequences), batch_size):
                ids_BT, mask_BT = right_pad(sequences[start : start + batch_size], 0)
                out += self(ids_BT.to(device), mask_BT.to(device)).tolist()
        finally:
            self.train(was_training)
        return out

    def save(self, folder: str | os.PathLike, tokenizer) -> Path:
        """Write `reward_model.json` (format, spec), `reward_model.safetensors` (backbone + head)
        and the tokenizer's files into `folder`, atomically (a temporary folder renamed into
        place; an existing reward-model folder is replaced whole).

        Raises:
            FileExistsError: if `folder` is a non-empty folder that is not a reward-model folder.
        """
        from safetensors.torch import save_file

        folder = Path(folder)
        if folder.exists() and any(folder.iterdir()) and not (folder / RM_CONFIG_FILE).is_file():
            raise FileExistsError(
                f"{folder} is a non-empty folder without {RM_CONFIG_FILE}; refusing to replace it"
            )
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
            save_file(state, str(tmp / RM_WEIGHTS_FILE), metadata={"format": "pt"})
            record = {
                **_FORMAT,
                "spec": self.spec.to_dict(),
                "head": "linear_no_bias",
                "dtype": str(self.head.weight.dtype).removeprefix("torch."),
            }
            (tmp / RM_CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
            tokenizer.save(tmp)
            if folder.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
                os.replace(folder, old / folder.name)
                os.replace(tmp, folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder

    def extra_repr(self) -> str:
        return f"family={self.spec.family}, embed_dim={self.spec.embed_dim}"


def load_reward_model(
    folder: str | os.PathLike, *, device: str | torch.device | None = None
) -> tuple[RewardModel, Any]:
    """(RewardModel, tokenizer) from a folder written by `RewardModel.save`.

    Raises:
        FileNotFoundError: if the folder has no `reward_model.json`.
        ValueError: for another format or version, or weights that do not match the spec.
    """
    from safetensors.torch import load_file

    from posttrain.models.tokenizer import load_tokenizer

    folder = Path(folder)
    if not (folder / RM_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder} has no {RM_CONFIG_FILE}; save with RewardModel.save")
    record = json.loads((folder / RM_CONFIG_FILE).read_text())
    found = {k: record.get(k) for k in _FORMAT}
    if found != _FORMAT:
        raise ValueError(f"{folder / RM_CONFIG_FILE} is {found}; this posttrain reads {_FORMAT}")
    spec = ModelSpec.from_dict(record["spec"])
    model = RewardModel.from_spec(spec, device=device)
    try:
        model.load_state_dict(load_file(str(folder / RM_WEIGHTS_FILE)))
    except RuntimeError as exc:
        raise ValueError(f"{folder / RM_WEIGHTS_FILE} does not match its spec: {exc}") from None
    return model, load_tokenizer(folder)


# --------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------


def bradley_terry_loss(
    rewards_chosen_B: Tensor, rewards_rejected_B: Tensor, *, margin: float | Tensor = 0.0
) -> Tensor:
    """Per-pair Bradley-Terry loss `-log sigmoid(r_chosen - r_rejected - margin)`, `[B]`.

    Bradley & Terry 1952; Ouyang et al. 2022, eq. 1 (InstructGPT reward model); the margin is
    Touvron et al. 2023 (Llama 2), eq. 2. Computed with `logsigmoid` (no overflow).

    Hand-checked: r_c = 1, r_r = 0 -> log(1 + e^-1) = 0.313262; equal rewards -> log 2.

    Args:
        rewards_chosen_B, rewards_rejected_B: float rewards of the same B pairs.
        margin: a float, or a `[B]` tensor of per-pair margins (>= 0 asks for a wider gap).

    Raises:
        ValueError: if the shapes differ.
    """
    if rewards_chosen_B.shape != rewards_rejected_B.shape:
        raise ValueError(
            f"chosen rewards {tuple(rewards_chosen_B.shape)} and rejected rewards "
            f"{tuple(rewards_rejected_B.shape)} must have the same shape"
        )
    return -F.logsigmoid(rewards_chosen_B.float() - rewards_rejected_B.float() - margin)


# --------------------------------------------------------------------------------------------
# Held-out pairwise accuracy
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairwiseAccuracy:
    """Fraction of pairs with r_chosen > r_rejected (ties count as wrong), with a 95% Wilson
    interval; `mean_margin` is the mean of r_chosen - r_rejected, `loss` the mean BT loss."""

    accuracy: float
    ci_low: float
    ci_high: float
    num_pairs: int
    num_ties: int
    mean_margin: float
    loss: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def accuracy_from_rewards(
    rewards_chosen: Sequence[float], rewards_rejected: Sequence[float]
) -> PairwiseAccuracy:
    """`PairwiseAccuracy` of already computed rewards of the same pairs.

    Example:
        >>> a = accuracy_from_rewards([1.0, 2.0, 0.0], [0.0, 3.0, 0.0])
        >>> a.accuracy, a.num_ties, round(a.ci_low, 3), round(a.ci_high, 3)
        (0.3333333333333333, 1, 0.061, 0.792)

    Raises:
        ValueError: for no pairs or different lengths.
    """
    if len(rewards_chosen) != len(rewards_rejected) or not rewards_chosen:
        raise ValueError(
            f"need the same non-zero number of chosen and rejected rewards, got "
            f"{len(rewards_chosen)} and {len(rewards_rejected)}"
        )
    rc, rr = torch.tensor(rewards_chosen), torch.tensor(rewards_rejected)
    correct, n = int((rc > rr).sum()), len(rewards_chosen)
    low, high = wilson_interval(correct, n)
    return PairwiseAccuracy(
        accuracy=correct / n,
        ci_low=low,
        ci_high=high,
        num_pairs=n,
        num_ties=int((rc == rr).sum()),
        mean_margin=float((rc - rr).mean()),
        loss=float(bradley_terry_loss(rc, rr).mean()),
    )


def pairwise_accuracy(
    reward_model: RewardModel,
    chosen: Sequence[Sequence[int]],
    rejected: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
) -> PairwiseAccuracy:
    """Held-out pairwise accuracy of `reward_model` on token-id pairs (`chosen[i]` vs
    `rejected[i]`, each rendered prompt + response, e.g. by `render_pair`)."""
    if len(chosen) != len(rejected):
        raise ValueError(f"{len(chosen)} chosen but {len(rejected)} rejected sequences")
    return accuracy_from_rewards(
        reward_model.score(chosen, batch_size=batch_size),
        reward_model.score(rejected, batch_size=batch_size),
    )
