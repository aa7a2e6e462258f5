"""What a judge is: the `Judge` protocol, the `JudgeResult` it returns, a judge used as a
`Verifier` (`judge_as_verifier`), and the checks of what every judge is given.

A judge scores completions with a model instead of a rule (the judges that ship, an LLM reading
a rubric and a Bradley-Terry reward model, are in `posttrain.rewards.judges`; pairwise judges in
`posttrain.rewards.pairwise`; a judge server's client in `posttrain.rewards.judge_client`). Each
returns `JudgeResult`s, which are `VerifierResult`s (same `Outcome` vocabulary, same finite
score) carrying the judge's raw output as well:

    =============  ==================================================================
    outcome        for a judge
    =============  ==================================================================
    ok             scored, normalised score >= `ok_threshold`
    wrong          scored, normalised score below `ok_threshold` (`score` keeps it)
    timeout        the judge ran past its budget (`run_verifier`, the judge client)
    error          the judge failed: its text holds no parsable score or one outside
                   its range, it raised, the item has no question, the prompt is too
                   long, the judge server could not be reached
    =============  ==================================================================

A judge's own failure is never the policy's low reward: an unparsable judge output is `error`
(score 0.0, the judge's text in `raw` and, shortened, in `reason`), which RL excludes with its
whole group and counts (`posttrain.rl.trainer`), not `format_error`, which RL trains on as a
0.0 reward because there the *policy* gave no answer. Judges never return `format_error`.

RL: `judge_as_verifier(judge)` is a `Verifier` (`(completion, item) -> VerifierResult`), so a
judge runs under `run_verifier` / `score_batch` time budgets and inside the environments and
group builders of `posttrain.envs` (`ReasoningGymGroupBuilder(item, task, verifier=...)`);
`posttrain.envs.JudgedGroupBuilder` judges a whole group in one call instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from posttrain.rewards.verifier import VerifierResult

__all__ = ["JudgeResult", "Judge", "JudgeVerifier", "judge_as_verifier"]


@dataclass(frozen=True)
class JudgeResult(VerifierResult):
    """A `VerifierResult` with what the judge produced.

    Attributes (besides score, outcome, reason):
        raw: the judge's generated text (LLM judges); "" for reward models.
        raw_score: the score on the judge's own scale (the parsed "Score: N", or the reward
            model's unnormalised reward); None when there is none (failures).
    """

    raw: str = ""
    raw_score: float | None = None


@runtime_checkable
class Judge(Protocol):
    """Scores N completions against their task items, batched.

    `items[i]` is a mapping with at least `question` (task items of `posttrain.envs`; `answer`
    is the reference, which a judge may or may not show to its model). Return one
    `VerifierResult` (usually a `JudgeResult`) per completion, in order; per-completion failures
    are typed outcomes, not exceptions. Use `judge_as_verifier` to call it as a `Verifier`.
    """

    def judge(
        self, completions: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[VerifierResult]: ...


@dataclass(frozen=True)
class JudgeVerifier:
    """A `Verifier` that asks `judge` about one completion. Pickles when the judge does.

    `isolation = "thread"`: `run_verifier` calls it on a thread of this process (the judge holds
    a model in memory), not in a worker process.
    """

    judge: Judge
    isolation = "thread"  # a class attribute, not a field

    def __call__(self, completion: str, item: Mapping[str, Any]) -> VerifierResult:
        results = self.judge.judge([completion], [item])
        if len(results) != 1:
            raise ValueError(
                f"{type(self.judge).__name__}.judge returned {len(results)} results "
                "for 1 completion"
            )
        return results[0]


def judge_as_verifier(judge: Judge) -> JudgeVerifier:
    """`judge` as a `Verifier` `(completion, item) -> VerifierResult`, for `run_verifier`,
    `score_batch` (time budgets; a raising judge becomes outcome error) and the environments of
    `posttrain.envs`. Each call judges one completion (a batch of one); the default budget
    (`posttrain.rewards.verifier.DEFAULT_TIMEOUT_S`, 5 s) suits tiny judges: give a large LLM judge
    more (`RLTrainer(verifier_timeout_s=...)`), since a timeout excludes the whole group.

    Example (an LLM judge as the reward of a chain_sum group builder):
        >>> from posttrain.envs import ReasoningGymGroupBuilder
        >>> from posttrain.policy import Policy
        >>> from posttrain.rewards.judges import LLMJudge
        >>> judge = LLMJudge(Policy.from_spec("tiny-1m", seed=0), "Correct?", max_new_tokens=4)
        >>> builder = ReasoningGymGroupBuilder({"question": "1 + 2 =", "answer": "3"},
        ...                                    "chain_sum", verifier=judge_as_verifier(judge))
        >>> builder.make_envs(1)[0].step("3").verifier_result.outcome.value  # untrained judge
        'error'
    """
    if not callable(getattr(judge, "judge", None)):
        raise TypeError(
            f"judge must have a judge(completions, items) method; got {type(judge).__name__}"
        )
    return JudgeVerifier(judge)


# --------------------------------------------------------------------------------------------
# What every judge is given
# --------------------------------------------------------------------------------------------


def _check_lengths(completions: Sequence[str], items: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(completions, str):
        raise ValueError("completions must be a list of str; wrap a single completion as [text]")
    if len(completions) != len(items):
        raise ValueError(
            f"need one item per completion, got {len(completions)} completions and "
            f"{len(items)} items"
        )


def _text_problem(completion: Any, item: Any) -> str | None:
    """Why (completion, item) cannot be judged: a non-str completion or question; else None."""
    if not isinstance(completion, str):
        return f"completion is a {type(completion).__name__}; expected a str"
    question = item.get("question") if isinstance(item, Mapping) else None
    if not isinstance(question, str):
        return f"item has no string 'question' (got {type(question).__name__})"
    return None
