"""A tiny multi-turn tool-use environment: a calculator the policy calls with tags.

Protocol of one episode (at most `max_turns` assistant turns):

    user:       the question (after a system turn describing the tool)
    assistant:  ... <calc>12*7</calc> ...
    tool:       <result>84</result>
    assistant:  <answer>84</answer>            -> done, scored by MathAnswerVerifier

- Every `<calc>...</calc>` of a turn is evaluated, in order, up to `MAX_CALLS_PER_TURN`; the
  tool turn holds one `<result>...</result>` per call (`<result>error: ...</result>` for a
  rejected expression) and one error result counting the calls past the limit, if any.
- `<answer>...</answer>` ends the episode; its content is verified against `item["answer"]`.
- A turn with neither tag gets a tool message saying how to use the tags.
- No answer after `max_turns` turns ends the episode with outcome format_error and reward 0.

Expressions are evaluated by `evaluate_arithmetic`, which walks the parsed syntax tree and allows
only integer literals, + - * /, unary minus/plus and parentheses; nothing is ever passed to
`eval`. Division is exact (a fraction such as 7/2 is written as "7/2").

Time is bounded by rule, not by a clock: no powers (`9**9**9**9` is refused before anything is
computed), at most `MAX_EXPRESSION_CHARS` characters and every intermediate value within
+-`MAX_ABS_VALUE`, so one evaluation takes under a millisecond; tags are found in linear time
(`posttrain.verifiers.basic.tag_contents`); at most `MAX_CALLS_PER_TURN` evaluations a turn.
The answer is verified through `run_verifier` with the environment's `timeout_s`.

Example (a scripted policy):
    >>> from posttrain.rl import run_text_episode
    >>> from posttrain.envs.calculator_env import CalculatorEnv
    >>> env = CalculatorEnv({"question": "What is 12 * 7 - 5?", "answer": "79"})
    >>> turns = iter(["<calc>12*7</calc>", "<calc>84 - 5</calc>", "<answer>79</answer>"])
    >>> episode = run_text_episode(env, lambda messages: next(turns))
    >>> [m["content"] for m in episode.messages if m["role"] == "tool"]
    ['<result>84</result>', '<result>79</result>']
    >>> episode.reward, episode.outcome, episode.num_turns
    (1.0, 'ok', 3)
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from posttrain.envs.reasoning_gym_env import prompt_messages
from posttrain.rewards.verifier import (
    DEFAULT_TIMEOUT_S,
    Outcome,
    Verifier,
    VerifierResult,
    run_verifier,
)
from posttrain.rewards.verifier_threads import check_timeout
from posttrain.rl.environment import Messages, StepResult, register_task
from posttrain.verifiers.basic import extract_tag, tag_contents
from posttrain.verifiers.math_answer import MathAnswerVerifier

CALCULATOR_SYSTEM_PROMPT = (
    "You can use a calculator. Write <calc>expression</calc> (integers, + - * / and "
    "parentheses) and you will get <result>value</result> back. When you know the answer, "
    "write <answer>value</answer>."
)

MAX_EXPRESSION_CHARS = 200
MAX_ABS_VALUE = 10**30
MAX_CALLS_PER_TURN = 64
"""Calculator calls evaluated in one assistant turn; the rest get one error result."""

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate_arithmetic(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, never executing anything.

    Allowed: integer literals, binary + - * /, unary - +, parentheses. At most
    `MAX_EXPRESSION_CHARS` characters; every intermediate value within +-`MAX_ABS_VALUE`.

    Raises:
        ValueError: for anything else (names, calls, attributes, floats, powers, ...), division
            by zero, or a value out of range; the message says what was rejected.

    Example:
        >>> evaluate_arithmetic("(1 + 2) * -3 / 4")
        Fraction(-9, 4)
        >>> evaluate_arithmetic("__import__('os')")
        Traceback (most recent call last):
        ...
        ValueError: Call is not allowed: only integers, + - * / and parentheses
    """
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError("not an arithmetic expression") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand)
        value = -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
    else:
        what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__
        if isinstance(node, ast.Constant):
            what = f"{type(node.value).__name__} literal"
        raise ValueError(f"{what} is not allowed: only integers, + - * / and parentheses")
    if abs(value) > MAX_ABS_VALUE:
        raise ValueError(f"value out of range (|x| > 1e{len(str(MAX_ABS_VALUE)) - 1})")
    return value


def calculator_result(expression: str) -> str:
    """The tool's reply to one call: `<result>84</result>` or `<result>error: ...</result>`."""
    try:
        value = evaluate_arithmetic(expression)
    except ValueError as exc:
        return f"<result>error: {exc}</result>"
    return f"<result>{value}</result>"


class CalculatorEnv:
    """One multi-turn calculator episode on one item (see the module docstring).

    Args:
        item: a task item with `question` and `answer`.
        max_turns: assistant turns before the episode ends without an answer (>= 1).
        verifier: checks the `<answer>` content against the item; `MathAnswerVerifier()` when
            None.
        system_prompt: the system turn describing the tool (None: no system turn).
        timeout_s: the verifier's time budget.

    `StepResult.info` holds `turn`, `calls` (calculator calls so far) and `tool_errors`.
    """

    def __init__(
        self,
        item: Mapping[str, Any],
        *,
        max_turns: int = 4,
        verifier: Verifier | None = None,
        system_prompt: str | None = CALCULATOR_SYSTEM_PROMPT,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not (isinstance(max_turns, int) and max_turns >= 1):
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.item = item
        self.max_turns = max_turns
        self.verifier = MathAnswerVerifier() if verifier is None else verifier
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.turn = 0
        self.calls = 0
        self.tool_errors = 0
        self.done = False

    def initial_messages(self) -> Messages:
        return prompt_messages(self.item["question"], self.system_prompt)

    def _info(self) -> dict:
        return {"turn": self.turn, "calls": self.calls, "tool_errors": self.tool_errors}

    def step(self, assistant_text: str) -> StepResult:
        if self.done:
            raise RuntimeError(
                "this episode is over; environments are single-use (make new ones "
                "with the group builder)"
            )
        self.turn += 1
        answer = extract_tag(assistant_text, "answer")
        if answer is not None:
            self.done = True
            result = run_verifier(self.verifier, answer, self.item, timeout_s=self.timeout_s)
            return StepResult(
                done=True, reward=result.score, verifier_result=result, info=self._info()
            )
        replies = []
        expressions = tag_contents(assistant_text, "calc")
        for expression in expressions[:MAX_CALLS_PER_TURN]:
            reply = calculator_result(expression)
            self.calls += 1
            self.tool_errors += reply.startswith("<result>error")
            replies.append(reply)
        skipped = len(expressions) - MAX_CALLS_PER_TURN
        if skipped > 0:
            self.calls += skipped
            self.tool_errors += skipped
            replies.append(
                f"<result>error: {skipped} more calls not evaluated (at most "
                f"{MAX_CALLS_PER_TURN} a turn)</result>"
            )
        if self.turn >= self.max_turns:
            self.done = True
            result = VerifierResult.failure(
                Outcome.FORMAT_ERROR, f"no <answer> after {self.max_turns} turns"
            )
            return StepResult(done=True, reward=0.0, verifier_result=result, info=self._info())
        if not replies:
            replies = [
                "<result>error: write <calc>expression</calc> to calculate or "
                "<answer>value</answer> to answer</result>"
            ]
        return StepResult(
            done=False,
            observation=[{"role": "tool", "content": "\n".join(replies)}],
            info=self._info(),
        )


@dataclass(frozen=True)
class CalculatorGroupBuilder:
    """The calculator environments of one item (one GRPO group). Pickles.

    Args:
        item: the task item (question/answer).
        max_turns, system_prompt, timeout_s: passed to each `CalculatorEnv`.
    """

    item: dict
    max_turns: int = 4
    system_prompt: str | None = CALCULATOR_SYSTEM_PROMPT
    timeout_s: float | None = DEFAULT_TIMEOUT_S

    def make_envs(self, group_size: int) -> list[CalculatorEnv]:
        if not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        return [
            CalculatorEnv(
                self.item,
                max_turns=self.max_turns,
                system_prompt=self.system_prompt,
                timeout_s=self.timeout_s,
            )
            for _ in range(group_size)
        ]


@register_task("calculator")
def calculator_task(
    *,
    max_turns: int = 4,
    system_prompt: str | None = CALCULATOR_SYSTEM_PROMPT,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    **overrides: Any,
):
    """The chain_sum preset (`chain_sum_task(**overrides)`) played with the calculator tool.

    `max_turns`, `system_prompt` and `timeout_s` are the `CalculatorGroupBuilder`'s, checked here
    (not at `make_envs`); `timeout_s` is also the task's (`score_fn`). Other `overrides` are
    chain_sum's (`size=`, `held_out_size=`, ...); `builder=` and `extract=` are refused (the
    builder is the calculator's, and the `<answer>` content is what is verified).

    Raises:
        ValueError / TypeError: for a bad or unknown option, naming it.

    Example:
        >>> task = calculator_task(size=20, held_out_size=4, max_turns=2)
        >>> env, = task.builders(0, 1)[0].make_envs(1)
        >>> env.max_turns
        2
    """
    from posttrain.envs.reasoning_gym_env import chain_sum_task

    for name in ("builder", "extract"):
        if name in overrides:
            raise ValueError(
                f"calculator does not take {name}= (its builder is "
                "CalculatorGroupBuilder, which verifies the <answer> content); its "
                "own options: max_turns, system_prompt, timeout_s"
            )
    options: dict[str, Any] = {
        "max_turns": max_turns,
        "system_prompt": system_prompt,
        "timeout_s": timeout_s,
    }
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise TypeError(
            f"calculator system_prompt must be a str or None, got {type(system_prompt).__name__}"
        )
    CalculatorEnv({}, **options)  # checks max_turns now
    check_timeout(timeout_s)
    return chain_sum_task(
        builder=functools.partial(CalculatorGroupBuilder, **options),
        timeout_s=timeout_s,
        **overrides,
    )
