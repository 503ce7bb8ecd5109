"""Generation stages: prefill one prompt into its cache, choose each next token, and (for benches and
tests) one whole `model.generate` call, timed.

The prompt is prefilled in chunks of `summarize.prefill_chunk_size`, token-major (transformers') or,
for tiered caches, layer-major first (`cache.prefill`, runner/engine/kvcache/layer_major.py): same tokens.
The worker's scheduler decodes (runner/engine/scheduler.py); a sequence's next token is chosen by its
own `TokenPicker` exactly as generate() chooses it, so batching never changes a sequence's tokens.
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.streamers import BaseStreamer

from jobs.config import PrefillMode, SummarizeConfig
from jobs.stopping import StopReason
from runner.engine.kvcache.layer_major import (
    choose_prefill,
    layer_major_prefill,
    prefilled,
)
from runner.engine.models import LoadedModel


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    input_tokens: int
    ttft_s: float
    decode_s: float
    batch_size: float = 1.0
    """Mean sequences that shared this pass's decode steps."""
    stop_reason: StopReason = StopReason.LENGTH

    @property
    def output_tokens(self) -> int:
        return len(self.tokens)


class TokenClock(BaseStreamer):
    """generate() calls put() once with the prompt, then once per new token."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self._calls = 0

    def put(self, value: torch.Tensor) -> None:
        self._calls += 1
        if self._calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def generate_once(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    settings: SummarizeConfig,
    cache_kwargs: dict[str, Any],
    prefill: PrefillMode = "auto",
) -> Generation:
    """Greedy or seeded-sampling generation of one prompt with the cache the caller chose."""
    input_ids = torch.tensor([prompt_ids], device=loaded.device)
    attention_mask = torch.ones_like(input_ids)
    chunk_size = settings.prefill_chunk_size
    cache = cache_kwargs.get("past_key_values")
    layer_major = choose_prefill(prefill, loaded.model, cache, len(prompt_ids), chunk_size) == "layer-major"
    if settings.do_sample:
        torch.manual_seed(settings.seed)
    clock = TokenClock()
    with torch.inference_mode(), ExitStack() as stack:
        if layer_major:  # generate() takes the filled cache and the last token's logits, and decodes
            output = layer_major_prefill(loaded.model, input_ids, attention_mask, cache, chunk_size)
            stack.enter_context(prefilled(loaded.model, output))
        out = loaded.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=settings.do_sample,
            prefill_chunk_size=chunk_size or None,
            pad_token_id=loaded.tokenizer.pad_token_id,
            streamer=clock,
            **settings.generation,  # GenerationConfig fields checked at submit (runner/preflight.py)
            **cache_kwargs,
        )
    end = time.perf_counter()
    new_tokens = out[0, input_ids.shape[1] :].tolist()
    first = clock.first_token_at or end
    ended = len(new_tokens) < max_new_tokens or TokenPicker(loaded.model, settings, prompt_ids, 1).stops(new_tokens[-1])
    return Generation(
        tokens=new_tokens,
        input_tokens=len(prompt_ids),
        ttft_s=first - clock.start,
        decode_s=end - first,
        stop_reason=StopReason.EOS if ended else StopReason.LENGTH,
    )


def prefill(
    loaded: LoadedModel, prompt_ids: list[int], settings: SummarizeConfig, cache: Cache, mode: PrefillMode
) -> torch.Tensor:
    """Fill `cache` with the prompt's K/V and return the last position's logits ([1, vocab], float32),
    through generate()'s own prefill (chunked, or layer-major on tiered caches) so the cache ends exactly
    as generate() leaves it before its first decode step."""
    input_ids = torch.tensor([prompt_ids], device=loaded.device)
    attention_mask = torch.ones_like(input_ids)
    chunk_size = settings.prefill_chunk_size
    layer_major = choose_prefill(mode, loaded.model, cache, len(prompt_ids), chunk_size) == "layer-major"
    with torch.inference_mode(), ExitStack() as stack:
        if layer_major:
            output = layer_major_prefill(loaded.model, input_ids, attention_mask, cache, chunk_size)
            stack.enter_context(prefilled(loaded.model, output))
        out = loaded.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=1, do_sample=False,
            prefill_chunk_size=chunk_size or None, pad_token_id=loaded.tokenizer.pad_token_id,
            past_key_values=cache, output_logits=True, return_dict_in_generate=True,
        )
    return out.logits[0].float()


class TokenPicker:
    """Chooses one sequence's next tokens as generate() does: the model's generation config with the
    task's settings, its logits processors over the sequence so far, then greedy, or sampling from the
    sequence's own seeded generator (so its tokens do not depend on its batch-mates)."""

    def __init__(self, model: PreTrainedModel, settings: SummarizeConfig, prompt_ids: list[int],
                 max_new_tokens: int) -> None:
        config = copy.deepcopy(model.generation_config)
        config.update(do_sample=settings.do_sample, max_new_tokens=max_new_tokens,
                      **settings.generation)
        self.do_sample = settings.do_sample
        self.processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=len(prompt_ids), device=model.device, model_kwargs={}
        )
        eos = config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.generator = torch.Generator(device=model.device).manual_seed(settings.seed) if self.do_sample else None
        self._ids = torch.tensor([prompt_ids], device=model.device)  # [1, tokens so far]

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from this position's logits ([1, vocab] float32)."""
        if len(self.processors):
            logits = self.processors(self._ids, logits)
        if self.do_sample:
            token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=self.generator)[0, 0]
        else:
            token = logits[0].argmax()
        if len(self.processors):
            self._ids = torch.cat([self._ids, token.view(1, 1)], dim=1)
        return int(token)

    def stops(self, token: int) -> bool:
        return token in self.eos
