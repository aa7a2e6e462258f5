"""`Policy`: a model and its tokenizer that sample completions and score them.

Sampling (`Policy.generate`) and scoring (`Policy.logprobs`, `token_logprobs`) share one function,
`sampling_logprobs`, that turns logits into the log-probabilities of the distribution the sampler
actually draws from (temperature, then top-k, then top-p, renormalised). So for unchanged weights
the log-probabilities recomputed at training time equal the ones recorded at sampling time and the
PPO/GRPO importance ratio is 1 on-policy, up to float32 rounding: the KV-cache path multiplies one
token at a time and the scorer a whole sequence, and BLAS sums those in different orders (a plain
`nn.Linear` differs by ~1e-5 on outputs of size 30). Measured <= 1e-5 on tiny-1m-sized models
(tests/policy/test_policy.py); the gap grows with the size of the logits.

Shape legend: B = sequences in a batch, T = tokens per sequence (prompt + response).

This module holds `Policy`; the sampling math and teacher-forced scoring are in
`posttrain.policy.sampling`, the decoding loop with its KV cache in `posttrain.policy.generation`.

Example:
    >>> from posttrain.policy.policy import Policy
    >>> policy = Policy.from_spec("tiny-1m", seed=0)
    >>> [c] = policy.generate(["Hello"], max_new_tokens=8, temperature=0)
    >>> len(c.token_ids) <= 8 and c.finish_reason in ("eos", "stop", "length")
    True
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from posttrain.core.checks import check_int
from posttrain.models.specs import ModelSpec, build_model, get_preset
from posttrain.policy.chunked_ce import token_logprobs_chunked
from posttrain.policy.generation import _check_stop, _first_stop, _generate_tokens
from posttrain.policy.sampling import Completion, _check_sampling_args

if TYPE_CHECKING:
    from posttrain.models.tokenizer import Tokenizer


class Policy:
    """A causal language model with its tokenizer: batched sampling and scoring.

    Args:
        model: a torchtune `TransformerDecoder` (from `posttrain.models.specs.build_model`).
        tokenizer: a `posttrain.models.tokenizer.Tokenizer`; its vocabulary must fit the model's.
        spec: the model's `ModelSpec`.
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, spec: ModelSpec) -> None:
        if tokenizer.vocab_size > spec.vocab_size:
            raise ValueError(
                f"tokenizer.vocab_size={tokenizer.vocab_size} exceeds "
                f"spec.vocab_size={spec.vocab_size}; the model cannot embed its ids"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_spec(
        cls,
        spec: ModelSpec | str,
        *,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Policy:
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
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Policy:
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
                self.model,
                self.spec,
                folder,
                bos_token_id=tok.bos_id,
                eos_token_id=tok.eos_id,
                pad_token_id=tok.pad_id,
                generation_config={
                    "bos_token_id": tok.bos_id,
                    "pad_token_id": tok.pad_id,
                    "eos_token_id": sorted(tok.stop_ids),
                },
                extra_files=tokenizer_files,
            )

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
        return (
            f"Policy(family={self.spec.family}, params={size}, vocab={self.spec.vocab_size}, "
            f"layers={self.spec.num_layers}, device={self.device}, "
            f"dtype={str(self.dtype).removeprefix('torch.')})"
        )

    # ------------------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        compile: bool = False,
    ) -> list[Completion]:
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
            compile: run the one-token decoding step under `torch.compile` (dynamic shapes:
                `posttrain.policy.generation._compiled_step`); the first call compiles (tens of
                seconds on a CPU), once per power-of-two batch size the finishing rows pass
                through; greedy tokens equal eager's, log-probs within 1e-5 (fp32); sampled
                ones (temperature > 0) draw from another random stream (padding rows draw too).

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
                    self.model,
                    rows,
                    max_new_tokens=max_new_tokens,
                    max_seq_len=self.spec.max_seq_len,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    stop_ids=sorted(self.tokenizer.stop_ids),
                    stops=stops,
                    decode=self.tokenizer.decode,
                    pad_id=self.tokenizer.pad_id or 0,
                    seed=seed,
                    compile=compile,
                )
        finally:
            self.model.train(was_training)

        completions = []
        for i, (ids, lps, reason) in enumerate(zip(tokens, logprobs, reasons)):
            text = self.tokenizer.decode(ids)
            if reason == "stop":
                text = text[: _first_stop(text, stops)]
            completions.append(
                Completion(
                    prompt_index=i // n,
                    sample_index=i % n,
                    prompt_ids=list(rows[i]),
                    token_ids=ids,
                    text=text,
                    logprobs=lps,
                    finish_reason=reason,
                )
            )
        return completions

    # --------------------------------------------------------------------------------- scoring
    def logprobs(
        self,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        chunk_tokens: int | None = None,
    ) -> list[Tensor]:
        """Teacher-forced log-probability of each response token given its prompt.

        Uses the same `sampling_logprobs` as `generate`, so with the same settings and unchanged
        weights it reproduces `Completion.logprobs` (<= 1e-5). The batch is right-padded; results
        do not depend on what else is in the batch. Runs in eval mode without gradients (for the
        differentiable version see `logprobs_tensor`).

        Args:
            prompt_ids: B non-empty lists of token ids.
            response_ids: B lists of token ids (may be empty).
            chunk_tokens: None (the full [B, T, V] logits), or response tokens per chunk of the
                output projection and log-softmax (`logprobs_tensor`).

        Returns:
            B float32 tensors, tensor b of shape `[len(response_ids[b])]`.

        Raises:
            ValueError: naming the argument, for malformed ids, a row longer than
                spec.max_seq_len, bad sampling settings or a bad `chunk_tokens`.
        """
        if isinstance(prompt_ids, (str, bytes)) or isinstance(response_ids, (str, bytes)):
            raise ValueError("prompt_ids and response_ids must be lists of token-id lists")
        if len(prompt_ids) != len(response_ids):
            raise ValueError(
                f"len(prompt_ids)={len(prompt_ids)} != "
                f"len(response_ids)={len(response_ids)}; need one response per prompt"
            )
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; pass at least one prompt")
        _check_sampling_args(temperature, top_k, top_p)
        for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
            self._check_ids(f"prompt_ids[{b}]", p, allow_empty=False)
            self._check_ids(f"response_ids[{b}]", r, allow_empty=True)
            if len(p) + len(r) > self.spec.max_seq_len:
                raise ValueError(
                    f"prompt_ids[{b}] + response_ids[{b}] has {len(p) + len(r)} "
                    f"tokens; spec.max_seq_len={self.spec.max_seq_len} is the most"
                )

        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        B, T = len(lengths), max(lengths)
        input_ids_BT = torch.zeros(B, T, dtype=torch.long)
        attention_BT = torch.zeros(B, T, dtype=torch.bool)
        response_BT = torch.zeros(B, T, dtype=torch.bool)
        for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
            input_ids_BT[b, : lengths[b]] = torch.tensor(list(p) + list(r), dtype=torch.long)
            attention_BT[b, : lengths[b]] = True
            response_BT[b, len(p) : lengths[b]] = True
        device = self.device
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                logprobs_BT = token_logprobs_chunked(
                    self.model,
                    input_ids_BT.to(device),
                    attention_BT.to(device),
                    response_BT.to(device),
                    chunk_tokens=chunk_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                )
        finally:
            self.model.train(was_training)
        logprobs_BT = logprobs_BT.cpu()
        return [logprobs_BT[b, len(p) : lengths[b]].clone() for b, p in enumerate(prompt_ids)]

    def logprobs_tensor(
        self,
        input_ids_BT: Tensor,
        attention_mask_BT: Tensor,
        response_mask_BT: Tensor,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        chunk_tokens: int | None = None,
    ) -> Tensor:
        """Differentiable `[B, T]` float32 token log-probabilities for training (0 off the
        response); see `posttrain.policy.sampling.token_logprobs` for the arguments.

        `chunk_tokens`: None (default) builds the full [B, T, V] logits; an int >= 1 runs the
        output projection and log-softmax (at `temperature`, `top_k`, `top_p`, applied per
        position as without chunks) over that many response tokens at a time, recomputed in
        backward, so no [B, T, V] tensor is held (`posttrain.policy.chunked_ce`). Values and
        gradients equal the unchunked ones up to float rounding (fp32: ~1e-7).

        Raises:
            ValueError: as `token_logprobs`, or for a `chunk_tokens` that is not None or an
                int >= 1 (named).
            TypeError: with chunks, for a model that is not a torchtune decoder.
        """
        return token_logprobs_chunked(
            self.model,
            input_ids_BT,
            attention_mask_BT,
            response_mask_BT,
            chunk_tokens=chunk_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )

    # --------------------------------------------------------------------------------- helpers
    def _check_ids(self, name: str, ids: Sequence[int], *, allow_empty: bool) -> None:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError(f"{name} must be a list of int token ids; got {type(ids).__name__}")
        if not ids and not allow_empty:
            raise ValueError(f"{name} is empty; a prompt needs at least one token")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.spec.vocab_size:
                raise ValueError(
                    f"{name} contains {i!r}; token ids must be ints in [0, {self.spec.vocab_size})"
                )

    def _encode_prompts(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(
                f"prompts must be a list of prompts (str or token-id lists); got "
                f"{type(prompts).__name__}: wrap a single prompt as [prompt]"
            )
        if len(prompts) == 0:
            raise ValueError("prompts=[] is empty; pass at least one prompt")
        out = []
        limit = self.spec.max_seq_len - 1
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError(
                        f"prompts[{i}]='' is empty; a prompt needs at least one character or token"
                    )
                ids = self.tokenizer.encode(prompt, add_bos=True)
            else:
                self._check_ids(f"prompts[{i}]", prompt, allow_empty=False)
                ids = list(prompt)
            if len(ids) > limit:
                raise ValueError(
                    f"prompts[{i}] has {len(ids)} tokens; spec.max_seq_len="
                    f"{self.spec.max_seq_len} leaves room for at most {limit} prompt "
                    "tokens (one new token must fit)"
                )
            out.append(ids)
        return out


class Sampler(Protocol):
    """What `generate_for_items` samples with: a `Policy`, or a rollout engine
    (`posttrain.policy.rollout_engine.RolloutEngine`, which has these two and more)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def generate(self) -> Callable[..., Sequence[Completion]]: ...


def generate_for_items(
    policy_or_engine: Sampler,
    items: Sequence[Mapping[str, Any]],
    *,
    batch_size: int,
    chat: bool = True,
    seed: int = 0,
    **sampling: Any,
) -> Iterator[tuple[int, list[Mapping[str, Any]], list[Completion]]]:
    """`generate` over task items in chunks, from a `Policy` or a rollout engine: the one place
    where evaluation, synthetic data, preference pairs and distillation data sample.

    Each item's "question" (a str; the caller checks) is rendered as a one-turn user chat with
    the generation prompt (`chat=True`) or fed as raw text, encoded with BOS by the sampler
    (`chat=False`, for continued-pretraining models); the chunk of `batch_size` items starting
    at item `start` is sampled with seed `seed + start`, so a chunk's completions do not depend
    on the chunks before it.

    Args:
        policy_or_engine: a `Policy`, or a `posttrain.policy.rollout_engine.RolloutEngine`
            ("builtin": `Policy.generate` itself, the same completions bit for bit; "vllm": a
            vLLM server, which refuses by name what it would sample differently, e.g. stop
            strings: `posttrain.policy.vllm_sampling`); anything with `generate(prompts,
            seed=..., **sampling)` and a `tokenizer.render_prompt`.
        sampling: the other keywords of `generate` (n, max_new_tokens, temperature, top_p,
            top_k, stop).

    Yields:
        (start, chunk, completions): `completions` as `generate` returns them for the chunk
        (prompt-major, `n` per item; `Completion.prompt_index` indexes `chunk`).

    Raises:
        TypeError: `policy_or_engine` has no `generate` or no `tokenizer` (checked before the
            first chunk).
        ValueError: what the sampler's `generate` raises for a bad setting (named).

    Example:
        >>> policy = Policy.from_spec("tiny-1m", seed=0)
        >>> items = [{"question": "1 + 1 ="}, {"question": "2 + 2 ="}, {"question": "3 + 3 ="}]
        >>> [(start, len(chunk), len(cs)) for start, chunk, cs in generate_for_items(
        ...     policy, items, batch_size=2, n=2, max_new_tokens=2)]
        [(0, 2, 4), (2, 1, 2)]
    """
    sampler = policy_or_engine
    if (
        not callable(getattr(sampler, "generate", None))
        or getattr(sampler, "tokenizer", None) is None
    ):
        raise TypeError(
            f"policy_or_engine is a {type(sampler).__name__}; must be a Policy or a RolloutEngine "
            "(posttrain.policy.rollout_engine: an object with generate(prompts, seed=..., "
            "**sampling) and a tokenizer)"
        )
    for start in range(0, len(items), batch_size):
        chunk = list(items[start : start + batch_size])
        prompts = [
            sampler.tokenizer.render_prompt([{"role": "user", "content": it["question"]}])
            if chat
            else it["question"]
            for it in chunk
        ]
        yield start, chunk, list(sampler.generate(prompts, seed=seed + start, **sampling))
