"""Budget-proportional placement: the planner's split, and the tiered cache that follows it.

The planner keeps as many full-attention layers on the device as the budget holds; the cache must
then give the tokens of DynamicCache, move only the streamed layers' bytes (exactly what the plan
says), and stay within the device budget it was planned for.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Gemma2Config, LlamaConfig, PreTrainedModel

from jobs.config import CacheConfig, load_config
from jobs.kvplan import KVShape, Placement, kv_bytes, plan_placement
from jobs.manifest import read_manifest
from jobs.rungs import TierName
from runner.engine.kvcache import TieredCache, build_cache, kv_shape
from runner.engine.worker import SummaryWorker
from tests.helpers.cli import LICENSES, TINY_CONFIG, write_jsonl
from tests.helpers.models import BLOCK, assert_tokens_of_dynamic, random_prompt, run_generate, small_config
from tests.helpers.summarize import summarize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMOLLM2 = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2)
DOC = 4096  # tokens: prompt + new tokens
LAYER = DOC * 768  # one SmolLM2 layer's KV for the document: 3 MiB
BIG = 1 << 40

# --- the planner (pure) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "resident"),
    [
        (0, 0),  # nothing fits: everything streamed; the cache's guard raises the OOM, as before
        (2 * LAYER - 1, 0),  # not even the two streaming layers
        (2 * LAYER, 0),  # just the working set
        (3 * LAYER - 1, 0),
        (3 * LAYER, 1),
        (15 * LAYER, 13),  # half the cache: 13 resident + 2 streaming, 17 of 30 streamed
        (int(22.5 * LAYER), 20),  # three quarters
        (30 * LAYER - 1, 27),  # 28 or 29 resident would need the same room as all 30
        (30 * LAYER, 30),  # the whole cache: nothing streamed, no working set
        (BIG, 30),
    ],
)
def test_device_budget_decides_how_many_layers_stay_resident(budget: int, resident: int) -> None:
    placement = plan_placement(SMOLLM2, DOC, "host", budget, BIG, block_tokens=512)
    assert len(placement.resident_layers) == resident
    assert placement.host_layers == tuple(i for i in range(30) if i not in placement.resident_layers)
    assert placement.disk_layers == ()
    assert placement.streamed_share == (30 - resident) / 30
    expected = f"resident {resident}/30 layers" + (f", host {30 - resident}" if resident < 30 else "")
    assert placement.describe() == expected


def test_resident_layers_are_spread_evenly_between_the_streamed_ones() -> None:
    half = plan_placement(SMOLLM2, DOC, "host", 17 * LAYER, BIG, block_tokens=512)
    assert half.resident_layers == tuple(range(1, 30, 2)) and half.host_layers == tuple(range(0, 30, 2))
    third = plan_placement(SMOLLM2, DOC, "host", 12 * LAYER, BIG, block_tokens=512)
    assert third.resident_layers == tuple(range(1, 30, 3))


TAIL = 512 * 768  # a disk layer's unfilled block in RAM
HOST_LAYER = 8 * TAIL  # a 4096-token layer kept in RAM: 8 blocks


@pytest.mark.parametrize(
    ("host_budget", "in_ram"),
    [
        (0, 0),  # not even the tails: the host guard raises, as before
        (30 * TAIL, 0),
        (30 * TAIL + HOST_LAYER - TAIL - 1, 0),
        (30 * TAIL + HOST_LAYER - TAIL, 1),
        (30 * TAIL + 12 * (HOST_LAYER - TAIL), 12),
        (30 * HOST_LAYER, 30),
        (BIG, 30),
    ],
)
def test_disk_tier_keeps_whole_layers_in_host_ram_as_far_as_the_host_budget_allows(host_budget: int, in_ram: int) -> None:
    placement = plan_placement(SMOLLM2, DOC, "disk", 0, host_budget, block_tokens=512)
    assert placement.resident_layers == ()
    assert len(placement.host_layers) == in_ram and len(placement.disk_layers) == 30 - in_ram
    assert sorted(placement.host_layers + placement.disk_layers) == list(range(30))


def test_on_a_cpu_device_layers_that_fit_are_resident_and_none_is_a_host_copy() -> None:
    placement = plan_placement(SMOLLM2, DOC, "disk", 15 * LAYER, BIG, block_tokens=512, device_is_cpu=True)
    assert len(placement.resident_layers) == 13 and placement.host_layers == ()
    assert placement.describe() == "resident 13/30 layers, disk 17"


def test_sliding_window_layers_take_their_window_and_are_never_placed() -> None:
    gemma = KVShape(num_layers=4, num_kv_heads=2, head_dim=16, dtype_bytes=2, layer_windows=(10, None, 10, None))
    token = 2 * 2 * 16 * 2
    windows = 2 * 10 * token
    everything = plan_placement(gemma, 100, "disk", 2 * 100 * token + windows, BIG, block_tokens=8)
    assert everything.resident_layers == (1, 3) and everything.streamed_layers == ()
    assert everything.describe() == "resident 2/2 layers, 2 sliding-window resident"
    streamed = plan_placement(gemma, 100, "disk", 2 * 100 * token + windows - 1, BIG, block_tokens=8)
    assert streamed.resident_layers == () and streamed.streamed_layers == (1, 3)


def test_batch_rows_multiply_every_layer() -> None:
    one = plan_placement(SMOLLM2, DOC, "host", 15 * LAYER, BIG, block_tokens=512)
    three = plan_placement(SMOLLM2, DOC, "host", 15 * LAYER, BIG, block_tokens=512, batch=3)
    assert three == dataclasses.replace(plan_placement(SMOLLM2, DOC, "host", 5 * LAYER, BIG, block_tokens=512),
                                        layer_token_bytes=3 * 768)
    assert len(three.resident_layers) == 3 < len(one.resident_layers)


def test_a_decode_step_moves_the_streamed_layers_only() -> None:
    placement = plan_placement(SMOLLM2, DOC, "host", 15 * LAYER, BIG, block_tokens=512)
    assert placement.moved_per_decode_step(4000) == 17 * 4001 * 768


def test_layer_windows_need_one_entry_per_layer() -> None:
    with pytest.raises(ValueError, match="layer_windows"):
        KVShape(num_layers=3, num_kv_heads=1, head_dim=8, dtype_bytes=2, layer_windows=(None, 4))


# --- the cache that follows a placement --------------------------------------------------------

ARCHS8 = {  # eight layers, so placements can split them several ways
    "llama": lambda: LlamaConfig(**{**small_config(), "num_hidden_layers": 8}),
    "gemma2": lambda: Gemma2Config(**{**small_config(head_dim=16, sliding_window=10), "num_hidden_layers": 8}),
}
PROMPT, NEW = 37, 14


def _model8(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ARCHS8[arch]()).eval()


def _device_budget(shape: KVShape, tokens: int, resident: int, batch: int = 1) -> int:
    """The device budget that holds `resident` layers besides the windows and the streaming working set."""
    full = len(shape.full_attention_layers)
    windows = sum(min(tokens, w) for w in shape.layer_windows if w)
    return ((resident + min(full - resident, 2)) * tokens + windows) * shape.layer_token_bytes(batch)


def _planned(model: PreTrainedModel, tier: TierName, resident: int, tokens: int, batch: int = 1,
             host_budget: int = BIG) -> tuple[Placement, int]:
    shape = kv_shape(model.config, torch.float32)
    budget = _device_budget(shape, tokens, resident, batch)
    placement = plan_placement(shape, tokens, tier, budget, host_budget, BLOCK, batch=batch)
    assert len(placement.resident_layers) == resident
    return placement, budget


def _cache(model: PreTrainedModel, tier: TierName, placement: Placement, tmp_path: Path, budget: int | None,
           host_budget: int | None = None) -> TieredCache:
    return TieredCache(model.config, tier=tier, offload_dir=tmp_path / "kv", block_tokens=BLOCK,
                       device_budget_bytes=budget, host_budget_bytes=host_budget, placement=placement)


def _check_placement(model: PreTrainedModel, tier: TierName, resident: int, tmp_path: Path, ids: torch.Tensor,
                     batch: int = 1, **kwargs: object) -> None:
    tokens = ids.shape[-1] + kwargs.get("max_new_tokens", NEW)
    placement, budget = _planned(model, tier, resident, tokens, batch)
    with _cache(model, tier, placement, tmp_path, budget) as cache:
        assert_tokens_of_dynamic(model, cache, ids, f"{placement.describe()} on {tier}", **kwargs)
        stats = cache.stats()
    assert stats["kv_resident_peak_bytes"] <= budget


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize(("arch", "resident"), [("llama", 0), ("llama", 3), ("llama", 8), ("gemma2", 1), ("gemma2", 4)])
def test_placement_gives_the_tokens_of_dynamic(arch: str, resident: int, tier: TierName, tmp_path: Path) -> None:
    _check_placement(_model8(arch), tier, resident, tmp_path, random_prompt(PROMPT), max_new_tokens=NEW)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_placement_with_chunked_prefill(tier: TierName, tmp_path: Path) -> None:
    _check_placement(_model8("gemma2"), tier, 1, tmp_path, random_prompt(53), max_new_tokens=NEW, prefill_chunk_size=11)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_placement_with_a_batch_of_two_left_padded(tier: TierName, tmp_path: Path) -> None:
    ids = random_prompt(30, batch=2)
    ids[1, :9] = 0
    mask = (torch.arange(30) >= 9).long().expand(2, -1).clone()
    mask[0] = 1
    _check_placement(_model8("llama"), tier, 3, tmp_path, ids, batch=2, attention_mask=mask, max_new_tokens=NEW)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_placement_with_three_beams(tier: TierName, tmp_path: Path) -> None:
    _check_placement(_model8("llama"), tier, 2, tmp_path, random_prompt(29), batch=3, num_beams=3, max_new_tokens=10)


TOKEN = 2 * 2 * 8 * 4  # the 8-layer Llama's K and V of one token in one layer: 2 KV heads of 8 fp32


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("resident", [0, 2, 5, 8])
def test_bytes_copied_per_decode_step_are_the_plans_overflow(resident: int, tier: TierName, tmp_path: Path) -> None:
    """The traffic counters add up what the copies wrote (tiers.py, layer_store.py), not the plan's
    formula; here they must come out at the figure worked out by hand, and at the plan's."""
    model = _model8("llama")
    placement, budget = _planned(model, tier, resident, PROMPT + NEW)
    with _cache(model, tier, placement, tmp_path, budget) as cache:
        run_generate(model, cache, random_prompt(PROMPT), max_new_tokens=NEW)
        stats = cache.stats()
    streamed = 8 - resident
    # the first new token comes from the prefill; decode step s starts with PROMPT + s - 1 cached
    # tokens, brings them in for every streamed layer and takes its one new token out
    steps = range(1, NEW)
    assert stats["decode_steps"] == len(steps)
    by_hand = sum(streamed * (PROMPT + s) * TOKEN for s in steps) / len(steps)
    assert stats["bytes_moved_per_decode_step"] == by_hand
    assert by_hand == sum(placement.moved_per_decode_step(PROMPT + s - 1) for s in steps) / len(steps)
    # resident layers never leave the device: only the streamed layers' tokens were copied off it, once
    assert stats["device_to_host_bytes"] == streamed * (PROMPT + NEW - 1) * TOKEN
    # every read copied in what the steps used, plus the first streamed layer once more: after the
    # last step it is prefetched for a step that never comes (the prefill, one chunk, reads nothing)
    wasted_prefetch = (PROMPT + NEW - 1) * TOKEN if streamed else 0
    assert stats["host_to_device_bytes"] == sum(streamed * (PROMPT + s - 1) * TOKEN for s in steps) + wasted_prefetch


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_disk_reads_are_counted_where_the_block_files_are_read(compression: str, tmp_path: Path) -> None:
    """Every streamed layer in block files: the store counts the bytes its reads returned, the layer
    store what decoding wrote into the device buffers, the process's read syscalls agree (zstd)."""
    model = _model8("llama")
    tokens = PROMPT + NEW
    placement, budget = _planned(model, "disk", 3, tokens, host_budget=5 * BLOCK * TOKEN)  # room for the tails only
    assert len(placement.disk_layers) == 5
    with TieredCache(model.config, tier="disk", offload_dir=tmp_path / "kv", block_tokens=BLOCK,
                     compression=compression, device_budget_bytes=budget, placement=placement) as cache:
        rchar_before = _rchar()
        run_generate(model, cache, random_prompt(PROMPT), max_new_tokens=NEW)
        stats = cache.stats()  # settles the last read ahead, which may still be in flight: rchar after it
        rchar = _rchar() - rchar_before
    steps = range(1, NEW)
    assert stats["bytes_moved_per_decode_step"] == sum(5 * (PROMPT + s) * TOKEN for s in steps) / len(steps)
    # a read of a layer holding n tokens reads its sealed blocks (n // BLOCK of them) from the files
    sealed = [5 * ((PROMPT + s - 1) // BLOCK) for s in steps] + [(tokens - 1) // BLOCK]  # + the wasted prefetch
    raw = sum(sealed) * BLOCK * TOKEN
    if compression == "none":
        assert stats["offload_bytes_read"] == raw
    else:
        assert 0 < stats["offload_bytes_read"] < raw
        assert rchar >= stats["offload_bytes_read"]  # the preads (the tokenizer-free run reads nothing else)


def _rchar() -> int:
    """Bytes this process has read through read syscalls so far (/proc/self/io)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_half_resident_moves_half_of_what_streaming_everything_moves(tmp_path: Path) -> None:
    model = _model8("llama")
    moved = {}
    for resident in (0, 4):
        placement, budget = _planned(model, "host", resident, PROMPT + NEW)
        with _cache(model, "host", placement, tmp_path, budget) as cache:
            run_generate(model, cache, random_prompt(PROMPT), max_new_tokens=NEW)
            moved[resident] = cache.stats()["bytes_moved_per_decode_step"]
    assert moved[4] * 2 == moved[0]


def test_all_resident_fills_the_budget_exactly_and_moves_nothing(tmp_path: Path) -> None:
    model = _model8("llama")
    placement, budget = _planned(model, "disk", 8, PROMPT + NEW)
    with _cache(model, "disk", placement, tmp_path, budget) as cache:
        run_generate(model, cache, random_prompt(PROMPT), max_new_tokens=NEW)
        stats = cache.stats()
        assert cache.offload_files() == []
    assert stats["kv_resident_peak_bytes"] == budget  # room for the whole document, reserved once
    assert stats["kv_bytes"] == kv_bytes(kv_shape(model.config, torch.float32), PROMPT + NEW - 1)
    assert stats["bytes_moved_per_decode_step"] == 0 and stats["device_to_host_bytes"] == 0


def test_a_budget_below_the_streaming_working_set_raises_oom_as_before(tmp_path: Path) -> None:
    model = _model8("llama")
    shape = kv_shape(model.config, torch.float32)
    budget = _device_budget(shape, PROMPT + NEW, 0) // 2  # one streamed layer: its successor's prefetch cannot fit
    placement = plan_placement(shape, PROMPT + NEW, "host", budget, BIG, BLOCK)
    assert placement.resident_layers == ()
    with _cache(model, "host", placement, tmp_path, budget) as cache:
        with pytest.raises(torch.OutOfMemoryError, match="device_kv_budget_bytes"):
            run_generate(model, cache, random_prompt(PROMPT), max_new_tokens=NEW)


def test_disk_tier_writes_files_only_for_the_layers_host_ram_cannot_keep(tmp_path: Path) -> None:
    model = _model8("llama")
    tokens = PROMPT + NEW
    token = kv_shape(model.config, torch.float32).layer_token_bytes()
    tail, host_layer = BLOCK * token, -(-tokens // BLOCK) * BLOCK * token
    host_budget = 6 * tail + 2 * (host_layer - tail)  # 6 streamed layers, 2 of them in RAM
    placement, budget = _planned(model, "disk", 2, tokens, host_budget=host_budget)
    assert (len(placement.host_layers), len(placement.disk_layers)) == (2, 4)
    expected = run_generate(model, DynamicCache(config=model.config), random_prompt(PROMPT), max_new_tokens=NEW)
    with _cache(model, "disk", placement, tmp_path, budget, host_budget) as cache:
        got = run_generate(model, cache, random_prompt(PROMPT), max_new_tokens=NEW)
        stats = cache.stats()
        files = cache.offload_files()
    assert torch.equal(got, expected)
    assert sorted(int(f.stem.split("-")[-1]) for f in files) == list(placement.disk_layers)
    assert stats["host_peak_bytes"] <= host_budget


def test_a_placement_planned_for_another_model_is_refused() -> None:
    gemma = kv_shape(_model8("gemma2").config, torch.float32)
    placement = plan_placement(gemma, 50, "host", BIG, BIG, BLOCK)
    with pytest.raises(ValueError, match="placement covers full-attention layers"):
        TieredCache(_model8("llama").config, placement=placement)


def test_build_cache_hands_the_placement_to_the_tiered_cache(tmp_path: Path) -> None:
    model = _model8("llama")
    placement, budget = _planned(model, "disk", 3, PROMPT + NEW)
    with build_cache("tiered-disk", model, CacheConfig(block_tokens=BLOCK), tmp_path / "kv", budget, BIG,
                     placement) as handle:
        assert handle.generate_kwargs["past_key_values"].placement is placement


# --- the worker records the placement it used ----------------------------------------------


def test_the_worker_plans_each_pass_and_records_the_placement(tmp_path: Path) -> None:
    """The tiny model's KV is 256 bytes a token a layer: a ~470-token pass of BSD needs ~120 KB a
    layer, so 400 KB holds one resident layer besides the two streaming ones."""
    rows = {}
    for strategy, budget in (("dynamic", "auto"), ("tiered-disk", 400_000)):
        config = load_config(TINY_CONFIG, [f"cache.strategy={strategy}", f"cache.device_kv_budget_bytes={budget}"])
        [task], _ = read_manifest(write_jsonl(tmp_path / "m.jsonl", [{"id": "bsd", "path": str(LICENSES / "BSD")}]),
                                  config.input)
        worker = SummaryWorker(config, "placement", str(tmp_path / "offload"), threads=1)
        rows[strategy] = summarize(worker, task, config.summarize.context_tokens)
    assert rows["dynamic"]["kv_placement"] is None
    tiered = rows["tiered-disk"]
    assert tiered["status"] == "done" and tiered["kv_placement"] == "resident 1/4 layers, disk 3"
    assert tiered["summary"] == rows["dynamic"]["summary"]
    assert tiered["kv_resident_peak_bytes"] <= 400_000
