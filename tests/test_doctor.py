"""`kvbatch doctor` through the real CLI: ready on this machine, exit 1 when the offload root cannot be written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli import kvbatch, refusal
from tests.helpers.system import mounted_tmpfs


def config_with_offload_root(tmp_path: Path, root: Path) -> Path:
    path = tmp_path / "doctor.yaml"
    path.write_text(f"cache:\n  offload_root: {root}\n", encoding="utf-8")
    return path


def test_doctor_passes_on_this_machine_and_leaves_nothing_behind(tmp_path):
    root = tmp_path / "not-yet" / "offload"
    proc = kvbatch("doctor", "-c", str(config_with_offload_root(tmp_path, root)), check=0)
    out = proc.stdout
    assert "torch 2." in out and "verdict: ready" in out
    assert f"offload root {root} is writable" in out
    assert "GiB free" in out and "MB/s" in out and "host RAM" in out
    assert not (tmp_path / "not-yet").exists()  # the folders it made to measure are gone


def test_doctor_fails_when_the_offload_root_is_under_a_file(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    root = blocker / "offload"
    proc = kvbatch("doctor", "-c", str(config_with_offload_root(tmp_path, root)), check=1)
    assert f"offload root {root} is not writable" in proc.stdout
    assert "problem(s)" in proc.stdout and "cache.offload_root" in proc.stdout


@pytest.fixture
def read_only_mount(tmp_path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as mount_point:
        yield mount_point


@pytest.mark.parametrize("below", ["", "offload"])
def test_doctor_fails_on_a_read_only_filesystem(read_only_mount, tmp_path, below):
    root = read_only_mount / below if below else read_only_mount
    proc = kvbatch("doctor", "-c", str(config_with_offload_root(tmp_path, root)), check=1)
    assert "is not writable: Read-only file system" in proc.stdout


def test_doctor_reports_a_bad_config_key_as_usage_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  offload_rot: /tmp/x\n")
    proc = refusal("doctor", "-c", str(bad))
    assert "offload_rot" in proc.stderr and "Traceback" not in proc.stderr
