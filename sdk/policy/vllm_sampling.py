"""posttrain's sampling settings as vLLM completion requests, and vLLM's answers as completions.

`posttrain.policy.vllm_server.VLLMServer` samples through vLLM's OpenAI-compatible completions
API (`POST /v1/completions`). This module holds the two pure halves of that exchange, so the
mapping is read and tested in one place:

- `completion_requests` turns `Policy.generate`'s arguments into one request body per sample;
- `served_completion` turns one answer back into a `ServedCompletion`.

How each setting maps (the server runs with `--logprobs-mode processed_logprobs`, so the
log-probabilities it returns are those of the distribution it sampled from, after temperature,
top-k and top-p, as `posttrain.policy.sampling.sampling_logprobs` computes them):

| posttrain | vLLM request | note |
|---|---|---|
| temperature (0 = greedy) | temperature | greedy log-probs are the untempered model's in both |
| top_p | top_p | |
| top_k (None = off) | top_k (-1 = off) | |
| max_new_tokens | max_tokens | capped at `max_seq_len - len(prompt)`, where posttrain stops |
| tokenizer.stop_ids | stop_token_ids | the stop token is kept in `token_ids` in both |
| seed | seed | sample j of prompt i uses `seed + i * n + j` (one request per sample) |
| n | n requests | vLLM gives every sample of one seeded request the same seed |

Refused by name (ValueError): `stop` strings (the server runs without a tokenizer, on token ids,
so it cannot see text), and any keyword `Policy.generate` does not have.

Shape legend: none; token ids are lists of ints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from posttrain.core.checks import check_int
from posttrain.policy.sampling import Completion, FinishReason, _check_sampling_args

if TYPE_CHECKING:
    from posttrain.models.specs import ModelSpec
    from posttrain.models.tokenizer import Tokenizer

__all__ = [
    "ServedCompletion",
    "completion_requests",
    "encode_prompts",
    "served_completion",
    "call_requests",
    "call_completions",
    "SAMPLING_KEYS",
]

# The keywords of `Policy.generate` that the vLLM engine accepts.
SAMPLING_KEYS = ("n", "max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed")


@dataclass(frozen=True)
class ServedCompletion(Completion):
    """A `Completion` sampled by a vLLM server.

    Attributes:
        weight_version: the server's weight version when the sample was drawn: 0 for the weights
            it started with, +1 for every successful `VLLMServer.sync_weights`.
    """

    weight_version: int


def completion_requests(
    prompt_ids: Sequence[Sequence[int]],
    *,
    model: str,
    max_seq_len: int,
    stop_ids: Sequence[int],
    seed: int,
    n: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    stop: str | Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One `/v1/completions` request body per sample, prompt-major (prompt 0's n samples first).

    Args:
        prompt_ids: the prompts as token ids, each shorter than `max_seq_len`.
        model: the server's served model name.
        max_seq_len: the model's context length (prompt + completion).
        stop_ids: token ids that end a sample (the tokenizer's `stop_ids`).
        seed: the seed of this call; sample j of prompt i gets `seed + i * n + j`.
        n, max_new_tokens, temperature, top_p, top_k: as in `Policy.generate`.
        stop: must be None (stop strings are refused, see the module docstring).

    Returns:
        `len(prompt_ids) * n` JSON-ready dicts.

    Raises:
        ValueError: a setting out of range (named, with what is allowed), or a stop string.
    """
    if stop is not None and stop != [] and stop != ():
        raise ValueError(
            f"stop={stop!r}: the vLLM engine samples token ids without a tokenizer, so it cannot "
            "stop on strings; stop on token ids (tokenizer.stop_ids, always applied) or use the "
            "builtin engine (Policy.generate)"
        )
    check_int("n", n, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    _check_sampling_args(temperature, top_k, top_p)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r}; must be an int or None")
    requests = []
    for i, ids in enumerate(prompt_ids):
        room = max_seq_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompts[{i}] has {len(ids)} tokens; max_seq_len={max_seq_len} leaves room for "
                f"at most {max_seq_len - 1} prompt tokens (one new token must fit)"
            )
        for j in range(n):
            requests.append(
                {
                    "model": model,
                    "prompt": [int(t) for t in ids],
                    "max_tokens": min(max_new_tokens, room),
                    "temperature": float(temperature),
                    "top_p": float(top_p),
                    "top_k": -1 if top_k is None else int(top_k),
                    "seed": (seed + i * n + j) % 2**63,
                    "stop_token_ids": sorted(int(t) for t in stop_ids),
                    "logprobs": 0,
                    "return_token_ids": True,
                    "return_tokens_as_token_ids": True,
                    "skip_special_tokens": False,
                    "n": 1,
                }
            )
    return requests


def served_completion(
    answer: Mapping[str, Any],
    *,
    prompt_index: int,
    sample_index: int,
    prompt_ids: Sequence[int],
    text: str,
    weight_version: int,
) -> ServedCompletion:
    """Turn one `/v1/completions` answer (one choice) into a `ServedCompletion`.

    `finish_reason` maps vLLM's "stop" (a stop token; the server has no stop strings) to "eos"
    and "length" to "length". `text` is the caller's decoding of the token ids (the server has
    no tokenizer).

    Raises:
        ValueError: the answer lacks token ids or log-probs, or they disagree in length, or a
            finish reason other than "stop" / "length" (e.g. "abort").
    """
    choices = answer.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"expected one choice in the vLLM answer, got {len(choices)}: {answer!r}")
    choice = choices[0]
    token_ids = choice.get("token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if token_ids is None or logprobs is None:
        raise ValueError(
            "the vLLM answer has no token_ids or logprobs.token_logprobs; the request must set "
            f"return_token_ids and logprobs: {choice!r}"
        )
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} token ids but {len(logprobs)} log-probs: {choice!r}")
    reasons: dict[str, FinishReason] = {"stop": "eos", "length": "length"}
    reason = reasons.get(str(choice.get("finish_reason")))
    if reason is None:
        raise ValueError(
            f"vLLM finish_reason={choice.get('finish_reason')!r}; expected 'stop' or 'length'"
        )
    values = [float(x) for x in logprobs]
    if any(math.isnan(x) for x in values):
        raise ValueError(f"vLLM returned NaN log-probs: {choice!r}")
    return ServedCompletion(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=list(prompt_ids),
        token_ids=[int(t) for t in token_ids],
        text=text,
        logprobs=values,
        finish_reason=reason,
        weight_version=weight_version,
    )


def encode_prompts(
    prompts: Sequence[str | Sequence[int]], tokenizer: Tokenizer, vocab_size: int
) -> list[list[int]]:
    """Prompts as token-id lists: a str is encoded with BOS, a list of ids is checked.

    Raises:
        ValueError: no prompts, an empty prompt, or an id outside [0, vocab_size).
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (str or token-id lists)")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompts[{i}]='' is empty; a prompt needs at least one character")
            out.append(tokenizer.encode(prompt, add_bos=True))
            continue
        ids = list(prompt)
        if not ids or any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids
        ):
            raise ValueError(
                f"prompts[{i}] must be a non-empty list of int token ids in [0, {vocab_size})"
            )
        out.append(ids)
    return out


def call_requests(
    prompts: Sequence[str | Sequence[int]],
    *,
    tokenizer: Tokenizer,
    spec: ModelSpec,
    model: str,
    seed: int | None,
    sampling: Mapping[str, Any],
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """One `generate` call as request bodies: the prompts' token ids and one body per sample,
    prompt-major (see `completion_requests`). A server or a pool of servers sends the bodies in
    any order and to any server: each carries its own seed, so its answer does not depend on
    where it runs.

    Args:
        prompts: str prompts (encoded with BOS by `tokenizer`) or token-id lists.
        tokenizer, spec: the served policy's (stop ids, vocabulary size, context length).
        model: the server's served model name.
        seed: the call's seed; None draws one from the global torch RNG, as `Policy.generate`.
        sampling: the call's other keywords (`SAMPLING_KEYS`).

    Raises:
        ValueError: an unknown keyword (the allowed ones listed), a bad prompt or setting, named.
    """
    unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown sampling settings {unknown}; allowed: {list(SAMPLING_KEYS)}")
    prompt_ids = encode_prompts(prompts, tokenizer, spec.vocab_size)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    bodies = completion_requests(
        prompt_ids,
        model=model,
        max_seq_len=spec.max_seq_len,
        stop_ids=sorted(tokenizer.stop_ids),
        seed=seed,
        **sampling,
    )
    return prompt_ids, bodies


def call_completions(
    answers: Sequence[Mapping[str, Any]],
    prompt_ids: Sequence[Sequence[int]],
    *,
    tokenizer: Tokenizer,
    weight_version: int,
) -> list[ServedCompletion]:
    """The answers to `call_requests`' bodies (in the bodies' order) as `ServedCompletion`s,
    prompt-major, each decoded with `tokenizer` and stamped with `weight_version`.

    Raises:
        ValueError: an answer `served_completion` refuses (named).
    """
    n = len(answers) // len(prompt_ids)
    out = []
    for k, answer in enumerate(answers):
        ids = (answer.get("choices") or [{}])[0].get("token_ids") or []
        out.append(
            served_completion(
                answer,
                prompt_index=k // n,
                sample_index=k % n,
                prompt_ids=prompt_ids[k // n],
                text=tokenizer.decode(ids),
                weight_version=weight_version,
            )
        )
    return out
