"""What scores a completion: the Verifier protocol and its runner (typed outcomes, time
budgets), judges (in process, or served over HTTP with batching and backpressure, and their
client verifier), the reward model, and greedy evaluation of a policy with a score function.

The names below load on first use (`posttrain.core.lazy`): importing the package or one of
its submodules does not import the others (nor torch).
"""

from __future__ import annotations

from posttrain.core.lazy import lazy_exports

# submodule -> the names it exports; each is imported on first use.
_EXPORTS = {
    "evaluation": [
        "EvalResult",
        "wilson_interval",
        "evaluate_generations",
        "paired_bootstrap_diff",
        "SampledEvalResult",
        "evaluate_sampled",
    ],
    "functions": ["RewardFunctions", "PerSample", "per_sample", "load_reward", "reward_name"],
    "judge_client": ["JudgeClient"],
    "judge_server": [
        "JudgeServer",
        "ServerSettings",
        "serve_judge",
        "JudgeJobSpec",
        "serve_until_stopped",
    ],
    "judge_protocol": ["JudgeResult", "Judge", "judge_as_verifier", "JudgeVerifier"],
    "judges": ["LLMJudge", "RewardModelJudge", "parse_score", "DEFAULT_JUDGE_TEMPLATE"],
    "pairwise": [
        "parse_choice",
        "DEFAULT_PAIRWISE_TEMPLATE",
        "DEFAULT_PAIRWISE_RUBRIC",
        "PairwiseOutcome",
        "PairwiseResult",
        "PairwiseJudge",
        "LLMPairwiseJudge",
        "RewardModelPairwiseJudge",
        "count_pairwise",
    ],
    "reward_model": [
        "RewardModel",
        "render_pair",
        "bradley_terry_loss",
        "PairwiseAccuracy",
        "accuracy_from_rewards",
        "pairwise_accuracy",
        "load_reward_model",
        "RM_CONFIG_FILE",
        "RM_WEIGHTS_FILE",
    ],
    "verifier": [
        "DEFAULT_TIMEOUT_S",
        "DEFAULT_MAX_WORKERS",
        "Outcome",
        "VerifierResult",
        "Verifier",
        "run_verifier",
        "score_batch",
        "count_outcomes",
        "as_score_fn",
        "VERIFIERS",
        "register_verifier",
        "get_verifier",
        "registered_verifiers",
    ],
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
