"""`batch.attention` resolved for a worker (jobs/attention.py): `auto` by device as measured
(docs/benchmarks.md, "Pooled or per-row attention on the CPU"), an explicit setting on any device,
and sliding-window models always per row (the KV pool keeps full-attention layers only)."""

from __future__ import annotations

import pytest

from jobs.attention import attention_path


@pytest.mark.parametrize(("device", "path"), [("cuda", "pooled"), ("cpu", "pooled"), ("mps", "per-row")])
def test_auto_takes_the_measured_path_of_each_device(device: str, path: str) -> None:
    """CUDA: pooled (launches per step); CPU: pooled (measured faster at every shape, mixed lengths
    included); a device never measured: per-row."""
    assert attention_path("auto", device, windowed_layers=False) == path


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("setting", ["pooled", "per-row"])
def test_an_explicit_setting_is_taken_on_every_device(setting: str, device: str) -> None:
    assert attention_path(setting, device, windowed_layers=False) == setting


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("setting", ["auto", "pooled", "per-row"])
def test_a_model_with_sliding_window_layers_attends_per_row(setting: str, device: str) -> None:
    assert attention_path(setting, device, windowed_layers=True) == "per-row"
