"""The summary a document's result gets (jobs/outcome.py `fold_passes`): one that ran out of tokens ends at
its last complete sentence, the cut words kept in `summary_tail`; the passes keep every word they wrote."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from jobs.config import load_config
from jobs.outcome import fold_passes
from jobs.stopping import StopReason
from jobs.summaries import last_sentence_end, trim_to_sentence
from jobs.task import Task
from runner.engine.worker import SummaryWorker
from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, write_jsonl

REPO = Path(__file__).resolve().parents[1]
DOCUMENT = Path("/usr/share/common-licenses/CC0-1.0")
NEW_TOKENS = 40  # the demo's summaries of this document run past it: stopped by length, mid-sentence


@pytest.mark.slow
def test_a_summary_stopped_by_length_ends_at_its_last_sentence_and_keeps_the_cut_words_apart(tmp_path: Path) -> None:
    """The document summarised in one pass by a worker with the demo's settings (the builtin model), its
    result folded with and without the trim."""
    config = load_config(REPO / "configs" / "default.yaml", [
        "model.name=builtin:smollm2-135m", "model.device=cpu", f"summarize.max_new_tokens={NEW_TOKENS}"])
    worker = SummaryWorker(config, "job", str(tmp_path / "kv"), threads=2)
    text = DOCUMENT.read_text()
    task = Task("t00000001", "cc0", "path", str(DOCUMENT), len(text), len(text.encode()),
                hashlib.sha256(text.encode()).hexdigest(), {}, {})
    try:
        [spec] = worker.plan(task, config.summarize.context_tokens)["plan"].specs
        outcome = worker.run_pass(spec, 1)
    finally:
        worker.engine.close()
    tree, ran = [outcome["row"]], {spec.key: outcome}
    summary = fold_passes(tree, ran, 1, 0, {}, trim=True)
    assert summary["stop_reason"] == StopReason.LENGTH and summary["summary_tail"].strip()  # cut mid-sentence
    assert last_sentence_end(summary["summary"]) == len(summary["summary"]), summary["summary"]
    untrimmed = fold_passes(tree, ran, 1, 0, {}, trim=False)  # every word the pass wrote
    assert (untrimmed["summary"], untrimmed["summary_tail"]) == (summary["summary"] + summary["summary_tail"], "")
    assert untrimmed["summary"] == outcome["row"]["text"]


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
