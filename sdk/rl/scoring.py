"""Teacher-forced scoring of RL rows: the log-probabilities of the sampled tokens under the
sampling distribution, the value head's values and the distribution's entropy.

Notation: B = rows, T = padded tokens per row (prompt + completion), V = vocabulary, D = the
model's embedding width. Position t of a [B, T] result belongs to token t (read from the logits
at t - 1); positions off the response hold 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from posttrain.core.masked import keep_selected
from posttrain.policy.chunked_ce import chunked_token_logprobs, final_hidden
from posttrain.policy.sampling import model_logits, picked_logprobs

if TYPE_CHECKING:
    from torchtune.modules import TransformerDecoder

__all__ = ["ValueHead", "score_rows"]


class ValueHead(nn.Module):
    """Scalar value per position from the policy's final-norm hidden state (PPO critic).

    Shapes: hidden [B, T, D] -> values [B, T]. Initialised to zero output (weight 0, bias 0), so
    the first GAE baseline is 0.
    """

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(embed_dim, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden_BTD: Tensor) -> Tensor:
        return self.proj(hidden_BTD).squeeze(-1)


def score_rows(
    model: TransformerDecoder,
    m: dict[str, Tensor],
    *,
    value_head: nn.Module | None,
    temperature: float,
    top_p: float,
    share_prefix: bool,
    entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Teacher-forced log-probs [B, T] under the sampling distribution (`temperature`, `top_p`),
    values [B, T] (with a value head, read from `model.norm`'s output) and that distribution's
    entropy [B, T] (if `entropy`; differentiable only with `entropy_grad`), 0 off the response.

    Args:
        model: a torchtune decoder (plain or split by a plan).
        m: rows with input_ids_BT (int64), attention_mask_BT and response_mask_BT (0/1).
        value_head: a `ValueHead` (or any [B, T, D] -> [B, T] module), or None.
        temperature, top_p: the sampler's settings (the same distribution it drew from).
        share_prefix: a group's rows share their prompt's forward
            (`posttrain.policy.shared_prefix`) when that saves work.
        entropy, entropy_grad: compute the entropy, and keep its gradient.
        chunk_tokens: None, or response tokens per chunk of the head and log-softmax
            (`posttrain.policy.chunked_ce`: no [B, T, V] logits; equal up to float rounding).
    """
    if chunk_tokens is not None:
        scored_BT = m["response_mask_BT"].bool() & m["attention_mask_BT"].bool()
        hidden_BTD, head, _ = final_hidden(
            model,
            m["input_ids_BT"],
            m["attention_mask_BT"].bool(),
            scored_BT,
            share_prefix=share_prefix,
        )
        logprobs_BT, entropy_BT = chunked_token_logprobs(
            hidden_BTD,
            head,
            m["input_ids_BT"],
            scored_BT,
            chunk_tokens=chunk_tokens,
            temperature=temperature,
            top_p=top_p,
            entropy=entropy,
        )
        if entropy_BT is not None and not entropy_grad:
            entropy_BT = entropy_BT.detach()
        values_BT = _values(value_head, hidden_BTD, m["response_mask_BT"])
        return logprobs_BT, values_BT, entropy_BT
    captured: dict[str, Tensor] = {}
    hook = (
        None
        if value_head is None
        else model.norm.register_forward_hook(
            lambda mod, inp, out: captured.__setitem__("hidden", out)
        )
    )
    mask_BT = m["response_mask_BT"]
    try:  # a group's rows share their prompt's forward (posttrain.policy.shared_prefix)
        logits_BTV, pack = model_logits(
            model,
            m["input_ids_BT"],
            m["attention_mask_BT"].bool(),
            mask_BT.bool(),
            share_prefix=share_prefix,
        )
    finally:
        if hook is not None:
            hook.remove()
    logprobs_BT, logp_BTV = picked_logprobs(
        logits_BTV,
        m["input_ids_BT"],
        mask_BT.bool() & m["attention_mask_BT"].bool(),
        temperature=temperature,
        top_p=top_p,
    )
    values_BT = entropy_BT = None
    if value_head is not None:
        hidden = captured["hidden"] if pack is None else pack.unpack(captured["hidden"])
        values_BT = _values(value_head, hidden, mask_BT)
    if entropy:  # of the distribution sampled from; masked positions hold logits 0
        logp_BTV = logp_BTV if entropy_grad else logp_BTV.detach()
        ent_BT = -(logp_BTV.exp() * logp_BTV.nan_to_num(neginf=0.0)).sum(-1)
        entropy_BT = torch.nn.functional.pad(ent_BT, (1, 0)) * mask_BT
    return logprobs_BT, values_BT, entropy_BT


def _values(value_head: nn.Module | None, hidden_BTD: Tensor, mask_BT: Tensor) -> Tensor | None:
    """The value head's [B, T] values on the final-norm states, 0 off the response: the state
    before token t is read at t - 1, like its log-prob."""
    if value_head is None:
        return None
    hidden = hidden_BTD.to(next(value_head.parameters()).dtype)[:, :-1]
    hidden = keep_selected(hidden, mask_BT[:, 1:, None])  # padding: any value
    return keep_selected(torch.nn.functional.pad(value_head(hidden), (1, 0)), mask_BT)
