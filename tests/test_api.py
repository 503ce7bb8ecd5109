"""The Python API (`import kvbatch`): a real tiny-model batch from a list of dicts, resumed and read back in
input order, the example script as the README shows it, and bad settings raised before anything runs."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvbatch
from jobs.config import ConfigError
from jobs.manifest import ManifestError
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
                  "rows": kvbatch.results("job"), "errors": kvbatch.results("job", errors_only=True),
                  "status": kvbatch.status("job")}))
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
    assert out["status"]["counts"] == {"pending": 0, "running": 0, "done": 2, "failed": 0, "rejected": 1}
    watched = json.loads(cli("status", str(tmp_path / "job"), "--json", check=0).stdout)
    same = ("job_id", "total", "counts")
    assert {k: watched[k] for k in same} == {k: out["status"][k] for k in same}


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


@pytest.mark.parametrize("documents, message", [
    ({"id": "a", "text": "hello"}, "documents must be a list of rows"),  # one row, not in a list
    (b'{"id": "a", "text": "hello"}', "documents must be a list of rows"),
    ([], "the documents given are an empty list"),
], ids=["a-dict", "bytes", "empty"])
def test_documents_that_are_no_list_of_rows_raise_a_manifest_error(tmp_path: Path, documents, message) -> None:
    with pytest.raises(ManifestError, match=message):
        kvbatch.submit(documents, job_dir=tmp_path / "job", quiet=True)
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("settings, message", [
    (["summarize.max_new_tokens=64"], "settings must be a dict"),
    ({"summarize.max_new_tokens": datetime.date(2026, 1, 1)}, r"settings\['summarize.max_new_tokens'\] is date"),
], ids=["a-list", "a-date"])
def test_settings_that_no_config_takes_raise_a_config_error(tmp_path: Path, settings, message) -> None:
    with pytest.raises(ConfigError, match=message):
        kvbatch.submit([{"id": "a", "text": "hello"}], job_dir=tmp_path / "job", settings=settings, quiet=True)
    assert not (tmp_path / "job").exists()


#: rows a program may hand over, each rejected alone with its place: what the CLI's manifest rules say of them
BAD_ROWS = [
    "a plain string",
    {"id": datetime.datetime(2026, 1, 1), "text": "an id no manifest can hold"},
    {"id": "surrogate", "text": "half a pair \ud800 here"},
    {"id": "meta-only", "when": datetime.date(2026, 3, 4), "raw": b"\x00bytes"},  # no text: rejected, metadata kept
    {"id": "undecodable", "text": b"\xff\xfe"},
]
REASONS = ["documents row 1: is not a dict (got str)", "documents row 2: 'id' must be a string or an integer",
           "documents row 3 (id 'surrogate'): 'text' contains a lone UTF-16 surrogate",
           "documents row 4 (id 'meta-only'): has neither 'text' nor 'path'",
           "documents row 5 (id 'undecodable'): 'text' is not valid UTF-8"]


def test_bad_rows_are_rejected_alone_and_named_by_their_place(tmp_path: Path, capsys) -> None:
    """The rows went through a temporary documents.jsonl: a date or bytes raised TypeError, a lone surrogate
    UnicodeEncodeError; now each is one rejected row, as in a manifest, and the good row beside them runs."""
    job = kvbatch.submit([*BAD_ROWS, {"id": "good", "text": "A fine document."}], job_dir=tmp_path / "job",
                         strict=True)
    said = " ".join(capsys.readouterr().err.split())
    assert job.exit_code == 2 and "5 manifest row(s) rejected" in said, said  # --strict: the good one is row 6
    for reason in REASONS:
        assert reason in said, (reason, said)
    assert "documents.jsonl" not in said and "good" not in said
    assert not (tmp_path / "job").exists()


def test_a_job_of_rejected_rows_goes_to_the_default_folder_and_keeps_their_metadata(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """job_dir=None ran the job in ./None; it is the CLI's default, runs/<job id>, and Job names it."""
    monkeypatch.chdir(tmp_path)
    job = kvbatch.submit(BAD_ROWS, quiet=True)  # every row rejected: no model needed
    assert job.exit_code == 3 and job.finished
    assert Path(job.job_dir).parent == Path("runs") and (tmp_path / job.job_dir / "job.json").is_file(), job
    assert not (tmp_path / "None").exists()
    info = json.loads((tmp_path / job.job_dir / "job.json").read_text())
    assert info["job_id"] == Path(job.job_dir).name and info["manifest"]["path"] == "rows given to kvbatch.submit"
    rows = kvbatch.results(job.job_dir)
    assert [r["status"] for r in rows] == ["rejected"] * len(REASONS)
    for row, reason in zip(rows, REASONS):
        assert reason in row["error"], (reason, row["error"])
    assert rows[3]["when"] == "2026-03-04" and rows[3]["raw"] == "\x00bytes"


def test_the_drop_in_cache_is_kvbatch_s_and_importing_kvbatch_leaves_torch_alone(tmp_path: Path) -> None:
    """One public face: `kvbatch.TieredCache` is the engine's cache (runner/engine/kvcache), imported
    when first asked for; `import kvbatch` alone (a script that only submits) does not import torch."""
    code = ("import sys, kvbatch; before = 'torch' in sys.modules; cache = kvbatch.TieredCache; "
            "print(before, 'torch' in sys.modules, cache.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == ["False", "True", "runner.engine.kvcache.tiered"]
    with pytest.raises(AttributeError, match="no attribute 'Cache'"):
        kvbatch.Cache  # noqa: B018 - what is asked for is the error


#: a typed config and its settings given to kvbatch.submit, with the CLI's text parser made to fail: the API parses no text
TYPED = """
import json, sys
import jobs.config
import kvbatch

def no_text(*args, **kwargs):
    raise AssertionError("the API parsed --set text")

jobs.config.parse_overrides = no_text
config = kvbatch.read_config(sys.argv[1], {"workers.count": 1})
assert isinstance(config, kvbatch.JobConfig)
job = kvbatch.submit(sys.argv[2], job_dir=sys.argv[3], config=config, address=sys.argv[4], quiet=True,
                     settings={"summarize.max_new_tokens": 8, "batch.static_step": "on"})
print(json.dumps([job.job_dir, job.exit_code]))
"""


def test_a_typed_config_runs_the_job_the_cli_runs_with_the_same_text(ray_address, tmp_path: Path) -> None:
    """The API is the core the CLI's text ends in: a JobConfig and a dict of settings (no `--set` text
    parsed, no file written for them) make the job folder the CLI makes from a config file and `--set`:
    the same config in job.json, the same manifest, the same summaries."""
    manifest = tmp_path / "docs.jsonl"
    manifest.write_text("".join(json.dumps({"id": name, "text": f"The {name} committee met and approved it. " * 20})
                                + "\n" for name in ("audit", "budget")))
    proc = subprocess.run([sys.executable, "-c", TYPED, str(TINY_CONFIG), str(manifest), str(tmp_path / "api"),
                           ray_address], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [str(tmp_path / "api"), 0]
    cli("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "cli"), "--address", ray_address,
        "--set", "workers.count=1", "--set", "summarize.max_new_tokens=8", "--set", "batch.static_step=on")

    def job(folder: str) -> dict:
        info = json.loads((tmp_path / folder / "job.json").read_text())
        return {key: value for key, value in info.items() if key not in ("job_id", "created")}

    assert job("api") == job("cli") and job("api")["config"]["batch"]["static_step"] == "on"
    summaries = {folder: [(r["doc_id"], r["summary"]) for r in kvbatch.results(tmp_path / folder)]
                 for folder in ("api", "cli")}
    assert summaries["api"] == summaries["cli"] and len(summaries["api"]) == 2


def test_a_config_that_is_neither_a_jobconfig_nor_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config must be a JobConfig"):
        kvbatch.submit([{"id": "a", "text": "hello"}], job_dir=tmp_path / "job", config={"workers": {"count": 1}},
                       quiet=True)
    assert not (tmp_path / "job").exists()
