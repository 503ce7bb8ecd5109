"""runner/cli.py: usage errors refused before Ray or torch is imported, flags shown as flags, `--version`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner import __version__
from tests.helpers.cli import REPO, kvbatch, write_jsonl

#: what a usage error must be refused without: Ray's and the model stack's imports cost seconds (issue 47 row 17)
HEAVY = ("ray", "torch", "transformers")

#: the CLI in a process that, however it ends, prints which of HEAVY it imported as its last stdout line
_RUN_AND_REPORT = (
    "import json, sys\n"
    "from runner.cli import main\n"
    "try:\n"
    "    main()\n"
    "finally:\n"
    f"    print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
)

USAGE_ERRORS = {
    "missing manifest": (["submit", "{tmp}/missing.jsonl"], "{tmp}/missing.jsonl"),
    "missing folder": (["submit", "{tmp}/no-such-folder/"], "{tmp}/no-such-folder"),
    "missing config": (["submit", "{manifest}", "-c", "{tmp}/missing.yaml"], "{tmp}/missing.yaml"),
    "bad --set": (["submit", "{manifest}", "--set", "summarize.max_new_tokens"], "summarize.max_new_tokens"),
    "gs:// job folder": (["submit", "{manifest}", "-j", "gs://b/x"], "gs://b/x"),
    "resume of a missing folder": (["resume", "{tmp}/no-such-job"], "{tmp}/no-such-job"),
    "resume with a bad --set": (["resume", "{tmp}/old", "--set", "nonsense"], "nonsense"),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_a_usage_error_is_refused_before_ray_or_torch_is_imported(tmp_path: Path, case: str) -> None:
    """A missing manifest took 8.6 s to report (the settings check ran first), a missing folder 13.7 s."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "A short document."}])
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "job.json").write_text("{}")  # a job folder, as far as resume's first check looks
    args, named = ([a.format(tmp=tmp_path, manifest=manifest) for a in USAGE_ERRORS[case][0]],
                   USAGE_ERRORS[case][1].format(tmp=tmp_path))
    job = tmp_path / "job"
    if args[0] == "submit" and "-j" not in args:
        args += ["-j", str(job)]
    proc = subprocess.run([sys.executable, "-c", _RUN_AND_REPORT, *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [], proc.stdout  # none of HEAVY was imported
    assert not job.exists()


def test_help_shows_flags_as_flags_and_offers_no_gs() -> None:
    """`--strict <bool>` read as if --strict took a value (typer's rich help gives every option a type)."""
    for command in ("submit", "resume", "results"):
        text = kvbatch(command, "--help", check=0, timeout=120, env={"COLUMNS": "200"}).stdout
        flags = [line for line in text.splitlines() if line.strip().startswith(("--strict", "--retry-failed",
                                                                                 "--errors", "--help"))]
        assert flags and not any("<bool>" in line or "BOOL" in line for line in flags), text
        assert "gs://" not in text, text


def test_version_prints_the_version_and_exits_0() -> None:
    proc = kvbatch("--version", check=0, timeout=120)
    assert proc.stdout.strip() == f"kvbatch {__version__}"

