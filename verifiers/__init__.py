"""Reward checkers, all satisfying `posttrain.rewards.verifier.Verifier` and registered by name.

Importing this package registers the verifiers below; `get_verifier` / `registered_verifiers`
here are the registry's lookups with them loaded.

    ==============  ============================  =============================================
    name            class                         checks
    ==============  ============================  =============================================
    math_answer     MathAnswerVerifier            final answer (\\boxed{}, "answer is", a bare
                                                  answer) equivalent by math-verify
    reasoning_gym   ReasoningGymVerifier          a reasoning-gym task's own score_answer
    exact_match     ExactMatchVerifier            text equality, whitespace-normalised
    regex           RegexVerifier                 a regular expression matches
    format          FormatVerifier                <answer>...</answer> present (+ inner check)
    code_tests      CodeTestsVerifier             a program's unit tests pass in the sandbox
    humaneval       humaneval_verifier            a HumanEval problem's tests (`check`) pass
    ==============  ============================  =============================================

Also here: the code sandbox (`Sandbox`, `SandboxLimits`, `sandbox_available`; see
docs/runbooks/sandbox.md), HumanEval problems and the unbiased pass@k estimator
(`humaneval_problems`, `pass_at_k`, `evaluate_pass_at_k`), and the check of reasoning-gym gold
answers that every task build runs (`check_gold`, `GoldReport`, `register_gold_check`).

Example:
    >>> from posttrain.verifiers import get_verifier
    >>> get_verifier("exact_match", case_sensitive=False)("YES", {"answer": "yes"}).ok
    True
"""

from posttrain.rewards.verifier import get_verifier, register_verifier, registered_verifiers
from posttrain.verifiers.basic import (
    ExactMatchVerifier,
    FormatVerifier,
    RegexVerifier,
    extract_tag,
    normalize_whitespace,
)
from posttrain.verifiers.code_exec import CodeTestsVerifier, extract_code
from posttrain.verifiers.humaneval import (
    evaluate_pass_at_k,
    humaneval_problems,
    humaneval_verifier,
    pass_at_k,
)
from posttrain.verifiers.math_answer import MathAnswerVerifier, extract_answer
from posttrain.verifiers.reasoning_gym import ReasoningGymVerifier
from posttrain.verifiers.reasoning_gym_gold import (
    GOLD_CHECKS,
    GoldReport,
    check_gold,
    gold_problem,
    register_gold_check,
)
from posttrain.verifiers.sandbox import (
    ExecOutcome,
    ExecutionResult,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    sandbox_available,
)

__all__ = [
    "ExactMatchVerifier",
    "FormatVerifier",
    "MathAnswerVerifier",
    "ReasoningGymVerifier",
    "RegexVerifier",
    "extract_answer",
    "extract_tag",
    "normalize_whitespace",
    "ExecOutcome",
    "ExecutionResult",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
    "sandbox_available",
    "CodeTestsVerifier",
    "extract_code",
    "evaluate_pass_at_k",
    "humaneval_problems",
    "humaneval_verifier",
    "pass_at_k",
    "GOLD_CHECKS",
    "GoldReport",
    "check_gold",
    "gold_problem",
    "register_gold_check",
    "get_verifier",
    "register_verifier",
    "registered_verifiers",
]
