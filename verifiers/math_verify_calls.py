"""math-verify as `MathAnswerVerifier` calls it: loaded with fixes, configs by name, calls timed.

`posttrain.verifiers.math_answer` decides where an answer is taken from and what the outcome is;
this module is the one place that talks to math-verify (https://github.com/huggingface/Math-Verify):

- `load_math_verify` imports it on first use (~1 s), mutes its "Timeout is disabled" notice,
  makes LaTeX percentages parseable (`_percent_fix`) and installs posttrain's number and case
  rules (verifiers/math_rules.py).
- `extraction_configs` turns the names of `TARGETS` (or math-verify config objects) into the
  extraction configs `math_verify.parse` takes.
- `parse`, `parse_reference` (cached: a GRPO group shares one reference) and `verify_pair` call
  `math_verify.parse` / `math_verify.verify` with their errors raised and posttrain's rules
  applied; math-verify's own timeout (`signal.alarm`, whole seconds, main thread only: off any
  other thread it is switched off, see `alarm_seconds`) becomes `MathVerifyTimeout`, so that a
  timeout, an error and "not equal" are told apart.

Example:
    >>> from posttrain.verifiers.math_verify_calls import extraction_configs, parse, verify_pair
    >>> configs = extraction_configs(["latex", "expr"])
    >>> gold, pred = parse("$3/4$", configs, 2, True), parse("0.75", configs, 2, True)
    >>> verify_pair(gold[0], pred[0], float_rounding=6, strict=True,
    ...             allow_set_relation_comp=False, timeout_s=2)
    True
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from posttrain.verifiers import math_rules
from posttrain.verifiers.math_statements import as_math_text

MAX_MATH_VERIFY_TIMEOUT_S = 86_400
"""The largest `math_verify_timeout_s` (one day): `signal.alarm` takes a C unsigned int."""

TARGETS = ("latex", "expr")
"""Named math-verify extraction configs: "latex" is `LatexExtractionConfig(boxed_match_priority=0)`
(as in Math-Verify's tests and TRL), "expr" is `ExprExtractionConfig()`."""


def load_math_verify():
    """math_verify, imported on first use (~1 s), with its "timeout is disabled" notice muted
    (off the main thread this verifier disables math-verify's timeout on purpose) and LaTeX
    percentages made parseable (`_percent_fix`); posttrain's number and case rules installed
    (`math_rules`)."""
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _mute_disabled_timeout not in logger.filters:
            logger.addFilter(_mute_disabled_timeout)
    _percent_fix()
    math_rules.install()
    return math_verify


def _percent_fix() -> None:
    """latex2sympy2_extended 1.11.0 asks every LaTeX atom for `FUNC_GAMMA()` before
    `PERCENT_NUMBER()`, but the parser it generated for the antlr4 4.9.3 runtime (the version
    omegaconf/hydra pin) has no such alternative in `AtomContext`: every percentage (`50\\%`)
    raised AttributeError and parsed to nothing. The missing accessor answers None, as generated
    accessors do for an absent token. With it math-verify 0.9.0 passes all 283 of its tests."""
    from latex2sympy2_extended.antlr_parser import PSParser

    if not hasattr(PSParser.AtomContext, "FUNC_GAMMA"):
        PSParser.AtomContext.FUNC_GAMMA = lambda self: None


def _mute_disabled_timeout(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Timeout is disabled")


def extraction_configs(targets: Sequence[Any]) -> tuple[Any, ...]:
    """The math-verify extraction configs of `targets`: names from `TARGETS` or
    `math_verify.LatexExtractionConfig` / `ExprExtractionConfig` objects (one, or a sequence).

    Raises:
        ValueError: for anything else (None included), or for an empty sequence.
    """
    mv = load_math_verify()
    named = {
        "latex": mv.LatexExtractionConfig(boxed_match_priority=0),
        "expr": mv.ExprExtractionConfig(),
    }
    configs = []
    one = isinstance(targets, str) or not isinstance(targets, Sequence)  # None: error below
    for target in (targets,) if one else targets:
        if isinstance(target, str) and target in named:
            configs.append(named[target])
        elif isinstance(target, (mv.LatexExtractionConfig, mv.ExprExtractionConfig)):
            configs.append(target)
        else:
            raise ValueError(
                f"targets must hold {TARGETS} or math_verify LatexExtractionConfig / "
                f"ExprExtractionConfig objects, got {target!r}"
            )
    if not configs:
        raise ValueError(f"targets must name at least one of {TARGETS}")
    return tuple(configs)


class MathVerifyTimeout(Exception):
    """math-verify's own timeout fired."""


def alarm_seconds(timeout_s: int | None) -> int | None:
    """math-verify's timeout where signals work (the main thread), else None (switched off)."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def parse(text: str, configs: tuple, timeout_s: int | None, case_sensitive: bool) -> list:
    """`math_verify.parse` with its errors raised (symbols keep their case if `case_sensitive`);
    its TimeoutException becomes `MathVerifyTimeout`."""
    mv = load_math_verify()
    from math_verify.errors import TimeoutException

    try:
        with math_rules.applied(case_sensitive=case_sensitive):
            return mv.parse(
                text, configs, parsing_timeout=alarm_seconds(timeout_s), raise_on_error=True
            )
    except TimeoutException:
        raise MathVerifyTimeout(f"math-verify parsing ran past {timeout_s} s") from None


@lru_cache(maxsize=1024)
def parse_reference(
    text: str, configs: tuple, timeout_s: int | None, case_sensitive: bool
) -> tuple:
    """The parsed reference, cached: a GRPO group shares one reference (errors are not cached)."""
    return tuple(parse(as_math_text(text), configs, timeout_s, case_sensitive))


def verify_pair(
    gold: Any,
    pred: Any,
    *,
    float_rounding: int,
    strict: bool,
    allow_set_relation_comp: bool,
    timeout_s: int | None,
) -> bool:
    """`math_verify.verify` on one (reference, answer) pair of parsed values, with its errors
    raised and posttrain's rules applied (variables keep their case if `strict`); its
    TimeoutException becomes `MathVerifyTimeout`."""
    mv = load_math_verify()
    from math_verify.errors import TimeoutException

    try:
        with math_rules.applied(case_sensitive=strict):
            return mv.verify(
                gold,
                pred,
                float_rounding=float_rounding,
                strict=strict,
                allow_set_relation_comp=allow_set_relation_comp,
                timeout_seconds=alarm_seconds(timeout_s),
                raise_on_error=True,
            )
    except TimeoutException:
        raise MathVerifyTimeout(f"math-verify comparison ran past {timeout_s} s") from None
