"""Which of a tokenizer's tokens begin a new word and which carry on the word before them.

Lets the summary's n-gram ban refuse a repeat in both spellings (why: docs/summaries.md). Read from the
tokenizer itself (each token decoded after a one-letter anchor), so it holds for byte-level BPE,
SentencePiece and word-level vocabularies alike.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

ANCHOR = "a"
"""Decoded before each token: a token's own text then shows whether a space comes first."""


class WordPieces:
    """The word-start and word-continuation tokens of one tokenizer, as host id sets and device masks."""

    def __init__(self, texts: list[str]) -> None:
        """`texts`: each token id's text as it reads after a letter ("" when it decodes to nothing)."""
        starts = [text[:1].isspace() for text in texts]
        continues = [text[:1].isalnum() for text in texts]
        self.starts = frozenset(i for i, s in enumerate(starts) if s)
        """Ids whose text begins with a space or line break: a new word."""
        self._masks = {"starts": torch.tensor(starts, dtype=torch.bool),
                       "continues": torch.tensor(continues, dtype=torch.bool)}
        self._fitted: dict[tuple[str, int, torch.device], torch.Tensor] = {}

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> WordPieces:
        anchor = tokenizer.encode(ANCHOR, add_special_tokens=False)
        anchor_text = tokenizer.decode(anchor)
        pairs = tokenizer.batch_decode([[*anchor, i] for i in range(len(tokenizer))])
        return cls([pair[len(anchor_text):] if pair.startswith(anchor_text) else "" for pair in pairs])

    def mask(self, kind: str, scores: torch.Tensor) -> torch.Tensor:
        """`kind` ("starts" or "continues") as a [vocab] bool mask as wide as `scores` and on its device
        (an lm head wider than the tokenizer: its extra ids are neither)."""
        width = scores.shape[-1]
        key = (kind, width, scores.device)
        fitted = self._fitted.get(key)
        if fitted is None:  # two threads at once both make the same mask: no lock on the step's path
            mask = self._masks[kind][:width]
            fitted = self._fitted[key] = torch.cat([mask, mask.new_zeros(width - mask.shape[0])]).to(scores.device)
        return fitted
