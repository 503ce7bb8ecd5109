"""Plan a document's passes: its chunks when it is longer than one pass, then merges of their summaries.

Chunks are cut by jobs.chunking and tokenised once here; jobs/document_run.py drives the merge levels.
The passes of one level are dealt out together, so the workers' engines decode them side by side.
"""

from __future__ import annotations

import threading

from jobs.chunking import (
    SUMMARY_SEPARATOR,
    group_for_merge,
    plan_chunks,
    summary_budget,
)
from runner.engine.model_loader import LoadedModel
from runner.engine.prompts import EDGE_MARGIN_TOKENS, prompt_ids


class Summarizer:
    def __init__(self, loaded: LoadedModel, overlap_tokens: int) -> None:
        self.tokenizer = loaded.tokenizer
        self.overlap_tokens = overlap_tokens
        # a fast tokenizer sets its truncation state per call, and two threads at once fail ("Already
        # borrowed"): the calls in flight in one worker take turns
        self._tokenizing = threading.Lock()

    def _encode(self, text: str, **kwargs: object) -> dict:
        with self._tokenizing:
            return self.tokenizer(text, add_special_tokens=False, **kwargs)

    def decode(self, tokens: list[int]) -> str:
        with self._tokenizing:
            return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def prompt_ids(self, instruction: str, document: str) -> list[int]:
        with self._tokenizing:
            return prompt_ids(self.tokenizer, instruction, document)

    def _budget(self, instruction: str, max_new_tokens: int, context_tokens: int) -> int:
        """Document tokens one pass holds beside its prompt and answer: the chunks and the merges alike."""
        overhead = len(self.prompt_ids(instruction, "")) + EDGE_MARGIN_TOKENS
        return summary_budget(context_tokens, overhead, max_new_tokens)

    def chunks(self, text: str, instruction: str, max_new_tokens: int,
               context_tokens: int) -> tuple[list[list[int]], int]:
        """The document's chunks as pass prompts (one when it fits), and its tokens."""
        budget = self._budget(instruction, max_new_tokens, context_tokens)
        encoded = self._encode(text, return_offsets_mapping=True)
        chunks = plan_chunks(text, encoded["offset_mapping"], budget, self.overlap_tokens)
        return [self.prompt_ids(instruction, chunk.text) for chunk in chunks], len(encoded["input_ids"])

    def merges(self, texts: list[str], instruction: str, max_new_tokens: int,
               context_tokens: int) -> tuple[list[range], list[list[int]]]:
        """How a level's summaries are grouped for the next (ranges of them, in order), and the prompt
        of each group of two or more (a group of one is carried over)."""
        budget = self._budget(instruction, max_new_tokens, context_tokens)
        separator_tokens = len(self._encode(SUMMARY_SEPARATOR)["input_ids"])
        groups = group_for_merge([len(self._encode(t)["input_ids"]) for t in texts], budget, separator_tokens)
        prompts = [self.prompt_ids(instruction, SUMMARY_SEPARATOR.join(texts[i] for i in g))
                   for g in groups if len(g) > 1]
        return groups, prompts
