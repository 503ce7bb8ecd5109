"""Token identity on the real model and a real document: every strategy matches `dynamic`."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.config import CacheConfig, ModelConfig, SummarizeConfig
from runner.engine.generation import generate_once
from runner.engine.kvcache import build_cache
from runner.engine.model_loader import load_model

DOCUMENT = Path("/usr/share/common-licenses/GPL-3")


@pytest.mark.slow
def test_smollm2_summary_tokens_identical_for_every_strategy(tmp_path: Path) -> None:
    loaded = load_model(ModelConfig(name="builtin:smollm2-135m", dtype="bfloat16", device="cpu"))
    messages = [{"role": "user", "content": "Summarise this licence:\n\n" + DOCUMENT.read_text()[:4500]}]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = loaded.tokenizer(text, add_special_tokens=False).input_ids
    assert len(prompt) > 1000
    settings = SummarizeConfig(max_new_tokens=24, prefill_chunk_size=512)
    cache_cfg = CacheConfig(block_tokens=256)
    outputs: dict[str, list[int]] = {}
    ratios: dict[str, float | None] = {}
    for strategy, compression in [("dynamic", "zstd"), ("tiered-host", "zstd"), ("tiered-disk", "zstd"),
                                  ("tiered-disk", "none")]:
        cfg = cache_cfg.model_copy(update={"compression": compression})
        with build_cache(strategy, loaded.model, cfg, tmp_path / f"{strategy}-{compression}", None) as handle:
            outputs[f"{strategy}-{compression}"] = generate_once(
                loaded, prompt, settings.max_new_tokens, settings, handle.generate_kwargs
            ).tokens
            ratios[f"{strategy}-{compression}"] = handle.stats()["compression_ratio"]
    expected = outputs.pop("dynamic-zstd")
    assert len(expected) > 4 and loaded.tokenizer.decode(expected).strip()
    for name, tokens in outputs.items():
        assert tokens == expected, f"{name} diverged from dynamic"
    assert ratios["tiered-disk-zstd"] > 1.4  # the byte-plane shuffle on real bf16 KV
    assert ratios["tiered-disk-none"] == 1.0
