"""The README is a user's guide a newcomer can follow: a quick start first, what to type after `make demo`,
under 300 lines, links that lead somewhere; and `make demo` installs what kvbatch runs on, not the tests'."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.helpers.cli import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_a_short_guide() -> None:
    assert len(README.splitlines()) < 300, "internals go to docs/"


def test_a_quick_start_comes_first_and_says_how_to_run_kvbatch() -> None:
    headings = re.findall(r"^## (.+)$", README, flags=re.MULTILINE)
    assert headings[0] == "Quick start", headings
    quick = _section(README, "Quick start")
    assert len(quick.strip().splitlines()) < 20
    assert "make demo" in quick and ".venv/bin/activate" in quick and ".venv/bin/kvbatch" in quick
    for command in ("kvbatch submit", "kvbatch status", "kvbatch results", "kvbatch resume", "kvbatch.submit"):
        assert command in quick, command


def test_the_python_api_is_documented_with_a_runnable_example() -> None:
    python = _section(README, "Python")
    for name in ("kvbatch.submit(", "kvbatch.resume(", "kvbatch.results(", "examples/summarise.py"):
        assert name in python, name
    assert (REPO / "examples" / "summarise.py").is_file()


def test_links_in_the_readme_and_docs_lead_to_files_that_exist() -> None:
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not target.startswith(("http:", "https:", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def _make_dry_run(target: str, tmp_path: Path) -> str:
    """What `make TARGET` would run on a fresh clone (a venv that does not exist yet)."""
    return subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def test_make_demo_installs_no_test_packages_and_make_test_does(tmp_path: Path) -> None:
    demo = _make_dry_run("demo", tmp_path)
    assert "pip install -q -e ." in demo and "[test" not in demo and "[quant" not in demo, demo
    assert f"{tmp_path / 'venv'}/bin/activate" in demo  # it ends by saying how to run kvbatch
    test = _make_dry_run("test", tmp_path)
    assert 'pip install -q -e ".[test,quant]"' in test and "-m pytest" in test
