"""Every module of posttrain imports (a shipped file that cannot be imported is a defect)."""

import importlib
import pkgutil

import pytest

# envs/ and verifiers/ live outside sdk/ (package-dir mapping), so each root is walked separately.
ROOTS = ("posttrain", "posttrain.envs", "posttrain.verifiers")


def _all_modules() -> list[str]:
    names = set(ROOTS)
    for root in ROOTS:
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, prefix=root + "."):
            names.add(info.name)
    return sorted(names)


def test_walk_finds_the_subpackages():
    names = _all_modules()
    assert {"posttrain.envs", "posttrain.verifiers", "posttrain.models", "posttrain.cli"} <= set(names)


@pytest.mark.parametrize("name", _all_modules())
def test_module_imports(name):
    importlib.import_module(name)
