"""The multi-turn Python-tool environment: every option of the `python_tool` task checked when
built and passed to its builder, code blocks and answers told apart, tool output cut and
counted, scripted episodes in the sandbox (limits, NUL bytes, an answer tag printed by code),
tool tokens masked out of the loss in a rollout, and a tiny-policy rollout."""

import pytest
from _env_helpers import ScriptedTurnsPolicy

from posttrain.envs import get_task
from posttrain.envs.python_tool_env import (
    PythonToolEnv,
    PythonToolGroupBuilder,
    format_tool_output,
    python_tool_task,
    tool_counts,
)
from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.rl import collect_groups, run_text_episode
from posttrain.rl.rollout import rollout_metrics
from posttrain.verifiers.basic import tag_contents
from posttrain.verifiers.sandbox import (
    ExecOutcome,
    ExecutionResult,
    Sandbox,
    SandboxLimits,
    sandbox_available,
)

NO_SANDBOX = sandbox_available()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}")
# CPU limits end runaway programs whatever the load; the wall-clock limit (60 s) is a backstop
# that a program expected to finish never reaches beside busy neighbours.
TOOL = SandboxLimits(cpu_s=1.0, wall_s=60.0, memory_mb=256, output_bytes=65_536)
ITEM = {"question": "What is 12 * 7 - 5?", "answer": "79"}


# --------------------------------------------------------------------------------------------
# The task's options, and what a turn runs (no sandbox)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,error,words",
    [
        ({"timeout_s": -1}, ValueError, "timeout_s must be a positive number"),
        ({"timeout_s": float("nan")}, ValueError, "timeout_s must be a positive number"),
        ({"max_turns": 0}, ValueError, "max_turns must be an int >= 1"),
        ({"max_calls_per_turn": 0}, ValueError, "max_calls_per_turn must be an int >= 1"),
        ({"max_output_chars": True}, ValueError, "max_output_chars must be an int >= 1"),
        ({"system_prompt": 3}, TypeError, "system_prompt must be a str or None"),
        ({"limits": {"cpu_s": 1}}, TypeError, "limits must be a SandboxLimits"),
        ({"extract": "last"}, ValueError, "python_tool does not take extract="),
        ({"builder": PythonToolGroupBuilder}, ValueError, "python_tool does not take builder="),
        ({"bogus": 1}, ValueError, "unknown option.*'bogus'.*python_tool's own options: limits"),
        ({"held_out_size": 10**6}, ValueError, "held_out_size must be an int in 0 .. 50000"),
    ],
)
def test_python_tool_task_checks_every_option_when_built(options, error, words):
    """Each was accepted (and failed only at make_envs, or was silently ignored)."""
    with pytest.raises(error, match=words):
        get_task("python_tool", **({"size": 20, "held_out_size": 4} | options))


def test_python_tool_task_passes_its_options_to_the_builder():
    task = get_task(
        "python_tool",
        size=20,
        held_out_size=4,
        max_calls_per_turn=2,
        timeout_s=60,
        system_prompt="Use Python.",
        max_turns=3,
        max_output_chars=70,
        limits=TOOL,
    )
    builder = task.builders(0, 1)[0]
    assert (
        builder.max_calls_per_turn,
        builder.timeout_s,
        builder.system_prompt,
        builder.max_turns,
        builder.max_output_chars,
        builder.limits,
    ) == (2, 60, "Use Python.", 3, 70, TOOL)
    assert task.timeout_s == 60  # score_fn's budget too
    env = PythonToolEnv(ITEM, sandbox=_StubSandbox(), system_prompt=builder.system_prompt)
    assert env.initial_messages()[0] == {"role": "system", "content": "Use Python."}


def test_a_custom_builder_refuses_the_options_it_would_ignore():
    from posttrain.envs.reasoning_gym_env import ReasoningGymTask, chain_sum_task

    with pytest.raises(ValueError, match="system_prompt is used only by the default builder"):
        chain_sum_task(size=20, held_out_size=4, builder=PythonToolGroupBuilder, system_prompt="x")
    with pytest.raises(TypeError, match="builder must be callable"):
        ReasoningGymTask(name="chain_sum", size=20, held_out_size=4, builder="tool")
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        ReasoningGymTask(name="chain_sum", size=20, held_out_size=4, timeout_s=0)


class _StubSandbox:
    """Records the programs it is asked to run; each prints its own length."""

    def __init__(self):
        self.programs = []

    def run_many(self, programs):
        self.programs += programs
        return [
            ExecutionResult(
                outcome=ExecOutcome.OK,
                exit_code=0,
                signal=None,
                stdout=f"{len(p)}\n",
                stderr="",
                stdout_truncated=False,
                wall_s=0.0,
            )
            for p in programs
        ]


@pytest.mark.parametrize(
    "text",
    [
        "<python>print('<answer>79</answer>')</python>",
        "<python>x = '<answer>79</answer>'</python> more",
        "<python>a</python><python>'<answer>79</answer>'</python>",
    ],
)
def test_an_answer_inside_a_code_block_is_code_not_an_answer(text):
    """It ended the episode with reward 1.0 and no call run."""
    sandbox = _StubSandbox()
    result = PythonToolEnv(ITEM, sandbox=sandbox).step(text)
    assert not result.done and sandbox.programs == tag_contents(text, "python")
    assert result.info["counts"]["calls"] == len(sandbox.programs)


@pytest.mark.parametrize(
    "text,dropped",
    [
        ("<answer>79</answer>", 0),
        ("<python>print(1)</python> so <answer>79</answer>", 1),
        ("<answer>79</answer><python>print('<answer>1</answer>')</python>", 1),
        ("<python>print(1)", 0),  # unclosed: text, not code
    ],
)
def test_an_answer_outside_code_ends_the_turn_without_running_its_code(text, dropped):
    sandbox = _StubSandbox()
    result = PythonToolEnv(ITEM, sandbox=sandbox).step(
        text + ("" if "answer" in text else "<answer>79</answer>")
    )
    assert (result.done, result.reward, sandbox.programs) == (True, 1.0, [])
    assert result.info["counts"]["extra_calls_dropped"] == dropped


# --------------------------------------------------------------------------------------------
# Tool output (no sandbox)
# --------------------------------------------------------------------------------------------


def _run(outcome=ExecOutcome.OK, stdout="", stderr="", truncated=False, signal=None):
    return ExecutionResult(
        outcome=outcome,
        exit_code=0,
        signal=signal,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=truncated,
        wall_s=0.01,
    )


def test_format_tool_output_cuts_and_counts():
    assert format_tool_output(_run(stdout="84\n")) == ("<output>84</output>", 0)
    text, cut = format_tool_output(_run(stdout="a" * 1500 + "\n"), max_chars=1000)
    assert (
        cut == 500 and text == "<output>" + "a" * 1000 + "\n[... 500 more characters cut]</output>"
    )
    text, _ = format_tool_output(
        _run(
            ExecOutcome.FAILED,
            stdout="1\n",
            stderr="Traceback...\nZeroDivisionError: division by zero\n",
        )
    )
    assert text == "<output>1\nTraceback...\nZeroDivisionError: division by zero</output>"
    assert (
        format_tool_output(_run(ExecOutcome.TIMEOUT))[0]
        == "<output>error: timed out (the sandbox's time limit)</output>"
    )
    assert "cut" in format_tool_output(_run(stdout="b" * 10, truncated=True))[0]
    assert "signal 11" in format_tool_output(_run(ExecOutcome.KILLED, signal=11))[0]
    with pytest.raises(ValueError, match="max_chars"):
        format_tool_output(_run(), max_chars=0)


# --------------------------------------------------------------------------------------------
# The Python tool (sandbox)
# --------------------------------------------------------------------------------------------


def _tool_env(**options):
    return PythonToolEnv(ITEM, sandbox=Sandbox(TOOL), **options)


def _play(env, turns):
    turns = iter(turns)
    return run_text_episode(env, lambda messages: next(turns))


def _tool_messages(episode):
    return [m["content"] for m in episode.messages if m["role"] == "tool"]


@needs_sandbox
def test_tool_calls_run_in_the_sandbox_and_the_answer_is_verified():
    episode = _play(
        _tool_env(),
        [
            "First <python>print(12 * 7)</python>",
            "<python>x = 1</python> <python>print(x)</python>",
            "<python>print(1 / 0)</python>",
            "<answer>79</answer>",
        ],
    )
    tool = _tool_messages(episode)
    assert tool[0] == "<output>84</output>"
    assert tool[1].startswith("<output></output>\n<output>Traceback")  # nothing carries over
    assert "NameError: name 'x' is not defined</output>" in tool[1]
    assert tool[2].endswith("ZeroDivisionError: division by zero</output>")
    assert (episode.reward, episode.outcome, episode.num_turns) == (1.0, "ok", 4)
    assert episode.final.info == {
        "turn": 4,
        "counts": {
            "calls": 4,
            "tool_errors": 2,
            "tool_timeouts": 0,
            "outputs_cut": 0,
            "chars_cut": 0,
            "extra_calls_dropped": 0,
        },
    }
    wrong = _play(_tool_env(), ["<answer>80</answer>"])
    assert (wrong.reward, wrong.outcome) == (0.0, "wrong")


@needs_sandbox
def test_tool_limits_cut_output_and_are_counted():
    env = _tool_env(max_output_chars=100, max_calls_per_turn=2, max_turns=5)
    episode = _play(
        env,
        [
            "<python>print('a' * 5000)</python>",
            "<python>print('b' * 200_000)</python>",
            "<python>while True: pass</python>",
            "<python>print(1)</python><python>print(2)</python><python>print(3)</python>",
            "no tags",
        ],
    )
    tool = _tool_messages(episode)
    assert tool[0] == "<output>" + "a" * 100 + "\n[... 4900 more characters cut]</output>"
    assert "output over the sandbox's limit" in tool[1]
    assert tool[2] == "<output>error: timed out (the sandbox's time limit)</output>"
    assert tool[3] == "<output>1</output>\n<output>2</output>"
    assert episode.outcome == "format_error" and episode.reward == 0.0  # no answer in 5 turns
    info = episode.final.info["counts"]
    assert info["calls"] == 5 and info["tool_timeouts"] == 1 and info["extra_calls_dropped"] == 1
    assert info["outputs_cut"] == 2 and info["chars_cut"] >= 4900
    hint = _play(_tool_env(max_turns=2), ["hello", "<answer>79</answer>"])
    assert "write <python>code</python>" in _tool_messages(hint)[0] and hint.reward == 1.0


@needs_sandbox
def test_a_program_with_a_nul_byte_is_a_tool_error_not_a_crash():
    """Python ran only the part before the NUL (`print('a')`) and reported success."""
    episode = _play(
        _tool_env(), ["<python>print('a')\x00print('b')</python>", "<answer>79</answer>"]
    )
    assert "cannot contain null bytes" in _tool_messages(episode)[0]
    assert episode.reward == 1.0 and episode.final.info["counts"]["tool_errors"] == 1


@needs_sandbox
def test_code_in_the_sandbox_that_prints_an_answer_tag_is_not_the_answer():
    episode = _play(
        _tool_env(), ["<python>print('<answer>79</answer>')</python>", "<answer>79</answer>"]
    )
    assert _tool_messages(episode) == ["<output><answer>79</answer></output>"]
    assert episode.num_turns == 2 and episode.final.info["counts"]["calls"] == 1


@needs_sandbox
def test_tool_tokens_are_masked_out_of_the_loss_in_a_rollout():
    """The False positions of the completion mask are exactly the tool turn and the header
    of the next assistant turn, located by rendering the conversation's prefixes."""
    scripted = ScriptedTurnsPolicy(["<python>print(2 + 3)</python>", "<answer>5</answer>"])
    item = {"question": "What is 2 + 3?", "answer": "5"}
    builder = PythonToolGroupBuilder(item, limits=TOOL)
    [group] = collect_groups(scripted, [builder], group_size=1, max_new_tokens=32)
    t = group.trajectories[0]
    assert (t.outcome, t.reward, t.info["counts"]["calls"]) == ("ok", 1.0, 1)
    assert rollout_metrics([group])["env_calls"] == 1
    tok = ByteTokenizer()
    messages = [
        *builder.make_envs(1)[0].initial_messages(),
        {"role": "assistant", "content": "<python>print(2 + 3)</python>"},
        {"role": "tool", "content": "<output>5</output>"},
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    assert t.prompt_ids + t.completion_ids == tok.render_chat(messages).input_ids
    start = len(tok.render_chat(messages[:-2]).input_ids) - len(t.prompt_ids)
    end = len(tok.render_prompt(messages[:-1])) - len(t.prompt_ids)
    assert [i for i, m in enumerate(t.completion_mask) if not m] == list(range(start, end))
    assert "<output>5</output>" in tok.decode(t.completion_ids[start:end])
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.completion_mask) if not m)
    assert tool_counts([group])["calls"] == 1


@needs_sandbox
def test_a_tiny_policy_rollout_on_the_python_tool_task():
    task = python_tool_task(size=16, held_out_size=2, max_turns=2)
    policy = Policy.from_spec("tiny-1m", seed=0)
    groups = collect_groups(policy, task.builders(0, 2), group_size=2, max_new_tokens=8, seed=0)
    rows = [t for g in groups for t in g]
    assert len(rows) == 4
    for t in rows:
        # no <answer> from a fresh model: two turns, the tool's hint in between, not trained on
        assert (t.outcome, t.reward, t.info["turn"]) == ("format_error", 0.0, 2)
        assert not all(t.completion_mask) and t.completion_mask[0]
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.completion_mask) if not m)
    assert tool_counts(groups) == {
        "episodes": 4,
        "calls": 0,
        "tool_errors": 0,
        "tool_timeouts": 0,
        "outputs_cut": 0,
        "chars_cut": 0,
        "extra_calls_dropped": 0,
    }
