"""The release metadata agrees with itself: one version in pyproject and the package, and a CHANGELOG entry for it."""

from __future__ import annotations

import pathlib
import re
import tomllib

import rollpool

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_package_and_pyproject_state_one_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == rollpool.__version__


def test_the_changelog_has_an_entry_for_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", changelog, flags=re.M)
    assert versions[0] == "Unreleased"
    assert rollpool.__version__ in versions


def test_the_dev_tools_are_a_dependency_group_not_an_extra() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "dev" not in pyproject["project"]["optional-dependencies"]
    assert "dev" in pyproject["dependency-groups"]
