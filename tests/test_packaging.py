"""The docs ship as package data and ``dpsql help`` prints them from the installed package;
pyproject's package-data globs cover every topic (the wheel itself is built by .ci/run's
wheel smoke step, not here: it is slow)."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import ROOT

from dpsql import helpdocs
from dpsql.cli import main


def test_every_doc_is_a_topic():
    topics = helpdocs.topics()
    assert {"readme", "grammar"} <= topics.keys()
    for doc in (ROOT / "docs").glob("*.md"):
        assert doc.stem in topics, f"docs/{doc.name} is not a dpsql help topic"
        assert topics[doc.stem].read_text(encoding="utf-8") == doc.read_text(encoding="utf-8")
    assert helpdocs.text("readme") == (ROOT / "README.md").read_text(encoding="utf-8")


def test_package_data_globs_cover_every_topic():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["dpsql"]
    package = ROOT / "dpsql"
    for topic, doc in helpdocs.topics().items():
        relative = Path(str(doc)).relative_to(package).as_posix()
        assert any(
            fnmatch.fnmatch(relative, p) and p.count("/") == relative.count("/") for p in patterns
        ), f"{topic}: {relative} is in no package-data glob"


def test_help_grammar_from_the_installed_package(tmp_path):
    # another directory, so the package is the installed one (its dpsql/docs data)
    proc = subprocess.run(
        [sys.executable, "-m", "dpsql", "help", "grammar"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# dpsql grammar notes")
    proc = subprocess.run(
        [sys.executable, "-c", "import dpsql, sys; sys.stdout.write(dpsql.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert Path(proc.stdout).parent.joinpath("docs", "grammar_notes.md").is_file()


def test_help_lists_topics_with_titles(capsys):
    assert main(["help"]) == 0
    out = capsys.readouterr().out
    assert "threat_model" in out and "Threat model" in out and "readme" in out
    assert main(["help", "ux"]) == 0
    assert capsys.readouterr().out.startswith("# What an analyst sees")
