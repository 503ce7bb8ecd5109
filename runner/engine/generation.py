"""Generation stages: prefill one prompt into its cache, choose each next token, and (for benches and
tests) one whole `model.generate` call, timed.

Prefill goes in chunks of `summarize.prefill_chunk_size`, token-major or layer-major (tiered caches):
same tokens. Each sequence's `TokenPicker` chooses exactly as generate() does, so batching never
changes its tokens; `choose_tokens` does a step's rows with one transfer to the host.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.cache_utils import Cache
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from jobs.config import PrefillMode, SummarizeConfig
from jobs.stopping import StopReason
from runner.engine.batched_logits import ANY, Ban, BatchedForm, HostBans, NoRepeatNGrams, batched_form
from runner.engine.kvcache.layer_major import (
    choose_prefill,
    layer_major_prefill,
    prefilled,
)
from runner.engine.model_loader import LoadedModel
from runner.engine.summary_ngrams import summary_processors
from runner.engine.word_pieces import WordPieces


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    input_tokens: int
    ttft_s: float
    decode_s: float
    batch_size: float = 1.0
    """Mean sequences that shared this pass's decode steps."""
    stop_reason: StopReason = StopReason.LENGTH


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
    if settings.do_sample:
        torch.manual_seed(settings.seed)
    clock = TokenClock()
    out = _generate(
        loaded, prompt_ids, settings.prefill_chunk_size, prefill, cache_kwargs.get("past_key_values"),
        max_new_tokens=max_new_tokens,
        do_sample=settings.do_sample,
        tokenizer=loaded.tokenizer,  # for stop_strings
        streamer=clock,
        logits_processor=summary_processors(settings, len(prompt_ids), loaded),
        **settings.generation,  # GenerationConfig fields checked at submit (runner/preflight.py)
        **cache_kwargs,
    )
    end = time.perf_counter()
    new_tokens = out[0, len(prompt_ids) :].tolist()
    first = clock.first_token_at or end
    return Generation(
        tokens=new_tokens,
        input_tokens=len(prompt_ids),
        ttft_s=first - clock.start,
        decode_s=end - first,
        stop_reason=TokenPicker(loaded, settings, prompt_ids, max_new_tokens).stop_reason(new_tokens),
    )


def prefill(
    loaded: LoadedModel, prompt_ids: list[int], settings: SummarizeConfig, cache: Cache, mode: PrefillMode
) -> torch.Tensor:
    """Fill `cache` with the prompt's K/V and return the last position's logits ([1, vocab], float32),
    through generate()'s own prefill (chunked, or layer-major on tiered caches) so the cache ends exactly
    as generate() leaves it before its first decode step."""
    out = _generate(loaded, prompt_ids, settings.prefill_chunk_size, mode, cache, max_new_tokens=1, do_sample=False,
                    past_key_values=cache, output_logits=True, return_dict_in_generate=True)
    return out.logits[0].float()


def _generate(loaded: LoadedModel, prompt_ids: list[int], chunk_size: int, mode: PrefillMode, cache: Cache | None,
              **kwargs: Any) -> Any:
    """generate() over one prompt, its prefill in chunks of `chunk_size`, or layer-major into `cache`
    when `mode` picks that (generate() then takes the filled cache and the last token's logits)."""
    input_ids = torch.tensor([prompt_ids], device=loaded.device)
    attention_mask = torch.ones_like(input_ids)
    layer_major = choose_prefill(mode, loaded.model, cache, len(prompt_ids), chunk_size) == "layer-major"
    with torch.inference_mode(), ExitStack() as stack:
        if layer_major:
            output = layer_major_prefill(loaded.model, input_ids, attention_mask, cache, chunk_size)
            stack.enter_context(prefilled(loaded.model, output))
        return loaded.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                     prefill_chunk_size=chunk_size or None,
                                     pad_token_id=loaded.tokenizer.pad_token_id, **kwargs)


class TokenPicker:
    """Chooses one sequence's next tokens, and says when it ends, as generate() does alone: generate()'s
    own config preparation, logits processors (kvbatch's placed where generate() places them) and
    stopping criteria; sampling uses the sequence's own seeded generator, so its tokens do not depend
    on its batch-mates. Processors run in their batched form (batched_logits.py) when all have one,
    so `choose_tokens` does every row with the same `batch_key` in one go."""

    def __init__(self, loaded: LoadedModel, settings: SummarizeConfig, prompt_ids: list[int],
                 max_new_tokens: int) -> None:
        model = loaded.model
        ids = torch.tensor([prompt_ids], device=model.device)  # [1, tokens so far]
        config = _prepared_config(loaded, settings, ids, max_new_tokens)
        self.processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=len(prompt_ids), encoder_input_ids=ids,
            logits_processor=summary_processors(settings, len(prompt_ids), loaded), device=model.device,
            model_kwargs={},
        )
        self.criteria = model._get_stopping_criteria(
            generation_config=config, stopping_criteria=StoppingCriteriaList(), tokenizer=loaded.tokenizer
        )
        eos = config._eos_token_tensor
        self.eos = set() if eos is None else set(eos.tolist())
        self.do_sample = settings.do_sample
        self.generator = torch.Generator(device=model.device).manual_seed(settings.seed) if self.do_sample else None
        self.max_new_tokens = max_new_tokens
        self.stop_strings = bool(config.stop_strings)
        self.done = False
        """Whether the last chosen token ended the sequence."""
        self._picked = 0
        forms = [batched_form(p, prompt_ids) for p in self.processors]
        self.forms: list[BatchedForm] | None = None if None in forms else forms  # type: ignore[assignment]
        """The processors' batched forms; None: transformers' own processors over `_ids`."""
        self.batch_key: Hashable = (self.do_sample, *(f.key for f in self.forms)) if self.forms is not None \
            else (self.do_sample, id(self))
        """Rows with equal keys have their processors applied together, in one call each."""
        # the length and end-of-sequence criteria are checked on the host from the token; the others
        # (stop strings, max time) read the ids, kept as a tensor only for them or the own processors
        self._host_criteria = all(type(c) in _PLAIN_CRITERIA for c in self.criteria)
        self._ids = ids if self.forms is None or not self._host_criteria else None

    def ban(self, vocab: int, pieces: WordPieces | None, ahead: bool = False) -> Ban | None:
        """Its next token's bans, when its choice is greedy over bans alone (the summary's n-gram ban,
        min lengths: `HostBans`), with word pieces, if any, `pieces`: what a static step applies on the
        device to choose the same token (runner/engine/static_step.py). `ahead`: the bans of the token
        after the next, by what the next one is (that one not read from the device yet). None: its
        choice is the host's."""
        if self.do_sample or self.forms is None or not all(isinstance(form, HostBans) for form in self.forms):
            return None
        entries: Ban = []
        for form in self.forms:
            by_next = form.banned_after_next() if ahead else {ANY: form.banned()}
            if by_next is None:
                return None
            for after, tokens in by_next.items():
                banned = [token for token in tokens if token < vocab]
                glued = isinstance(form, NoRepeatNGrams) and form.begins_word(banned)
                if glued and form.pieces is not pieces:
                    return None
                if banned:
                    entries.append((after, banned, glued))
        return entries

    def ends_after(self, tokens: int) -> bool:
        """Whether it reaches its most new tokens within `tokens` more (whatever they are)."""
        return self._picked + tokens >= self.max_new_tokens

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from this position's logits ([1, vocab] float32), chosen alone; sets `done`."""
        scores = _processed([self], logits)
        token = _draw(self, torch.softmax(scores, dim=-1)) if self.do_sample else scores[0].argmax()
        return self.take(int(token))

    def take(self, token: int) -> int:
        """Record the token chosen for it (by `pick`, or the batch's `choose_tokens`); sets `done`."""
        self._picked += 1
        for form in self.forms or ():
            form.note(token)
        if self._ids is not None:
            self._ids = torch.cat([self._ids, torch.tensor([[token]], device=self._ids.device)], dim=1)
        if self._host_criteria:
            self.done = self._picked >= self.max_new_tokens or token in self.eos
        else:  # a host read of its own, for these rows only
            self.done = bool(self.criteria(self._ids, None)[0])
        return token

    def stop_reason(self, tokens: list[int]) -> StopReason:
        """Which of generate()'s stopping criteria ended `tokens` (this sequence's new tokens)."""
        if tokens and tokens[-1] in self.eos:
            return StopReason.EOS
        if len(tokens) < self.max_new_tokens and self.stop_strings:
            return StopReason.STOP_STRING
        return StopReason.LENGTH  # max_new_tokens, or max_time


_PLAIN_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)


def choose_tokens(pickers: Sequence[TokenPicker], logits: torch.Tensor) -> dict[int, int]:
    """The token of every row of a step's logits ([rows, vocab]), by row, with one transfer to the host
    for all of them (each row's own `pick` would read once per row). Rows with equal `batch_key`s are
    processed together; greedy takes the first of tied maxima, as generate() alone does. A group whose
    processors raise, or a row whose draw does, is left out: the caller's own `pick` for that row then
    raises the same error for that row alone."""
    groups: dict[Hashable, list[int]] = {}
    for row, picker in enumerate(pickers):
        groups.setdefault(picker.batch_key, []).append(row)
    chosen: list[int] = []
    parts: list[torch.Tensor] = []  # each [rows of a group] or [1], on the device
    for rows in groups.values():
        members = [pickers[row] for row in rows]
        try:
            scores = _processed(members, logits if len(rows) == len(pickers) else logits[rows])
        except Exception:  # noqa: BLE001, S112 - each row's own pick raises it for that row
            continue
        if not members[0].do_sample:
            chosen += rows
            parts.append(scores.argmax(dim=-1))
            continue
        probs = torch.softmax(scores, dim=-1)
        for i, (row, picker) in enumerate(zip(rows, members, strict=True)):
            try:
                parts.append(_draw(picker, probs[i : i + 1]).view(1))
            except RuntimeError:  # its own pick raises it
                continue
            chosen.append(row)
    if not parts:
        return {}
    tokens = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    return dict(zip(chosen, tokens, strict=True))


def _processed(members: Sequence[TokenPicker], scores: torch.Tensor) -> torch.Tensor:
    """`scores` ([rows, vocab]) through the processors of `members` (rows with one `batch_key`)."""
    first = members[0]
    if first.forms is None:  # one row: transformers' own processors over its ids
        return first.processors(first._ids, scores) if len(first.processors) else scores
    for position, form in enumerate(first.forms):
        scores = type(form).apply([m.forms[position] for m in members], scores)  # type: ignore[index]
    return scores


def _draw(picker: TokenPicker, probs: torch.Tensor) -> torch.Tensor:
    """One token from a row's probabilities ([1, vocab]) by its own generator, as generate() samples."""
    return torch.multinomial(probs, 1, generator=picker.generator)[0, 0]


def _prepared_config(loaded: LoadedModel, settings: SummarizeConfig, ids: torch.Tensor,
                     max_new_tokens: int) -> GenerationConfig:
    """The generation config generate() would decode this prompt with: the model's defaults under the
    task's settings, special tokens as tensors, max_length/min_length counted from this prompt."""
    model = loaded.model
    fields = {"do_sample": settings.do_sample, "max_new_tokens": max_new_tokens,
              "pad_token_id": loaded.tokenizer.pad_token_id, **settings.generation}
    config, _ = model._prepare_generation_config(None, **fields)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=ids.device, batch_size=1)
    return model._prepare_generated_length(
        generation_config=config,
        has_default_max_length="max_length" not in settings.generation and model.generation_config.max_length is None,
        has_default_min_length="min_length" not in settings.generation and model.generation_config.min_length is None,
        model_input_name="input_ids",
        input_ids_length=ids.shape[1],
        inputs_tensor=ids,
    )
