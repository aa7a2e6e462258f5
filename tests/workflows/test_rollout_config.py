"""The recipes' `rollout` section (`RolloutConfig`; grpo and ppo: `RLRolloutConfig`, which adds
`max_staleness`): the engine is chosen by name in every recipe that samples, bad values and
combinations the engine cannot serve are refused naming the dotted field before anything is
written, the section reaches `RLTrainer` (grpo and ppo share it), and a recipe run from the
command line with `rollout.engine=vllm` samples its held-out evaluations through the engine
(started in the run folder, closed when the run ends) with the answers of the builtin one."""

import json
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.policy.rollout_engine import VLLMEngine
from posttrain.workflows import override
from posttrain.workflows.reports import read_table
from posttrain.workflows.rl_config import RLRolloutConfig, RolloutConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        ("grpo", {"rollout.engine": "vlm"}, r"Config\.rollout\.engine='vlm'; must be one of "
         r"builtin, vllm"),
        ("ppo", {"rollout.engine": "vlm"}, r"Config\.rollout\.engine='vlm'"),
        ("sft", {"rollout.engine": "vlm"}, r"Config\.rollout\.engine='vlm'; must be one of "),
        ("dpo", {"rollout.engine": "vlm"}, r"Config\.rollout\.engine='vlm'"),
        ("reward_model", {"rollout.engine": "vlm"}, r"Config\.rollout\.engine='vlm'"),
        ("grpo", {"rollout.max_staleness": -1}, r"Config\.rollout\.max_staleness=-1"),
        ("grpo", {"rollout.kv_cache_gib": 0}, r"Config\.rollout\.kv_cache_gib=0"),
        ("sft", {"rollout.kv_cache_gib": 0}, r"Config\.rollout\.kv_cache_gib=0"),
        ("grpo", {"rollout.startup_timeout_s": 0.0}, r"Config\.rollout\.startup_timeout_s=0"),
        ("dpo", {"rollout.startup_timeout_s": 0.0}, r"Config\.rollout\.startup_timeout_s=0"),
        (
            "grpo",
            {"rollout.engine": "vllm", "quantization.rollout": "int8"},
            r"Config\.rollout\.engine='vllm'; must be builtin with quantization\.rollout='int8'",
        ),
        (
            "ppo",
            {"rollout.engine": "vllm", "sampling.top_p": 0.9},
            r"Config\.rollout\.engine='vllm'; must be builtin with sampling\.top_p=0\.9",
        ),
        (
            "sft",
            {"rollout.engine": "vllm", "task.eval_size": 0},
            r"Config\.rollout\.engine='vllm'; must be builtin with task\.eval_size=0 \(the "
            r"engine samples the held-out evaluation; this run samples nothing\)",
        ),
        (
            "sft",
            {"rollout.engine": "vllm", "quantization.training": "qat"},
            r"Config\.rollout\.engine='vllm'; must be builtin with quantization\.training='qat' "
            r"\(the vllm engine samples apart from the policy: it needs "
            r"quantization\.training='none'\)",
        ),
        (
            "dpo",
            {"rollout.engine": "vllm", "quantization.training": "fp8"},
            r"Config\.rollout\.engine='vllm'; must be builtin with quantization\.training='fp8'",
        ),
        (
            "grpo",
            {"rollout.url": "http://127.0.0.1:8000"},
            r"Config\.rollout\.url='http://127\.0\.0\.1:8000'; must be None, or http://host:port "
            r"of a running vLLM server with rollout\.engine=vllm",
        ),
        (
            "sft",
            {"rollout.engine": "vllm", "rollout.url": "127.0.0.1:8000"},
            r"Config\.rollout\.url='127\.0\.0\.1:8000'; must be None, or http://host:port",
        ),
        (
            "reward_model",
            {"rollout.engine": "vllm", "parallel.dp_shard": 2},
            r"Config\.rollout\.engine='vllm'; must be builtin under a parallel plan",
        ),
    ],
)  # fmt: skip
def test_bad_rollout_settings_fail_by_dotted_name(recipe, overrides, message):
    with pytest.raises(ValueError, match=message):
        override(cli.load_recipe(recipe).Config(), overrides)


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_the_rollout_section_reaches_the_trainer(recipe):
    cfg = override(cli.load_recipe(recipe).Config(), {"rollout.engine": "vllm"})
    assert cfg.rollout.trainer_options() == {
        "rollout_engine": "vllm",
        "max_staleness": 0,
        "rollout_options": {"startup_timeout_s": 900.0, "kv_cache_gib": 1},
    }
    assert RLRolloutConfig().trainer_options()["rollout_engine"] == "builtin"
    assert RLRolloutConfig().trainer_options()["rollout_options"] is None


def test_grpo_under_a_plan_hands_the_vllm_engine_to_the_trainer_by_name(tmp_path):
    """Under a parallel plan the trainer gets the engine's name and options, so that its ranks
    share one server (posttrain.rl.engine_plan), not an engine the run's slot started: nothing
    starts here. With `rollout.url` the options are the address alone (the engine attaches)."""
    from _policy_helpers import drawn_policy

    from posttrain.workflows.rl_stage import rollout_options

    url = {"rollout.url": "http://127.0.0.1:8000"}
    planned = {"parallel.dp_shard": 2, "eval.every": 0, "baseline.steps": 0}
    cfg = override(cli.load_recipe("grpo").Config(), {"rollout.engine": "vllm", **planned, **url})
    with cfg.rollout.slot(tmp_path) as slot:
        options = rollout_options(cfg, slot, drawn_policy(0))
        assert slot.engine is None  # nothing started or attached by the run's slot
    assert options == {
        "rollout_engine": "vllm",
        "max_staleness": 0,
        "rollout_options": {"url": "http://127.0.0.1:8000"},
    }
    # its SFT stage evaluates on rank 0 alone: the engine is allowed there too
    sft = override(
        cli.load_recipe("sft").Config(), {"rollout.engine": "vllm", "parallel.dp_shard": 2}
    )
    assert sft.rollout.options() == {"startup_timeout_s": 900.0, "kv_cache_gib": 1}


@pytest.mark.parametrize("recipe", ["sft", "dpo", "reward_model", "grpo"])
def test_every_sampling_recipe_has_the_section_at_builtin(recipe):
    rollout = cli.load_recipe(recipe).Config().rollout
    assert isinstance(rollout, RolloutConfig) and rollout.engine == "builtin"
    assert override(cli.load_recipe(recipe).Config(), {"rollout.engine": "vllm"}).rollout.options()


def table_of(path):
    """An evaluation table as the recipes read it back, every field a str."""
    return read_table(path, required=True, dtype=str, keep_default_na=False)


SFT_TINY = [
    "task.train_size=64",
    "task.eval_size=8",
    "optim.steps=3",
    "optim.batch_size=8",
    "optim.warmup_steps=1",
    "checkpoint.every=0",
    "eval.max_new_tokens=10",
    "progress=false",
]


@pytest.mark.slow
def test_sft_from_the_command_line_evaluates_through_the_vllm_engine(
    vllm_server, tmp_path, monkeypatch
):
    """`posttrain run sft ... rollout.engine=vllm`: the recipe asks for the vllm engine in its
    run folder and samples both held-out evaluations with it (before training, and after it on
    the synced weights), then closes it. The engine's start is lent the suite's shared tiny-1m
    server (`vllm_server`, synced to the policy the recipe passes), since a server of the
    recipe's own takes 1-2 minutes to start; what the start was given is recorded. Reference:
    the same run on the builtin engine (Policy.generate), computed without the server."""
    from _policy_helpers import drawn_policy
    from _vllm_helpers import SharedServerEngine

    monkeypatch.chdir(tmp_path)
    drawn_policy(0).save(tmp_path / "start")  # its greedy answers vary (a fresh init's are empty)
    started = []

    def lend(cls, policy, run_dir, *, version=0, **options):
        vllm_server.sync_weights(policy)
        engine = SharedServerEngine(vllm_server, version=version)
        started.append((Path(run_dir), options, engine))
        return engine

    monkeypatch.setattr(VLLMEngine, "start", classmethod(lend))
    for name, extra in (("builtin", []), ("vllm", ["rollout.engine=vllm"])):
        argv = [*SFT_TINY, f"model.init_from={tmp_path / 'start'}", f"out_dir={tmp_path / name}"]
        assert cli.main(["run", "sft", *argv, *extra]) == 0

    [(run_dir, options, engine)] = started
    assert run_dir == tmp_path / "vllm"
    assert options == {"startup_timeout_s": 900.0, "kv_cache_gib": 1}
    assert engine.closed and engine.version == 1  # synced once, after training; then closed
    for table in ("eval_before.csv", "eval_after.csv"):
        served, builtin = (table_of(tmp_path / n / table) for n in ("vllm", "builtin"))
        assert served[["completion", "finish_reason"]].equals(
            builtin[["completion", "finish_reason"]]
        )
        assert served["correct"].tolist() == builtin["correct"].tolist()
    results = {
        n: json.loads((tmp_path / n / "results.json").read_text()) for n in ("builtin", "vllm")
    }
    assert results["vllm"]["after"] == results["builtin"]["after"]
    assert results["vllm"]["before"] == results["builtin"]["before"]
    # The starting policy's answers vary, so the comparison before can fail; after 3 SFT steps
    # on chain_sum the answers differ from the start's, so a server left on the starting
    # weights (a missed sync) fails the comparison after.
    before = table_of(tmp_path / "builtin" / "eval_before.csv")["completion"]
    after = table_of(tmp_path / "builtin" / "eval_after.csv")["completion"]
    assert before.nunique() > 4 and not set(before) & set(after)
