"""The Python API (`import kvbatch`): a real tiny-model batch from a list of dicts, resumed and read back in
input order, the example script as the README shows it, and bad settings raised before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvbatch
from jobs.config import ConfigError
from tests.helpers.cli import REPO, TINY_CONFIG
from tests.helpers.cli import kvbatch as cli

#: run in a child process: a batch owns its Ray session (a private one, or a connection to `address`)
BATCH = """
import json, sys
import kvbatch
config, address = sys.argv[1], sys.argv[2]
docs = [
    {"id": "long", "path": "docs/long.txt", "team": "legal"},  # relative: from the working directory
    {"id": "nothing"},  # neither text nor path: rejected, and listed in its place
    {"id": "short", "text": "The board met on Monday and approved the budget.", "max_new_tokens": 8},
]
job = kvbatch.submit(docs, job_dir="job", config=config, address=address, quiet=True,
                     settings={"summarize.max_new_tokens": 12, "workers.count": 1})
again = kvbatch.resume("job", address=address, quiet=True)
print(json.dumps({"job": [job.job_dir, job.exit_code, job.finished], "again": [again.exit_code, again.finished],
                  "rows": kvbatch.results("job"), "errors": kvbatch.results("job", errors_only=True)}))
"""


def test_a_batch_from_python_returns_rows_in_input_order(ray_address, tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "long.txt").write_text("The committee reviewed the quarterly figures. " * 60)
    proc = subprocess.run([sys.executable, "-c", BATCH, str(TINY_CONFIG), ray_address], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["job"] == ["job", 3, True]  # every document ended, but one was left undone: exit 3, as the CLI's
    assert out["again"] == [3, True]  # nothing left to run, the rejected row still undone
    rows = out["rows"]
    assert [r["doc_id"] for r in rows] == ["long", "nothing", "short"]
    assert [r["status"] for r in rows] == ["done", "rejected", "done"]
    assert rows[0]["team"] == "legal" and rows[0]["summary"] and 0 < rows[2]["output_tokens"] <= 8
    assert [r["doc_id"] for r in out["errors"]] == ["nothing"]
    exported = [json.loads(line) for line in cli("results", str(tmp_path / "job"), check=0).stdout.splitlines()]
    assert exported == rows  # the CLI reads the same job folder, the same rows


def test_the_example_script_runs(ray_address, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "summarise.py"), "-c", str(TINY_CONFIG),
                           "--address", ray_address, "-j", str(tmp_path / "job")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["memo", "bsd", "apache"], proc.stdout
    assert all(" done, " in line for line in lines) and lines[0].startswith("memo [finance] done")


def test_a_bad_setting_raises_before_anything_is_made(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cache.stratgy"):
        kvbatch.submit([{"id": "a", "text": "hello"}], job_dir=tmp_path / "job", settings={"cache.stratgy": "dynamic"},
                       quiet=True)
    assert not (tmp_path / "job").exists()


#: a caller with children of its own (a plain subprocess and a multiprocessing one) runs a batch on a private Ray
CALLER_WITH_CHILDREN = """
import json, multiprocessing, subprocess, sys, time
import kvbatch
if __name__ == "__main__":
    sleeper = subprocess.Popen(["sleep", "1000"])
    helper = multiprocessing.Process(target=time.sleep, args=(1000,))
    helper.start()
    job = kvbatch.submit([{"id": "a", "text": "The board met on Monday and approved the budget."}], job_dir="job",
                         config=sys.argv[1], settings={"workers.count": 1}, quiet=True)
    # submit returned after the private Ray's reaper ended: a child it killed died of SIGKILL before this SIGTERM
    sleeper.terminate()
    helper.terminate()
    helper.join()
    print(json.dumps({"exit_code": job.exit_code, "sleeper": sleeper.wait(), "helper": helper.exitcode}), flush=True)
"""


def test_a_batch_leaves_the_callers_own_child_processes_alone(tmp_path: Path) -> None:
    """The private Ray's reaper killed every child of the process alive after ray.init: the caller's too."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", CALLER_WITH_CHILDREN, str(TINY_CONFIG)], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"exit_code": 0, "sleeper": -15, "helper": -15}, out  # alive until the caller ended them
