"""A decode step's tokens are chosen for the whole batch: rows with the same settings have their logits
processors (repetition penalty, no-repeat n-grams, minimum lengths, temperature, top-k/p, ...) applied
in one batched call each, greedy rows take one argmax, sampled rows draw from their own generator, all
of them reach the host in one transfer, and every row's tokens stay those generate() chooses alone.

Real tiny random models (tests/helpers/models.py), real caches, the engine's own prefill and
decode step; transfers are counted where they happen, by torch's own function and dispatch modes.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from jobs.config import SummarizeConfig
from runner.engine.batch_engine import BatchEngine
from runner.engine.batch_plan import BatchSequence
from runner.engine.generation import TokenPicker, choose_tokens, generate_once, prefill
from runner.engine.ragged import decode_step
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, PLAIN, as_loaded_model, dynamic_request
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = 6
NEW = 12
GREEDY = SummarizeConfig(**PLAIN)
"""Plain greedy rows: no logits processor (the default settings have some)."""


class _ScalarReads(TorchDispatchMode):
    """int(t), t.item(), bool(t): each one device-to-host read of a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


class HostTransfers(TorchFunctionMode):
    """Every read of tensor data by the host: scalar reads (dispatched) and tolist() (a copy to the
    host on a device, which dispatches nothing on a CPU tensor, so it is counted as it is called)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars = _ScalarReads()
        self.lists = 0

    @property
    def count(self) -> int:
        return self.scalars.count + self.lists

    def __enter__(self) -> HostTransfers:
        super().__enter__()
        self.scalars.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.scalars.__exit__(*exc)
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.lists += func is torch.Tensor.tolist
        return func(*args, **(kwargs or {}))


def _prefilled(loaded, settings: list[SummarizeConfig], prompts: list[list[int]]) -> tuple[list, list, list]:
    """Each row's cache, picker and first token, as the engine's join makes them."""
    caches, pickers, tokens = [], [], []
    for row_settings, prompt in zip(settings, prompts, strict=True):
        cache = DynamicCache(config=loaded.model.config)
        logits = prefill(loaded, prompt, row_settings, cache, "auto")
        picker = TokenPicker(loaded, row_settings, prompt, NEW)
        caches.append(cache)
        pickers.append(picker)
        tokens.append([picker.pick(logits)])
    return caches, pickers, tokens


def test_the_engines_step_of_plain_greedy_rows_makes_one_transfer_to_the_host(tokenizer) -> None:
    """The worker's own decode step over ROWS joined greedy sequences reads the host once for all
    their tokens (the code before made one read a row: ROWS). The engine's thread is closed first
    so that the step runs here, inside the counter (torch's modes are per thread)."""
    model = tiny_model("llama-gqa")
    engine = BatchEngine(as_loaded_model(model, tokenizer), GREEDY, "auto", ROWS, BIG, _is_memory_error,
                               prefill_chunk_tokens=0)  # each prompt prefilled whole, so the step is decode rows only
    engine.close()
    prompts = [random_prompt(8 + row)[0].tolist() for row in range(ROWS)]
    for prompt in prompts:
        engine.plan.add(BatchSequence(dynamic_request(model, prompt, NEW), Future(), engine.settings.loop_stop))
        engine._start(engine.plan.schedule())
    rows = engine.plan.decoding
    with HostTransfers() as step:
        engine._decode(rows, None)
    assert engine.plan.most_rows == ROWS and engine.plan.decoding == rows  # one batched step, none ended
    assert step.count == 1
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), max_new_tokens=2, do_sample=False)[0, len(p):].tolist()
                 for p in prompts]
    assert [seq.tokens for seq in rows] == alone
    for seq in rows:
        seq.handle.close()


def test_choose_tokens_chooses_every_pickers_token_with_one_transfer(tokenizer) -> None:
    """Each picker alone syncs once per row (the step before batching); the batch chooses the same
    tokens with one transfer."""
    model = tiny_model("llama-gqa")
    loaded = as_loaded_model(model, tokenizer)
    prompts = [random_prompt(8 + row)[0].tolist() for row in range(ROWS)]
    caches, pickers, tokens = _prefilled(loaded, [GREEDY] * ROWS, prompts)
    assert all(p.forms == [] for p in pickers)  # plain greedy rows
    with torch.inference_mode():
        logits = decode_step(model, [t[-1] for t in tokens], [len(p) for p in prompts], caches)
    _, alone_pickers, _ = _prefilled(loaded, [GREEDY] * ROWS, prompts)
    with HostTransfers() as per_row:
        alone = [picker.pick(logits[row : row + 1]) for row, picker in enumerate(alone_pickers)]
    with HostTransfers() as batched:
        chosen_tokens = choose_tokens(pickers, logits)
        chosen = [picker.take(chosen_tokens[row]) for row, picker in enumerate(pickers)]
    assert per_row.count == ROWS
    assert batched.count == 1
    assert chosen == alone == logits.argmax(dim=-1).tolist()
    assert [p.done for p in pickers] == [p.done for p in alone_pickers]


#: Each processor the batched decode applies to all its rows at once, with the settings that make it
#: bite on the tiny model; the sampling ones with a seed.
PROCESSOR_SETTINGS = {
    "repetition_penalty": SummarizeConfig(generation={"repetition_penalty": 1.3}),
    "no_repeat_ngram_size": SummarizeConfig(generation={"no_repeat_ngram_size": 2}),
    "min_new_tokens": SummarizeConfig(generation={"min_new_tokens": NEW - 2, "eos_token_id": 5}),
    "penalty and n-grams": SummarizeConfig(generation={"repetition_penalty": 1.1, "no_repeat_ngram_size": 3}),
    "temperature": SummarizeConfig(do_sample=True, seed=3, generation={"temperature": 0.7}),
    "top_k": SummarizeConfig(do_sample=True, seed=4, generation={"top_k": 5}),
    "top_p": SummarizeConfig(do_sample=True, seed=5, generation={"top_p": 0.8}),
    "min_p": SummarizeConfig(do_sample=True, seed=6, generation={"min_p": 0.8}),
    "sampling filters and penalty": SummarizeConfig(do_sample=True, seed=8, generation={
        "top_k": 20, "top_p": 0.9, "temperature": 0.8, "repetition_penalty": 1.2}),
    "no_repeat_summary_ngram": SummarizeConfig(generation={}, no_repeat_summary_ngram=2),
    "no_repeat_summary_ngram sampled": SummarizeConfig(do_sample=True, seed=9, generation={"top_k": 20},
                                                       no_repeat_summary_ngram=2),
}


def _decoded_together(loaded, settings: list[SummarizeConfig], prompts: list[list[int]],
                      syncs: list[int] | None = None) -> tuple[list[list[int]], list[TokenPicker]]:
    """The rows decoded in one batch until each ends, every step's tokens by `choose_tokens`; each
    step's host reads appended to `syncs`. Asserts every row's token came from the batch's choice."""
    model = loaded.model
    caches, pickers, tokens = _prefilled(loaded, settings, prompts)
    active = [row for row in range(len(settings)) if not pickers[row].done]
    while active:
        with torch.inference_mode():
            logits = decode_step(model, [tokens[r][-1] for r in active],
                                 [len(prompts[r]) + len(tokens[r]) - 1 for r in active], [caches[r] for r in active])
        with HostTransfers() as step:
            chosen = choose_tokens([pickers[r] for r in active], logits)
            for i, row in enumerate(active):
                tokens[row].append(pickers[row].take(chosen[i]))
        if syncs is not None:
            syncs.append(step.count)
        active = [row for row in active if not pickers[row].done]
    return tokens, pickers


def _alone(loaded, settings: SummarizeConfig, prompt: list[int]) -> list[int]:
    cache = DynamicCache(config=loaded.model.config)
    return generate_once(loaded, prompt, NEW, settings, {"past_key_values": cache}).tokens


@pytest.mark.parametrize("name", list(PROCESSOR_SETTINGS))
def test_rows_with_a_processor_chosen_together_equal_each_row_alone_with_one_transfer_a_step(name: str,
                                                                                           tokenizer) -> None:
    """ROWS rows of different lengths with the same processor settings are processed as one group by
    the processors' batched forms, each step reads the host once, and each row's tokens are the ones
    generate() gives it alone, which the setting changed."""
    model = tiny_model("llama-gqa")
    loaded = as_loaded_model(model, tokenizer)
    settings = PROCESSOR_SETTINGS[name]
    prompts = [random_prompt(3 + 5 * row)[0].tolist() for row in range(ROWS)]
    syncs: list[int] = []
    tokens, pickers = _decoded_together(loaded, [settings] * ROWS, prompts, syncs)
    assert all(p.forms for p in pickers) and len({p.batch_key for p in pickers}) == 1  # one batched group
    assert len(syncs) >= NEW - 1 and set(syncs) == {1}
    alone = [_alone(loaded, settings, prompt) for prompt in prompts]
    assert tokens == alone
    plain = SummarizeConfig(**PLAIN, do_sample=settings.do_sample, seed=settings.seed)
    assert alone != [_alone(loaded, plain, prompt) for prompt in prompts], "the setting changed nothing"


def test_the_engines_summaries_without_a_repeated_ngram_are_generate_onces(tokenizer) -> None:
    """Sequences decoded together by the worker's engine with `no_repeat_summary_ngram` get
    generate_once's tokens (generate() with the same processor), no 2-gram repeats within a summary,
    and plain greedy decoding repeats one in some of them (the ban bit)."""
    model = tiny_model("llama-gqa")
    loaded = as_loaded_model(model, tokenizer)
    settings = SummarizeConfig(generation={}, no_repeat_summary_ngram=2, loop_stop={"enabled": False})
    prompts = [random_prompt(3 + 5 * row)[0].tolist() for row in range(ROWS)]
    engine = BatchEngine(loaded, settings, "auto", ROWS, BIG, _is_memory_error)
    try:
        futures = [engine.submit(dynamic_request(model, prompt, NEW)) for prompt in prompts]
        batched = [future.result(timeout=300).generation.tokens for future in futures]
    finally:
        engine.close()
    assert engine.plan.most_rows > 1  # decoded in one batch
    assert batched == [_alone(loaded, settings, prompt) for prompt in prompts]
    assert not any(_repeats_a_2gram(t) for t in batched)
    plain = [_alone(loaded, GREEDY, prompt) for prompt in prompts]
    assert any(_repeats_a_2gram(t) for t in plain), "plain greedy repeats no 2-gram: the ban could not show"


def _repeats_a_2gram(tokens: list[int]) -> bool:
    grams = list(itertools.pairwise(tokens))
    return len(set(grams)) < len(grams)


def test_a_sampled_rows_tokens_do_not_depend_on_its_batch_mates(tokenizer) -> None:
    """The same seeded row decoded beside two different sets of batch-mates (other prompts, other
    seeds, one of them greedy) and alone: the same tokens each time, drawn from its own generator."""
    model = tiny_model("llama-gqa")
    loaded = as_loaded_model(model, tokenizer)
    row = SummarizeConfig(do_sample=True, seed=21, generation={"top_k": 10, "temperature": 0.9})
    prompt = random_prompt(9)[0].tolist()
    mates = [
        ([SummarizeConfig(do_sample=True, seed=22, generation={"top_k": 10, "temperature": 0.9})],
         [random_prompt(4)[0].tolist()]),
        ([SummarizeConfig(do_sample=True, seed=s, generation={"top_k": 10, "temperature": 0.9}) for s in (1, 2, 3)]
         + [GREEDY], [random_prompt(n)[0].tolist() for n in (12, 5, 17, 30)]),
    ]
    seen = []
    for mate_settings, mate_prompts in mates:
        tokens, pickers = _decoded_together(loaded, [*mate_settings, row], [*mate_prompts, prompt])
        assert pickers[-1].batch_key == pickers[0].batch_key  # drawn in one group with its sampled mates
        seen.append(tokens[-1])
    assert seen[0] == seen[1] == _alone(loaded, row, prompt)


def test_mixed_rows_chosen_together_equal_generate_alone(tokenizer) -> None:
    """Plain greedy rows beside rows with processors (repetition penalty, no-repeat n-grams, top-k/p,
    temperature), seeded sampling, and a processor without a batched form (sequence bias: transformers'
    own call), decoded in one batch until each ends: every row's token comes from the batch's choice,
    rows with equal settings in one group, and each row's tokens are generate()'s alone."""
    model = tiny_model("llama-gqa")
    loaded = as_loaded_model(model, tokenizer)
    settings = [
        GREEDY,
        SummarizeConfig(generation={"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}),
        SummarizeConfig(do_sample=True, seed=7, generation={"top_k": 20, "top_p": 0.9, "temperature": 0.8}),
        GREEDY,
        SummarizeConfig(do_sample=True, seed=11),
        SummarizeConfig(generation={"repetition_penalty": 1.1}),
        SummarizeConfig(generation={"sequence_bias": [[[3], -5.0]]}),
        SummarizeConfig(generation={"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}),
    ]
    prompts = [random_prompt(8 + row)[0].tolist() for row in range(len(settings))]
    tokens, pickers = _decoded_together(loaded, settings, prompts)
    keys = [p.batch_key for p in pickers]
    assert keys[0] == keys[3] and keys[1] == keys[7] and len(set(keys)) == 6
    assert pickers[6].forms is None  # no batched form: its own processors, still in the step's one transfer
    for row, (row_settings, prompt) in enumerate(zip(settings, prompts, strict=True)):
        assert tokens[row] == _alone(loaded, row_settings, prompt), f"row {row} differs from generate() alone"


def test_a_row_whose_draw_fails_is_left_to_its_own_pick(tokenizer) -> None:
    """A sampled row whose logits are not finite cannot be drawn: the batch chooses its mates' tokens
    and leaves it out, and its own pick raises torch's error for that row alone (the engine then
    fails that sequence only)."""
    model = tiny_model("llama-gqa")
    loaded = as_loaded_model(model, tokenizer)
    settings = [SummarizeConfig(do_sample=True, seed=s) for s in (1, 2, 3)]
    prompts = [random_prompt(6 + row)[0].tolist() for row in range(3)]
    caches, pickers, tokens = _prefilled(loaded, settings, prompts)
    with torch.inference_mode():
        logits = decode_step(model, [t[-1] for t in tokens], [len(p) for p in prompts], caches).clone()
        logits[1] = float("nan")
    chosen = choose_tokens(pickers, logits)
    assert sorted(chosen) == [0, 2]
    with pytest.raises(RuntimeError, match="probability tensor"):
        pickers[1].pick(logits[1:2])
