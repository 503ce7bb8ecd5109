"""The config schema: defaults, YAML files, --set overrides and errors that name the key."""

from __future__ import annotations

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
