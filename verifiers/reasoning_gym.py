"""Adapter from a reasoning-gym task's own scorer to the `Verifier` protocol.

reasoning-gym (https://github.com/open-thought/reasoning-gym) scores an answer with
`dataset.score_answer(answer, entry) -> float in [0, 1]`. The adapter extracts the answer from
the completion, calls that scorer and types the result: 1.0 -> ok; anything lower -> wrong with
that score (countdown gives partial credit 0.05 / 0.01, kept as is); an extraction that finds
nothing -> format_error; a scorer that raises -> error (through `run_verifier`).

Answer extraction (`extract=`):
    "whole"          the whole completion, whitespace stripped (default; what a model trained
                     on the task's bare answers writes);
    "answer_prefix"  the text after the last "answer:" (case-insensitive), else the whole
                     completion;
    "answer_tag"     the content of the last <answer>...</answer>; missing -> format_error;
    a callable       `(completion) -> str | None`; None -> format_error.

Scorer fixes (`SCORE_FIXES`): where a task's own scorer misses its own rule, the adapter scores
with the rule as the scorer's code states it. `spell_backward` deducts 0.2 from an answer with
every letter in place that is longer than the word, testing `reward == 1.0` after summing
`1 / len(word)` per letter; for 6 letters that sum is 0.9999999999999999 (7: ...98), so the
deduction never applies and "the word plus anything" scores 1.0 in all but the last bit: GRPO
learns to write the word and never stop (docs/benchmarks/task_split.md). The fix applies the
deduction there and keeps every other score as the task gives it.

The scorer's dataset is built once per process and configuration, when the verifier is made or
unpickled (outside any verifier time budget: importing reasoning-gym takes seconds), and is
not pickled: the verifier travels as a name and a config.

Example:
    >>> from posttrain.verifiers.reasoning_gym import ReasoningGymVerifier
    >>> verify = ReasoningGymVerifier("chain_sum")
    >>> item = {"question": "4 - 1 =", "answer": "3", "metadata": {}}
    >>> verify(" 3\\n", item).ok, verify("4", item).outcome.value
    (True, 'wrong')
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.rewards.verifier import Outcome, VerifierResult, register_verifier
from posttrain.verifiers.basic import extract_tag

EXTRACT_MODES = ("whole", "answer_prefix", "answer_tag")

_DATASETS: dict[tuple[str, str], Any] = {}
_DATASETS_LOCK = threading.Lock()


def reasoning_gym_names() -> list[str]:
    """Names of the reasoning-gym tasks (`reasoning_gym.create_dataset` accepts these)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task_name(name: str) -> None:
    """Raises ValueError, listing the valid names, when `name` is not a reasoning-gym task."""
    names = reasoning_gym_names()
    if name not in names:
        raise ValueError(f"unknown reasoning-gym task {name!r}; valid names: {', '.join(names)}")


def check_task_config(name: str, config: Mapping[str, Any]) -> None:
    """Raises ValueError, listing the valid options, when reasoning-gym rejects `config`."""
    from reasoning_gym.factory import DATASETS

    config_class = DATASETS[name][1]
    valid = [f.name for f in dataclasses.fields(config_class) if f.name not in ("size", "seed")]
    unknown = sorted(set(config) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for reasoning-gym task {name!r}; valid "
            f"options: {', '.join(valid)}"
        )
    try:
        built = config_class(**config)
        if callable(getattr(built, "validate", None)):
            built.validate()
    except (AssertionError, ValueError, TypeError) as exc:  # reasoning-gym validates by assert
        raise ValueError(f"invalid options for reasoning-gym task {name!r}: {exc}") from None


def scoring_dataset(name: str, config: Mapping[str, Any]) -> Any:
    """A reasoning-gym dataset object for `name` and `config`, built once per process, used only
    for its `score_answer` (size 1; `size` and `seed` in `config` are ignored)."""
    config = {k: v for k, v in config.items() if k not in ("size", "seed")}
    key = (name, json.dumps(config, sort_keys=True, default=repr))
    with _DATASETS_LOCK:
        if key not in _DATASETS:
            import reasoning_gym

            _DATASETS[key] = reasoning_gym.create_dataset(name, size=1, seed=0, **config)
        return _DATASETS[key]


def _spell_backward_score(score: float, answer: str, entry: Mapping[str, Any]) -> float:
    """reasoning-gym's `SpellBackwardDataset.score_answer` (0.1.x) `score` for `answer`, with
    its deduction applied where its sum missed it: an answer with every letter of the word in
    place that is longer than the word scores 1.0 - 0.2, as the scorer's code states (every
    other score is the task's own, to the last bit)."""
    expected, got = str(entry["answer"]).lower(), answer.lower()
    if len(got) > len(expected) and got.startswith(expected):
        return 1.0 - 0.2
    return score


SCORE_FIXES: dict[str, Callable[[float, str, Mapping[str, Any]], float]] = {
    "spell_backward": _spell_backward_score,
}
"""Task name -> `(score, answer, entry) -> score`: the task scorer's `score` corrected where its
arithmetic misses its own rule (see the module docstring)."""


def task_score(dataset: Any, answer: str, entry: Mapping[str, Any]) -> float:
    """`dataset.score_answer(answer, entry)` with its task's `SCORE_FIXES` applied where
    `dataset` is a registered reasoning-gym dataset (any other scorer's score as it is): the
    score the verifier rewards and the held-out evaluations report."""
    score = float(dataset.score_answer(answer, entry))
    try:
        fix = SCORE_FIXES.get(_name_of(dataset))
    except ValueError:  # a scorer of its own, not a registered reasoning-gym dataset
        return score
    return score if fix is None else fix(score, answer, entry)


def _extract(completion: str, extract: str | Callable[[str], str | None]) -> str | None:
    if callable(extract):
        return extract(completion)
    if extract == "whole":
        return completion.strip()
    if extract == "answer_prefix":
        parts = re.split(r"answer\s*:", completion, flags=re.IGNORECASE)
        return parts[-1].strip()
    return extract_tag(completion, "answer")


@register_verifier("reasoning_gym")
class ReasoningGymVerifier:
    """Scores completions with a reasoning-gym task's own `score_answer`.

    Args:
        dataset_or_name: a task name ("chain_sum", "countdown", ...) or a reasoning-gym dataset
            object (its class and config are used; the object itself is not kept).
        extract: how to find the answer in the completion (see the module docstring).
        config: the task's options when a name is given (some scorers read them), e.g.
            `min_terms=2`.

    Raises:
        ValueError: for an unknown task name, an unknown or invalid task option, or an unknown
            extract mode.
    """

    def __init__(
        self,
        dataset_or_name: Any,
        *,
        extract: str | Callable[[str], str | None] = "whole",
        **config: Any,
    ) -> None:
        if isinstance(dataset_or_name, str):
            check_task_name(dataset_or_name)
            check_task_config(dataset_or_name, config)
            self.name, self.config = dataset_or_name, dict(config)
        else:
            if config:
                raise ValueError(
                    "pass task options only with a task name; a dataset object "
                    "already has its config"
                )
            self.name, self.config = _name_of(dataset_or_name), _config_of(dataset_or_name)
        if not callable(extract) and extract not in EXTRACT_MODES:
            raise ValueError(
                f"extract must be one of {EXTRACT_MODES} or a callable, got {extract!r}"
            )
        self.extract = extract
        scoring_dataset(self.name, self.config)  # import and build now, not inside a budget

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        scoring_dataset(self.name, self.config)

    def __call__(self, completion: str, item: Mapping[str, Any]) -> VerifierResult:
        answer = _extract(completion or "", self.extract)
        if answer is None:
            return VerifierResult.failure(
                Outcome.FORMAT_ERROR, f"no answer found (extract={self.extract!r})"
            )
        entry = item if isinstance(item, dict) else dict(item)
        score = task_score(scoring_dataset(self.name, self.config), answer, entry)
        result = VerifierResult.from_score(float(score))
        if result.ok:
            return result
        return VerifierResult(
            result.score,
            Outcome.WRONG,
            f"{self.name} scored {result.score:g} for {answer!r:.60} "
            f"(reference {str(item.get('answer'))!r:.60})",
        )

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.config.items())
        return f"ReasoningGymVerifier({self.name!r}, extract={self.extract!r}{options})"


def _name_of(dataset: Any) -> str:
    from reasoning_gym.factory import DATASETS

    for name, registered in DATASETS.items():
        dataset_class = registered[0] if isinstance(registered, tuple) else registered
        if type(dataset) is dataset_class:
            return name
    raise ValueError(
        f"{type(dataset).__name__} is not a registered reasoning-gym dataset; "
        "pass its task name instead"
    )


def _config_of(dataset: Any) -> dict[str, Any]:
    config = getattr(dataset, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return {}
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in ("size", "seed")
    }
