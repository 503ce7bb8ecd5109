"""Config values and manifest overrides that were accepted and then failed once the batch ran: each is
refused where it is read (config load, manifest parse), with a message naming the key or the row."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jobs.config import MAX_CONFIG_BYTES, MAX_CONFIG_VALUES, MAX_SEQUENCES, ConfigError, config_from_dict, load_config
from jobs.manifest import read_manifest
from runner.cli import app
from tests.helpers.cli import REPO, TINY_CONFIG, write_jsonl


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("batch.max_sequences=100000", "batch.max_sequences"),
        ("workers.cpus_per_worker=0.00001", "workers.cpus_per_worker"),
        ("workers.gpus_per_worker=0.00001", "workers.gpus_per_worker"),
        ("checkpoint.flush_interval_s=.inf", "checkpoint.flush_interval_s"),
        ("retry.backoff_max_s=1.0e+300", "retry.backoff_max_s"),
        ("input.max_document_bytes=2000000000000000000", "input.max_document_bytes"),
        ("input.max_document_bytes=2.0e+18", "input.max_document_bytes"),
        ("model.device=cuda:abc", "model.device"),
        ("model.device=cuda:-1", "model.device"),
        ("model.device=cuda:01", "model.device"),
        ("model.device=cuda:128", "model.device"),
        ("model.device=CUDA", "model.device"),
        ("summarize.seed=100000000000000000000", "summarize.seed"),
        ("cache.block_tokens=100000000000", "cache.block_tokens"),
    ],
)
def test_values_that_fail_later_are_refused_at_load(override, named):
    with pytest.raises(ConfigError, match=rf"{named.replace('.', '[.]')}: ") as refused:
        load_config(TINY_CONFIG, [override])
    assert "\n" in str(refused.value) and "Traceback" not in str(refused.value)


@pytest.mark.parametrize(
    "override",
    [f"batch.max_sequences={MAX_SEQUENCES}", "workers.cpus_per_worker=0.0001", "workers.gpus_per_worker=0",
     "checkpoint.flush_interval_s=86400", "input.max_document_bytes=2147483647", "model.device=cuda:7",
     "model.device=cpu", "model.device=mps", "summarize.seed=18446744073709551615", "summarize.seed=-1",
     "cache.block_tokens=1048576"],
)
def test_the_bounds_themselves_are_accepted(override):
    load_config(TINY_CONFIG, [override])


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    lines = ["summarize:", "  generation:", f"    l0: &l0 [{', '.join(['lol'] * 9)}]"]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")  # 9**9 strings once expanded, a few hundred bytes as written
    with pytest.raises(ConfigError, match=rf"{bomb}.*more than {MAX_CONFIG_VALUES:,} values.*alias"):
        load_config(bomb)


@pytest.mark.parametrize("text", ["summarize:\n  generation: &g {again: *g}\n",
                                  "cache:\n  ladder: &l [dynamic, *l]\n"])
def test_a_circular_yaml_alias_is_refused(tmp_path, text):
    circular = tmp_path / "circular.yaml"
    circular.write_text(text)
    with pytest.raises(ConfigError, match=r"(summarize\.generation|cache\.ladder).* contains itself"):
        load_config(circular)


def test_a_circular_alias_in_set_is_refused():
    with pytest.raises(ConfigError, match=r"summarize\.generation.* contains itself"):
        load_config(None, ["summarize.generation=&g {again: *g}"])


def _answer_room_manifest(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "m.jsonl", [
        {"id": "fits", "text": "A short memo.", "max_new_tokens": 512},
        {"id": "greedy", "text": "A short memo.", "max_new_tokens": 513},
    ])


def test_a_row_max_new_tokens_over_half_the_context_is_rejected(tmp_path):
    config = load_config(TINY_CONFIG)  # context_tokens 1024
    tasks, rejections = read_manifest(_answer_room_manifest(tmp_path), config.input,
                                      context_tokens=config.summarize.context_tokens)
    assert [t.doc_id for t in tasks] == ["fits"]
    [rejected] = rejections
    assert rejected.doc_id == "greedy" and rejected.reason.startswith("m.jsonl line 2 (id 'greedy'): ")
    assert "'max_new_tokens' (513)" in rejected.reason and "512 or less" in rejected.reason


def test_submit_rejects_the_row_before_anything_starts(tmp_path):
    job = tmp_path / "job"
    result = CliRunner().invoke(app, ["submit", str(_answer_room_manifest(tmp_path)), "-c", str(TINY_CONFIG),
                                      "-j", str(job), "--strict"])
    assert result.exit_code == 2, result.output
    assert "m.jsonl line 2 (id 'greedy'): 'max_new_tokens' (513)" in " ".join(result.output.split())
    assert not job.exists()


def test_submit_refuses_a_bound_config_with_exit_2(tmp_path):
    job = tmp_path / "job"
    result = CliRunner().invoke(app, ["submit", str(_answer_room_manifest(tmp_path)), "-c", str(TINY_CONFIG),
                                      "-j", str(job), "--set", "batch.max_sequences=100000"])
    assert result.exit_code == 2 and "batch.max_sequences" in result.output, result.output
    assert not job.exists()


def test_local_paths_are_stored_absolute_and_names_are_not(tmp_path, monkeypatch):
    model = tmp_path / "models" / "mine"
    model.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    stored = {}
    for name in ["models/mine", "./models/mine", "models/../models/mine"]:
        config = load_config(TINY_CONFIG, [f"model.name={name}", "cache.offload_root=kv/../nvme"])
        stored[name] = config.model_dump(mode="json")  # what submit writes into job.json
        assert stored[name]["model"]["name"] == str(model)
        assert stored[name]["cache"]["offload_root"] == str(tmp_path / "nvme")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # resume: job.json read back from another working directory
    again = config_from_dict(json.loads(json.dumps(stored["models/mine"])))
    assert again.model.name == str(model) and again.cache.offload_root == str(tmp_path / "nvme")
    for name in ["builtin:tiny-random", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"]:
        assert load_config(TINY_CONFIG, [f"model.name={name}"]).model.name == name


def test_home_relative_offload_root_is_expanded():
    config = load_config(TINY_CONFIG, ["cache.offload_root=~/kv"])
    assert config.cache.offload_root == os.path.join(os.path.expanduser("~"), "kv")


def _at_most_4_gib() -> None:
    """A child's address space capped, so a config read without bound fails it instead of the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("kind", ["/dev/urandom", "/dev/zero", "fifo", "folder", "too large"])
def test_a_config_that_is_no_small_regular_file_is_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    """`-c /dev/urandom` was read until the OOM killer ended it, a FIFO blocked forever (issue 47, row 5):
    a config is a regular file of at most MAX_CONFIG_BYTES, checked on the open file before reading."""
    config = Path(kind) if kind.startswith("/dev/") else tmp_path / "config.yaml"
    if kind == "fifo":
        os.mkfifo(config)  # no writer: opening it to read blocks until one comes
    elif kind == "folder":
        config.mkdir()
    elif kind == "too large":
        config.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    proc = subprocess.run([sys.executable, "-m", "runner", "config", "-c", str(config)], capture_output=True,
                          text=True, timeout=60, cwd=REPO, preexec_fn=_at_most_4_gib)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and f"config file {config}" in proc.stderr, proc.stderr[-2000:]
    assert ("larger than" if kind == "too large" else "not a regular file") in proc.stderr


def test_a_config_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    config = tmp_path / "padded.yaml"
    body = "summarize:\n  max_new_tokens: 64\n"
    config.write_text(body + "#" * (MAX_CONFIG_BYTES - len(body) - 1) + "\n")
    assert config.stat().st_size == MAX_CONFIG_BYTES
    assert load_config(config).summarize.max_new_tokens == 64
