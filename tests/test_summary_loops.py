"""The demo's settings (configs/default.yaml, the builtin SmolLM2) give summaries that do not loop: a real
document, summarised through the worker's engine as `make demo` summarises it, repeats at most 5 %
of its 4-grams, and where the n-gram ban refuses a repeat the model does not glue the word on instead.
bench/quantization.py prints the same figures for every demo document."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobs.config import CacheConfig, ModelConfig, load_config
from jobs.stopping import repeated_ngram_share
from runner.engine.batch_engine import BatchEngine, PassRequest
from runner.engine.kvcache import build_cache
from runner.engine.model_loader import LoadedModel, load_model
from runner.engine.probes import StageMemory
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


GLUED = Path("/usr/share/common-licenses/Artistic")
"""The demo document whose summary glued words with the ban alone ("the conditions underwhich")."""


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(ModelConfig(name="builtin:smollm2-135m", device="cpu"))


def _default_summary(loaded: LoadedModel, document: Path, scratch: Path) -> list[int]:
    """The document summarised in one pass through the worker's engine, as `make demo` runs it."""
    settings = load_config(REPO / "configs" / "default.yaml").summarize
    prompt = Summarizer(loaded, 0).prompt_ids(settings.prompt, document.read_text())
    assert len(prompt) + settings.max_new_tokens <= settings.context_tokens  # one pass, as the demo runs it
    engine = BatchEngine(loaded, settings, "auto", 1, 1 << 50, _is_memory_error)
    try:
        request = PassRequest(prompt, settings.max_new_tokens, device_bytes=0, memory=StageMemory(),
                              make_cache=lambda: build_cache("dynamic", loaded.model, CacheConfig(), scratch, None))
        return engine.submit(request).result(timeout=600).generation.tokens
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.usefixtures("_two_threads")
def test_the_default_settings_summary_of_a_real_document_repeats_at_most_5_percent_of_its_4grams(
        smollm2: LoadedModel, tmp_path: Path) -> None:
    tokens = _default_summary(smollm2, DOCUMENT, tmp_path)
    summary = smollm2.tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(tokens) >= 20 and "Creative Commons" in summary, summary  # about the document
    assert repeated_ngram_share(tokens) <= 0.05, summary


@pytest.mark.slow
@pytest.mark.usefixtures("_two_threads")
def test_where_the_ban_refuses_a_repeated_word_the_summary_starts_a_new_word_instead_of_gluing_it_on(
        smollm2: LoadedModel, tmp_path: Path) -> None:
    """At each step whose last 3 tokens were followed earlier by a new word (one decoding with a space
    first), the 4-gram ban refuses that word; the token chosen there does not glue a letter or digit on
    to the word before it, and such steps happened (the phrase "the conditions under" recurs)."""
    tokens = _default_summary(smollm2, GLUED, tmp_path)
    summary = smollm2.tokenizer.decode(tokens, skip_special_tokens=True)
    text = [smollm2.tokenizer.decode([t]) for t in tokens]
    refusals = [i for i in range(3, len(tokens))
                if any(tokens[j:j + 3] == tokens[i - 3:i] and text[j + 3][:1].isspace() for j in range(i - 3))]
    assert len(refusals) >= 2 and summary.count("the conditions under") >= 2, summary  # the moment was reached
    assert not [text[i] for i in refusals if text[i][:1].isalnum()], summary
    assert "underwhich" not in summary and "undergiver" not in summary, summary
