"""Every GenerationConfig field kvbatch accepts in `summarize.generation` is honoured in the batched
decode exactly as generate() honours it alone; every other field is refused at submit with a reason.

For each accepted field: three prompts (one of a single token, one that already holds the tokens the model repeats) decode together through the real
BatchEngine, and each gets exactly the tokens `model.generate()` gives it alone with that field
(tiny random model; greedy, or seeded sampling for a sampling field). The test also shows the
field changed the tokens, except for the few that cannot change a causal model's tokens (NO_EFFECT).
A GenerationConfig field that transformers adds later fails here until it is given a case or refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from jobs.config import ConfigError, SummarizeConfig
from runner.engine.batch_engine import BatchEngine
from runner.engine.worker import _is_memory_error
from runner.preflight import OWNED_FIELDS, UNSUPPORTED_FIELDS, check_generation
from tests.helpers.batching import BIG, as_loaded_model, run_batch
from tests.helpers.cli import TINY_CONFIG, refusal, write_jsonl
from tests.helpers.models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _unseen(tokens: list[int]) -> int:
    """A token the plain decode never chooses: an end-of-sequence token only a setting brings on."""
    return next(t for t in range(2, 96) if t not in tokens)


LENGTHS = [37, 1]  # and a third prompt: the first with its first plain tokens (a repeating cycle) appended
NEW = 14
SEED = 11
ACCEPTED = sorted(
    {name for name in GenerationConfig().to_dict() if not name.startswith("_")}
    - {"transformers_version"} - set(OWNED_FIELDS) - set(UNSUPPORTED_FIELDS)
)

Case = Callable[[list[int], Any], dict[str, Any]]
"""The fields to set, from prompt 0's plain greedy tokens and the tokenizer (so each setting bites on this model)."""
CASES: dict[str, Case] = {
    "bad_words_ids": lambda plain, tok: {"bad_words_ids": [[plain[0]], [plain[2], plain[3]]]},
    "begin_suppress_tokens": lambda plain, tok: {"begin_suppress_tokens": [plain[0]]},
    "bos_token_id": lambda plain, tok: {"bos_token_id": 1},
    "decoder_start_token_id": lambda plain, tok: {"decoder_start_token_id": 1},
    "disable_compile": lambda plain, tok: {"disable_compile": True},
    "encoder_no_repeat_ngram_size": lambda plain, tok: {"encoder_no_repeat_ngram_size": 1},
    "encoder_repetition_penalty": lambda plain, tok: {"encoder_repetition_penalty": 3.0},
    "eos_token_id": lambda plain, tok: {"eos_token_id": plain[8]},
    "epsilon_cutoff": lambda plain, tok: {"epsilon_cutoff": 0.02},
    "eta_cutoff": lambda plain, tok: {"eta_cutoff": 0.9},
    "exponential_decay_length_penalty": lambda plain, tok: {"exponential_decay_length_penalty": [8, 1.5],
                                                       "eos_token_id": _unseen(plain)},
    "forced_bos_token_id": lambda plain, tok: {"forced_bos_token_id": 1},  # acts on a 1-token prompt
    "forced_eos_token_id": lambda plain, tok: {"forced_eos_token_id": next(t for t in range(2, 9) if t != plain[-1])},
    "guidance_scale": lambda plain, tok: {"guidance_scale": 3.0},
    "max_time": lambda plain, tok: {"max_time": 0.0},  # every sequence ends after its first token
    "min_length": lambda plain, tok: {"min_length": LENGTHS[0] + 8, "eos_token_id": plain[1]},
    "min_new_tokens": lambda plain, tok: {"min_new_tokens": 8, "eos_token_id": plain[1]},
    "min_p": lambda plain, tok: {"min_p": 0.8},
    "no_repeat_ngram_size": lambda plain, tok: {"no_repeat_ngram_size": 2},
    "remove_invalid_values": lambda plain, tok: {"remove_invalid_values": True},
    "renormalize_logits": lambda plain, tok: {"renormalize_logits": True},
    "repetition_penalty": lambda plain, tok: {"repetition_penalty": 1.5},
    "sequence_bias": lambda plain, tok: {"sequence_bias": [[[plain[0]], -100.0], [[plain[1], plain[2]], -100.0]]},
    "stop_strings": lambda plain, tok: {"stop_strings": [tok.decode(plain[6:8])]},
    "suppress_tokens": lambda plain, tok: {"suppress_tokens": [plain[0], plain[1]]},
    "temperature": lambda plain, tok: {"temperature": 0.5},
    "top_h": lambda plain, tok: {"top_h": 0.5},
    "top_k": lambda plain, tok: {"top_k": 3},
    "top_p": lambda plain, tok: {"top_p": 0.6},
    "typical_p": lambda plain, tok: {"typical_p": 0.6},
    "watermarking_config": lambda plain, tok: {"watermarking_config": {"greenlist_ratio": 0.25, "bias": 6.0}},
}
#: Sampling fields: checked with do_sample and a seed, against generate() after torch.manual_seed(seed).
SAMPLING = {"epsilon_cutoff", "eta_cutoff", "min_p", "temperature", "top_h", "top_k", "top_p", "typical_p"}
#: Fields that cannot change a causal model's tokens here, and why: equality is all there is to show.
NO_EFFECT = {
    "bos_token_id": "generate() uses it only to start a generation without a prompt",
    "decoder_start_token_id": "encoder-decoder models only",
    "disable_compile": "nothing is compiled on this model (no static cache)",
    "remove_invalid_values": "the logits are finite",
    "renormalize_logits": "softmax of log-softmax is the same distribution; greedy takes the same argmax",
}


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_model("llama-gqa")


@pytest.fixture(scope="module")
def prompts(model, tokenizer) -> list[list[int]]:
    first, single = (random_prompt(n)[0].tolist() for n in LENGTHS)
    return [first, single, first + _alone(model, tokenizer, first, False, {})[:6]]


@pytest.fixture(scope="module")
def without_fields(model, tokenizer, prompts) -> dict[bool, list[list[int]]]:
    """Each prompt's tokens alone with no field set, greedy (False) and sampled (True)."""
    return {sample: [_alone(model, tokenizer, p, sample, {}) for p in prompts] for sample in (False, True)}


def _alone(model: PreTrainedModel, tokenizer, prompt: list[int], sample: bool, fields: dict[str, Any]) -> list[int]:
    if sample:
        torch.manual_seed(SEED)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=sample, tokenizer=tokenizer,
                             **fields)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("field", ACCEPTED)
def test_an_accepted_field_gives_batched_the_tokens_generate_gives_alone(field: str, model, prompts, tokenizer,
                                                                        without_fields, tmp_path: Path) -> None:
    assert field in CASES, f"GenerationConfig field {field} is accepted at submit: give it a case or refuse it"
    fields = CASES[field](without_fields[False][0], tokenizer)
    sample = field in SAMPLING
    # the loop stop and the summary n-gram ban are kvbatch's own, on top of generate()'s: off for the comparison
    settings = SummarizeConfig(do_sample=sample, seed=SEED, generation=fields, no_repeat_summary_ngram=0,
                               loop_stop={"enabled": False})
    check_generation(settings)  # accepted at submit
    expected = [_alone(model, tokenizer, p, sample, fields) for p in prompts]
    engine = BatchEngine(as_loaded_model(model, tokenizer), settings, "auto", len(prompts), BIG, _is_memory_error)
    try:
        got = [g.tokens for g in run_batch(engine, model, "dynamic", tmp_path, prompts, [NEW] * len(prompts))]
    finally:
        engine.close()
    assert got == expected
    assert field == "max_time" or engine.plan.most_rows >= 2  # they decoded side by side
    if field not in NO_EFFECT:
        assert expected != without_fields[sample], "the field changed nothing"


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
def test_a_field_the_batched_decode_cannot_honour_is_refused_with_its_reason(field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_generation(SummarizeConfig(generation={field: 1}))
    message = str(raised.value)
    assert message.startswith(f"summarize.generation.{field} is not supported: ") and "\n" not in message
    assert message.endswith("; remove it") and UNSUPPORTED_FIELDS[field] in message


@pytest.mark.parametrize(("setting", "message"), [
    ("summarize.generation.prompt_lookup_num_tokens=3",
     "summarize.generation.prompt_lookup_num_tokens is not supported: it selects another decoding loop"),
    ("summarize.generation.max_length=78",
     "summarize.generation.max_length: kvbatch sets it from summarize.max_new_tokens"),
])
def test_submit_refuses_such_a_field_in_one_line_before_anything_starts(setting: str, message: str,
                                                                       tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "Some text."}])
    proc = refusal("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"),
                   "--set", setting)
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "job").exists()
