"""Summarise one document: in one pass when it fits the context, else map-reduce over chunks.

A document longer than the context is split (jobs.chunking) into token-budgeted chunks on
paragraph/sentence boundaries; each chunk is summarised, then neighbouring summaries are joined in
groups that fit one pass and summarised again, until one summary remains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jobs.chunking import SUMMARY_SEPARATOR, group_for_merge, plan_chunks, summary_budget
from runner.engine.generation import Generation
from runner.engine.models import LoadedModel

#: Re-tokenising a chunk inside the chat template can merge tokens differently at its edges.
_EDGE_MARGIN_TOKENS = 8

GenerateFn = Callable[[list[int], int], Generation]


@dataclass
class Summary:
    text: str
    input_tokens: int
    output_tokens: int
    chunks: int
    passes: list[Generation] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.passes[0].ttft_s

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = sum(p.decode_s for p in self.passes)
        decoded = sum(max(p.output_tokens - 1, 0) for p in self.passes)
        return decoded / decode_s if decode_s > 0 else 0.0


class Summarizer:
    def __init__(self, loaded: LoadedModel, overlap_tokens: int) -> None:
        self.tokenizer = loaded.tokenizer
        self.overlap_tokens = overlap_tokens

    def prompt_ids(self, instruction: str, document: str) -> list[int]:
        """The model's chat template when it has one, else instruction and document as plain text."""
        content = f"{instruction}\n\n{document}"
        if self.tokenizer.chat_template:
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": content}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        return self.tokenizer(content, add_special_tokens=True)["input_ids"]

    def summarize(
        self,
        text: str,
        instruction: str,
        max_new_tokens: int,
        context_tokens: int,
        generate: GenerateFn,
    ) -> Summary:
        overhead = len(self.prompt_ids(instruction, "")) + _EDGE_MARGIN_TOKENS
        budget = summary_budget(context_tokens, overhead, max_new_tokens)
        encoded = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        chunks = plan_chunks(text, encoded["offset_mapping"], budget, self.overlap_tokens)
        summary = Summary(text="", input_tokens=len(encoded["input_ids"]), output_tokens=0, chunks=len(chunks))

        def summarise(document: str) -> tuple[str, int]:
            gen = generate(self.prompt_ids(instruction, document), max_new_tokens)
            summary.passes.append(gen)
            return self.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip(), gen.output_tokens

        parts = [summarise(chunk.text) for chunk in chunks]
        separator_tokens = len(self.tokenizer(SUMMARY_SEPARATOR, add_special_tokens=False)["input_ids"])
        while len(parts) > 1:
            counts = [len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p, _ in parts]
            groups = group_for_merge(counts, budget, separator_tokens)
            parts = [
                parts[g.start] if len(g) == 1 else summarise(SUMMARY_SEPARATOR.join(parts[i][0] for i in g))
                for g in groups
            ]
        summary.text, summary.output_tokens = parts[0]
        return summary
