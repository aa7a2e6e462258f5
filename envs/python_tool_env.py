"""A multi-turn Python-tool environment: the policy runs code in the sandbox, then answers.

Protocol of one episode (at most `max_turns` assistant turns):

    system:     how to use the tool (`PYTHON_TOOL_SYSTEM_PROMPT`)
    user:       the question
    assistant:  ... <python>print(12 * 7)</python> ...
    tool:       <output>84</output>
    assistant:  <answer>84</answer>            -> done, scored by the verifier (MathAnswerVerifier)

- Every `<python>...</python>` of a turn (up to `max_calls_per_turn`) runs as a fresh Python 3
  program in the sandbox (`posttrain.verifiers.sandbox`: no network, read-only filesystem,
  CPU / memory / wall-clock limits); nothing carries over between calls. The tool turn holds
  one `<output>...</output>` per call: stdout, then stderr (a traceback); a call stopped by a
  limit says which (`<output>error: timed out ...</output>`).
- Tool output is cut to `max_output_chars` characters (the sandbox also cuts at its
  `output_bytes`); a cut output ends with `[... N more characters cut]`. Every cut is counted.
- `<answer>...</answer>` outside every `<python>...</python>` block ends the episode (the last
  such answer); its content is verified against `item["answer"]`. An answer inside a code block
  is code (`print('<answer>79</answer>')`): it is not an answer. The code blocks of a turn that
  answers are not run (their output could never be read) and count as `extra_calls_dropped`.
  Blocks pair as in `posttrain.verifiers.basic.tag_contents`; an unclosed `<python>` is text.
- A program holding a NUL byte is not run; its tool output says so (a tool error).
- A turn with neither tag gets a tool message saying how to use the tags.
- No answer after `max_turns` turns: outcome format_error, reward 0.
- The sandbox itself failing ends the episode with outcome error (the checker failed, not the
  policy: RL excludes the group and counts it).

Counts, in every `StepResult.info["counts"]` (so in each rollout trajectory's `Trajectory.info`;
the RL trainer logs their sums per step as `env_calls`, `env_chars_cut`, ...; `tool_counts(groups)`
sums them over a batch), next to `info["turn"]`: `calls`, `tool_errors` (non-zero exit, limit
hit, a NUL byte), `tool_timeouts`, `outputs_cut` (outputs cut by either limit), `chars_cut`
(characters dropped by `max_output_chars`), `extra_calls_dropped` (calls past
`max_calls_per_turn`, or in the turn that answers: not run).

In an RL rollout the tool turns are context, not policy output: `posttrain.rl.rollout` appends
their tokens with `completion_mask` False and log-probability 0.0, so they are not trained on.

Example (a scripted policy; needs a sandbox):
    >>> from posttrain.rl import run_text_episode
    >>> from posttrain.envs.python_tool_env import PythonToolEnv
    >>> env = PythonToolEnv({"question": "What is 12 * 7 - 5?", "answer": "79"})
    >>> turns = iter(["<python>print(12 * 7 - 5)</python>", "<answer>79</answer>"])
    >>> episode = run_text_episode(env, lambda messages: next(turns))
    >>> episode.messages[-2]
    {'role': 'tool', 'content': '<output>79</output>'}
    >>> episode.reward, episode.outcome, episode.num_turns, episode.final.info["counts"]["calls"]
    (1.0, 'ok', 2, 1)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.envs.reasoning_gym_env import prompt_messages
from posttrain.rewards.verifier import (
    DEFAULT_TIMEOUT_S,
    Outcome,
    Verifier,
    VerifierResult,
    run_verifier,
)
from posttrain.rl.environment import Messages, StepResult, register_task
from posttrain.verifiers.basic import extract_tag, tag_contents
from posttrain.verifiers.math_answer import MathAnswerVerifier
from posttrain.verifiers.sandbox import ExecOutcome, ExecutionResult, Sandbox, SandboxLimits

__all__ = [
    "MAX_TOOL_OUTPUT_CHARS",
    "PYTHON_TOOL_SYSTEM_PROMPT",
    "TOOL_COUNTS",
    "TOOL_LIMITS",
    "PythonToolEnv",
    "PythonToolGroupBuilder",
    "format_tool_output",
    "python_tool_task",
    "tool_counts",
]

PYTHON_TOOL_SYSTEM_PROMPT = (
    "You can run Python. Write <python>code</python>; it runs as a new Python 3 program and you "
    "get <output>what it printed</output> back. When you know the answer, write "
    "<answer>value</answer>."
)

TOOL_LIMITS = SandboxLimits(cpu_s=2.0, wall_s=5.0, memory_mb=256, output_bytes=65_536)
"""Sandbox limits of one tool call: 2 s CPU, 5 s wall clock, 256 MB, 64 KiB of output."""

MAX_TOOL_OUTPUT_CHARS = 1000
"""Characters of one call's output returned to the policy; the rest is cut and counted."""

TOOL_COUNTS = (
    "calls",
    "tool_errors",
    "tool_timeouts",
    "outputs_cut",
    "chars_cut",
    "extra_calls_dropped",
)
"""The counters of `StepResult.info["counts"]` that `tool_counts` sums."""

_USAGE = (
    "<output>error: write <python>code</python> to run Python or <answer>value</answer> "
    "to answer</output>"
)


def _outside_code(text: str) -> str:
    """`text` without its `<python>...</python>` blocks (the pairs `tag_contents` finds)."""
    opening, closing = "<python>", "</python>"
    parts, start = [], 0
    while (begin := text.find(opening, start)) >= 0:
        end = text.find(closing, begin + len(opening))
        if end < 0:
            break
        parts.append(text[start:begin])
        start = end + len(closing)
    return "".join(parts) + text[start:]


def _check_options(
    *,
    max_turns: Any,
    max_calls_per_turn: Any,
    max_output_chars: Any,
    system_prompt: Any,
    timeout_s: Any,
) -> None:
    for name, value in (
        ("max_turns", max_turns),
        ("max_calls_per_turn", max_calls_per_turn),
        ("max_output_chars", max_output_chars),
    ):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not (system_prompt is None or isinstance(system_prompt, str)):
        raise TypeError(f"system_prompt must be a str or None, got {type(system_prompt).__name__}")
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 < timeout_s < float("inf")
    ):
        raise ValueError(
            f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}"
        )


def format_tool_output(
    run: ExecutionResult,
    *,
    max_chars: int = MAX_TOOL_OUTPUT_CHARS,
) -> tuple[str, int]:
    """The tool message of one call and the number of characters cut from it.

    The text is stdout then stderr, stripped, cut to `max_chars` characters with a
    `[... N more characters cut]` note; a call stopped by a limit gets an `error:` line saying
    which. The sandbox's own cut (`stdout_truncated`, output over `output_bytes`) is noted too.

    Args:
        run: the sandbox's result (not SANDBOX_ERROR: that ends the episode instead).
        max_chars: characters of output kept (>= 1).

    Returns:
        (`<output>...</output>`, characters cut by `max_chars`; 0 when nothing was cut here).

    Raises:
        ValueError: if `max_chars` < 1.
    """
    if not (isinstance(max_chars, int) and max_chars >= 1):
        raise ValueError(f"max_chars must be an int >= 1, got {max_chars!r}")
    text = "\n".join(part.strip("\n") for part in (run.stdout, run.stderr) if part.strip())
    cut = max(0, len(text) - max_chars)
    if cut:
        text = f"{text[:max_chars]}\n[... {cut} more characters cut]"
    notes = {
        ExecOutcome.TIMEOUT: "error: timed out (the sandbox's time limit)",
        ExecOutcome.MEMORY: "error: memory limit exceeded",
        ExecOutcome.OUTPUT_LIMIT: "error: output over the sandbox's limit, cut",
        ExecOutcome.KILLED: f"error: killed by signal {run.signal}",
    }
    note = notes.get(ExecOutcome(run.outcome))
    if note is None and run.stdout_truncated:
        note = "error: output over the sandbox's limit, cut"
    if note:
        text = f"{text}\n{note}" if text else note
    return f"<output>{text}</output>", cut


class PythonToolEnv:
    """One multi-turn Python-tool episode on one item (see the module docstring).

    Args:
        item: a task item with `question` and `answer`.
        sandbox: runs the calls; `Sandbox(TOOL_LIMITS)` when None.
        max_turns: assistant turns before the episode ends without an answer (>= 1).
        max_calls_per_turn: `<python>` blocks run per turn (>= 1); later ones are dropped and
            counted.
        max_output_chars: characters of each call's output returned (>= 1).
        verifier: checks the `<answer>` content; `MathAnswerVerifier()` when None.
        system_prompt: the system turn describing the tool (None: no system turn).
        timeout_s: the verifier's time budget (`run_verifier`).

    Raises:
        ValueError: for a bad `max_turns`, `max_calls_per_turn` or `max_output_chars` (ints >= 1)
            or `timeout_s` (positive or None).
        TypeError: `system_prompt` is not a str or None.
        SandboxUnavailable: (default sandbox only) when no sandbox can be made here.
    """

    def __init__(
        self,
        item: Mapping[str, Any],
        *,
        sandbox: Sandbox | None = None,
        max_turns: int = 4,
        max_calls_per_turn: int = 4,
        max_output_chars: int = MAX_TOOL_OUTPUT_CHARS,
        verifier: Verifier | None = None,
        system_prompt: str | None = PYTHON_TOOL_SYSTEM_PROMPT,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        _check_options(
            max_turns=max_turns,
            max_calls_per_turn=max_calls_per_turn,
            max_output_chars=max_output_chars,
            system_prompt=system_prompt,
            timeout_s=timeout_s,
        )
        self.item = item
        self.sandbox = Sandbox(TOOL_LIMITS) if sandbox is None else sandbox
        self.max_turns = max_turns
        self.max_calls_per_turn = max_calls_per_turn
        self.max_output_chars = max_output_chars
        self.verifier = MathAnswerVerifier() if verifier is None else verifier
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.turn = 0
        self.counts = dict.fromkeys(TOOL_COUNTS, 0)
        self.done = False

    def initial_messages(self) -> Messages:
        return prompt_messages(self.item["question"], self.system_prompt)

    def _info(self) -> dict:
        return {"turn": self.turn, "counts": dict(self.counts)}

    def _end(self, result: VerifierResult) -> StepResult:
        self.done = True
        return StepResult(done=True, reward=result.score, verifier_result=result, info=self._info())

    def step(self, assistant_text: str) -> StepResult:
        if self.done:
            raise RuntimeError(
                "this episode is over; environments are single-use (make new ones "
                "with the group builder)"
            )
        self.turn += 1
        programs = tag_contents(assistant_text, "python")
        answer = extract_tag(_outside_code(assistant_text), "answer")
        if answer is not None:
            self.counts["extra_calls_dropped"] += len(programs)
            return self._end(
                run_verifier(self.verifier, answer, self.item, timeout_s=self.timeout_s)
            )
        self.counts["extra_calls_dropped"] += max(0, len(programs) - self.max_calls_per_turn)
        programs = programs[: self.max_calls_per_turn]
        replies = []
        if programs:
            for run in self.sandbox.run_many(programs):
                if ExecOutcome(run.outcome) is ExecOutcome.SANDBOX_ERROR:
                    detail = (run.stderr.strip().splitlines() or ["no detail"])[-1][:200]
                    return self._end(
                        VerifierResult.failure(
                            Outcome.ERROR, f"the sandbox failed on a tool call: {detail}"
                        )
                    )
                reply, cut = format_tool_output(run, max_chars=self.max_output_chars)
                outcome = ExecOutcome(run.outcome)
                self.counts["calls"] += 1
                self.counts["tool_errors"] += outcome is not ExecOutcome.OK
                self.counts["tool_timeouts"] += outcome is ExecOutcome.TIMEOUT
                self.counts["outputs_cut"] += bool(
                    cut or run.stdout_truncated or outcome is ExecOutcome.OUTPUT_LIMIT
                )
                self.counts["chars_cut"] += cut
                replies.append(reply)
        if self.turn >= self.max_turns:
            return self._end(
                VerifierResult.failure(
                    Outcome.FORMAT_ERROR, f"no <answer> after {self.max_turns} turns"
                )
            )
        return StepResult(
            done=False,
            info=self._info(),
            observation=[{"role": "tool", "content": "\n".join(replies or [_USAGE])}],
        )


@dataclass(frozen=True)
class PythonToolGroupBuilder:
    """The Python-tool environments of one item (one GRPO group). Pickles.

    Args:
        item: the task item (question/answer).
        limits: sandbox limits of one call (`TOOL_LIMITS`).
        max_turns, max_calls_per_turn, max_output_chars, system_prompt, timeout_s: passed to
            each `PythonToolEnv`.

    Raises:
        ValueError / TypeError: when made, for a bad option (as `PythonToolEnv`) or `limits`
            that is not a `SandboxLimits`.
        SandboxUnavailable: from `make_envs`, when no sandbox can be made here.
    """

    item: dict
    limits: SandboxLimits = TOOL_LIMITS
    max_turns: int = 4
    max_calls_per_turn: int = 4
    max_output_chars: int = MAX_TOOL_OUTPUT_CHARS
    system_prompt: str | None = PYTHON_TOOL_SYSTEM_PROMPT
    timeout_s: float | None = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(self.limits).__name__}")
        _check_options(
            max_turns=self.max_turns,
            max_calls_per_turn=self.max_calls_per_turn,
            max_output_chars=self.max_output_chars,
            system_prompt=self.system_prompt,
            timeout_s=self.timeout_s,
        )

    def make_envs(self, group_size: int) -> list[PythonToolEnv]:
        if not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        sandbox = Sandbox(self.limits)
        return [
            PythonToolEnv(
                self.item,
                sandbox=sandbox,
                max_turns=self.max_turns,
                max_calls_per_turn=self.max_calls_per_turn,
                max_output_chars=self.max_output_chars,
                system_prompt=self.system_prompt,
                timeout_s=self.timeout_s,
            )
            for _ in range(group_size)
        ]


def tool_counts(groups: Sequence[Any]) -> dict[str, int]:
    """Sums of the `TOOL_COUNTS` counters over the trajectories of `groups` (rollout `Group`s of
    Python-tool episodes), plus `episodes`; every key present, zeros included."""
    totals = dict.fromkeys(("episodes", *TOOL_COUNTS), 0)
    for group in groups:
        for trajectory in group:
            totals["episodes"] += 1
            for key in TOOL_COUNTS:
                totals[key] += int((trajectory.info.get("counts") or {}).get(key, 0))
    return totals


_TOOL_OPTIONS = (
    "limits",
    "max_turns",
    "max_calls_per_turn",
    "max_output_chars",
    "system_prompt",
    "timeout_s",
)


@register_task("python_tool")
def python_tool_task(
    *,
    limits: SandboxLimits = TOOL_LIMITS,
    max_turns: int = 4,
    max_calls_per_turn: int = 4,
    max_output_chars: int = MAX_TOOL_OUTPUT_CHARS,
    system_prompt: str | None = PYTHON_TOOL_SYSTEM_PROMPT,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    **overrides: Any,
):
    """The chain_sum preset (`chain_sum_task(**overrides)`) played with the Python tool.

    `limits`, `max_turns`, `max_calls_per_turn`, `max_output_chars`, `system_prompt` and
    `timeout_s` are the `PythonToolGroupBuilder`'s, checked here (not at `make_envs`);
    `timeout_s` is also the task's (`score_fn`). Other `overrides` are chain_sum's (`size=`,
    `held_out_size=`, `max_digits=`, ...). `builder=` and `extract=` are refused: the builder is
    the tool's, and the `<answer>` content is what is verified.

    Raises:
        ValueError / TypeError: for a bad or unknown option, naming it.

    Example:
        >>> task = python_tool_task(size=20, held_out_size=4, max_turns=2)
        >>> task.builders(0, 1)[0].max_turns
        2
    """
    from posttrain.envs.reasoning_gym_env import chain_sum_task

    for name in ("builder", "extract"):
        if name in overrides:
            raise ValueError(
                f"python_tool does not take {name}= (its builder is "
                f"PythonToolGroupBuilder, which verifies the <answer> content); "
                f"its own options: {', '.join(_TOOL_OPTIONS)}"
            )
    options: dict[str, Any] = {
        "limits": limits,
        "max_turns": max_turns,
        "max_calls_per_turn": max_calls_per_turn,
        "max_output_chars": max_output_chars,
        "system_prompt": system_prompt,
        "timeout_s": timeout_s,
    }
    PythonToolGroupBuilder({}, **options)  # checks every option now
    builder = functools.partial(PythonToolGroupBuilder, **options)
    try:
        return chain_sum_task(builder=builder, timeout_s=timeout_s, **overrides)
    except ValueError as exc:
        if "unknown option" not in str(exc):
            raise
        raise ValueError(
            f"python_tool: {exc}; python_tool's own options: {', '.join(_TOOL_OPTIONS)}"
        ) from None
