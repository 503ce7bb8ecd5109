"""Summarise one document: in one pass when it fits the context, else map-reduce over chunks.

A document longer than the context is split (jobs.chunking) into token-budgeted chunks on
paragraph/sentence boundaries; each chunk is summarised, the summaries are joined and the result
is summarised again, until one pass covers everything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jobs.chunking import plan_chunks, summary_budget
from runner.generation import Generation
from runner.models import LoadedModel

#: Re-tokenising a chunk inside the chat template can merge tokens differently at its edges.
_EDGE_MARGIN_TOKENS = 8

GenerateFn = Callable[[list[int], int], Generation]


class ContextTooSmallError(ValueError):
    """The context leaves too little room for the document after the prompt and the summary."""


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
        try:
            budget = summary_budget(context_tokens, overhead, max_new_tokens)
        except ValueError as e:
            raise ContextTooSmallError(str(e)) from None
        summary: Summary | None = None
        level_text = text
        while True:
            encoded = self.tokenizer(level_text, return_offsets_mapping=True, add_special_tokens=False)
            n_tokens = len(encoded["input_ids"])
            chunks = plan_chunks(level_text, encoded["offset_mapping"], budget, self.overlap_tokens)
            if summary is None:
                summary = Summary(text="", input_tokens=n_tokens, output_tokens=0, chunks=len(chunks))
            parts = []
            for chunk in chunks:
                gen = generate(self.prompt_ids(instruction, chunk.text), max_new_tokens)
                summary.passes.append(gen)
                parts.append(self.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip())
            if len(chunks) == 1:
                summary.text = parts[0]
                summary.output_tokens = summary.passes[-1].output_tokens
                return summary
            level_text = "\n\n".join(parts)
            if len(self.tokenizer(level_text, add_special_tokens=False)["input_ids"]) >= n_tokens:
                raise ContextTooSmallError(
                    f"context_tokens={context_tokens} is too small to combine summaries of "
                    f"{max_new_tokens} tokens; raise summarize.context_tokens or lower max_new_tokens"
                )
