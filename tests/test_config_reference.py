"""One source of truth for the config: jobs/config.py's fields. configs/default.yaml, the reference
tables in docs/config.md and `kvbatch config` must give every key the code's default and meaning."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field
from pydantic_core import to_jsonable_python
from typer.testing import CliRunner

from jobs.config import JobConfig, load_config

REPO = Path(__file__).resolve().parents[1]
DEFAULT_YAML = REPO / "configs" / "default.yaml"
CONFIG_DOC = REPO / "docs" / "config.md"
TABLE_ROW = re.compile(r"^\| `(?P<key>[a-z_.]+)` \| `(?P<value>.*)` \| (?P<meaning>.*) \|$")


def code_defaults(config: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of `config` (dotted) and its value, read from the pydantic model itself."""
    found: dict[str, Any] = {}
    for name in type(config).model_fields:
        value, dotted = getattr(config, name), f"{prefix}{name}"
        if isinstance(value, BaseModel):
            found |= code_defaults(value, dotted + ".")
        else:
            found[dotted] = to_jsonable_python(value)
    return found


def yaml_leaves(data: dict[str, Any], leaf_keys: set[str], prefix: str = "") -> dict[str, Any]:
    """The leaves of a parsed YAML mapping; a key the code calls a leaf stays whole (`generation: {}`)."""
    found: dict[str, Any] = {}
    for name, value in data.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict) and dotted not in leaf_keys:
            found |= yaml_leaves(value, leaf_keys, dotted + ".")
        else:
            found[dotted] = value
    return found


def disagreements(where: str, found: dict[str, Any], code: dict[str, Any]) -> list[str]:
    """One line per key that `where` leaves out, adds, or gives another default than jobs/config.py."""
    lines = [f"{key}: missing from {where}" for key in code if key not in found]
    lines += [f"{key}: in {where} but not in jobs/config.py" for key in found if key not in code]
    lines += [f"{key}: {where} says {found[key]!r}, jobs/config.py {code[key]!r}"
              for key in code if key in found and found[key] != code[key]]
    return lines


def test_default_yaml_holds_every_key_at_the_codes_default():
    code = code_defaults(JobConfig())
    found = yaml_leaves(yaml.safe_load(DEFAULT_YAML.read_text(encoding="utf-8")), set(code))
    assert code, "no config keys read from jobs/config.py"
    problems = disagreements("configs/default.yaml", found, code)
    assert not problems, "\n".join(problems)


def test_the_reference_tables_give_every_key_its_default_and_meaning():
    code = code_defaults(JobConfig())
    rows = [m for line in CONFIG_DOC.read_text(encoding="utf-8").splitlines() if (m := TABLE_ROW.match(line))]
    found = {m["key"]: yaml.safe_load(m["value"].replace("\\|", "|")) for m in rows}
    problems = disagreements("docs/config.md", found, code)
    problems += [f"{m['key']}: no meaning in docs/config.md" for m in rows if not m["meaning"].strip()]
    assert not problems, "\n".join(problems)
    assert len(rows) == len(found), "a key has two rows in docs/config.md"


def test_every_key_says_what_it_means():
    from jobs.config_reference import leaves, section_of

    keys = list(leaves(section_of(JobConfig())))
    assert [k.path for k in keys] == list(code_defaults(JobConfig()))
    assert all(len(k.meaning.split()) >= 3 for k in keys), [k.path for k in keys if len(k.meaning.split()) < 3]


def test_the_written_files_are_what_the_code_writes():
    from jobs.config_reference import stale_files

    stale = [str(path.relative_to(REPO)) for path in stale_files()]
    assert not stale, f"{stale} differ from jobs/config.py's fields: run python -m jobs.config_reference"


def test_the_readme_points_at_the_reference():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "(docs/config.md)" in readme and "kvbatch config --explain" in readme


class _Extra(BaseModel):
    """A section a later change adds."""

    documented: int = Field(7, description="how many of something, in widgets")
    undocumented: int = 1


class _WithExtra(JobConfig):
    extra: _Extra = Field(default_factory=_Extra)


def test_a_key_without_a_description_is_refused_naming_it():
    from jobs.config_reference import ConfigReferenceError, reference_tables

    with pytest.raises(ConfigReferenceError, match=r"config key extra\.undocumented has no description"):
        reference_tables(_WithExtra())


def test_a_new_documented_key_reaches_the_yaml_and_the_tables():
    from jobs.config_reference import config_yaml, reference_tables

    class Documented(BaseModel):
        documented: int = Field(7, description="how many of something, in widgets")

    class WithDocumented(JobConfig):
        extra: Documented = Field(default_factory=Documented)

    text = config_yaml(WithDocumented())
    assert yaml.safe_load(text)["extra"] == {"documented": 7}
    assert "  # how many of something, in widgets\n  documented: 7\n" in text
    assert "| `extra.documented` | `7` | how many of something, in widgets |" in reference_tables(WithDocumented())


def test_kvbatch_config_prints_the_resolved_config_and_explains_it():
    from runner.cli import app

    runner = CliRunner()
    plain = runner.invoke(app, ["config"])
    assert plain.exit_code == 0, plain.output
    assert DEFAULT_YAML.read_text(encoding="utf-8").endswith(plain.output), "kvbatch config is not default.yaml"

    changed = runner.invoke(app, ["config", "--set", "summarize.max_new_tokens=64", "--set", "cache.ladder=[dynamic]"])
    assert changed.exit_code == 0, changed.output
    assert yaml.safe_load(changed.output)["summarize"]["max_new_tokens"] == 64
    assert load_config(None, ["summarize.max_new_tokens=64", "cache.ladder=[dynamic]"]).model_dump() == \
        JobConfig.model_validate(yaml.safe_load(changed.output)).model_dump()

    explained = runner.invoke(app, ["config", "--explain", "--set", "batch.max_sequences=4"])
    assert explained.exit_code == 0, explained.output
    assert "| key | value | meaning |" in explained.output
    assert re.search(r"^\| `batch\.max_sequences` \| `4` \| tasks a worker keeps in flight", explained.output, re.MULTILINE)

    bad = runner.invoke(app, ["config", "--set", "cache.stratgy=dynamic"])
    assert bad.exit_code == 2 and "cache.stratgy" in bad.output
