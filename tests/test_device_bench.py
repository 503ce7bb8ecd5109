"""bench/device_step.py (bench/device.sh's bench step) under a deadline: the run that a timeout would cut keeps
its JSON and says what it skipped, and the issue's figures (32 rows: the static-cache graph, then kvbatch
graphed) come first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from device_step import BASELINE, device_order  # noqa: E402 - bench/ is a folder of scripts, not a package


def _dry_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """bench/device_step.py on the CPU at 2 rows and 1: its output and its JSON report."""
    report = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "bench/device_step.py", "--device", "cpu", "--rows", "1,2", *args,
                          "--report", str(report)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run, json.loads(report.read_text(encoding="utf-8"))


def test_the_widest_rows_are_measured_first_the_baseline_before_kvbatch() -> None:
    assert device_order([1, 8, 32])[:3] == [(32, BASELINE), (32, "kvbatch graphed"), (32, "kvbatch graphed, cuDNN off")]
    assert [width for width, _ in device_order([1, 8, 32])][-1] == 1


def test_rows_past_the_deadline_are_skipped_and_the_report_says_so(tmp_path: Path) -> None:
    run, figures = _dry_run(tmp_path, "--decode-steps", "2", "--prompt-tokens", "16", "--deadline", "0")
    assert figures["rows"] == [] and figures["agreement"] == []
    assert [(s.get("rows"), s.get("way")) for s in figures["skipped"][:2]] == [(2, BASELINE), (2, "kvbatch graphed")]
    assert "agreement" in figures["skipped"][-2] and "offload" in figures["skipped"][-1]
    assert f"{BASELINE:<27} skipped: past the 0 s deadline" in run.stdout.splitlines()[2]


def test_a_short_dry_run_measures_every_row_and_its_tokens_agree(tmp_path: Path) -> None:
    """Every way at 2 rows and 1, then the agreement rows (fp32 on the CPU: all 100 %)."""
    _, figures = _dry_run(tmp_path, "--decode-steps", "3", "--prompt-tokens", "40", "--offload-tokens", "64")
    ways = [way for way in (BASELINE, "kvbatch graphed", "kvbatch static eager", "kvbatch pooled eager")]
    assert [(r["rows"], r["way"]) for r in figures["rows"]] == [(w, way) for w in (2, 1) for way in ways]
    assert all(r["decode_tok_s"] > 0 and r["kernels_per_step"] > 0 for r in figures["rows"])
    assert all(a["same_as_pooled_alone"] == 1.0 and a["same_as_per-row_alone"] == 1.0 for a in figures["agreement"])
    assert figures["offload"][0]["cache"] == "tiered-host" and figures["skipped"] == []
