"""What the CLI says in the moments a user reads most closely: a refusal, a folder that is no job, a bare
`kvbatch clean` as the README shows it, a SIGTERM that comes after the last document ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from storage.checkpoint import load_state
from tests.helpers.child_process import Child
from tests.helpers.cli import REPO, TINY_CONFIG, refusal, start_submit, wait_for, write_jsonl

HOLD_DIR = """
import sys, time
from pathlib import Path
from storage.scratch import task_scratch
with task_scratch(Path(sys.argv[1]), sys.argv[2], "t000001", 1) as scratch:
    print(scratch, flush=True)
    time.sleep(600)
"""


def test_a_refused_submit_names_no_job(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "hello"}, {"id": "b"}])
    for extra in (["--set", "cache.stratgy=dynamic"], ["--strict"]):
        proc = refusal("submit", str(manifest), "-j", str(tmp_path / "job"), *extra)
        assert "job " not in proc.stdout and "->" not in proc.stdout, proc.stdout
        assert not (tmp_path / "job").exists()


def test_status_of_a_folder_without_results_says_it_is_no_job_folder(tmp_path: Path) -> None:
    (tmp_path / "events").mkdir()  # something, but no job.json and no results/
    proc = refusal("status", str(tmp_path))
    message = " ".join(proc.stderr.split())
    assert f"{tmp_path} is not a job folder" in message and "intact" not in message, message


def test_bare_kvbatch_clean_sweeps_the_jobs_in_runs(tmp_path: Path) -> None:
    """The README's `kvbatch clean`, with no argument, in the folder where jobs were submitted without -j."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": "1000"}
    env.pop("KVBATCH_OFFLOAD_ROOT", None)
    write_jsonl(tmp_path / "m.jsonl", [{"id": "a"}])  # rejected: a job folder without Ray

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runner", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    assert cli("submit", "m.jsonl", "-c", str(TINY_CONFIG)).returncode == 3
    [job] = list((tmp_path / "runs").iterdir())
    root = job / "scratch" / "kvbatch"
    dead = Child(HOLD_DIR, str(root), job.name)
    left = Path(dead.read_line())
    dead.kill()  # SIGKILL: its dir stays behind, owned by a process that is gone
    assert left.is_dir()
    proc = cli("clean")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"removed {left}" in proc.stdout and "freed 1 dir(s)" in proc.stdout, proc.stdout
    assert not left.exists()


def test_sigterm_after_every_document_ended_is_no_interruption(ray_address, tmp_path: Path) -> None:
    docs = [{"id": f"d{i}", "text": f"Note {i}: the board met and approved the budget."} for i in range(3)]
    job = tmp_path / "job"
    proc = start_submit(write_jsonl(tmp_path / "m.jsonl", docs), job, ray_address,
                        "--set", "checkpoint.flush_every=1")
    try:
        def all_done() -> bool:
            try:
                return len(load_state(job).done_task_ids) == len(docs)
            except OSError:
                return False

        assert wait_for(all_done, proc, timeout=300, poll=0.005), proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "nothing was interrupted" in out, out + err  # the signal came after the last document ended
    assert proc.returncode == 0, out + err
    assert "done 3, failed 0, rejected 0" in out and "kvbatch resume" not in out
