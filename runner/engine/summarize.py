"""Summarise one document: in one pass when it fits the context, else map-reduce over chunks.

A document longer than the context is split (jobs.chunking) into token-budgeted chunks on
paragraph/sentence boundaries; each chunk is summarised, then neighbouring summaries are joined in
groups that fit one pass and summarised again, until one summary remains. The passes of one level
(every chunk; every merge group of a round) are handed over together, so the worker's engine
decodes them side by side. The final summary, when its pass ran out of tokens, ends at its last
complete sentence (jobs.summaries; `summarize.trim_to_sentence`); the passes it was merged from keep
every word, since a merge is better for all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from jobs.chunking import (
    SUMMARY_SEPARATOR,
    group_for_merge,
    plan_chunks,
    summary_budget,
)
from jobs.stopping import StopReason
from jobs.summaries import trim_to_sentence
from runner.engine.generation import Generation
from runner.engine.model_loader import LoadedModel
from runner.engine.prompts import EDGE_MARGIN_TOKENS, prompt_ids

#: Re-tokenising a chunk inside the chat template can merge tokens differently at its edges.
GenerateFn = Callable[[list[list[int]], int], list[Generation]]
"""Generate for several prompts at once (each with the same number of new tokens), in their order."""


@dataclass(frozen=True)
class FirstLevel:
    """A document's first level of passes at one context: one prompt per chunk."""

    prompts: list[list[int]]
    budget: int  # document tokens one pass holds: the merges group by it too
    input_tokens: int  # the document's


@dataclass
class Summary:
    text: str
    input_tokens: int
    output_tokens: int
    chunks: int
    passes: list[Generation] = field(default_factory=list)
    stop_reason: str = ""
    """Why the pass that wrote the summary ended (jobs.stopping.StopReason)."""
    tail: str = ""
    """What that pass wrote after the summary's last complete sentence, cut off when it ran out of tokens."""

    @property
    def run_passes(self) -> list[Generation]:
        """The passes this attempt ran (not those an earlier one finished): what the timings are of."""
        return [p for p in self.passes if not p.reused]

    @property
    def reused_passes(self) -> int:
        return len(self.passes) - len(self.run_passes)

    @property
    def ttft_s(self) -> float:
        run = self.run_passes
        return run[0].ttft_s if run else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = sum(p.decode_s for p in self.run_passes)
        decoded = sum(max(p.output_tokens - 1, 0) for p in self.run_passes)
        return decoded / decode_s if decode_s > 0 else 0.0

    @property
    def batch_size(self) -> float:
        """Mean sequences sharing this document's decode steps (each pass weighted by its steps)."""
        steps = sum(max(p.output_tokens - 1, 0) for p in self.run_passes)
        if not steps:
            return 1.0
        return sum(p.batch_size * max(p.output_tokens - 1, 0) for p in self.run_passes) / steps


class Summarizer:
    def __init__(self, loaded: LoadedModel, overlap_tokens: int, trim_to_sentence: bool = False) -> None:
        """`trim_to_sentence`: a final summary stopped by length ends at its last sentence (the rest in its tail)."""
        self.tokenizer = loaded.tokenizer
        self.overlap_tokens = overlap_tokens
        self.trim_to_sentence = trim_to_sentence
        # a fast tokenizer sets its truncation state per call, and two threads at once fail ("Already
        # borrowed"): the tasks in flight in one worker take turns
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

    def first_level(self, text: str, instruction: str, max_new_tokens: int, context_tokens: int) -> FirstLevel:
        """The document's chunks as pass prompts: what the coordinator deals out to the workers before
        the task's own attempt runs the merges (runner/coordinator.py)."""
        overhead = len(self.prompt_ids(instruction, "")) + EDGE_MARGIN_TOKENS
        budget = summary_budget(context_tokens, overhead, max_new_tokens)
        encoded = self._encode(text, return_offsets_mapping=True)
        chunks = plan_chunks(text, encoded["offset_mapping"], budget, self.overlap_tokens)
        return FirstLevel([self.prompt_ids(instruction, chunk.text) for chunk in chunks], budget,
                          len(encoded["input_ids"]))

    def summarize(
        self,
        text: str,
        instruction: str,
        max_new_tokens: int,
        context_tokens: int,
        generate: GenerateFn,
    ) -> Summary:
        first = self.first_level(text, instruction, max_new_tokens, context_tokens)
        summary = Summary(text="", input_tokens=first.input_tokens, output_tokens=0, chunks=len(first.prompts))

        def run(prompts: list[list[int]]) -> list[tuple[str, int, str]]:
            generations = generate(prompts, max_new_tokens)
            summary.passes.extend(generations)
            return [(self.decode(g.tokens), g.output_tokens, g.stop_reason) for g in generations]

        parts = run(first.prompts)
        separator_tokens = len(self._encode(SUMMARY_SEPARATOR)["input_ids"])
        while len(parts) > 1:
            counts = [len(self._encode(p)["input_ids"]) for p, _, _ in parts]
            groups = group_for_merge(counts, first.budget, separator_tokens)
            merged = iter(run([self.prompt_ids(instruction, SUMMARY_SEPARATOR.join(parts[i][0] for i in g))
                               for g in groups if len(g) > 1]))
            parts = [parts[g.start] if len(g) == 1 else next(merged) for g in groups]
        summary.text, summary.output_tokens, summary.stop_reason = parts[0]
        if self.trim_to_sentence and summary.stop_reason == StopReason.LENGTH:
            summary.text, summary.tail = trim_to_sentence(summary.text)
        return summary
