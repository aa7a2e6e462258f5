"""Every `posttrain.*` module name is also a path that static tools can follow.

pyproject.toml maps sdk/ -> posttrain, envs/ -> posttrain.envs and verifiers/ ->
posttrain.verifiers with setuptools `package-dir`, which only the installer reads. Three
committed relative links spell the same mapping as folders (`posttrain -> sdk`,
`sdk/envs -> ../envs`, `sdk/verifiers -> ../verifiers`), so ruff, mypy, editors and code search
find `posttrain/train/parallel.py` for `posttrain.train.parallel` without the editable install
(docs/design/static_checks.md). These tests hold the links to the mapping and check that the links
give no module a second name at run time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]


def _module_files() -> dict[str, Path]:
    """Every posttrain module name -> its file, read from the package-dir mapping (not the
    links)."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGE_DIR.items():
        for path in sorted((ROOT / folder).rglob("*.py")):  # rglob does not enter linked folders
            parts = [
                p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"
            ]
            out[".".join([package, *parts])] = path
    return out


def _static_path(module: str) -> Path:
    """Where a tool that knows nothing of package-dir looks for `module` from the repo root."""
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def test_the_links_spell_the_package_dir_mapping():
    for package, folder in PACKAGE_DIR.items():
        path = ROOT.joinpath(*package.split("."))
        assert path.resolve() == (ROOT / folder).resolve(), (
            f"{path.relative_to(ROOT)} must lead to {folder}/ as pyproject's package-dir maps "
            f"{package} (a committed relative link; docs/design/static_checks.md)"
        )
    links = {"posttrain": "sdk", "sdk/envs": "../envs", "sdk/verifiers": "../verifiers"}
    for link, target in links.items():
        assert (ROOT / link).is_symlink(), f"{link} must be a link to {target}"
        assert os.readlink(ROOT / link) == target, (
            f"{link} -> {os.readlink(ROOT / link)}; must be the relative {target} so that any "
            "clone resolves it"
        )


def test_every_module_resolves_statically_to_its_one_file():
    modules = _module_files()
    assert {"posttrain.train.parallel", "posttrain.envs", "posttrain.verifiers.basic"} <= set(
        modules
    )
    wrong = {
        m: str(_static_path(m).relative_to(ROOT))
        for m, f in modules.items()
        if not _static_path(m).is_file() or _static_path(m).resolve() != f.resolve()
    }
    assert not wrong, (
        f"{len(wrong)} modules whose folder path is not their file, e.g. "
        f"{dict(sorted(wrong.items())[:5])}"
    )


def test_ruff_maps_posttrain_imports_to_files():
    """ruff's import graph (what its isort rules and `ruff analyze` see) follows the links."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.is_file():
        pytest.skip(f"ruff is not installed beside {sys.executable} (`make install` installs it)")
    done = subprocess.run(
        [str(ruff), "analyze", "graph", "envs/code_env.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout)["envs/code_env.py"]
    for module in (
        "posttrain.rewards.verifier",
        "posttrain.envs.reasoning_gym_env",
        "posttrain.verifiers.code_exec",
    ):
        path = str(_static_path(module).relative_to(ROOT))
        assert path in imported, f"ruff did not map {module} to {path}: {imported}"


_PROBE = """
import importlib.util, json, os, sys
import posttrain, posttrain.core.registry
names = ["posttrain", "posttrain.envs", "posttrain.verifiers", "posttrain.core.registry"]
origins = {n: os.path.realpath(importlib.util.find_spec(n).origin) for n in names}
files = {}
for name, module in list(sys.modules.items()):
    f = getattr(module, "__file__", None)
    if f and name.split(".")[0] in ("posttrain", "sdk", "envs", "verifiers"):
        files.setdefault(os.path.realpath(f), []).append(name)
print(json.dumps({"origins": origins, "files": files}))
"""


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_one_name_per_file_at_run_time(where, tmp_path):
    """From the repo root `import posttrain` finds the `posttrain` link (the current folder
    comes first on sys.path); elsewhere the editable install's finder. Either way each file is
    one module, under its posttrain name, and the names reach the mapped folders."""
    cwd = ROOT if where == "root" else tmp_path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    expected = {
        "posttrain": ROOT / "sdk" / "__init__.py",
        "posttrain.envs": ROOT / "envs" / "__init__.py",
        "posttrain.verifiers": ROOT / "verifiers" / "__init__.py",
        "posttrain.core.registry": ROOT / "sdk" / "core" / "registry.py",
    }
    if where == "elsewhere" and Path(found["origins"]["posttrain"]) != expected["posttrain"]:
        pytest.skip(
            f"posttrain is installed from {found['origins']['posttrain']}, not this "
            "checkout (editable)"
        )
    assert {n: Path(o) for n, o in found["origins"].items()} == expected
    twice = {f: names for f, names in found["files"].items() if len(names) > 1}
    assert not twice, f"files imported under two module names: {twice}"
    assert all(
        name.startswith("posttrain") for names in found["files"].values() for name in names
    ), found["files"]
