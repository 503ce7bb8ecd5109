"""File-system errors of the commands' own paths (-o, -j, a job folder): one line naming the path and the fix, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import TINY_CONFIG, kvbatch, write_jsonl


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real job folder made by submit without a model run: its only row is rejected."""
    tmp = tmp_path_factory.mktemp("fs")
    manifest = write_jsonl(tmp / "m.jsonl", [{"id": "a"}])
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp / "job"))
    assert (tmp / "job" / "job.json").is_file()
    return tmp / "job"


def _one_line_error(proc, *named: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert all(n in lines[0] for n in named), lines[0]
    return lines[0]


@pytest.mark.parametrize("name", ["x.jsonl", "x.csv", "x.parquet"])
def test_results_into_a_missing_folder_names_the_file(job: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "no" / "such" / name
    line = _one_line_error(kvbatch("results", str(job), "-o", str(out)), str(out))
    assert "No such file or directory" in line and "give -o a file in a folder that exists" in line
    assert not (tmp_path / "no").exists()


def test_results_onto_a_folder_names_it(job: Path, tmp_path: Path) -> None:
    line = _one_line_error(kvbatch("results", str(job), "-o", str(tmp_path)), str(tmp_path))
    assert "Is a directory" in line


def test_report_into_a_missing_folder_names_the_file(job: Path, tmp_path: Path) -> None:
    out = tmp_path / "no" / "such" / "r.html"
    line = _one_line_error(kvbatch("report", str(job), "-o", str(out)), str(out))
    assert "give -o a file" in line and not (tmp_path / "no").exists()


def test_submit_with_a_file_as_job_folder_creates_nothing(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "hello"}])
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    for target in (taken, taken / "job"):
        line = _one_line_error(kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(target)), str(taken))
        assert "is a file, not a folder" in line
    assert taken.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl", "notes.txt"]


@pytest.mark.parametrize("command", ["status", "results", "resume"])
def test_a_file_given_as_job_folder_is_named(tmp_path: Path, command: str) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    line = _one_line_error(kvbatch(command, str(taken)), str(taken))
    assert "is not a job folder" in line and "is a file" in line
