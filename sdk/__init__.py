"""posttrain: a notebook-first SDK for post-training language models.

The names a notebook uses most are here as `posttrain.X`, loaded on first use (PEP 562 module
`__getattr__`), so `import posttrain` itself stays light: it imports neither torch nor torchtune
nor verl until a name is used. Everything else lives in the layered subpackages, lowest first:

    core -> models -> policy -> data -> rewards (-> verifiers) -> train -> preference -> rl
    (-> envs) -> launch -> notebook

Example:
    >>> import posttrain
    >>> "Policy" in dir(posttrain)
    True
    >>> posttrain.RLAlgorithm.grpo(group_size=4).advantage_estimator
    'grpo'
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__version__ = "0.1.0"

# name -> the module it is imported from (each a package's public API).
_LAZY = {
    # models, policy, data
    "ModelSpec": "posttrain.models",
    "PRESETS": "posttrain.models",
    "Policy": "posttrain.policy",
    "SFTDataset": "posttrain.data",
    "CPTDataset": "posttrain.data",
    "SFTLoader": "posttrain.data",
    "PreferenceDataset": "posttrain.data",
    "PreferenceLoader": "posttrain.data",
    # rewards and verifiers
    "Outcome": "posttrain.rewards",
    "VerifierResult": "posttrain.rewards",
    "run_verifier": "posttrain.rewards",
    "score_batch": "posttrain.rewards",
    "evaluate_generations": "posttrain.rewards",
    "LLMJudge": "posttrain.rewards",
    "RewardModelJudge": "posttrain.rewards",
    "judge_as_verifier": "posttrain.rewards",
    "RewardModel": "posttrain.rewards",
    "get_verifier": "posttrain.verifiers",
    "register_verifier": "posttrain.verifiers",
    "registered_verifiers": "posttrain.verifiers",
    # training
    "Trainer": "posttrain.train",
    "warmup_cosine_schedule": "posttrain.train",
    "get_loss": "posttrain.preference",
    "register_loss": "posttrain.train",
    "registered_losses": "posttrain.preference",
    "compute_reference_logps": "posttrain.preference",
    "make_preference_pairs": "posttrain.preference",
    # RL
    "RLAlgorithm": "posttrain.rl",
    "RLTrainer": "posttrain.rl",
    "ReplayBuffer": "posttrain.rl",
    "get_task": "posttrain.envs",
    "register_task": "posttrain.envs",
    "registered_tasks": "posttrain.envs",
    "ReasoningGymTask": "posttrain.envs",
    "ReasoningGymGroupBuilder": "posttrain.envs",
    # launch and the notebook
    # (`posttrain.launch` is the package, so the function is `posttrain.launch.launch`)
    "launch_array": "posttrain.launch",
    "Run": "posttrain.launch",
    "LiveDashboard": "posttrain.notebook",
    "plot_metrics": "posttrain.notebook",
    "rollouts_frame": "posttrain.notebook",
    "compare_rewards": "posttrain.notebook",
    "load_recipe": "posttrain.workflows.recipes",
    "sweep": "posttrain.workflows.sweep",
    "runs_table": "posttrain.workflows.lineage",
}

__all__ = sorted(_LAZY)

# torchao warns on every import that its C++ extensions are skipped for this torch build, and
# that triton is absent; neither matters to what posttrain uses. Drop exactly those two records.
_NOTICES = {
    "torchao": "Skipping import of cpp extensions due to incompatible torch version",
    "torchao.kernel.intmm": "Warning: Detected no triton",
}


def _not_starting_with(prefix: str) -> Callable[[logging.LogRecord], bool]:
    return lambda record: not str(record.msg).startswith(prefix)


for _logger, _prefix in _NOTICES.items():
    logging.getLogger(_logger).addFilter(_not_starting_with(_prefix))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(
            f"module 'posttrain' has no attribute {name!r}; the names here are "
            f"{', '.join(__all__)} (the rest live in posttrain's subpackages)"
        )
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
