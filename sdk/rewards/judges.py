"""Judges: model-based rewards with typed results, usable wherever a verifier is.

A judge scores completions with a model instead of a rule: an LLM reading a rubric
(`LLMJudge`), or a Bradley-Terry reward model (`RewardModelJudge`, see
`posttrain.rewards.reward_model`). Both return `JudgeResult`s, which are `VerifierResult`s (same
`Outcome` vocabulary, same finite score) carrying the judge's raw output as well. What a judge
is and returns (the outcomes of a judge, why its failure is never the policy's low reward, the
`Judge` protocol, a judge as a `Verifier` for RL: `judge_as_verifier`) is
`posttrain.rewards.judge_protocol`; its names are importable from here as well.

Pairwise judges (which of two completions is better) are in `posttrain.rewards.pairwise`; a
judge served over HTTP is `posttrain.rewards.judge_server` and its client
`posttrain.rewards.judge_client`.

Thread safety: `JudgeVerifier` declares `isolation = "thread"` (it holds a model: `run_verifier`
runs it on a thread, not in a worker process). `LLMJudge` (and
`posttrain.rewards.pairwise.LLMPairwiseJudge`) hold a lock around `Policy.generate` (which sets
up KV caches on the model), so concurrent calls wait for each other; a call abandoned after its
timeout still holds the lock until its generation ends.

Example (a stub stands in for the judge model's `generate`):
    >>> from types import SimpleNamespace
    >>> from posttrain.policy import Completion
    >>> from posttrain.models import ByteTokenizer
    >>> verdicts = iter(["Score: 7", "no idea"])
    >>> def generate(prompts, **settings):
    ...     return [Completion(i, 0, p, [], next(verdicts), [], "eos")
    ...             for i, p in enumerate(prompts)]
    >>> stub = SimpleNamespace(generate=generate, tokenizer=ByteTokenizer(),
    ...                        spec=SimpleNamespace(max_seq_len=512))
    >>> judge = LLMJudge(stub, "Is the answer correct?")
    >>> [(r.outcome.value, r.score) for r in judge.judge(["12", "13"], [{"question": "5+7="}] * 2)]
    [('ok', 0.7), ('error', 0.0)]
"""

from __future__ import annotations

import math
import numbers
import re
import string
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.core.checks import check_int
from posttrain.rewards.judge_parsing import parse_score
from posttrain.rewards.judge_protocol import (
    Judge,
    JudgeResult,
    JudgeVerifier,
    _check_lengths,
    _text_problem,
    judge_as_verifier,
)
from posttrain.rewards.verifier import Outcome

__all__ = [
    "JudgeResult",
    "Judge",
    "LLMJudge",
    "RewardModelJudge",
    "judge_as_verifier",
    "JudgeVerifier",
    "parse_score",
    "DEFAULT_JUDGE_TEMPLATE",
]

_REASON_CHARS = 80  # judge text quoted in a reason


# --------------------------------------------------------------------------------------------
# LLM-as-judge
# --------------------------------------------------------------------------------------------

DEFAULT_JUDGE_TEMPLATE = (
    "{rubric}\n\nQuestion:\n{question}\n\nResponse:\n{completion}\n\n"
    "Rate the response from {low:g} to {high:g}. End with 'Score: N'."
)
"""Placeholders: rubric, question, completion (judged), reference (item["answer"]), low, high."""


class _Generator:
    """Batched greedy/sampled generation with a judge policy; prompts too long for the model
    come back as errors instead of failing the batch. Holds the lock (see module docstring)."""

    def __init__(
        self,
        policy,
        *,
        chat: bool,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        batch_size: int,
    ) -> None:
        for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
            check_int(name, value, minimum=1)
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
            raise ValueError(f"temperature={temperature!r}; must be >= 0 (0 = greedy)")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed={seed!r}; must be an int")
        self.policy, self.chat = policy, chat
        self.max_new_tokens, self.temperature = max_new_tokens, float(temperature)
        self.seed, self.batch_size = seed, batch_size
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, texts: Sequence[str]) -> list[tuple[str | None, str]]:
        """(generated text, "") per prompt text, or (None, why) when it could not be judged."""
        tok = self.policy.tokenizer
        limit = self.policy.spec.max_seq_len - 1
        out: list[tuple[str | None, str]] = [(None, "")] * len(texts)
        todo: list[tuple[int, list[int]]] = []
        for i, text in enumerate(texts):
            ids = (
                tok.render_prompt([{"role": "user", "content": text}])
                if self.chat
                else tok.encode(text, add_bos=True)
            )
            if len(ids) > limit:
                out[i] = (
                    None,
                    f"judge prompt has {len(ids)} tokens; the judge model takes at "
                    f"most {limit} (max_seq_len - 1)",
                )
            else:
                todo.append((i, ids))
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start : start + self.batch_size]
            with self._lock:
                completions = self.policy.generate(
                    [ids for _, ids in chunk],
                    max_new_tokens=self.max_new_tokens,
                    temperature=self.temperature,
                    seed=self.seed,
                )
            for (i, _), completion in zip(chunk, completions):
                out[i] = (completion.text, "")
        return out


def _quote(text: str) -> str:
    return repr(text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS] + "...")


def _check_template(template: str, names: set[str], required: tuple[str, ...]) -> None:
    if not isinstance(template, str):
        raise TypeError(f"template is a {type(template).__name__}; expected a format string")
    try:
        template.format(**{name: 0 for name in names})
        used = {
            re.split(r"[.\[]", field)[0]
            for _, field, _, _ in string.Formatter().parse(template)
            if field
        }
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"template {template[:60]!r}... is not a valid format string over the "
            f"placeholders {sorted(names)}: {type(exc).__name__}: {exc}"
        ) from None
    missing = [name for name in required if name not in used]
    if missing:
        raise ValueError(
            f"template {template[:60]!r}... lacks the placeholders "
            f"{', '.join('{' + m + '}' for m in missing)}; it must show the judge "
            f"{', '.join('{' + r + '}' for r in required)}"
        )


def _check_real(name: str, value: Any, allowed: str) -> float:
    """`value` as a float if it is a finite real number (not a bool); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}; must be {allowed}")
    return float(value)


class LLMJudge:
    """LLM-as-judge: render rubric + question + completion, generate, parse "Score: N".

    The judge model reads `template` (a one-turn chat when `chat`), writes a verdict, and the
    score is `parse(text)`, checked against `score_range`; an unparsable text or a score outside
    the range is the judge's failure, outcome `error` (Zheng et al. 2023, "Judging LLM-as-a-Judge
    with MT-Bench and Chatbot Arena", single-answer grading, section 3.1).

    Args:
        policy: the judge model, a `posttrain.policy.policy.Policy`, or a rollout engine
            holding its weights (`posttrain.policy.rollout_engine`: "builtin" judges exactly as
            the policy, "vllm" through a vLLM server); anything with `generate`, `tokenizer`
            and `spec.max_seq_len`.
        rubric: what a good response is; the `{rubric}` placeholder.
        score_range: (low, high), finite, low < high; parsed scores must lie inside (inclusive).
        parse: `text -> float | None` (default `parse_score`); None, a raise, or anything but
            a real number -> error.
        template: format string over rubric, question, completion, reference, low, high; it
            must use {question} and {completion}.
        normalize: report `(s - low) / (high - low)` in [0, 1] (default) instead of s.
        ok_threshold: outcome ok when the normalised score is >= this, else wrong.
        max_new_tokens, temperature, seed: generation settings (temperature 0 = greedy, the
            default: the same input gets the same verdict).
        batch_size: prompts per `generate` call.
        chat: render the prompt as a user turn (True) or as plain text after BOS.

    Raises:
        ValueError: for a bad range, threshold, template or generation setting.
    """

    def __init__(
        self,
        policy,
        rubric: str,
        *,
        score_range: tuple[float, float] = (0, 10),
        parse: Callable[[str], float | None] = parse_score,
        template: str = DEFAULT_JUDGE_TEMPLATE,
        normalize: bool = True,
        ok_threshold: float = 0.5,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int = 0,
        batch_size: int = 32,
        chat: bool = True,
    ) -> None:
        allowed = "two finite numbers (low, high), low < high"
        if not (isinstance(score_range, Sequence) and len(score_range) == 2):
            raise ValueError(f"score_range={score_range!r}; must be {allowed}")
        low, high = (_check_real("score_range", v, allowed) for v in score_range)
        if not low < high:
            raise ValueError(f"score_range={score_range!r}; must be {allowed}")
        if not 0.0 <= _check_real("ok_threshold", ok_threshold, "a number in [0, 1]") <= 1.0:
            raise ValueError(f"ok_threshold={ok_threshold!r}; must be in [0, 1] (normalised)")
        _check_template(
            template,
            {"rubric", "question", "completion", "reference", "low", "high"},
            required=("question", "completion"),
        )
        self.rubric, self.score_range, self.parse = rubric, (low, high), parse
        self.template, self.normalize, self.ok_threshold = template, normalize, ok_threshold
        self._generate = _Generator(
            policy,
            chat=chat,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            batch_size=batch_size,
        )

    @property
    def policy(self):
        return self._generate.policy

    def render(self, completion: str, item: Mapping[str, Any]) -> str:
        """The judge prompt for one completion (raises KeyError without item["question"])."""
        low, high = self.score_range
        return self.template.format(
            rubric=self.rubric,
            question=item["question"],
            completion=completion,
            reference=item.get("answer", ""),
            low=low,
            high=high,
        )

    def judge(
        self, completions: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[JudgeResult]:
        """One `JudgeResult` per completion (see the module table for the outcomes).

        Raises:
            ValueError: if the two sequences differ in length.
        """
        _check_lengths(completions, items)
        results: list[JudgeResult | None] = [None] * len(completions)
        prompts, where = [], []
        for i, (completion, item) in enumerate(zip(completions, items)):
            problem = _text_problem(completion, item)
            if problem is not None:
                results[i] = JudgeResult.failure(Outcome.ERROR, problem)
                continue
            try:
                prompts.append(self.render(completion, item))
                where.append(i)
            except (KeyError, TypeError) as exc:
                results[i] = JudgeResult.failure(
                    Outcome.ERROR, f"cannot render the judge prompt: {type(exc).__name__}: {exc}"
                )
        for i, (text, why) in zip(where, self._generate(prompts)):
            results[i] = (
                JudgeResult.failure(Outcome.ERROR, why) if text is None else self._score(text)
            )
        return [
            r if r is not None else JudgeResult.failure(Outcome.ERROR, "not judged")
            for r in results
        ]

    def _score(self, text: str) -> JudgeResult:
        low, high = self.score_range
        try:
            value = self.parse(text)
        except Exception as exc:  # noqa: BLE001 - a failing parser is the judge's failure
            return JudgeResult(
                0.0,
                Outcome.ERROR,
                f"parse raised {type(exc).__name__}: {exc} on {_quote(text)}",
                raw=text,
            )
        if value is None:
            return JudgeResult(
                0.0, Outcome.ERROR, f"no score found in judge output {_quote(text)}", raw=text
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return JudgeResult(
                0.0,
                Outcome.ERROR,
                f"parse returned {value!r} (a "
                f"{type(value).__name__}), not a number, on {_quote(text)}",
                raw=text,
            )
        value = float(value)
        if not (math.isfinite(value) and low <= value <= high):
            return JudgeResult(
                0.0,
                Outcome.ERROR,
                f"score {value:g} outside score_range [{low:g}, {high:g}] in {_quote(text)}",
                raw=text,
            )
        fraction = (value - low) / (high - low)
        outcome = Outcome.OK if fraction >= self.ok_threshold else Outcome.WRONG
        return JudgeResult(
            fraction if self.normalize else value,
            outcome,
            f"judge score {value:g} of [{low:g}, {high:g}]",
            raw=text,
            raw_score=value,
        )

    def __repr__(self) -> str:
        return (
            f"LLMJudge(policy={self.policy!r}, score_range={self.score_range}, "
            f"normalize={self.normalize})"
        )


# --------------------------------------------------------------------------------------------
# Reward-model judge
# --------------------------------------------------------------------------------------------

NORMALIZE_MODES = (None, "sigmoid")


class RewardModelJudge:
    """Scores (question, completion) with a Bradley-Terry reward model.

    The sequence is rendered exactly as the reward model was trained on it
    (`posttrain.rewards.reward_model.render_pair`: the question as the user turn, the completion as
    the assistant turn) and the reward read at its last token.

    Args:
        reward_model: a `posttrain.rewards.reward_model.RewardModel`.
        tokenizer: the tokenizer it was trained with.
        normalize: None reports the raw reward r (any real number); "sigmoid" reports
            sigmoid(r) in (0, 1), the Bradley-Terry probability of beating a response with
            reward 0.
        ok_threshold: outcome ok when the reported score is >= this (a finite number); default
            0.0 for raw rewards and 0.5 for "sigmoid" (the same decision: r >= 0).
        batch_size: sequences per forward pass (an integer >= 1).

    Outcomes: ok / wrong by the threshold; error for an item without a question, a completion
    that is not a str, a sequence the chat template cannot render or longer than the model's
    `max_seq_len`, or a non-finite reward.

    Example:
        >>> from posttrain.rewards.reward_model import RewardModel
        >>> from posttrain.models import ByteTokenizer
        >>> judge = RewardModelJudge(RewardModel.from_spec("tiny-1m", seed=0), ByteTokenizer(),
        ...                          normalize="sigmoid")
        >>> [r] = judge.judge(["12"], [{"question": "5 + 7 ="}])
        >>> 0.0 < r.score < 1.0, r.outcome.value in ("ok", "wrong")
        (True, True)

    Raises:
        ValueError: for an unknown `normalize`, a bad `ok_threshold` or `batch_size`.
    """

    def __init__(
        self,
        reward_model,
        tokenizer,
        *,
        normalize: str | None = None,
        ok_threshold: float | None = None,
        batch_size: int = 32,
    ) -> None:
        if normalize not in NORMALIZE_MODES:
            raise ValueError(f"normalize={normalize!r}; allowed: {NORMALIZE_MODES}")
        check_int("batch_size", batch_size, minimum=1)
        self.reward_model, self.tokenizer, self.normalize = reward_model, tokenizer, normalize
        self.ok_threshold = (
            _check_real("ok_threshold", ok_threshold, "a finite number")
            if ok_threshold is not None
            else 0.5
            if normalize == "sigmoid"
            else 0.0
        )
        self.batch_size = batch_size

    @classmethod
    def from_pretrained(cls, folder, **options: Any) -> RewardModelJudge:
        """A judge from a folder written by `RewardModel.save` (weights, spec, tokenizer)."""
        from posttrain.rewards.reward_model import load_reward_model

        model, tokenizer = load_reward_model(folder)
        return cls(model, tokenizer, **options)

    def rewards(
        self, completions: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[float | str]:
        """Raw reward per completion, or the reason it could not be scored (a str)."""
        from posttrain.rewards.reward_model import render_pair

        _check_lengths(completions, items)
        out: list[float | str] = [""] * len(completions)
        rows, where = [], []
        limit = self.reward_model.spec.max_seq_len
        for i, (completion, item) in enumerate(zip(completions, items)):
            problem = _text_problem(completion, item)
            if problem is not None:
                out[i] = problem
                continue
            try:
                ids = render_pair(self.tokenizer, item["question"], completion)
            except ValueError as exc:  # BadRowError: the chat template refused it
                out[i] = f"cannot render the pair: {exc}"
                continue
            if len(ids) > limit:
                out[i] = f"question + completion is {len(ids)} tokens; max_seq_len is {limit}"
                continue
            rows.append(ids)
            where.append(i)
        for i, reward in zip(where, self.reward_model.score(rows, batch_size=self.batch_size)):
            out[i] = reward if math.isfinite(reward) else f"non-finite reward {reward}"
        return out

    def judge(
        self, completions: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[JudgeResult]:
        """One `JudgeResult` per completion (raw_score = the raw reward)."""
        results = []
        for reward in self.rewards(completions, items):
            if isinstance(reward, str):
                results.append(JudgeResult.failure(Outcome.ERROR, reward))
                continue
            score = _sigmoid(reward) if self.normalize == "sigmoid" else reward
            outcome = Outcome.OK if score >= self.ok_threshold else Outcome.WRONG
            results.append(JudgeResult(score, outcome, f"reward {reward:.4g}", raw_score=reward))
        return results

    def __repr__(self) -> str:
        return f"RewardModelJudge(normalize={self.normalize!r}, ok_threshold={self.ok_threshold})"


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
