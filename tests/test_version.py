"""One version, in one place: ``setvalued.__version__``, which pyproject.toml reads (the
distribution's version) and CHANGELOG.md heads its latest entries with."""

from __future__ import annotations

import re
from pathlib import Path

import setvalued

ROOT = Path(__file__).resolve().parents[1]


def test_the_distribution_reads_its_version_from_setvalued():
    """What a build of the distribution is versioned: pyproject.toml's version, resolved by
    setuptools as pip does, is ``setvalued.__version__``."""
    from setuptools.config.pyprojecttoml import read_configuration

    project = read_configuration(ROOT / "pyproject.toml", expand=True)["project"]
    assert project["version"] == setvalued.__version__


def test_the_version_is_declared_once():
    """pyproject.toml states no version of its own: it is dynamic, from setvalued.__version__."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M), "pyproject.toml's [project] states a version"
    assert 'dynamic = ["version"]' in project
    assert 'version = { attr = "setvalued.__version__" }' in text


def test_the_changelog_starts_with_this_version():
    """The changelog's first version heading is the version the code carries: a release's
    entries are written under its number before it ships."""
    headings = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]?", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert headings, "CHANGELOG.md has no version heading (## 0.2.0 ...)"
    assert headings[0] == setvalued.__version__
