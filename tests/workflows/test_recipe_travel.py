"""What `posttrain launch` ships of a recipe run: its main and Config, read back and validated
in a fresh process that never loaded the recipe."""

from __future__ import annotations

import subprocess
import sys

import pytest

from posttrain import cli
from posttrain.workflows import override

TRAVELLERS = ["dpo", "ppo", "reward_model"]


@pytest.fixture(scope="module")
def travelled(tmp_path_factory) -> dict[str, list[str] | str]:
    """What `posttrain launch` ships for each of TRAVELLERS, read back in one fresh process that
    never loaded a recipe (one stack import for the three): each recipe's printed line, or the
    process's stderr where it printed none."""
    import cloudpickle

    tmp, steps = tmp_path_factory.mktemp("travel"), {}
    for name in TRAVELLERS:
        module = cli.load_recipe(name)
        cfg = override(module.Config(), {**module.TINY, "out_dir": str(tmp / name / "run")})
        steps[name] = cfg.optim.steps
        (tmp / f"{name}.pkl").write_bytes(cloudpickle.dumps((module.main, cfg)))
    script = (
        "import dataclasses, pickle, sys\n"
        "from posttrain.workflows import validate\n"
        "for path in sys.argv[1:]:\n"
        "    main, cfg = pickle.loads(open(path, 'rb').read())\n"
        "    validate(cfg); again = dataclasses.replace(cfg, resume=True)\n"
        "    print(type(again).__module__, again.optim.steps, callable(main), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *(str(tmp / f"{n}.pkl") for n in TRAVELLERS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line.split() for line in proc.stdout.splitlines()]
    return {
        name: lines[i] if i < len(lines) else f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        for i, name in enumerate(TRAVELLERS)
    } | {f"{name}.steps": str(steps[name]) for name in TRAVELLERS}


@pytest.mark.parametrize("name", TRAVELLERS)
def test_a_recipe_config_travels_to_a_job_and_validates_there(name, travelled):
    """What `posttrain launch` ships: the recipe's main and Config travel by value (the module
    has a made-up name that a job cannot import), the sections by reference (posttrain is
    installed there). In a fresh process that never loaded the recipe, the Config validates
    again (as `main` and a requeue's `dataclasses.replace(cfg, resume=True)` do)."""
    got = travelled[name]
    assert isinstance(got, list), got
    assert got == [f"posttrain_recipe_{name}", travelled[f"{name}.steps"], "True"]
