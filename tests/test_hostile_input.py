"""Hostile manifests and configs through the parser and the real CLI: a clear message naming the
row or key, the rest of the batch goes on, never a traceback. (tests/test_manifest.py covers the
per-reason messages; this file adds random structured rows, random configs and the CLI path.)"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs.config import ConfigError, InputConfig, config_from_dict
from jobs.manifest import read_manifest
from tests.helpers.cli import REPO, TINY_CONFIG, export_rows, kvbatch, refusal, write_jsonl

SMALL_INPUT = InputConfig(max_document_bytes=4096)

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
    st.text(max_size=30), st.sampled_from(["", " ", "\x00", "..", "/etc/passwd", "$(touch x)", "e\u0301", "\u00e9"]),
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
row_fields = st.dictionaries(
    st.sampled_from(["id", "text", "path", "max_new_tokens", "prompt", "lang", ""]), json_values, max_size=6
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(row_fields, min_size=1, max_size=8))
def test_random_structured_rows_become_tasks_or_named_rejections(tmp_path: Path, rows: list[dict]) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [*rows, {"id": "zz-good", "text": "A real document."}])
    tasks, rejections = read_manifest(manifest, SMALL_INPUT)
    assert tasks[-1].doc_id == "zz-good" or any(r.doc_id == "zz-good" for r in rejections)  # a duplicate id may claim it
    assert len(tasks) + len(rejections) == len(rows) + 1  # every row accounted for, once
    for rejection in rejections:
        assert rejection.reason.startswith(f"m.jsonl line {rejection.row}") and ": " in rejection.reason
    for task in tasks:
        assert task.n_bytes <= SMALL_INPUT.max_document_bytes and task.doc_id.strip()


config_keys = st.sampled_from(
    ["model", "summarize", "cache", "retry", "workers", "checkpoint", "input", "modle", "cache.strategy",
     "summarize.max_new_tokens", "cache.device_kv_budget_bytes", "retry.context_shrink", "workers.count",
     "input.max_document_bytes", "checkpoint.flush_every", "cache.ladder", "summarize.seed", "cache.zstd_levle"]
)


def _nest(dotted: str, value: object) -> dict:
    head, _, rest = dotted.partition(".")
    return {head: _nest(rest, value) if rest else value}


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.tuples(config_keys, json_values), max_size=4))
@example(items=[("model", {"\x1e\x1e": 0})])  # a draw that once split the message: \x1e ends a line
def test_random_configs_are_valid_or_a_config_error_naming_the_key(items: list[tuple[str, object]]) -> None:
    data: dict = {}
    for key, value in items:
        section = _nest(key, value)
        name = next(iter(section))
        if isinstance(data.get(name), dict) and isinstance(section[name], dict):
            data[name].update(section[name])
        else:
            data.update(section)
    try:
        config_from_dict(data, "hypothesis")
    except ConfigError as e:
        message = str(e)
        assert message.startswith("invalid config (hypothesis):")
        named = [line.split(":")[0].strip() for line in message.splitlines()[1:]]
        assert named and all(n for n in named)


def test_a_config_key_with_control_characters_is_named_escaped_on_one_line() -> None:
    with pytest.raises(ConfigError) as error:
        config_from_dict({"model": {"\x1e\x1e": 0, "ok\nkey": 1}, "cache": {"strategy": 5}}, "test")
    lines = str(error.value).splitlines()
    assert len(lines) == 4, lines
    assert "unknown key 'model.\\x1e\\x1e'" in lines[1] + lines[2] and "unknown key 'model.ok\\nkey'" in lines[1] + lines[2]
    assert lines[3].startswith("  cache.strategy: ")


def test_property_tests_are_derandomized_when_ci_is_set() -> None:
    code = "import tests.conftest; from hypothesis import settings; print(settings.default.derandomize)"
    without_ci = {k: v for k, v in os.environ.items() if k != "CI"}
    for env, expected in (({**without_ci, "CI": "1"}, "True"), (without_ci, "False")):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=REPO, env=env)
        assert proc.stdout.strip() == expected, proc.stderr
    assert "export CI=1" in (REPO / ".ci" / "run").read_text()  # CI runs the suite with the profile on


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b"cache:\n  stratgy: dynamic\n", "unknown key 'cache.stratgy'"),
        (b"summarize:\n  max_new_tokens: -3\n", "summarize.max_new_tokens"),
        (b"cache:\n  host_kv_budget_bytes: 0\n", "cache.host_kv_budget_bytes"),
        (b"input:\n  max_document_bytes: 0\n", "input.max_document_bytes"),
        (b"retry: 5\n", "retry: Input should be a valid dictionary"),
        (b"model:\n  name: \xff\xfe\n", "is not valid UTF-8"),
        (b"a: &a [*a]\n", "a.0 contains itself"),
        (b"cache: {ladder: []}\n", "cache.ladder"),
    ],
    ids=["typo", "negative", "zero-budget", "zero-limit", "not-a-section", "bad-utf8", "recursive-yaml", "empty-ladder"],
)
def test_bad_config_files_exit_2_through_the_cli_naming_the_key(tmp_path: Path, content: bytes, named: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "Some text."}])
    proc = refusal("submit", str(manifest), "-c", str(config), "-j", str(tmp_path / "job"))
    assert named in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "job" / "job.json").exists()  # nothing started


def _hostile_rows(tmp_path: Path) -> list[dict | str]:
    root = tmp_path / "docs"
    root.mkdir()
    (root / "good.txt").write_text("A perfectly ordinary document about licences.\n" * 20)
    (root / "huge.txt").open("wb").truncate(2 * 1024**3)  # sparse: costs no disk, would cost 2 GB of RAM
    (root / "latin1.txt").write_bytes("Caf\xe9".encode("latin-1"))
    (root / "nul.txt").write_bytes(b"text\x00more")
    (root / "subdir").mkdir()
    os.mkfifo(root / "fifo")
    (root / "escape.txt").symlink_to("/etc/hostname")
    return [
        {"id": "good-inline", "text": "Inline text of a document."},
        '{"id": "truncated", "text": "no end',
        "\x00\x00\x00",
        {"id": "huge", "path": "docs/huge.txt"},
        {"id": "latin1", "path": "docs/latin1.txt"},
        {"id": "nul-file", "path": "docs/nul.txt"},
        {"id": "nul-text", "text": "a\x00b"},
        {"id": "dir", "path": "docs/subdir"},
        {"id": "fifo", "path": "docs/fifo"},
        {"id": "device", "path": "/dev/zero"},
        {"id": "dotdot", "path": "docs/../../outside.txt"},
        {"id": "absolute", "path": "/etc/hostname"},
        {"id": "symlink", "path": "docs/escape.txt"},
        {"id": "caf\u00e9", "text": "Composed."},
        {"id": "cafe\u0301", "text": "Decomposed duplicate."},
        {"id": "zero-tokens", "text": "x", "max_new_tokens": 0},
        {"id": "good-file", "path": "docs/good.txt"},
    ]


EXPECTED_REASONS = {
    "huge": "over input.max_document_bytes",
    "nul-file": "is binary: 1 of its 9 bytes", "nul-text": "is binary: 1 of its 3 bytes", "dir": "is a directory",
    "fifo": "is a FIFO", "device": "outside input.documents_root", "dotdot": "outside input.documents_root",
    "absolute": "outside input.documents_root", "symlink": "outside input.documents_root",
    "cafe\u0301": "equal after Unicode normalisation", "zero-tokens": "'max_new_tokens' must be a positive integer",
}


def _write_hostile(tmp_path: Path) -> tuple[Path, Path]:
    rows = _hostile_rows(tmp_path)
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(b"".join((r if isinstance(r, str) else json.dumps(r)).encode("utf-8", "surrogatepass") + b"\n" for r in rows))
    config = tmp_path / "c.yaml"
    settings_ = yaml.safe_load(TINY_CONFIG.read_text())
    settings_["input"] = {"documents_root": str(tmp_path / "docs"), "max_document_bytes": 100_000}
    config.write_text(yaml.safe_dump(settings_))
    return manifest, config


def test_strict_submit_of_a_hostile_manifest_names_every_row_reads_nothing_big_and_starts_nothing(tmp_path: Path) -> None:
    manifest, config = _write_hostile(tmp_path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = kvbatch("submit", str(manifest), "-c", str(config), "-j", str(tmp_path / "job"), "--strict", check=2, timeout=60)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak_kib < 1024 * 1024 or peak_kib == before  # far below the 2 GiB a read of huge.txt would need
    assert "Traceback" not in proc.stderr + proc.stdout
    out = " ".join(proc.stdout.split())
    assert "13 manifest row(s) rejected" in out and "--strict: nothing was started" in out
    for doc_id, reason in EXPECTED_REASONS.items():
        assert any(f"(id {doc_id!r})" in line and reason in line for line in proc.stdout.splitlines()), (doc_id, proc.stdout)
    assert "m.jsonl line 2: is not valid JSON" in out and "m.jsonl line 3: is not valid JSON" in out  # cut JSON, NULs


def test_the_batch_goes_on_past_hostile_rows_and_exports_them_as_errors(tmp_path: Path, ray_address: str) -> None:
    manifest, config = _write_hostile(tmp_path)
    job = tmp_path / "job"
    proc = kvbatch("submit", str(manifest), "-c", str(config), "-j", str(job), "--address", ray_address, check=3)
    assert "Traceback" not in proc.stderr + proc.stdout
    rows = {r["task_id"]: r for r in export_rows(job)}
    done = sorted(r["doc_id"] for r in rows.values() if r["status"] == "done")
    assert done == ["café", "good-file", "good-inline", "latin1"]  # a Latin-1 file is decoded, not refused
    errors = export_rows(job, "--errors")
    assert len(errors) == 13 and {r["status"] for r in errors} == {"rejected"}
    by_id = {r["doc_id"]: r["error"] for r in errors if r["doc_id"]}
    for doc_id, reason in EXPECTED_REASONS.items():
        assert reason in by_id[doc_id]
    assert sorted(r["task_id"] for r in errors if r["doc_id"] is None) == ["t000002", "t000003"]  # cut JSON, NULs


def test_pseudo_files_are_rejected_rows_naming_the_path_listed_or_linked(tmp_path: Path) -> None:
    """`/proc/self/environ` would give submit's environment (credentials included) to the model and the
    results: as a row's path, through a symlink in a documents folder, and in a submitted folder."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.txt").write_text("An ordinary document about licences.\n")
    (docs / "notes.txt").symlink_to("/proc/self/environ")
    manifest = write_jsonl(tmp_path / "m.jsonl", [
        {"id": "environ", "path": "/proc/self/environ"},
        {"id": "linked", "path": "docs/notes.txt"},
        {"id": "sys", "path": "/sys/devices/system/cpu/online"},
        {"id": "good", "path": "docs/good.txt"},
    ])
    secret = {"KVBATCH_TEST_SECRET": "do-not-leak-7f3a"}
    listed = refusal("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"), "--strict",
                     env=secret)
    folder = refusal("submit", str(docs), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job2"), "--strict",
                     env=secret)
    for proc in (listed, folder):
        assert "do-not-leak" not in proc.stdout + proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    lines = " ".join(listed.stdout.split()).split(" row ")
    for doc_id, path in (("environ", "'/proc/self/environ'"), ("linked", "'docs/notes.txt'"),
                         ("sys", "'/sys/devices/system/cpu/online'")):
        assert any(f"(id {doc_id!r}): 'path' {path}: " in line and "is on a pseudo file system" in line
                   for line in lines), (doc_id, listed.stdout)
    assert "3 manifest row(s) rejected" in listed.stdout
    out = " ".join(folder.stdout.split())
    assert "1 manifest row(s) rejected" in out and "(id 'notes.txt')" in out and "pseudo file system (proc)" in out


def test_a_row_prompt_too_long_for_the_context_is_refused_at_submit(tmp_path: Path) -> None:
    """It passed submit and failed at run time (exit 3); now a rejected row naming it (--strict: exit 2)."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [
        {"id": "memo", "text": "The committee agreed to publish the figures next week."},
        {"id": "long-prompt", "text": "A memo.", "prompt": "Summarise this carefully. " * 60000},
    ])
    proc = refusal("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"), "--strict")
    out = " ".join(proc.stdout.split())
    assert "1 manifest row(s) rejected" in out and "m.jsonl line 2 (id 'long-prompt'): 'prompt' takes " in out, out
    assert "--strict: nothing was started" in out and not (tmp_path / "job").exists()


def test_a_folder_on_a_pseudo_file_system_is_refused_before_it_is_listed(tmp_path: Path) -> None:
    """`submit /proc/self` would list thousands of kernel files (environ among them), one rejected row each."""
    proc = refusal("submit", "/proc/self", "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"))
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "folder /proc/self is on a pseudo file system (proc)" in out and "no documents" in out, out
    assert not (tmp_path / "job").exists() and "Traceback" not in proc.stdout + proc.stderr
