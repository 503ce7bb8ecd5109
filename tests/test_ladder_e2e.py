"""The OOM ladder through the real CLI and Ray workers, on CPU exactly as on a GPU."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import LICENSES, TINY_CONFIG, export_rows, kvbatch, write_jsonl


def run(tmp_path, ray_address, name: str, *settings: str, env: dict | None = None) -> dict:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "bsd", "path": str(LICENSES / "BSD")}])
    args = [a for s in settings for a in ("--set", s)]
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / name),
            "--address", ray_address, *args, env=env, check=0)
    [row] = export_rows(tmp_path / name)
    return row


@pytest.fixture(scope="module")
def reference(ray_address, tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("ladder"), ray_address, "dynamic", "cache.strategy=dynamic")


def test_a_device_budget_too_small_for_dynamic_runs_tiered_with_identical_tokens(reference, ray_address, tmp_path):
    # the tiny model's KV is 1 KiB a token: BSD's ~450-token pass needs ~450 KiB on `dynamic`,
    # two layers and a block (what tiered-disk keeps resident) fit well under 300 KB
    row = run(tmp_path, ray_address, "budget", "cache.device_kv_budget_bytes=300000")
    assert reference["kv_resident_peak_bytes"] > 300_000
    assert row["cache_strategy"] == "tiered-disk" and row["fallbacks"] == []
    assert row["kv_resident_peak_bytes"] <= 300_000 and row["offload_bytes_written"] > 0
    assert row["summary"] == reference["summary"] and row["output_tokens"] == reference["output_tokens"]


def test_a_forced_oom_on_a_rung_moves_the_task_to_the_next(reference, ray_address, tmp_path):
    faults = json.dumps([{"doc": "bsd", "fault": "oom", "rungs": ["dynamic"]}])
    row = run(tmp_path, ray_address, "forced", env={"KVBATCH_FAULTS": faults})
    assert row["fallbacks"] == ["cache:dynamic->tiered-disk (OutOfMemoryError)"]
    assert row["cache_strategy"] == "tiered-disk" and row["attempts"] == 1
    assert row["summary"] == reference["summary"]
    log = [json.loads(line) for line in (tmp_path / "forced" / "job.log").read_text().splitlines()]
    assert any("cache:dynamic->tiered-disk (OutOfMemoryError)" in (e.get("fallbacks") or []) for e in log)
