"""A pass's prompt as token ids: what the workers feed the model and what submit's settings check
measures (runner/preflight.py), from the tokenizer alone. No torch here: submit imports it."""

from __future__ import annotations

from typing import Any

EDGE_MARGIN_TOKENS = 8
"""Tokens a pass keeps free beside its prompt and answer (special tokens a template may add)."""


def prompt_ids(tokenizer: Any, instruction: str, document: str) -> list[int]:
    """The model's chat template when it has one, else instruction and document as plain text."""
    content = f"{instruction}\n\n{document}"
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(content, add_special_tokens=True)["input_ids"]
