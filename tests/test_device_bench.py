"""bench/throughput.py's device section (bench/device.sh's bench step) under a deadline: the run that a
timeout would cut keeps its JSON and says what it skipped, and the issue's figure (32 rows pooled) comes first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from throughput import device_order  # noqa: E402 - bench/ is a folder of scripts, not a package


def test_the_widest_pooled_row_is_measured_first() -> None:
    assert device_order([1, 8, 32])[:3] == [(32, "pooled"), (32, "per-row"), (8, "pooled")]


def test_rows_past_the_deadline_are_skipped_and_the_report_says_so(tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "bench/throughput.py", "--device", "cpu", "--sections", "device", "--rows", "1,2",
         "--decode-steps", "2", "--prompt-tokens", "16", "--deadline", "0", "--report", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(report.read_text(encoding="utf-8"))
    assert figures["rows"] == []
    assert [(s.get("rows"), s.get("attention")) for s in figures["skipped"][:4]] == [
        (2, "pooled"), (2, "per-row"), (1, "pooled"), (1, "per-row")]
    assert "offload" in figures["skipped"][-1]
    assert "pooled skipped: past the 0 s deadline" in run.stdout.splitlines()[2]
