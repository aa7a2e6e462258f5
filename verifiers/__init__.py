"""Reward checkers, all satisfying `posttrain.rewards.verifier.Verifier` and registered by name.

    ==============  ============================  =============================================
    name            class                         checks
    ==============  ============================  =============================================
    math_answer     MathAnswerVerifier            final answer (\\boxed{}, "answer is", last
                                                  number) equal by exact rational value
    reasoning_gym   ReasoningGymVerifier          a reasoning-gym task's own score_answer
    exact_match     ExactMatchVerifier            text equality, whitespace-normalised
    regex           RegexVerifier                 a regular expression matches
    format          FormatVerifier                <answer>...</answer> present (+ inner check)
    ==============  ============================  =============================================

Example:
    >>> from posttrain.rewards import get_verifier
    >>> get_verifier("exact_match", case_sensitive=False)("YES", {"answer": "yes"}).ok
    True
"""

from posttrain.verifiers.basic import (ExactMatchVerifier, FormatVerifier, RegexVerifier,
                                       extract_tag, normalize_whitespace)
from posttrain.verifiers.math_answer import (MathAnswerVerifier, extract_answer, normalize_answer,
                                             parse_number)
from posttrain.verifiers.reasoning_gym import ReasoningGymVerifier

__all__ = [
    "ExactMatchVerifier", "FormatVerifier", "MathAnswerVerifier", "ReasoningGymVerifier",
    "RegexVerifier", "extract_answer", "extract_tag", "normalize_answer", "normalize_whitespace",
    "parse_number",
]
