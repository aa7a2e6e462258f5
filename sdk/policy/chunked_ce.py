"""Chunked (fused linear) cross-entropy and token log-probabilities: the output projection and
the log-softmax run over chunks of tokens, so no [B, T, V] fp32 logits are ever held.

Why: at Qwen2.5-0.5B (V = 151,936) and 8 x 2048 tokens, the fp32 logits, the log-softmax the
cross-entropy saves and the gradients of both are ~8-28 GiB; the transformer blocks' activations
are a fraction of that. Here the model runs up to its final norm (`final_hidden`: [B, T, D]),
and the head (whatever module the model has as `output`: `nn.Linear`, torchtune's `TiedLinear`,
a LoRA or float8-converted linear) is applied to `chunk_tokens` scored positions at a time
inside `torch.utils.checkpoint`: the forward keeps only the chunk's hidden states, and backward
recomputes one chunk's logits at a time. Peak memory of the loss is O(chunk_tokens x V), not
O(B x T x V); the cost is one more head matmul per chunk in backward (~1/3 more head FLOPs).

Only scored positions are projected (labels != ignore_index; response tokens): prompt and
padding positions cost nothing, and NaN/inf hidden states there cannot reach the loss or the
gradient (the unchunked path replaces their logits by 0 for the same reason).

Under tensor parallelism the head is called per chunk as it is (torchtune's plan: column-parallel
when untied, its logits all-gathered to every tp rank; replicated when tied), so the chunked loss
equals the unchunked one to rounding (tests/parallel_plan_run.py, tests/plans_trainers_run.py).
A float8-converted head is refused (`check_chunkable_head`: its scales would be per chunk); the
float8 blocks under a high-precision head are exact. Sequence parallelism is refused (`_whole`).

Equal to the unchunked path (`posttrain.train.losses.token_cross_entropy_sum`,
`posttrain.policy.sampling.picked_logprobs`) up to float rounding: the per-token values come
from the same functions on the same rows, but sums run in another order and a matmul over a
chunk may round differently from one over all rows (~1e-7 relative in fp32). So it is opt-in
(`loss_chunk_tokens=` on the losses; None keeps the unchunked path).

Shape legend: B = rows, T = tokens per row, D = embed_dim, V = vocabulary, N = scored positions
(flattened over B and T), C = chunk_tokens.

Example:
    >>> import torch
    >>> head = torch.nn.Linear(2, 3, bias=False)
    >>> _ = torch.nn.init.zeros_(head.weight)       # uniform over 3 tokens: CE = log 3 per token
    >>> hidden_BTD = torch.randn(1, 4, 2)
    >>> labels_BT = torch.tensor([[0, -100, 2, 1]])
    >>> loss_sum, n = chunked_cross_entropy_sum(hidden_BTD, head, labels_BT, chunk_tokens=2)
    >>> round(float(loss_sum / n), 6), int(n)
    (1.098612, 3)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from posttrain.models.attention_masks import AttentionMask
from posttrain.policy.sampling import (
    check_scoring_inputs,
    model_logits,
    sampling_logprobs,
    token_logprobs,
)
from posttrain.policy.shared_prefix import SharedPrefixPack

__all__ = [
    "Head",
    "check_chunk_tokens",
    "check_chunkable_head",
    "final_hidden",
    "model_hidden",
    "map_token_chunks",
    "chunked_cross_entropy_sum",
    "chunked_token_logprobs",
    "token_logprobs_chunked",
]

Head = Callable[[Tensor], Tensor]
"""The model's output projection, [..., D] -> [..., V] (any module or callable)."""

_IGNORE_INDEX = -100  # posttrain.data.loader.IGNORE_INDEX (the data layer sits above this one)


def check_chunk_tokens(chunk_tokens: Any, name: str = "loss_chunk_tokens") -> int | None:
    """`chunk_tokens` if it is None (no chunking) or an int >= 1.

    Raises:
        ValueError: naming `name` and the allowed values otherwise.
    """
    if chunk_tokens is None:
        return None
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(
            f"{name}={chunk_tokens!r}; must be None (unchunked logits) or an integer >= 1 "
            "(tokens per chunk of the output projection and log-softmax)"
        )
    return chunk_tokens


def check_chunkable_head(head: Any) -> None:
    """Refuse a head whose output per token depends on the other tokens of its input: a
    float8-converted output projection (torchao's `Float8Linear`, `posttrain.train.float8` with
    "output" taken out of `Float8Config.skip_modules`) scales each call's activations
    (tensorwise) or output gradients (both recipes, along the token dimension of the weight's
    gradient) by their amax, so a chunk's scales differ from the whole batch's. Measured on a
    tiny untied model: tensorwise loss 1.4e-4 relative apart, gradients 8% of their scale;
    rowwise gradients 0.3%. The default keeps the head in high precision: chunks are exact.

    Raises:
        ValueError: naming loss_chunk_tokens and the head's type, with what to do.
    """
    kind = type(head)  # FSDP2 subclasses the module's class: look along the MRO
    if any(k.__module__.startswith("torchao.float8") for k in kind.__mro__):
        raise ValueError(
            f"loss_chunk_tokens with a float8 output projection ({kind.__name__}): its dynamic "
            "scales would be taken per chunk instead of over the whole batch, so the chunked "
            "loss and gradients would differ from the unchunked ones by more than rounding; "
            "keep 'output' in Float8Config.skip_modules (the default) or use "
            "loss_chunk_tokens=None"
        )


@contextmanager
def _head_bypassed(model: nn.Module) -> Iterator[tuple[Head, list[Tensor]]]:
    """While inside, `model.output` records its input (the final norm's output) and returns an
    empty [..., 0] tensor; yields (the real head, the recorded inputs). The registered module is
    untouched (parameters, state dict, FSDP groups): the stand-in shadows it in the instance
    dictionary for the duration of one forward."""
    if not hasattr(model, "output") or not hasattr(model, "norm"):
        raise TypeError(
            f"{type(model).__name__} has no `norm` and `output`; a chunked loss "
            "(loss_chunk_tokens) needs a torchtune TransformerDecoder (built by "
            "posttrain.models.build_model); use loss_chunk_tokens=None for other models"
        )
    head: Head = model.output  # type: ignore[assignment]  # nn.Module or TiedLinear
    check_chunkable_head(head)
    shadowed = "output" in model.__dict__  # TiedLinear is a plain attribute, nn.Module is not
    captured: list[Tensor] = []

    def record(h_xD: Tensor) -> Tensor:
        captured.append(h_xD)
        # an empty view, not a new tensor: the forward's output then requires grad as the
        # logits would, so an FSDP2 root is not resharded after it
        # (`reshard_root_after_frozen_forward`) and the head's weight stays gathered for the loss
        return h_xD[..., :0]

    object.__setattr__(model, "output", record)
    try:
        yield head, captured
    finally:
        if shadowed:
            object.__setattr__(model, "output", head)
        else:
            del model.__dict__["output"]


def final_hidden(
    model: nn.Module,
    input_ids_BT: Tensor,
    valid_BT: Tensor,
    response_BT: Tensor,
    *,
    share_prefix: bool = False,
) -> tuple[Tensor, Head, SharedPrefixPack | None]:
    """The model's final-norm hidden states [B, T, D] (what its head would project), its head,
    and the `SharedPrefixPack` used (None: one forward over the rows).

    The same forward as `posttrain.policy.sampling.model_logits` (right padding, left padding,
    shared prefixes), with the output projection skipped. Works with `set_num_output_chunks`
    (the chunks are concatenated back).

    Raises:
        TypeError: if the model has no `norm` and `output` (not a torchtune decoder).
    """
    with _head_bypassed(model) as (head, captured):
        _, pack = model_logits(
            model, input_ids_BT, valid_BT, response_BT, share_prefix=share_prefix
        )
    if pack is not None:
        return pack.unpack(torch.cat(captured, dim=1)), head, pack
    return _whole(captured, input_ids_BT.shape[1]), head, None


def model_hidden(
    model: nn.Module,
    tokens_BT: Tensor,
    *,
    mask: AttentionMask | None = None,
    input_pos: Tensor | None = None,
) -> tuple[Tensor, Head]:
    """`model(tokens_BT, mask=mask, input_pos=input_pos)` without the output projection: the
    final-norm hidden states [B, T, D] and the head (for the SFT/CPT batches of the trainer).

    Raises:
        TypeError: if the model has no `norm` and `output` (not a torchtune decoder).
    """
    with _head_bypassed(model) as (head, captured):
        model(tokens_BT, mask=mask, input_pos=input_pos)
    return _whole(captured, tokens_BT.shape[1]), head


def _whole(captured: list[Tensor], length: int) -> Tensor:
    """The recorded head input as one [B, T, D] tensor; refuses a forward that fed the head a
    slice of the sequence (Ulysses sequence parallelism gathers the logits, not the states)."""
    hidden = torch.cat(captured, dim=1) if len(captured) > 1 else captured[0]
    if hidden.shape[1] != length:
        raise ValueError(
            f"the model's head saw {hidden.shape[1]} of {length} positions (a sequence-parallel "
            "model slices the sequence); use loss_chunk_tokens=None with sequence parallelism"
        )
    return hidden


def map_token_chunks(
    fn: Callable[..., tuple[Tensor, ...]], *inputs_N: Tensor, chunk_tokens: int
) -> tuple[Tensor, ...]:
    """`fn` applied to chunks of `chunk_tokens` rows of `inputs_N` (all [N, ...]), outputs
    concatenated along dim 0.

    With gradients enabled each call runs inside a non-reentrant `torch.utils.checkpoint`: what
    `fn` builds (a chunk's logits, its log-softmax) is dropped after the forward and rebuilt one
    chunk at a time in backward, so at most one chunk's intermediates are alive. `fn` must return
    a tuple of [n, ...] tensors for an [n, ...] chunk (the RNG state is restored for the rebuild,
    so a dropout inside a LoRA head draws the same mask twice).

    Raises:
        ValueError: if `chunk_tokens` is not an int >= 1 or the inputs differ in length.
    """
    check_chunk_tokens(chunk_tokens, "chunk_tokens")
    n = inputs_N[0].shape[0]
    if any(t.shape[0] != n for t in inputs_N):
        raise ValueError(
            f"inputs of map_token_chunks differ in length: {[t.shape for t in inputs_N]}"
        )
    if n == 0:
        return fn(*inputs_N)
    grad = torch.is_grad_enabled()
    parts = []
    for start in range(0, n, chunk_tokens):
        chunk = [t[start : start + chunk_tokens] for t in inputs_N]
        parts.append(checkpoint(fn, *chunk, use_reentrant=False) if grad else fn(*chunk))
    return tuple(torch.cat(outs, dim=0) for outs in zip(*parts))


def chunked_cross_entropy_sum(
    hidden_BTD: Tensor,
    head: Head,
    labels_BT: Tensor,
    *,
    chunk_tokens: int,
    ignore_index: int = _IGNORE_INDEX,
) -> tuple[Tensor, Tensor]:
    """`token_cross_entropy_sum(head(hidden_BTD).float(), labels_BT)` without its [B, T, V].

    Args:
        hidden_BTD: [B, T, D] final-norm hidden states (`model_hidden`), any float dtype.
        head: the model's output projection (`model.output`).
        labels_BT: [B, T] int64, already shifted; `ignore_index` where nothing is trained.
        chunk_tokens: trained positions per chunk (C); peak memory of the loss ~ C x V x 16 B.
        ignore_index: label of untrained positions.

    Returns:
        (loss_sum, num_tokens): fp32 scalar sum of `-log softmax(head(h_t))[labels_t]` over
        trained positions (0.0 with a zero gradient when none is), int64 scalar count.

    Raises:
        ValueError: if the shapes disagree or `chunk_tokens` is not an int >= 1.
    """
    if hidden_BTD.dim() != 3 or labels_BT.shape != hidden_BTD.shape[:2]:
        raise ValueError(
            f"hidden must be [B, T, D] and labels [B, T]; got hidden "
            f"{tuple(hidden_BTD.shape)} and labels {tuple(labels_BT.shape)}"
        )
    trained_BT = labels_BT != ignore_index

    def ce(h_CD: Tensor, y_C: Tensor) -> tuple[Tensor]:
        return (F.cross_entropy(head(h_CD).float(), y_C, reduction="none"),)

    (losses_N,) = map_token_chunks(
        ce, hidden_BTD[trained_BT], labels_BT[trained_BT], chunk_tokens=chunk_tokens
    )
    return losses_N.sum(), trained_BT.sum()


def chunked_token_logprobs(
    hidden_BTD: Tensor,
    head: Head,
    input_ids_BT: Tensor,
    response_BT: Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`picked_logprobs(head(hidden_BTD), ...)` (and the sampling distribution's entropy) without
    its [B, T, V].

    Position t of the results belongs to token t, read from the hidden state at t - 1, under
    `sampling_logprobs(head(h).float(), temperature, top_k, top_p)`; positions off `response_BT`
    hold 0.

    Args:
        hidden_BTD: [B, T, D] final-norm hidden states (`final_hidden`).
        head: the model's output projection.
        input_ids_BT: [B, T] int64 token ids (the tokens to score).
        response_BT: [B, T] bool, the positions to score (never position 0).
        chunk_tokens: scored positions per chunk.
        temperature, top_k, top_p: the sampler's settings (`sampling_logprobs`).
        entropy: also return the entropy [B, T] of the sampling distribution (nats; 0 off the
            response), differentiable like the log-probs.

    Returns:
        (logprobs_BT, entropy_BT or None), float32.

    Raises:
        ValueError: for bad sampling settings or `chunk_tokens`.
    """
    scored_BT = response_BT[:, 1:].bool()

    def score(h_CD: Tensor, ids_C: Tensor) -> tuple[Tensor, ...]:
        logp_CV = sampling_logprobs(
            head(h_CD).float(), temperature=temperature, top_k=top_k, top_p=top_p
        )
        picked_C = logp_CV.gather(-1, ids_C[:, None]).squeeze(-1)
        if not entropy:
            return (picked_C,)
        return picked_C, -(logp_CV.exp() * logp_CV.nan_to_num(neginf=0.0)).sum(-1)

    outs = map_token_chunks(
        score,
        hidden_BTD[:, :-1][scored_BT],
        input_ids_BT[:, 1:][scored_BT],
        chunk_tokens=chunk_tokens,
    )
    B, T = input_ids_BT.shape
    results = []
    for values_N in outs:
        full_BT = values_N.new_zeros(B, T - 1).index_put((scored_BT,), values_N)
        results.append(F.pad(full_BT, (1, 0)))
    return results[0], (results[1] if entropy else None)


def token_logprobs_chunked(
    model: nn.Module,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    chunk_tokens: int | None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    share_prefix: bool = False,
) -> Tensor:
    """`posttrain.policy.sampling.token_logprobs` with the head and log-softmax over
    `chunk_tokens` response tokens at a time (None: `token_logprobs` itself, bitwise).

    Same arguments, checks and float32 `[B, T]` result (0 off the response), equal up to float
    rounding; differentiable with respect to the model's parameters.

    Raises:
        ValueError: as `token_logprobs`, or for a `chunk_tokens` that is not None or an int >= 1.
        TypeError: if the model is not a torchtune decoder (chunked only).
    """
    chunk = check_chunk_tokens(chunk_tokens, "chunk_tokens")
    if chunk is None:
        return token_logprobs(
            model,
            input_ids_BT,
            attention_mask_BT,
            response_mask_BT,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            share_prefix=share_prefix,
        )
    valid_BT, response_BT = check_scoring_inputs(
        model, input_ids_BT, attention_mask_BT, response_mask_BT
    )
    hidden_BTD, head, _ = final_hidden(
        model, input_ids_BT, valid_BT, response_BT, share_prefix=share_prefix
    )
    return chunked_token_logprobs(
        hidden_BTD,
        head,
        input_ids_BT,
        response_BT,
        chunk_tokens=chunk,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )[0]
