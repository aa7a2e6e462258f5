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


def sampling_logprobs(logits_xV: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float = 1.0) -> Tensor:
    """Log-probabilities of the distribution a sampler with these settings draws from.

    The logits are divided by `temperature`, then all but the `top_k` largest are removed (ties
    with the k-th value are kept), then all but the nucleus: the smallest set of most probable
    tokens whose probability adds up to at least `top_p` (Holtzman et al. 2020, "The Curious Case
    of Neural Text Degeneration", section 3.1). What is left is renormalised with a log-softmax.
    Removed tokens get -inf.

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
        float32 tensor shaped like `logits_xV`.
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
        probs = torch.softmax(logits.detach(), dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove_sorted = mass_before >= top_p  # the first (most likely) token is always kept
        remove = torch.empty_like(remove_sorted).scatter_(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, -math.inf)
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(model: nn.Module, input_ids_BT: Tensor, attention_mask_BT: Tensor,
                   response_mask_BT: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float = 1.0) -> Tensor:
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

    Args:
        model: a torchtune `TransformerDecoder` without KV caches.
        input_ids_BT: int64 token ids, prompt + response per row.
        attention_mask_BT: bool/int, 1 on real tokens.
        response_mask_BT: bool/int, 1 on the response tokens to score (a subset of the real ones).
        temperature, top_k, top_p: the sampling settings (see `sampling_logprobs`).

    Returns:
        float32 `[B, T]`, differentiable with respect to the model's parameters.

    Raises:
        ValueError: on shape mismatch or a response token at position 0.
    """
    if input_ids_BT.ndim != 2:
        raise ValueError(f"input_ids_BT must be 2-D [B, T]; got shape {tuple(input_ids_BT.shape)}")
    for name, t in (("attention_mask_BT", attention_mask_BT),
                    ("response_mask_BT", response_mask_BT)):
        if t.shape != input_ids_BT.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; must equal input_ids_BT's "
                             f"{tuple(input_ids_BT.shape)}")
    valid_BT = attention_mask_BT.bool()
    response_BT = response_mask_BT.bool() & valid_BT
    if response_BT[:, 0].any():
        raise ValueError("response_mask_BT[:, 0] must be 0: the first token has no context to be "
                         "predicted from")
    if getattr(model, "caches_are_enabled", lambda: False)():
        raise ValueError("the model has KV caches enabled; score with a model without caches "
                         "(torchtune.modules.common_utils.delete_kv_caches)")

    lengths_B = valid_BT.sum(dim=-1)
    right_padded = bool((valid_BT == (torch.arange(valid_BT.shape[1], device=valid_BT.device)
                                      < lengths_B[:, None])).all())
    if right_padded:
        logits_BTV = _as_tensor(model(input_ids_BT))
    else:
        from torchtune.generation import (get_causal_mask_from_padding_mask,
                                          get_position_ids_from_padding_mask)
        logits_BTV = _as_tensor(model(input_ids_BT,
                                      mask=get_causal_mask_from_padding_mask(valid_BT),
                                      input_pos=get_position_ids_from_padding_mask(valid_BT)))
    # logits at t-1 predict the token at t
    logprobs_BTV = sampling_logprobs(logits_BTV[:, :-1], temperature=temperature, top_k=top_k,
                                     top_p=top_p)
    picked_BT = logprobs_BTV.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    picked_BT = torch.nn.functional.pad(picked_BT, (1, 0))
    return torch.where(response_BT, picked_BT, torch.zeros_like(picked_BT))


def _as_tensor(output: Tensor | list[Tensor]) -> Tensor:
    """Model output as one `[B, T, V]` tensor (torchtune returns chunks when
    `set_num_output_chunks` was called)."""
    return torch.cat(output, dim=1) if isinstance(output, list) else output


def _check_sampling_args(temperature: float, top_k: int | None, top_p: float) -> None:
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or math.isinf(temperature):
        raise ValueError(f"temperature={temperature!r}; must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k={top_k!r}; must be None (no top-k) or an integer >= 1")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}; must be in (0, 1] (1 = no nucleus filtering)")
