"""The config schema: defaults, YAML files, --set overrides and errors that name the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["default.yaml", "tiny.yaml", "gpu-nvme.yaml"])
def test_shipped_configs_are_valid(name):
    load_config(REPO / "configs" / name)


def test_overrides_are_typed_and_dotted():
    cfg = load_config(None, ["cache.strategy=tiered-disk", "summarize.max_new_tokens=64",
                             "cache.ladder=[dynamic, tiered-disk]", "workers.count=2"])
    assert cfg.cache.strategy == "tiered-disk" and cfg.summarize.max_new_tokens == 64
    assert cfg.cache.ladder == ["dynamic", "tiered-disk"] and cfg.workers.count == 2


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("cache.stratgy=dynamic", "cache.stratgy"),
        ("nonsense.key=1", "nonsense"),
        ("summarize.max_new_tokens=0", "summarize.max_new_tokens"),
        ("cache.device_kv_budget_bytes=-5", "cache.device_kv_budget_bytes"),
        ("retry.context_shrink=1.5", "retry.context_shrink"),
        ("workers.count=0", "workers.count"),
        ("summarize.min_context_tokens=99999", "min_context_tokens"),
        ("cache.strategy=tiered-nvme", "cache.strategy"),
        ("cache.ladder=[dynamic, ram]", "cache.ladder"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["justakey"])


@pytest.mark.parametrize(
    ("text", "named"),
    [
        # a second section replaced the first: its max_new_tokens 64 became the default 120
        ("summarize:\n  max_new_tokens: 64\ncache:\n  strategy: dynamic\nsummarize:\n  context_tokens: 1024\n",
         "key 'summarize' appears twice (lines 1 and 5)"),
        ("summarize:\n  max_new_tokens: 64\n  max_new_tokens: 32\n", "key 'summarize.max_new_tokens' appears twice"),
        ("cache:\n  ladder: [dynamic]\n  offload_root: /a\n  offload_root: /b\n", "key 'cache.offload_root' appears twice"),
        ("summarize:\n  generation: {top_k: 5, top_k: 7}\n", "key 'summarize.generation.top_k' appears twice"),
    ],
)
def test_a_key_given_twice_in_a_config_file_is_an_error_naming_it(tmp_path: Path, text: str, named: str) -> None:
    config = tmp_path / "twice.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(named)) as raised:
        load_config(config)
    assert str(config) in str(raised.value) and "\n" not in str(raised.value)


def test_a_key_given_twice_in_a_set_value_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=re.escape("key 'summarize.generation.top_k' appears twice")):
        load_config(None, ["summarize.generation={top_k: 5, top_k: 7}"])


def test_an_anchored_mapping_merged_in_is_no_duplicate(tmp_path: Path) -> None:
    config = tmp_path / "merged.yaml"
    config.write_text("summarize:\n  loop_stop: &stop {ngram: 4, repeats: 3}\n  max_new_tokens: 64\n"
                      "  generation:\n    <<: {top_k: 5}\n    top_p: 0.9\n")
    assert load_config(config).summarize.generation == {"top_k": 5, "top_p": 0.9}


@pytest.mark.parametrize("value", ["yes", "true", "on", "no", "false"])
@pytest.mark.parametrize("key", ["summarize.max_new_tokens", "workers.count", "batch.max_sequences",
                                 "retry.backoff_initial_s", "cache.device_kv_budget_bytes", "summarize.seed"])
def test_a_yes_or_no_for_a_number_is_an_error_naming_the_key(tmp_path: Path, key: str, value: str) -> None:
    """YAML reads yes/true/on as True and pydantic took it as 1 (a manifest row's `true` was already refused)."""
    section, name = key.split(".")
    config = tmp_path / "bool.yaml"
    config.write_text(f"{section}:\n  {name}: {value}\n")
    for load in (lambda: load_config(config), lambda: load_config(None, [f"{key}={value}"])):
        with pytest.raises(ConfigError, match=re.escape(key) + ": .*must be a number, not true/false"):
            load()


def test_yes_and_no_still_set_a_yes_or_no_key() -> None:
    config = load_config(None, ["summarize.do_sample=yes", "cache.shuffle=off", "summarize.loop_stop.enabled=no"])
    assert config.summarize.do_sample is True and config.cache.shuffle is False
    assert config.summarize.loop_stop.enabled is False


@pytest.mark.parametrize("word", ["on", "off", "auto"])
def test_static_step_takes_on_and_off_as_the_docs_write_them(tmp_path: Path, word: str) -> None:
    """YAML 1.1 read `on`/`off` as true/false, so the values docs/config.md names were refused (issue 47, row 18)."""
    config = tmp_path / "static.yaml"
    config.write_text(f"batch:\n  static_step: {word}\n")
    assert load_config(config).batch.static_step == word
    assert load_config(None, [f"batch.static_step={word}"]).batch.static_step == word


def test_configs_are_read_as_yaml_1_2_where_only_true_and_false_are_booleans(tmp_path: Path) -> None:
    config = tmp_path / "words.yaml"
    config.write_text("model:\n  name: yes\nsummarize:\n  prompt: off\n  do_sample: true\n")
    loaded = load_config(config)
    assert loaded.model.name == "yes" and loaded.summarize.prompt == "off" and loaded.summarize.do_sample is True
    assert load_config(None, ["summarize.prompt=No", "summarize.do_sample=False"]).summarize.prompt == "No"
