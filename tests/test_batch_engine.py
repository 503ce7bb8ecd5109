"""The worker's engine never dies: an error in one sequence fails that sequence at once, an error it
cannot pin on one fails every waiting future with it, and it keeps serving afterwards.

Real BatchEngine, real tiny random models and caches (tests/helpers/). Through the CLI
the issue's own setting (an out-of-vocabulary forced_eos_token_id) is refused at submit now
(tests/test_submit_checks.py), and a setting that fails every task inside the engine ends the batch
within seconds (tests/test_setting_failures.py).
"""

from __future__ import annotations

import time

import pytest
import torch

from jobs.config import SummarizeConfig
from runner.engine.batch_engine import BatchEngine
from runner.engine.worker import _is_memory_error
from tests.helpers.batching import BIG, PLAIN, as_loaded_model, dynamic_request
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OUT_OF_VOCAB = 1_000_000


def _outcome(future) -> list[int] | BaseException:
    try:
        return future.result(timeout=30).generation.tokens  # seconds, not retry.task_timeout_s
    except TimeoutError:
        raise AssertionError("a future was left unresolved: the engine thread died") from None
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return e


def test_an_error_choosing_one_sequences_token_fails_that_sequence_at_once(tokenizer) -> None:
    """forced_eos_token_id outside the vocabulary (the issue's setting) raises in the token choice of
    the step where the forced end falls. Sequence 0 ends at its end-of-sequence token before that
    step and keeps its tokens; sequence 1 reaches it mid-batch and fails with the real IndexError;
    the engine keeps serving."""
    model = tiny_model("llama-gqa")
    prompts = [random_prompt(9)[0].tolist(), random_prompt(12)[0].tolist()]
    new = 16
    with torch.no_grad():
        plain = model.generate(torch.tensor([prompts[0]]), max_new_tokens=new, do_sample=False)[0, 9:].tolist()
    # sequence 0 stops there, early, but after sequence 1 has joined (its prompt rides sequence 0's
    # second decode step, so it decodes beside it from the third on)
    stop = next(t for t in plain[3:7] if t not in plain[:3])
    with torch.no_grad():
        alone_1 = model.generate(torch.tensor([prompts[1]]), max_new_tokens=new, do_sample=False)[0, 12:].tolist()
    assert stop not in alone_1, "sequence 1 must run to its forced end"
    settings = SummarizeConfig(generation={"forced_eos_token_id": OUT_OF_VOCAB, "eos_token_id": stop},
                               no_repeat_summary_ngram=0)
    engine = BatchEngine(as_loaded_model(model, tokenizer), settings, "auto", 2, BIG, _is_memory_error)
    try:
        futures = [engine.submit(dynamic_request(model, p, new)) for p in prompts]
        got = [_outcome(f) for f in futures]
        again = _outcome(engine.submit(dynamic_request(model, prompts[0], new)))
    finally:
        engine.close()
    assert got[0] == plain[: plain.index(stop) + 1] == again
    assert isinstance(got[1], IndexError) and str(OUT_OF_VOCAB) in str(got[1]), got[1]
    assert engine.plan.most_rows == 2  # it failed inside a batched step, beside sequence 0
    with pytest.raises(IndexError, match=str(OUT_OF_VOCAB)), torch.no_grad():  # generate() alone fails too
        model.generate(torch.tensor([prompts[1]]), max_new_tokens=new, do_sample=False,
                       forced_eos_token_id=OUT_OF_VOCAB, eos_token_id=stop)


def test_an_error_the_loop_cannot_pin_on_a_sequence_fails_every_waiting_future_and_serving_goes_on(
        tokenizer) -> None:
    """A request whose device_bytes is not a number breaks admission (the loop's own code, not one
    sequence's decode): every future waiting then, active and queued, fails with that error at once,
    and the next request is served."""
    model = tiny_model("llama-gqa")
    engine = BatchEngine(as_loaded_model(model, tokenizer), SummarizeConfig(**PLAIN), "auto", 4, BIG, _is_memory_error)
    try:
        long = engine.submit(dynamic_request(model, random_prompt(20)[0].tolist(), 200))
        while engine.plan.most_rows < 1:  # it decodes: admission of the next request sums device bytes
            time.sleep(0.001)
        # in one moment of the loop's (its lock held): else the loop could turn between them, fail
        # `broken` alone and then serve `queued` (CI saw it), and nothing would have been queued behind it
        with engine._changed:
            broken = engine.submit(dynamic_request(model, random_prompt(9)[0].tolist(), 8, device_bytes=None))
            queued = engine.submit(dynamic_request(model, random_prompt(11)[0].tolist(), 8))
        outcomes = [_outcome(f) for f in (long, broken, queued)]
        after = _outcome(engine.submit(dynamic_request(model, random_prompt(9)[0].tolist(), 8)))
    finally:
        engine.close()
    assert all(isinstance(o, TypeError) for o in outcomes), outcomes
    assert isinstance(after, list) and len(after) == 8
