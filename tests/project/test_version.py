"""posttrain's version is written once, as `posttrain.__version__` (sdk/__init__.py):
pyproject.toml declares it dynamic and setuptools reads that assignment, so the installed metadata,
the package and the changelog agree.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import tomllib
from packaging.version import Version
from setuptools.config.expand import read_attr

import posttrain

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_reads_the_version_from_the_package():
    project = PYPROJECT["project"]
    assert "version" not in project, "pyproject.toml must not write the version a second time"
    assert "version" in project.get("dynamic", [])
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "posttrain.__version__"
    }


def test_the_build_reads_the_same_version_without_importing_the_package():
    # What setuptools does at build time, with pyproject's own package-dir mapping.
    package_dir = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert (
        read_attr("posttrain.__version__", package_dir=package_dir, root_dir=ROOT)
        == posttrain.__version__
    )


def test_the_installed_metadata_agrees():
    installed = importlib.metadata.version("posttrain")
    assert installed == posttrain.__version__, (
        f"installed metadata says {installed}, posttrain.__version__ is {posttrain.__version__}: "
        "an editable install records the version when installed; run `pip install -e . --no-deps`"
    )


def test_the_version_is_pep440_and_has_a_changelog_section():
    version = Version(posttrain.__version__)
    assert str(version) == posttrain.__version__, "write the version in its normal form"
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert sections[0] == "Unreleased", "CHANGELOG.md starts with an [Unreleased] section"
    assert posttrain.__version__ in sections, (
        f"CHANGELOG.md has no section for {posttrain.__version__}: {sections}"
    )
