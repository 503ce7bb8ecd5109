"""`summarize.generation`: transformers GenerationConfig fields reach generate(); wrong ones, and a context
the model has no positions for, are config errors at submit, before any document runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.config import ConfigError, SummarizeConfig, load_config
from runner.engine.generation import generate_once
from runner.preflight import check_settings
from tests.helpers.cli import TINY_CONFIG, kvbatch, refusal, write_jsonl


def _tokens(tiny, **generation) -> list[int]:
    prompt = tiny.tokenizer("The committee approved the budget for the new library and the park.")["input_ids"]
    return generate_once(tiny, prompt, 48, SummarizeConfig(generation=generation, no_repeat_summary_ngram=0), {}).tokens


def test_generation_fields_reach_generate(tiny_random) -> None:
    plain = _tokens(tiny_random)
    assert len(set(plain)) < len(plain), "the baseline must repeat a token, or no_repeat_ngram_size could not show"
    assert len(set(_tokens(tiny_random, no_repeat_ngram_size=1))) == len(plain)
    assert _tokens(tiny_random, suppress_tokens=[plain[0]])[0] != plain[0]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("summarize.generation.repetition_penlty=1.15", "unknown key 'summarize.generation.repetition_penlty'"),
        ("summarize.generation.temperature=0.7", "`temperature`: `do_sample` is not set to `True`"),
        ("summarize.generation.max_new_tokens=9", "kvbatch sets it from summarize.max_new_tokens"),
        ("summarize.generation.num_beams=4", "summarize.generation.num_beams is not supported"),
        ("summarize.context_tokens=9000", "summarize.context_tokens (9000) is above the max_position_embeddings (8192)"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_key(setting: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_settings(load_config(TINY_CONFIG, [setting]))
    assert message in " ".join(str(raised.value).split())


def test_a_bad_setting_stops_submit_before_anything_starts(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "Some text."}])
    proc = refusal("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"),
                   "--set", "summarize.generation.repetition_penlty=1.15")
    assert "unknown key 'summarize.generation.repetition_penlty'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "job").exists()


def test_context_limit_is_read_from_a_model_folder_without_weights(tmp_path: Path) -> None:
    """A folder with only config.json: if submit loaded weights it would fail on their absence instead."""
    from transformers import LlamaConfig

    model = tmp_path / "model"
    LlamaConfig(max_position_embeddings=512, hidden_size=64, num_attention_heads=4, num_hidden_layers=1).save_pretrained(model)
    assert [p.name for p in model.iterdir()] == ["config.json"]
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "Some text."}])
    proc = refusal("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"),
                   "--set", f"model.name={model}", "--set", "summarize.context_tokens=1024")
    assert f"above the max_position_embeddings (512) of model {model}" in " ".join(proc.stderr.split())


def test_resume_with_a_bad_setting_is_a_config_error(tmp_path: Path, ray_address: str) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "Some text about a meeting."}])
    job = tmp_path / "job"
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            "--set", "summarize.generation.repetition_penalty=1.15", check=0)
    assert json.loads((job / "job.json").read_text())["config"]["summarize"]["generation"] == {"repetition_penalty": 1.15}
    proc = refusal("resume", str(job), "--set", "summarize.generation.top_pp=0.9")
    assert "unknown key 'summarize.generation.top_pp'" in proc.stderr
