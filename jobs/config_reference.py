"""The config reference, written from jobs/config.py's fields so it cannot drift from the code.

Writes `configs/default.yaml` and docs/config.md's tables (`python -m jobs.config_reference`); `kvbatch
config` prints the same for any config. How to add a key: docs/development.md, "Adding a config key".
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from jobs.config import JobConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULT_YAML = REPO / "configs" / "default.yaml"
CONFIG_DOC = REPO / "docs" / "config.md"
WIDTH = 100
BEGIN = "<!-- begin config reference: written by `python -m jobs.config_reference` from jobs/config.py -->"
END = "<!-- end config reference -->"
DEFAULT_YAML_HEADER = (
    "# kvbatch defaults: every key with its default and what it means (docs/config.md).\n"
    "# Written by `python -m jobs.config_reference` from jobs/config.py: change a default or a meaning\n"
    "# there, not here. Copy this file to start your own, or override a key with --set section.key=value.\n"
)


class ConfigReferenceError(ValueError):
    """A config field the reference cannot document (no description)."""


@dataclass(frozen=True)
class Key:
    """One leaf of the config: its dotted name, its value there and what it means."""

    path: str
    value: Any  # plain YAML/JSON data
    meaning: str


@dataclass(frozen=True)
class Section:
    """A config section: its dotted name, what it is for (the class docstring), its keys and subsections."""

    path: str
    about: str
    keys: list[Key]
    sections: list[Section]


def section_of(config: BaseModel, path: str = "") -> Section:
    """The section tree of `config`, every leaf with its description; a leaf without one is an error."""
    keys: list[Key] = []
    sections: list[Section] = []
    for name, field in type(config).model_fields.items():
        dotted = f"{path}.{name}" if path else name
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            sections.append(section_of(value, dotted))
            continue
        if not field.description:
            raise ConfigReferenceError(
                f"config key {dotted} has no description: give it Field(..., description='what it means, its unit')"
            )
        keys.append(Key(dotted, to_jsonable_python(value), " ".join(field.description.split())))
    return Section(path, " ".join((type(config).__doc__ or "").split()), keys, sections)


def leaves(section: Section) -> Iterator[Key]:
    """Every key under `section`, in the order the code declares them."""
    yield from section.keys
    for child in section.sections:
        yield from leaves(child)


def flow(value: Any) -> str:
    """`value` as one line of YAML (`auto`, `[dynamic, tiered-host]`, `{}`, `null`)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent + "# ", subsequent_indent=indent + "# ",
                         break_long_words=False, break_on_hyphens=False)


def _yaml_key(key: Key, indent: str) -> list[str]:
    name = key.path.rsplit(".", 1)[-1]
    line = f"{indent}{name}: {flow(key.value)}"
    if len(line) <= WIDTH or not isinstance(key.value, str) or "\n" in key.value or "  " in key.value:
        return [line]
    # a long plain sentence: folded, so the file stays WIDTH wide and reads back as the same string
    body = textwrap.wrap(key.value, WIDTH - len(indent) - 2, break_long_words=False, break_on_hyphens=False)
    return [f"{indent}{name}: >-"] + [f"{indent}  {part}" for part in body]


def _yaml_section(section: Section, depth: int) -> list[str]:
    indent = "  " * depth
    lines = _comment(section.about, indent) + [f"{indent}{section.path.rsplit('.', 1)[-1]}:"]
    for key in section.keys:
        lines += _comment(key.meaning, indent + "  ") + _yaml_key(key, indent + "  ")
    for child in section.sections:
        lines += _yaml_section(child, depth + 1)
    return lines


def config_yaml(config: BaseModel) -> str:
    """`config` as YAML, each section and key after a comment saying what it means."""
    lines: list[str] = []
    for section in section_of(config).sections:
        lines += ["", *_yaml_section(section, 0)]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _tables(section: Section, value_heading: str) -> list[str]:
    lines = [f"### `{section.path}`", ""]
    if section.about:
        lines += [section.about, ""]
    if section.keys:
        lines += [f"| key | {value_heading} | meaning |", "|---|---|---|"]
        lines += [f"| `{k.path}` | `{_cell(flow(k.value))}` | {_cell(k.meaning)} |" for k in section.keys]
        lines.append("")
    for child in section.sections:
        lines += _tables(child, value_heading)
    return lines


def reference_tables(config: BaseModel, value_heading: str = "default") -> str:
    """Markdown: a table per section of every key, its value in `config` and what it means."""
    lines: list[str] = []
    for section in section_of(config).sections:
        lines += _tables(section, value_heading)
    return "\n".join(lines).rstrip("\n") + "\n"


def default_yaml_text() -> str:
    """What configs/default.yaml holds: the header and the defaults."""
    return DEFAULT_YAML_HEADER + config_yaml(JobConfig())


def config_doc_text(current: str) -> str:
    """docs/config.md with the part between its BEGIN and END markers replaced by the default tables."""
    head, begin, rest = current.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ConfigReferenceError(f"{CONFIG_DOC} has lost its markers {BEGIN!r} ... {END!r}: put them back")
    return f"{head}{BEGIN}\n\n{reference_tables(JobConfig())}\n{END}{tail}"


def stale_files() -> dict[Path, str]:
    """The reference files whose text differs from the code's, with the text they should hold."""
    wanted = {DEFAULT_YAML: default_yaml_text(), CONFIG_DOC: config_doc_text(CONFIG_DOC.read_text(encoding="utf-8"))}
    return {path: text for path, text in wanted.items()
            if not path.exists() or path.read_text(encoding="utf-8") != text}


def main(argv: list[str]) -> int:
    """Rewrite the stale reference files (`--check`: only name them, exit 1 if any)."""
    stale = stale_files()
    for path, text in stale.items():
        if "--check" not in argv:
            path.write_text(text, encoding="utf-8")
        print(f"{'stale' if '--check' in argv else 'wrote'}: {path.relative_to(REPO)}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
