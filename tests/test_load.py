"""Load: 5,000 documents of real text through the real CLI complete, each exactly once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.cli import REPO, export_rows


@pytest.mark.slow
def test_five_thousand_documents_complete_exactly_once(tmp_path):
    # bench/load.py generates the manifest, runs `kvbatch submit`, checks `status` and prints the figures
    bench = subprocess.run([sys.executable, str(REPO / "bench" / "load.py"), "--docs", "5000", "--keep", str(tmp_path)],
                           cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    rows = export_rows(tmp_path / "job")
    assert len(rows) == 5000 and len({r["doc_id"] for r in rows}) == 5000
    assert {r["status"] for r in rows} == {"done"}
    assert len(list((tmp_path / "job").glob("*/part-*.parquet"))) == 2  # compacted: one part per folder
