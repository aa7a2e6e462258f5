"""Task environments, all satisfying the protocols of `posttrain.rl.environment`.

Importing this package registers the tasks below; `get_task` / `registered_tasks` here are the
registry's lookups with them loaded.

    ==============  =====================================  ====================================
    task name       what                                   episodes
    ==============  =====================================  ====================================
    reasoning_gym   ReasoningGymTask: any reasoning-gym    single-turn, the task's own scorer
                    task by name + config
    chain_sum       chain_sum_task: 2-term, 1-2-digit      single-turn
                    chain_sum preset
    calculator      calculator_task: chain_sum with a      multi-turn, <calc> tool calls,
                    calculator tool                        <answer> scored by math_answer
    humaneval       humaneval_task: the 164 HumanEval      single-turn, unit tests run in the
                    problems, deterministic held-out split sandbox (code_tests verifier)
    code            CodeTask: any code items (MBPP-style   single-turn, unit tests run in the
                    rows via mbpp_item)                    sandbox
    python_tool     python_tool_task: chain_sum with a     multi-turn, <python> runs in the
                    Python tool                            sandbox, <answer> by math_answer
    prompts         PromptTask: any prompt records (a      single-turn, reward functions in
                    list of dicts) + reward functions      TRL's convention, one call a group
    ==============  =====================================  ====================================

Example:
    >>> from posttrain.envs import get_task
    >>> task = get_task("chain_sum", size=32, held_out_size=4)
    >>> [m["role"] for m in task.builders(0, 1)[0].make_envs(2)[0].initial_messages()]
    ['user']
"""

from posttrain.envs.calculator_env import (
    CALCULATOR_SYSTEM_PROMPT,
    CalculatorEnv,
    CalculatorGroupBuilder,
    calculator_result,
    calculator_task,
    evaluate_arithmetic,
)
from posttrain.envs.code_env import CodeEnv, CodeGroupBuilder, CodeTask, humaneval_task, mbpp_item
from posttrain.envs.judged_env import JudgedEnv, JudgedGroupBuilder
from posttrain.envs.prompt_task import PromptEnv, PromptGroupBuilder, PromptTask, check_prompt_rows
from posttrain.envs.python_tool_env import (
    PYTHON_TOOL_SYSTEM_PROMPT,
    PythonToolEnv,
    PythonToolGroupBuilder,
    python_tool_task,
    tool_counts,
)
from posttrain.envs.reasoning_gym_env import (
    CHAIN_SUM_CONFIG,
    ReasoningGymEnv,
    ReasoningGymGroupBuilder,
    ReasoningGymTask,
    chain_sum_task,
    prompt_messages,
)
from posttrain.rl.environment import get_task, register_task, registered_tasks

__all__ = [
    "JudgedEnv",
    "PromptEnv",
    "PromptGroupBuilder",
    "PromptTask",
    "check_prompt_rows",
    "JudgedGroupBuilder",
    "CALCULATOR_SYSTEM_PROMPT",
    "CHAIN_SUM_CONFIG",
    "CalculatorEnv",
    "CalculatorGroupBuilder",
    "ReasoningGymEnv",
    "ReasoningGymGroupBuilder",
    "ReasoningGymTask",
    "calculator_result",
    "calculator_task",
    "chain_sum_task",
    "evaluate_arithmetic",
    "prompt_messages",
    "CodeEnv",
    "CodeGroupBuilder",
    "CodeTask",
    "humaneval_task",
    "mbpp_item",
    "PYTHON_TOOL_SYSTEM_PROMPT",
    "PythonToolEnv",
    "PythonToolGroupBuilder",
    "python_tool_task",
    "tool_counts",
    "get_task",
    "register_task",
    "registered_tasks",
]
