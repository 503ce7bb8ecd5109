"""The KV cache strategies against transformers' DynamicCache, on tiny random models.

Token identity is the contract (docs/design.md): with greedy decoding every strategy gives exactly the
tokens of `dynamic`, and sampling with a fixed seed too.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, StoppingCriteria

from jobs.config import CacheConfig, ConfigError
from jobs.kvplan import kv_bytes, plan_rungs
from runner.engine.kvcache import BudgetedDynamicCache, TieredCache, build_cache, kv_shape, resolve_budgets
from tests.helpers.models import (
    ARCHS,
    BLOCK,
    assert_next_logits_equal,
    assert_tokens_of_dynamic,
    layer_bytes,
    random_prompt,
    run_generate,
    strategy_cache,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STRATEGIES = ["dynamic", "tiered-host", "tiered-disk-zstd", "tiered-disk-none"]


def _check_strategy(model: PreTrainedModel, strategy: str, tmp_path: Path, input_ids: torch.Tensor, **kwargs) -> None:
    cache = strategy_cache(strategy, model, tmp_path)
    try:
        got, _ = assert_tokens_of_dynamic(model, cache, input_ids, strategy, **kwargs)
    finally:
        cache.close()
    assert got.shape[-1] > input_ids.shape[-1]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_identical(arch: str, strategy: str, tmp_path: Path) -> None:
    _check_strategy(tiny_model(arch), strategy, tmp_path, random_prompt(37), do_sample=False)


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_batch_of_two_with_left_padding(strategy: str, tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    ids = random_prompt(30, batch=2)
    ids[1, :9] = 0  # the shorter document, left-padded
    mask = (torch.arange(30) >= 9).long().expand(2, -1).clone()
    mask[0] = 1
    _check_strategy(model, strategy, tmp_path, ids, attention_mask=mask, do_sample=False)


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-sliding"])
def test_beam_search_three_beams(arch: str, strategy: str, tmp_path: Path) -> None:
    _check_strategy(tiny_model(arch), strategy, tmp_path, random_prompt(29), num_beams=3, do_sample=False,
                    max_new_tokens=16)


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
@pytest.mark.parametrize("arch", ["llama-gqa", "gemma2-alternating"])
def test_chunked_prefill(arch: str, strategy: str, tmp_path: Path) -> None:
    _check_strategy(tiny_model(arch), strategy, tmp_path, random_prompt(53), prefill_chunk_size=11, do_sample=False)


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_sampling_with_fixed_seed(strategy: str, tmp_path: Path) -> None:
    _check_strategy(tiny_model("qwen2-sliding"), strategy, tmp_path, random_prompt(33), do_sample=True, top_k=20)


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_under_inference_mode(strategy: str, tmp_path: Path) -> None:
    """The worker generates under torch.inference_mode; the IO thread's tensors must mix with it."""
    _check_strategy(tiny_model("llama-gqa"), strategy, tmp_path, random_prompt(35), inference_mode=True,
                    do_sample=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_through_the_disk_codec(dtype: torch.dtype, tmp_path: Path) -> None:
    _check_strategy(tiny_model("llama-gqa", dtype), "tiered-disk-zstd", tmp_path, random_prompt(41), do_sample=False)


def _prefilled_pair(model: PreTrainedModel, tier: str, tmp_path: Path, ids: torch.Tensor) -> tuple[DynamicCache, TieredCache]:
    dynamic = DynamicCache(config=model.config)
    tiered = TieredCache(model.config, tier=tier, offload_dir=tmp_path / "kv", block_tokens=BLOCK)
    with torch.no_grad():
        for cache in (dynamic, tiered):
            model(ids, past_key_values=cache)
    return dynamic, tiered


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_crop_across_a_block_boundary_matches_dynamic(tier: str, tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    dynamic, tiered = _prefilled_pair(model, tier, tmp_path, random_prompt(29))
    with tiered:
        for cache in (dynamic, tiered):
            cache.crop(-10)  # 29 -> 19 tokens: cuts into the third sealed block
        assert tiered.get_seq_length() == dynamic.get_seq_length() == 19
        assert_next_logits_equal(model, dynamic, tiered, random_prompt(5))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_batch_repeat_and_select_match_dynamic(tier: str, tmp_path: Path) -> None:
    """What contrastive and assisted decoding do to a cache: repeat rows, then keep some of them."""
    model = tiny_model("llama-gqa")
    dynamic, tiered = _prefilled_pair(model, tier, tmp_path, random_prompt(27, batch=2))
    with tiered:
        for cache in (dynamic, tiered):
            cache.batch_repeat_interleave(3)  # rows a a a b b b
            cache.batch_select_indices(torch.tensor([5, 0, 3]))  # rows b a b
        assert_next_logits_equal(model, dynamic, tiered, random_prompt(4, batch=3))


def test_reads_queued_behind_a_stalled_io_thread_are_done_by_the_compute_thread(tmp_path: Path) -> None:
    """A starved IO thread must not stall decoding: queued reads are taken over, not waited for."""
    model = tiny_model("llama-gqa")
    dynamic, tiered = _prefilled_pair(model, "disk", tmp_path, random_prompt(30))
    release = threading.Event()
    with tiered:
        tiered.stats()  # let the prefill's block seals finish first
        stall = tiered.shared.io(torch.device("cpu")).submit(release.wait)
        errors: list[BaseException] = []

        def decode_step() -> None:
            try:
                assert_next_logits_equal(model, dynamic, tiered, random_prompt(1))  # 30 + 1 tokens: no block to seal
            except BaseException as e:  # reported below, from the test's thread
                errors.append(e)

        step = threading.Thread(target=decode_step)
        step.start()
        step.join(timeout=60)
        finished = not step.is_alive()
        release.set()
        step.join()
        stall.result()
    assert finished, "the decode step waited for the stalled IO thread"
    assert not errors, errors


class _OffloadDirWatcher(StoppingCriteria):
    """Records the size of the offload dir at every decode step, while generate() runs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sizes: list[int] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.BoolTensor:
        self.sizes.append(sum(f.stat().st_size for f in self.directory.glob("*")))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_tiered_disk_keeps_two_layers_resident_and_its_blocks_on_disk(tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    ids = random_prompt(45)
    new_tokens = 20
    total = ids.shape[-1] + new_tokens - 1  # the last token is sampled, never cached
    watcher = _OffloadDirWatcher(tmp_path / "kv")
    dynamic = BudgetedDynamicCache(model.config)
    run_generate(model, dynamic, ids, max_new_tokens=new_tokens)
    with TieredCache(model.config, tier="disk", offload_dir=tmp_path / "kv", block_tokens=BLOCK) as tiered:
        run_generate(model, tiered, ids, max_new_tokens=new_tokens, stopping_criteria=[watcher])
        stats = tiered.stats()
        files = tiered.offload_files()
        files_sizes = [f.stat().st_size for f in files]
        assert len(files) == model.config.num_hidden_layers
    layer = layer_bytes(model, total)
    block = layer_bytes(model, BLOCK)
    all_layers = layer * model.config.num_hidden_layers
    assert dynamic.stats()["kv_resident_peak_bytes"] == all_layers
    assert stats["kv_bytes"] == all_layers
    assert stats["kv_resident_peak_bytes"] <= 2 * layer + block
    assert stats["device_to_host_bytes"] == all_layers, "each token must leave the device exactly once"
    assert stats["offload_bytes_written"] > 0 and stats["offload_bytes_read"] > 0
    # every decode step brings each layer's old tokens in and sends its new token out: one KV, no more
    assert stats["bytes_moved_per_decode_step"] <= all_layers
    # blocks are sealed on the IO thread, so the first step may see them still in flight
    assert watcher.sizes[-1] > 0, "the offload dir held no blocks while generate() ran"
    assert watcher.sizes == sorted(watcher.sizes)
    assert stats["offload_bytes_written"] == sum(files_sizes)
    assert not (tmp_path / "kv").exists(), "close() must remove the block files"


def test_device_budget_guard_moves_dynamic_to_tiered_with_same_tokens(tmp_path: Path) -> None:
    """The ladder's building blocks on CPU: too small for dynamic, enough for tiered-disk."""
    model = tiny_model("llama-gqa")
    ids = random_prompt(40)
    new_tokens = 12
    shape = kv_shape(model.config, torch.float32)
    needed = kv_bytes(shape, ids.shape[-1] + new_tokens)
    budget = needed // 2
    assert plan_rungs(["dynamic", "tiered-host", "tiered-disk"], needed, budget, 10 * needed, True) == ["tiered-disk"]
    cfg = CacheConfig(block_tokens=BLOCK)
    with build_cache("dynamic", model, cfg, None, budget) as handle:
        with pytest.raises(torch.OutOfMemoryError, match="device_kv_budget_bytes"):
            run_generate(model, None, ids, max_new_tokens=new_tokens, **handle.generate_kwargs)
    expected = run_generate(model, DynamicCache(config=model.config), ids, max_new_tokens=new_tokens)
    with build_cache("tiered-disk", model, cfg, tmp_path / "kv", budget) as handle:
        got = run_generate(model, None, ids, max_new_tokens=new_tokens, **handle.generate_kwargs)
        stats = handle.stats()
    assert torch.equal(got, expected)
    assert set(stats) == {"kv_bytes", "kv_resident_peak_bytes", "offload_bytes_written",
                          "offload_bytes_read", "compression_ratio"}
    assert stats["kv_resident_peak_bytes"] <= budget < stats["kv_bytes"]


def test_tiered_budget_below_two_layers_raises_oom(tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    ids = random_prompt(40)
    budget = layer_bytes(model, ids.shape[-1])  # one layer: the prefetch of the next cannot fit
    with TieredCache(model.config, tier="host", block_tokens=BLOCK, device_budget_bytes=budget) as cache:
        with pytest.raises(torch.OutOfMemoryError):
            run_generate(model, cache, ids, max_new_tokens=4)


def test_host_budget_guard_for_the_host_tier(tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    ids = random_prompt(40)
    with TieredCache(model.config, tier="host", block_tokens=BLOCK, host_budget_bytes=4096) as cache:
        with pytest.raises(torch.OutOfMemoryError, match="host_kv_budget_bytes"):
            run_generate(model, cache, ids, max_new_tokens=4)


def test_transformers_offloading_on_cpu_is_a_clear_error() -> None:
    model = tiny_model("llama-gqa")
    for strategy in ("offloaded", "offloaded_static"):
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            build_cache(strategy, model, CacheConfig(), None, None)


def test_static_cache_implementation_passes_through() -> None:
    model = tiny_model("llama-gqa")
    ids = random_prompt(20)
    handle = build_cache("static", model, CacheConfig(), None, None)
    assert handle.generate_kwargs == {"cache_implementation": "static"}
    got = run_generate(model, None, ids, max_new_tokens=8, **handle.generate_kwargs)
    expected = run_generate(model, DynamicCache(config=model.config), ids, max_new_tokens=8)
    assert torch.equal(got, expected)


def test_disk_tier_needs_an_offload_dir() -> None:
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match="offload"):
        build_cache("tiered-disk", model, CacheConfig(), None, None)
    with pytest.raises(ValueError, match="offload_dir"):
        TieredCache(model.config, tier="disk")


def test_kv_shape_reads_the_model_config() -> None:
    shape = kv_shape(tiny_model("gemma2-alternating").config, torch.bfloat16)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (4, 2, 16, 2)
    assert kv_shape(tiny_model("llama-gqa").config, torch.float32).head_dim == 8


def test_resolve_budgets_on_cpu() -> None:
    explicit = CacheConfig(device_kv_budget_bytes=123_456, host_kv_budget_bytes=654_321)
    assert resolve_budgets(explicit, torch.device("cpu")) == (123_456, 654_321)
    device, host = resolve_budgets(CacheConfig(), torch.device("cpu"))
    assert 0 < device <= psutil.virtual_memory().total
    assert 0 < host <= psutil.virtual_memory().total
