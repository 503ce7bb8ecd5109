"""The KV planner: size estimate and which rungs of cache.ladder to try, in order."""

from __future__ import annotations

import pytest

from jobs.kvplan import KVShape, kv_bytes, plan_rungs

SMOLLM2 = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2)
LADDER = ["dynamic", "tiered-host", "tiered-disk"]
MiB = 1 << 20


def test_kv_bytes_is_two_tensors_per_layer_per_token() -> None:
    assert kv_bytes(SMOLLM2, 1) == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes(SMOLLM2, 8192) == 23040 * 8192  # ~180 MiB for a full context
    assert kv_bytes(SMOLLM2, 100, batch=3) == 3 * kv_bytes(SMOLLM2, 100)
    assert kv_bytes(SMOLLM2, 0) == 0


@pytest.mark.parametrize("bad", [dict(tokens=-1), dict(tokens=5, batch=0)])
def test_kv_bytes_rejects_nonsense(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        kv_bytes(SMOLLM2, **bad)


def test_kv_shape_rejects_zero_sizes() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVShape(num_layers=2, num_kv_heads=0, head_dim=64, dtype_bytes=2)


def test_everything_fits_on_the_device_starts_with_dynamic() -> None:
    assert plan_rungs(LADDER, 100 * MiB, 200 * MiB, 1000 * MiB, device_is_cpu=False) == LADDER


def test_too_big_for_the_device_starts_with_the_host_tier() -> None:
    assert plan_rungs(LADDER, 300 * MiB, 200 * MiB, 1000 * MiB, device_is_cpu=False) == LADDER[1:]


def test_too_big_for_device_and_host_goes_to_disk() -> None:
    assert plan_rungs(LADDER, 3000 * MiB, 200 * MiB, 1000 * MiB, device_is_cpu=False) == ["tiered-disk"]


def test_cpu_device_skips_the_host_tier() -> None:
    assert plan_rungs(LADDER, 100 * MiB, 200 * MiB, 1000 * MiB, device_is_cpu=True) == ["dynamic", "tiered-disk"]
    assert plan_rungs(LADDER, 300 * MiB, 200 * MiB, 1000 * MiB, device_is_cpu=True) == ["tiered-disk"]


def test_cpu_device_skips_transformers_offloading_too() -> None:
    ladder = ["dynamic", "offloaded", "offloaded_static", "tiered-disk"]
    assert plan_rungs(ladder, 300 * MiB, 200 * MiB, 1000 * MiB, device_is_cpu=True) == ["tiered-disk"]
    assert plan_rungs(ladder, 300 * MiB, 200 * MiB, 1000 * MiB, device_is_cpu=False) == ladder[1:]


def test_exact_fit_counts_as_fitting() -> None:
    assert plan_rungs(LADDER, 200 * MiB, 200 * MiB, 0, device_is_cpu=False) == LADDER


def test_nothing_fits_leaves_the_shorter_context_to_the_coordinator() -> None:
    assert plan_rungs(["dynamic", "tiered-host"], 300 * MiB, 200 * MiB, 250 * MiB, device_is_cpu=False) == []


def test_ladder_order_is_the_users() -> None:
    ladder = ["tiered-disk", "dynamic"]
    assert plan_rungs(ladder, 1, 10, 10, device_is_cpu=False) == ladder
