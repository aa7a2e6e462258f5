"""`Policy`: a model and its tokenizer that sample completions and score them.

Sampling (`Policy.generate`) and scoring (`Policy.logprobs`, `token_logprobs`) share one function,
`sampling_logprobs`, that turns logits into the log-probabilities of the distribution the sampler
actually draws from (temperature, then top-k, then top-p, renormalised). So for unchanged weights
the log-probabilities recomputed at training time equal the ones recorded at sampling time and the
PPO/GRPO importance ratio is 1 on-policy, up to float32 rounding: the KV-cache path multiplies one
token at a time and the scorer a whole sequence, and BLAS sums those in different orders (a plain
`nn.Linear` differs by ~1e-5 on outputs of size 30). Measured <= 1e-5 on tiny-1m-sized models
(tests/test_policy.py); the gap grows with the size of the logits.

Shape legend: B = sequences in a batch, T = tokens per sequence (prompt + response), P = padded
prompt length, L = KV-cache length (P + new tokens), V = vocabulary, `x` = any leading dims.

Example:
    >>> from posttrain.policy.policy import Policy
    >>> policy = Policy.from_spec("tiny-1m", seed=0)
    >>> [c] = policy.generate(["Hello"], max_new_tokens=8, temperature=0)
    >>> len(c.token_ids) <= 8 and c.finish_reason in ("eos", "stop", "length")
    True
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from posttrain.models.specs import ModelSpec, build_model, get_preset
from posttrain.core.checks import check_int

if TYPE_CHECKING:
    from posttrain.models.tokenizer import Tokenizer

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


class Policy:
    """A causal language model with its tokenizer: batched sampling and scoring.

    Args:
        model: a torchtune `TransformerDecoder` (from `posttrain.models.specs.build_model`).
        tokenizer: a `posttrain.models.tokenizer.Tokenizer`; its vocabulary must fit the model's.
        spec: the model's `ModelSpec`.
    """

    def __init__(self, model: nn.Module, tokenizer: "Tokenizer", spec: ModelSpec) -> None:
        if tokenizer.vocab_size > spec.vocab_size:
            raise ValueError(f"tokenizer.vocab_size={tokenizer.vocab_size} exceeds "
                             f"spec.vocab_size={spec.vocab_size}; the model cannot embed its ids")
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_spec(cls, spec: ModelSpec | str, *, tokenizer: "Tokenizer | None" = None,
                  seed: int = 0, device: str | torch.device | None = None,
                  dtype: torch.dtype = torch.float32) -> "Policy":
        """A freshly initialised policy. `spec` is a `ModelSpec` or a preset name ("tiny-1m");
        the tokenizer defaults to `ByteTokenizer()`; parameters come from `seed` (global RNG
        untouched)."""
        if isinstance(spec, str):
            spec = get_preset(spec)
        if tokenizer is None:
            from posttrain.models.tokenizer import ByteTokenizer
            tokenizer = ByteTokenizer()
        return cls(build_model(spec, device=device, dtype=dtype, seed=seed), tokenizer, spec)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, device: str | torch.device | None = None,
                        dtype: torch.dtype = torch.float32) -> "Policy":
        """Load an HF-format folder (config.json + safetensors + tokenizer files)."""
        from posttrain.models.hf import load_hf_checkpoint
        from posttrain.models.tokenizer import load_tokenizer

        model, spec = load_hf_checkpoint(folder, dtype=dtype)
        if device is not None:
            model = model.to(device)
        return cls(model, load_tokenizer(folder), spec)

    def save(self, folder: str | os.PathLike) -> None:
        """Write an HF-format folder that `Policy.from_pretrained` (and transformers) can load:
        config.json, model.safetensors, the tokenizer's files, and generation_config.json whose
        `eos_token_id` lists `tokenizer.stop_ids` (so transformers' `generate` stops where
        `Policy.generate` does). An existing checkpoint folder is replaced whole."""
        from posttrain.models.hf import save_hf_checkpoint

        tok = self.tokenizer
        with tempfile.TemporaryDirectory() as tmp:
            tok.save(tmp)  # written with the weights in one atomic folder replacement
            tokenizer_files = {p.name: p for p in Path(tmp).iterdir() if p.is_file()}
            save_hf_checkpoint(
                self.model, self.spec, folder, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                pad_token_id=tok.pad_id,
                generation_config={"bos_token_id": tok.bos_id, "pad_token_id": tok.pad_id,
                                   "eos_token_id": sorted(tok.stop_ids)},
                extra_files=tokenizer_files)

    # ------------------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def num_parameters(self) -> int:
        """Parameters of the model (tied embeddings counted once)."""
        return sum(p.numel() for p in self.model.parameters())

    def __repr__(self) -> str:
        n = self.num_parameters()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        return (f"Policy(family={self.spec.family}, params={size}, vocab={self.spec.vocab_size}, "
                f"layers={self.spec.num_layers}, device={self.device}, "
                f"dtype={str(self.dtype).removeprefix('torch.')})")

    # ------------------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[str | Sequence[int]], *, n: int = 1,
                 max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int | None = None, stop: str | Sequence[str] | None = None,
                 seed: int | None = None) -> list[Completion]:
        """Sample `n` completions of every prompt, batched, with a KV cache.

        Prompts of different lengths are left-padded; padding is tracked by position (a padding
        mask), never by token value. Each sequence stops on its own at a token in
        `tokenizer.stop_ids` ("eos"), when its decoded text contains a stop string ("stop"; the
        text is cut before it), or after `max_new_tokens` or at `spec.max_seq_len` tokens in all
        ("length"). A finished sequence is no longer scored; when enough have finished, they are
        dropped from the batch.

        Args:
            prompts: str prompts (encoded with BOS) or lists of token ids (used as they are).
            n: samples per prompt.
            max_new_tokens: most tokens generated per sample.
            temperature: 0 is greedy (argmax); its `logprobs` are the untempered model's.
            top_p: nucleus mass in (0, 1].
            top_k: keep the k most likely tokens, or None.
            stop: a stop string or several (checked on the decoded text of each sample).
            seed: seeds a local `torch.Generator` (the global RNG is untouched) so the same seed
                gives the same completions; None draws that seed from the global torch RNG.

        Returns:
            `len(prompts) * n` completions, prompt-major: prompt 0's n samples first.

        Raises:
            ValueError: naming the argument, its value and what is allowed.
        """
        prompt_ids = self._encode_prompts(prompts)
        check_int("n", n, minimum=1)
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        _check_sampling_args(temperature, top_k, top_p)
        stops = _check_stop(stop)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed={seed!r}; must be an int or None")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        rows = [ids for ids in prompt_ids for _ in range(n)]

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                tokens, logprobs, reasons = _generate_tokens(
                    self.model, rows, max_new_tokens=max_new_tokens,
                    max_seq_len=self.spec.max_seq_len, temperature=temperature, top_k=top_k,
                    top_p=top_p, stop_ids=sorted(self.tokenizer.stop_ids), stops=stops,
                    decode=self.tokenizer.decode, pad_id=self.tokenizer.pad_id or 0, seed=seed)
        finally:
            self.model.train(was_training)

        completions = []
        for i, (ids, lps, reason) in enumerate(zip(tokens, logprobs, reasons)):
            text = self.tokenizer.decode(ids)
            if reason == "stop":
                text = text[:_first_stop(text, stops)]
            completions.append(Completion(prompt_index=i // n, sample_index=i % n,
                                          prompt_ids=list(rows[i]), token_ids=ids, text=text,
                                          logprobs=lps, finish_reason=reason))
        return completions

    # --------------------------------------------------------------------------------- scoring
    def logprobs(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                 *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float = 1.0) -> list[Tensor]:
        """Teacher-forced log-probability of each response token given its prompt.

        Uses the same `sampling_logprobs` as `generate`, so with the same settings and unchanged
        weights it reproduces `Completion.logprobs` (<= 1e-5). The batch is right-padded; results
        do not depend on what else is in the batch. Runs in eval mode without gradients (for the
        differentiable version see `logprobs_tensor`).

        Args:
            prompt_ids: B non-empty lists of token ids.
            response_ids: B lists of token ids (may be empty).

        Returns:
            B float32 tensors, tensor b of shape `[len(response_ids[b])]`.
        """
        if isinstance(prompt_ids, (str, bytes)) or isinstance(response_ids, (str, bytes)):
            raise ValueError("prompt_ids and response_ids must be lists of token-id lists")
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"len(prompt_ids)={len(prompt_ids)} != "
                             f"len(response_ids)={len(response_ids)}; need one response per prompt")
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; pass at least one prompt")
        _check_sampling_args(temperature, top_k, top_p)
        for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
            self._check_ids(f"prompt_ids[{b}]", p, allow_empty=False)
            self._check_ids(f"response_ids[{b}]", r, allow_empty=True)
            if len(p) + len(r) > self.spec.max_seq_len:
                raise ValueError(f"prompt_ids[{b}] + response_ids[{b}] has {len(p) + len(r)} "
                                 f"tokens; spec.max_seq_len={self.spec.max_seq_len} is the most")

        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        B, T = len(lengths), max(lengths)
        input_ids_BT = torch.zeros(B, T, dtype=torch.long)
        attention_BT = torch.zeros(B, T, dtype=torch.bool)
        response_BT = torch.zeros(B, T, dtype=torch.bool)
        for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
            input_ids_BT[b, :lengths[b]] = torch.tensor(list(p) + list(r), dtype=torch.long)
            attention_BT[b, :lengths[b]] = True
            response_BT[b, len(p):lengths[b]] = True
        device = self.device
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                logprobs_BT = token_logprobs(
                    self.model, input_ids_BT.to(device), attention_BT.to(device),
                    response_BT.to(device), temperature=temperature, top_k=top_k, top_p=top_p)
        finally:
            self.model.train(was_training)
        logprobs_BT = logprobs_BT.cpu()
        return [logprobs_BT[b, len(p):lengths[b]].clone() for b, p in enumerate(prompt_ids)]

    def logprobs_tensor(self, input_ids_BT: Tensor, attention_mask_BT: Tensor,
                        response_mask_BT: Tensor, *, temperature: float = 1.0,
                        top_k: int | None = None, top_p: float = 1.0) -> Tensor:
        """Differentiable `[B, T]` token log-probabilities for training; see `token_logprobs`."""
        return token_logprobs(self.model, input_ids_BT, attention_mask_BT, response_mask_BT,
                              temperature=temperature, top_k=top_k, top_p=top_p)

    # --------------------------------------------------------------------------------- helpers
    def _check_ids(self, name: str, ids: Sequence[int], *, allow_empty: bool) -> None:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError(f"{name} must be a list of int token ids; got {type(ids).__name__}")
        if not ids and not allow_empty:
            raise ValueError(f"{name} is empty; a prompt needs at least one token")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.spec.vocab_size:
                raise ValueError(f"{name} contains {i!r}; token ids must be ints in "
                                 f"[0, {self.spec.vocab_size})")

    def _encode_prompts(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a list of prompts (str or token-id lists); got "
                             f"{type(prompts).__name__}: wrap a single prompt as [prompt]")
        if len(prompts) == 0:
            raise ValueError("prompts=[] is empty; pass at least one prompt")
        out = []
        limit = self.spec.max_seq_len - 1
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError(f"prompts[{i}]='' is empty; a prompt needs at least one "
                                     "character or token")
                ids = self.tokenizer.encode(prompt, add_bos=True)
            else:
                self._check_ids(f"prompts[{i}]", prompt, allow_empty=False)
                ids = list(prompt)
            if len(ids) > limit:
                raise ValueError(f"prompts[{i}] has {len(ids)} tokens; spec.max_seq_len="
                                 f"{self.spec.max_seq_len} leaves room for at most {limit} prompt "
                                 "tokens (one new token must fit)")
            out.append(ids)
        return out


# ---------------------------------------------------------------------------------- internals
@torch.inference_mode()
def _generate_tokens(model: nn.Module, rows: list[list[int]], *, max_new_tokens: int,
                     max_seq_len: int, temperature: float, top_k: int | None, top_p: float,
                     stop_ids: list[int], stops: list[str], decode, pad_id: int, seed: int
                     ) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
    """The decoding loop: prefill the left-padded prompts, then one token per step for the live
    rows. Returns per row: token ids, their logprobs, finish reason."""
    from torchtune.generation import (get_causal_mask_from_padding_mask,
                                      get_position_ids_from_padding_mask)

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
        tokens_BP[b, P - len(r):] = torch.tensor(r, dtype=torch.long)
        prompt_valid_BP[b, P - len(r):] = True
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
        logprobs_bV = sampling_logprobs(logits_bV, temperature=temperature, top_k=top_k,
                                        top_p=top_p)
        if temperature == 0:
            next_b = logits_bV.argmax(dim=-1)
        else:
            next_b = torch.multinomial(logprobs_bV.exp(), 1, generator=generator).squeeze(-1)
        return next_b, logprobs_bV.gather(-1, next_b[:, None]).squeeze(-1)

    # Batch rows map to original rows through `live`; a row that finished stays in the batch
    # (running_b False, its outputs ignored) until finished rows are a quarter of the batch, then
    # they are dropped from the batch and from the KV cache.
    live = torch.arange(B, device=device)
    running_b = torch.ones(B, dtype=torch.bool, device=device)
    with _decoding_attention(model, batch_size=B, max_len=L,
                             padded=not bool(prompt_valid_BP.all())):
        mask_BPP = get_causal_mask_from_padding_mask(prompt_valid_BP)
        logits_bV = _as_tensor(model(tokens_BP, input_pos=positions_BL[:, :P],
                                     mask=mask_BPP))[:, -1]
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
                    reasons[int(live[j])] = ("eos" if eos_b[j] else
                                             "stop" if stop_b[j] else "length")
                running_b = running_b & ~finished_b
                if not bool(running_b.any()):
                    break
                if int((~running_b).sum()) * 4 >= len(live):
                    keep = running_b.nonzero().flatten()
                    _select_kv_cache_rows(model, keep)
                    live, next_b, running_b = live[keep], next_b[keep], running_b[keep]
            # the new token sits at cache position P + step and sees the cache up to itself
            cache_pos = P + step
            mask_b1S = valid_BL[live, None, :cache_pos + 1]
            input_pos_b1 = positions_BL[live, cache_pos:cache_pos + 1]
            logits_bV = _as_tensor(model(next_b[:, None], mask=mask_b1S,
                                         input_pos=input_pos_b1))[:, -1]
    assert all(r is not None for r in reasons), reasons
    tokens = [out_tokens_BN[b, :int(n_generated_B[b])].tolist() for b in range(B)]
    logprobs = [out_logprobs_BN[b, :int(n_generated_B[b])].tolist() for b in range(B)]
    return tokens, logprobs, reasons  # type: ignore[return-value]


class _GrowingKVCache(nn.Module):
    """Key/value cache of one attention layer that returns only the filled positions.

    Stands in for torchtune's `KVCache` inside `MultiHeadAttention` (same `update`, `reset`,
    `k_cache`, `v_cache`); torchtune's returns the whole preallocated `[B, H_kv, L, D]` buffer at
    every step, so each step attends over all L positions. The caller passes a mask as wide as
    the filled part.
    """

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.size = 0

    def reset(self) -> None:
        self.size = 0

    def update(self, k_val: Tensor, v_val: Tensor) -> tuple[Tensor, Tensor]:
        end = self.size + k_val.shape[2]
        assert end <= self.k_cache.shape[2], "KV cache overflow"
        self.k_cache[:, :, self.size:end] = k_val
        self.v_cache[:, :, self.size:end] = v_val
        self.size = end
        return self.k_cache[:, :, :end], self.v_cache[:, :, :end]

    def select_rows(self, keep_b: Tensor) -> None:
        self.k_cache = self.k_cache[keep_b]
        self.v_cache = self.v_cache[keep_b]


def _sdpa_gqa(*, padded: bool):
    """torchtune's `_attention_call` for a boolean `[b, s_q, s_k]` mask, with grouped-query heads
    left to SDPA (`enable_gqa`: query head h reads key/value head h // (H / H_kv), the same
    pairing as torchtune's expand) instead of copied.

    Without padding (`padded=False`) the mask carries nothing SDPA cannot do itself: the prompt
    is plainly causal and a one-token step sees the whole filled cache, so it is dropped.
    """

    def attention_call(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
                       is_causal: bool) -> Tensor:
        if not padded:
            mask, is_causal = None, q.shape[2] > 1
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask[:, None], dropout_p=dropout_p,
            is_causal=is_causal, enable_gqa=k.shape[1] != q.shape[1])

    return attention_call


@contextlib.contextmanager
def _decoding_attention(model: nn.Module, *, batch_size: int, max_len: int, padded: bool):
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
        `MultiHeadAttention.forward`, pinned by tests/test_policy.py (KV cache == no cache).
    """
    from torchtune.modules import MultiHeadAttention

    if model.caches_are_setup():
        raise ValueError("the model already has KV caches set up; Policy.generate sets up its "
                         "own (remove them with torchtune.modules.common_utils.delete_kv_caches)")
    param = next(model.parameters())
    attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    saved = [(a.num_kv_heads, a._attention_call) for a in attns]
    attention_call = _sdpa_gqa(padded=padded)
    try:
        for attn in attns:
            attn.kv_cache = _GrowingKVCache(batch_size, max_len, attn.num_kv_heads, attn.head_dim,
                                            param.dtype, param.device)
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
    """Keep only batch rows `keep_b` of every KV cache (drops finished sequences)."""
    for module in model.modules():
        if isinstance(module, _GrowingKVCache):
            module.select_rows(keep_b)


def _as_tensor(output: Tensor | list[Tensor]) -> Tensor:
    """Model output as one `[B, T, V]` tensor (torchtune returns chunks when
    `set_num_output_chunks` was called)."""
    return torch.cat(output, dim=1) if isinstance(output, list) else output


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in `text` of the earliest stop string, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None




def _check_sampling_args(temperature: float, top_k: int | None, top_p: float) -> None:
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or math.isinf(temperature):
        raise ValueError(f"temperature={temperature!r}; must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k={top_k!r}; must be None (no top-k) or an integer >= 1")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}; must be in (0, 1] (1 = no nucleus filtering)")


def _check_stop(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop={stop!r}; must be None, a non-empty str or a list of "
                             "non-empty str")
    return stops
