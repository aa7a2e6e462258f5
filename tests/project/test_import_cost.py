"""Importing the RL trainer, the RL workflow or the CLI loads no verl and no ray: verl's package
imports ray, ~20 s of wall time per process on a loaded 2-core machine (every rank of a
distributed RL test, every subprocess, every `posttrain` call). verl is imported on first use,
through `posttrain.rl.verl_registry.core_algos()`; tests/rl/test_verl_registry.py checks that
the names listed without it equal verl's and that an RL step still calls verl."""

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
