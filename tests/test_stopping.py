"""The loop stop's detection (jobs/stopping.py): explicit cases and properties, and its settings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.config import ConfigError, LoopStopConfig, config_from_dict
from jobs.stopping import LoopWatch, loop_stopped, repeated_ngram_share, repeated_tail

RULE = LoopStopConfig(ngram=4, repeats=3, max_period=64)


def test_a_sentence_repeated_three_times_keeps_it_once() -> None:
    sentence = list(range(100, 118))  # 18 tokens, like "The work is a work of a creator ..."
    tokens = [1, 2, 3, *sentence * 3]
    assert repeated_tail(tokens, RULE) == 2 * len(sentence)
    assert tokens[: len(tokens) - repeated_tail(tokens, RULE)] == [1, 2, 3, *sentence]


def test_two_copies_are_not_a_loop_yet() -> None:
    sentence = list(range(100, 118))
    assert repeated_tail([1, 2, 3, *sentence * 2], RULE) == 0


def test_a_repeated_word_is_caught_once_it_spans_repeats_times_ngram_tokens() -> None:
    assert repeated_tail([7, 8, *[5] * 11], RULE) == 0
    assert repeated_tail([7, 8, *[5] * 12], RULE) == 8  # period 4 (a multiple of 1): 4 tokens kept


def test_the_shortest_period_wins() -> None:
    unit = [1, 2, 3, 4, 5]
    assert repeated_tail(unit * 6, RULE) == 10  # period 5, not 10 or 15


def test_a_period_above_max_period_or_below_ngram_is_not_looked_for() -> None:
    long_unit = list(range(70))
    assert repeated_tail(long_unit * 3, RULE) == 0
    assert repeated_tail([9, *[1, 2] * 5], LoopStopConfig(ngram=4, repeats=3)) == 0  # 10 tokens < 3 x 4


def test_off_never_cuts() -> None:
    assert repeated_tail([5] * 50, LoopStopConfig(enabled=False)) == 0


def test_too_short_or_empty_sequences_are_no_loop() -> None:
    assert repeated_tail([], RULE) == 0
    assert repeated_tail([1, 2, 3], RULE) == 0


@given(st.lists(st.integers(0, 5), min_size=1, max_size=20), st.integers(4, 20), st.integers(2, 5),
       st.lists(st.integers(0, 5), max_size=10))
def test_any_block_repeated_at_the_end_is_cut_to_one_copy(block, period, repeats, prefix) -> None:
    unit = (block * period)[:period]  # `period` tokens
    tokens = prefix + unit * repeats
    rule = LoopStopConfig(ngram=4, repeats=repeats, max_period=64)
    cut = repeated_tail(tokens, rule)
    assert 0 < cut <= period * (repeats - 1)
    kept = tokens[: len(tokens) - cut]
    # what is cut is copies of what is kept just before it: the text the reader loses was already there
    shortest = cut // (repeats - 1)
    assert tokens[len(tokens) - cut :] == kept[len(kept) - shortest :] * (repeats - 1)


@given(st.lists(st.integers(0, 1000), unique=True, max_size=200))
def test_a_sequence_without_repeated_tokens_is_never_cut(tokens) -> None:
    assert repeated_tail(tokens, RULE) == 0
    assert repeated_ngram_share(tokens) == 0.0


PARAGRAPH = list(range(200, 240))  # 40 tokens, like a licence's disclaimer paragraph


def test_a_paragraph_repeated_with_one_word_changed_keeps_it_once() -> None:
    """The demo's bsd summary: the paragraph again and again, one word different in each copy, so no
    fixed period matches; the near-copy rule stops it inside the second copy and keeps the first."""
    copies = [PARAGRAPH[:k] + [999] + PARAGRAPH[k + 1:] for k in (10, 20, 30)]
    tokens = [1, 2, 3, *PARAGRAPH, *copies[0], *copies[1], *copies[2]]
    assert repeated_tail(tokens, RULE) == 0  # the exact rule alone never stops it
    kept, looped = loop_stopped(tokens, LoopStopConfig())
    assert looped and kept == [1, 2, 3, *PARAGRAPH]
    assert repeated_ngram_share(kept) == 0.0


def test_a_paragraph_repeated_with_a_line_break_inserted_keeps_it_once() -> None:
    """The demo's artistic summary: copies differ by an extra line-break token."""
    tokens = [1, 2, 3, *PARAGRAPH, *PARAGRAPH[:15], 198, *PARAGRAPH[15:], *PARAGRAPH[:25], 198, *PARAGRAPH[25:]]
    kept, looped = loop_stopped(tokens, LoopStopConfig())
    assert looped and kept == [1, 2, 3, *PARAGRAPH]


def test_the_near_copy_rule_stops_while_the_second_copy_is_written() -> None:
    """It stops inside the second copy: it pays for about window x share tokens of it, not three copies."""
    rule = LoopStopConfig()
    watch = LoopWatch(rule)
    stream = [1, 2, 3, *PARAGRAPH, *PARAGRAPH, *PARAGRAPH]
    for end in range(1, len(stream) + 1):
        if watch.update(stream[:end]):
            break
    written_of_second_copy = end - 3 - len(PARAGRAPH)
    assert written_of_second_copy <= rule.window
    assert watch.kept(stream[:end]) == [1, 2, 3, *PARAGRAPH]


def test_window_zero_turns_the_near_copy_rule_off() -> None:
    copies = [PARAGRAPH[:k] + [999] + PARAGRAPH[k + 1:] for k in (10, 20, 30)]
    tokens = [*PARAGRAPH, *copies[0], *copies[1], *copies[2]]
    assert loop_stopped(tokens, LoopStopConfig(window=0)) == (tokens, False)


@settings(deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=300))
def test_a_sequence_without_a_repeated_ngram_is_never_cut(tokens) -> None:
    if repeated_ngram_share(tokens) > 0:  # hypothesis rarely draws one; such a draw is no test of this
        return
    assert loop_stopped(tokens, LoopStopConfig()) == (tokens, False)


@settings(deadline=None)
@given(st.integers(4, 12), st.lists(st.integers(20, 180), min_size=1, max_size=6))
def test_a_phrase_quoted_again_now_and_then_is_not_a_loop(phrase_len, gaps) -> None:
    """Text that is not a loop may quote an earlier phrase ("the Software", a clause's name) now and
    then: up to 12 tokens at a time, at least 20 new tokens apart. It is never cut."""
    fresh = iter(range(10_000, 100_000))  # tokens not seen before
    phrase = [next(fresh) for _ in range(phrase_len)]
    tokens = [*phrase]
    for gap in gaps:
        tokens += [next(fresh) for _ in range(gap)] + phrase
    tokens += [next(fresh) for _ in range(20)]
    assert loop_stopped(tokens, LoopStopConfig()) == (tokens, False)


def test_fed_a_token_at_a_time_or_at_once_it_cuts_the_same() -> None:
    stream = [5, 6, *PARAGRAPH, *PARAGRAPH[:30], 7, *PARAGRAPH]
    watch = LoopWatch(LoopStopConfig())
    for end in range(1, len(stream) + 1):
        watch.update(stream[:end])
    assert watch.kept(stream) == loop_stopped(stream, LoopStopConfig())[0] == [5, 6, *PARAGRAPH]


@settings(deadline=None)
@given(st.lists(st.integers(0, 3), max_size=120), st.integers(4, 8), st.integers(2, 4))
def test_the_watch_stops_where_the_exact_rule_first_fires(tokens, ngram, repeats) -> None:
    """LoopWatch runs `repeated_tail` only after an n-gram seen before: it stops exactly where running
    it after every token would (small alphabets, so loops are common)."""
    rule = LoopStopConfig(ngram=ngram, repeats=repeats, max_period=16, window=0)
    expected = (tokens, False)
    for end in range(1, len(tokens) + 1):
        cut = repeated_tail(tokens[:end], rule)
        if cut:
            expected = (tokens[: end - cut], True)
            break
    assert loop_stopped(tokens, rule) == expected


def test_repeated_ngram_share() -> None:
    assert repeated_ngram_share([1, 2, 3, 4, 5]) == 0.0
    assert repeated_ngram_share([1, 2, 3, 4] * 3) == pytest.approx(5 / 9)  # 4 distinct of 9
    assert repeated_ngram_share([1, 2]) == 0.0


@pytest.mark.parametrize("loop_stop, key", [
    ({"repeats": 1}, "summarize.loop_stop.repeats"),
    ({"ngram": 0}, "summarize.loop_stop.ngram"),
    ({"ngram": 8, "max_period": 4}, "summarize.loop_stop"),
    ({"window": 3}, "summarize.loop_stop.window"),
    ({"window_share": 0}, "summarize.loop_stop.window_share"),
    ({"window_share": 1.5}, "summarize.loop_stop.window_share"),
])
def test_bad_loop_stop_settings_name_the_key(loop_stop, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"summarize": {"loop_stop": loop_stop}})


def test_the_batched_decode_stops_a_looping_sequence_at_its_third_copy(tmp_path) -> None:
    """A random model that loops (its 20-token prompt repeats one token): the worker's engine ends the
    sequence there with stop_reason repetition, before max_new_tokens, and keeps what generate() wrote up to
    the loop's first copy; with the loop stop off it runs to max_new_tokens with generate()'s tokens."""
    import torch
    from transformers import AutoTokenizer

    from jobs.config import CacheConfig, SummarizeConfig
    from jobs.stopping import StopReason, loop_stopped
    from runner.engine.batch_engine import BatchEngine, PassRequest
    from runner.engine.kvcache import build_cache
    from runner.engine.model_loader import LoadedModel
    from runner.engine.model_registry import smollm2_tokenizer_dir
    from runner.engine.worker import _is_memory_error
    from tests.helpers.batching import PLAIN
    from tests.helpers.models import random_prompt, tiny_model

    model = tiny_model("gemma2-alternating")
    prompt, new = random_prompt(20)[0].tolist(), 60
    with torch.no_grad():
        plain = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()
    kept, looped = loop_stopped(plain, RULE)
    assert looped and len(kept) < new - 10, plain  # the model really loops, early
    loaded = LoadedModel(model=model, tokenizer=AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir())),
                         name="tiny", device=torch.device("cpu"), dtype=torch.float32, load_s=0.0)
    results = {}
    for enabled in (True, False):
        settings = SummarizeConfig(**PLAIN, loop_stop={"enabled": enabled})
        engine = BatchEngine(loaded, settings, "auto", 1, 1 << 40, _is_memory_error)
        try:
            request = PassRequest(prompt, new, device_bytes=0,
                                  make_cache=lambda: build_cache("dynamic", model, CacheConfig(), tmp_path, None))
            results[enabled] = engine.submit(request).result(timeout=120).generation
        finally:
            engine.close()
    assert results[True].tokens == kept and results[True].stop_reason == StopReason.REPETITION
    assert results[False].tokens == plain and results[False].stop_reason == StopReason.LENGTH
