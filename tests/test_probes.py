"""Memory snapshots (per-stage figures are recorded by the engine: tests/test_batching.py)."""

from __future__ import annotations

import torch

from runner.engine.probes import memory_snapshot


def test_memory_snapshot_on_cpu():
    snap = memory_snapshot(torch.device("cpu"))
    assert snap.host_rss_bytes > 0 and snap.device_bytes is None and snap.device_used_fraction is None
    assert 0 < snap.host_used_fraction < 1
