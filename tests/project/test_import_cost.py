"""Importing the RL trainer, the RL workflow or the CLI loads no verl and no ray: verl's package
imports ray, ~20 s of wall time per process on a loaded 2-core machine (every rank of a
distributed RL test, every subprocess, every `posttrain` call). verl is imported on first use,
through `posttrain.rl.verl_registry.core_algos()`; tests/rl/test_verl_registry.py checks that
the names listed without it equal verl's and that an RL step still calls verl."""

import json
import subprocess
import sys

from _waits import WAIT_S

# Loaded on first use only; each costs seconds per process.
LAZY = (
    "verl",
    "ray",
    "tensordict",
    "transformers",
    "torchtune",
    "torchao",
    "matplotlib",
    "submitit",
)

# The import paths of a process that touches RL without running a step yet: the trainer, the
# package, the RL workflow (the recipe's config), the CLI's module (`posttrain --help`).
IMPORTS = ("posttrain.rl.trainer", "posttrain.rl", "posttrain.workflows.rl", "posttrain.cli")


def test_rl_trainer_workflow_and_cli_imports_load_no_verl_or_ray():
    code = (
        f"import sys\nfor name in {IMPORTS!r}: __import__(name)\n"
        "import posttrain.rl as rl\n"
        # the names and a name's error need no verl either
        "assert 'grpo' in rl.advantage_estimators() and 'vanilla' in rl.policy_losses()\n"
        f"print(sorted(m for m in {LAZY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"loaded at import: {out.stdout}"


def test_posttrain_help_loads_no_verl_or_ray():
    """`posttrain --help` (the CLI's main, as the console script calls it) exits 0 and has loaded
    none of the heavy packages when it prints its usage."""
    code = (
        "import sys, atexit\n"
        f"atexit.register(lambda: print(sorted(m for m in {LAZY!r} if m in sys.modules)))\n"
        "sys.argv = ['posttrain', '--help']\n"
        "from posttrain.cli import main\nsys.exit(main())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: posttrain" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# What a command that starts no run may load: none of these (each seconds of CPU per call).
HEAVY = (*LAZY, "torch", "pandas", "numpy", "reasoning_gym", "vllm")


def test_commands_that_start_no_run_load_no_torch_or_pandas(tmp_path):
    """The code paths of `posttrain --help`, `posttrain CMD --help`, `ls`, `runs`, and of the
    mistakes found before a recipe is loaded (unknown recipe, preset or run, a missing preset
    file, a malformed override, a finished run given to `resume`), run in one fresh process:
    each exits as it should (0, or 2 with a one-line error) and torch, pandas and the rest are
    still not in sys.modules at the end. The run folder is written by hand: config.json,
    lineage.json, results.json."""
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "config.json").write_text('{"out_dir": "runs/a"}')
    (run / "lineage.json").write_text(
        '{"recipe": {"name": "sft"}, "started": "2026-01-01T00:00:00+00:00", "code": {}}'
    )
    (run / "results.json").write_text('{"after": {"accuracy": 0.25}}')
    calls = [
        (["--help"], 0),
        (["run", "--help"], 0),
        (["resume", "--help"], 0),
        (["ls"], 0),
        (["runs"], 0),
        (["run", "nope"], 2),
        (["run", "sft", "--config", "nope"], 2),
        (["run", "sft", "--config", "missing.yaml"], 2),
        (["run", "sft", "optim.steps"], 2),
        (["resume", "nope"], 2),
        (["resume", "a"], 2),
        (["rerun", "nope"], 2),
        (["runs", "--bogus"], 2),
    ]
    code = (
        "import sys\nfrom posttrain.cli import main\ncodes = []\n"
        f"for argv, _ in {calls!r}:\n"
        "    try:\n        codes.append(main(argv))\n"
        "    except SystemExit as e:\n        codes.append(e.code)\n"
        f"print(codes, sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{[c for _, c in calls]} []", out.stdout
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == sum(c == 2 for _, c in calls), out.stderr  # one line each
    assert "Traceback" not in out.stderr
    assert "runs/a" in out.stdout and "after.accuracy" in out.stdout  # the `runs` table
    assert "sft_lora" in out.stdout and "reward_model" in out.stdout  # the `ls` listing


# Config mistakes of the recipes, whose configs import without the training stack: an unknown
# key (sft, dpo), a bad value (grpo, reward_model), an unknown task name (grpo) and a data file
# of a kind no reader takes (sft).
CONFIG_ERRORS = (
    (["run", "sft", "optim.lrr=1"], "unknown config key 'optim.lrr'; valid keys of optim: "),
    (["run", "grpo", "optim.lr=-1"], "Config.optim.lr=-1.0; must be a finite number > 0"),
    (
        ["run", "grpo", "task.name=no_such_task"],
        "Config.task.name='no_such_task': unknown reasoning-gym task 'no_such_task'; valid names: ",
    ),
    (["run", "dpo", "optim.lrr=1"], "unknown config key 'optim.lrr'; valid keys of optim: "),
    (["run", "reward_model", "optim.lr=-1"], "Config.optim.lr=-1.0; must be a finite number > 0"),
    (
        ["run", "sft", "data.train=rows.xlsx"],
        "Config.data.train='rows.xlsx'; must be a .jsonl/.json/.parquet/.csv path, ",
    ),
)


def test_config_errors_answer_before_torch_or_reasoning_gym_loads(tmp_path):
    """Each of CONFIG_ERRORS (`posttrain run sft optim.lrr=1`, `run grpo optim.lr=-1`, `run dpo
    optim.lrr=1`, `run sft data.train=rows.xlsx`, ...) exits 2 with its one-line error (the
    message a full check gives) without loading torch, reasoning-gym or pandas: the checks that
    need them are deferred (`posttrain.workflows.stack_checks`). All of them together, in one
    fresh process, cost under 2 s of CPU (user + sys, this test's process excluded; each ~0.1-0.2
    s of its own when measured, against ~4-8 s each with torch and reasoning-gym loaded)."""
    code = (
        "import resource, sys\nfrom posttrain.cli import main\ncodes = []\n"
        f"for argv, _ in {CONFIG_ERRORS!r}:\n"
        "    try:\n        codes.append(main(argv))\n"
        "    except SystemExit as e:\n        codes.append(e.code)\n"
        "usage = resource.getrusage(resource.RUSAGE_SELF)\n"
        f"print(codes, sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        "print(usage.ru_utime + usage.ru_stime)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    *_, loaded, cpu_s = out.stdout.strip().splitlines()
    assert loaded == f"{[2] * len(CONFIG_ERRORS)} []", out.stdout
    errors = out.stderr.strip().splitlines()
    assert len(errors) == len(CONFIG_ERRORS), out.stderr
    for line, (_, message) in zip(errors, CONFIG_ERRORS):
        assert line.startswith(f"posttrain run: error: {message}"), line
    assert float(cpu_s) < 2.0, f"{cpu_s} s of CPU for the config errors"


def test_task_names_known_without_reasoning_gym_are_its_registry():
    """The task names a deferred check knows without importing reasoning-gym are exactly the
    installed registry's (a reasoning-gym upgrade that adds or drops a task fails here). The
    registry is read in a fresh process: tests register tasks of their own in this one."""
    from posttrain.workflows.stack_checks import REASONING_GYM_TASKS

    code = "import json, reasoning_gym.factory as f; print(json.dumps(sorted(f.DATASETS)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert list(REASONING_GYM_TASKS) == json.loads(out.stdout)
