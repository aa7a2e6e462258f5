"""Batched generation with a KV cache: the decoding loop behind `Policy.generate`.

`_generate_tokens` prefills the left-padded prompts (each distinct prompt once: the G samples of a
group share its prefill, whose cache rows are then copied), then samples one token per step for the
rows still running (with `posttrain.policy.sampling.sampling_logprobs`, so the recorded log-probs
are those of the distribution drawn from) and stops each row on a stop id, a stop string or its
length budget; finished rows are dropped from the batch and the cache (under compile only down to
power-of-two row counts, `_rows_to_keep`). `_decoding_attention` swaps torchtune's KV caches for
`_GrowingKVCache` (attend over the filled positions only) and its attention call for `_sdpa_gqa`
(grouped-query heads without copies) for the duration.

Shape legend: B = sequences in a batch, b = the rows still in the batch, P = padded prompt
length, N = most new tokens of a row, L = KV-cache length (P + N), V = vocabulary, S = stop ids
(`stop_ids_S`) or filled cache positions (`mask_b1S`).

Example:
    >>> _first_stop("4. Done!", ["!", "."])
    1
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from posttrain.policy.sampling import FinishReason, _as_tensor, sampling_logprobs

if TYPE_CHECKING:
    from torchtune.modules import TransformerDecoder


@torch.inference_mode()
def _generate_tokens(
    model: nn.Module,
    rows: list[list[int]],
    *,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float,
    top_k: int | None,
    top_p: float,
    stop_ids: list[int],
    stops: list[str],
    decode,
    pad_id: int,
    seed: int,
    compile: bool = False,
) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
    """The decoding loop: prefill the left-padded prompts, then one token per step for the live
    rows (with `compile`, a `torch.compile`d step: `_compiled_step`). Returns per row: token
    ids, their logprobs, finish reason."""
    from torchtune.generation import (
        get_causal_mask_from_padding_mask,
        get_position_ids_from_padding_mask,
    )

    device = next(model.parameters()).device
    B = len(rows)
    lengths = [len(r) for r in rows]
    P = max(lengths)
    # per-row budget: prompt + new tokens <= max_seq_len
    caps_B = torch.tensor([min(max_new_tokens, max_seq_len - n) for n in lengths], device=device)
    N = int(caps_B.max())
    L = P + N

    tokens_BP = torch.full((B, P), pad_id, dtype=torch.long, device=device)
    prompt_valid_BP = torch.zeros(B, P, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        tokens_BP[b, P - len(r) :] = torch.tensor(r, dtype=torch.long)
        prompt_valid_BP[b, P - len(r) :] = True
    valid_BL = torch.nn.functional.pad(prompt_valid_BP, (0, N), value=True)
    positions_BL = get_position_ids_from_padding_mask(valid_BL)

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    stop_ids_S = torch.tensor(stop_ids, dtype=torch.long, device=device)

    out_tokens_BN = torch.zeros(B, N, dtype=torch.long, device=device)
    out_logprobs_BN = torch.zeros(B, N, dtype=torch.float32, device=device)
    n_generated_B = torch.zeros(B, dtype=torch.long, device=device)
    reasons: list[FinishReason | None] = [None] * B
    histories: list[list[int]] = [[] for _ in range(B)]  # generated ids, kept only for stops
    # tokens to decode for the stop check: each token gives at least one byte (special tokens
    # none, hence the margin), so a stop string of k bytes lies within the last k + 8 tokens
    stop_window = max((len(s.encode()) for s in stops), default=0) + 8

    def pick(logits_bV: Tensor) -> tuple[Tensor, Tensor]:
        logprobs_bV = sampling_logprobs(
            logits_bV, temperature=temperature, top_k=top_k, top_p=top_p
        )
        if temperature == 0:
            next_b = logits_bV.argmax(dim=-1)
        else:
            next_b = torch.multinomial(logprobs_bV.exp(), 1, generator=generator).squeeze(-1)
        return next_b, logprobs_bV.gather(-1, next_b[:, None]).squeeze(-1)

    # Batch rows map to original rows through `live`; a row that finished stays in the batch
    # (running_b False, its outputs ignored) until `_rows_to_keep` drops it from the batch and from
    # the KV cache. The compiled step runs a power-of-two batch: dummy rows (copies of row 0,
    # never running) fill it up.
    rows_b = _bucket(B) if compile else B
    live = torch.zeros(rows_b, dtype=torch.long, device=device)
    live[:B] = torch.arange(B, device=device)
    running_b = torch.arange(rows_b, device=device) < B
    # Prefix sharing: identical prompts (a group's G samples) are prefilled once; their cache
    # rows and last logits are then copied to every row that shares them.
    first: dict[tuple[int, ...], int] = {}  # prompt -> its index among the unique prompts
    unique: list[int] = []  # batch row of each unique prompt's first occurrence
    for b, r in enumerate(rows):
        if first.setdefault(tuple(r), len(unique)) == len(unique):
            unique.append(b)
    source_b = torch.tensor([first[tuple(r)] for r in rows], device=device)[live]
    unique_U = torch.tensor(unique, device=device)
    step_model: Callable[..., Any] = _compiled_step(model) if compile else model
    # the compiled step's graphs are specialised to the cache buffers' sizes: under compile the
    # cache length is a power of two too, so calls of other prompt lengths reuse them
    cache_len = _bucket(L) if compile else L
    with _decoding_attention(
        model, batch_size=len(unique), max_len=cache_len, padded=not bool(prompt_valid_BP.all())
    ):
        mask_UPP = get_causal_mask_from_padding_mask(prompt_valid_BP[unique_U])
        logits_UV = _as_tensor(
            model(tokens_BP[unique_U], input_pos=positions_BL[unique_U, :P], mask=mask_UPP)
        )[:, -1]
        if len(unique) < rows_b:
            _select_kv_cache_rows(model, source_b)
        logits_bV = logits_UV[source_b]
        for step in range(N):
            next_b, logprob_b = pick(logits_bV)
            rows_r = live[running_b]
            out_tokens_BN[rows_r, step] = next_b[running_b]
            out_logprobs_BN[rows_r, step] = logprob_b[running_b]
            n_generated_B[rows_r] += 1
            # rows that finish now; the first reason wins: eos, then stop string, then length
            eos_b = torch.isin(next_b, stop_ids_S) & running_b
            stop_b = torch.zeros_like(eos_b)
            if stops:
                # a stop string can only have just appeared at the end: decode a tail window
                new_tokens = next_b.tolist()
                for j in running_b.nonzero().flatten().tolist():
                    history = histories[int(live[j])]
                    history.append(new_tokens[j])
                    if not eos_b[j]:
                        stop_b[j] = _first_stop(decode(history[-stop_window:]), stops) is not None
            length_b = (caps_B[live] <= step + 1) & running_b
            finished_b = eos_b | stop_b | length_b
            if bool(finished_b.any()):
                for j in finished_b.nonzero().flatten().tolist():
                    reasons[int(live[j])] = "eos" if eos_b[j] else "stop" if stop_b[j] else "length"
                running_b = running_b & ~finished_b
                if not bool(running_b.any()):
                    break
                keep_rows = _rows_to_keep(int(running_b.sum()), len(live), buckets=compile)
                if keep_rows < len(live):
                    # the running rows and, to fill a bucket, the first finished ones, in order
                    fill = (~running_b).nonzero().flatten()[: keep_rows - int(running_b.sum())]
                    keep = torch.cat([running_b.nonzero().flatten(), fill]).sort().values
                    _select_kv_cache_rows(model, keep)
                    live, next_b, running_b = live[keep], next_b[keep], running_b[keep]
            # the new token sits at cache position P + step and sees the cache up to itself
            cache_pos = P + step
            mask_b1S = valid_BL[live, None, : cache_pos + 1]
            input_pos_b1 = positions_BL[live, cache_pos : cache_pos + 1]
            logits_bV = _as_tensor(
                step_model(next_b[:, None], mask=mask_b1S, input_pos=input_pos_b1)
            )[:, -1]
    assert all(r is not None for r in reasons), reasons
    tokens = [out_tokens_BN[b, : int(n_generated_B[b])].tolist() for b in range(B)]
    logprobs = [out_logprobs_BN[b, : int(n_generated_B[b])].tolist() for b in range(B)]
    return tokens, logprobs, reasons  # type: ignore[return-value]


def _bucket(n: int) -> int:
    """The smallest power of two >= `n` (n >= 1): the row counts the compiled step runs."""
    return 1 << (n - 1).bit_length()


def _rows_to_keep(running: int, rows: int, *, buckets: bool) -> int:
    """How many rows the decoding batch keeps once some of its `rows` finished and `running`
    still run (`running < rows`).

    Eager (`buckets=False`): all `rows` until the finished ones are a quarter of them, then the
    running ones. Compiled (`buckets=True`): `_bucket(running)` once that is fewer than `rows`,
    so the compiled step, which also starts from `_bucket(B)` rows, meets at most
    log2(B) + 1 row counts and compiles once for each (`_compiled_step`).

    Example: 6 sequences finishing one at a time run in batches of 6, 4, 3, 2, 1 rows eagerly
    and of 8, 4, 2, 1 rows compiled.
    """
    if buckets:
        return min(_bucket(running), rows)
    return running if (rows - running) * 4 >= rows else rows


COMPILE_BACKEND = "inductor"
"""The `torch.compile` backend of the compiled decoding step ("aot_eager": the same graphs
without code generation, fast to build)."""

_COMPILED_STEPS: weakref.WeakKeyDictionary[nn.Module, dict[str, Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def _compiled_step(model: nn.Module) -> Callable[..., Any]:
    """`model` under `torch.compile(dynamic=True)` for the one-token decoding steps, made once per
    model (and backend) and kept while the model lives: later `generate` calls reuse its graphs.

    Dynamic shapes are marked, not padded to buckets: the filled cache length S (one more every
    step) is a symbolic size and the cache's fill level (`_GrowingKVCache.size`, a Python int on
    a module) a symbolic int (`allow_unspec_int_on_nn_module`), so the steps of a call share one
    graph. The live rows b are not: the caches are module buffers, whose sizes dynamo keeps
    static, so each row count and cache length compiles once. The decoding loop therefore runs
    the compiled step on power-of-two row counts only (`_rows_to_keep`: a batch is padded with
    dummy rows, and finished rows are dropped only down to the next power of two) and with a
    power-of-two cache length (prompt + new tokens rounded up; the cache only holds more
    zeros): a generation of B sequences compiles at most log2(B) + 1 times however its rows
    finish, and later calls of the same cache bucket reuse those graphs (dynamo's recompile
    limit, 8 per function, counts all of them; past it the step runs eagerly, with dynamo's
    warning). The prompt's prefill runs eagerly: it
    happens once per call and its shapes vary with the prompts. Weights are read at every call,
    so training in between needs no recompilation.
    """
    steps = _COMPILED_STEPS.setdefault(model, {})
    if COMPILE_BACKEND not in steps:
        steps[COMPILE_BACKEND] = torch.compile(model, dynamic=True, backend=COMPILE_BACKEND)
    compiled = steps[COMPILE_BACKEND]

    def step(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return compiled(*args, **kwargs)

    return step


class _GrowingKVCache(nn.Module):
    """Key/value cache of one attention layer that returns only the filled positions.

    Stands in for torchtune's `KVCache` inside `MultiHeadAttention` (same `update`, `reset`,
    `k_cache`, `v_cache`); torchtune's returns the whole preallocated `[B, H_kv, L, D]` buffer at
    every step, so each step attends over all L positions. The caller passes a mask as wide as
    the filled part.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k_cache: Tensor
        self.v_cache: Tensor
        self.register_buffer(
            "k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.size = 0

    def reset(self) -> None:
        self.size = 0

    def update(self, k_val: Tensor, v_val: Tensor) -> tuple[Tensor, Tensor]:
        end = self.size + k_val.shape[2]
        assert end <= self.k_cache.shape[2], "KV cache overflow"
        self.k_cache[:, :, self.size : end] = k_val
        self.v_cache[:, :, self.size : end] = v_val
        self.size = end
        return self.k_cache[:, :, :end], self.v_cache[:, :, :end]

    def select_rows(self, keep_b: Tensor) -> None:
        self.k_cache = self.k_cache[keep_b]
        self.v_cache = self.v_cache[keep_b]


def _sdpa_gqa(*, padded: bool, gqa: bool):
    """torchtune's `_attention_call` for a boolean `[b, s_q, s_k]` mask, with grouped-query heads
    left to SDPA (`enable_gqa`: query head h reads key/value head h // (H / H_kv), the same
    pairing as torchtune's expand) instead of copied.

    Without padding (`padded=False`) the mask carries nothing SDPA cannot do itself: the prompt
    is plainly causal and a one-token step sees the whole filled cache, so it is dropped.
    `gqa`: the model has fewer key/value heads than query heads.
    """

    def attention_call(
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, is_causal: bool
    ) -> Tensor:
        if not padded:
            mask, is_causal = None, q.shape[2] > 1
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if mask is None else mask[:, None],
            dropout_p=dropout_p,
            is_causal=is_causal,
            enable_gqa=gqa,  # a constant, not a (symbolic) shape comparison: compiles
        )

    return attention_call


@contextlib.contextmanager
def _decoding_attention(
    model: TransformerDecoder, *, batch_size: int, max_len: int, padded: bool
) -> Iterator[None]:
    """Prepare every torchtune `MultiHeadAttention` of `model` for incremental decoding, and put
    it back as it was on exit (like torchtune's `local_kv_cache`, fresh caches every call, so the
    "second setup_caches is silently skipped" and "other batch size raises" traps cannot occur).

    Two changes against torchtune's own caches, both from profiling tiny-10m, batch 32, 32 + 64
    tokens on CPU (where they made generation ~25% slower than transformers'):
      * `_GrowingKVCache`: attend over the filled positions only, not the whole buffer;
      * grouped-query attention without copies: torchtune's forward expands K/V to all query
        heads (`unsqueeze/expand/flatten`, a copy of the whole cache per layer and step) whenever
        `num_kv_heads != num_heads`. For the duration, `num_kv_heads` is set to `num_heads` (the
        key/value projections are still reshaped with `-1`, so they keep their real head count)
        and `_attention_call` is `_sdpa_gqa`. This relies on torchtune 0.6.1's
        `MultiHeadAttention.forward`, pinned by tests/policy/test_policy.py (KV cache == no cache).
    """
    from torchtune.modules import MultiHeadAttention

    if model.caches_are_setup():
        raise ValueError(
            "the model already has KV caches set up; Policy.generate sets up its "
            "own (remove them with torchtune.modules.common_utils.delete_kv_caches)"
        )
    param = next(model.parameters())
    attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    saved = [(a.num_kv_heads, a._attention_call) for a in attns]
    attention_call = _sdpa_gqa(padded=padded, gqa=any(a.num_kv_heads != a.num_heads for a in attns))
    try:
        for attn in attns:
            attn.kv_cache = _GrowingKVCache(
                batch_size, max_len, attn.num_kv_heads, attn.head_dim, param.dtype, param.device
            )
            attn.cache_enabled = True
            attn.num_kv_heads = attn.num_heads
            attn._attention_call = attention_call
        yield
    finally:
        for attn, (num_kv_heads, attention_call) in zip(attns, saved):
            attn.kv_cache = None
            attn.cache_enabled = False
            attn.num_kv_heads = num_kv_heads
            attn._attention_call = attention_call


def _select_kv_cache_rows(model: nn.Module, keep_b: Tensor) -> None:
    """Rows `keep_b` of every KV cache, in that order: drops finished sequences, or repeats a
    shared prompt's rows (prefix sharing; `keep_b` may list a row several times)."""
    for module in model.modules():
        if isinstance(module, _GrowingKVCache):
            module.select_rows(keep_b)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in `text` of the earliest stop string, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _check_stop(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(
                f"stop={stop!r}; must be None, a non-empty str or a list of non-empty str"
            )
    return stops
