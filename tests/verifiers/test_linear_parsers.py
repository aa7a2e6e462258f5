"""Linear tag parsers and the calculator's bounded tool: 25,000 tags parse in milliseconds of
CPU (a regex took ~21 s, quadratic), `tag_contents` equals the regular expression it replaced,
and the calculator refuses huge powers at once and evaluates a bounded number of calls a turn.
Timed in CPU seconds of this thread (`_waits.thread_cpu_s`), which a busy machine cannot
inflate."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from _waits import thread_cpu_s

from posttrain.envs.calculator_env import MAX_CALLS_PER_TURN, CalculatorEnv, evaluate_arithmetic
from posttrain.rewards.verifier import Outcome
from posttrain.verifiers.basic import FormatVerifier, extract_tag, tag_contents


@pytest.mark.parametrize(
    "text",
    [
        "<answer>" * 25_000,
        "<answer>x</answer>" * 25_000,
        "<answer>" * 25_000 + "</answer>",
        "</answer><answer>" * 25_000,
    ],
)
def test_25000_tags_are_parsed_in_linear_time(text):
    """The regex took ~21 s on 25,000 unclosed tags (quadratic); the scan takes milliseconds
    (CPU seconds: a bound 10x under the quadratic cost, that waiting for a core cannot break)."""
    _, cpu_s = thread_cpu_s(lambda: extract_tag(text, "answer"))
    assert cpu_s < 2.0, cpu_s
    result, cpu_s = thread_cpu_s(lambda: FormatVerifier()(text, {}))
    assert cpu_s < 2.0 and isinstance(result.outcome, Outcome)


def test_tag_contents_equals_the_regular_expression():
    """Reference: `re.findall` with the lazy pattern (the slower path), on random texts."""
    rng = np.random.default_rng(0)
    pieces = ["<a>", "</a>", "a", "<", ">", "/", " ", "<a", "a>", "</", "\n", "<b>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces, size=int(rng.integers(0, 14))))
        assert tag_contents(text, "a") == re.findall(r"<a>(.*?)</a>", text, re.DOTALL), text
    assert extract_tag("<a> 1 </a><a>2 ", "a") == "1"
    assert extract_tag("no tags", "a") is None


def test_the_calculator_refuses_huge_powers_at_once_and_bounds_a_turn():
    """Refusals and the worst 200-character expressions take milliseconds of CPU (the powers
    would never end); a turn evaluates at most MAX_CALLS_PER_TURN calls (counted)."""
    for expression in ["9**9**9**9", "2**10**100", "(10**10)**(10**10)"]:
        start = time.thread_time()
        with pytest.raises(ValueError, match="Pow is not allowed"):
            evaluate_arithmetic(expression)
        assert time.thread_time() - start < 0.5, expression
    worst = [
        "1/7" * 66 + "1",
        "(" * 99 + "1" + ")" * 99,
        "-" * 199 + "1",
        "(1/7-1/11)/(1/13+1/17)*" * 8 + "1",
    ]
    for expression in worst:
        _, cpu_s = thread_cpu_s(lambda e=expression: evaluate_arithmetic(e[:200]))
        assert cpu_s < 0.5, (expression, cpu_s)
    env = CalculatorEnv({"question": "?", "answer": "2"})
    result, cpu_s = thread_cpu_s(lambda: env.step("<calc>1+1</calc>" * 25_000))
    replies = result.observation[0]["content"].split("\n")
    assert cpu_s < 5.0 and len(replies) == MAX_CALLS_PER_TURN + 1
    assert replies[0] == "<result>2</result>"
    assert replies[-1] == (
        f"<result>error: {25_000 - MAX_CALLS_PER_TURN} more calls not "
        f"evaluated (at most {MAX_CALLS_PER_TURN} a turn)</result>"
    )
    assert env.calls == 25_000 and env.tool_errors == 25_000 - MAX_CALLS_PER_TURN
    _, cpu_s = thread_cpu_s(
        lambda: CalculatorEnv({"question": "?", "answer": "2"}).step("<calc>" * 25_000)
    )
    assert cpu_s < 2.0
