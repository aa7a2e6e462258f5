"""Reward checkers, all satisfying `posttrain.rewards.verifier.Verifier` and registered by name.

Importing this package registers the verifiers below; `get_verifier` / `registered_verifiers`
here are the registry's lookups with them loaded.

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
    >>> from posttrain.verifiers import get_verifier
    >>> get_verifier("exact_match", case_sensitive=False)("YES", {"answer": "yes"}).ok
    True
"""

from posttrain.verifiers.basic import (ExactMatchVerifier, FormatVerifier, RegexVerifier,
                                       extract_tag, normalize_whitespace)
from posttrain.verifiers.math_answer import (MathAnswerVerifier, extract_answer, normalize_answer,
                                             parse_number)
from posttrain.verifiers.reasoning_gym import ReasoningGymVerifier
from posttrain.rewards.verifier import get_verifier, register_verifier, registered_verifiers

__all__ = [
    "ExactMatchVerifier", "FormatVerifier", "MathAnswerVerifier", "ReasoningGymVerifier",
    "RegexVerifier", "extract_answer", "extract_tag", "normalize_answer", "normalize_whitespace",
    "parse_number", "get_verifier", "register_verifier", "registered_verifiers",
]
