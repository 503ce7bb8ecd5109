"""The demo's settings (configs/default.yaml, the builtin SmolLM2) give summaries that do not loop: a real
document, summarised through the worker's scheduler as `make demo` summarises it, repeats at most 5 %
of its 4-grams. bench/quantization.py prints the same figure for every demo document."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobs.config import CacheConfig, ModelConfig, load_config
from jobs.stopping import repeated_ngram_share
from runner.engine.kvcache import build_cache
from runner.engine.model_loader import load_model
from runner.engine.probes import StageMemory
from runner.engine.scheduler import BatchScheduler, PassRequest
from runner.engine.summarize import Summarizer
from runner.engine.worker import _is_memory_error

REPO = Path(__file__).resolve().parents[1]
DOCUMENT = Path("/usr/share/common-licenses/CC0-1.0")
"""The demo's shortest document whose summary looped with the settings before (8 % repeated 4-grams)."""


@pytest.fixture
def _two_threads() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.usefixtures("_two_threads")
def test_the_default_settings_summary_of_a_real_document_repeats_at_most_5_percent_of_its_4grams(
        tmp_path: Path) -> None:
    settings = load_config(REPO / "configs" / "default.yaml").summarize
    loaded = load_model(ModelConfig(name="builtin:smollm2-135m", device="cpu"))
    prompt = Summarizer(loaded, 0).prompt_ids(settings.prompt, DOCUMENT.read_text())
    assert len(prompt) + settings.max_new_tokens <= settings.context_tokens  # one pass, as the demo runs it
    scheduler = BatchScheduler(loaded, settings, "auto", 1, 1 << 50, _is_memory_error)
    try:
        request = PassRequest(prompt, settings.max_new_tokens, device_bytes=0, memory=StageMemory(),
                              make_cache=lambda: build_cache("dynamic", loaded.model, CacheConfig(), tmp_path, None))
        generation = scheduler.submit(request).result(timeout=600).generation
    finally:
        scheduler.close()
    summary = loaded.tokenizer.decode(generation.tokens, skip_special_tokens=True)
    assert len(generation.tokens) >= 20 and "Creative Commons" in summary, summary  # about the document
    assert repeated_ngram_share(generation.tokens) <= 0.05, summary
