"""The summary a document's result gets (runner/engine/summarize.py): one that ran out of tokens ends at
its last complete sentence, the cut words kept in `tail`; the passes keep every word they wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobs.config import CacheConfig, ModelConfig, load_config
from jobs.stopping import StopReason
from jobs.summaries import last_sentence_end, trim_to_sentence
from runner.engine.batch_engine import BatchEngine, PassRequest
from runner.engine.generation import Generation
from runner.engine.kvcache import build_cache
from runner.engine.model_loader import LoadedModel, load_model
from runner.engine.probes import StageMemory
from runner.engine.summarize import Summary, Summarizer
from runner.engine.worker import _is_memory_error
from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, write_jsonl

REPO = Path(__file__).resolve().parents[1]
DOCUMENT = Path("/usr/share/common-licenses/CC0-1.0")
NEW_TOKENS = 40  # the demo's summaries of this document run past it: stopped by length, mid-sentence


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield load_model(ModelConfig(name="builtin:smollm2-135m", device="cpu"))
    torch.set_num_threads(before)


def _summary(loaded: LoadedModel, scratch: Path, trim: bool) -> Summary:
    """The document summarised in one pass through the worker's engine, with the demo's settings."""
    settings = load_config(REPO / "configs" / "default.yaml").summarize
    engine = BatchEngine(loaded, settings, "auto", 1, 1 << 50, _is_memory_error)

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        requests = [PassRequest(p, max_new_tokens, device_bytes=0, memory=StageMemory(),
                                make_cache=lambda: build_cache("dynamic", loaded.model, CacheConfig(), scratch, None))
                    for p in prompts]
        return [engine.submit(r).result(timeout=600).generation for r in requests]

    try:
        return Summarizer(loaded, 0, trim_to_sentence=trim).summarize(
            DOCUMENT.read_text(), settings.prompt, NEW_TOKENS, settings.context_tokens, generate)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_summary_stopped_by_length_ends_at_its_last_sentence_and_keeps_the_cut_words_apart(
        smollm2: LoadedModel, tmp_path: Path) -> None:
    summary = _summary(smollm2, tmp_path, trim=True)
    written = Summarizer(smollm2, 0).decode(summary.passes[-1].tokens)  # every word the pass wrote
    assert summary.stop_reason == StopReason.LENGTH and summary.tail.strip(), written  # cut mid-sentence
    assert summary.text + summary.tail == written
    assert last_sentence_end(summary.text) == len(summary.text), summary.text
    untrimmed = _summary(smollm2, tmp_path, trim=False)
    assert (untrimmed.text, untrimmed.tail) == (written, "")


def test_the_cut_words_reach_the_exported_result_row(ray_address: str, tmp_path: Path) -> None:
    """Through a real batch (the tiny model, stopped by length): each row's `summary_tail` is exported beside
    its summary, and together they are what the pass wrote, cut at the last sentence end."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [
        {"id": f"memo{i}", "text": f"Memo {i}. The board approved the new budget on Monday. Spending rises."}
        for i in range(3)])
    job = tmp_path / "job"
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            "--set", "workers.count=1", check=0)
    rows = export_rows(job)
    assert [r["stop_reason"] for r in rows] == ["length"] * 3, rows
    for row in rows:
        assert trim_to_sentence(row["summary"] + row["summary_tail"]) == (row["summary"], row["summary_tail"])
