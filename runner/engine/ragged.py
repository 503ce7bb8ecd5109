"""One forward pass over several sequences of different lengths, each with its own KV cache.

A decode step's weight matmuls (projections, MLP, head) cost the same for one row as for many, so
the sequences of a worker share them; attention is each sequence's own (its own cache, its own
length), so nothing is padded and any cache works, tiered ones included. The trick: a
`SequenceBatch` is passed to the model as its `past_key_values`; its `update` hands each row's new
K/V to that row's cache and returns the lists of K/V, which the attention function registered here
("kvbatch-ragged") attends row by row with the model's own attention function. transformers builds
no mask for an attention implementation it has no mask function for, and a decode row needs none.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

RAGGED = "kvbatch-ragged"


class RowFailed(Exception):
    """A row's cache raised during a batched step: `row` says whose, `__cause__` is the error."""

    def __init__(self, row: int) -> None:
        super().__init__(f"sequence {row} of the batch failed")
        self.row = row


class SequenceBatch:
    """The `past_key_values` of a ragged step: row i's K/V go to `caches[i]`."""

    def __init__(self, caches: Sequence[Cache]) -> None:
        self.caches = list(caches)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # keys, values: [rows, kv_heads, 1, head_dim]
        out_keys, out_values = [], []
        for row, cache in enumerate(self.caches):
            try:
                k, v = cache.update(keys[row : row + 1], values[row : row + 1], layer_idx)
            except Exception as e:  # noqa: BLE001 - the scheduler fails this row, not its batch-mates
                raise RowFailed(row) from e
            out_keys.append(k)
            out_values.append(v)
        return out_keys, out_values


def _inner_function(module: torch.nn.Module, implementation: str) -> Any:
    if implementation == "eager":  # a model's own eager attention (Gemma2's has its logit softcap)
        return importlib.import_module(type(module).__module__).eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [rows, heads, 1, head_dim]
    key: list[torch.Tensor],  # per row [1, kv_heads, its length, head_dim]
    value: list[torch.Tensor],
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Each row attends to its own keys with the model's own attention implementation."""
    inner = _inner_function(module, module.config._kvbatch_inner_attention)
    outputs = [inner(module, query[row : row + 1], k, v, None, **kwargs)[0] for row, (k, v) in enumerate(zip(key, value))]
    return torch.cat(outputs, dim=0), None


AttentionInterface.register(RAGGED, ragged_attention)


@contextmanager
def ragged_step(model: PreTrainedModel) -> Iterator[None]:
    """The model attends row by row for one forward pass, then goes back to its own implementation."""
    config = model.config
    own = config._attn_implementation
    config._kvbatch_inner_attention = own
    config._attn_implementation = RAGGED
    try:
        yield
    finally:
        config._attn_implementation = own


def decode_step(model: PreTrainedModel, last_tokens: Sequence[int], positions: Sequence[int],
                caches: Sequence[Cache]) -> torch.Tensor:
    """One decode step for several sequences (each its last token, at its own position, with its own
    cache): the next-token logits, [rows, vocab] in float32."""
    ids = torch.tensor([[token] for token in last_tokens], device=model.device)  # [rows, 1]
    position_ids = torch.tensor([[p] for p in positions], device=model.device)  # [rows, 1]
    with torch.inference_mode(), ragged_step(model):
        out = model(input_ids=ids, position_ids=position_ids, past_key_values=SequenceBatch(caches),
                    use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float()
