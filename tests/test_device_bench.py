"""bench/device_step.py (bench/device.sh's bench step) on the CPU: a run that a deadline or a section's
budget cuts keeps its JSON and says what it skipped and why; a row that fails is that row's error and
the bench goes on; the issue's figures (32 rows: the static-cache graph, then kvbatch graphed) come
first; the real-job row runs the worker's engine on documents arriving in turn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from device_step import BASELINE, device_order  # noqa: E402 - bench/ is a folder of scripts, not a package

SMALL = ("--rows", "1,2", "--decode-steps", "3", "--prompt-tokens", "40", "--short-prompt-tokens", "0",
         "--offload-tokens", "64", "--job", "6x300x8")
"""Shapes that run in seconds on the CPU: 2 rows and 1 of 40 tokens, 6 documents of 300 tokens."""


def _dry_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """bench/device_step.py on the CPU at SMALL's shapes: its output and its JSON report."""
    report = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "bench/device_step.py", "--device", "cpu", *SMALL, *args,
                          "--report", str(report)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run, json.loads(report.read_text(encoding="utf-8"))


def test_the_widest_rows_are_measured_first_the_baseline_before_kvbatch() -> None:
    order = device_order([(1, 8192), (8, 8192), (32, 8192), (32, 2048)])
    assert order[:3] == [((32, 8192), BASELINE), ((32, 8192), "kvbatch graphed"),
                         ((32, 8192), "kvbatch graphed, cuDNN off")]
    assert order[5] == ((32, 2048), BASELINE)  # the 32 x 2k comparison right after 32 x 8k
    assert order[-1][0] == (1, 8192)


def test_rows_past_the_deadline_are_skipped_and_the_report_says_so(tmp_path: Path) -> None:
    run, figures = _dry_run(tmp_path, "--deadline", "0")
    assert figures["rows"] == [] and figures["agreement"] == [] and figures["job"] is None
    skipped = figures["skipped"]
    assert [(s["section"], s.get("rows"), s.get("way")) for s in skipped[:2]] == [
        ("rows", 2, BASELINE), ("rows", 2, "kvbatch graphed")]
    assert [s["section"] for s in skipped[-3:]] == ["agreement", "job", "offload"]
    assert all(s["why"] == "past the 0 s deadline" for s in skipped)
    assert f"rows 2 40 {BASELINE} skipped: past the 0 s deadline" in run.stdout


def test_a_spent_section_budget_skips_that_section_only_and_the_real_job_row_runs(tmp_path: Path) -> None:
    """Rows, agreement and offload given no time: each is skipped with its budget named, and the job
    section still runs: the worker's engine, default config, 6 documents of 292 tokens arriving in turn."""
    _, figures = _dry_run(tmp_path, "--budgets", "rows=0,agreement=0,offload=0")
    assert figures["rows"] == [] and figures["offload"] == []
    assert {s["why"] for s in figures["skipped"]} == {f"the {section} section's 0 s budget spent"
                                                       for section in ("rows", "agreement", "offload")}
    job = figures["job"]
    assert job["done"] == job["documents"] == 6 and job["failed"] == {} and job["note"] == ""
    assert job["max_sequences"] == 16  # batch.max_sequences: auto, as the worker runs it
    assert 0 < job["row_steps"] and 0 < job["decode_tok_s"] and 0 < job["of_bound"] < 1
    assert job["static_row_steps"] + sum(job["eager_row_steps"].values()) == job["row_steps"]
    assert job["static_share"] == job["static_row_steps"] / job["row_steps"]
    # batch.static_step: on, every row a pool slot, a riding prompt a passenger: the 95 % and more
    assert job["static_share"] >= 0.95 and job["least_document_share"] >= 0.95, job["eager_row_steps"]
    assert job["steps_with_prefill"] > 0, "no prompt rode the decode steps: the documents did not arrive in turn"


def test_a_failed_row_is_its_error_and_every_other_row_is_measured_and_agrees(tmp_path: Path) -> None:
    """One way made to fail at every shape (a real OutOfMemoryError, as the device would raise): its
    rows carry the error, every other way at 2 rows and 1 is measured, and its tokens agree with the
    same prompts alone (fp32 on the CPU: 100 %, no first difference)."""
    failing = "kvbatch static eager"
    _, figures = _dry_run(tmp_path, "--fault-way", failing)
    ways = (BASELINE, "kvbatch graphed", failing, "kvbatch pooled eager")
    assert [(r["rows"], r["way"]) for r in figures["rows"]] == [(w, way) for w in (2, 1) for way in ways]
    failed = [r for r in figures["rows"] if r["way"] == failing]
    assert all(r["error"] == f"OutOfMemoryError: injected by --fault-way '{failing}'" for r in failed)
    measured = [r for r in figures["rows"] if r["way"] != failing]
    assert all(r["decode_tok_s"] > 0 and r["kernels_per_step"] > 0 and "error" not in r for r in measured)
    assert [(a["rows"], a["way"]) for a in figures["agreement"]] == [(r["rows"], r["way"]) for r in measured]
    assert all(a["same_as_pooled_alone"] == 1.0 and a["same_as_per-row_alone"] == 1.0
               and a["first_difference_from_pooled_alone"] is None for a in figures["agreement"])
    assert figures["job"]["done"] == 6 and figures["offload"][0]["cache"] == "tiered-host"
    assert figures["skipped"] == []
