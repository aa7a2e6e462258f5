"""Sampling math and teacher-forced scoring: `sampling_logprobs`, `token_logprobs`, `Completion`.

`sampling_logprobs` turns logits into the log-probabilities of the distribution the sampler
actually draws from (temperature, then top-k, then top-p, renormalised). The sampler
(`Policy.generate`, through `posttrain.policy.generation`) and the scorer (`token_logprobs`,
`Policy.logprobs`) both call it, so for unchanged weights the log-probabilities recomputed at
training time equal the ones recorded at sampling time up to float32 rounding.

Shape legend: B = sequences in a batch, T = tokens per sequence (prompt + response),
V = vocabulary, `x` = any leading dims.

Example:
    >>> import torch
    >>> round(sampling_logprobs(torch.tensor([2.0, 0.0]), temperature=0.5)[0].item(), 6)
    -0.01815
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from posttrain.core.masked import keep_selected
from posttrain.policy.shared_prefix import SharedPrefixPack

FinishReason = Literal["eos", "stop", "length"]


@dataclass(frozen=True)
class Completion:
    """One sampled completion of one prompt.

    Attributes:
        prompt_index: index of the prompt in the list given to `Policy.generate`.
        sample_index: 0..n-1 among the `n` samples of that prompt.
        prompt_ids: the prompt's token ids as fed to the model (a str prompt is encoded with BOS).
        token_ids: the generated token ids. A stop token (any id in `tokenizer.stop_ids`) that
            ended the sequence is included, and so are the tokens that completed a stop string:
            they were sampled, so a trainer scores them.
        text: `tokenizer.decode(token_ids)` (special tokens skipped), cut just before the first
            stop string when the sequence ended on one.
        logprobs: one float per entry of `token_ids`: its log-probability under the distribution
            sampled from (`sampling_logprobs`); float32 values stored as Python floats.
        finish_reason: "eos" (a stop token was generated), "stop" (a stop string appeared in the
            text) or "length" (`max_new_tokens` reached, or the model's `max_seq_len`).
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason


def sampling_logprobs(
    logits_xV: Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0
) -> Tensor:
    """Log-probabilities of the distribution a sampler with these settings draws from.

    The logits are divided by `temperature`, then all but the `top_k` largest are removed (ties
    with the k-th value are kept), then all but the nucleus: the smallest set of most probable
    tokens whose probability adds up to at least `top_p` (Holtzman et al. 2020, "The Curious Case
    of Neural Text Degeneration", section 3.1), with float rounding handled as transformers'
    `TopPLogitsWarper` handles it (`nucleus_removed`). What is left is renormalised with a
    log-softmax; removed tokens get -inf.

    `temperature == 0` means greedy decoding. The argmax then has probability 1 in the sampling
    distribution, which carries no information; instead this returns the model's own untempered
    distribution `log_softmax(logits)` (top-k and top-p are ignored: they never change the argmax).

    This is the only place posttrain turns logits into sampling log-probabilities: the sampler
    (`Policy.generate`) and the scorer (`token_logprobs`) both call it. It is differentiable in
    the logits (the top-k/top-p masks are piecewise constant).

    Worked example: logits [2, 0], T = 0.5 -> [4, 0] -> log p(token 0) = -log(1 + e^-4) = -0.018150
    (the untempered value would be -log(1 + e^-2) = -0.126928).

    Args:
        logits_xV: logits with the vocabulary last, any leading shape; any float dtype.
        temperature: >= 0.
        top_k: keep the k most likely tokens; None keeps all.
        top_p: nucleus mass in (0, 1]; 1 keeps all.

    Returns:
        float32 tensor shaped like `logits_xV` (float64 logits are rounded to float32 first).

    Raises:
        ValueError: for a temperature that is not a finite number >= 0, a top_k that is not None
            or an integer >= 1, or a top_p outside (0, 1].
    """
    _check_sampling_args(temperature, top_k, top_p)
    logits = logits_xV.float()
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_x1 = torch.topk(logits.detach(), top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_x1, -math.inf)
    if top_p < 1.0:
        logits = logits.masked_fill(nucleus_removed(logits.detach(), top_p), -math.inf)
    return torch.log_softmax(logits, dim=-1)


def nucleus_removed(logits_xV: Tensor, top_p: float) -> Tensor:
    """Which tokens top-p (nucleus) sampling removes: a bool tensor shaped like `logits_xV`.

    Kept: the smallest prefix of the tokens sorted by probability (most likely first; ties in
    index order, lower index first) whose probability mass reaches `top_p` (Holtzman et al. 2020,
    section 3.1). The mass of a prefix is measured as transformers' `TopPLogitsWarper` measures
    it (transformers 5.10): token j is removed when the mass of j and every less likely token,
    summed from the least likely up, is <= 1 - top_p. In exact arithmetic that is "the mass
    before j already reaches top_p"; in float32 it makes a prefix whose summed mass is a hair
    under top_p because of rounding count as reaching it (probabilities [0.3, 0.1, 0.1, 0.5]
    with top_p = 0.8 keep {0.5, 0.3}; the mass before the third token taken as its running sum
    from the most likely down minus its own probability is 0.79999995 in float32, < 0.8, and
    would keep it too). The most likely token is always kept; tokens whose logit is -inf are
    always removed when top_p < 1.

    Used by `sampling_logprobs`, so the sampler and the training-time scorer apply one rule.

    Args:
        logits_xV: float logits (already tempered and top-k filtered), vocabulary last.
        top_p: nucleus mass in (0, 1]; 1 removes nothing.

    Returns:
        bool tensor, True on removed tokens.

    Raises:
        ValueError: if top_p is not a number in (0, 1].

    Example:
        >>> import torch
        >>> nucleus_removed(torch.tensor([0.3, 0.1, 0.1, 0.5]).log(), 0.8).tolist()
        [False, True, True, False]
    """
    _check_sampling_args(1.0, None, top_p)
    if top_p == 1:
        return torch.zeros(logits_xV.shape, dtype=torch.bool, device=logits_xV.device)
    sorted_logits, order = torch.sort(logits_xV, dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_from_here = sorted_probs.flip(-1).cumsum(dim=-1).flip(-1)  # summed least likely first
    remove_sorted = mass_from_here <= 1 - top_p
    remove_sorted[..., 0] = False
    return torch.empty_like(remove_sorted).scatter_(-1, order, remove_sorted)


def token_logprobs(
    model: nn.Module,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    share_prefix: bool = False,
) -> Tensor:
    """Teacher-forced log-probability of every response token, keeping the autograd graph.

    `logprobs_BT[b, t] = log p(input_ids_BT[b, t] | input_ids_BT[b, :t])` under
    `sampling_logprobs(..., temperature, top_k, top_p)` where `response_mask_BT[b, t]` is true,
    and 0 elsewhere (position 0 has no context, so it must not be a response token).

    Padding is by position, never by token value: `attention_mask_BT` marks the real tokens.
    Right padding (each row a run of real tokens then padding) takes the fast plain-causal path;
    any other layout (left padding) builds the causal mask and position ids with torchtune's
    `get_causal_mask_from_padding_mask` / `get_position_ids_from_padding_mask`.

    The model's train/eval mode is left as it is (this is the training-time call); wrap in
    `torch.no_grad()` for reference log-probs. A token outside the top-k / top-p set under the
    current weights gets -inf (and a NaN gradient): score with the settings it was sampled with.
    Positions outside `response_mask_BT` contribute nothing, whatever the model outputs there
    (their logits are replaced by 0 before the log-softmax, so a NaN there gives no NaN
    gradient).

    Args:
        model: a torchtune `TransformerDecoder` without KV caches.
        input_ids_BT: int64 token ids, prompt + response per row.
        attention_mask_BT: bool/int, 1 on real tokens.
        response_mask_BT: bool/int, 1 on the response tokens to score (a subset of the real ones).
        temperature, top_k, top_p: the sampling settings (see `sampling_logprobs`).
        share_prefix: score rows that share a prompt in one packed sequence per prompt
            (`posttrain.policy.shared_prefix`; right-padded rows only; same values up to float
            rounding, fewer tokens when a prompt has several responses, as in a GRPO group).

    Returns:
        float32 `[B, T]`, differentiable with respect to the model's parameters.

    Raises:
        ValueError: on shape mismatch or a response token at position 0.
    """
    valid_BT, response_BT = check_scoring_inputs(
        model, input_ids_BT, attention_mask_BT, response_mask_BT
    )
    logits_BTV, _ = model_logits(
        model, input_ids_BT, valid_BT, response_BT, share_prefix=share_prefix
    )
    return picked_logprobs(
        logits_BTV, input_ids_BT, response_BT, temperature=temperature, top_k=top_k, top_p=top_p
    )[0]


def check_scoring_inputs(
    model: nn.Module, input_ids_BT: Tensor, attention_mask_BT: Tensor, response_mask_BT: Tensor
) -> tuple[Tensor, Tensor]:
    """(valid_BT, response_BT) as bool `[B, T]` (the response restricted to real tokens), after
    the checks of `token_logprobs`.

    Raises:
        ValueError: on shape mismatch, a response token at position 0, or a model with KV caches.
    """
    if input_ids_BT.ndim != 2:
        raise ValueError(f"input_ids_BT must be 2-D [B, T]; got shape {tuple(input_ids_BT.shape)}")
    for name, t in (
        ("attention_mask_BT", attention_mask_BT),
        ("response_mask_BT", response_mask_BT),
    ):
        if t.shape != input_ids_BT.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; must equal input_ids_BT's "
                f"{tuple(input_ids_BT.shape)}"
            )
    valid_BT = attention_mask_BT.bool()
    response_BT = response_mask_BT.bool() & valid_BT
    if response_BT[:, 0].any():
        raise ValueError(
            "response_mask_BT[:, 0] must be 0: the first token has no context to be predicted from"
        )
    if getattr(model, "caches_are_enabled", lambda: False)():
        raise ValueError(
            "the model has KV caches enabled; score with a model without caches "
            "(torchtune.modules.common_utils.delete_kv_caches)"
        )
    return valid_BT, response_BT


def model_logits(
    model: nn.Module,
    input_ids_BT: Tensor,
    valid_BT: Tensor,
    response_BT: Tensor,
    *,
    share_prefix: bool = False,
) -> tuple[Tensor, SharedPrefixPack | None]:
    """The model's logits `[B, T, V]` on each row (position t: the logits after token t), and
    the `SharedPrefixPack` they were computed through (None: one forward over the rows).

    `valid_BT` and `response_BT` are bool `[B, T]` (real tokens; tokens to score). Right-padded
    rows take the plain causal path; any other layout gets torchtune's causal mask and position
    ids from the padding mask. With `share_prefix`, right-padded rows that share the prefix
    before their first response token are scored once per prefix when that pays
    (`SharedPrefixPack.build`); the logits equal the unshared ones up to float rounding.
    """
    lengths_B = valid_BT.sum(dim=-1)
    right_padded = bool(
        (
            valid_BT
            == (torch.arange(valid_BT.shape[1], device=valid_BT.device) < lengths_B[:, None])
        ).all()
    )
    embed_dim = getattr(getattr(model, "tok_embeddings", None), "embedding_dim", 1024)
    pack = (
        SharedPrefixPack.build(
            input_ids_BT,
            valid_BT,
            response_BT,
            embed_dim=embed_dim,
            max_seq_len=getattr(model, "max_seq_len", None),
        )
        if share_prefix and right_padded
        else None
    )
    if pack is not None:
        return pack.unpack(_as_tensor(pack.forward(model))), pack
    if right_padded:
        return _as_tensor(model(input_ids_BT)), None
    from torchtune.generation import (
        get_causal_mask_from_padding_mask,
        get_position_ids_from_padding_mask,
    )

    return _as_tensor(
        model(
            input_ids_BT,
            mask=get_causal_mask_from_padding_mask(valid_BT),
            input_pos=get_position_ids_from_padding_mask(valid_BT),
        )
    ), None


def picked_logprobs(
    logits_BTV: Tensor,
    input_ids_BT: Tensor,
    response_BT: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(logprobs_BT, logprobs_BTV) from row logits `[B, T, V]` (`model_logits`): float32
    `[B, T]` log-probabilities of each response token (0 elsewhere) and the sampling
    distribution `[B, T - 1, V]` after each position (all 0 where the next token is not scored:
    those logits, NaN or not, are replaced by 0 before the log-softmax, so they add no NaN
    gradient)."""
    logits_BTV = keep_selected(logits_BTV[:, :-1], response_BT[:, 1:, None])
    logprobs_BTV = sampling_logprobs(logits_BTV, temperature=temperature, top_k=top_k, top_p=top_p)
    picked_BT = logprobs_BTV.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    picked_BT = torch.nn.functional.pad(picked_BT, (1, 0))
    return torch.where(response_BT, picked_BT, torch.zeros_like(picked_BT)), logprobs_BTV


def _as_tensor(output: Tensor | list[Tensor]) -> Tensor:
    """Model output as one `[B, T, V]` tensor (torchtune returns chunks when
    `set_num_output_chunks` was called)."""
    return torch.cat(output, dim=1) if isinstance(output, list) else output


def _check_sampling_args(temperature: float, top_k: int | None, top_p: float) -> None:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not temperature >= 0
        or math.isinf(temperature)
    ):
        raise ValueError(f"temperature={temperature!r}; must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k={top_k!r}; must be None (no top-k) or an integer >= 1")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}; must be in (0, 1] (1 = no nucleus filtering)")
