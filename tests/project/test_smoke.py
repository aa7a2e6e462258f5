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
    assert {
        "posttrain.envs",
        "posttrain.verifiers",
        "posttrain.models.specs",
        "posttrain.cli",
    } <= set(names)


@pytest.mark.parametrize("name", _all_modules())
def test_module_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize("name", _all_modules())
def test_docstring_examples_run(name):
    """Every docstring example of a shipped module runs and prints what it shows."""
    import doctest

    module = importlib.import_module(name)
    if "needs a sandbox" in (module.__doc__ or ""):  # its example runs a sandboxed program
        from posttrain.verifiers.sandbox import sandbox_available

        if (reason := sandbox_available()) is not None:
            pytest.skip(f"{name}'s example needs the code sandbox: {reason}")
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=False
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
