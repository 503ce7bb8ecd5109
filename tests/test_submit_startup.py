"""`kvbatch submit`'s own process checks the settings and starts the workers without importing torch or
the worker's model stack (runner/worker_actor.py): those seconds are paid by the workers' processes
only, not once more before any of them starts."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.cli import REPO, TINY_CONFIG, export_rows, license_manifest

#: modules the submitting process must not import (torch costs ~3 s, the worker's module ~6 s here)
WORKER_ONLY = frozenset({"torch", "runner.engine.worker"})


def imported(stderr: str) -> set[str]:
    """The modules `python -X importtime` reported importing (one `import time: ... | name` line each)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_a_submit_runs_its_batch_without_importing_torch_in_its_own_process(ray_address, tmp_path):
    job = tmp_path / "job"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "runner", "submit", str(license_manifest(tmp_path, ["BSD"])),
         "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = imported(proc.stderr)
    assert {"runner.pool", "transformers"} <= modules  # the trace covers the whole run
    assert not modules & WORKER_ONLY
    assert [row["status"] for row in export_rows(job)] == ["done"]  # the workers did import them
