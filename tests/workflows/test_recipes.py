"""Every recipe runs at tiny size (a recipe may define TINY: dotted Config overrides for tests),
its set of config keys is frozen, and bad values fail before anything is written."""

import json
import re

import pytest

from posttrain import cli
from posttrain.workflows import config_keys, override
from posttrain.workflows.recipe_run import RecipeRun

RECIPES = sorted(p.stem for p in cli.recipe_dirs()[1].glob("*.py") if not p.name.startswith("_"))


def _tiny(module, tmp_path, **extra):
    """The recipe's Config with its TINY overrides, writing under `tmp_path / "run"`."""
    return override(
        module.Config(), {**getattr(module, "TINY", {}), "out_dir": str(tmp_path / "run"), **extra}
    )


def test_recipes_are_found():
    assert "demo" in RECIPES


def test_a_recipe_file_python_cannot_import_is_named(tmp_path):
    path = tmp_path / "recipes" / "notes.txt"  # found as a file, but not a module
    path.parent.mkdir()
    path.write_text("print('hi')\n")
    with pytest.raises(ValueError, match=r"notes\.txt.*is not a Python file; name it NAME\.py"):
        cli.load_recipe(str(path))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_at_tiny_size(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = cli.load_recipe(name)
    module.main(_tiny(module, tmp_path))


def test_demo_via_cli_writes_a_hf_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "demo", "sampling.max_new_tokens=8", f"out_dir={tmp_path / 'd'}"]) == 0
    assert (tmp_path / "d" / "policy" / "config.json").is_file()
    assert "reloaded greedy output identical: True" in capsys.readouterr().out


PRESETS = sorted((cli.recipe_dirs()[1] / "presets").glob("*.yaml"))


def _preset_recipe(path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# recipe: "), f"{path.name} must start with '# recipe: NAME'"
    return first.removeprefix("# recipe: ").strip()


def test_presets_are_found():
    assert {"sft_chain_sum", "cpt_chain_sum"} <= {p.stem for p in PRESETS}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_fills_its_recipe_config(path):
    """Presets are nested like the Config; each one loads (the run itself is pinned bitwise by
    tests/project/test_refactor_guard.py: metrics, saved weights, evaluation tables,
    results.json)."""
    module = cli.load_recipe(_preset_recipe(path))
    cfg = cli.load_config_file(module.Config(), str(path))
    assert cfg.out_dir.startswith("runs/")


# The dotted config keys of every recipe, built from the sections recipes share (each written
# once: a key added to a shared section is added here once). A rename or a new key is a
# deliberate change: update these lists, the presets, the docs and the Makefile together.


def _keys(section: str, *names: str) -> list[str]:
    return [f"{section}.{name}" for name in names]


MODEL_KEYS = _keys("model", "init_from", "name")
SAMPLING_KEYS = _keys("sampling", "max_new_tokens", "temperature", "top_p")
TASK_KEYS = _keys("task", "demo_options", "eval_seed", "eval_size", "name", "options", "train_size")
OPTIM_KEYS = _keys(
    "optim",
    "loss_chunk_tokens",
    "lr",
    "max_grad_norm",
    "min_lr_ratio",
    "steps",
    "warmup_steps",
    "weight_decay",
)
BATCH_OPTIM_KEYS = OPTIM_KEYS + _keys("optim", "batch_size", "grad_accum_steps")
SFT_WARM_START_KEYS = _keys(
    "sft",
    "batch_size",
    "demonstrations",
    "grad_accum_steps",
    "loss_chunk_tokens",
    "lr",
    "max_grad_norm",
    "min_lr_ratio",
    "steps",
    "warmup_steps",
    "weight_decay",
)
PAIRS_KEYS = _keys("pairs", "num_prompts", "reference_answer", "samples_per_prompt")
PARALLEL_KEYS = _keys(
    "parallel",
    "activation_checkpointing",
    "compile",
    "cpu_offload",
    "dp_replicate",
    "dp_shard",
    "ep",
    "n_microbatches",
    "param_dtype",
    "pp",
    "pp_schedule",
    "reduce_dtype",
    "sp",
    "tp",
)
CONVERTER_KEYS = _keys("adapters", "alpha", "dropout", "method", "modules", "rank") + _keys(
    "quantization", "fp8_recipe", "qat_group_size", "qat_scheme", "training"
)
ROLLOUT_KEYS = _keys("rollout", "engine", "kv_cache_gib", "startup_timeout_s", "url")
RL_ROLLOUT_KEYS = _keys(
    "quantization", "rollout", "rollout_correction", "rollout_is_threshold"
) + _keys("rollout", "max_staleness")
# Every training recipe: a run folder that checkpoints and resumes, a model, a task and its
# evaluation (sampled by the rollout engine), a parallel plan, adapters and quantisation, and
# experiment trackers.
TRAINING_KEYS = [
    "out_dir",
    "progress",
    "resume",
    "seed",
    *_keys("checkpoint", "every", "keep_last", "permissions"),
    *_keys("eval", "every", "max_new_tokens"),
    *MODEL_KEYS,
    *TASK_KEYS,
    *PARALLEL_KEYS,
    *CONVERTER_KEYS,
    *ROLLOUT_KEYS,
    *_keys("logging", "experiment", "mlflow_tracking_uri", "trackers", "wandb_dir", "wandb_mode"),
]
CONFIG_KEYS = {
    "demo": ["out_dir", "prompts", "seed", *MODEL_KEYS, *SAMPLING_KEYS],
    "dpo": [
        *TRAINING_KEYS,
        *BATCH_OPTIM_KEYS,
        *SFT_WARM_START_KEYS,
        *SAMPLING_KEYS,
        *PAIRS_KEYS,
        "beta",
        "budget_s",
        "dpo_loss_type",
        "f_alpha_divergence_coef",
        "f_divergence_type",
        "ipo_length_normalize",
        "kto_desirable_weight",
        "kto_undesirable_weight",
        "label_smoothing",
        "loss",
        "max_seq_len",
        "simpo_gamma",
        "val_pairs",
        "eval.samples",
        *_keys("data", "eval", "eval_fraction", "eval_rows", "eval_split", "seed", "split"),
        "data.train",
    ],
    "grpo": [
        *TRAINING_KEYS,
        *OPTIM_KEYS,
        *SFT_WARM_START_KEYS,
        *SAMPLING_KEYS,
        *RL_ROLLOUT_KEYS,
        "eval.samples",
        *_keys("baseline", "lr", "steps"),
        *_keys("rewards", "funcs", "weights"),
        *_keys("data", "eval", "eval_fraction", "eval_rows", "eval_split", "seed", "split"),
        "data.train",
        *_keys(
            "rl",
            "algo",
            "clip_ratio_high",
            "clip_ratio_low",
            "filter_groups",
            "group_size",
            "kl_coef",
            "max_num_gen_batches",
            "minibatch_size",
            "overlong_buffer_len",
            "overlong_penalty_factor",
            "ppo_epochs",
            "prompts_per_step",
        ),
    ],
    "reward_model": [
        *TRAINING_KEYS,
        *BATCH_OPTIM_KEYS,
        *SFT_WARM_START_KEYS,
        *SAMPLING_KEYS,
        *PAIRS_KEYS,
        "held_out_fraction",
        "margin",
        "prompt_seed",
        *_keys("data", "eval", "eval_fraction", "eval_rows", "eval_split", "seed", "split"),
        "data.train",
    ],
    "sft": [
        *TRAINING_KEYS,
        *BATCH_OPTIM_KEYS,
        *_keys("data", "eval", "eval_fraction", "eval_rows", "eval_split", "seed", "split"),
        "data.train",
        "max_seq_len",
        "mode",
        "pack",
    ],
}
CONFIG_KEYS["ppo"] = CONFIG_KEYS["grpo"]  # the same sections, PPO defaults
# one process, full training: no parallel plan, adapters or quantisation
CONFIG_KEYS["rft"] = [
    *(k for k in TRAINING_KEYS if k not in PARALLEL_KEYS + CONVERTER_KEYS),
    *SFT_WARM_START_KEYS,
    *SAMPLING_KEYS,
    "eval.samples",
    *(f"rft.{k.removeprefix('optim.')}" for k in BATCH_OPTIM_KEYS),
    *_keys(
        "rft",
        "budget_s",
        "keep",
        "max_per_prompt",
        "prompts_per_round",
        "rounds",
        "samples_per_prompt",
    ),
]


def test_every_recipe_has_its_keys_frozen():
    assert sorted(CONFIG_KEYS) == RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_config_keys_are_frozen(name):
    """A key the recipe lost or gained, or a key written twice in the lists above, fails."""
    assert config_keys(cli.load_recipe(name).Config()) == sorted(CONFIG_KEYS[name])


def test_recipes_never_import_each_other():
    for path in cli.recipe_dirs()[1].glob("*.py"):
        assert "load_recipe" not in path.read_text(), f"{path.name} loads another recipe"


def test_recipe_refuses_a_used_run_dir_before_writing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sft = cli.load_recipe("sft")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a run"):
        sft.main(_tiny(sft, tmp_path))
    assert (run / "config.json").read_text() == "{}"
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl"]


def test_sft_config_rejects_warmup_longer_than_training():
    sft = cli.load_recipe("sft")
    with pytest.raises(
        ValueError,
        match=r"Config\.optim\.warmup_steps=20 exceeds "
        r"Config\.optim\.steps=5",
    ):
        override(sft.Config(), {"optim.steps": 5})


@pytest.mark.parametrize(
    "name, overrides, field",
    [
        ("dpo", {"optim.max_grad_norm": -1.0}, "optim.max_grad_norm"),
        ("dpo", {"optim.lr": float("inf")}, "optim.lr"),
        ("dpo", {"sampling.temperature": float("inf")}, "sampling.temperature"),
        ("dpo", {"model.init_from": "/nonexistent/policy"}, "model.init_from"),
        ("dpo", {"pairs.num_prompts": 8, "val_pairs": 50}, "val_pairs"),
        ("dpo", {"loss": "ipo", "label_smoothing": 0.3}, "label_smoothing"),
        ("dpo", {"dpo_loss_type": "nope"}, "dpo_loss_type"),
        ("dpo", {"loss": "ipo", "dpo_loss_type": "robust"}, "dpo_loss_type"),
        ("dpo", {"f_divergence_type": "kl"}, "f_divergence_type"),
        ("reward_model", {"margin": float("nan")}, "margin"),
        ("reward_model", {"pairs.num_prompts": 1}, "pairs.num_prompts"),
        ("sft", {"optim.lr": float("nan")}, "optim.lr"),
        ("sft", {"model.init_from": "/nonexistent/policy"}, "model.init_from"),
        ("grpo", {"rl.kl_coef": -1.0}, "rl.kl_coef"),
        ("grpo", {"sft.demonstrations": 0}, "sft.demonstrations"),
        ("grpo", {"sft.demonstrations": 30000}, "sft.demonstrations"),
        ("dpo", {"sft.demonstrations": 1.5}, "sft.demonstrations"),
        ("grpo", {"rl.max_num_gen_batches": 0}, "rl.max_num_gen_batches"),
        ("grpo", {"optim.lr": float("inf")}, "optim.lr"),
        ("sft", {"mode": "rlhf"}, "mode"),
        ("sft", {"model.name": "tiny-9t"}, "model.name"),
    ],
)
def test_bad_config_values_fail_before_any_stage_runs(name, overrides, field):
    """Values that used to pass `__post_init__` and fail minutes later (after SFT and sampling
    had written into the run folder) fail at construction, naming the dotted field."""
    module = cli.load_recipe(name)
    with pytest.raises(ValueError, match=rf"Config\.{field}="):
        override(module.Config(), overrides)


# Fault kinds: each is refused by `posttrain run` as a usage error naming the dotted field, before
# the run folder exists.
FAULTS = [
    ("grpo", "rl.group_size=1", r"Config\.rl\.group_size=1: .*at least 2"),
    ("ppo", "rl.algo=grpo", r"Config\.rl\.group_size=1"),  # PPO's group of one under GRPO
    ("sft", "checkpoint.keep_last=0", r"Config\.checkpoint\.keep_last=0; must be an integer >= 1"),
    ("dpo", "checkpoint.keep_last=0", r"Config\.checkpoint\.keep_last=0"),
    ("sft", "max_seq_len=4096", r"Config\.max_seq_len=4096; must be at most 512"),
    ("dpo", "max_seq_len=513", r"Config\.max_seq_len=513; must be at most 512"),
    (
        "sft",
        "task.options.max_term=3",
        r"Config\.task\.options=.*unknown option.*'max_term'.*"
        r"valid options: min_terms, max_terms",
    ),
    ("ppo", "task.options.min_terms=3", r"Config\.task\.options=.*max_terms must be >= min_terms"),
    ("grpo", "task.options.min_terms=3", r"Config\.task\.options=.*unknown option.*'min_terms'"),
    ("reward_model", "task.options={min_digits: 3, max_digits: 1}", r"Config\.task\.options="),
    ("grpo", "task.demo_options=short", r"Config\.task\.demo_options='short'; must be None"),
    (
        "grpo",
        "task.demo_options={min_word_len: 3, max_len: 5}",
        r"Config\.task\.demo_options=.*unknown option.*'max_len'",
    ),
    (
        "sft",
        "task.demo_options={min_terms: 3, max_terms: 2}",
        r"Config\.task\.demo_options=.*max_terms must be",
    ),
    ("sft", "task.demo_options.min_terms=3", r"'task\.demo_options' has no keys of its own"),
    ("sft", "seed=-1", r"Config\.seed=-1; must be an integer in \[0, 4294967295\]"),
    ("grpo", "task.eval_seed=4294967296", r"Config\.task\.eval_seed=4294967296"),
    ("reward_model", "prompt_seed=-3", r"Config\.prompt_seed=-3"),
    ("dpo", "out_dir=", r"Config\.out_dir=''; must be a non-empty folder path"),
    ("grpo", "out_dir= ", r"Config\.out_dir=' '"),
]


@pytest.mark.parametrize("name, override_, message", FAULTS)
def test_fault_is_a_usage_error_before_any_folder_exists(
    name, override_, message, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    start = RecipeRun.start.__func__

    def accepted(cls, *args, **kwargs):  # a case that is no fault stops here, not minutes later
        start(cls, *args, **kwargs)
        raise AssertionError(f"{override_!r} was accepted: the run started")

    monkeypatch.setattr(RecipeRun, "start", classmethod(accepted))
    args = ["run", name, override_]
    if not override_.startswith("out_dir="):
        args.append(f"out_dir={tmp_path / 'run'}")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert list(tmp_path.iterdir()) == []  # nothing written: no run folder, nothing in cwd


def test_a_section_changed_in_place_is_validated_again_before_writing(tmp_path):
    """A notebook may set `cfg.checkpoint.keep_last = 0` after building the Config; `main`
    checks the whole config again before it creates the run folder."""
    sft = cli.load_recipe("sft")
    cfg = _tiny(sft, tmp_path)
    cfg.checkpoint.keep_last = 0
    with pytest.raises(ValueError, match=r"Config\.checkpoint\.keep_last=0"):
        sft.main(cfg)
    assert not (tmp_path / "run").exists()


def test_a_section_must_be_its_section_type():
    sft = cli.load_recipe("sft")
    with pytest.raises(TypeError, match=r"Config\.optim must be a BatchOptimConfig"):
        sft.Config(optim={"lr": 1.0})


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"dpo_loss_type": "robust", "label_smoothing": 0.1},
            {"loss_type": "robust", "label_smoothing": 0.1},
        ),
        (
            {
                "dpo_loss_type": "sigmoid",
                "f_divergence_type": "alpha_divergence",
                "f_alpha_divergence_coef": 0.3,
            },
            {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
        ),
        ({"dpo_loss_type": "dpop"}, {"loss_type": "dpop"}),
    ],
)
def test_dpo_recipe_reaches_every_dpo_loss_type(overrides, expected):
    """A loss ablation is one config key: the recipe builds the DPOLoss those options name."""
    from posttrain.preference import DPOLoss

    module = cli.load_recipe("dpo")
    built = override(module.Config(), overrides).build_loss()
    assert repr(built) == repr(DPOLoss(beta=0.1, **expected))


CALLS: list[dict] = []


def quarter(completions, answer, completion_ids, **kwargs):
    """A reward function written for TRL's GRPOTrainer: 0.25 for each completion of an item
    with an answer."""
    CALLS.append({"n": len(completions), "answer": list(answer), "ids": len(completion_ids)})
    return [0.25 if a else None for a in answer]


def test_the_spell_backward_grpo_preset_runs_at_tiny_size(tmp_path, monkeypatch):
    """The longer preset where GRPO measurably learns (docs/benchmarks/results.md) runs end to end
    at tiny size on its own task, and its results name that task. The same run takes its rewards
    from a function named by import path (`rewards:` in a second preset file): weight 2 on
    `quarter` makes every reward 2 * 0.25 = 0.5, so each step's logged mean is 0.5 (the task's
    verifier would give 0 or 1), from one call per group with the group's answer column."""
    monkeypatch.chdir(tmp_path)
    module = cli.load_recipe("grpo")
    cfg = cli.load_config_file(
        module.Config(), str(cli.recipe_dirs()[1] / "presets" / "grpo_spell_backward.yaml")
    )
    assert (cfg.task.name, cfg.rl.prompts_per_step, cfg.optim.steps) == ("spell_backward", 64, 600)
    (tmp_path / "own.yaml").write_text(
        f"rewards:\n  funcs: ['{__name__}:quarter']\n  weights: [2]\n"
    )
    cfg = cli.load_config_file(cfg, str(tmp_path / "own.yaml"))
    CALLS.clear()
    results = module.main(override(cfg, {**module.TINY, "out_dir": str(tmp_path / "run")}))
    assert results["task_config"] == {"min_word_len": 3, "max_word_len": 5}
    assert 0.0 <= results["after_grpo"]["accuracy"] <= 1.0
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["reward_mean"] for r in rows if "reward_mean" in r] == [0.5] * module.TINY[
        "optim.steps"
    ]
    assert len(CALLS) == module.TINY["optim.steps"] * module.TINY["rl.prompts_per_step"]
    group_size = module.TINY["rl.group_size"]
    assert all(c["n"] == c["ids"] == group_size and len(set(c["answer"])) == 1 for c in CALLS)
