"""A decode step's tokens are chosen for the whole batch: every plain greedy row by one argmax and one
transfer to the host, the rest (logits processors, seeded sampling) by their own picker, and every
row's tokens stay those generate() chooses alone.

Real tiny random models (tests/helpers/models.py), real caches, the scheduler's own prefill and
decode step; transfers are counted where they happen, by torch's own function and dispatch modes.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from jobs.config import SummarizeConfig
from runner.engine.batch_plan import BatchSequence
from runner.engine.generation import TokenPicker, generate_once, greedy_tokens, prefill
from runner.engine.ragged import decode_step
from runner.engine.scheduler import BatchScheduler
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, as_loaded_model, dynamic_request
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = 6
NEW = 12


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
    """Each row's cache, picker and first token, as the scheduler's join makes them."""
    caches, pickers, tokens = [], [], []
    for row_settings, prompt in zip(settings, prompts, strict=True):
        cache = DynamicCache(config=loaded.model.config)
        logits = prefill(loaded, prompt, row_settings, cache, "auto")
        picker = TokenPicker(loaded, row_settings, prompt, NEW)
        caches.append(cache)
        pickers.append(picker)
        tokens.append([picker.pick(logits)])
    return caches, pickers, tokens


def test_the_schedulers_step_of_plain_greedy_rows_makes_one_transfer_to_the_host(tokenizer) -> None:
    """The worker's own decode step over ROWS joined greedy sequences reads the host once for all
    their tokens (the code before made one read a row: ROWS). The scheduler's thread is closed first
    so that the step runs here, inside the counter (torch's modes are per thread)."""
    model = tiny_model("llama-gqa")
    scheduler = BatchScheduler(as_loaded_model(model, tokenizer), SummarizeConfig(), "auto", ROWS, BIG, _is_memory_error,
                               prefill_chunk_tokens=0)  # each prompt prefilled whole, so the step is decode rows only
    scheduler.close()
    prompts = [random_prompt(8 + row)[0].tolist() for row in range(ROWS)]
    for prompt in prompts:
        scheduler.plan.add(BatchSequence(dynamic_request(model, prompt, NEW), Future(), scheduler.settings.loop_stop))
        scheduler._start(scheduler.plan.schedule().prefill)
    rows = scheduler.plan.decoding
    with HostTransfers() as step:
        scheduler._decode(rows, None)
    assert scheduler.most_rows == ROWS and scheduler.plan.decoding == rows  # one batched step, none ended
    assert step.count == 1
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), max_new_tokens=2, do_sample=False)[0, len(p):].tolist()
                 for p in prompts]
    assert [seq.tokens for seq in rows] == alone
    for seq in rows:
        seq.handle.close()


def test_greedy_tokens_chooses_every_pickers_token_with_one_transfer(tokenizer) -> None:
    """Each picker alone syncs once per row (the step before this change); the batch chooses the same
    tokens with one transfer."""
    model = tiny_model("llama-gqa")
    loaded = as_loaded_model(model, tokenizer)
    prompts = [random_prompt(8 + row)[0].tolist() for row in range(ROWS)]
    caches, pickers, tokens = _prefilled(loaded, [SummarizeConfig()] * ROWS, prompts)
    assert all(p.plain_greedy for p in pickers)
    with torch.inference_mode():
        logits = decode_step(model, [t[-1] for t in tokens], [len(p) for p in prompts], caches)
    _, alone_pickers, _ = _prefilled(loaded, [SummarizeConfig()] * ROWS, prompts)
    with HostTransfers() as per_row:
        alone = [picker.pick(logits[row : row + 1]) for row, picker in enumerate(alone_pickers)]
    with HostTransfers() as batched:
        greedy = greedy_tokens(pickers, logits)
        chosen = [picker.take(greedy[row]) for row, picker in enumerate(pickers)]
    assert per_row.count == ROWS
    assert batched.count == 1
    assert chosen == alone == logits.argmax(dim=-1).tolist()
    assert [p.done for p in pickers] == [p.done for p in alone_pickers]


def test_mixed_rows_chosen_together_equal_generate_alone(tokenizer) -> None:
    """Plain greedy rows beside rows with processors (repetition penalty, no-repeat n-grams, top-k/p,
    temperature) and seeded sampling, decoded in one batch until each ends: each row's tokens are
    generate()'s alone, and only the plain rows went through the batch's argmax."""
    model = tiny_model("llama-gqa")
    loaded = as_loaded_model(model, tokenizer)
    settings = [
        SummarizeConfig(),
        SummarizeConfig(generation={"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}),
        SummarizeConfig(do_sample=True, seed=7, generation={"top_k": 20, "top_p": 0.9, "temperature": 0.8}),
        SummarizeConfig(),
        SummarizeConfig(do_sample=True, seed=11),
        SummarizeConfig(generation={"repetition_penalty": 1.1}),
    ]
    prompts = [random_prompt(8 + row)[0].tolist() for row in range(len(settings))]
    caches, pickers, tokens = _prefilled(loaded, settings, prompts)
    assert [p.plain_greedy for p in pickers] == [True, False, False, True, False, False]
    active = [row for row in range(len(settings)) if not pickers[row].done]
    batched_rows = set()
    while active:
        with torch.inference_mode():
            logits = decode_step(model, [tokens[r][-1] for r in active],
                                 [len(prompts[r]) + len(tokens[r]) - 1 for r in active], [caches[r] for r in active])
        step_pickers = [pickers[r] for r in active]
        greedy = greedy_tokens(step_pickers, logits)
        batched_rows.update(active[i] for i in greedy)
        for i, row in enumerate(active):
            picker = pickers[row]
            tokens[row].append(picker.take(greedy[i]) if i in greedy else picker.pick(logits[i : i + 1]))
        active = [row for row in active if not pickers[row].done]
    assert batched_rows == {0, 3}
    for row, (row_settings, prompt) in enumerate(zip(settings, prompts, strict=True)):
        alone = generate_once(loaded, prompt, NEW, row_settings, {"past_key_values": DynamicCache(config=model.config)})
        assert tokens[row] == alone.tokens, f"row {row} differs from generate() alone"
